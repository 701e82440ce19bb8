"""The sample preference set (`python -m data_prep sample-preferences`): generated offline, deterministic for a seed.

Two kinds of pairs (docs/preferences.md#the-sample-set):

  addition   the RL demo's problems in its own chat format (data_prep/rl_tasks.py: user "312+7", thinking off):
             chosen = the sum, rejected = a wrong sum (off by 1-3, or one digit changed). The problems that
             rl_tasks holds out for its default split (seed 0) are never used, so its held-out accuracy stays a
             measure of unseen problems after DPO on these pairs.
  chat       sample_chats' arithmetic, string and code questions (thinking on or off): chosen = the short answer
             that ends its turn, rejected = the same answer rambling (repeated to several times the length) or
             breaking the format (its reasoning leaked into the answer behind an unclosed <think>, or the reply
             running on into a made-up next user turn).
"""

from __future__ import annotations

import json
import random
from typing import Any

from data_prep import rl_tasks, sample_chats

KINDS = ("addition", "chat")
Line = dict[str, Any]
_RL_DEFAULTS = {"seed": 0, "heldout": 500, "sft": 1000, "max_a": 1000}  # rl_tasks.write's defaults


def rl_heldout_problems() -> set[tuple[int, int]]:
    """The (a, b) problems `python -m data_prep.rl_tasks` holds out with its defaults."""
    d = _RL_DEFAULTS
    return set(rl_tasks.split(d["seed"], d["heldout"], d["sft"], d["max_a"])[2])


def wrong_sum(rng: random.Random, right: int) -> int:
    """A plausible wrong answer: off by 1-3 (never negative), or one digit of the right answer changed."""
    while True:
        digits = list(str(right))
        if rng.random() < 0.5:
            wrong = right + rng.choice((-3, -2, -1, 1, 2, 3))
        else:
            k = rng.randrange(len(digits))
            digits[k] = rng.choice([d for d in "0123456789" if d != digits[k] and (k or d != "0" or len(digits) == 1)])
            wrong = int("".join(digits))
        if wrong >= 0 and wrong != right:
            return wrong


def addition_pairs(rng: random.Random, count: int) -> list[Line]:
    heldout = rl_heldout_problems()
    pool = [p for p in rl_tasks.problems(_RL_DEFAULTS["max_a"]) if p not in heldout]
    chosen = rng.sample(pool, min(count, len(pool)))
    chosen += [rng.choice(pool) for _ in range(count - len(chosen))]
    out = []
    for a, b in chosen:
        conv = rl_tasks.chat(a, b)  # the SFT chats' exact prompt and answer
        out.append({"messages": conv["messages"][:1], "chosen": conv["messages"][1],
                    "rejected": {"role": "assistant", "content": str(wrong_sum(rng, a + b))},
                    "enable_thinking": conv["enable_thinking"]})
    return out


def _ramble(rng: random.Random, answer: str) -> str:
    fillers = ("To repeat:", "Again,", "In other words:", "Once more:", "As I said,")
    parts = [answer] + [f"{rng.choice(fillers)} {answer}" for _ in range(rng.randint(4, 8))]
    return "\n".join(parts) + "\nLet me know if you want me to say it again."


def chat_pairs(rng: random.Random, count: int) -> list[Line]:
    out = []
    for _ in range(count):
        question, answer, reasoning = rng.choice(sample_chats.TASKS)(rng)
        thinking = rng.random() < 0.5
        chosen: dict[str, Any] = {"role": "assistant", "content": answer}
        if thinking:
            chosen["reasoning_content"] = reasoning
        how = rng.choice(("ramble", "ramble", "leaked_thinking", "runs_on"))
        if how == "ramble":
            rejected = {**chosen, "content": _ramble(rng, answer)}
        elif how == "leaked_thinking":  # no reasoning_content: it sits in the answer, its <think> never closed
            rejected = {"role": "assistant", "content": f"<think>{reasoning}\n{answer}"}
        else:  # does not stop at the end of its turn: it writes the user's next turn too
            follow_up, _, _ = rng.choice(sample_chats.TASKS)(rng)
            rejected = {**chosen, "content": f"{answer}<|user|>\n{follow_up}"}
        line: Line = {"messages": [{"role": "user", "content": question}], "chosen": chosen, "rejected": rejected}
        if not thinking:
            line["enable_thinking"] = False
        out.append(line)
    return out


def parse_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"--kinds {text!r}: a comma-separated list of {', '.join(KINDS)}")
    return tuple(dict.fromkeys(kinds))


def pairs(count: int = 400, kinds: tuple[str, ...] = KINDS, seed: int = 0) -> list[Line]:
    """`count` pairs, split evenly between `kinds` (the first kinds get the remainder), interleaved."""
    if count < 1:
        raise ValueError(f"--pairs {count}: must be >= 1")
    rng = random.Random(seed)
    makers = {"addition": addition_pairs, "chat": chat_pairs}
    per_kind = [makers[k](rng, count // len(kinds) + (i < count % len(kinds))) for i, k in enumerate(kinds)]
    return [lines[i] for i in range(max(map(len, per_kind))) for lines in per_kind if i < len(lines)]


def jsonl(lines: list[Line]) -> str:
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)

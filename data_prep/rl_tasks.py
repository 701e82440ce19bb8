"""The RL demo's verifiable task, generated offline: adding a one-digit number to a number below `max_a` (1000).

    python -m data_prep.rl_tasks --out data/rl_addition
    python -m data_prep sft --input data/rl_addition/sft_chats.jsonl --tokenizer data/rl_addition/tokenizer.json \
        --out data/rl_addition/sft

writes into --out:
  tokenizer.json          byte-level with GLM's chat tokens and no merges (digits are one token each)
  sft_chats.jsonl         "312+7" -> "319" conversations (thinking off) that teach the format and some of the skill
  prompts_train.jsonl     {"prompt": "312+7", "answer": "319", "difficulty": 0 | 1} for GRPO (1 = a carry)
  prompts_heldout.jsonl   problems in neither file above: the held-out exact-match accuracy
The three sets are disjoint and the split is deterministic for a seed (docs/rl.md#the-cpu-demo). With the
defaults, 10,000 problems: 500 held out, 1,000 SFT chats, 8,500 RL prompts (a pool the RL run does not exhaust, so
it cannot memorise its prompts' answers). `make rlhf` holds out 2,000 (`--heldout 2000 --out data/rlhf_addition`:
7,000 RL prompts): the same SFT chats, so the same SFT model starts it, with half the standard error.
"""

from __future__ import annotations

import argparse
import json
import os
import random

from data_prep import tokenizer
from glm46_jax import atomic, cli
from glm46_jax.errors import InputError


def problems(max_a: int = 1000) -> list[tuple[int, int]]:
    return [(a, b) for a in range(max_a) for b in range(10)]


def item(a: int, b: int) -> dict[str, object]:
    return {"prompt": f"{a}+{b}", "answer": str(a + b), "difficulty": int(a % 10 + b >= 10)}


def chat(a: int, b: int) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)}],
            "enable_thinking": False}


# Held-out problems beyond these come from the end of the shuffle, so the SFT chats that follow them do not move.
_HELDOUT_FIRST = 500


def split(seed: int, heldout: int, sft: int, max_a: int = 1000) -> tuple[list, list, list]:
    """(sft, rl train, heldout) problem lists: disjoint, shuffled with `seed`. The held-out set is the shuffle's
    first 500 problems (all of them when fewer) and its last `heldout` - 500, the SFT set the `sft` after the first
    ones: one SFT model serves every held-out size (make rl's 500 and make rlhf's 2,000)."""
    all_problems = problems(max_a)
    random.Random(seed).shuffle(all_problems)
    first = min(heldout, _HELDOUT_FIRST)
    end = len(all_problems) - (heldout - first)
    if end < first + sft:
        raise InputError(f"--heldout {heldout} and --sft {sft} need more than the {len(all_problems)} problems of "
                         f"--max-a {max_a}")
    return (all_problems[first:first + sft], all_problems[first + sft:end],
            all_problems[:first] + all_problems[end:])


def _jsonl(rows: list[dict[str, object]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def write(out: str, seed: int = 0, heldout: int = 500, sft: int = 1000, max_a: int = 1000) -> dict[str, int]:
    sft_set, train_set, heldout_set = split(seed, heldout, sft, max_a)
    os.makedirs(out, exist_ok=True)
    texts = [f"{a}+{b}={a + b}" for a, b in problems(max_a)]
    # The smallest vocabulary: the special and chat tokens and the 256 bytes, no merges.
    info = tokenizer.trained(texts, len(tokenizer.ADDED_TOKENS) + 256)
    atomic.write_text(os.path.join(out, "tokenizer.json"), info.json)
    atomic.write_text(os.path.join(out, "sft_chats.jsonl"), _jsonl([chat(a, b) for a, b in sft_set]))
    atomic.write_text(os.path.join(out, "prompts_train.jsonl"), _jsonl([item(a, b) for a, b in train_set]))
    atomic.write_text(os.path.join(out, "prompts_heldout.jsonl"), _jsonl([item(a, b) for a, b in heldout_set]))
    return {"sft": len(sft_set), "train": len(train_set), "heldout": len(heldout_set)}


def main(argv: list[str] | None = None) -> int:
    p = cli.ArgumentParser(prog="python -m data_prep.rl_tasks", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/rl_addition")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout", type=int, default=500, help="held-out problems (make rlhf: 2000)")
    p.add_argument("--sft", type=int, default=1000, help="problems in the SFT chats (the rest are RL prompts)")
    p.add_argument("--max-a", type=int, default=1000, help="the first operand is below this (the second below 10)")
    args = p.parse_args(argv)
    counts = write(args.out, args.seed, args.heldout, args.sft, args.max_a)
    print(f"{counts['sft']} SFT chats, {counts['train']} RL prompts, {counts['heldout']} held-out -> {args.out}")
    return 0


if __name__ == "__main__":
    cli.main_guard(main)

"""The agentic RL demo's task, generated offline: a 4-digit number times a 2-digit one, which a tiny model cannot
compute but can answer with the calculator tool by copying digits (docs/rl.md#agentic-rl).

    python -m data_prep.agent_tasks --out data/agent_calc
    python -m data_prep sft --input data/agent_calc/sft_chats.jsonl --tokenizer data/agent_calc/tokenizer.json \
        --out data/agent_calc/sft

writes into --out:
  tokenizer.json          byte-level with GLM's chat tokens and no merges (digits are one token each)
  sft_chats.jsonl         tool-use traces (thinking off): user "4821*73", an assistant turn calling `calculate` with
                          {"expression": "4821*73"}, the tool turn with what the "calculator" environment answers,
                          then the assistant's "351933". No system prompt and no tool schemas: SFT teaches the tool,
                          which keeps the rows short for a CPU model
  prompts_train.jsonl     {"prompt": "4821*73", "answer": "351933"} for agentic RL
  prompts_heldout.jsonl   problems in neither file above: the held-out exact-match accuracy
The problems are the 9,000 * 90 = 810,000 pairs (a in [1000, 9999], b in [10, 99]); the three sets are drawn from
them without replacement, so they are disjoint, and deterministic for a seed. With the defaults: 400 SFT traces,
5,000 RL prompts, 500 held out.
"""

from __future__ import annotations

import argparse
import json
import os
import random

from data_prep import tokenizer
from glm46_jax import atomic
from glm46_jax.recipes.rl import environments

A_RANGE = range(1000, 10_000)  # the first operand: 4 digits
B_RANGE = range(10, 100)  # the second: 2 digits
PROBLEMS = len(A_RANGE) * len(B_RANGE)  # 810,000
# The built-in "calculator" environment's one tool and its argument (environments.resolve).
TOOL, ARGUMENT = "calculate", "expression"
_CALCULATOR = environments.resolve("calculator")


def problem(index: int) -> tuple[int, int]:
    """The problem numbered `index` in [0, PROBLEMS): (a, b), b varying fastest."""
    i, j = divmod(index, len(B_RANGE))
    return A_RANGE[i], B_RANGE[j]


def item(a: int, b: int) -> dict[str, str]:
    return {"prompt": f"{a}*{b}", "answer": str(a * b)}


def tool_answer(expression: str) -> str:
    """What the calculator environment shows the model for a call of `calculate` on `expression`."""
    call = environments.ToolCall(TOOL, {ARGUMENT: expression})
    return _CALCULATOR.call(call, {"prompt": expression})


def trace(a: int, b: int) -> dict[str, object]:
    """One SFT conversation: the question, the tool call, the environment's answer, and the final answer: that
    answer copied (the calculator is exact: it is item(a, b)["answer"], checked here)."""
    expression, answer = f"{a}*{b}", str(a * b)
    result = tool_answer(expression)
    if result != answer:
        raise AssertionError(f"the calculator environment answers {result!r} for {expression}, not {answer}")
    call = {"type": "function", "function": {"name": TOOL, "arguments": {ARGUMENT: expression}}}
    return {"messages": [{"role": "user", "content": expression},
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "content": result},
                         {"role": "assistant", "content": answer}],
            "enable_thinking": False}


def split(seed: int, heldout: int, sft: int, train: int) -> tuple[list, list, list]:
    """(sft, rl train, heldout) problem lists: disjoint, drawn with `seed` from the PROBLEMS problems."""
    if min(heldout, sft, train) < 0 or heldout + sft + train > PROBLEMS:
        raise ValueError(f"--heldout {heldout} --sft {sft} --train {train}: each must be >= 0 and together at most "
                         f"{PROBLEMS:,} (the number of problems)")
    drawn = [problem(i) for i in random.Random(seed).sample(range(PROBLEMS), heldout + sft + train)]
    return drawn[heldout:heldout + sft], drawn[heldout + sft:], drawn[:heldout]


def _jsonl(rows: list[dict[str, object]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def write(out: str, seed: int = 0, heldout: int = 500, sft: int = 400, train: int = 5000) -> dict[str, int]:
    sft_set, train_set, heldout_set = split(seed, heldout, sft, train)
    os.makedirs(out, exist_ok=True)
    # The smallest vocabulary: the special and chat tokens and the 256 bytes, no merges (so the texts it sees do
    # not change it: the same file as data_prep.rl_tasks writes).
    info = tokenizer.trained([f"{a}*{b}={a * b}" for a, b in sft_set], len(tokenizer.ADDED_TOKENS) + 256)
    atomic.write_text(os.path.join(out, "tokenizer.json"), info.json)
    atomic.write_text(os.path.join(out, "sft_chats.jsonl"), _jsonl([trace(a, b) for a, b in sft_set]))
    atomic.write_text(os.path.join(out, "prompts_train.jsonl"), _jsonl([item(a, b) for a, b in train_set]))
    atomic.write_text(os.path.join(out, "prompts_heldout.jsonl"), _jsonl([item(a, b) for a, b in heldout_set]))
    return {"sft": len(sft_set), "train": len(train_set), "heldout": len(heldout_set)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data_prep.agent_tasks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/agent_calc")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft", type=int, default=400, help="tool-use traces in sft_chats.jsonl")
    p.add_argument("--train", type=int, default=5000, help="RL prompts")
    p.add_argument("--heldout", type=int, default=500, help="held-out problems")
    args = p.parse_args(argv)
    try:
        counts = write(args.out, args.seed, args.heldout, args.sft, args.train)
    except ValueError as e:
        p.error(str(e))
    print(f"{counts['sft']} SFT traces, {counts['train']} RL prompts, {counts['heldout']} held-out -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

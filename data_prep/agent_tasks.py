"""The agentic RL demo's tasks, generated offline (docs/rl.md#the-tool-only-task). `calc` (the default): a 4-digit
number times a 2-digit one, which a tiny model cannot compute but can answer with the calculator tool by copying
digits. `lookup`: a document store of parts and their box sizes, and questions only the store answers (the lookup
environment's search and open tools).

    python -m data_prep.agent_tasks --out data/agent_calc
    python -m data_prep.agent_tasks --task lookup --out data/agent_lookup
    python -m data_prep sft --input data/agent_calc/sft_chats.jsonl --tokenizer data/agent_calc/tokenizer.json \
        --out data/agent_calc/sft

writes into --out:
  tokenizer.json          byte-level with GLM's chat tokens and no merges (digits are one token each), or a copy of
                          --tokenizer (e.g. make train's, to fine-tune that model)
  sft_chats.jsonl         tool-use traces (thinking off): user "4821*73", an assistant turn calling `calculate` with
                          {"expression": "4821*73"}, the tool turn with what the "calculator" environment answers,
                          then the assistant's "351933". No system prompt and no tool schemas: SFT teaches the tool,
                          which keeps the rows short for a CPU model
  prompts_train.jsonl     {"prompt": "4821*73", "answer": "351933"} for agentic RL
  prompts_heldout.jsonl   problems in neither file above: the held-out exact-match accuracy
The problems are the 9,000 * 90 = 810,000 pairs (a in [1000, 9999], b in [10, 99]); the three sets are drawn from
them without replacement, so they are disjoint, and deterministic for a seed. With the defaults: 400 SFT traces,
5,000 RL prompts, 500 held out.

`lookup` writes documents.jsonl too: one {"id": "part-4821", "title": "Part 4821", "text": "Part 4821 ships in
boxes of 37."} per part 1000..9999, the box sizes drawn with the seed (so no model knows them); questions "box size
of part 4821?" with their answers; traces that search, open the right document and answer (the tools' replies are
the lookup environment's own over that store). Run it with --config.rl.environment=lookup
--config.rl.environment_store=<out>/documents.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import random

from data_prep import tokenizer
from glm46_jax import atomic, cli
from glm46_jax.errors import InputError
from glm46_jax.interop import chat
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


def tokenizer_text(tokenizer_json: str | None) -> str:
    """What <out>/tokenizer.json holds: a copy of `tokenizer_json` (it must have GLM's chat tokens), else the smallest
    vocabulary: the special and chat tokens and the 256 bytes, no merges (the same file data_prep.rl_tasks writes)."""
    if tokenizer_json is None:
        text = tokenizer.trained([], len(tokenizer.ADDED_TOKENS) + 256).json
    elif not os.path.isfile(tokenizer_json):
        raise ValueError(f"--tokenizer {tokenizer_json}: no such file")
    else:
        info = tokenizer.load(tokenizer_json)
        if not chat.has_chat_tokens(tokenizer.encoder(info)):
            raise ValueError(f"--tokenizer {tokenizer_json}: it has no GLM chat tokens; use data_prep's (make train's)")
        text = info.json
    return text


def write(out: str, seed: int = 0, heldout: int = 500, sft: int = 400, train: int = 5000,
          tokenizer_json: str | None = None) -> dict[str, int]:
    sft_set, train_set, heldout_set = split(seed, heldout, sft, train)
    vocab = tokenizer_text(tokenizer_json)
    os.makedirs(out, exist_ok=True)
    atomic.write_text(os.path.join(out, "tokenizer.json"), vocab)
    atomic.write_text(os.path.join(out, "sft_chats.jsonl"), _jsonl([trace(a, b) for a, b in sft_set]))
    atomic.write_text(os.path.join(out, "prompts_train.jsonl"), _jsonl([item(a, b) for a, b in train_set]))
    atomic.write_text(os.path.join(out, "prompts_heldout.jsonl"), _jsonl([item(a, b) for a, b in heldout_set]))
    return {"sft": len(sft_set), "train": len(train_set), "heldout": len(heldout_set)}


# --- lookup ---------------------------------------------------------------------------------------------------

PARTS = range(1000, 10_000)


def documents(seed: int) -> list[dict[str, str]]:
    sizes = random.Random(f"{seed}-sizes")
    return [{"id": f"part-{n}", "title": f"Part {n}", "text": f"Part {n} ships in boxes of {sizes.randint(2, 99)}."}
            for n in PARTS]


def lookup_trace(env: environments.Environment, part: int, answer: str) -> dict[str, object]:
    """Search for the part, open its document, answer: each tool turn is what `env` (over the store) replies."""
    item = {"prompt": f"box size of part {part}?", "answer": answer}
    messages: list[dict[str, object]] = [{"role": "user", "content": item["prompt"]}]
    for name, arguments in (("search", {"query": f"part {part}"}), ("open", {"id": f"part-{part}"})):
        messages.append({"role": "assistant", "content": "",
                         "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]})
        messages.append({"role": "tool", "content": env.call(environments.ToolCall(name, arguments), item)})
    if f"boxes of {answer}." not in messages[-1]["content"]:
        raise AssertionError(f"the lookup environment's document for part {part} does not hold {answer}")
    messages.append({"role": "assistant", "content": answer})
    return {"messages": messages, "enable_thinking": False}


def write_lookup(out: str, seed: int = 0, heldout: int = 500, sft: int = 400, train: int = 5000,
                 tokenizer_json: str | None = None) -> dict[str, int]:
    if min(heldout, sft, train) < 0 or heldout + sft + train > len(PARTS):
        raise ValueError(f"--heldout {heldout} --sft {sft} --train {train}: each must be >= 0 and together at most "
                         f"{len(PARTS):,} (the number of parts)")
    docs, vocab = documents(seed), tokenizer_text(tokenizer_json)
    os.makedirs(out, exist_ok=True)
    store = os.path.join(out, "documents.jsonl")
    atomic.write_text(store, _jsonl(docs))
    env = environments.resolve("lookup", store=store)
    answers = {int(d["id"][5:]): d["text"].rsplit(" ", 1)[1].rstrip(".") for d in docs}
    drawn = random.Random(seed).sample(list(PARTS), heldout + sft + train)
    sft_set, train_set, heldout_set = drawn[heldout:heldout + sft], drawn[heldout + sft:], drawn[:heldout]
    atomic.write_text(os.path.join(out, "tokenizer.json"), vocab)
    atomic.write_text(os.path.join(out, "sft_chats.jsonl"), _jsonl([lookup_trace(env, n, answers[n]) for n in sft_set]))
    for name, parts in (("prompts_train.jsonl", train_set), ("prompts_heldout.jsonl", heldout_set)):
        atomic.write_text(os.path.join(out, name),
                          _jsonl([{"prompt": f"box size of part {n}?", "answer": answers[n]} for n in parts]))
    return {"sft": len(sft_set), "train": len(train_set), "heldout": len(heldout_set), "documents": len(docs)}


def main(argv: list[str] | None = None) -> int:
    p = cli.ArgumentParser(prog="python -m data_prep.agent_tasks", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=("calc", "lookup"), default="calc")
    p.add_argument("--out", default="", help="default data/agent_<task>")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft", type=int, default=400, help="tool-use traces in sft_chats.jsonl")
    p.add_argument("--train", type=int, default=5000, help="RL prompts")
    p.add_argument("--heldout", type=int, default=500, help="held-out problems")
    p.add_argument("--tokenizer", default=None, help="copy this tokenizer.json (e.g. make train's run's) instead of "
                                                     "writing the byte-level one")
    args = p.parse_args(argv)
    try:
        out = args.out or f"data/agent_{args.task}"
        counts = (write if args.task == "calc" else write_lookup)(out, args.seed, args.heldout, args.sft, args.train,
                                                                  args.tokenizer)
    except ValueError as e:
        raise InputError(str(e)) from e
    store = f", {counts['documents']:,} documents" if "documents" in counts else ""
    print(f"{counts['sft']} SFT traces, {counts['train']} RL prompts, {counts['heldout']} held-out{store} -> {out}")
    return 0


if __name__ == "__main__":
    cli.main_guard(main)

"""data_prep/agent_tasks.py: the agentic RL demo's multiplication task (no model, a few seconds).

The three sets are disjoint and seeded; every SFT trace is what the calculator environment answers and scores 1.0;
the traces go through `data_prep sft` whole, and the assistant mask trains the tool call and the final answer, not
the tool's response.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from tokenizers import Tokenizer

from data_prep import agent_tasks
from data_prep import cli as data_cli
from glm46_jax.interop import chat
from glm46_jax.recipes.rl import environments, rewards

PROMPT = re.compile(r"(\d{4})\*(\d{2})")
FILES = ("tokenizer.json", "sft_chats.jsonl", "prompts_train.jsonl", "prompts_heldout.jsonl")


def _rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _operands(prompt: str) -> tuple[int, int]:
    m = PROMPT.fullmatch(prompt)
    assert m, prompt
    return int(m.group(1)), int(m.group(2))


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("agent_calc"))
    assert agent_tasks.write(out) == {"sft": 400, "train": 5000, "heldout": 500}
    return out


def _problems(out: str) -> dict[str, list[tuple[int, int]]]:
    sft = [_operands(r["messages"][0]["content"]) for r in _rows(os.path.join(out, "sft_chats.jsonl"))]
    return {"sft": sft, **{split: [_operands(r["prompt"]) for r in _rows(os.path.join(out, f"prompts_{split}.jsonl"))]
                           for split in ("train", "heldout")}}


def _bytes(out: str) -> dict[str, bytes]:
    contents = {}
    for name in FILES:
        with open(os.path.join(out, name), "rb") as f:
            contents[name] = f.read()
    return contents


def test_the_sets_are_disjoint_in_range_and_deterministic_for_a_seed(task, tmp_path):
    problems = _problems(task)
    assert {k: len(v) for k, v in problems.items()} == {"sft": 400, "train": 5000, "heldout": 500}
    every = [p for ps in problems.values() for p in ps]
    assert len(set(every)) == len(every)  # disjoint, and no problem twice within a set
    assert all(1000 <= a <= 9999 and 10 <= b <= 99 for a, b in every)
    for split in ("train", "heldout"):
        for r in _rows(os.path.join(task, f"prompts_{split}.jsonl")):
            a, b = _operands(r["prompt"])
            assert r == {"prompt": f"{a}*{b}", "answer": str(a * b)}

    agent_tasks.write(str(tmp_path / "again"))
    assert _bytes(str(tmp_path / "again")) == _bytes(task)
    agent_tasks.write(str(tmp_path / "seed1"), seed=1)
    other = _problems(str(tmp_path / "seed1"))
    for split, ps in problems.items():
        assert other[split] != ps
        assert len(set(other[split]) & set(ps)) < len(ps) // 10  # a different draw, not a reshuffle
    # byte-level, no merges: digits are one token each
    tok = Tokenizer.from_file(os.path.join(task, "tokenizer.json"))
    assert len(tok.encode("4821*73=351933", add_special_tokens=False).ids) == 14


def test_sizes_are_checked_and_the_cli_writes_them(tmp_path, capsys):
    with pytest.raises(ValueError, match="810,000"):
        agent_tasks.split(0, heldout=agent_tasks.PROBLEMS, sft=1, train=0)
    out = str(tmp_path / "small")
    assert agent_tasks.main(["--out", out, "--seed", "3", "--sft", "5", "--train", "7", "--heldout", "2"]) == 0
    assert capsys.readouterr().out == f"5 SFT traces, 7 RL prompts, 2 held-out -> {out}\n"
    assert {k: len(v) for k, v in _problems(out).items()} == {"sft": 5, "train": 7, "heldout": 2}


def test_each_trace_is_the_calculator_environments_answer_and_scores_one(task):
    env = environments.resolve("calculator")
    for row in _rows(os.path.join(task, "sft_chats.jsonl")):
        assert set(row) == {"messages", "enable_thinking"} and row["enable_thinking"] is False  # no tools, no system
        messages = chat.parse_messages(row["messages"], "trace")
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
        expression = messages[0]["content"]
        a, b = _operands(expression)
        item = {"prompt": expression, "answer": str(a * b)}
        [call] = messages[1]["tool_calls"]
        assert call["function"] == {"name": "calculate", "arguments": {"expression": expression}}
        assert messages[2]["content"] == environments.calculate(expression) == str(a * b)
        # the call as the model would write it parses back, and the environment answers it with the tool turn
        rendered = chat.render(messages[:2], enable_thinking=False).split(chat.ASSISTANT)[-1]
        calls, error = environments.parse_tool_calls(rendered)
        assert error is None and environments.observations(env, calls, error, item) == [messages[2]["content"]]
        assert rewards.exact_answer(messages[3]["content"], item) == 1.0
        assert env.reward(messages[3]["content"], item) == 1.0


def test_the_traces_go_through_the_sft_pipeline_whole(task, tmp_path):
    out = str(tmp_path / "sft")
    assert data_cli.main(["sft", "--input", os.path.join(task, "sft_chats.jsonl"), "--tokenizer",
                          os.path.join(task, "tokenizer.json"), "--out", out, "--heldout-fraction", "0.05",
                          "--max-len", "96"]) == 0
    with open(os.path.join(out, "metadata.json"), encoding="utf-8") as f:
        meta = json.load(f)
    assert meta["conversations"]["valid"] == 400 and meta["conversations"]["malformed"] == 0
    assert meta["truncation"]["samples_dropped"] == 0 and meta["truncation"]["samples_truncated"] == 0
    assert sum(s["samples"] for s in meta["splits"].values()) == 400
    assert all(0 < s["samples"] for s in meta["splits"].values())
    for split in meta["splits"]:
        lengths = np.diff(np.load(os.path.join(out, split, "offsets.npy")))
        assert len(lengths) == meta["splits"][split]["samples"] and lengths.max() <= 96


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))


def test_the_mask_trains_the_call_and_the_answer_not_the_tool_response(task):
    tok = Tokenizer.from_file(os.path.join(task, "tokenizer.json"))

    def decode(ids: np.ndarray) -> str:
        return tok.decode(ids.tolist(), skip_special_tokens=False)

    for row in _rows(os.path.join(task, "sft_chats.jsonl")):
        expression, answer = row["messages"][0]["content"], row["messages"][2]["content"]
        enc = chat.encode(tok, row["messages"], enable_thinking=False, close_final_turn=True)
        assert len(enc.ids) <= 96
        call = (f"\n<think></think>\n<tool_call>calculate\n<arg_key>expression</arg_key>\n"
                f"<arg_value>{expression}</arg_value>\n</tool_call>{chat.OBSERVATION}")
        final = f"\n<think></think>\n{answer}{chat.USER}"
        runs = _runs(enc.assistant_mask)
        assert [decode(enc.ids[lo:hi]) for lo, hi in runs] == [call, final]
        assert int(enc.assistant_mask.sum()) == sum(len(tok.encode(t, add_special_tokens=False).ids)
                                                    for t in (call, final))
        response = f"\n<tool_response>\n{answer}\n</tool_response>{chat.ASSISTANT}"
        between = enc.ids[runs[0][1]:runs[1][0]]  # everything between the two trained runs: none of it trained
        assert decode(between) == response
        assert len(between) == len(tok.encode(response, add_special_tokens=False).ids)


# --- the lookup task ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lookup(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("agent_lookup"))
    assert agent_tasks.main(["--task", "lookup", "--out", out, "--sft", "40", "--train", "100", "--heldout", "20"]) == 0
    return out


def test_lookup_traces_are_the_lookup_environments_answers_over_the_written_store(lookup, tmp_path):
    """The store parses (one document per part); each trace searches, opens the part's document and answers what
    that document says (read back here with a regex), every tool turn being what the lookup environment over the
    written store replies to the call; the sets are disjoint; the traces go through `data_prep sft` whole."""
    store = os.path.join(lookup, "documents.jsonl")
    docs = environments.read_store(store)
    assert len(docs) == 9000
    env = environments.resolve("lookup", store=store)
    text = re.compile(r"Part (\d+) ships in boxes of (\d+)\.")
    sizes = {int(m.group(1)): m.group(2) for m in (text.fullmatch(d["text"]) for d in docs.values())}
    traces = _rows(os.path.join(lookup, "sft_chats.jsonl"))
    sets = [traces] + [_rows(os.path.join(lookup, f)) for f in ("prompts_train.jsonl", "prompts_heldout.jsonl")]
    prompts = [[t["messages"][0]["content"] for t in traces]] + [[it["prompt"] for it in s] for s in sets[1:]]
    assert [len(p) for p in prompts] == [40, 100, 20] and len({q for p in prompts for q in p}) == 160
    for items in sets[1:]:
        for it in items:
            assert it["answer"] == sizes[int(re.fullmatch(r"box size of part (\d+)\?", it["prompt"]).group(1))]
    for t in traces:
        msgs = chat.parse_messages(t["messages"], "trace")
        part = int(re.fullmatch(r"box size of part (\d+)\?", msgs[0]["content"]).group(1))
        calls = [m for m in msgs if m.get("tool_calls")]
        assert [c["tool_calls"][0]["function"]["name"] for c in calls] == ["search", "open"]
        for call, reply in zip(calls, [m for m in msgs if m["role"] == "tool"], strict=True):
            fn = call["tool_calls"][0]["function"]
            assert reply["content"] == env.call(environments.ToolCall(fn["name"], fn["arguments"]), {})
        assert msgs[-1]["content"] == sizes[part]
        assert rewards.exact_answer(msgs[-1]["content"], {"answer": sizes[part]}) == 1.0
    out = str(tmp_path / "sft")
    assert data_cli.main(["sft", "--input", os.path.join(lookup, "sft_chats.jsonl"), "--tokenizer",
                          os.path.join(lookup, "tokenizer.json"), "--out", out, "--heldout-fraction", "0.1",
                          "--max-len", "256"]) == 0
    with open(os.path.join(out, "metadata.json"), encoding="utf-8") as f:
        meta = json.load(f)
    assert meta["conversations"]["valid"] == 40 and meta["truncation"]["samples_dropped"] == 0


def test_a_given_tokenizer_is_copied_and_bad_input_is_one_line(task, tmp_path):
    """--tokenizer copies that file byte for byte (make train's, to fine-tune that model); a missing tokenizer, sizes
    past the problems and an unknown flag are one error line each, exit 2, nothing written."""
    import subprocess
    import sys

    given = os.path.join(task, "tokenizer.json")
    out = str(tmp_path / "copied")
    assert agent_tasks.main(["--out", out, "--sft", "2", "--train", "2", "--heldout", "2", "--tokenizer", given]) == 0
    with open(given, "rb") as a, open(os.path.join(out, "tokenizer.json"), "rb") as b:
        assert a.read() == b.read()
    root = os.path.join(os.path.dirname(__file__), os.pardir)
    for flags, says in ((["--tokenizer", str(tmp_path / "none.json")], "none.json: no such file"),
                        (["--heldout", "900000"], "together at most 810,000"),
                        (["--bogus"], "unrecognized arguments: --bogus")):
        done = subprocess.run([sys.executable, "-m", "data_prep.agent_tasks", "--out", str(tmp_path / "bad"), *flags],
                              cwd=root, capture_output=True, text=True, check=False)
        err = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(err) == 1 and says in err[0], (done.returncode, done.stderr)
    assert not os.path.exists(tmp_path / "bad")

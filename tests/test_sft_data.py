"""SFT data (data_prep/sft.py, glm46_jax/data/sft_loader.py): the samples and loss masks of rendered conversations
against hand-written text and masked strings, token ids against transformers' apply_chat_template fixtures,
malformed lines skipped with file:line, truncation, packed rows against the samples read back from disk, and
loader resume."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import FIXTURES
from tokenizers import Tokenizer

from data_prep import cli, sample_chats, sft
from data_prep.tokenizer import load as load_tokenizer
from glm46_jax.errors import InputError
from glm46_jax.data import iterator_state, loader, sft_loader

CHAT = os.path.join(FIXTURES, "chat")
TOKENIZER = os.path.join(CHAT, "hf_tokenizer", "tokenizer.json")
with open(os.path.join(CHAT, "apply_chat_template.json"), encoding="utf-8") as _f:
    EXAMPLES = {e["name"]: e for e in json.load(_f)["examples"]}
USER_ID, OBSERVATION_ID = 5, 7  # in the fixture tokenizer, read off its tokenizer.json by hand
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(TOKENIZER)


def _samples(tok, conv, max_len=4096, truncate="rounds"):
    chat_ = sft.parse_line(json.dumps(conv), "t.jsonl:1")
    return sft.conversation_samples(tok, chat_, max_len, truncate)


def _text(tok, s):
    return tok.decode(s.ids.tolist(), skip_special_tokens=False)


def _runs(tok, s):
    """The decoded text of each maximal run of masked tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], s.assistant_mask.astype(np.int8), [0]])))
    return [tok.decode(s.ids[lo:hi].tolist(), skip_special_tokens=False) for lo, hi in zip(edges[::2], edges[1::2])]


def _u(text):
    return {"role": "user", "content": text}


def _a(text, reasoning=None):
    return {"role": "assistant", "content": text, **({"reasoning_content": reasoning} if reasoning else {})}


# --- samples and masks, by hand -----------------------------------------------------------------------

def test_multi_turn_without_reasoning_is_one_sample_training_every_round(tok):
    samples, reports = _samples(tok, {"messages": [{"role": "system", "content": "Be brief."}, _u("2+2?"),
                                                   _a("4"), _u("3+3?"), _a("6")]})
    assert reports == [] and len(samples) == 1
    assert _text(tok, samples[0]) == ("[gMASK]<sop><|system|>\nBe brief.<|user|>\n2+2?<|assistant|>\n<think></think>"
                                      "\n4<|user|>\n3+3?<|assistant|>\n<think></think>\n6<|user|>")
    assert _runs(tok, samples[0]) == ["\n<think></think>\n4<|user|>", "\n<think></think>\n6<|user|>"]


def test_reasoning_rounds_get_their_own_sample_rendered_as_the_last_round(tok):
    conv = {"messages": [_u("a?"), _a("A", "think a"), _u("b?"), _a("B"), _u("c?"), _a("C"), _u("d?"),
                         _a("D", "think d")]}
    samples, _ = _samples(tok, conv)
    assert [_text(tok, s) for s in samples] == [
        "[gMASK]<sop><|user|>\na?<|assistant|>\n<think>think a</think>\nA<|user|>",
        ("[gMASK]<sop><|user|>\na?<|assistant|>\n<think></think>\nA<|user|>\nb?<|assistant|>\n<think></think>\nB"
        "<|user|>\nc?<|assistant|>\n<think></think>\nC<|user|>\nd?<|assistant|>\n<think>think d</think>\nD<|user|>")]
    assert _runs(tok, samples[0]) == ["\n<think>think a</think>\nA<|user|>"]
    # Round 0 was trained with its thinking: here it is context only; rounds 1-3 render as they always do.
    assert _runs(tok, samples[1]) == ["\n<think></think>\nB<|user|>", "\n<think></think>\nC<|user|>",
                                      "\n<think>think d</think>\nD<|user|>"]


def test_thinking_off(tok):
    samples, _ = _samples(tok, {"messages": [_u("Hi"), _a("Hello."), _u("Bye"), _a("Bye.")],
                                "enable_thinking": False})
    assert [_text(tok, s) for s in samples] == [
        ("[gMASK]<sop><|user|>\nHi/nothink<|assistant|>\n<think></think>\nHello.<|user|>\nBye/nothink<|assistant|>"
        "\n<think></think>\nBye.<|user|>")]
    assert _runs(tok, samples[0]) == ["\n<think></think>\nHello.<|user|>", "\n<think></think>\nBye.<|user|>"]


def test_tool_call_and_observation(tok):
    call = {"type": "function", "function": {"name": "calculate", "arguments": '{"expression": "6*7"}'}}
    conv = {"tools": [sample_chats.CALCULATOR], "messages": [
        _u("6*7?"), {"role": "assistant", "content": "", "reasoning_content": "use it", "tool_calls": [call]},
        {"role": "observation", "content": "42"}, _a("42.", "it said 42")]}
    samples, _ = _samples(tok, conv)
    assert len(samples) == 1
    text = _text(tok, samples[0])
    assert text.startswith("[gMASK]<sop><|system|>\n# Tools\n") and '"name": "calculate"' in text
    assert text.endswith("<|user|>\n6*7?<|assistant|>\n<think>use it</think>\n<tool_call>calculate\n"
                         "<arg_key>expression</arg_key>\n<arg_value>6*7</arg_value>\n</tool_call><|observation|>\n"
                         "<tool_response>\n42\n</tool_response><|assistant|>\n<think>it said 42</think>\n42.<|user|>")
    assert _runs(tok, samples[0]) == [
        ("\n<think>use it</think>\n<tool_call>calculate\n<arg_key>expression</arg_key>\n<arg_value>6*7</arg_value>\n"
        "</tool_call><|observation|>"), "\n<think>it said 42</think>\n42.<|user|>"]
    # Ending on the tool call: the sample closes with <|observation|>, trained.
    samples, _ = _samples(tok, {"tools": conv["tools"], "messages": conv["messages"][:2]})
    assert samples[0].ids[-1] == OBSERVATION_ID and samples[0].assistant_mask[-1]


def test_trailing_user_turns_are_dropped(tok):
    samples, _ = _samples(tok, {"messages": [_u("a"), _a("A"), _u("b")]})
    assert [_text(tok, s) for s in samples] == ["[gMASK]<sop><|user|>\na<|assistant|>\n<think></think>\nA<|user|>"]


@pytest.mark.parametrize("name", ["single_turn_answered", "multi_turn_thinking", "two_assistant_turns_after_last_user",
                                  "thinking_off_answered", "content_parts", "tool_call_and_response",
                                  "unicode_and_whitespace"])
def test_last_sample_ids_are_transformers_ids_plus_the_end_token(tok, name):
    e = EXAMPLES[name]
    samples, _ = _samples(tok, {"messages": e["messages"], "tools": e["tools"],
                                "enable_thinking": e["enable_thinking"]})
    assert samples[-1].ids.tolist() == e["ids"] + [USER_ID]


def test_multi_turn_thinking_fixture_gets_a_sample_for_its_first_round(tok):
    samples, _ = _samples(tok, {"messages": EXAMPLES["multi_turn_thinking"]["messages"]})
    assert len(samples) == 2
    assert _text(tok, samples[0]) == ("[gMASK]<sop><|system|>\nYou are a helpful assistant.<|user|>\nWhat is 17 * 3?"
                                      "<|assistant|>\n<think>17 * 3 = 51.</think>\n51<|user|>")
    assert _runs(tok, samples[0]) == ["\n<think>17 * 3 = 51.</think>\n51<|user|>"]
    assert _runs(tok, samples[1]) == ["\n<think>51 + 4 = 55.</think>\n55.<|user|>"]


# --- truncation ----------------------------------------------------------------------------------------

def _four_rounds(reasoning: bool):
    msgs = [{"role": "system", "content": "S"}]
    for k in range(4):
        msgs += [_u(f"q{k}"), _a(f"a{k}", f"r{k}" if reasoning else None)]
    return {"messages": msgs}


def test_truncation_drops_earliest_whole_rounds_keeping_system(tok):
    conv = _four_rounds(reasoning=False)
    full, _ = _samples(tok, conv)
    last_two = ("[gMASK]<sop><|system|>\nS<|user|>\nq2<|assistant|>\n<think></think>\na2<|user|>\nq3<|assistant|>"
                "\n<think></think>\na3<|user|>")
    n = len(tok.encode(last_two, add_special_tokens=False).ids)
    assert n < len(full[0].ids)
    samples, reports = _samples(tok, conv, max_len=n)
    assert [_text(tok, s) for s in samples] == [last_two]
    assert _runs(tok, samples[0]) == ["\n<think></think>\na2<|user|>", "\n<think></think>\na3<|user|>"]
    assert [r["kind"] for r in reports] == ["truncated"] and samples[0].rounds_dropped == 2
    assert "t.jsonl:1: cut the first 2 round(s) (2 of them trained)" in reports[0]["message"]

    dropped, reports = _samples(tok, conv, max_len=n, truncate="drop")
    assert dropped == [] and [r["kind"] for r in reports] == ["dropped_too_long"]
    too_small, reports = _samples(tok, conv, max_len=10)
    assert too_small == [] and "even its last round alone" in reports[0]["message"]


def test_truncating_a_reasoning_round_cuts_only_context(tok):
    samples, reports = _samples(tok, _four_rounds(reasoning=True), max_len=30)
    assert [_runs(tok, s) for s in samples] == [[f"\n<think>r{k}</think>\na{k}<|user|>"] for k in range(4)]
    assert all(len(s.ids) <= 30 for s in samples)
    assert _text(tok, samples[3]).startswith("[gMASK]<sop><|system|>\nS<|user|>\nq")
    assert all("(0 of them trained)" in r["message"] for r in reports)


# --- the command ---------------------------------------------------------------------------------------

def _run(*args):
    return subprocess.run([sys.executable, "-m", "data_prep", *args], cwd=ROOT, capture_output=True, text=True,
                          check=False)


GOOD = [{"messages": [_u("a"), _a("A")]}, {"messages": [_u("b"), _a("B", "think")]}]


def test_malformed_lines_are_reported_with_file_and_line_and_skipped(tmp_path):
    lines = [json.dumps(GOOD[0]), "{not json", json.dumps({"messages": [_a("first")]}),
             json.dumps({"messages": [{"role": "bot", "content": "x"}, _a("y")]}), "",
             json.dumps({"messages": [{"role": "user"}, _a("x")]}), json.dumps({"messages": [_u("only")]}),
             json.dumps({"messages": [_u("x"), {"role": "tool", "content": "r"}, _a("y")]}), json.dumps(GOOD[1])]
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    r = _run("sft", "--input", str(src), "--tokenizer", TOKENIZER, "--out", str(out), "--heldout-fraction", "0")
    assert r.returncode == 0, r.stderr
    for line, why in [(2, "invalid JSON"), (3, "starts (after system messages) with a user message"),
                      (4, "has role 'bot'"), (6, "message 0 (user) has no content"), (7, "no assistant message"),
                      (8, "message 1 (tool) is a tool result that follows no tool call")]:
        assert f"{src}:{line}: " in r.stderr and why in r.stderr.split(f"{src}:{line}: ")[1].splitlines()[0]
    assert "skipped 6 malformed line(s) of 8" in r.stderr
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["conversations"] == {"lines": 8, "valid": 2, "malformed": 6, "by_kind": {
        "bad_message": 1, "bad_role_order": 2, "invalid_json": 1, "missing_content": 1, "no_assistant": 1}}
    assert meta["splits"]["train"]["samples"] == 2 and meta["splits"]["heldout"]["samples"] == 0


def test_all_bad_lines_are_one_error_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text("nope\n[1]\n")
    r = _run("sft", "--input", str(src), "--tokenizer", TOKENIZER, "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [(f"error: no valid conversation in {src} (2 non-blank line(s)); first: "
                                     f"{src}:1: invalid JSON (Expecting value at column 1)")]
    assert not (tmp_path / "o").exists()


def test_tokenizer_without_chat_tokens_is_an_error(tmp_path):
    from data_prep.tokenizer import trained
    plain = Tokenizer.from_str(trained(["abc def"] * 10, 300).json)
    spec = json.loads(plain.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in ("<|pad|>", "<|endoftext|>")]
    path = tmp_path / "tok.json"
    path.write_text(json.dumps(spec))
    chats = [sft.parse_line(json.dumps(GOOD[0]), "x:1")]
    with pytest.raises(InputError, match="lacks GLM's chat tokens"):
        sft.write_sft_dataset(str(tmp_path / "o"), load_tokenizer(str(path)), ["x"], chats, [], 1, sft.SFTOptions())


def test_split_is_by_content_and_arrays_hold_the_samples(tmp_path, tok):
    convs = sample_chats.conversations(60, seed=3)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(sample_chats.jsonl(convs))
    b.write_text(sample_chats.jsonl(convs[::-1]))  # same conversations, other order and file
    for src, out in [(a, "oa"), (b, "ob")]:
        assert cli.main(["sft", "--input", str(src), "--tokenizer", TOKENIZER, "--out", str(tmp_path / out),
                         "--heldout-fraction", "0.3"]) == 0
    info = load_tokenizer(TOKENIZER)
    for out, order in [("oa", convs), ("ob", convs[::-1])]:
        meta = json.loads((tmp_path / out / "metadata.json").read_text())
        for split in sft.SPLITS:
            expected = []
            for i, conv in enumerate(order):
                c = sft.parse_line(json.dumps(conv), f"x:{i}")
                if sft.shards.is_heldout(c.digest, 0.3) == (split == "heldout"):
                    expected += sft.conversation_samples(tok, c, 2048, "rounds")[0]
            arrays = {k: np.load(tmp_path / out / split / f"{k}.npy") for k in ("tokens", "assistant_mask", "offsets")}
            got = [(arrays["tokens"][lo:hi].tolist(), arrays["assistant_mask"][lo:hi].tolist())
                   for lo, hi in zip(arrays["offsets"][:-1], arrays["offsets"][1:])]
            assert got == [(s.ids.tolist(), s.assistant_mask.tolist()) for s in expected]
            assert meta["splits"][split]["samples"] == len(expected)
            assert meta["splits"][split]["assistant_tokens"] == sum(int(s.assistant_mask.sum()) for s in expected)
        assert meta["tokenizer"]["sha256"] == info.sha256
    heldout = [json.loads((tmp_path / o / "metadata.json").read_text())["splits"]["heldout"] for o in ("oa", "ob")]
    assert heldout[0] == heldout[1] and 0 < heldout[0]["conversations"] < 60


def test_sample_chats_are_deterministic_small_and_all_valid(tmp_path):
    out = tmp_path / "s"
    written = []
    for _ in range(2):
        assert cli.main(["sample-sft", "--out", str(out), "--tokenizer", TOKENIZER, "--max-len", "2048"]) == 0
        written.append((out / "_source" / "chats.jsonl").read_bytes())
    first = written[0]
    assert written[1] == first and len(first) < 300_000
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["conversations"]["valid"] == 400 and meta["conversations"]["malformed"] == 0
    assert meta["truncation"]["samples_truncated"] == meta["truncation"]["samples_dropped"] == 0
    convs = [json.loads(line) for line in first.decode().splitlines()]
    assert any(c.get("enable_thinking") is False for c in convs)
    assert any(c.get("tools") for c in convs) and any(m["role"] == "tool" for c in convs for m in c["messages"])
    assert any(c["messages"][0]["role"] == "system" for c in convs)
    assert any(sum(m["role"] == "user" for m in c["messages"]) > 1 for c in convs)
    assert any("reasoning_content" in m for c in convs for m in c["messages"])


# --- the loader ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sft"))
    assert cli.main(["sample-sft", "--out", out, "--tokenizer", TOKENIZER, "--conversations", "120",
                     "--max-len", "1024", "--heldout-fraction", "0.2"]) == 0
    return out


def _disk_samples(root, split):
    a = {k: np.load(os.path.join(root, split, f"{k}.npy")) for k in ("tokens", "assistant_mask", "offsets")}
    return [(a["tokens"][lo:hi], a["assistant_mask"][lo:hi]) for lo, hi in zip(a["offsets"][:-1], a["offsets"][1:])]


def _segments(batches):
    """Every packed segment as (its sample's tokens, the loss mask over the sample's targets tokens[1:]), checking
    segment ids and positions on the way. A sample always ends with its trained end token, so a segment whose last
    input's target is trained continues into that target (the row's last token, only a target)."""
    out = []
    for b in batches:
        assert set(b) == {"inputs", "targets", "segment_ids", "positions", "loss_mask"}
        assert all(v.dtype == np.int32 and v.shape == b["inputs"].shape for v in b.values())
        for r in range(len(b["inputs"])):
            seg = b["segment_ids"][r]
            real = seg[seg > 0]
            assert (seg[len(real):] == 0).all()  # padding only at the end of a row
            assert sorted(set(real.tolist())) == list(range(1, int(seg.max()) + 1)) and (np.diff(real) >= 0).all()
            assert not b["loss_mask"][r][seg == 0].any()
            for s in range(1, int(seg.max()) + 1):
                idx = np.flatnonzero(seg == s)
                assert b["positions"][r][idx].tolist() == list(range(len(idx)))
                assert (b["targets"][r][idx[:-1]] == b["inputs"][r][idx[1:]]).all()
                mask = b["loss_mask"][r][idx].tolist()
                tokens = b["inputs"][r][idx].tolist()
                if mask[-1]:
                    tokens.append(int(b["targets"][r][idx[-1]]))
                else:
                    mask = mask[:-1]  # the target after the sample's last token belongs to the next one: untrained
                out.append((tokens, mask))
    return out


@pytest.mark.parametrize("pack", ["best_fit", "first_fit"])
def test_one_epoch_trains_every_assistant_token_exactly_once(dataset, pack):
    cfg = sft_loader.SFTLoaderConfig(dataset, num_epochs=1, pack=pack, pack_bins=4, process_index=0, process_count=1)
    segments = _segments(sft_loader.sft_batches(cfg, seq_len=1024, global_batch=3))
    # Reference: each sample read from disk; its targets are tokens[1:], trained where the mask of tokens[1:] is.
    expected = sorted((t.tolist(), m[1:].astype(int).tolist()) for t, m in _disk_samples(dataset, "train"))
    assert sorted(segments) == expected
    assert sum(sum(m) for _, m in segments) == sft_loader.assistant_tokens(dataset, "train") > 0


def test_processes_read_disjoint_samples_and_epochs_reshuffle(dataset):
    halves = []
    for p in range(2):
        cfg = sft_loader.SFTLoaderConfig(dataset, num_epochs=1, process_index=p, process_count=2)
        halves.append(_segments(sft_loader.sft_batches(cfg, seq_len=1024, global_batch=4)))
    expected = sorted((t.tolist(), m[1:].astype(int).tolist()) for t, m in _disk_samples(dataset, "train"))
    assert sorted(halves[0] + halves[1]) == expected and abs(len(halves[0]) - len(halves[1])) <= 1

    cfg = sft_loader.SFTLoaderConfig(dataset, split="heldout", num_epochs=2, pack_bins=1, process_index=0,
                                     process_count=1)
    order = [tuple(t) for t, _ in _segments(sft_loader.sft_batches(cfg, seq_len=1024, global_batch=1))]
    n = len(_disk_samples(dataset, "heldout"))
    assert len(order) == 2 * n and sorted(order[:n]) == sorted(order[n:]) and order[:n] != order[n:]


def test_loader_resumes_from_a_json_state(dataset):
    cfg = sft_loader.SFTLoaderConfig(dataset, seed=7, pack_bins=3, process_index=0, process_count=1)
    it = iter(sft_loader.sft_batches(cfg, seq_len=1024, global_batch=2))
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(iterator_state.to_json(it)))
    following = [next(it) for _ in range(4)]
    resumed = iter(sft_loader.sft_batches(cfg, seq_len=1024, global_batch=2))
    iterator_state.restore(resumed, state)
    for want in following:
        got = next(resumed)
        assert all((got[k] == want[k]).all() for k in want)


def test_batches_match_the_pretraining_batch_layout(dataset):
    """The same fields, dtypes and shapes as the pretraining loader's shift_row gives the trainer."""
    row = {"tokens": np.arange(9, dtype=np.int32), "tokens_segment_ids": np.array([1] * 5 + [2] * 3 + [0], np.int32),
           "tokens_positions": np.array([0, 1, 2, 3, 4, 0, 1, 2, 0], np.int32),
           "assistant_mask": np.array([0, 0, 1, 1, 1, 0, 1, 1, 0], np.int32)}
    ours, theirs = sft_loader.shift_sft_row(row, pad_id=0), loader.shift_row(row, pad_id=0)
    assert {k: (v.dtype, v.shape) for k, v in ours.items()} == {k: (v.dtype, v.shape) for k, v in theirs.items()}
    assert ours["loss_mask"].tolist() == [0, 1, 1, 1, 0, 1, 1, 0]  # by hand: targets 2,3,4 and 6,7; none across 4->5


def test_loader_errors(dataset, tmp_path):
    cfg = sft_loader.SFTLoaderConfig(dataset, process_index=0, process_count=1)
    longest = sft_loader.read_sft_metadata(dataset)["splits"]["train"]["max_sample_tokens"]
    with pytest.raises(InputError, match=f"up to {longest} tokens"):
        sft_loader.sft_batches(cfg, seq_len=longest - 2, global_batch=1)
    sft_loader.sft_batches(cfg, seq_len=longest - 1, global_batch=1)  # a sample of L + 1 tokens fits a row
    (tmp_path / "metadata.json").write_text("{}")
    with pytest.raises(InputError, match="not an SFT dataset"):
        sft_loader.sft_batches(sft_loader.SFTLoaderConfig(str(tmp_path)), 64, 1)
    with pytest.raises(InputError, match="pack"):
        sft_loader.SFTLoaderConfig(dataset, pack="concat")

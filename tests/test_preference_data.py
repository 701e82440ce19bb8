"""Preference data (data_prep/preferences.py, data_prep/sample_preferences.py, glm46_jax/data/preference_loader.py):
the command on a hand-written JSONL (every skipped kind reported as file:line, an all-bad file one error line with
exit 2), the sequences against the chat module's own encoding and hand-written text, the loader's rows against
rows worked out by hand, one pass seeing every pair once, resume, and the generated sample pairs decoded and
checked."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import FIXTURES
from tokenizers import Tokenizer

from data_prep import cli, rl_tasks, sample_preferences
from glm46_jax.errors import InputError
from glm46_jax.data import iterator_state
from glm46_jax.data import preference_loader as pl
from glm46_jax.interop import chat

TOKENIZER = os.path.join(FIXTURES, "chat", "hf_tokenizer", "tokenizer.json")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
PAD = 3  # the hand-made dataset's pad id: not 0, so padding is told apart from segment/loss zeros


def _u(text):
    return {"role": "user", "content": text}


def _a(text, reasoning=None):
    return {"role": "assistant", "content": text, **({"reasoning_content": reasoning} if reasoning else {})}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(TOKENIZER)


def _decode(tok, ids):
    return tok.decode(np.asarray(ids).tolist(), skip_special_tokens=False)


# --- the command ---------------------------------------------------------------------------------------

VALID = [  # (line, chosen prompt + reply as messages, rejected ditto, enable_thinking, margin)
    ({"prompt": "2+2?", "chosen": "4", "rejected": "5", "margin": 1.5},
     [_u("2+2?"), _a("4")], [_u("2+2?"), _a("5")], True, 1.5),
    ({"messages": [{"role": "system", "content": "Be kind."}, _u("hi")], "chosen": [_a("Hello.", "greet")],
      "rejected": {"role": "assistant", "content": "Go away."}},
     [{"role": "system", "content": "Be kind."}, _u("hi"), _a("Hello.", "greet")],
     [{"role": "system", "content": "Be kind."}, _u("hi"), _a("Go away.")], True, 0.0),
    ({"prompt": [_u("a"), _a("A"), _u("b")], "chosen": "B", "rejected": {"content": "C"}, "enable_thinking": False},
     [_u("a"), _a("A"), _u("b"), _a("B")], [_u("a"), _a("A"), _u("b"), _a("C")], False, 0.0),
]
# What the final reply's mask covers, by hand: everything after the last <|assistant|>, and the <|user|> ending it.
MASKED = [("\n<think></think>\n4<|user|>", "\n<think></think>\n5<|user|>"),
          ("\n<think>greet</think>\nHello.<|user|>", "\n<think></think>\nGo away.<|user|>"),
          ("\n<think></think>\nB<|user|>", "\n<think></think>\nC<|user|>")]
BAD = [  # (line text, kind, what the report says after "file:line: ")
    ("{not json", "invalid_json", "invalid JSON"),
    (json.dumps({"prompt": "x", "chosen": "a"}), "missing_field", "no 'rejected'"),
    (json.dumps({"chosen": "a", "rejected": "b"}), "missing_field", "no prompt"),
    (json.dumps({"prompt": "x", "chosen": "a", "rejected": "a"}), "identical", "chosen and rejected are the same"),
    (json.dumps({"prompt": "x", "chosen": "a", "rejected": " a\n"}), "identical", "render to the same tokens"),
    (json.dumps({"prompt": "x", "chosen": "a", "rejected": _u("b")}), "bad_role", "rejected has role 'user'"),
    (json.dumps({"prompt": [{"role": "bot", "content": "x"}], "chosen": "a", "rejected": "b"}), "bad_message",
     "has role 'bot'"),
    (json.dumps({"prompt": [_u("x"), _a("y")], "chosen": "a", "rejected": "b"}), "bad_role_order",
     "the prompt ends with an assistant message"),
    (json.dumps({"prompt": [_a("y"), _u("x")], "chosen": "a", "rejected": "b"}), "bad_role_order",
     "starts (after system messages) with a user message"),
    (json.dumps({"prompt": "x", "chosen": "a", "rejected": "b", "margin": "big"}), "bad_field",
     "margin must be a finite number"),
    (json.dumps({"prompt": "x", "chosen": [_a("a"), _a("b")], "rejected": "c"}), "bad_field",
     "chosen is a list of 2 messages"),
    (json.dumps({"prompt": "x", "chosen": "", "rejected": "b"}), "missing_content", "chosen has no content"),
    (json.dumps({"prompt": "x " * 300, "chosen": "a", "rejected": "b"}), "too_long", "> --max-len 200"),
]


def _write_input(path):
    lines = [json.dumps(v[0]).encode() for v in VALID[:2]] + [b""] + [t.encode() for t, _, _ in BAD]
    lines += [b"\xff\xfe", json.dumps(VALID[2][0]).encode()]
    path.write_bytes(b"\n".join(lines) + b"\n")
    # file line numbers: valid 1, 2; blank 3; BAD at 4..; invalid UTF-8 next; the last valid one after it
    return {"bad": {4 + i: b for i, b in enumerate(BAD)}, "utf8": 4 + len(BAD), "non_blank": len(lines) - 1}


@pytest.fixture(scope="module")
def handwritten(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefs")
    src, out = tmp / "pairs.jsonl", tmp / "out"
    where = _write_input(src)
    r = subprocess.run([sys.executable, "-m", "data_prep", "preferences", "--input", str(src), "--tokenizer",
                        TOKENIZER, "--out", str(out), "--heldout-fraction", "0", "--max-len", "200"], cwd=ROOT,
                       capture_output=True, text=True, check=False)
    return src, out, where, r


def test_skipped_lines_are_reported_with_file_and_line_and_counted(handwritten):
    src, out, where, r = handwritten
    assert r.returncode == 0, r.stderr
    reported = {int(m.group(1)): m.group(2) for m in re.finditer(rf"^warning: {re.escape(str(src))}:(\d+): (.*)$",
                                                                 r.stderr, re.MULTILINE)}
    expected = {line: why for line, (_, _, why) in where["bad"].items()} | {where["utf8"]: "not UTF-8"}
    assert sorted(reported) == sorted(expected)
    for line, why in expected.items():
        assert why in reported[line], (line, reported[line])
    meta = json.loads((out / "metadata.json").read_text())
    kinds = {}
    for _, kind, _ in BAD + [(None, "invalid_utf8", None)]:
        kinds[kind] = kinds.get(kind, 0) + 1
    assert meta["pairs"] == {"lines": where["non_blank"], "valid": 3, "skipped": len(BAD) + 1, "by_kind": kinds}
    assert [(x["location"], x["kind"]) for x in meta["reports"]] == (
        [(f"{src}:{n}", k) for n, (_, k, _) in where["bad"].items()] + [(f"{src}:{where['utf8']}", "invalid_utf8")])
    assert f"skipped {len(BAD) + 1} line(s) of {where['non_blank']}" in r.stderr
    assert meta["kind"] == "preferences" and meta["tokenizer"]["pad_id"] == 0
    with open(TOKENIZER, "rb") as f:
        assert (out / "tokenizer.json").read_bytes() == f.read()


def test_sequences_are_the_chat_modules_encoding_masked_on_the_final_reply(handwritten, tok):
    _, out, _, _ = handwritten
    a = {k: np.load(out / "train" / f"{k}.npy") for k in ("tokens", "assistant_mask", "offsets", "margin")}
    assert a["tokens"].dtype == np.int32 and a["assistant_mask"].dtype == bool and a["offsets"].dtype == np.int64
    assert a["margin"].dtype == np.float32 and a["margin"].tolist() == [1.5, 0.0, 0.0]
    assert len(a["offsets"]) == 2 * len(VALID) + 1
    seqs = [(a["tokens"][lo:hi], a["assistant_mask"][lo:hi]) for lo, hi in zip(a["offsets"][:-1], a["offsets"][1:])]
    for i, (_, chosen, rejected, thinking, _) in enumerate(VALID):
        for side, messages in enumerate((chosen, rejected)):
            ids, mask = seqs[2 * i + side]
            direct = chat.encode(tok, messages, enable_thinking=thinking, close_final_turn=True)
            assert ids.tolist() == direct.ids.tolist()
            first = int(np.argmax(mask))
            assert mask[first:].all() and not mask[:first].any()  # one run, to the end of the sequence
            assert _decode(tok, ids[mask]) == MASKED[i][side]
            assert _decode(tok, ids[first - 1:first]) == "<|assistant|>"
    # The multi-turn prompt, by hand: the earlier answer "A" is context, not trained.
    assert _decode(tok, seqs[4][0]) == ("[gMASK]<sop><|user|>\na/nothink<|assistant|>\n<think></think>\nA<|user|>\n"
                                        "b/nothink<|assistant|>\n<think></think>\nB<|user|>")
    meta = json.loads((out / "metadata.json").read_text())
    lengths = np.diff(a["offsets"])
    assert meta["splits"]["train"] == {"pairs": 3, "prompts": 3, "tokens": int(lengths.sum()),
                                       "assistant_tokens": int(a["assistant_mask"].sum()),
                                       "max_pair_tokens": int(max(lengths[0::2] + lengths[1::2])),
                                       "max_sequence_tokens": int(lengths.max())}
    assert meta["splits"]["heldout"]["pairs"] == 0


def test_all_bad_lines_are_one_error_line_and_exit_2(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('nope\n{"prompt": "x", "chosen": "a", "rejected": "a"}\n')
    r = subprocess.run([sys.executable, "-m", "data_prep", "preferences", "--input", str(src), "--tokenizer",
                        TOKENIZER, "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True, check=False)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.splitlines() == [(f"error: no valid preference pair in {src} (2 non-blank line(s)); first: "
                                      f"{src}:1: invalid JSON (Expecting value at column 1)")]
    assert not (tmp_path / "o").exists()
    assert cli.main(["preferences", "--input", str(tmp_path / "missing.jsonl"), "--tokenizer", TOKENIZER,
                     "--out", str(tmp_path / "o")]) == 2
    assert cli.main(["sample-preferences", "--kinds", "addition,poetry", "--tokenizer", TOKENIZER,
                     "--out", str(tmp_path / "o")]) == 2


def test_split_is_by_prompt_content(tmp_path):
    lines = [{"prompt": f"q{i}", "chosen": f"good {j}", "rejected": f"bad {j}"} for i in range(30) for j in range(2)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines[::-1]))
    metas = []
    for name in ("a", "b"):
        assert cli.main(["preferences", "--input", str(tmp_path / f"{name}.jsonl"), "--tokenizer", TOKENIZER,
                         "--out", str(tmp_path / f"o{name}"), "--heldout-fraction", "0.3"]) == 0
        metas.append(json.loads((tmp_path / f"o{name}" / "metadata.json").read_text())["splits"])
    assert metas[0] == metas[1]
    for s in metas[0].values():  # both pairs of a prompt land in one split
        assert s["pairs"] == 2 * s["prompts"]
    assert 0 < metas[0]["heldout"]["prompts"] < 30


# --- the loader on a dataset small enough to work out by hand -------------------------------------------

# (chosen tokens, chosen mask, rejected tokens, rejected mask, margin)
HAND = [([10, 11, 12, 13], [0, 0, 1, 1], [10, 11, 14, 15, 16], [0, 0, 1, 1, 1], 0.5),  # 9 tokens
        ([20, 21, 22], [0, 1, 1], [20, 23], [0, 1], -1.0),  # 5
        ([40, 41], [0, 1], [40, 42], [0, 1], 0.0),  # 4
        ([30, 31, 32, 33, 34, 35], [0, 0, 0, 1, 1, 1], [30, 36, 37], [0, 1, 1], 2.0)]  # 9


def _write_hand_dataset(root):
    seqs = [s for c, cm, r, rm, _ in HAND for s in ((c, cm), (r, rm))]
    os.makedirs(root / "train")
    np.save(root / "train" / "tokens.npy", np.concatenate([t for t, _ in seqs]).astype(np.int32))
    np.save(root / "train" / "assistant_mask.npy", np.concatenate([m for _, m in seqs]).astype(bool))
    np.save(root / "train" / "offsets.npy", np.cumsum([0] + [len(t) for t, _ in seqs]).astype(np.int64))
    np.save(root / "train" / "margin.npy", np.asarray([p[4] for p in HAND], np.float32))
    (root / "metadata.json").write_text(json.dumps({
        "kind": "preferences", "tokenizer": {"pad_id": PAD},
        "splits": {"train": {"pairs": 4, "max_pair_tokens": 14}, "heldout": {"pairs": 0, "max_pair_tokens": 0}}}))


def test_rows_match_hand_computed_fields(tmp_path):
    _write_hand_dataset(tmp_path)
    cfg = pl.PreferenceLoaderConfig(str(tmp_path), shuffle=False, num_epochs=1, pairs_per_row=2, pack_bins=1,
                                    process_index=0, process_count=1)
    batches = list(pl.preference_batches(cfg, seq_len=20, global_batch=3))
    assert len(batches) == 1
    b = batches[0]
    P = PAD
    # Row 0: pairs 0 and 1 (14 tokens); pair 2 would fit by length but the row already holds pairs_per_row = 2.
    # Row 1: pairs 2 and 3 (13 tokens). Row 2: an empty row filling the last batch.
    want = {
        "inputs": [[10, 11, 12, 13, 10, 11, 14, 15, 16, 20, 21, 22, 20, 23] + [P] * 6,
                   [40, 41, 40, 42, 30, 31, 32, 33, 34, 35, 30, 36, 37] + [P] * 7, [P] * 20],
        "targets": [[11, 12, 13, P, 11, 14, 15, 16, P, 21, 22, P, 23, P] + [P] * 6,
                    [41, P, 42, P, 31, 32, 33, 34, 35, P, 36, 37, P] + [P] * 7, [P] * 20],
        "segment_ids": [[1] * 4 + [2] * 5 + [3] * 3 + [4] * 2 + [0] * 6,
                        [1] * 2 + [2] * 2 + [3] * 6 + [4] * 3 + [0] * 7, [0] * 20],
        "positions": [[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 0, 1] + [0] * 6,
                      [0, 1, 0, 1, 0, 1, 2, 3, 4, 5, 0, 1, 2] + [0] * 7, [0] * 20],
        "loss_mask": [[0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 0] + [0] * 6,
                      [1, 0, 1, 0, 0, 0, 1, 1, 1, 0, 1, 1, 0] + [0] * 7, [0] * 20],
        "chosen_end": [[3, 11], [1, 9], [0, 0]],
        "rejected_end": [[8, 13], [3, 12], [0, 0]],
        "pair_mask": [[1, 1], [1, 1], [0, 0]],
        "margin": [[0.5, -1.0], [0.0, 2.0], [0.0, 0.0]],
    }
    assert set(b) == set(want)
    for k, v in want.items():
        assert b[k].dtype == (np.float32 if k == "margin" else np.int32), k
        assert b[k].tolist() == v, k


def test_loader_errors(tmp_path):
    _write_hand_dataset(tmp_path)
    cfg = pl.PreferenceLoaderConfig(str(tmp_path), process_index=0, process_count=1)
    with pytest.raises(InputError, match=re.escape(f"{tmp_path}: the longest train pair is 14 tokens")) as e:
        pl.preference_batches(cfg, seq_len=13, global_batch=1)
    assert "seq_len >= 14" in str(e.value) and "--max-len 13" in str(e.value)
    pl.preference_batches(cfg, seq_len=14, global_batch=1)  # a pair of exactly seq_len tokens fits
    with pytest.raises(InputError, match="no pairs"):
        pl.preference_batches(pl.PreferenceLoaderConfig(str(tmp_path), split="heldout", process_index=0,
                                                        process_count=1), 16, 1)
    missing = tmp_path / "nothing"
    with pytest.raises(InputError, match=re.escape(f"{missing / 'metadata.json'} not found")):
        pl.read_preference_metadata(str(missing))
    (tmp_path / "metadata.json").write_text('{"kind": "sft"}')
    with pytest.raises(InputError, match="not a preference dataset"):
        pl.read_preference_metadata(str(tmp_path))
    with pytest.raises(InputError, match="pairs_per_row"):
        pl.PreferenceLoaderConfig(str(tmp_path), pairs_per_row=0)


# --- the sample set, and the loader over it -------------------------------------------------------------

@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    out = tmp_path_factory.mktemp("sample_prefs")
    assert cli.main(["sample-preferences", "--out", str(out), "--tokenizer", TOKENIZER, "--pairs", "80",
                     "--heldout-fraction", "0.2"]) == 0
    return out


def _disk_pairs(root, split):
    a = {k: np.load(os.path.join(root, split, f"{k}.npy")) for k in ("tokens", "assistant_mask", "offsets", "margin")}
    seqs = [(a["tokens"][lo:hi], a["assistant_mask"][lo:hi]) for lo, hi in zip(a["offsets"][:-1], a["offsets"][1:])]
    return [(seqs[2 * i], seqs[2 * i + 1], float(a["margin"][i])) for i in range(len(a["margin"]))]


def test_sample_addition_answers_are_right_when_chosen_and_wrong_when_rejected(sample, tok):
    heldout = set(rl_tasks.split(0, 500, 1000)[2])
    additions = chats = 0
    for split in ("train", "heldout"):
        for (c, cm), (r, rm), _ in _disk_pairs(sample, split):
            text, rejected = _decode(tok, c), _decode(tok, r)
            m = re.fullmatch(r"\[gMASK\]<sop><\|user\|>\n(\d+)\+(\d)/nothink<\|assistant\|>\n<think></think>\n(\d+)"
                             r"<\|user\|>", text)
            if m:
                a, b, answer = map(int, m.groups())
                assert answer == a + b and (a, b) not in heldout
                wrong = re.fullmatch(r".*<\|assistant\|>\n<think></think>\n(\d+)<\|user\|>", rejected, re.DOTALL)
                assert wrong and int(wrong.group(1)) != a + b
                assert _decode(tok, c[cm]) == f"\n<think></think>\n{a + b}<|user|>"
                additions += 1
            else:  # a chat pair: the rejected reply rambles or breaks the format
                reply = _decode(tok, r[rm])
                assert (rm.sum() > 2 * cm.sum() or "<think>" in reply.split("</think>", 1)[1]
                        or "<|user|>" in reply[:-len("<|user|>")]), reply
                chats += 1
    assert additions == chats == 40
    only = sample_preferences.pairs(12, ("addition",), seed=5)
    assert len(only) == 12 and all(re.fullmatch(r"\d+\+\d", p["messages"][0]["content"]) for p in only)
    assert only == sample_preferences.pairs(12, ("addition",), seed=5)  # deterministic for a seed


def _pairs_of(batches):
    """Every pair in the batches as (chosen tokens, mask, rejected tokens, mask, margin), rebuilt from the row fields
    (a reply's first token is never masked, so mask = [0] + loss_mask[:-1]), checking the fields on the way."""
    out = []
    for b in batches:
        for r in range(len(b["inputs"])):
            seg = b["segment_ids"][r]
            assert (b["loss_mask"][r][seg == 0] == 0).all() and (b["inputs"][r][seg == 0] == 0).all()
            slots = int(b["pair_mask"][r].sum())
            assert b["pair_mask"][r].tolist() == [1] * slots + [0] * (len(b["pair_mask"][r]) - slots)
            assert int(seg.max()) == 2 * slots
            pair = []
            for s in range(1, 2 * slots + 1):
                idx = np.flatnonzero(seg == s)
                assert (np.diff(idx) == 1).all() and b["positions"][r][idx].tolist() == list(range(len(idx)))
                assert b["targets"][r][idx[:-1]].tolist() == b["inputs"][r][idx[1:]].tolist()
                assert b["targets"][r][idx[-1]] == 0 and b["loss_mask"][r][idx[-1]] == 0
                mask = np.concatenate([[0], b["loss_mask"][r][idx[:-1]]]).astype(bool)
                end = (b["chosen_end"] if s % 2 else b["rejected_end"])[r][(s - 1) // 2]
                assert end == idx[mask][-1]
                pair += [b["inputs"][r][idx].tolist(), mask.tolist()]
                if s % 2 == 0:
                    out.append((*pair, float(b["margin"][r][s // 2 - 1])))
                    pair = []
    return out


def test_one_pass_sees_every_pair_once_and_processes_are_disjoint(sample):
    expected = sorted((c.tolist(), cm.tolist(), r.tolist(), rm.tolist(), m) for (c, cm), (r, rm), m
                      in _disk_pairs(sample, "train"))
    cfg = pl.PreferenceLoaderConfig(str(sample), num_epochs=1, pairs_per_row=3, pack_bins=4, process_index=0,
                                    process_count=1)
    batches = list(pl.preference_batches(cfg, seq_len=1024, global_batch=3))
    assert sum(int(b["pair_mask"].sum()) for b in batches) == pl.split_pair_count(str(sample), "train")
    assert sorted(_pairs_of(batches)) == expected
    halves = [_pairs_of(pl.preference_batches(pl.PreferenceLoaderConfig(
        str(sample), num_epochs=1, process_index=p, process_count=2), seq_len=1024, global_batch=2)) for p in range(2)]
    assert sorted(halves[0] + halves[1]) == expected


def test_loader_resumes_from_a_json_state(sample):
    cfg = pl.PreferenceLoaderConfig(str(sample), seed=3, pack_bins=3, process_index=0, process_count=1)
    it = iter(pl.preference_batches(cfg, seq_len=1024, global_batch=2))
    for _ in range(4):
        next(it)
    state = json.loads(json.dumps(iterator_state.to_json(it)))
    following = [next(it) for _ in range(3)]
    resumed = iter(pl.preference_batches(cfg, seq_len=1024, global_batch=2))
    iterator_state.restore(resumed, state)
    for want in following:
        got = next(resumed)
        assert set(got) == set(want) and all((got[k] == want[k]).all() for k in want)

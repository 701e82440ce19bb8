"""data_prep: cleaning, quality rules, deduplication, malformed input, formats, shards, task counts, resume, sample.

References are independent of the code under test: exact Jaccard over Python sets for dedup, hand-written
expected strings for cleaning, shards read back with Grain and decoded with the saved tokenizer, a run with other
task counts (byte-identical output). The executors (Slurm, Ray, S3) are in test_data_prep_executors.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from data_prep import cli, minhash, quality, report, shards
from data_prep.clean import clean_text
from data_prep.executors import run_pipeline
from data_prep.inputs import ReaderOptions, ReadTask, read_task
from data_prep.pipeline import ExecutorOptions, PipelineConfig, TokenizerOptions, WriteOptions

STOP = sorted(quality.STOP_WORDS)


def _vocab(rng: np.random.Generator, n: int = 3000) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return ["".join(rng.choice(letters, rng.integers(3, 10))) for _ in range(n)]


def prose(rng: np.random.Generator, vocab: list[str], n_words: int) -> str:
    """Random 'English-like' text: real stop words between pseudo-words, sentences of ~12 words."""
    words = [STOP[rng.integers(len(STOP))] if rng.random() < 0.25 else vocab[rng.integers(len(vocab))]
             for _ in range(n_words)]
    sentences = [" ".join(words[i:i + 12]).capitalize() + "." for i in range(0, n_words, 12)]
    return " ".join(sentences)


def shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def jaccard(a: str, b: str) -> float:
    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / len(sa | sb)


def config(tmp_path, inputs, **kw) -> PipelineConfig:
    kw.setdefault("tokenizer", TokenizerOptions(vocab_size=300))
    return PipelineConfig(inputs=tuple(inputs), out=str(tmp_path / "out"), **kw)


def _jsonl(path, texts) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def decoded_texts(out: str, meta: dict) -> dict[tuple[str, str], list[str]]:
    """Every record of the dataset decoded back to text with its own tokenizer, per (domain, split), in order."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    return {key: [tok.decode(r[:-1].tolist()) for r in recs] for key, recs in read_dataset(out, meta).items()}


def read_dataset(out: str, meta: dict) -> dict[tuple[str, str], list[np.ndarray]]:
    import grain

    records = {}
    for domain, info in meta["domains"].items():
        for split in shards.SPLITS:
            paths = [os.path.join(out, p) for p in info[split]["shards"]]
            source = grain.sources.ArrayRecordDataSource(paths) if paths else []
            records[domain, split] = [np.frombuffer(source[i], "<i4") for i in range(len(source))]
    return records


def all_files(root: str) -> dict[str, bytes]:
    """Every file of a dataset directory but the work folder of intermediate files."""
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x != "_work"]
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), root)] = fh.read()
    return out


# --- clean -----------------------------------------------------------------------------------------

def test_clean_text():
    raw = "  indented\r\nline with trailing   \t\r\n\r\n\r\n\r\n\r\nafter\x00\x07 blanks\x7f\rCafe\u0301\tend \n\n"
    assert clean_text(raw) == "  indented\nline with trailing\n\n\nafter blanks\nCaf\u00e9\tend"
    assert clean_text("a\n\n\nb") == "a\n\n\nb"  # two blank lines are kept
    assert clean_text(" \t\n \n") == ""


# --- dedup -------------------------------------------------------------------------------------------

def test_lsh_params_reach_recall_at_threshold():
    for t in (0.85, 0.9):
        bands, rows = minhash.lsh_params(t, 128)
        assert bands * rows <= 128 and minhash.candidate_probability(t, bands, rows) >= 0.99
        assert minhash.candidate_probability(t - 0.35, bands, rows) < 0.1  # few candidates far below t


def test_dedup_finds_planted_duplicates_and_task_counts_give_identical_bytes(tmp_path):
    """Planted exact copies, near duplicates (Jaccard 0.90-0.93) and related documents (Jaccard < 0.6), spread over
    five files; a few near duplicates come in a file *before* their original, so the survivor rule (smallest input
    file, line) keeps the copy. 1 task, and 4 tasks with 2 workers and 3 write tasks: the same bytes."""
    rng = np.random.default_rng(0)
    vocab = _vocab(rng)
    originals = [prose(rng, vocab, 400) for _ in range(300)]
    near = {}  # original index -> near-duplicate with 3 or 4 words replaced (Jaccard 0.90-0.93)
    for i in range(100, 200):
        words = originals[i].split(" ")
        for pos in rng.choice(np.arange(20, len(words) - 20, 6), 3 + i % 2, replace=False):
            words[pos] = "zzz" + vocab[rng.integers(len(vocab))]
        near[i] = " ".join(words)
    related = []  # share ~half their text with an original: similar but below the threshold
    for i in range(200, 220):
        half = originals[i].split(" ")
        related.append(" ".join(half[: len(half) // 2]) + " " + prose(rng, vocab, 200))
    exact = [originals[i].replace(". ", ".\n  ") for i in range(20)]  # same text, other whitespace
    early = {i: near.pop(i) for i in range(190, 200)}  # these copies come first: they survive, the originals go

    sims = [jaccard(originals[i], t) for i, t in {**near, **early}.items()]
    assert 0.9 <= min(sims) and max(sims) <= 0.93, (min(sims), max(sims))
    assert max(jaccard(originals[200 + k], t) for k, t in enumerate(related)) < 0.6

    files = [_jsonl(tmp_path / "0_early.jsonl", list(early.values())),
             _jsonl(tmp_path / "1_orig.jsonl", originals[:150]), _jsonl(tmp_path / "2_orig.jsonl", originals[150:]),
             _jsonl(tmp_path / "3_near.jsonl", list(near.values())),
             _jsonl(tmp_path / "4_more.jsonl", related + exact)]
    one = config(tmp_path / "one", [("prose", f) for f in files], executor=ExecutorOptions(tasks=1),
                 write=WriteOptions(heldout_fraction=0.0, shard_bytes=200_000))
    meta, _ = run_pipeline(one)
    kept = decoded_texts(one.out, meta)["prose", "train"]
    kept_set = set(kept)

    assert meta["domains"]["prose"]["filter"]["kept"] == len(originals) + 100 + 40  # no rule removed any
    assert all(originals[i] in kept_set for i in range(300) if i not in early) and all(t in kept_set for t in related)
    assert all(t in kept_set for t in early.values()) and not any(originals[i] in kept_set for i in early)
    assert not any(t in kept_set for t in exact)
    near_removed = sum(t not in kept_set for t in near.values())
    assert near_removed / len(near) >= 0.95, near_removed
    assert len(kept) == len(kept_set) == 290 + len(early) + len(related) + len(near) - near_removed
    d = meta["dedup"]
    assert d["exact_duplicate_clusters"] == 20 and d["exact_duplicates_removed"] == 20
    assert d["near_duplicate_clusters"] == d["near_duplicates_removed"] == near_removed + 10
    assert d["removed"] == 20 + near_removed + 10 and d["kept"] == len(kept)
    assert meta["domains"]["prose"]["dedup"]["near_duplicates"] == near_removed + 10
    assert d["candidates_below_threshold"] >= 0 and d["lsh"]["bands"] == 15

    many = dataclasses.replace(one, out=str(tmp_path / "many" / "out"),
                               executor=ExecutorOptions(tasks=4, workers=2, write_tasks=3))
    run_pipeline(many)
    assert all_files(many.out) == all_files(one.out)
    assert len(meta["domains"]["prose"]["train"]["shards"]) > 3


def test_verification_rejects_band_collisions_below_the_threshold():
    """datatrove's buckets alone would merge these: a candidate group is kept only where the estimated Jaccard of
    the full signatures reaches the threshold, and the smallest node of each component survives."""
    from data_prep.dedup import UnionFind, bucket_groups

    pairs = np.array([[0, 5, 0, 7], [0, 7, 1, 2], [2, 0, 2, 1]], np.uint32)  # chains: (0:5, 0:7, 1:2), (2:0, 2:1)
    groups = bucket_groups(pairs)
    assert [g.tolist() for g in groups] == [[5, 7, (1 << 32) | 2], [2 << 32, (2 << 32) | 1]]
    uf = UnionFind(5)
    uf.union(4, 2)
    uf.union(3, 4)
    assert uf.roots().tolist() == [0, 1, 2, 2, 2]
    # 15 x 8 bands: a pair at Jaccard 0.5 is a candidate ~6 % of the time, one at 0.85 with probability >= 0.99
    assert 0.04 < minhash.candidate_probability(0.5, 15, 8) < 0.07
    assert minhash.candidate_probability(0.85, 15, 8) >= 0.99


# --- quality -----------------------------------------------------------------------------------------

def test_each_quality_rule_removes_its_planted_document(tmp_path):
    rng = np.random.default_rng(1)
    vocab = _vocab(rng)
    good = [prose(rng, vocab, 80) for _ in range(20)]
    planted = {
        "min_chars": "The cat and the dog.",
        "max_chars": prose(rng, vocab, 800),
        "mean_word_length": "The and of to " + " ".join(["incomprehensibilities", "internationalization"] * 4),
        "symbol_ratio_max": "The {house} => [garden] && (the) || window <> with ##$$%% of @@!! to ;;:: and ~~^^ table.",
        "duplicate_line_fraction_max": "\n".join(["The cat sat with the dog."] * 6 + vocab[:4]),
        "top_ngram_fraction_max": " ".join(["the quick"] * 8 + vocab[:10]),
        "stop_words_min": " ".join(vocab[10:40]),
    }
    rules = {"prose": quality.rules_for("prose", {"prose": {"max_chars": 3000}}),
             "code": quality.rules_for("code", {})}
    for rule, text in planted.items():
        assert quality.first_failure(text, rules["prose"]) == rule, rule
    code = "def f(xs):\n    return [x ** 2 for x in xs if x]  # squares"
    cfg = config(tmp_path, [("prose", _jsonl(tmp_path / "p.jsonl", good[:10] + list(planted.values()) + good[10:])),
                            ("code", _jsonl(tmp_path / "c.jsonl", [code]))],
                 rule_overrides={"prose": {"max_chars": 3000}}, write=WriteOptions(heldout_fraction=0.0))
    meta, _ = run_pipeline(cfg)  # each rule is its own datatrove filter block, chained in RULE_ORDER
    texts = decoded_texts(cfg.out, meta)
    assert texts["prose", "train"] == good and texts["code", "train"] == [code]
    stats = {d: meta["domains"][d]["filter"] for d in ("prose", "code")}
    assert stats["prose"]["removed"] == dict.fromkeys(planted, 1)
    assert stats["prose"]["kept"] == 20 and stats["prose"]["documents"] == 27
    # code skips the stop-word and word-length rules
    assert "stop_words_min" not in stats["code"]["removed"] and stats["code"]["kept"] == 1


def test_rule_overrides_and_errors():
    r = quality.rules_for("web", {"web": {"preset": "code", "min_chars": 5, "mean_word_length": [2, 12]}})
    assert r.min_chars == 5 and r.stop_words_min is None and r.mean_word_length == (2, 12)
    assert quality.parse_rule_override("code.stop_words_min=null") == ("code", "stop_words_min", None)
    with pytest.raises(ValueError, match="unknown quality rule"):
        quality.rules_for("web", {"web": {"min_char": 5}})


# --- inputs ------------------------------------------------------------------------------------------

def test_malformed_inputs_are_reported_and_good_documents_survive(tmp_path, capsys):
    rng = np.random.default_rng(2)
    vocab = _vocab(rng)
    texts = [prose(rng, vocab, 60) for _ in range(6)]
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_bytes(b"\n".join([
        json.dumps({"text": texts[0]}).encode(),
        b'{"text": "unterminated',
        json.dumps({"body": texts[1]}).encode(),
        b'{"text": "caf\xff bytes"}',
        json.dumps({"text": 5}).encode(),
        b"",
        json.dumps({"text": texts[2], "id": 7}).encode(),
    ]) + b"\n")
    (src / "b.jsonl").write_bytes(b"")
    (src / "c.txt").write_text(texts[3])
    (src / "d.txt").write_bytes(texts[4].encode() + b"\nline two\n\x80\x81 broken\n")
    (src / "e.txt").write_bytes(b"  \n")
    a, b, d, e = (str(src / n) for n in ("a.jsonl", "b.jsonl", "d.txt", "e.txt"))

    out = tmp_path / "out"
    assert cli.main(["pipeline", "--input", f"prose={src}", "--out", str(out), "--workers", "1",
                     "--vocab-size", "300", "--heldout-fraction", "0"]) == 0
    printed = capsys.readouterr().out
    assert f"{a}:2: invalid_json" in printed and f"{d}:3: invalid_utf8" in printed
    stats = json.loads((out / "metadata.json").read_text())
    got = {(r["location"], r["kind"]) for r in stats["malformed"]["reports"]}
    assert got == {(f"{a}:2", "invalid_json"), (f"{a}:3", "missing_field"), (f"{a}:4", "invalid_utf8"),
                   (f"{a}:5", "wrong_type"), (f"{a}:6", "blank_line"), (f"{b}:1", "empty_file"),
                   (f"{d}:3", "invalid_utf8"), (f"{e}:1", "empty_file")}
    assert stats["malformed"]["count"] == 8
    assert stats["malformed"]["by_kind"] == {"blank_line": 1, "empty_file": 2, "invalid_json": 1,
                                             "invalid_utf8": 2, "missing_field": 1, "wrong_type": 1}
    # d.txt is one document (its text with the bad byte is reported, not read): the good ones, in input order
    assert decoded_texts(str(out), stats)["prose", "train"] == [texts[0], texts[2], texts[3]]
    assert stats["domains"]["prose"]["ingest"] == {"files": 5, "documents": 3, "malformed": 8}


def test_missing_input_is_a_clear_error(tmp_path, capsys):
    code = cli.main(["pipeline", "--input", f"prose={tmp_path}/nope/*.jsonl", "--out", str(tmp_path / "o")])
    assert code == 2
    err = capsys.readouterr().err
    assert "nope/*.jsonl" in err and "no file" in err
    assert cli.main(["pipeline", "--input", "no-equals-sign", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "expected DOMAIN=PATH" in err[0]


def test_text_lines_mode(tmp_path):
    (tmp_path / "l.txt").write_text("first document here\n\nsecond one\n")
    docs = list(read_task(ReadTask("p", "text", str(tmp_path / "l.txt")), ReaderOptions(text_lines=True)))
    assert [(d.source.rsplit(":", 1)[1], d.text) for d in docs] == [("1", "first document here"), ("2", ""),
                                                                    ("3", "second one")]


# --- formats, shards, round trip ---------------------------------------------------------------------

def test_jsonl_text_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install 'glm46_jax[data]')")
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    rng = np.random.default_rng(3)
    vocab = _vocab(rng)
    web = [prose(rng, vocab, 100) for _ in range(30)]
    books = [prose(rng, vocab, 150) for _ in range(5)]
    code = [f"def f{i}(x):\n    y = x * {i} + {vocab[i]!r}  # ünïcode ✓\n    return {{y: {vocab[i + 1]!r}}}\n"
            for i in range(12)]
    (tmp_path / "web.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in web))
    os.makedirs(tmp_path / "books")
    for i, t in enumerate(books):  # CRLF + trailing spaces: the expected text is the cleaned one
        (tmp_path / "books" / f"{i}.txt").write_bytes(t.replace(". ", ".   \r\n").encode())
    pq.write_table(pa.table({"content": code}), tmp_path / "code.parquet")

    inputs = [("web", str(tmp_path / "web.jsonl")), ("books", str(tmp_path / "books/*.txt")),
              ("code", str(tmp_path / "code.parquet"))]
    cfg = config(tmp_path, inputs, reader=ReaderOptions(text_field="content"),
                 write=WriteOptions(heldout_fraction=0.2, shard_bytes=4000))
    meta, run = run_pipeline(cfg)
    expected = {"web": web, "books": [t.replace(". ", ".\n") for t in books], "code": [t.rstrip("\n") for t in code]}

    tok = Tokenizer.from_file(os.path.join(cfg.out, "tokenizer.json"))
    assert tok.token_to_id("<|pad|>") == 0 and tok.token_to_id("<|endoftext|>") == 1
    assert meta["tokenizer"] == {**meta["tokenizer"], "eos_id": 1, "pad_id": 0, "vocab_size": 300,
                                 "path": "tokenizer.json"}
    records = read_dataset(cfg.out, meta)
    for domain, texts in expected.items():
        decoded = {}
        for split in shards.SPLITS:
            recs = records[domain, split]
            info = meta["domains"][domain][split]
            assert info["documents"] == len(recs) and info["tokens"] == sum(r.size for r in recs)
            for r in recs:
                assert r[-1] == 1 and 1 not in r[:-1]  # exactly one EOS, at the end
            decoded[split] = [tok.decode(r[:-1].tolist()) for r in recs]
            assert decoded[split] == [t for t in texts if t in decoded[split]]  # pipeline order kept
        assert sorted(decoded["train"] + decoded["heldout"]) == sorted(texts)
    assert records["web", "heldout"] and records["web", "train"]
    assert len(meta["domains"]["web"]["train"]["shards"]) > 1  # shard_bytes forces several shards
    on_disk = {p for p in all_files(cfg.out) if p.endswith(".array_record")}
    assert on_disk == {p for d in meta["domains"].values() for s in shards.SPLITS for p in d[s]["shards"]}
    assert all(re.fullmatch(r"\w+/(train|heldout)/shard-\d{5}-of-\d{5}\.array_record", p) for p in on_disk)
    assert not any(run["skipped"].values())


@functools.cache  # TFDS registers builder classes by name: define this one once per process
def _tiny_tfds_builder():
    import tensorflow_datasets as tfds

    class DataPrepTinyText(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "n": tfds.features.Tensor(shape=(), dtype=np.int32)}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            rng = np.random.default_rng(4)
            vocab = _vocab(rng, 500)
            for i in range(12):
                yield i, {"text": prose(rng, vocab, 40 + i), "n": i}

    return DataPrepTinyText


def test_tfds_input_without_tensorflow(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets", reason="tensorflow-datasets is not installed")
    data_dir = str(tmp_path / "tfds")
    _tiny_tfds_builder()(data_dir=data_dir, file_format="array_record").download_and_prepare()
    source = tfds.data_source("data_prep_tiny_text", split="train", data_dir=data_dir)
    want = sorted(source[i]["text"].decode() for i in range(len(source)))

    cfg = config(tmp_path, [("prose", "tfds:data_prep_tiny_text@train")],
                 reader=ReaderOptions(tfds_data_dir=data_dir), write=WriteOptions(heldout_fraction=0.0))
    meta, _ = run_pipeline(cfg)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(cfg.out, "tokenizer.json"))
    got = sorted(tok.decode(r[:-1].tolist()) for r in read_dataset(cfg.out, meta)["prose", "train"])
    assert got == want and len(got) == 12
    assert "tensorflow" not in sys.modules
    with pytest.raises(FileNotFoundError, match="no_such_dataset"):
        run_pipeline(config(tmp_path, [("p", "tfds:no_such_dataset")], reader=ReaderOptions(tfds_data_dir=data_dir)))


# --- resume and determinism -------------------------------------------------------------------------

@pytest.fixture
def small_corpus(tmp_path):
    rng = np.random.default_rng(5)
    vocab = _vocab(rng)
    return [("prose", _jsonl(tmp_path / f"c{i}.jsonl", [prose(rng, vocab, 120) for _ in range(15)])) for i in range(4)]


def _argv(inputs, out, *flags) -> list[str]:
    return ["pipeline", *(a for d, p in inputs for a in ("--input", f"{d}={p}")), "--out", str(out),
            "--vocab-size", "300", "--shard-size-mb", "0.01", *flags]


def test_killed_run_resumes_to_the_same_dataset(tmp_path, small_corpus):
    """SIGKILL the whole local run mid-way: no metadata.json; the same command again skips the finished tasks and
    writes the bytes an uninterrupted run writes."""
    reference = tmp_path / "reference"
    assert cli.main(_argv(small_corpus, reference, "--tasks", "4", "--workers", "1")) == 0
    out = tmp_path / "crash"
    argv = _argv(small_corpus, out, "--tasks", "4", "--workers", "1")
    proc = subprocess.Popen([sys.executable, "-m", "data_prep", *argv], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(out.glob("_work/*/logs/prepare/completions/00001")) and time.time() < deadline:
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (out / "metadata.json").exists()  # an incomplete dataset has no metadata

    _, run = run_pipeline(_config_from_argv(argv))
    assert 1 <= run["skipped"]["prepare"] < 4 and run["skipped"]["write"] == 0
    assert all_files(str(out)) == all_files(str(reference))
    _, again = run_pipeline(_config_from_argv(argv))  # a complete run re-run: every task skipped, same bytes
    assert again["skipped"] == {**{s: n for s, n in again["skipped"].items()}, "prepare": 4, "tokenize": 4}
    assert all_files(str(out)) == all_files(str(reference))


def _config_from_argv(argv: list[str]) -> PipelineConfig:
    args = cli.build_parser().parse_args(argv)
    return cli.pipeline_config(args, tuple(args.input))


def test_worker_counts_give_the_same_dataset(tmp_path, small_corpus):
    one, two = tmp_path / "one", tmp_path / "two"
    assert cli.main(_argv(small_corpus, one, "--workers", "1")) == 0
    assert cli.main(_argv(small_corpus, two, "--workers", "2", "--write-tasks", "2")) == 0
    reference = all_files(str(one))
    assert all_files(str(two)) == reference and len([p for p in reference if p.endswith(".array_record")]) > 2


def test_loaded_tokenizer_and_literal_special_tokens(tmp_path, small_corpus):
    first = config(tmp_path / "a", small_corpus)
    run_pipeline(first)
    tok_path = os.path.join(first.out, "tokenizer.json")
    doc = tmp_path / "special.jsonl"
    doc.write_text(json.dumps({"text": "The text <|endoftext|> of the doc, with <|pad|> inside it to be read."}) + "\n")
    cfg = config(tmp_path / "b", [("prose", str(doc))], tokenizer=TokenizerOptions(path=tok_path),
                 write=WriteOptions(heldout_fraction=0.0))
    meta, _ = run_pipeline(cfg)
    (record,) = read_dataset(cfg.out, meta)["prose", "train"]
    assert record[-1] == 1 and 1 not in record[:-1] and 0 not in record  # literal tokens are just text
    with open(tok_path, "rb") as a, open(os.path.join(cfg.out, "tokenizer.json"), "rb") as b:
        assert a.read() == b.read()  # a loaded tokenizer is copied byte for byte
    assert meta["tokenizer"]["source"] == tok_path
    with pytest.raises(ValueError, match="<eos>"):
        run_pipeline(dataclasses.replace(cfg, tokenizer=TokenizerOptions(path=tok_path, eos_token="<eos>")))


def test_tokenizer_without_pad_token_pads_with_eos_in_the_loader(tmp_path, small_corpus):
    """GLM's tokenizer.json has no `<|pad|>` (it pads with `<|endoftext|>`): the corpus records EOS as the
    pad id and a best-fit loader, which pads, reads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from glm46_jax.data import loader

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["some words to learn merges from"] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[MASK]", "<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok_path = tmp_path / "glm_like_tokenizer.json"
    tok.save(str(tok_path))
    cfg = config(tmp_path, small_corpus, tokenizer=TokenizerOptions(path=str(tok_path)),
                 write=WriteOptions(heldout_fraction=0.0))
    meta, _ = run_pipeline(cfg)
    eos = tok.token_to_id("<|endoftext|>")
    assert eos == 1 and meta["tokenizer"]["eos_id"] == eos and meta["tokenizer"]["pad_id"] == eos
    batch = next(iter(loader.training_batches(loader.LoaderConfig(cfg.out, read_threads=1, pack_bins=4),
                                              {"prose": 1.0}, 2048, 2, "best_fit")))
    pad = batch["segment_ids"] == 0
    assert pad.any() and (batch["inputs"][pad] == eos).all()  # 2048-token rows of ~800-token documents get padded


# --- the embedded sample corpus ------------------------------------------------------------------------

def test_sample_command_builds_both_domains(tmp_path, capsys):
    out = tmp_path / "sample"
    assert cli.main(["sample", "--out", str(out), "--max-docs-per-domain", "60", "--workers", "1",
                     "--vocab-size", "300", "--heldout-fraction", "0.05"]) == 0
    meta = json.loads((out / "metadata.json").read_text())
    for domain in ("code", "prose"):
        assert meta["domains"][domain]["train"]["tokens"] > 10_000
        assert meta["domains"][domain]["ingest"]["documents"] == 60
    printed = capsys.readouterr().out
    assert "[code] train:" in printed and "[prose] train:" in printed
    assert (out / "_source" / "code.jsonl").exists()


def test_changed_config_rewrites_shards_and_reports_stale_ones(tmp_path, small_corpus):
    cfg = config(tmp_path, small_corpus, write=WriteOptions(heldout_fraction=0.0, shard_bytes=8000))
    first, _ = run_pipeline(cfg)
    regrouped = dataclasses.replace(cfg, write=WriteOptions(heldout_fraction=0.0, shard_bytes=20000))
    meta, run = run_pipeline(regrouped)
    old, new = (set(m["domains"]["prose"]["train"]["shards"]) for m in (first, meta))
    assert old.isdisjoint(new) and not any(run["skipped"].values())  # another configuration: another work folder
    assert meta["stale_shards"] == sorted(old)  # reported, not deleted
    assert all(os.path.exists(os.path.join(cfg.out, p)) for p in old)
    with pytest.raises(ValueError, match="no --input"):
        run_pipeline(dataclasses.replace(cfg, rule_overrides={"typo": {"min_chars": 1}}))
    with pytest.raises(ValueError, match="heldout_fraction"):
        WriteOptions(heldout_fraction=1.5)


# --- empty and small domains ---------------------------------------------------------------------------

SYMBOL_HEAVY = [f"The {{house}} => [garden] && (the) || window <> with ##$$%% of @@!! to ;;:: and ~~^^ table {w}."
                for w in ("one", "two", "three", "four", "five")]  # 93-95 chars: only symbol_ratio_max fails


@pytest.fixture
def failing_domain(tmp_path):
    """12 documents that all fail a quality rule: 7 under min_chars, 5 over symbol_ratio_max."""
    return _jsonl(tmp_path / "x.jsonl", [f"tiny doc {i}" for i in range(7)] + SYMBOL_HEAVY)


def test_documents_without_words_are_deduplicated_exactly(tmp_path):
    """No \\w+ word, so no word shingle: such a document is one shingle of its whole text, so exact copies
    (up to whitespace) still meet in every band, and different ones do not."""
    texts = ["!!! ??? !!! ??? !!! ??? !!! ??? !!! ??? !!! ??? !!! ??? !!! ??? !!! ???", "--- +++ --- +++ --- +++ ---",
             "!!!   ??? !!! ??? !!! ??? !!! ??? !!! ??? !!! ??? !!! ??? !!! ??? !!! ???"]
    cfg = config(tmp_path, [("sym", _jsonl(tmp_path / "s.jsonl", texts))], write=WriteOptions(heldout_fraction=0.0),
                 rule_overrides={"sym": dict.fromkeys(quality.RULE_ORDER)})
    meta, _ = run_pipeline(cfg)
    assert decoded_texts(cfg.out, meta)["sym", "train"] == texts[:2]
    assert meta["dedup"]["exact_duplicates_removed"] == 1 and meta["dedup"]["near_duplicates_removed"] == 0


def test_emptied_and_small_domains_warn_and_the_rest_is_written(tmp_path, failing_domain, capsys):
    rng = np.random.default_rng(6)
    vocab = _vocab(rng)
    good = _jsonl(tmp_path / "p.jsonl", [prose(rng, vocab, 80) for _ in range(20)])
    tiny = _jsonl(tmp_path / "t.jsonl", [prose(rng, vocab, 60) for _ in range(2)])  # hashes put neither in heldout
    out = tmp_path / "out"
    assert cli.main(["pipeline", "--input", f"prose={good}", "--input", f"x={failing_domain}", "--input",
                     f"tiny={tiny}", "--out", str(out), "--workers", "1", "--vocab-size", "300",
                     "--heldout-fraction", "0.25"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "warning: domain 'x': all 12 documents were dropped (min_chars 7, symbol_ratio_max 5); it gets no shards",
        ("warning: domain 'tiny': none of its 2 documents fell in the heldout split (heldout_fraction 0.25); "
         "it has no heldout data"),
    ]
    meta = json.loads((out / "metadata.json").read_text())
    domains = meta["domains"]
    assert [domains[d]["empty"] for d in ("prose", "x", "tiny")] == [False, True, False]
    for split in shards.SPLITS:
        assert domains["x"][split] == {"documents": 0, "tokens": 0, "shards": []}
    assert domains["tiny"]["heldout"] == {"documents": 0, "tokens": 0, "shards": []}
    assert domains["tiny"]["train"]["documents"] == 2
    assert domains["prose"]["train"]["documents"] + domains["prose"]["heldout"]["documents"] == 20
    assert domains["prose"]["heldout"]["documents"] > 0
    assert not (out / "x").exists() and not (out / "tiny" / "heldout").exists()


def test_all_domains_empty_is_one_error_and_writes_nothing(tmp_path, failing_domain, capsys):
    blank = _jsonl(tmp_path / "y.jsonl", ["   ", "\t\n"])
    (tmp_path / "z.jsonl").write_text('{"text": \n{"body": "no text field"}\n')
    z = str(tmp_path / "z.jsonl")
    want = ("error: every domain is empty, so no dataset was written: domain 'x': all 12 documents were dropped "
            "(min_chars 7, symbol_ratio_max 5); domain 'y': all 2 documents were dropped (empty after clean 2); "
            "domain 'z': no documents were read (2 malformed)")
    inputs = ["--input", f"x={failing_domain}", "--input", f"y={blank}", "--input", f"z={z}"]
    out = tmp_path / "out"
    assert cli.main(["pipeline", *inputs, "--out", str(out), "--workers", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [want]
    assert all_files(str(out)) == {}  # only the work folder of intermediate files
    assert cli.main(["pipeline", *inputs, "--out", str(out), "--workers", "2", "--tasks", "2"]) == 2
    assert capsys.readouterr().err.splitlines() == [want]


def test_warning_lines_from_metadata():
    def domain(train, heldout, empty=False):
        return {"train": {"documents": train, "tokens": 10 * train, "shards": []}, "empty": empty,
                "heldout": {"documents": heldout, "tokens": 10 * heldout, "shards": []}}

    meta = {"domains": {"a": domain(5, 0), "b": domain(0, 3), "c": domain(4, 1)},
            "config": {"write": {"heldout_fraction": 0.5}}, "stale_shards": []}
    assert report.warning_lines(meta) == [
        ("warning: domain 'a': none of its 5 documents fell in the heldout split (heldout_fraction 0.5); "
         "it has no heldout data"),
        ("warning: domain 'b': all 3 of its documents fell in the heldout split (heldout_fraction 0.5); "
         "it has no train data"),
    ]
    # No heldout split was asked for: nothing is missing.
    meta = {**meta, "domains": {"a": domain(5, 0)}, "config": {"write": {"heldout_fraction": 0.0}}}
    assert report.warning_lines(meta) == []
    meta["stale_shards"] = ["a/train/shard-00000-of-00002.array_record"]
    assert report.warning_lines(meta) == [
        ("warning: 1 shard file(s) not in this run's plan (left by a differently configured run; not listed in "
         "metadata.json): ['a/train/shard-00000-of-00002.array_record']")]


# --- user errors ----------------------------------------------------------------------------------------

def _rules_file(content: str):
    def make(tmp_path, corpus):
        (tmp_path / "rules.json").write_text(content)
        return ["pipeline", "--input", f"p={corpus}", "--out", str(tmp_path / "o"), "--rules", str(tmp_path / "rules.json")]
    return make


def _rule(arg: str):
    return lambda tmp_path, corpus: ["pipeline", "--input", f"p={corpus}", "--out", str(tmp_path / "o"), "--rule", arg]


def _pipeline(*flags: str):
    return lambda tmp_path, corpus: ["pipeline", "--input", f"p={corpus}", "--out", str(tmp_path / "o"), *flags]


def _out_is_a_file(tmp_path, corpus):
    (tmp_path / "taken").write_text("someone's file")
    return ["pipeline", "--input", f"p={corpus}", "--out", str(tmp_path / "taken")]


USER_ERRORS = {  # argv builder, a fragment the one error line must contain
    "missing input": (lambda t, s: ["pipeline", "--input", f"p={t}/nope.jsonl", "--out", str(t / "o")],
                      "nope.jsonl: no file"),
    "rules file not JSON": (_rules_file("{"), "rules.json: "),
    "rules file not an object": (_rules_file("[1, 2]"), "rules.json: "),
    "rule value of the wrong type": (_rule('p.min_chars="many"'), "p.min_chars"),
    "rule range not a pair": (_rule("p.mean_word_length=5"), "p.mean_word_length"),
    "unknown rule": (_rule("p.min_char=5"), "unknown quality rule"),
    "rule without a domain": (_rule("min_chars=5"), "DOMAIN.RULE=VALUE"),
    "rule for a domain without input": (_rule("q.min_chars=5"), "no --input"),
    "out is a file": (_out_is_a_file, "not a directory"),
    "out under a file": (lambda t, s: ["pipeline", "--input", f"p={s}", "--out", f"{s}/o"], "not a directory"),
    "ngram 0": (_pipeline("--ngram", "0"), "ngram"),
    "tasks 0": (_pipeline("--tasks", "0"), "--tasks 0"),
    "unknown executor": (_pipeline("--executor", "spark"), "--executor"),
    "missing tokenizer": (lambda t, s: ["pipeline", "--input", f"p={s}", "--out", str(t / "o"), "--tokenizer",
                                        str(t / "none.json")], "none.json"),
    "input without a domain": (lambda t, s: ["pipeline", "--input", "no-equals-sign", "--out", str(t / "o")],
                               "expected DOMAIN=PATH"),
}


@pytest.mark.parametrize("case", list(USER_ERRORS))
def test_user_errors_are_one_line_and_exit_2(tmp_path, capsys, case):
    lines = ["The cat sat on the mat with the dog and the bird, which was not the way of it."] * 3
    corpus = _jsonl(tmp_path / "p.jsonl", lines)
    make_argv, fragment = USER_ERRORS[case]
    try:
        code = cli.main([*make_argv(tmp_path, corpus), "--workers", "1"])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and fragment in err, err
    assert not (tmp_path / "o").exists()

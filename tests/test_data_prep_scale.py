"""data_prep at corpus scale: one input file spread over many tasks (byte ranges for JSON lines and text lines, row
groups for Parquet), with the same dataset bytes as one task, file lines in the malformed-input reports, and every
stage's peak RSS recorded.

References: the whole file read in one piece (`read_task`), and a run with one task (byte-identical output).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from data_prep.executors import run_pipeline
from data_prep.inputs import ReaderOptions, ReadTask, measured, read_piece, read_task
from data_prep.pipeline import STAGES, ExecutorOptions, PipelineConfig, TokenizerOptions, WriteOptions
from data_prep.slices import task_pieces
from tests.test_data_prep import _vocab, all_files, prose


def _texts(items) -> list[tuple[str, str]]:
    return [(type(i).__name__, getattr(i, "text", getattr(i, "kind", ""))) for i in items]


@pytest.mark.parametrize("kind", ["jsonl", "text"])
def test_pieces_cover_every_line_once_in_order(tmp_path, kind):
    """Lines of every length (empty, blank, one byte, long; a BOM, CRLF, no final newline) split into 1-9 tasks: the
    pieces' items, concatenated in task order, are the whole file's."""
    rng = np.random.default_rng(0)
    lines = [("x" * int(rng.integers(0, 40))) if i % 7 else "" for i in range(60)] + ["a", " ", "b" * 300]
    path = tmp_path / f"f.{'jsonl' if kind == 'jsonl' else 'txt'}"
    body = [json.dumps({"text": t}) if kind == "jsonl" and t.strip() else t for t in lines]
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(body).encode())
    reader = ReaderOptions(text_lines=True)
    task = measured(ReadTask("d", kind, str(path)))
    whole = _texts(read_task(task, reader))
    for tasks in range(1, 10):
        got = []
        for rank in range(tasks):
            for piece in task_pieces([task], reader, rank, tasks):
                got += _texts(read_piece(task, reader, piece.start, piece.end))
        assert got == whole, tasks


def _corpus(tmp_path) -> tuple[list[str], list[tuple[str, str]]]:
    """One JSONL file (malformed lines spread through it), one text-lines file and one Parquet file of 6 row groups,
    with exact copies across them."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rng = np.random.default_rng(1)
    vocab = _vocab(rng)
    texts = [prose(rng, vocab, 80) for _ in range(90)]
    lines = []
    for i, t in enumerate(texts[:60]):
        lines.append(json.dumps({"text": t if i % 10 else texts[i // 10]}))  # copies of earlier documents
        if i % 13 == 5:
            lines += ["", '{"text": "unterminated', json.dumps({"body": 1})]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "b.txt").write_text("\n".join(texts[60:75] + [texts[3]]) + "\n")
    pq.write_table(pa.table({"text": texts[75:] + [None]}), tmp_path / "c.parquet", row_group_size=3)
    (tmp_path / "d.jsonl").write_text("\n\n  \n")  # nothing but blank lines: one empty_file report
    inputs = [("web", str(tmp_path / n)) for n in ("a.jsonl", "b.txt", "c.parquet", "d.jsonl")]
    return texts, inputs


def test_one_file_over_many_tasks_gives_the_same_bytes(tmp_path):
    _, inputs = _corpus(tmp_path)
    one = PipelineConfig(inputs=tuple(inputs), out=str(tmp_path / "one"), reader=ReaderOptions(text_lines=True),
                         tokenizer=TokenizerOptions(vocab_size=300), executor=ExecutorOptions(tasks=1, workers=1),
                         write=WriteOptions(heldout_fraction=0.2, shard_bytes=4000))
    meta, run = run_pipeline(one)
    ingest = meta["domains"]["web"]["ingest"]
    assert ingest == {"files": 4, "documents": 60 + 16 + 15, "malformed": 2 + 5 * 3}
    by_kind = meta["malformed"]["by_kind"]
    assert by_kind == {"blank_line": 5, "empty_file": 1, "invalid_json": 5, "missing_field": 5 + 1}
    locations = [r["location"] for r in meta["malformed"]["reports"]]
    a = str(tmp_path / "a.jsonl")
    assert locations[:3] == [f"{a}:7", f"{a}:8", f"{a}:9"]  # after the 6th document
    assert f"{tmp_path / 'c.parquet'}:16" in locations and locations[-1] == f"{tmp_path / 'd.jsonl'}:1"
    assert meta["dedup"]["exact_duplicates_removed"] == 6  # 5 copies in a.jsonl, 1 in b.txt
    assert set(run["peak_rss"]) == set(STAGES) and all(p["max_mb"] > 10 for p in run["peak_rss"].values())

    many = dataclasses.replace(one, out=str(tmp_path / "many"), executor=ExecutorOptions(tasks=7, workers=2))
    _, run = run_pipeline(many)
    assert run["peak_rss"]["prepare"]["tasks"] == 7
    pieces = [task_pieces([measured(ReadTask("web", k, p)) for k, (_, p) in zip(
        ("jsonl", "text", "parquet", "jsonl"), inputs, strict=True)], many.reader, r, 7) for r in range(7)]
    assert sum(len([p for p in ps if p.file == 0]) for ps in pieces) >= 3  # a.jsonl spread over several tasks
    assert sum(len([p for p in ps if p.file == 2]) for ps in pieces) >= 2  # so is the Parquet file
    assert all_files(many.out) == all_files(one.out)
    assert os.path.getsize(os.path.join(many.out, "metadata.json")) > 0

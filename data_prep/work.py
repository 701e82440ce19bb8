"""The work folder of one run (`<work>/<config hash>/`, local or any fsspec URL): layout and file helpers.

    counts/<block>/<rank>.json      per-domain counts of each block (ingest: also lines per file piece)  (prepare)
    docs/<rank>.jsonl.gz            the task's documents after the quality rules
    index/<rank>.npy                one INDEX_DTYPE row per stored document
    sigs/bucket_<b>/<rank>.minhash.sig                                        (datatrove's signature files)
    buckets/<b>_<w>.dups            candidate chains per band                 (stage buckets, datatrove)
    remove/<rank>.remove, dedup.json                                          (stage dedup)
    tokenizer.json, plan.json                                                 (stage dedup)
    tokens/<rank>.bin, tokens/<rank>.npy   token ids (int32) and TOKENS_DTYPE rows of surviving documents (tokenize)
    written/<rank>.json             what each write task wrote                (stage write)
    rss/<stage>/<rank>.json         each task's peak RSS                      (every stage; peak.py)
    logs/<stage>/ (write: logs/write-<tasks>/)   datatrove's logs, stats and completion markers (what a re-run skips)

A task owns a contiguous byte slice of the inputs (slices.py), so (rank, position) orders like (input file, line).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
from datatrove.io import DataFolder

# One row per stored document, in task order: where it came from, its size, split and exact-duplicate key.
INDEX_DTYPE = np.dtype([("file", "<u4"), ("ord", "<u8"), ("domain", "<u2"), ("bytes", "<u8"), ("heldout", "u1"),
                        ("key", "V16")])
# One row per surviving document, in task order: its tokens are bin[start:start + tokens] (EOS included).
TOKENS_DTYPE = np.dtype([("domain", "<u2"), ("heldout", "u1"), ("bytes", "<u8"), ("start", "<u8"),
                         ("tokens", "<u8")])


class Rows:
    """Index rows gathered in numpy blocks: a task's index costs itemsize bytes per document, not a Python tuple's
    ~200 (a task of 256 MB of 3 KB documents: 4 MB, not 17)."""

    def __init__(self, dtype: np.dtype, block: int = 4096):
        self.dtype, self.block, self.blocks, self.pending = dtype, block, [], []

    def append(self, row: tuple) -> None:
        self.pending.append(row)
        if len(self.pending) == self.block:
            self.blocks.append(np.array(self.pending, self.dtype))
            self.pending = []

    def array(self) -> np.ndarray:
        return np.concatenate([*self.blocks, np.array(self.pending, self.dtype)])


def save_json(folder: DataFolder, path: str, value: Any) -> None:
    with folder.open(path, "w") as f:
        json.dump(value, f, sort_keys=True)


def load_json(folder: DataFolder, path: str) -> Any:
    with folder.open(path, "r") as f:
        return json.load(f)


def save_array(folder: DataFolder, path: str, array: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    with folder.open(path, "wb") as f:
        f.write(buf.getvalue())


def load_array(folder: DataFolder, path: str) -> np.ndarray:
    with folder.open(path, "rb") as f:
        return np.load(io.BytesIO(f.read()), allow_pickle=False)


def removed(folder: DataFolder, rank: int) -> np.ndarray:
    """Positions of the task's documents that dedup removed (sorted)."""
    with folder.open(f"remove/{rank:06d}.remove", "rb") as f:
        return np.frombuffer(f.read(), "<u4")


def stored_texts(folder: DataFolder, rank: int) -> Iterator[str]:
    with folder.open(f"docs/{rank:05d}.jsonl.gz", "rt", compression="gzip") as f:
        for line in f:
            yield json.loads(line)["text"]


def survivors(folder: DataFolder, rank: int) -> Iterator[tuple[np.void, str]]:
    """(index row, text) of the task's documents that dedup kept, in order."""
    index, drop = load_array(folder, f"index/{rank:05d}.npy"), set(removed(folder, rank).tolist())
    for position, text in enumerate(stored_texts(folder, rank)):
        if position not in drop:
            yield index[position], text

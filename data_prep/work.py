"""The work folder of one run (`<work>/<config hash>/`, local or any fsspec URL): layout and file helpers.

    counts/<block>/<rank>.json      per-domain counts of each block          (stage prepare)
    docs/<rank>.jsonl.gz            the task's documents after the quality rules
    index/<rank>.npy                one INDEX_DTYPE row per stored document
    sigs/bucket_<b>/<rank>.minhash.sig                                        (datatrove's signature files)
    buckets/<b>_<w>.dups            candidate chains per band                 (stage buckets, datatrove)
    remove/<rank>.remove, dedup.json                                          (stage dedup)
    tokenizer.json, plan.json                                                 (stage dedup)
    tokens/<rank>.bin, tokens/<rank>.npy   token ids (int32) and TOKENS_DTYPE rows of surviving documents (tokenize)
    written/<rank>.json             what each write task wrote                (stage write)
    logs/<stage>/ (write: logs/write-<tasks>/)   datatrove's logs, stats and completion markers (what a re-run skips)

A task owns a contiguous range of input files (`rank_files`), so (rank, position) orders like (input file, line).
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


def rank_files(num_files: int, rank: int, world_size: int) -> range:
    """The contiguous block of input files task `rank` reads (some tasks get none when files < tasks)."""
    return range(num_files * rank // world_size, num_files * (rank + 1) // world_size)


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

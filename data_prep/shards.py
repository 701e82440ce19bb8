"""Tokenize documents into ArrayRecord shards: the heldout split, the shard plan, resumable writes.

Output contract (read by the training loader):
    <out>/<domain>/<split>/shard-{i:05d}-of-{n:05d}.array_record    split in {"train", "heldout"}
    one record = one document's token ids + EOS, as little-endian int32 bytes.

A document goes to "heldout" when the first 8 bytes of its content hash, read as a fraction of 2^64,
fall below `heldout_fraction`, so the split is stable under any re-ordering or re-run. Within a split
documents keep pipeline order and are cut into contiguous shards of about `shard_bytes` of UTF-8 text.

Resume: each shard is written atomically, then a hidden marker `.<shard name>.done` records its
fingerprint (tokenizer hash, EOS id, writer options, and the hash of every document in it) with the
document/token counts and the file size. A re-run skips a shard whose marker matches; any other shard
(missing, half-written, or planned from different inputs) is rewritten. Writes are deterministic,
so a skipped shard is byte-identical to the one a rewrite would produce.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from glm46_jax import atomic
from data_prep.documents import Document, text_digest
from data_prep.tokenizer import TokenizerInfo, encode_documents, encoder

SPLITS = ("train", "heldout")
DEFAULT_WRITER_OPTIONS = "group_size:1"  # one record per chunk: cheapest random access for the loader
SHARD_RE = re.compile(r"^shard-\d{5}-of-\d{5}\.array_record$")
_ENCODE_BATCH = 512  # documents per encode_batch call: bounds the memory of HF Encoding objects


def shard_name(index: int, count: int) -> str:
    return f"shard-{index:05d}-of-{count:05d}.array_record"


def marker_path(shard_path: str) -> str:
    head, tail = os.path.split(shard_path)
    return os.path.join(head, f".{tail}.done")


def is_heldout(digest: bytes, fraction: float) -> bool:
    return int.from_bytes(digest[:8], "little") < fraction * 2.0**64


def split_documents(docs: Sequence[Document], fraction: float) -> dict[str, list[Document]]:
    out: dict[str, list[Document]] = {split: [] for split in SPLITS}
    for doc in docs:
        out["heldout" if is_heldout(text_digest(doc.text), fraction) else "train"].append(doc)
    return out


@dataclasses.dataclass(frozen=True)
class ShardTask:
    path: str  # relative to the output directory (what metadata.json lists)
    texts: tuple[str, ...]
    fingerprint: str


def plan_shards(domain: str, split: str, docs: Sequence[Document], shard_bytes: int, tok: TokenizerInfo,
                writer_options: str) -> list[ShardTask]:
    """Contiguous groups of about `shard_bytes` of text; a document larger than that gets a shard alone."""
    if not docs:
        return []
    sizes = np.array([len(d.text.encode("utf-8")) for d in docs], np.int64)
    starts = np.cumsum(sizes) - sizes
    total = max(1, int(sizes.sum()))
    target = -(-total // shard_bytes)  # ceil: the number of shards if every document were divisible
    group = starts * target // total
    _, first, counts = np.unique(group, return_index=True, return_counts=True)  # drop empty groups
    tasks = []
    for index, (lo, n) in enumerate(zip(first.tolist(), counts.tolist(), strict=True)):
        group_docs = docs[lo:lo + n]
        h = hashlib.sha256(f"{tok.sha256}|{tok.eos_id}|{writer_options}|".encode())
        for d in group_docs:
            h.update(text_digest(d.text))
        tasks.append(ShardTask(os.path.join(domain, split, shard_name(index, len(first))),
                               tuple(d.text for d in group_docs), h.hexdigest()))
    return tasks


def read_marker(shard_path: str) -> dict[str, Any] | None:
    try:
        with open(marker_path(shard_path), encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None  # a marker that is absent or unreadable means "not done"


def is_done(shard_path: str, fingerprint: str) -> dict[str, Any] | None:
    """The marker of a complete shard written from exactly these inputs, else None."""
    marker = read_marker(shard_path)
    if marker is None or marker.get("fingerprint") != fingerprint:
        return None
    if not os.path.isfile(shard_path) or os.path.getsize(shard_path) != marker.get("bytes"):
        return None
    return marker


# --- worker side -------------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}  # per-process tokenizer, set once by `init_worker` (not pickled per task)


def init_worker(tok: TokenizerInfo, out_dir: str, writer_options: str) -> None:
    _WORKER.update(encoder=encoder(tok), eos_id=tok.eos_id, out_dir=out_dir, writer_options=writer_options)


def write_shard(task: ShardTask) -> dict[str, Any]:
    """Writes one shard (unless done) and returns {documents, tokens, skipped}."""
    path = os.path.join(_WORKER["out_dir"], task.path)
    if (marker := is_done(path, task.fingerprint)) is not None:
        return {"documents": marker["documents"], "tokens": marker["tokens"], "skipped": True}
    from array_record.python.array_record_module import ArrayRecordWriter

    tokens = 0
    with atomic.atomic_path(path) as tmp:
        writer = ArrayRecordWriter(tmp, _WORKER["writer_options"])
        for lo in range(0, len(task.texts), _ENCODE_BATCH):
            for ids in encode_documents(_WORKER["encoder"], task.texts[lo:lo + _ENCODE_BATCH], _WORKER["eos_id"]):
                writer.write(ids.astype("<i4").tobytes())
                tokens += ids.size
        writer.close()
    marker = {"fingerprint": task.fingerprint, "documents": len(task.texts), "tokens": tokens,
              "bytes": os.path.getsize(path)}
    atomic.write_json(marker_path(path), marker)
    return {"documents": len(task.texts), "tokens": tokens, "skipped": False}


def stale_shards(out_dir: str, planned: set[str]) -> list[str]:
    """Shard files under `out_dir` that the current plan does not contain (left by a differently
    configured run). Reported, not deleted: they may be someone's data."""
    stale = []
    for root, _, files in os.walk(out_dir):
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(root, name), out_dir)
            if SHARD_RE.match(name) and rel not in planned:
                stale.append(rel)
    return sorted(stale)

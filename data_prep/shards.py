"""After dedup: the tokenizer and the shard plan (one task), tokenization (a task per input range), and the final
deterministic step of ours that writes the ArrayRecord shards (any number of tasks).

Output contract (read by the training loader):
    <out>/<domain>/<split>/shard-{i:05d}-of-{n:05d}.array_record    split in {"train", "heldout"}
    one record = one document's token ids + EOS, as little-endian int32 bytes.

A document goes to "heldout" when the first 8 bytes of its content hash, read as a fraction of 2^64, fall below
`heldout_fraction`, so the split is stable under any re-ordering or re-run. Within a split documents keep input order
(input file, line) and are cut into contiguous shards of about `shard_bytes` of UTF-8 text: with T bytes in the split,
n = ceil(T / shard_bytes) and a document starting at byte s of the split goes to group floor(s * n / T); empty
groups (a document longer than a shard spans several) are dropped. The plan is a pass over the per-task indexes
(no text), so every write task knows which task files hold its shard; none holds the corpus.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator

import numpy as np
from datatrove.data import Document as DTDocument
from datatrove.data import DocumentsPipeline
from datatrove.io import get_datafolder
from datatrove.pipeline.base import PipelineStep

from data_prep.documents import text_digest
from data_prep.tokenizer import TokenizerInfo, encode_documents, encoder, load, trained
from data_prep.work import (
    TOKENS_DTYPE,
    Rows,
    load_array,
    load_json,
    removed,
    save_array,
    save_json,
    stored_texts,
    survivors,
)
from glm46_jax import atomic

SPLITS = ("train", "heldout")
DEFAULT_WRITER_OPTIONS = "group_size:1"  # one record per chunk: cheapest random access for the loader
SHARD_RE = re.compile(r"^shard-\d{5}-of-\d{5}\.array_record$")
# Documents per encode call, and text: HF Encoding objects cost ~100 bytes per token (ids, token strings, masks), so
# 512 documents of 3 KB with a 300-token BPE peaked at ~100 MB; a byte bound also caps a batch of 1 MB documents.
_ENCODE_BATCH, _ENCODE_BYTES = 512, 1 << 19


def shard_name(index: int, count: int) -> str:
    return f"shard-{index:05d}-of-{count:05d}.array_record"


def is_heldout(digest: bytes, fraction: float) -> bool:
    return int.from_bytes(digest[:8], "little") < fraction * 2.0**64


def in_sample(digest: bytes, fraction: float) -> bool:
    """The tokenizer's training sample: bytes 8-16 of the hash, independent of the split's bytes 0-8."""
    return int.from_bytes(digest[8:16], "little") < fraction * 2.0**64


def groups(starts: np.ndarray, total: int, target: int) -> np.ndarray:
    """floor(start * target / total), exactly (Python integers where int64 could overflow)."""
    if total * target < 2**62:
        return starts.astype(np.int64) * target // total
    return np.array([s * target // total for s in starts.tolist()], np.int64)


class PlanAndTokenizer(PipelineStep):
    """One task: per (domain, split) totals and shard groups from the indexes, and the tokenizer (loaded, or a
    byte-level BPE trained on a sample of at most `sample_bytes` of the deduplicated train split, in input order)."""

    name, type = "plan shards, tokenizer", "🔢 - TOKENIZER"

    def __init__(self, work: str, tasks: int, domains: list[str], shard_bytes: int, tokenizer_path: str | None,
                 eos_token: str, vocab_size: int, sample_bytes: int):
        super().__init__()
        self.work, self.tasks, self.domains, self.shard_bytes = work, tasks, domains, shard_bytes
        self.tokenizer_path, self.eos_token, self.vocab_size, self.sample_bytes = (
            tokenizer_path, eos_token, vocab_size, sample_bytes)

    def _kept_rows(self, folder, rank: int) -> np.ndarray:
        index = load_array(folder, f"index/{rank:05d}.npy")
        keep = np.ones(len(index), bool)
        keep[removed(folder, rank)] = False
        return index[keep]

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> None:
        folder = get_datafolder(self.work)
        keys = [(d, s) for d in range(len(self.domains)) for s in range(len(SPLITS))]
        per_rank = np.zeros((self.tasks, len(keys)), np.int64)  # bytes of each (domain, split) per task
        for r in range(self.tasks):
            rows = self._kept_rows(folder, r)
            np.add.at(per_rank[r], rows["domain"].astype(np.int64) * len(SPLITS) + rows["heldout"], rows["bytes"])
        totals = per_rank.sum(axis=0)
        prefix = np.cumsum(per_rank, axis=0) - per_rank
        plan = {"error": None, "splits": []}
        if not totals.any():
            plan["error"] = "every domain is empty"
            return save_json(folder, "plan.json", plan)
        targets = [-(-int(t) // self.shard_bytes) for t in totals]
        seen: list[dict[int, list[int]]] = [{} for _ in keys]  # group -> [first task, last task]
        for r in range(self.tasks):
            rows = self._kept_rows(folder, r)
            for k, (d, s) in enumerate(keys):
                mine = rows[(rows["domain"] == d) & (rows["heldout"] == s)]
                if len(mine):
                    starts = prefix[r, k] + np.cumsum(mine["bytes"].astype(np.int64)) - mine["bytes"]
                    for g in np.unique(groups(starts, int(totals[k]), targets[k])).tolist():
                        seen[k].setdefault(g, [r, r])[1] = r
        for k, (d, s) in enumerate(keys):
            plan["splits"].append({"domain": self.domains[d], "split": SPLITS[s], "total": int(totals[k]),
                                   "target": targets[k], "prefix": prefix[:, k].tolist(),
                                   "groups": sorted(seen[k]), "ranks": [seen[k][g] for g in sorted(seen[k])]})
        tok, sample = self._tokenizer(folder, int(totals[[k for k, (_, s) in enumerate(keys) if s == 0]].sum()))
        if tok is None:
            plan["error"] = ("every document left after filtering and deduplication fell in the heldout split: "
                             "none to train a tokenizer on")
        else:
            with folder.open("tokenizer.json", "w") as f:
                f.write(tok.json)
            plan["tokenizer"] = {"source": tok.source, "sample": sample}
        save_json(folder, "plan.json", plan)

    def _tokenizer(self, folder, train_bytes: int) -> tuple[TokenizerInfo | None, dict]:
        if self.tokenizer_path is not None:
            return load(self.tokenizer_path, self.eos_token), {}
        fraction = min(1.0, self.sample_bytes / max(train_bytes, 1))
        sample = {"fraction": fraction, "documents": 0, "bytes": 0}

        def texts() -> Iterator[str]:
            for r in range(self.tasks):
                for row, text in survivors(folder, r):
                    if not row["heldout"] and (fraction >= 1.0 or in_sample(text_digest(text), fraction)):
                        sample["documents"] += 1
                        sample["bytes"] += int(row["bytes"])
                        yield text

        if train_bytes == 0:
            return None, sample
        return trained(texts(), self.vocab_size), sample


class ReadStored(PipelineStep):
    """The task's stored documents, in order, for datatrove's `MinhashDedupFilter` (which counts positions)."""

    name, type = "read stored documents", "📖 - READER"

    def __init__(self, work: str):
        super().__init__()
        self.work = work

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        folder = get_datafolder(self.work)
        if load_json(folder, "plan.json")["error"]:
            return
        index = load_array(folder, f"index/{rank:05d}.npy")
        for position, text in enumerate(stored_texts(folder, rank)):
            yield DTDocument(text=text, id=str(position), metadata={"row": index[position]})


class Tokenize(PipelineStep):
    """Token ids + EOS of the surviving documents: `tokens/<rank>.bin` (int32) and `tokens/<rank>.npy` rows."""

    name, type = "tokenize", "🔢 - TOKENIZER"

    def __init__(self, work: str):
        super().__init__()
        self.work = work

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> None:
        folder = get_datafolder(self.work)
        info = load(f"{self.work}/tokenizer.json")
        tok, rows, batch, start = encoder(info), Rows(TOKENS_DTYPE), [], 0
        with folder.open(f"tokens/{rank:05d}.bin", "wb") as out:
            def flush() -> None:
                nonlocal start
                for doc, ids in zip(batch, encode_documents(tok, [d.text for d in batch], info.eos_id), strict=True):
                    row = doc.metadata["row"]
                    rows.append((row["domain"], row["heldout"], row["bytes"], start, ids.size))
                    out.write(ids.astype("<i4").tobytes())
                    start += ids.size
                batch.clear()

            text_bytes = 0
            for doc in data or ():
                batch.append(doc)
                text_bytes += int(doc.metadata["row"]["bytes"])
                if len(batch) == _ENCODE_BATCH or text_bytes >= _ENCODE_BYTES:
                    flush()
                    text_bytes = 0
            flush()
        save_array(folder, f"tokens/{rank:05d}.npy", rows.array())


def shard_list(plan: dict) -> list[tuple[dict, int]]:
    """(split entry, shard index) of every shard of the dataset, in (domain, split, index) order."""
    return [(entry, i) for entry in plan["splits"] for i in range(len(entry["groups"]))]


class WriteShards(PipelineStep):
    """Task w of W writes shards w, w+W, ... of `shard_list`; each shard atomically (a local temp file, then
    a rename or an fsspec upload), so a killed task leaves no partial shard under its final name."""

    name, type = "write ArrayRecord shards", "💽 - WRITER"

    def __init__(self, work: str, out: str, writer_options: str):
        super().__init__()
        self.work, self.out, self.writer_options = work, out, writer_options

    def _records(self, folder, entry: dict, index: int) -> Iterator[bytes]:
        """The shard's records, read one by one from the token files (a task's file can be far larger than memory)."""
        group = entry["groups"][index]
        domain, heldout = entry["domain_id"], SPLITS.index(entry["split"])
        first, last = entry["ranks"][index]
        for r in range(first, last + 1):
            rows = load_array(folder, f"tokens/{r:05d}.npy")
            mine = rows[(rows["domain"] == domain) & (rows["heldout"] == heldout)]
            starts = entry["prefix"][r] + np.cumsum(mine["bytes"].astype(np.int64)) - mine["bytes"]
            chosen = mine[groups(starts, entry["total"], entry["target"]) == group]
            if not len(chosen):
                continue
            with folder.open(f"tokens/{r:05d}.bin", "rb") as f:
                for start, tokens in zip(chosen["start"].tolist(), chosen["tokens"].tolist(), strict=True):
                    f.seek(4 * start)
                    yield f.read(4 * tokens)

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> None:
        from array_record.python.array_record_module import ArrayRecordWriter

        folder, out = get_datafolder(self.work), get_datafolder(self.out)
        plan = load_json(folder, "plan.json")
        if plan["error"]:
            return
        domains = list(dict.fromkeys(e["domain"] for e in plan["splits"]))
        written = {}
        for entry, i in shard_list(plan)[rank::world_size]:
            entry = {**entry, "domain_id": domains.index(entry["domain"])}
            path = f"{entry['domain']}/{entry['split']}/{shard_name(i, len(entry['groups']))}"
            local = os.path.join(self.out, path) if "://" not in self.out else None
            if local:
                os.makedirs(os.path.dirname(local), exist_ok=True)
            if local:
                tmp = atomic.temp_path(local)
            else:  # ArrayRecord writes local files: write one, then upload it whole
                with tempfile.NamedTemporaryFile(suffix=".array_record", delete=False) as f:
                    tmp = f.name
            documents = tokens = 0
            writer = ArrayRecordWriter(tmp, self.writer_options)
            for record in self._records(folder, entry, i):
                writer.write(record)
                documents += 1
                tokens += len(record) // 4
            writer.close()
            if local:
                atomic.commit(tmp, local)
            else:
                out.put_file(tmp, path)
                os.remove(tmp)
            written[path] = {"documents": documents, "tokens": tokens}
        save_json(folder, f"written/{rank:05d}.json", written)


def stale_shards(out_dir: str, planned: set[str]) -> list[str]:
    """Shard files under a local `out_dir` that this run's plan does not contain (left by a differently configured
    run). Reported, not deleted: they may be someone's data."""
    stale = []
    for root, dirs, files in os.walk(out_dir):
        dirs[:] = [d for d in dirs if not d.startswith("_")]  # the work folder
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(root, name), out_dir)
            if SHARD_RE.match(name) and rel not in planned:
                stale.append(rel)
    return sorted(stale)

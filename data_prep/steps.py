"""Our datatrove pipeline blocks for the first stage: read -> clean -> quality rules -> store + MinHash signatures.

Each block is a `datatrove.pipeline.base.PipelineStep`, so any datatrove executor runs it (local, Slurm, Ray). A task
(rank) owns a contiguous byte range of the input files laid end to end (slices.py: one big file spreads over many
tasks), so ordering documents by (rank, position in the task) is ordering them by (input file, line): the survivor rule of dedup and the order inside shards follow from that, for any task
count. Per-domain counts are written by each block to `<work>/counts/<block>/<rank>.json` and summed by the last stage.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from datatrove.data import Document as DTDocument
from datatrove.data import DocumentsPipeline
from datatrove.io import get_datafolder
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup.minhash import MinhashDedupSignature
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.utils.word_tokenizers import WordTokenizer

from data_prep import clean as clean_mod
from data_prep import minhash, quality
from data_prep.dedup import exact_key
from data_prep.documents import Malformed, text_digest
from data_prep.inputs import ReaderOptions, ReadTask, is_blank, label, read_piece
from data_prep.shards import is_heldout
from data_prep.slices import task_pieces
from data_prep.work import INDEX_DTYPE, Rows, save_array, save_json


class Counted(PipelineStep):
    """A block that counts per domain and saves its counts when its task ends."""

    key = "counted"

    def __init__(self, work: str):
        super().__init__()
        self.work = work

    def save_counts(self, rank: int, counts: dict[str, Any]) -> None:
        save_json(get_datafolder(self.work), f"counts/{self.key}/{rank:05d}.json", counts)


class ReadInputs(Counted):
    """Our readers (JSONL, Parquet, text, TFDS; local paths or fsspec URLs), streamed over the task's pieces of the
    input (slices.py); malformed input is counted and its first `max_reports` locations kept, never raised.

    A piece may start mid-file, so reports carry the line within the piece, and each piece's line count is saved:
    `pipeline.collect_stats` turns them into file lines, and decides which files are empty (only blank units in
    every piece), in task order."""

    name, type, key = "read inputs", "📖 - READER", "ingest"

    def __init__(self, work: str, tasks: Sequence[ReadTask], reader: ReaderOptions, max_reports: int):
        super().__init__(work)
        self.tasks, self.reader, self.max_reports = list(tasks), reader, max_reports

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        counts: dict[str, dict[str, int]] = {}
        reports: dict[bool, list[dict]] = {False: [], True: []}  # the first max_reports of others / blank lines
        kinds: Counter[str] = Counter()
        files: dict[str, dict[str, Any]] = {}
        for piece in task_pieces(self.tasks, self.reader, rank, world_size):
            task = self.tasks[piece.file]
            domain = counts.setdefault(task.domain, {"files": 0, "documents": 0, "malformed": 0})
            domain["files"] += piece.first
            seen = files[str(piece.file)] = {"domain": task.domain, "path": label(task), "lines": 0, "nonblank": 0,
                                             "blank": 0}
            ordinal = 0
            for item in read_piece(task, self.reader, piece.start, piece.end):
                seen["lines"] += 1
                blank = is_blank(item, task, self.reader)
                seen["nonblank"] += not blank
                if isinstance(item, Malformed):
                    domain["malformed"] += 1
                    kinds[item.kind] += 1
                    seen["blank"] += blank
                    if len(reports[blank]) < self.max_reports:
                        reports[blank].append({"file": piece.file, "line": item.line, "path": item.file,
                                               "kind": item.kind, "message": item.message})
                    continue
                domain["documents"] += 1
                self.stat_update("documents")
                yield DTDocument(text=item.text, id=f"{piece.file}:{piece.start}:{ordinal}",
                                 metadata={"domain": task.domain, "file": piece.file, "ord": ordinal})
                ordinal += 1
        section = {"count": sum(kinds.values()), "by_kind": dict(sorted(kinds.items())),
                   "reports": reports[False], "blank_reports": reports[True]}
        self.save_counts(rank, {"domains": counts, "malformed": section, "files": files})


class Clean(Counted):
    """Our normalisation (clean.py); documents left empty are dropped and counted."""

    name, type, key = "clean", "✂️ - FORMAT", "clean"

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        counts: dict[str, dict[str, int]] = {}
        for doc in data:
            c = counts.setdefault(doc.metadata["domain"], {"documents": 0, "changed": 0, "empty": 0, "kept": 0})
            c["documents"] += 1
            text = clean_mod.clean_text(doc.text)
            c["changed"] += text != doc.text
            if not text.strip():
                c["empty"] += 1
                continue
            c["kept"] += 1
            doc.text = text
            yield doc
        self.save_counts(rank, {"domains": counts})


class QualityRule(BaseFilter):
    """One of our quality rules as a datatrove filter, with each domain's own limit (`None`: off for it).

    A document is removed by the first rule it fails: the rules are chained in `quality.RULE_ORDER`."""

    type = "🔻 - FILTER"

    def __init__(self, work: str, rule: str, rules: dict[str, quality.QualityRules]):
        super().__init__()
        self.work, self.rule, self.rules = work, rule, rules
        self.name = rule

    def filter(self, doc: DTDocument) -> bool:
        domain = doc.metadata["domain"]
        rules = self.rules[domain]
        failed = getattr(rules, self.rule) is not None and quality.fails(self.rule, doc.text, rules,
                                                                         doc.metadata.setdefault("words", {}))
        self.removed[domain] += failed
        return not failed

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        self.removed = dict.fromkeys(self.rules, 0)
        yield from super().run(data, rank, world_size)
        save_json(get_datafolder(self.work), f"counts/filter.{self.rule}/{rank:05d}.json", {"removed": self.removed})


def quality_blocks(work: str, rules: dict[str, quality.QualityRules]) -> list[QualityRule]:
    """One block per rule that any domain uses, in the order a document is tested."""
    used = [r for r in quality.RULE_ORDER if any(getattr(rs, r) is not None for rs in rules.values())]
    return [QualityRule(work, r, rules) for r in used]


class Store(PipelineStep):
    """Writes the task's surviving documents (`docs/<rank>.jsonl.gz`) and their index (`index/<rank>.npy`),
    and passes them on to the signature block."""

    name, type = "store", "💽 - WRITER"

    def __init__(self, work: str, domains: Sequence[str], heldout_fraction: float):
        super().__init__()
        self.work, self.domains, self.heldout_fraction = work, list(domains), heldout_fraction

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        folder = get_datafolder(self.work)
        rows = Rows(INDEX_DTYPE)
        with folder.open(f"docs/{rank:05d}.jsonl.gz", "wt", compression="gzip") as f:
            for doc in data:
                doc.metadata.pop("words", None)
                f.write(json.dumps({"text": doc.text}, ensure_ascii=False) + "\n")
                rows.append((doc.metadata["file"], doc.metadata["ord"], self.domains.index(doc.metadata["domain"]),
                             len(doc.text.encode("utf-8")), is_heldout(text_digest(doc.text), self.heldout_fraction),
                             exact_key(doc.text)))
                yield doc
        save_array(folder, f"index/{rank:05d}.npy", rows.array())


class _Words(WordTokenizer):
    """`\\w+` words: what our shingles use. Given to datatrove so it loads no language model (no download)."""

    def __init__(self):
        super().__init__("words")

    def word_tokenize(self, text: str) -> list[str]:
        return minhash.words(text)

    def sent_tokenize(self, text: str) -> list[str]:
        return [text]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [(0, len(text))]


class Signatures(MinhashDedupSignature):
    """datatrove's MinHash signature stage with our shingles: `--shingle word|char` n-grams hashed in one vectorised
    pass (minhash.shingle_hashes; datatrove hashes each n-gram string in Python, several times slower)."""

    def __init__(self, work: str, cfg: minhash.MinHashConfig):
        super().__init__(f"{work}/sigs", config=minhash.datatrove_config(cfg), language=_Words())
        self.shingle, self.ngram = cfg.shingle, cfg.ngram

    def get_shingles(self, text: str) -> np.ndarray:
        hashes = minhash.shingle_hashes(text, self.shingle, self.ngram)
        if hashes.size == 0:  # no word at all: the whole text is the one shingle, so exact copies still meet
            hashes = np.array([int.from_bytes(exact_key(text)[:4], "little")], np.uint64)
        return hashes.reshape(-1, 1)


def first_stage(work: str, tasks: Sequence[ReadTask], reader: ReaderOptions, max_reports: int,
                rules: dict[str, quality.QualityRules], domains: Sequence[str], heldout_fraction: float,
                cfg: minhash.MinHashConfig) -> list[Callable]:
    return [ReadInputs(work, tasks, reader, max_reports), Clean(work), *quality_blocks(work, rules),
            Store(work, domains, heldout_fraction), Signatures(work, cfg)]

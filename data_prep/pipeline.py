"""The stages as functions over document lists, and `run_pipeline`, which chains them in memory.

    ingest -> clean -> quality_filter -> deduplicate -> build_tokenizer -> write_dataset

Every stage returns `(documents, stats)`; stats are merged with `merge_stats` and end up, with each
stage's configuration, in `<out>/metadata.json`. The CLI runs a stage alone by saving/loading the
document list as a document set (`documents.save_docset`) between commands.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from data_prep import dedup, minhash, parallel, quality, report, shards
from data_prep import clean as clean_mod
from data_prep.documents import Document, by_domain
from data_prep.inputs import ReaderOptions, expand_inputs, read_task
from data_prep.tokenizer import EOS_TOKEN, TokenizerInfo, load, trained
from glm46_jax import atomic
from glm46_jax.cli import InputError

Stats = dict[str, Any]
METADATA_VERSION = 1


@dataclasses.dataclass(frozen=True)
class WriteOptions:
    heldout_fraction: float = 0.01
    shard_bytes: int = 64 << 20  # UTF-8 text per shard (the int32 shard is ~1.5x that with a small vocab)
    writer_options: str = shards.DEFAULT_WRITER_OPTIONS

    def __post_init__(self):
        if not 0.0 <= self.heldout_fraction <= 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1], got {self.heldout_fraction}")
        if self.shard_bytes < 1:
            raise ValueError(f"shard_bytes must be positive, got {self.shard_bytes}")


@dataclasses.dataclass(frozen=True)
class TokenizerOptions:
    path: str | None = None  # an existing tokenizer.json; None: train a byte-level BPE
    vocab_size: int = 512
    eos_token: str = EOS_TOKEN


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    inputs: tuple[tuple[str, str], ...]  # (domain, path/glob/dir/tfds:NAME@SPLIT)
    out: str
    reader: ReaderOptions = ReaderOptions()
    rule_overrides: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    minhash: minhash.MinHashConfig = minhash.MinHashConfig()
    tokenizer: TokenizerOptions = TokenizerOptions()
    write: WriteOptions = WriteOptions()
    workers: int = 1  # not part of any output: results are identical for every worker count
    max_reports: int = 1000


def merge_stats(stats: Stats, new: Stats) -> Stats:
    """`new` stage sections replace old ones; the per-stage "config" sections accumulate."""
    return {**stats, **new, "config": {**stats.get("config", {}), **new.get("config", {})}}


def ingest(inputs: tuple[tuple[str, str], ...], reader: ReaderOptions, workers: int = 1,
           max_reports: int = 1000) -> tuple[list[Document], list[str], Stats]:
    """(documents in input order, domain order, stats) -- raises only for inputs that do not exist."""
    tasks = expand_inputs(list(inputs), reader)
    domains = list(dict.fromkeys(domain for domain, _ in inputs))
    per_domain = {d: {"files": 0, "documents": 0, "malformed": 0} for d in domains}
    docs, bad = [], []
    results = parallel.imap(read_task, tasks, workers, "read", extra=(reader,))
    for task, (task_docs, task_bad) in zip(tasks, results, strict=True):
        add = {"files": 1, "documents": len(task_docs), "malformed": len(task_bad)}
        report.add_counts(per_domain[task.domain], add)
        docs += task_docs
        bad += task_bad
    config = {"inputs": [list(i) for i in inputs], "reader": dataclasses.asdict(reader)}
    stats = {"ingest": per_domain, "malformed": report.malformed_section(bad, max_reports),
             "config": {"ingest": config}}
    return docs, domains, stats


def clean(docs: list[Document], workers: int = 1) -> tuple[list[Document], Stats]:
    parts = parallel.map_chunks(clean_mod.clean_documents, docs, workers, "clean")
    counts: Stats = {}
    for _, part in parts:
        report.add_counts(counts, part)
    return [d for part_docs, _ in parts for d in part_docs], {"clean": counts}


def quality_filter(docs: list[Document], domains: list[str], overrides: dict[str, dict[str, Any]],
                   workers: int = 1) -> tuple[list[Document], Stats]:
    if unknown := sorted(set(overrides) - set(domains)):
        raise InputError(f"quality rules name domain(s) {unknown} that no --input has; domains: {domains}")
    rules = {d: quality.rules_for(d, overrides) for d in domains}
    parts = parallel.map_chunks(quality.filter_documents, docs, workers, "filter", extra=(rules,))
    counts: Stats = {d: {"documents": 0, "kept": 0, "removed": dict.fromkeys(r.rule_names, 0)}
                     for d, r in rules.items()}
    for _, part in parts:
        report.add_counts(counts, part)
    config = {d: dataclasses.asdict(r) for d, r in rules.items()}
    return [d for part_docs, _ in parts for d in part_docs], {"filter": counts, "config": {"filter": config}}


def deduplicate(docs: list[Document], cfg: minhash.MinHashConfig, workers: int = 1) -> tuple[list[Document], Stats]:
    kept, stats = dedup.deduplicate(docs, cfg, workers)
    return kept, {"dedup": stats, "config": {"dedup": dataclasses.asdict(cfg)}}


def build_tokenizer(docs: list[Document], opts: TokenizerOptions, heldout_fraction: float) -> TokenizerInfo:
    """Loads `opts.path`, or trains on the *train* split only, so heldout text stays unseen by every
    learned component."""
    if opts.path is not None:
        return load(opts.path, opts.eos_token)
    texts = shards.split_documents(docs, heldout_fraction)["train"]
    if not texts:
        raise InputError(f"every document left after filtering and deduplication fell in the heldout split "
                         f"(heldout_fraction {heldout_fraction}): none to train a tokenizer on")
    return trained([d.text for d in texts], opts.vocab_size)


def domain_stages(stats: Stats, domain: str) -> Stats:
    """One domain's counts from every stage so far, keyed as metadata.json lists them under the domain."""
    entry = {stage: stats.get(stage, {}).get(domain, {}) for stage in ("ingest", "clean", "filter")}
    entry["dedup"] = stats.get("dedup", {}).get("per_domain", {}).get(domain, {})
    return entry


def require_documents(docs: list[Document], domains: list[str], stats: Stats) -> None:
    """A domain that lost every document is only a warning (the others still make a dataset); when all
    of them did, there is no dataset to write, and each domain's counts say which rule or input to fix."""
    if not docs:
        reasons = "; ".join(report.empty_domain_reason(d, domain_stages(stats, d)) for d in domains)
        raise InputError(f"every domain is empty, so no dataset was written: {reasons}")


Plan = dict[tuple[str, str], list[shards.ShardTask]]  # (domain, split) -> its shards, in order


def plan_dataset(docs: list[Document], domains: list[str], tok: TokenizerInfo, opts: WriteOptions) -> Plan:
    grouped = by_domain(docs)
    plan: Plan = {}
    for domain in domains:
        for split, split_docs in shards.split_documents(grouped.get(domain, []), opts.heldout_fraction).items():
            plan[domain, split] = shards.plan_shards(domain, split, split_docs, opts.shard_bytes, tok,
                                                     opts.writer_options)
    return plan


def dataset_metadata(plan: Plan, results: dict[str, dict[str, Any]], stats: Stats, tok: TokenizerInfo,
                     opts: WriteOptions, stale: list[str]) -> Stats:
    """The content of metadata.json (README.md documents every field)."""
    domains: dict[str, Any] = {}
    for (domain, split), tasks in plan.items():
        domains.setdefault(domain, {})[split] = {
            "documents": sum(results[t.path]["documents"] for t in tasks),
            "tokens": sum(results[t.path]["tokens"] for t in tasks),
            "shards": [t.path for t in tasks],
        }
    for domain, entry in domains.items():
        entry.update(domain_stages(stats, domain))
        entry["empty"] = not any(entry[split]["documents"] for split in shards.SPLITS)
    return {
        "version": METADATA_VERSION,
        "record_format": {"dtype": "<i4", "content": "one document's token ids followed by eos_id",
                          "layout": "<domain>/<split>/shard-{i:05d}-of-{n:05d}.array_record",
                          "splits": list(shards.SPLITS), "writer_options": opts.writer_options},
        "domains": domains,
        "dedup": {k: v for k, v in stats.get("dedup", {}).items() if k != "per_domain"},
        "malformed": stats.get("malformed", report.malformed_section([], 0)),
        "tokenizer": tok.metadata(),
        "config": {**stats.get("config", {}), "tokenizer": {"source": tok.source, "eos_token": tok.eos_token},
                   "write": dataclasses.asdict(opts)},
        "stale_shards": stale,
    }


def write_dataset(docs: list[Document], domains: list[str], tok: TokenizerInfo, opts: WriteOptions, out: str,
                  stats: Stats, workers: int = 1) -> tuple[Stats, dict[str, int]]:
    """Writes tokenizer.json, every shard (skipping completed ones) and finally metadata.json.

    Returns (the metadata, {shards_written, shards_skipped}); the counts differ between a fresh run
    and a resumed one, so they are not part of the (deterministic) metadata file."""
    require_documents(docs, domains, stats)
    os.makedirs(out, exist_ok=True)
    metadata_path = os.path.join(out, "metadata.json")
    if os.path.exists(metadata_path):
        os.remove(metadata_path)  # metadata.json present <=> the dataset is complete and consistent
    atomic.write_text(os.path.join(out, "tokenizer.json"), tok.json)

    plan = plan_dataset(docs, domains, tok, opts)
    tasks = [t for split_tasks in plan.values() for t in split_tasks]
    written = parallel.imap(shards.write_shard, tasks, workers, "shards", initializer=shards.init_worker,
                            initargs=(tok, out, opts.writer_options))
    results = {t.path: r for t, r in zip(tasks, written, strict=True)}

    stale = shards.stale_shards(out, set(results))
    meta = dataset_metadata(plan, results, stats, tok, opts, stale)
    atomic.write_json(metadata_path, meta)
    skipped = sum(r["skipped"] for r in results.values())
    return meta, {"shards_written": len(results) - skipped, "shards_skipped": skipped}


def run_pipeline(cfg: PipelineConfig) -> tuple[Stats, dict[str, int]]:
    """All stages in memory; returns what `write_dataset` returns."""
    docs, domains, stats = ingest(cfg.inputs, cfg.reader, cfg.workers, cfg.max_reports)
    docs, new = clean(docs, cfg.workers)
    stats = merge_stats(stats, new)
    docs, new = quality_filter(docs, domains, cfg.rule_overrides, cfg.workers)
    stats = merge_stats(stats, new)
    docs, new = deduplicate(docs, cfg.minhash, cfg.workers)
    stats = merge_stats(stats, new)
    require_documents(docs, domains, stats)
    tok = build_tokenizer(docs, cfg.tokenizer, cfg.write.heldout_fraction)
    return write_dataset(docs, domains, tok, cfg.write, cfg.out, stats, cfg.workers)

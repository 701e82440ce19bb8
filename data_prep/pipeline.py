"""The data pipeline as datatrove stages, run by a datatrove executor (local processes, Slurm array jobs or Ray).

    prepare  (T tasks)   read -> clean -> quality rules -> store + MinHash signatures      steps.py
    buckets  (B tasks)   datatrove MinhashDedupBuckets, one task per band                  (datatrove)
    dedup    (1 task)    verify candidates + cluster; shard plan; tokenizer                 dedup.py, shards.py
    tokenize (T tasks)   stored documents -> datatrove MinhashDedupFilter -> token ids      shards.py
    write    (W tasks)   the ArrayRecord shards                                             shards.py
    finalize (1 task)    tokenizer.json + metadata.json (last: present <=> complete)        here

Every stage's intermediate files live in `<work>/<hash of everything that shapes the output>/` (work.py), and datatrove
records each finished task there, so re-running the same command skips what is done and a changed configuration
starts afresh. The dataset does not depend on T or W (tested).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import fsspec
from datatrove.data import DocumentsPipeline
from datatrove.io import get_datafolder
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup.minhash import MinhashDedupBuckets, MinhashDedupFilter

from data_prep import minhash, peak, quality, report, shards, slices, steps
from data_prep.dedup import VerifyAndCluster
from data_prep.inputs import ReaderOptions, ReadTask, empty_file, expand_inputs, measured
from data_prep.tokenizer import EOS_TOKEN, load
from data_prep.work import load_json
from glm46_jax import atomic
from glm46_jax.errors import InputError

Stats = dict[str, Any]
METADATA_VERSION = 1
STAGES = ("prepare", "buckets", "dedup", "tokenize", "write", "finalize")
TASK_BYTES = 256 << 20  # default tasks: the input files, or the input in slices of this many bytes if more


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
    sample_bytes: int = 1 << 30  # the trained BPE sees at most about this much of the train split


@dataclasses.dataclass(frozen=True)
class ExecutorOptions:
    """How the stages run; never part of the output (any of them gives the same bytes)."""

    kind: str = "local"  # "local" | "slurm" | "ray"
    workers: int = 1  # local: processes; ray: concurrent tasks
    tasks: int | None = None  # prepare/tokenize tasks; None: max(input files, input / TASK_BYTES), at most 1000
    write_tasks: int | None = None  # None: as many as tasks
    partition: str = "cpu"  # slurm
    time: str = "04:00:00"
    cpus_per_task: int = 1
    mem_per_cpu_gb: float = 2.0
    slurm_logs: str | None = None  # None: <work>/slurm_logs
    job_name: str = "data_prep"


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    inputs: tuple[tuple[str, str], ...]  # (domain, path/glob/dir/URL/tfds:NAME@SPLIT)
    out: str
    reader: ReaderOptions = ReaderOptions()
    rule_overrides: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    minhash: minhash.MinHashConfig = minhash.MinHashConfig()
    tokenizer: TokenizerOptions = TokenizerOptions()
    write: WriteOptions = WriteOptions()
    executor: ExecutorOptions = ExecutorOptions()
    work: str | None = None  # None: <out>/_work
    max_reports: int = 1000


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything a run needs that is decided before any task starts."""

    files: list[ReadTask]
    domains: list[str]
    rules: dict[str, quality.QualityRules]
    tasks: int
    write_tasks: int
    work: str  # the hashed work folder of this configuration


def _file_stamp(task: ReadTask) -> list:
    """Size and modification time (or ETag): a re-run after an input file changed must not reuse old tasks."""
    if task.kind == "tfds":
        return [task.domain, task.kind, task.path]
    path = task.path
    info = fsspec.core.url_to_fs(path)[0].info(path)
    return [task.domain, task.kind, path, task.size, list(task.row_groups),
            str(info.get("mtime") or info.get("LastModified") or info.get("ETag"))]


def make_plan(cfg: PipelineConfig) -> Plan:
    """Checks what can be checked before any work (inputs exist, rules are valid) and fixes the work folder."""
    files = [measured(f) for f in expand_inputs(list(cfg.inputs), cfg.reader)]
    domains = list(dict.fromkeys(domain for domain, _ in cfg.inputs))
    if unknown := sorted(set(cfg.rule_overrides) - set(domains)):
        raise InputError(f"quality rules name domain(s) {unknown} that no --input has; domains: {domains}")
    rules = {d: quality.rules_for(d, cfg.rule_overrides) for d in domains}
    total = sum(slices.weight(f) for f in files)
    tasks = cfg.executor.tasks or min(max(len(files), -(-total // TASK_BYTES)), 1000)
    if tasks < 1:
        raise InputError(f"--tasks {tasks}: must be >= 1")
    if cfg.tokenizer.path is not None:
        load(cfg.tokenizer.path, cfg.tokenizer.eos_token)  # a bad tokenizer fails now, not in a task
    shape = {"files": [_file_stamp(f) for f in files], "tasks": tasks,
             "config": config_section(cfg, rules),
             "tokenizer_sha": load(cfg.tokenizer.path).sha256 if cfg.tokenizer.path else None,
             "sample_bytes": cfg.tokenizer.sample_bytes, "max_reports": cfg.max_reports}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]
    work = f"{(cfg.work or cfg.out.rstrip('/') + '/_work').rstrip('/')}/{digest}"
    return Plan(files, domains, rules, tasks, cfg.executor.write_tasks or tasks, work)


def config_section(cfg: PipelineConfig, rules: dict[str, quality.QualityRules]) -> Stats:
    return {"ingest": {"inputs": [list(i) for i in cfg.inputs], "reader": dataclasses.asdict(cfg.reader)},
            "filter": {d: dataclasses.asdict(r) for d, r in rules.items()},
            "dedup": dataclasses.asdict(cfg.minhash),
            "write": dataclasses.asdict(cfg.write)}


def stage_pipelines(cfg: PipelineConfig, plan: Plan) -> dict[str, tuple[list, int]]:
    """{stage: (datatrove pipeline, tasks)}, in run order; every task records its peak RSS (peak.py)."""
    return {stage: (peak.wrapped(plan.work, stage, pipeline), tasks)
            for stage, (pipeline, tasks) in _stages(cfg, plan).items()}


def _stages(cfg: PipelineConfig, plan: Plan) -> dict[str, tuple[list, int]]:
    work, dt = plan.work, minhash.datatrove_config(cfg.minhash)
    tok = cfg.tokenizer
    return {
        "prepare": (steps.first_stage(work, plan.files, cfg.reader, cfg.max_reports, plan.rules, plan.domains,
                                      cfg.write.heldout_fraction, cfg.minhash), plan.tasks),
        "buckets": ([MinhashDedupBuckets(f"{work}/sigs", f"{work}/buckets", config=dt)], dt.num_buckets),
        "dedup": ([VerifyAndCluster(work, cfg.minhash, plan.tasks, plan.domains),
                   shards.PlanAndTokenizer(work, plan.tasks, plan.domains, cfg.write.shard_bytes, tok.path,
                                           tok.eos_token, tok.vocab_size, tok.sample_bytes)], 1),
        "tokenize": ([shards.ReadStored(work), MinhashDedupFilter(f"{work}/remove"), shards.Tokenize(work)],
                     plan.tasks),
        "write": ([shards.WriteShards(work, cfg.out, cfg.write.writer_options)], plan.write_tasks),
        "finalize": ([Finalize(work, cfg.out, config_section(cfg, plan.rules), tok, cfg.max_reports)], 1),
    }


# --- statistics and metadata -------------------------------------------------------------------------

def _summed(folder, block: str) -> list[Stats]:
    return [load_json(folder, p) for p in sorted(folder.list_files(f"counts/{block}", glob_pattern="*.json"))]


def collect_stats(work: str, rules: dict[str, list[str]], max_reports: int) -> Stats:
    """Per-domain counts of every stage before dedup (as metadata.json lists them under each domain; `rules`: each
    domain's active rules) and the malformed-input section: reports get their file lines (the lines of the file's
    pieces in earlier tasks added), and a file with nothing but blank units in every piece one `empty_file` report
    in place of its blank-line ones."""
    folder = get_datafolder(work)
    per = {d: {"ingest": {"files": 0, "documents": 0, "malformed": 0},
               "clean": {"documents": 0, "changed": 0, "empty": 0, "kept": 0}} for d in rules}
    reports, kinds, count = [], {}, 0
    lines: dict[str, int] = {}  # file -> lines read by earlier tasks
    files: dict[str, Stats] = {}
    for part in _summed(folder, "ingest"):
        for d, c in part["domains"].items():
            report.add_counts(per[d]["ingest"], c)
        offset = {}
        for f, seen in part["files"].items():
            offset[f] = lines.get(f, 0)
            lines[f] = offset[f] + seen["lines"]
            report.add_counts(files.setdefault(f, {"domain": seen["domain"], "path": seen["path"]}),
                              {"nonblank": seen["nonblank"], "blank": seen["blank"]})
        for r in part["malformed"]["reports"] + part["malformed"]["blank_reports"]:
            reports.append((r["file"], offset[str(r["file"])] + r["line"], r))
        report.add_counts(kinds, part["malformed"]["by_kind"])
        count += part["malformed"]["count"]
    for f, seen in files.items():
        if not seen["nonblank"]:
            reports = [x for x in reports if not (x[0] == int(f) and x[2]["kind"] == "blank_line")]
            reports.append((int(f), 1, {"path": seen["path"], **empty_file(seen["path"]).to_json()}))
            report.add_counts(kinds, {"blank_line": -seen["blank"], "empty_file": 1})
            per[seen["domain"]]["ingest"]["malformed"] += 1 - seen["blank"]
            count += 1 - seen["blank"]
    for part in _summed(folder, "clean"):
        for d, c in part["domains"].items():
            report.add_counts(per[d]["clean"], c)
    by_rule = {r: _summed(folder, f"filter.{r}") for r in quality.RULE_ORDER}
    for d, active in rules.items():
        removed = {r: sum(p["removed"].get(d, 0) for p in by_rule[r]) for r in active}
        documents = per[d]["clean"]["kept"]
        per[d]["filter"] = {"documents": documents, "kept": documents - sum(removed.values()), "removed": removed}
    reports.sort(key=lambda x: (x[0], x[1]))
    shown = [{"location": f"{r['path']}:{line}", "kind": r["kind"], "message": r["message"]}
             for _, line, r in reports[:max_reports]]
    malformed = {"count": count, "by_kind": {k: n for k, n in sorted(kinds.items()) if n}, "reports": shown,
                 "reports_left_out": max(0, count - max_reports)}
    return {"domains": per, "malformed": malformed}


def active_rules(config: Stats) -> dict[str, list[str]]:
    """Each domain's rules that are on, in test order, from the config section's `filter` entry."""
    return {d: [r for r in quality.RULE_ORDER if r in fields and fields[r] is not None]
            for d, fields in config["filter"].items()}


class Finalize(PipelineStep):
    """tokenizer.json, then metadata.json (README.md documents every field), from the work folder's records."""

    name, type = "metadata.json", "💽 - WRITER"

    def __init__(self, work: str, out: str, config: Stats, tokenizer: TokenizerOptions, max_reports: int):
        super().__init__()
        self.work, self.out, self.config, self.tokenizer, self.max_reports = work, out, config, tokenizer, max_reports

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> None:
        folder = get_datafolder(self.work)
        plan = load_json(folder, "plan.json")
        if plan["error"]:
            return
        source = self.tokenizer.path or "trained"
        tok = dataclasses.replace(load(f"{self.work}/tokenizer.json", self.tokenizer.eos_token), source=source)
        write_text(self.out, "tokenizer.json", tok.json)  # the exact bytes: a loaded tokenizer is copied as is
        written: dict[str, Stats] = {}
        for p in sorted(folder.list_files("written", glob_pattern="*.json")):
            written.update(load_json(folder, p))
        stats = collect_stats(self.work, active_rules(self.config), self.max_reports)
        dedup = load_json(folder, "dedup.json")
        domains: dict[str, Any] = {}
        for entry in plan["splits"]:
            n = len(entry["groups"])
            paths = [f"{entry['domain']}/{entry['split']}/{shards.shard_name(i, n)}" for i in range(n)]
            domains.setdefault(entry["domain"], {})[entry["split"]] = {
                "documents": sum(written[p]["documents"] for p in paths),
                "tokens": sum(written[p]["tokens"] for p in paths), "shards": paths}
        for d, entry in domains.items():
            entry.update(stats["domains"][d])
            dd = dedup["per_domain"][d]
            stored = entry["filter"]["kept"]
            entry["dedup"] = {"documents": stored, **dd, "kept": stored - dd["exact_duplicates"] - dd["near_duplicates"]}
            entry["empty"] = not any(entry[split]["documents"] for split in shards.SPLITS)
        total = sum(e["dedup"]["documents"] for e in domains.values())
        kept = sum(e["dedup"]["kept"] for e in domains.values())
        cfg = self.config["dedup"]
        bands, rows = minhash.lsh_params(cfg["threshold"], cfg["num_perm"])
        meta = {
            "version": METADATA_VERSION,
            "record_format": {"dtype": "<i4", "content": "one document's token ids followed by eos_id",
                              "layout": "<domain>/<split>/shard-{i:05d}-of-{n:05d}.array_record",
                              "splits": list(shards.SPLITS), "writer_options": self.config["write"]["writer_options"]},
            "domains": domains,
            "dedup": {**{k: v for k, v in dedup.items() if k != "per_domain"}, "documents": total,
                      "removed": total - kept, "kept": kept,
                      "lsh": {"num_perm": cfg["num_perm"], "bands": bands, "rows": rows, "threshold": cfg["threshold"],
                              "shingle": cfg["shingle"], "ngram": cfg["ngram"], "seed": cfg["seed"]}},
            "malformed": stats["malformed"],
            "tokenizer": tok.metadata(),
            "config": {**self.config, "tokenizer": {"source": source, "eos_token": tok.eos_token,
                                                    "sample": plan["tokenizer"]["sample"]}},
            "stale_shards": (shards.stale_shards(self.out, set(written)) if "://" not in self.out else []),
        }
        write_text(self.out, "metadata.json", json.dumps(meta, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def write_text(folder_url: str, name: str, text: str) -> None:
    """Atomically on a local path (temp file + rename); an object store's put is atomic already."""
    if "://" in folder_url:
        with get_datafolder(folder_url).open(name, "w") as f:
            f.write(text)
    else:
        atomic.write_text(os.path.join(folder_url, name), text)

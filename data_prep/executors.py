"""Runs the stages of pipeline.py on one of datatrove's executors.

* local: `LocalPipelineExecutor`, one stage after the other, `workers` processes each;
* ray:   `RayPipelineExecutor` on the cluster `ray.init()` finds (RAY_ADDRESS, or a local one it starts);
* slurm: one `SlurmPipelineExecutor` array job per stage, each depending on the one before (`afterok`); the last
         job writes metadata.json. The command returns once the jobs are queued (`--wait`: once the last one ended).

Between the local/Ray stages the driver stops with one error line when nothing survived the filters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import multiprocess
from datatrove.executor import LocalPipelineExecutor
from datatrove.io import get_datafolder
from loguru import logger

from data_prep import peak, report
from data_prep.pipeline import (
    STAGES,
    PipelineConfig,
    Plan,
    active_rules,
    collect_stats,
    config_section,
    make_plan,
    stage_pipelines,
)
from data_prep.work import load_json
from glm46_jax.errors import InputError

EXECUTORS = ("local", "slurm", "ray")
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # what Slurm tasks import data_prep from


class StageFailed(RuntimeError):
    """Tasks failed (not the user's input): the CLI prints this one line and exits 1; the logs say why."""


class _QuietLocal(LocalPipelineExecutor):
    """datatrove prints every task's INFO log to the console of the rank-0 worker; ours print errors only (the full
    logs stay in <work>/logs/<stage>/logs/), so a local run reads like any other command."""

    def _run_for_rank(self, rank: int, local_rank: int = 0, node_rank: int = -1):
        return super()._run_for_rank(rank, local_rank + 1, node_rank)  # local_rank > 0: console level ERROR


def _executor(cfg: PipelineConfig, plan: Plan, stage: str, pipeline: list, tasks: int, depends: Any = None) -> Any:
    opts, logs = cfg.executor, _logs(plan, stage, tasks)
    skip = stage != "finalize"  # metadata.json is rewritten by every run: present <=> this run completed
    if opts.kind == "local":
        return _QuietLocal(pipeline, tasks=tasks, workers=max(1, min(opts.workers, tasks)),
                                     logging_dir=logs, skip_completed=skip)
    if opts.kind == "ray":
        from datatrove.executor import RayPipelineExecutor

        return RayPipelineExecutor(pipeline, tasks=tasks, workers=max(1, min(opts.workers, tasks)), logging_dir=logs,
                                   skip_completed=skip, cpus_per_task=opts.cpus_per_task,
                                   mem_per_cpu_gb=opts.mem_per_cpu_gb)
    from datatrove.executor import SlurmPipelineExecutor

    activate = os.path.join(sys.prefix, "bin", "activate")
    return SlurmPipelineExecutor(
        pipeline, tasks=tasks, time=opts.time, partition=opts.partition, cpus_per_task=opts.cpus_per_task,
        mem_per_cpu_gb=opts.mem_per_cpu_gb, job_name=f"{opts.job_name}_{stage}", logging_dir=logs,
        slurm_logs_folder=os.path.join(opts.slurm_logs or f"{plan.work}/slurm_logs", stage), depends=depends,
        skip_completed=skip, venv_path=activate if os.path.exists(activate) else None, mail_type="NONE",
        # datatrove writes --mem-per-cpu={mem_per_cpu_gb}G, and sbatch rejects a fraction ("2.0G": "Invalid
        # --mem-per-cpu specification"), so whole MiB instead; kill-on-invalid-dep: a failed stage cancels the
        # stages (and merge_stats jobs) that wait on it with afterok, which would otherwise stay pending forever
        # (DependencyNeverSatisfied) and keep --wait waiting
        sbatch_args={"mem-per-cpu": f"{max(1, round(opts.mem_per_cpu_gb * 1024))}M", "kill-on-invalid-dep": "yes"},
        # PYTHONPATH: the tasks import data_prep from the same checkout as this command
        env_command=f"export PYTHONPATH={CHECKOUT}:$PYTHONPATH" + (f"; source {activate}"
                                                                      if os.path.exists(activate) else ""))


def _check_survivors(cfg: PipelineConfig, plan: Plan) -> None:
    """After the dedup stage: one error line when there is no dataset to write."""
    error = load_json(get_datafolder(plan.work), "plan.json")["error"]
    if error == "every domain is empty":
        stats = collect_stats(plan.work, active_rules(config_section(cfg, plan.rules)), cfg.max_reports)
        dedup = load_json(get_datafolder(plan.work), "dedup.json")["per_domain"]
        reasons = []
        for d in plan.domains:
            entry = {**stats["domains"][d], "dedup": dedup[d]}
            reasons.append(report.empty_domain_reason(d, entry))
        raise InputError(f"every domain is empty, so no dataset was written: {'; '.join(reasons)}")
    if error:
        raise InputError(error)


def _logs(plan: Plan, stage: str, tasks: int) -> str:
    """datatrove's logs and completion markers of a stage. The write stage's task count is not part of the work
    folder's hash (any count writes the same shards), so its markers are kept per count."""
    return f"{plan.work}/logs/{stage}" + (f"-{tasks}" if stage == "write" else "")


def _completed(plan: Plan, stage: str, tasks: int) -> int:
    folder = get_datafolder(_logs(plan, stage, tasks))
    return sum(folder.isfile(f"completions/{rank:05d}") for rank in range(tasks)) if stage != "finalize" else 0


def run(cfg: PipelineConfig, wait: bool = False) -> dict[str, Any]:
    """Runs (local, ray) or submits (slurm) every stage; returns {"work", "skipped": {stage: tasks}, "jobs",
    "peak_rss": {stage: {"max_mb", "tasks"}} (slurm: with `wait` only)}."""
    plan = make_plan(cfg)
    out = get_datafolder(cfg.out)
    if out.isfile("metadata.json"):
        out.rm("metadata.json")  # metadata.json present <=> the dataset is complete and consistent
    pipelines = stage_pipelines(cfg, plan)
    skipped = {stage: _completed(plan, stage, tasks) for stage, (_, tasks) in pipelines.items()}
    counts = {stage: n for stage, (_, n) in pipelines.items()}
    if cfg.executor.kind == "slurm":
        jobs = _submit(cfg, plan, pipelines, wait)
        return {"work": plan.work, "skipped": skipped, "jobs": jobs,
                "peak_rss": peak.stage_peaks(plan.work, counts) if wait else {}}
    if cfg.executor.kind == "ray":
        import ray

        if not ray.is_initialized():
            ray.init(log_to_driver=False)
    logger.disable("datatrove.executor")  # the driver's progress lines; tasks still log to their files
    # datatrove's process manager would fork this process, which may hold threads (tokenizers, jax in a notebook)
    multiprocess.set_start_method("forkserver", force=True)
    for stage in STAGES:
        pipeline, tasks = pipelines[stage]
        _executor(cfg, plan, stage, pipeline, tasks).run()
        incomplete = tasks - _completed(plan, stage, tasks) if stage != "finalize" else 0
        if incomplete:
            raise StageFailed(f"stage {stage}: {incomplete} of {tasks} task(s) failed; logs in "
                              f"{_logs(plan, stage, tasks)}/logs; re-run the same command to retry them")
        if stage == "dedup":
            _check_survivors(cfg, plan)
    return {"work": plan.work, "skipped": skipped, "jobs": [], "peak_rss": peak.stage_peaks(plan.work, counts)}


def run_pipeline(cfg: PipelineConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """The library entry point: runs every stage to the end and returns (metadata.json's content, what `run` returns)."""
    result = run(cfg, wait=True)
    with get_datafolder(cfg.out).open("metadata.json", "r") as f:
        return json.load(f), result


def _submit(cfg: PipelineConfig, plan: Plan, pipelines: dict, wait: bool) -> list[str]:
    previous = None
    executors = []
    for stage in STAGES:
        pipeline, tasks = pipelines[stage]
        previous = _executor(cfg, plan, stage, pipeline, tasks, depends=previous)
        executors.append(previous)
    previous.run()  # launches its dependencies first
    # job_id -1 (an int): datatrove launched nothing, every task of that stage being complete (a re-run)
    jobs = [str(e.job_id) for e in executors if e.job_id not in (None, -1)]
    if wait:
        while _queued(jobs):
            time.sleep(2)
        if not get_datafolder(cfg.out).isfile("metadata.json"):
            if get_datafolder(plan.work).isfile("plan.json"):
                _check_survivors(cfg, plan)
            raise StageFailed(f"the Slurm jobs {jobs} ended without metadata.json; see "
                               f"{cfg.executor.slurm_logs or plan.work + '/slurm_logs'}")
    return jobs


def _queued(jobs: list[str]) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", ",".join(jobs), "-o", "%i"], capture_output=True, text=True, check=False)
    return bool(out.stdout.strip())

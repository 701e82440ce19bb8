"""Watching a long run: where metrics go (`MonitorConfig`, `open_writer`), device memory, stragglers, a profiler
window. The trainer owns the loop; this module owns what it reports (docs/monitoring.md).

  * `open_writer`: the sinks `monitor.sinks` names. JSONL, TensorBoard and W&B on process 0 (the metrics are
    global); Prometheus on every process, each on its own port, since step time, memory and data wait are
    per process.
  * `memory_scalars`: bytes in use / peak / limit per local device (the host's RSS on CPU).
  * `Stragglers`: every `straggler_every` steps one small all-gather of each process's host seconds per step.
  * `ProfileWindow`: a `jax.profiler` trace of `train.profile_steps`, one annotation per step.
  * `Watch`: all of the above plus the hang watchdog (glm46_jax/monitoring/watchdog.py) and injected faults, as
    the trainer's loop calls them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from glm46_jax.errors import InputError, check_at_least, check_choice, check_field
from glm46_jax.monitoring import fault_injection
from glm46_jax.monitoring import metrics
from glm46_jax.monitoring import sinks as sinks_lib
from glm46_jax.monitoring import watchdog as watchdog_lib

SINKS = ("jsonl", "tensorboard", "prometheus", "wandb")
STRAGGLER_WARN_RATIO = 1.5  # a process this much slower than the median gets a warning, not an info line


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
    sinks: str = "jsonl,tensorboard"  # comma-separated, of SINKS
    run_name: str = ""  # the `run` label / W&B run name; "" = the run dir's base name
    prometheus_port: int = 9400  # process i serves http://HOST:(port + i)/metrics; 0 = a free port (logged)
    prometheus_linger_s: float = 30.0  # serve this long after the run ends, so the last step is scraped
    wandb_project: str = "glm46_jax"
    wandb_mode: str = "offline"  # offline: run_dir/wandb/, `wandb sync` uploads it; online needs WANDB_API_KEY
    watchdog_factor: float = 10.0  # a hang = no step for max(factor x median step time, floor); 0 = no watchdog
    watchdog_floor_s: float = 600.0
    watchdog_exit: bool = True  # after the stack dump and status.json "hung": exit with code 3
    straggler_every: int = 100  # steps between the processes' host-time exchange; 0 = none

    def __post_init__(self):
        unknown = [s for s in self.sink_names if s not in SINKS]
        check_field("monitor", "sinks", self.sinks, not unknown, f"unknown sink(s) {unknown}",
                    f"name some of {', '.join(SINKS)}, comma-separated")
        check_choice("monitor", self, "wandb_mode", ("offline", "online", "disabled"))
        check_at_least("monitor", self, 0, "prometheus_port", "prometheus_linger_s", "watchdog_factor",
                       "watchdog_floor_s", "straggler_every")
        check_field("monitor", "prometheus_port", self.prometheus_port, self.prometheus_port < 65536,
                    "is not a TCP port", "choose a base port below 65536 - the process count")

    @property
    def sink_names(self) -> list[str]:
        return [s.strip() for s in self.sinks.split(",") if s.strip()]


def open_writer(cfg: MonitorConfig, run_dir: str, *, append: bool, steps_done: int = 0) -> sinks_lib.MetricWriter:
    """The run's `MetricWriter`: the configured sinks this process writes to. `steps_done`: the steps a resumed
    run had completed (where its step counter starts)."""
    process, names = jax.process_index(), cfg.sink_names
    run = cfg.run_name or os.path.basename(os.path.normpath(run_dir))
    out: list[sinks_lib.Sink] = []
    if process == 0 and "jsonl" in names:
        out.append(sinks_lib.JsonlSink(run_dir, append=append))
    if process == 0 and "tensorboard" in names:
        out.append(sinks_lib.TensorBoardSink(run_dir))
    if process == 0 and "wandb" in names:
        out.append(sinks_lib.WandbSink(run_dir, project=cfg.wandb_project, name=run, mode=cfg.wandb_mode,
                                       config=_run_config(run_dir)))
    if "prometheus" in names:
        from glm46_jax.monitoring import exporter  # prometheus_client: only a run that exports imports it

        port = cfg.prometheus_port + process if cfg.prometheus_port else 0
        try:
            out.append(exporter.PrometheusSink(port=port, run=run, process=process, steps_done=steps_done,
                                               linger_s=cfg.prometheus_linger_s, balance=process == 0))
        except OSError as e:  # the port is taken: one line, not a traceback from the HTTP server
            raise InputError(f"monitor.prometheus_port={cfg.prometheus_port}: process {process} cannot serve "
                             f"on port {port} ({e.strerror}); choose a free base port, or 0 for any") from e
    return sinks_lib.MetricWriter(out)


def _run_config(run_dir: str) -> dict[str, Any]:
    path = os.path.join(run_dir, "config.json")  # train.py writes it before the loop starts
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def memory_scalars(devices: Sequence[jax.Device]) -> dict[str, float]:
    """`memory/<device id>/{in_use,peak,limit}_bytes` for each device whose allocator reports them; on CPU
    (no allocator statistics) `memory/host/...`: the process's resident set, its peak, the host's memory."""
    out = {}
    for device in devices:
        stats = device.memory_stats() or {}
        for key, name in (("bytes_in_use", "in_use"), ("peak_bytes_in_use", "peak"), ("bytes_limit", "limit")):
            if key in stats:
                out[f"memory/{device.id}/{name}_bytes"] = float(stats[key])
    if out or not devices or devices[0].platform != "cpu":
        return out
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:  # Linux; fields are pages: size resident shared ...
        rss = int(f.read().split()[1]) * page
    peak = metrics.device_memory_peak_bytes(devices[0])  # on CPU: the process's peak RSS
    return {"memory/host/in_use_bytes": float(rss), "memory/host/peak_bytes": float(max(peak, rss)),
            "memory/host/limit_bytes": float(os.sysconf("SC_PHYS_PAGES") * page)}


class Stragglers:
    """Which process holds the others up. Every process adds its host seconds per step: the step's wall time
    less the time it blocked waiting for its devices. A process slowed by its data loader, its CPU or its file
    system spends more of each step on the host while the others wait in the step's collectives, so it has the
    largest figure. Every `every` steps one all-gather of the means names the slowest and its ratio to the
    median (a device that computes slowly is not seen this way: every process then waits alike)."""

    def __init__(self, every: int):
        self.every = every
        self._host_s, self._steps = 0.0, 0

    def add(self, host_s: float) -> None:
        self._host_s += host_s
        self._steps += 1

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0 and self._steps > 0

    def exchange(self, step: int) -> dict[str, float]:
        """Every process calls this at the same step (a collective). Returns the straggler scalars."""
        mine = np.asarray([self._host_s / self._steps], np.float32)
        self._host_s, self._steps = 0.0, 0
        every = mine
        if jax.process_count() > 1:
            with jax.transfer_guard("allow"):  # the all-gather's host <-> device copies are the point here
                every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1)
        slowest, median = int(np.argmax(every)), float(np.median(every))
        ratio = float(every[slowest] / median) if median > 0 else 1.0
        if len(every) > 1:
            log = logging.warning if ratio >= STRAGGLER_WARN_RATIO else logging.info
            log("step %d: the slowest process is %d, %.3f host s/step, %.2fx the median %.3f s (all: %s)", step,
                slowest, every[slowest], ratio, median, " ".join(f"{x:.3f}" for x in every))
        return {"straggler/process": float(slowest), "straggler/ratio": ratio,
                "straggler/host_s": float(mine[0])}


class ProfileWindow:
    """`train.profile_steps="START:END"`: a jax.profiler trace of steps START..END (inclusive) in
    run_dir/profile/ (TensorBoard's profile plugin reads it; perfetto_trace.json.gz opens in ui.perfetto.dev),
    each step annotated as "train_step" with its step number. On process 0, or on every process."""

    def __init__(self, spec: str, run_dir: str, *, enabled: bool):
        self.start, self.end = parse_steps(spec) if spec else (0, -1)
        self.enabled = enabled and bool(spec)
        self.directory = os.path.join(run_dir, "profile")
        self.active = False

    def before(self, step: int) -> None:
        if self.enabled and step == self.start:
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.active = True

    def annotate(self, step: int) -> contextlib.AbstractContextManager:
        return jax.profiler.StepTraceAnnotation("train_step", step_num=step) if self.active else \
            contextlib.nullcontext()

    def after(self, step: int) -> None:
        if self.active and step >= self.end:
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            logging.info("profile of steps %d-%d written to %s", self.start, self.end, self.directory)


def parse_steps(spec: str) -> tuple[int, int]:
    """"START:END" -> (START, END), 1 <= START <= END."""
    start, sep, end = spec.partition(":")
    try:
        first, last = int(start), int(end)
    except ValueError:
        first = last = 0
    if not sep or not 1 <= first <= last:
        raise InputError(f"train.profile_steps={spec!r}: must be START:END with 1 <= START <= END (steps, "
                         "inclusive), e.g. 3:5; \"\" = no profile")
    return first, last


class Watch:
    """What `trainer.fit` reports about its loop besides the step's own metrics, and the watchdog it feeds.

    Per step: `before_step` (injected faults, the profiler window's start), `data_wait` (seconds spent getting
    the next batch), `step_done` (the watchdog's beat, the host seconds for the straggler exchange, the window's
    end); `paused` around compiles; `saved` after a checkpoint save. `record()` gives the scalars for the next
    log record (data wait, memory, the last exchange and save) and starts a new interval."""

    def __init__(self, cfg: MonitorConfig, run_dir: str, *, profile_steps: str, profile_all: bool, total_steps: int):
        self.process = jax.process_index()
        self.faults = fault_injection.from_env()
        self.watchdog = watchdog_lib.Watchdog(
            run_dir, factor=cfg.watchdog_factor, floor_s=cfg.watchdog_floor_s, exit=cfg.watchdog_exit,
            process=self.process, total_steps=total_steps) if cfg.watchdog_factor else None
        self.stragglers = Stragglers(cfg.straggler_every)
        self.profile = ProfileWindow(profile_steps, run_dir, enabled=profile_all or self.process == 0)
        self.devices = jax.local_devices()
        self._wait_s, self._waits = 0.0, 0
        self._pending: dict[str, float] = {}

    def before_step(self, step: int) -> None:
        self.faults.before_step(step, self.process)
        self.profile.before(step)

    def paused(self, phase: str) -> contextlib.AbstractContextManager:
        return self.watchdog.paused(phase) if self.watchdog else contextlib.nullcontext()

    def phase(self, name: str) -> None:
        if self.watchdog:
            self.watchdog.phase(name)

    def data_wait(self, seconds: float) -> None:
        self._wait_s += seconds
        self._waits += 1

    def step_done(self, step: int, host_s: float) -> None:
        if self.watchdog:
            self.watchdog.step_done(step)
        self.profile.after(step)
        self.stragglers.add(host_s)
        if self.stragglers.due(step):
            self._pending.update(self.stragglers.exchange(step))

    def saved(self, step: int, block_s: float, at: float) -> None:
        self._pending.update({"checkpoint/step": float(step), "checkpoint/save_s": block_s, "checkpoint/saved_at": at})

    def pending(self) -> dict[str, float]:
        """The last save's and exchange's scalars not yet in a record (taken: the next call gives {})."""
        out, self._pending = self._pending, {}
        return out

    def record(self) -> dict[str, float]:
        out = {**self._pending, **memory_scalars(self.devices)}
        if self._waits:
            out["train/data_wait_s"] = self._wait_s / self._waits
        self._wait_s, self._waits, self._pending = 0.0, 0, {}
        return out

    def close(self) -> None:
        if self.watchdog:
            self.watchdog.close()
        self.profile.close()

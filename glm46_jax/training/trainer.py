"""The generic training driver: one loop that every recipe (pre-training, mid-training, SFT, RL) runs.

    with trainer.Preemption(multi_process) as stop:
        state, summary = trainer.fit(recipe, state, ckpt, train_cfg, run_dir=..., start_step=..., stop=stop)

A recipe (`Recipe`) says what a step is, where its batches come from and how it is evaluated: pre-training
(`glm46_jax.recipes.pretrain`) walks a curriculum of phases; a fine-tuning recipe brings chat batches and an
RL recipe sampled rollouts, each with its own loss in the one update step (`step.make_step`). The
driver owns everything around the step and is the same for all of them:
  * each segment's (phase's) train step, compiled ahead of time once per batch shape (`compiled.CompileOnce`:
    a batch of another shape fails loudly instead of silently recompiling);
  * `BadSteps`: non-finite or spiking steps are skipped by the step itself; here the policy after
    several in a row: stop ("skip") or roll back to the last checkpoint ("rollback");
  * `StepTimer`: step time, tokens/s and MFU with compilation and evaluation kept out;
  * `Progress`: metrics to the configured sinks (JSONL, TensorBoard, Prometheus, W&B: `monitor.open_writer`),
    a progress bar, the run's first/last figures;
  * `Watch`: what a weeks-long run needs watched (docs/monitoring.md): the hang watchdog, the straggler
    exchange, device memory, the data wait, a profiler window;
  * evaluation at `eval_every`, at every segment's end and at the run's end;
  * checkpoints at Orbax's interval, at the end and on preemption (`Preemption`: SIGTERM/SIGUSR1).
The loop stays asynchronous: the next batch is prepared while the step runs, and the only
per-step host sync is reading the loss. Design notes: docs/trainer.md#the-recipe-interface.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import numpy as np
from absl import logging
from tqdm import tqdm

from glm46_jax.errors import check_at_least, check_choice
from glm46_jax.monitoring import metrics, monitor
from glm46_jax.parallel import sharding
from glm46_jax.training import checkpoint, compiled

_END_WINDOW = 10  # "end loss" = mean over this many final steps: one noisy batch says little


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 0  # 0 = until the curriculum's tokens are spent
    seed: int = 0
    log_every: int = 50
    eval_every: int = 500  # 0 = no periodic eval (every phase still ends with one)
    eval_batches: int = 8
    eval_per_domain: bool = False  # also eval/<domain>/ce for each domain of a phase's mixture, alone
    accum_steps: int = 1  # micro-batches per step (every phase's batch must divide by it)
    bad_steps: str = "skip"  # skip | rollback
    max_nonfinite: int = 10  # "skip": stop after this many bad steps in a row
    rollback_after: int = 3  # "rollback": restore the last checkpoint after this many in a row
    spike_factor: float = 0.0  # a loss above factor x its running mean is a bad step; 0 = off
    spike_warmup: int = 10  # steps of the running mean before spike_factor applies
    profile_steps: str = ""  # "START:END": a jax.profiler trace of those steps in run_dir/profile/; "" = none
    profile_all_processes: bool = False  # trace every process, not only process 0

    def __post_init__(self):
        check_at_least("train", self, 0, "steps", meaning="0 = until the curriculum's tokens are spent")
        check_at_least("train", self, 0, "eval_every", meaning="0 = no periodic eval")
        check_at_least("train", self, 0, "spike_factor", meaning="0 = off; else a multiple of the running mean loss")
        check_at_least("train", self, 0, "seed", "spike_warmup")
        check_at_least("train", self, 1, "log_every", "eval_batches", "accum_steps", "max_nonfinite", "rollback_after")
        check_choice("train", self, "bad_steps", ("skip", "rollback"))
        if self.profile_steps:
            monitor.parse_steps(self.profile_steps)


@dataclasses.dataclass(frozen=True)
class Segment:
    """A stretch of the run with one train step program (compiled per batch shape). Pre-training's segments are its
    curriculum phases (`data.curriculum.Phase`, the same fields); SFT and RL runs are one segment each."""
    name: str
    seq_len: int


@dataclasses.dataclass
class StepInput:
    """One step's work, prepared by the recipe while the previous step runs."""
    segment: Any  # what selects the compiled program: a `Segment` (or a curriculum `Phase`; has `.name`)
    batch: dict[str, jax.Array]  # global arrays on the mesh
    controls: dict[str, jax.Array]  # host-scheduled scalars the step reads (loss weights, rates, max_loss)
    tokens_seen: int  # by the run, after this batch
    data_state: Any  # the batch source's state right after this batch: what a checkpoint after the step holds


class Recipe(Protocol):
    """Everything `train.train` and `fit` call on a recipe (docs/trainer.md#the-recipe-interface).
    `recipes.base.RecipeBase` implements the recipe-independent members once."""
    mesh: jax.sharding.Mesh
    total_steps: int
    global_rows: bool  # every process reads the whole batch: the data state restores on any process count
    tokenizer: dict[str, str] | None  # the run's tokenizer.json (path, source, sha256), set by train.py
    frozen: Any  # weights the steps read but do not train: their last argument (a jit argument, not donated)

    def tokenizer_source(self) -> str | None: ...  # the tokenizer.json to copy into the run dir; None = none
    def start(self, state: Any, data_state: Any | None) -> None: ...  # restored state and data state, or fresh
    # The next step's input, chosen with the current state (an RL recipe samples from it); max_loss: the spike
    # threshold for that step.
    def next_input(self, state: Any, max_loss: float) -> StepInput: ...
    def steps_for(self, segment: Any) -> Callable: ...  # jitted step(state, batch, controls, frozen)
    # Held-out metrics ("eval/<metric>", "eval/<set>/<metric>"); {} = no held-out data for the segment.
    def evaluate(self, state: Any, segment: Any, controls: Any) -> dict[str, float]: ...
    # Asked after every step: the recipe's own reason to end the run there (e.g. its held-out check failed), or None.
    # The step is saved and the run ends as a completed one (with checkpoint.keep_best, on its best step).
    def stop_reason(self) -> str | None: ...
    def flops_per_token(self, segment: Any) -> float: ...
    def describe(self, segment: Any) -> dict[str, float]: ...  # scalars logged with each train record
    def checkpoint_meta(self, segment: Any, tokens_seen: int) -> dict[str, Any]: ...
    # After a completed run (not a stopped one): e.g. LoRA's merged weights; returns their path or None.
    def finish(self, state: Any, step: int, run_dir: str, tokens_seen: int) -> str | None: ...
    def close(self) -> None: ...


class Preemption:
    """SIGTERM / SIGUSR1 (Slurm `--signal`) ask the loop to finish its step, save and stop.

    One process: a Python handler sets `requested`. Several processes must all stop after the same
    step, though the signal may reach them steps apart (or reach only one): there SIGTERM is left to
    JAX's preemption service (installed by `jax.distributed.initialize`), which tells every process
    and agrees on a step, seen through `Checkpointer.preemption_step`; SIGUSR1 is turned into a
    SIGTERM for it. A context manager: the previous handlers come back afterwards.
    """

    def __init__(self, multi_process: bool):
        self.multi_process = multi_process
        self.requested: str | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        del frame
        self.requested = signal.Signals(signum).name

    def _to_sigterm(self, signum, frame):
        del signum, frame
        os.kill(os.getpid(), signal.SIGTERM)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signals only reach the main thread
            handlers = {signal.SIGUSR1: self._to_sigterm} if self.multi_process else \
                {signal.SIGTERM: self._handle, signal.SIGUSR1: self._handle}
            self._previous = {s: signal.signal(s, h) for s, h in handlers.items()}
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def stop_after(self, step: int, ckpt: checkpoint.Checkpointer) -> bool:
        if self.multi_process and self.requested is None and ckpt.preemption_step(step):
            self.requested = "preemption notice (SIGTERM to one of the processes)"
        return self.requested is not None


class BadSteps:
    """What happens after bad steps (the step itself skips the update of a non-finite or spiking one).

    The spike threshold is `spike_factor` x the running mean (an EMA) of applied steps' losses, once
    `spike_warmup` steps were seen; infinity when the factor is 0 (off). The threshold for step s + 1
    is chosen before step s's loss is read (the loop stays asynchronous), so it is one step behind.
    After `max_nonfinite` bad steps in a row "skip" stops the run; after `rollback_after` "rollback"
    restores the last checkpoint's weights and optimizer (not its data: the bad batches are skipped).
    """

    def __init__(self, cfg: TrainConfig, ckpt: checkpoint.Checkpointer, global_rows: bool, decay: float = 0.9):
        self.cfg, self.ckpt, self.global_rows, self.decay = cfg, ckpt, global_rows, decay
        self.mean, self.seen = 0.0, 0
        self.rollbacks: list[tuple[int, int]] = []  # (step, step rolled back to)

    @property
    def max_loss(self) -> float:
        on = self.cfg.spike_factor > 0 and self.seen >= self.cfg.spike_warmup
        return self.cfg.spike_factor * self.mean if on else float("inf")

    def after(self, step: int, state: Any, loss: float, in_a_row: int) -> Any:
        """The state to go on with after `step` (rolled back, or as it is); raises when the run must stop."""
        if in_a_row == 0 and np.isfinite(loss):
            self.mean = loss if self.seen == 0 else self.decay * self.mean + (1 - self.decay) * loss
            self.seen += 1
        if self.cfg.bad_steps == "rollback" and in_a_row >= self.cfg.rollback_after:
            self.ckpt.wait()
            restored = self.ckpt.restore_latest(state, global_rows=self.global_rows)
            if restored is None:
                raise FloatingPointError(f"step {step}: {in_a_row} bad steps in a row and no checkpoint in "
                                         f"{self.ckpt.directory} to roll back to")
            self.rollbacks.append((step, restored[0]))
            logging.warning("step %d: %d bad steps in a row; rolled back to the weights of step %d, skipping "
                            "their data", step, in_a_row, restored[0])
            return restored[1]
        if in_a_row >= self.cfg.max_nonfinite:
            raise FloatingPointError(
                f"step {step}: loss or gradient not finite (or a loss spike) for {in_a_row} steps in a row "
                f"(train.max_nonfinite={self.cfg.max_nonfinite}); the updates were skipped, the last finite "
                "parameters are in memory. Lower optim.lr, raise optim.warmup_steps or check the data.")
        return state


class StepTimer:
    """Step time, tokens/s and MFU; compilation and evaluation are not step time.

    `interval()` averages over the steps since the last call (what a log record reports); the run's
    MFU averages every step but the first (which includes the first dispatch).
    """

    def __init__(self, mesh: jax.sharding.Mesh, start_step: int):
        self.peak, self.peak_source = metrics.system_peak(list(mesh.devices.flatten()))
        self.start_step = start_step
        self._mark, self._mark_step = time.perf_counter(), start_step - 1
        self.train_s, self.flops, self.timed_steps = 0.0, 0.0, 0

    def exclude(self, seconds: float) -> None:
        self._mark += seconds

    def restart(self) -> None:
        self._mark = time.perf_counter()

    def step_done(self, step: int, started: float, flops: float) -> None:
        if step > self.start_step:
            self.train_s += time.perf_counter() - started
            self.flops += flops
            self.timed_steps += 1

    def interval(self, step: int) -> float:
        now = time.perf_counter()
        step_s = (now - self._mark) / (step - self._mark_step)
        self._mark, self._mark_step = now, step
        return step_s

    def mfu(self, flops_per_token: float, tokens_per_s: float) -> float | None:
        # system_peak is the peak of all the mesh's devices together, hence one "device" here.
        return metrics.mfu(flops_per_token, tokens_per_s, 1, self.peak) if self.peak else None

    @property
    def step_s(self) -> float:
        return self.train_s / self.timed_steps if self.timed_steps else float("nan")

    @property
    def run_mfu(self) -> float | None:
        return self.flops / self.train_s / self.peak if self.peak and self.train_s else None


def _scalars(values: Mapping[str, Any], prefix: str) -> dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in jax.device_get(values).items()}


class Progress:
    """Metric records (to the sinks `monitor.sinks` names: monitor.open_writer), the progress bar, and the figures
    the summary reports: the first logged train record, the last steps' metrics, the last eval."""

    def __init__(self, run_dir: str, cfg: monitor.MonitorConfig, *, total: int, start_step: int, append: bool):
        self.is_main = jax.process_index() == 0
        self.writer = monitor.open_writer(cfg, run_dir, append=append, steps_done=start_step - 1)
        self.bar = tqdm(total=total, initial=start_step - 1, disable=not self.is_main, desc="train")
        self.history: collections.deque = collections.deque(maxlen=_END_WINDOW)  # device metrics, read at the end
        self.first: dict[str, float] = {}
        self.last_eval: dict[str, float] = {}
        self.last_eval_step = 0
        self.segments: list[str] = []

    def enter(self, segment: Any) -> None:
        if not self.segments or self.segments[-1] != segment.name:
            self.segments.append(segment.name)
            self.bar.set_description(f"train [{segment.name}]")

    def train(self, step: int, step_metrics: Any, values: dict[str, float]) -> None:
        values = {**_scalars(step_metrics, "train"), **values}
        self.first = self.first or values
        self.writer.write(step, values, self.segments[-1])
        shown = {k: f"{values[f'train/{k}']:.3f}" for k in ("loss", "ce", "accuracy") if f"train/{k}" in values}
        self.bar.set_postfix(**shown)

    def eval(self, step: int, values: dict[str, float]) -> None:
        self.last_eval, self.last_eval_step = values, step
        self.writer.write(step, {**values, "eval/phase_index": float(len(self.segments) - 1)}, self.segments[-1])

    def close(self) -> None:
        self.bar.close()
        self.writer.close()


@dataclasses.dataclass
class _Loop:
    """The loop's parts, built once by `fit`."""
    recipe: Recipe
    cfg: TrainConfig
    ckpt: checkpoint.Checkpointer
    stop: Preemption
    programs: compiled.CompileOnce  # the train steps
    timer: StepTimer
    bad: BadSteps
    progress: Progress
    watch: monitor.Watch
    save_block_s: list[float] = dataclasses.field(default_factory=list)
    tokens_seen: int = 0
    warned_no_eval: set[str] = dataclasses.field(default_factory=set)
    evaluated: set[str] = dataclasses.field(default_factory=set)  # segments whose eval program is compiled
    early_stop: str | None = None  # the recipe's reason to end the run (`Recipe.stop_reason`)


def fit(recipe: Recipe, state: Any, ckpt: checkpoint.Checkpointer, cfg: TrainConfig, *, run_dir: str,
        start_step: int, stop: Preemption, global_rows: bool = False,
        monitor_cfg: monitor.MonitorConfig = monitor.MonitorConfig()) -> tuple[Any, dict[str, Any]]:
    """Train from `start_step` to `recipe.total_steps` (or a preemption); returns (state, summary)."""
    timer = StepTimer(recipe.mesh, start_step)
    step = start_step - 1
    # Host<->device copies in the loop must be explicit (device_get, loader.to_global).
    with contextlib.ExitStack() as closing, sharding.use_mesh(recipe.mesh), jax.transfer_guard("disallow"):
        progress = Progress(run_dir, monitor_cfg, total=recipe.total_steps, start_step=start_step,
                            append=start_step > 1)
        closing.callback(progress.close)
        watch = monitor.Watch(monitor_cfg, run_dir, profile_steps=cfg.profile_steps,
                              profile_all=cfg.profile_all_processes, total_steps=recipe.total_steps)
        closing.callback(watch.close)  # closed first: the exporter's linger after the run is not a hang
        # A new segment's compile is neither a hang nor step time.
        programs = compiled.CompileOnce("train step", while_compiling=watch.paused, after=timer.exclude)
        loop = _Loop(recipe, cfg, ckpt, stop, programs, timer, BadSteps(cfg, ckpt, global_rows), progress, watch)
        logging.info("%d steps; MFU peak %.3g FLOP/s (%s)", recipe.total_steps, timer.peak or 0, timer.peak_source)
        inp = recipe.next_input(state, loop.bad.max_loss)
        timer.restart()
        for step in range(start_step, recipe.total_steps + 1):
            state, inp, stopping = _step(loop, step, state, inp)
            if stopping:
                logging.warning("%s: saved step %d and stopping", stop.requested or loop.early_stop, step)
                break
        if final := watch.pending():  # the last save comes after the last record: it gets one of its own
            progress.writer.write(step, final, progress.segments[-1] if progress.segments else "")
    return state, _summary(loop, step)


def _step(loop: _Loop, step: int, state: Any, inp: StepInput) -> tuple[Any, StepInput | None, bool]:
    """Run `step` on `inp`; log, evaluate and save as due. Returns (state, next input, stopping)."""
    recipe, cfg, watch = loop.recipe, loop.cfg, loop.watch
    loop.progress.enter(inp.segment)
    train_step = loop.programs.get(inp.segment.name, inp.batch["inputs"].shape, lambda: recipe.steps_for(inp.segment),
                                   state, inp.batch, inp.controls, recipe.frozen)
    started = time.perf_counter()
    watch.before_step(step)
    last = step == recipe.total_steps
    with watch.profile.annotate(step):
        state, step_metrics = train_step(state, inp.batch, inp.controls, recipe.frozen)
        loop.progress.history.append(step_metrics)
        t0 = time.perf_counter()
        nxt = None if last else recipe.next_input(state, loop.bad.max_loss)  # prepared while the step runs
        t1 = time.perf_counter()
        loss, in_a_row = jax.device_get((step_metrics["loss"], step_metrics["nonfinite_in_a_row"]))
    watch.data_wait(t1 - t0)
    state = loop.bad.after(step, state, float(loss), int(in_a_row))
    watch.step_done(step, host_s=t1 - started)  # the host's part: all but the wait for the devices (device_get)
    tokens = inp.batch["inputs"].size
    flops_per_token = recipe.flops_per_token(inp.segment)
    loop.timer.step_done(step, started, flops_per_token * tokens)
    loop.tokens_seen = inp.tokens_seen
    if step == loop.timer.start_step or step % cfg.log_every == 0 or last:
        step_s = loop.timer.interval(step)
        values = {"train/step_s": step_s, "train/tokens_per_s": tokens / step_s,
                  "train/tokens_seen": float(inp.tokens_seen),
                  **{f"train/{k}": float(v) for k, v in recipe.describe(inp.segment).items()}}
        mfu = loop.timer.mfu(flops_per_token, tokens / step_s)
        if mfu is not None and step > 1:
            values["train/mfu"] = mfu
        loop.progress.train(step, step_metrics, {**values, **watch.record()})
    segment_ends = nxt is not None and nxt.segment.name != inp.segment.name
    if (cfg.eval_every and step % cfg.eval_every == 0) or last or segment_ends:  # every segment ends with one
        _evaluate(loop, step, state, inp)
    loop.progress.bar.update(1)
    stopping = loop.stop.stop_after(step, loop.ckpt)
    if not last and not stopping and (reason := recipe.stop_reason()):
        loop.early_stop = stopping = reason
    if last or stopping or loop.ckpt.should_save(step):
        # keep_best ranks a step by its own eval only: an older eval would misjudge it
        ranked = loop.progress.last_eval if loop.progress.last_eval_step == step else {}
        t0 = time.perf_counter()
        watch.phase("checkpoint")
        loop.ckpt.save(step, state, inp.data_state, recipe.checkpoint_meta(inp.segment, inp.tokens_seen),
                       metrics=ranked or None)
        loop.save_block_s.append(time.perf_counter() - t0)  # the async save's cost to the loop
        watch.saved(step, loop.save_block_s[-1], time.time())
    watch.phase("step")
    return state, nxt, stopping


def _evaluate(loop: _Loop, step: int, state: Any, inp: StepInput) -> None:
    name = inp.segment.name
    loop.watch.phase("eval")
    with loop.watch.paused(f"first evaluation of {name} (compiling)") if name not in loop.evaluated else \
            contextlib.nullcontext():
        values = loop.recipe.evaluate(state, inp.segment, inp.controls)
    loop.evaluated.add(name)
    if values:
        loop.progress.eval(step, values)
    elif inp.segment.name not in loop.warned_no_eval:
        loop.warned_no_eval.add(inp.segment.name)
        logging.warning("%s: no held-out data for its mixture, so no evaluation; training goes on",
                        inp.segment.name)
    loop.timer.restart()  # keep eval time out of train/step_s


def _summary(loop: _Loop, step: int) -> dict[str, Any]:
    p, t = loop.progress, loop.timer
    tail = jax.device_get(list(p.history))
    return {
        "start_loss": p.first.get("train/ce", float("nan")),
        "end_loss": float(np.mean([m["ce"] for m in tail])) if tail and "ce" in tail[0] else float("nan"),
        "start_total_loss": p.first.get("train/loss", float("nan")),
        "end_total_loss": float(np.mean([m["loss"] for m in tail])) if tail else float("nan"),
        "end_window": len(tail), **p.last_eval, "compile_s": loop.programs.seconds, "step_s": t.step_s,
        "phases": p.segments, "tokens_seen": loop.tokens_seen,
        "steps": step, "start_step": t.start_step, "preempted": loop.stop.requested,
        "save_block_s": loop.save_block_s, "rollbacks": loop.bad.rollbacks, "early_stop": loop.early_stop,
        "mfu": t.run_mfu, "mfu_peak_source": t.peak_source,
    }

"""Pre-training entry point: config -> `build` (curriculum, mesh, model, optimizer, state) -> loop.

    python -m glm46_jax.train --config=configs/pretrain.py:tiny [--config.train.steps=10 ...]

The loop walks the curriculum (`data.curriculum.CurriculumIterator`): each phase brings its
sequence length, batch, mixture and RoPE theta, and the step is compiled once per phase shape.
Writes to `run_dir`: config.json (the resolved config), tokenizer.json (the corpus's),
metrics.jsonl and tensorboard/ (one record per log or eval point, `metrics.MetricWriter`) and
checkpoints/<step>/ (`checkpoint.Checkpointer`: weights, optimizer, data-iterator state, meta),
from which a restarted run resumes, and at the end status.json: {"state": "complete" | "stopped" (by
SIGTERM/SIGUSR1, saved and resumable), "step", "total_steps", "reason"}.

Multi-process (`distributed.initialize`, called first by `main`: Slurm's srun, or
`launch/local_multiprocess.sh N`): every process runs this same program on its own devices and
reads its own share of the data (or, with data.process_split="rows", the whole batch); all of them
take part in checkpointing; only process 0 prints or writes metrics.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags
from tqdm import tqdm

from glm46_jax import checkpoint, distributed, metrics, sharding
from glm46_jax.build import Run, build
from glm46_jax.config import RUNTIME_FIELDS
from glm46_jax.data import curriculum, loader
from glm46_jax.data.curriculum import Phase
from glm46_jax.train_step import TrainState

_END_WINDOW = 10  # "end loss" = mean over this many final steps: one noisy batch says little


def _scalars(values: dict[str, Any], prefix: str) -> dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in jax.device_get(values).items()}


def _eval_set(run: Run, phase: Phase, batches: int) -> list[dict[str, jax.Array]]:
    """`batches` held-out batches of the phase's mixture, length and packing (fixed per phase)."""
    cfg = dataclasses.replace(run.loader_cfg, split="heldout")
    it = iter(loader.training_batches(cfg, phase.mixture, phase.seq_len, phase.global_batch, phase.pack))
    return [run.device_batch(next(it), train=False) for _ in range(batches)]


def _write_status(run_dir: str, status: dict[str, Any]) -> None:
    """`run_dir/status.json`, replaced atomically: a reader never sees half of it."""
    tmp = os.path.join(run_dir, f".status.json.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(status, f)
    os.replace(tmp, os.path.join(run_dir, "status.json"))


class _Preemption:
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


class _SpikeGuard:
    """The loss above which a step counts as a spike: `factor` x the running mean of applied steps'
    losses (an EMA), once `warmup` steps have been seen; infinity when `factor` is 0 (off). The
    threshold for step s + 1 is chosen before step s's loss is read (the loop stays asynchronous),
    so it is one step behind."""

    def __init__(self, factor: float, warmup: int = 10, decay: float = 0.9):
        self.factor, self.warmup, self.decay = factor, warmup, decay
        self.mean, self.seen = 0.0, 0

    @property
    def max_loss(self) -> float:
        return self.factor * self.mean if self.factor > 0 and self.seen >= self.warmup else float("inf")

    def observe(self, loss: float, skipped: bool) -> None:
        if skipped or not np.isfinite(loss):
            return
        self.mean = loss if self.seen == 0 else self.decay * self.mean + (1 - self.decay) * loss
        self.seen += 1


def _run_tokenizer(run_dir: str, corpus_root: str, is_main: bool) -> dict[str, str] | None:
    """Copy the corpus's tokenizer.json into the run dir (scoring and export find it there)."""
    source = os.path.join(corpus_root, "tokenizer.json")
    if not os.path.exists(source):
        return None
    with open(source, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    target = os.path.join(run_dir, "tokenizer.json")
    if is_main:
        shutil.copy(source, target)
    return {"path": target, "source": os.path.abspath(source), "sha256": digest}


def train(config: ml_collections.ConfigDict,
          devices: Sequence[jax.Device] | None = None) -> tuple[TrainState, dict[str, Any]]:
    """Run the whole training job on `devices` (default: all); returns (final state, summary)."""
    t_start = time.perf_counter()
    is_main = jax.process_index() == 0
    tcfg = config.train

    # --- Run dir, model, optimizer, curriculum ----------------------------------------------
    run_dir = os.path.abspath(config.run_dir)
    if is_main:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    run = build(config, devices)
    state, run.state = run.state, None  # the loop owns the state (the step donates it)
    peak, peak_source = metrics.system_peak(list(run.mesh.devices.flatten()))
    logging.info("%d steps over phases %s; MFU peak %.3g FLOP/s (%s)", run.total_steps,
                 [p.name for p in run.curriculum.phases], peak or 0, peak_source)
    data = curriculum.CurriculumIterator(run.curriculum, run.loader_cfg)
    tokenizer = _run_tokenizer(run_dir, run.loader_cfg.root, is_main)

    # --- Checkpoints: resume the newest complete one, or start from given weights -----------
    ccfg = config.checkpoint
    ckpt = checkpoint.Checkpointer(run_dir, every=ccfg.every, keep=ccfg.keep or None, async_save=ccfg.async_save,
                                   best_metric="eval/ce" if ccfg.keep_best else None)
    start_step, resumed = 1, None
    if ccfg.resume == "auto":
        resumed = ckpt.restore_latest(state, shared_data=run.global_rows)
    elif ccfg.resume != "never":
        raise ValueError(f"checkpoint.resume={ccfg.resume!r}: expected 'auto' or 'never'")
    elif ckpt.steps():  # starting over would overwrite them: never lose a written checkpoint
        raise ValueError(f"{ckpt.directory} already holds checkpoints {ckpt.steps()} and checkpoint.resume=never: "
                         "use a new run_dir, or resume=auto to continue")
    if resumed is not None:
        last, state, data_state, _ = resumed
        data.set_state(data_state)
        start_step = last + 1
        logging.info("resumed from %s (step %d, %d tokens seen)", ckpt.directory, last, data.tokens_seen)
    elif ccfg.init_from:  # mid-training / fine-tuning: the weights of another run or an HF import
        init_cfg, _, params, buffers = checkpoint.load_params(ccfg.init_from, run.mesh)
        differ = {f.name for f in dataclasses.fields(init_cfg) if f.name not in RUNTIME_FIELDS + ("rope_theta",)
                  and getattr(init_cfg, f.name) != getattr(run.model_cfg, f.name)}
        if differ:
            raise ValueError(f"checkpoint.init_from={ccfg.init_from}: its model differs from config.model in "
                             f"{sorted(differ)}; set those config.model fields to the checkpoint's values")
        state = state.replace(params=params, buffers=buffers)
        logging.info("initialised the weights from %s", ccfg.init_from)
    stop = _Preemption(multi_process=jax.process_count() > 1)
    if tcfg.bad_steps not in ("skip", "rollback"):
        raise ValueError(f"train.bad_steps={tcfg.bad_steps!r}: expected 'skip' or 'rollback'")
    spikes = _SpikeGuard(tcfg.spike_factor, tcfg.spike_warmup)
    rollbacks: list[tuple[int, int]] = []
    save_block_s: list[float] = []

    # --- Phase set-up: the step compiled ahead of time for each phase's shapes and RoPE theta
    # (a batch of the wrong shape fails loudly instead of silently recompiling), and its eval set.
    compiled: dict[tuple, tuple[Any, Any]] = {}
    eval_sets: dict[str, list] = {}
    compile_s = 0.0

    def steps_for(phase: Phase, batch, ctrl):
        nonlocal compile_s
        key = (phase.name, batch["inputs"].shape)
        if key not in compiled:
            t0 = time.perf_counter()
            train_step, eval_step = run.steps_for(phase)
            if phase.name not in eval_sets:
                eval_sets[phase.name] = _eval_set(run, phase, tcfg.eval_batches)
            compiled[key] = (train_step.lower(state, batch, ctrl).compile(),
                             eval_step.lower(state, eval_sets[phase.name][0], ctrl).compile())
            compile_s += time.perf_counter() - t0
            logging.info("phase %s: compiled for batch %s in %.1f s", phase.name, batch["inputs"].shape,
                         time.perf_counter() - t0)
        return compiled[key]

    def evaluate(phase: Phase, eval_step, ctrl) -> dict[str, float]:
        per_batch = jax.device_get([eval_step(state, b, ctrl) for b in eval_sets[phase.name]])
        out = {f"eval/{k}": float(np.mean([m[k] for m in per_batch])) for k in per_batch[0]}
        out["eval/ppl"] = float(np.exp(out["eval/ce"]))  # of the mean CE, not the mean of ppls
        return out

    def next_batch():
        # The iterator's state right after this batch is what a checkpoint after its step holds.
        tokens_before = data.tokens_seen
        phase, local = next(data)
        return (phase, run.device_batch(local), run.controls_at(tokens_before, spikes.max_loss), data.tokens_seen,
                data.get_state())

    def save(step: int, phase: Phase, data_state, tokens: int, eval_metrics=None):
        meta = {"model_config": dataclasses.asdict(run.model_for(phase)), "phase": phase.name,
                "tokens_seen": tokens, "tokenizer": tokenizer, "config": json.loads(config.to_json_best_effort())}
        t0 = time.perf_counter()
        ckpt.save(step, state, data_state, meta, metrics=eval_metrics)
        save_block_s.append(time.perf_counter() - t0)  # the async save's cost to the loop

    # --- Train loop --------------------------------------------------------------------------
    history: collections.deque = collections.deque(maxlen=_END_WINDOW)  # device metrics, fetched at the end
    first: dict[str, float] = {}
    last_eval: dict[str, float] = {}
    last_eval_step = 0
    phases_seen: list[str] = []
    mfu_num = 0.0
    if start_step > run.total_steps:
        raise ValueError(f"{ckpt.directory}: the run already finished ({start_step - 1} of {run.total_steps} steps); "
                         "use a new run_dir, or --config.checkpoint.resume=never to start over")
    with sharding.use_mesh(run.mesh):
        phase, batch, ctrl, tokens_after, data_after = next_batch()
    writer = metrics.MetricWriter(run_dir, enabled=is_main, tensorboard=tcfg.tensorboard, append=resumed is not None)
    t_log, last_logged, t_train = time.perf_counter(), start_step - 1, 0.0
    step = step_phase = None
    # Host<->device copies in the loop must be explicit (device_get / make_array_from_process_local_data).
    with writer, sharding.use_mesh(run.mesh), jax.transfer_guard("disallow"), \
            tqdm(total=run.total_steps, initial=start_step - 1, disable=not is_main, desc="train") as bar, stop:
        for step in range(start_step, run.total_steps + 1):
            if not phases_seen or phases_seen[-1] != phase.name:
                phases_seen.append(phase.name)
                bar.set_description(f"train [{phase.name}]")
            compiled_before = compile_s
            train_step, eval_step = steps_for(phase, batch, ctrl)
            if compile_s != compiled_before:  # a new phase's compile is not step time
                t_log += compile_s - compiled_before
            t_step = time.perf_counter()
            state, step_metrics = train_step(state, batch, ctrl)
            history.append(step_metrics)
            step_phase, step_tokens, step_ctrl = phase, batch["inputs"].size, ctrl
            step_tokens_after, step_data = tokens_after, data_after
            if step < run.total_steps:  # prepared while the step runs
                phase, batch, ctrl, tokens_after, data_after = next_batch()
            loss, in_a_row = jax.device_get((step_metrics["loss"], step_metrics["nonfinite_in_a_row"]))
            loss, in_a_row = float(loss), int(in_a_row)
            spikes.observe(loss, skipped=in_a_row > 0)
            if tcfg.bad_steps == "rollback" and in_a_row >= tcfg.rollback_after:
                # Back to the last checkpoint's weights and optimizer, but not its data: the batches
                # that went bad are skipped.
                ckpt.wait()
                restored = ckpt.restore_latest(state, shared_data=run.global_rows)
                if restored is None:
                    raise FloatingPointError(f"step {step}: {int(in_a_row)} bad steps in a row and no checkpoint "
                                             f"in {ckpt.directory} to roll back to")
                state = restored[1]
                rollbacks.append((step, restored[0]))
                logging.warning("step %d: %d bad steps in a row; rolled back to the weights of step %d, skipping "
                                "their data", step, int(in_a_row), restored[0])
            elif in_a_row >= tcfg.max_nonfinite:
                raise FloatingPointError(
                    f"step {step}: loss or gradient not finite (or a loss spike) for {in_a_row} steps in a row "
                    f"(train.max_nonfinite={tcfg.max_nonfinite}); the updates were skipped, the last finite "
                    f"parameters are in memory. Lower optim.lr, raise optim.warmup_steps or check the data.")
            now = time.perf_counter()
            if step > start_step:  # the first step includes the first dispatch; the MFU average leaves it out
                t_train += now - t_step
                mfu_num += run.flops_per_token(step_phase) * step_tokens
            if step == start_step or step % tcfg.log_every == 0 or step == run.total_steps:
                values = _scalars(step_metrics, "train")
                step_s = (now - t_log) / (step - last_logged)
                t_log, last_logged = now, step
                values.update({"train/step_s": step_s, "train/tokens_per_s": step_tokens / step_s,
                               "train/tokens_seen": float(step_tokens_after),
                               "train/seq_len": float(step_phase.seq_len),
                               "train/rope_theta": float(step_phase.rope_theta)})
                if peak and step > 1:
                    values["train/mfu"] = run.flops_per_token(step_phase) * step_tokens / step_s / peak
                if not first:
                    first = values
                writer.write(step, values)
                bar.set_postfix(loss=f"{values['train/loss']:.3f}", ce=f"{values['train/ce']:.3f}")
            if step % tcfg.eval_every == 0 or step == run.total_steps or (
                    step < run.total_steps and phase.name != step_phase.name):  # every phase ends with an eval
                last_eval, last_eval_step = evaluate(step_phase, eval_step, step_ctrl), step
                writer.write(step, {**last_eval, "eval/phase_index": float(len(phases_seen) - 1)})
                t_log = time.perf_counter()  # keep eval time out of train/step_s
            bar.update(1)
            stopping = stop.stop_after(step, ckpt)
            if ckpt.due(step) or step == run.total_steps or stopping:
                save(step, step_phase, step_data, step_tokens_after,
                     # keep_best ranks a step by its own eval only: an older eval would misjudge it
                     {"eval/ce": last_eval["eval/ce"]} if last_eval_step == step else None)
            if stopping:
                logging.warning("%s: saved step %d and stopping", stop.requested, step)
                break
    data.close()
    ckpt.close()  # waits for the last write
    if is_main:  # for schedulers: launch/slurm_pretrain.sbatch requeues a run that stopped early
        _write_status(run_dir, {"state": "stopped" if stop.requested else "complete", "step": step,
                                "total_steps": run.total_steps, "reason": stop.requested})

    # --- Summary ----------------------------------------------------------------------------
    ckpt_dir = os.path.join(ckpt.directory, str(step))
    tail = jax.device_get(list(history))
    steps_run = step - start_step + 1
    step_s = t_train / (steps_run - 1) if steps_run > 1 else float("nan")
    summary = {
        "start_loss": first["train/ce"], "end_loss": float(np.mean([m["ce"] for m in tail])),
        "start_total_loss": first["train/loss"], "end_total_loss": float(np.mean([m["loss"] for m in tail])),
        **last_eval, "compile_s": compile_s, "step_s": step_s, "phases": phases_seen,
        "tokens_seen": step_tokens_after, "steps": step, "start_step": start_step,
        "preempted": stop.requested, "save_block_s": save_block_s, "rollbacks": rollbacks,
        "mfu": mfu_num / t_train / peak if peak and t_train else None,
        "wall_s": time.perf_counter() - t_start, "checkpoint": ckpt_dir,
    }
    if is_main:
        print(f"start loss {summary['start_loss']:.3f} -> end loss {summary['end_loss']:.3f} "
              f"(next-token CE, nats/token; mean of the last {len(tail)} steps; total loss with MTP and aux: "
              f"{summary['start_total_loss']:.3f} -> {summary['end_total_loss']:.3f}; "
              f"held-out CE {format(last_eval['eval/ce'], '.3f') if last_eval else 'n/a: no eval ran'})")
        mfu = f"{summary['mfu']:.1%} MFU vs {peak_source}" if summary["mfu"] else "MFU n/a"
        print(f"steps {start_step}-{step} of {run.total_steps} through phases {' -> '.join(phases_seen)} "
              f"({step_tokens_after:,} tokens seen); compile {compile_s:.1f} s, {step_s * 1e3:.0f} ms/step, {mfu}; "
              f"wall {summary['wall_s']:.1f} s; checkpoint {ckpt_dir} ({len(save_block_s)} saves, the loop blocked "
              f"{1e3 * float(np.mean(save_block_s or [0])):.0f} ms per save on average)")
    return state, summary


def main(argv):
    del argv
    distributed.initialize(flags.FLAGS.config.distributed)  # before anything touches a device
    if jax.process_index() != 0:
        logging.set_verbosity(logging.WARNING)
    train(flags.FLAGS.config)


if __name__ == "__main__":
    # Defined here, not at import: bench and train each own a --config flag.
    config_flags.DEFINE_config_file("config", None, "Training config file, e.g. configs/pretrain.py:tiny.",
                                      lock_config=True)
    app.run(main)

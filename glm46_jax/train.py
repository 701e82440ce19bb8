"""Pre-training entry point: config -> `build` (curriculum, mesh, model, optimizer, state) -> loop.

    python -m glm46_jax.train --config=configs/pretrain.py:tiny [--config.train.steps=10 ...]

The loop walks the curriculum (`data.curriculum.CurriculumIterator`): each phase brings its
sequence length, batch, mixture and RoPE theta, and the step is compiled once per phase shape.
Writes to `run_dir`: config.json (the resolved config), metrics.jsonl and tensorboard/ (one
record per log or eval point, `metrics.MetricWriter`) and checkpoints/<step>/ (final params +
buffers + model_config.json + the corpus's tokenizer.json). Only process 0 prints or writes
files; every process runs the same program and reads its own share of the data.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags
from tqdm import tqdm

from glm46_jax import checkpoint, metrics, sharding
from glm46_jax.build import Run, build
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
        tokens_before = data.tokens_seen
        phase, local = next(data)
        return phase, run.device_batch(local), run.controls_at(tokens_before), data.tokens_seen

    # --- Train loop --------------------------------------------------------------------------
    history: collections.deque = collections.deque(maxlen=_END_WINDOW)  # device metrics, fetched at the end
    first: dict[str, float] = {}
    last_eval: dict[str, float] = {}
    phases_seen: list[str] = []
    mfu_num = 0.0
    with sharding.use_mesh(run.mesh):
        phase, batch, ctrl, tokens_after = next_batch()
    writer = metrics.MetricWriter(run_dir, enabled=is_main, tensorboard=tcfg.tensorboard)
    t_log, last_logged, t_train = time.perf_counter(), 0, 0.0
    # Host<->device copies in the loop must be explicit (device_get / make_array_from_process_local_data).
    with writer, sharding.use_mesh(run.mesh), jax.transfer_guard("disallow"), \
            tqdm(total=run.total_steps, disable=not is_main, desc="train") as bar:
        for step in range(1, run.total_steps + 1):
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
            step_phase, step_tokens, step_ctrl, step_tokens_after = phase, batch["inputs"].size, ctrl, tokens_after
            if step < run.total_steps:  # prepared while the step runs
                phase, batch, ctrl, tokens_after = next_batch()
            in_a_row = int(jax.device_get(step_metrics["nonfinite_in_a_row"]))
            if in_a_row >= tcfg.max_nonfinite:
                raise FloatingPointError(
                    f"step {step}: loss or gradient not finite for {in_a_row} steps in a row "
                    f"(train.max_nonfinite={tcfg.max_nonfinite}); the updates were skipped, the last finite "
                    f"parameters are in memory. Lower optim.lr, raise optim.warmup_steps or check the data.")
            now = time.perf_counter()
            if step > 1:  # step 1 includes the first dispatch; the MFU average leaves it out
                t_train += now - t_step
                mfu_num += run.flops_per_token(step_phase) * step_tokens
            if step == 1 or step % tcfg.log_every == 0 or step == run.total_steps:
                values = _scalars(step_metrics, "train")
                step_s = (now - t_log) / (step - last_logged)
                t_log, last_logged = now, step
                values.update({"train/step_s": step_s, "train/tokens_per_s": step_tokens / step_s,
                               "train/tokens_seen": float(step_tokens_after),
                               "train/seq_len": float(step_phase.seq_len),
                               "train/rope_theta": float(step_phase.rope_theta)})
                if peak and step > 1:
                    values["train/mfu"] = run.flops_per_token(step_phase) * step_tokens / step_s / peak
                if step == 1:
                    first = values
                writer.write(step, values)
                bar.set_postfix(loss=f"{values['train/loss']:.3f}", ce=f"{values['train/ce']:.3f}")
            if step % tcfg.eval_every == 0 or step == run.total_steps or (
                    step < run.total_steps and phase.name != step_phase.name):  # every phase ends with an eval
                last_eval = evaluate(step_phase, eval_step, step_ctrl)
                writer.write(step, {**last_eval, "eval/phase_index": float(len(phases_seen) - 1)})
                t_log = time.perf_counter()  # keep eval time out of train/step_s
            bar.update(1)
    data.close()

    # --- Final checkpoint and summary --------------------------------------------------------
    ckpt_dir = checkpoint.save_params(os.path.join(run_dir, "checkpoints"), run.total_steps, state.params,
                                      state.buffers, run.model_for(step_phase))
    tokenizer = os.path.join(run.loader_cfg.root, "tokenizer.json")
    if is_main and os.path.exists(tokenizer):  # `score --checkpoint` finds the run's tokenizer here
        shutil.copy(tokenizer, os.path.join(ckpt_dir, "tokenizer.json"))
    tail = jax.device_get(list(history))
    steps_timed = max(run.total_steps - 1, 1)
    step_s = t_train / steps_timed if run.total_steps > 1 else float("nan")
    summary = {
        "start_loss": first["train/ce"], "end_loss": float(np.mean([m["ce"] for m in tail])),
        "start_total_loss": first["train/loss"], "end_total_loss": float(np.mean([m["loss"] for m in tail])),
        **last_eval, "compile_s": compile_s, "step_s": step_s, "phases": phases_seen,
        "tokens_seen": step_tokens_after, "steps": run.total_steps,
        "mfu": mfu_num / t_train / peak if peak and t_train else None,
        "wall_s": time.perf_counter() - t_start, "checkpoint": ckpt_dir,
    }
    if is_main:
        print(f"start loss {summary['start_loss']:.3f} -> end loss {summary['end_loss']:.3f} "
              f"(next-token CE, nats/token; mean of the last {len(tail)} steps; total loss with MTP and aux: "
              f"{summary['start_total_loss']:.3f} -> {summary['end_total_loss']:.3f}; "
              f"held-out CE {last_eval.get('eval/ce', float('nan')):.3f})")
        mfu = f"{summary['mfu']:.1%} MFU vs {peak_source}" if summary["mfu"] else "MFU n/a"
        print(f"{run.total_steps} steps through phases {' -> '.join(phases_seen)} ({step_tokens_after:,} tokens); "
              f"compile {compile_s:.1f} s, {step_s * 1e3:.0f} ms/step, {mfu}; wall {summary['wall_s']:.1f} s; "
              f"checkpoint {ckpt_dir}")
    return state, summary


def main(argv):
    del argv
    if jax.process_index() != 0:
        logging.set_verbosity(logging.WARNING)
    train(flags.FLAGS.config)


if __name__ == "__main__":
    # Defined here, not at import: bench and train each own a --config flag.
    config_flags.DEFINE_config_file("config", None, "Training config file, e.g. configs/pretrain.py:tiny.",
                                      lock_config=True)
    app.run(main)

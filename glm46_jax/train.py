"""Pre-training entry point: config -> mesh -> model -> data -> optimizer -> jitted step -> loop.

    python -m glm46_jax.train --config=configs/pretrain.py:tiny [--config.train.steps=10 ...]

Writes to `run_dir`: config.json (the resolved config), metrics.jsonl (one JSON object per log
or eval point) and checkpoints/<step>/ (final params + buffers + model_config.json). Only
process 0 prints or writes files; every process runs the same program.
"""

from __future__ import annotations

import collections
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import app, logging
from ml_collections import config_flags
from tqdm import tqdm

from glm46_jax import checkpoint, sharding
from glm46_jax.config import model_config_from_dict
from glm46_jax.data import bytes_corpus
from glm46_jax.model import init_model
from glm46_jax.optim import OptimConfig, build_optimizer
from glm46_jax.train_step import TrainState, init_state, make_eval_step, make_train_step

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file, e.g. configs/pretrain.py:tiny.",
                                          lock_config=True)
_END_WINDOW = 10  # "end loss" = mean over this many final steps: one noisy batch says little


def _device_batch(batch: dict[str, np.ndarray], layout: jax.NamedSharding) -> dict[str, jax.Array]:
    # Every process holds the same global batch (it is a pure function of seed and step) and
    # hands each of its devices the shard it owns: correct for one process or many. The one
    # sanctioned host->device copy of the loop (make_array_from_callback trips the guard).
    with jax.transfer_guard_host_to_device("allow"):
        return {k: jax.make_array_from_callback(v.shape, layout, lambda index, v=v: v[index]) for k, v in batch.items()}


def _scalars(metrics: dict[str, Any], prefix: str) -> dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in jax.device_get(metrics).items()}


def train(config: ml_collections.ConfigDict,
          devices: Sequence[jax.Device] | None = None) -> tuple[TrainState, dict[str, Any]]:
    """Run the whole training job on `devices` (default: all); returns (final state, summary)."""
    t_start = time.perf_counter()
    is_main = jax.process_index() == 0
    tcfg = config.train

    # --- Config and run dir ------------------------------------------------------------------
    model_cfg = model_config_from_dict(config.model)
    optim = dict(config.optim)
    mtp_weight = float(optim.pop("mtp_weight"))
    optim_cfg = OptimConfig(**optim)
    run_dir = os.path.abspath(config.run_dir)
    if is_main:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if is_main:
        open(metrics_path, "w").close()  # a fresh log per run

    def record(step: int, values: dict[str, float]):
        if is_main:
            with open(metrics_path, "a") as f:  # appended line by line: readable while the run goes
                f.write(json.dumps({"step": step, **values}) + "\n")
            logging.info("step %d  %s", step, "  ".join(f"{k}={v:.4g}" for k, v in values.items()))

    # --- Mesh and model ----------------------------------------------------------------------
    mesh = sharding.make_mesh(dict(config.mesh), devices, cfg=model_cfg, global_batch=tcfg.global_batch)
    graphdef, params, buffers = init_model(model_cfg, mesh, tcfg.seed)
    batch_layout = jax.NamedSharding(mesh, sharding.logical("batch", "seq"))

    # --- Data --------------------------------------------------------------------------------
    corpus = bytes_corpus.stdlib_docstrings()
    if model_cfg.vocab_size < bytes_corpus.VOCAB_SIZE:
        raise ValueError(f"byte corpus needs vocab_size >= {bytes_corpus.VOCAB_SIZE}, model has {model_cfg.vocab_size}")
    train_batches = bytes_corpus.train_batches(corpus.train, tcfg.global_batch, tcfg.seq_len, tcfg.seed)
    eval_set = [_device_batch(b, batch_layout) for b in
                bytes_corpus.eval_batches(corpus.heldout, tcfg.global_batch, tcfg.seq_len, tcfg.eval_batches)]
    logging.info("corpus: %d train / %d held-out byte tokens from %d / %d stdlib modules", len(corpus.train),
                 len(corpus.heldout), len(corpus.train_modules), len(corpus.heldout_modules))

    # --- Optimizer and jitted steps ----------------------------------------------------------
    tx, lr_schedule = build_optimizer(optim_cfg, params)
    with sharding.use_mesh(mesh):
        state = init_state(params, buffers, tx)
        del params, buffers  # now owned by `state`, which the step donates
        first_batch = _device_batch(next(train_batches), batch_layout)
        t0 = time.perf_counter()
        # Compiled ahead of time: the compile time is measured on its own, and a batch of the
        # wrong shape fails loudly instead of silently recompiling.
        train_step = make_train_step(graphdef, tx, model_cfg, mtp_weight=mtp_weight,
                                     lr_schedule=lr_schedule).lower(state, first_batch).compile()
        eval_step = make_eval_step(graphdef, model_cfg, mtp_weight=mtp_weight).lower(state, eval_set[0]).compile()
        compile_s = time.perf_counter() - t0
    logging.info("compiled train + eval step in %.1f s", compile_s)

    def evaluate() -> dict[str, float]:
        per_batch = jax.device_get([eval_step(state, b) for b in eval_set])
        return {f"eval/{k}": float(np.mean([m[k] for m in per_batch])) for k in per_batch[0]}

    # --- Train loop --------------------------------------------------------------------------
    history: collections.deque = collections.deque(maxlen=_END_WINDOW)  # device metrics, fetched at the end
    first: dict[str, float] = {}
    last_eval: dict[str, float] = {}
    batch = first_batch
    t_first_done = t_log = time.perf_counter()
    last_logged = 0
    # Host<->device copies in the loop must be explicit (device_get / make_array_from_callback).
    with sharding.use_mesh(mesh), jax.transfer_guard("disallow"), \
            tqdm(total=tcfg.steps, disable=not is_main, desc="train") as bar:
        for step in range(1, tcfg.steps + 1):
            state, metrics = train_step(state, batch)
            history.append(metrics)
            if step < tcfg.steps:
                batch = _device_batch(next(train_batches), batch_layout)  # overlaps the running step
            if step == 1 or step % tcfg.log_every == 0 or step == tcfg.steps:
                values = _scalars(metrics, "train")
                now = time.perf_counter()
                values["train/step_s"] = (now - t_log) / (step - last_logged)
                t_log, last_logged = now, step
                if step == 1:
                    first, t_first_done = values, now
                record(step, values)
                bar.set_postfix(loss=f"{values['train/loss']:.3f}", ce=f"{values['train/ce']:.3f}")
            if step % tcfg.eval_every == 0 or step == tcfg.steps:
                last_eval = evaluate()
                record(step, last_eval)
                t_log = time.perf_counter()  # keep eval time out of train/step_s
            bar.update(1)
    t_loop_end = time.perf_counter()

    # --- Final checkpoint and summary --------------------------------------------------------
    ckpt_dir = checkpoint.save_params(os.path.join(run_dir, "checkpoints"), tcfg.steps, state.params,
                                      state.buffers, model_cfg)
    tail = jax.device_get(list(history))
    summary = {
        "start_loss": first["train/ce"], "end_loss": float(np.mean([m["ce"] for m in tail])),
        "start_total_loss": first["train/loss"], "end_total_loss": float(np.mean([m["loss"] for m in tail])),
        **last_eval, "compile_s": compile_s,
        "step_s": (t_loop_end - t_first_done) / max(tcfg.steps - 1, 1),
        "wall_s": time.perf_counter() - t_start, "checkpoint": ckpt_dir,
    }
    if is_main:
        print(f"start loss {summary['start_loss']:.3f} -> end loss {summary['end_loss']:.3f} "
              f"(next-token CE, nats/byte; mean of the last {len(tail)} steps; with {mtp_weight} x MTP: "
              f"{summary['start_total_loss']:.3f} -> {summary['end_total_loss']:.3f}; "
              f"held-out CE {last_eval.get('eval/ce', float('nan')):.3f})")
        print(f"compile {compile_s:.1f} s, {summary['step_s'] * 1e3:.0f} ms/step, wall {summary['wall_s']:.1f} s; "
              f"checkpoint {ckpt_dir}")
    return state, summary


def main(argv):
    del argv
    if jax.process_index() != 0:
        logging.set_verbosity(logging.WARNING)
    train(_CONFIG.value)


if __name__ == "__main__":
    app.run(main)

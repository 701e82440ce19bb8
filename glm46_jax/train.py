"""Pre-training entry point: config -> mesh -> model -> optimizer -> jitted step -> data -> loop.

    python -m glm46_jax.train --config=configs/pretrain.py:tiny [--config.train.steps=10 ...]

Writes to `run_dir`: config.json (the resolved config), metrics.jsonl and tensorboard/ (one
record per log or eval point, `metrics.MetricWriter`) and checkpoints/<step>/ (final params +
buffers + model_config.json). Only process 0 prints or writes files; every process runs the same
program. `build` is shared with `glm46_jax.bench`.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
import optax
from absl import app, flags, logging
from ml_collections import config_flags
from tqdm import tqdm

from glm46_jax import checkpoint, metrics, sharding
from glm46_jax.balancing import BalanceConfig, rate_at
from glm46_jax.config import ModelConfig, model_config_from_dict
from glm46_jax.counting import flops_per_token
from glm46_jax.data import bytes_corpus
from glm46_jax.loss import LossConfig, mtp_weight_at
from glm46_jax.model import init_model
from glm46_jax.optim import OptimConfig, build_optimizer
from glm46_jax.train_step import StepConfig, TrainState, controls, init_state, make_eval_step, make_train_step

_END_WINDOW = 10  # "end loss" = mean over this many final steps: one noisy batch says little


@dataclasses.dataclass
class Run:
    """What `build` wires together; `train` and `bench` drive it."""
    model_cfg: ModelConfig
    loss_cfg: LossConfig
    balance_cfg: BalanceConfig
    mesh: jax.sharding.Mesh
    state: TrainState
    lr_schedule: optax.Schedule
    train_step: Any  # jitted (state, batch, controls) -> (state, metrics)
    eval_step: Any  # jitted (state, batch, controls) -> metrics
    accum_steps: int
    flops_per_token: int  # model FLOPs per trained token (counting.flops_per_token), the MFU numerator

    def device_batch(self, batch: dict[str, np.ndarray], *, train: bool = True) -> dict[str, jax.Array]:
        """A host batch [B, s] (the same on every process) as global arrays on the mesh; for the
        train step with accumulation, reshaped to [accum_steps, B / accum_steps, s]."""
        a = self.accum_steps if train else 1
        layout = jax.NamedSharding(self.mesh, sharding.logical(*((None,) if a > 1 else ()), "batch", "seq"))
        # Every process holds the same global batch (a pure function of seed and step) and hands
        # each of its devices the shard it owns: correct for one process or many. The sanctioned
        # host->device copy of the loop (make_array_from_callback trips the transfer guard).
        with jax.transfer_guard_host_to_device("allow"):
            out = {}
            for k, v in batch.items():
                v = v.reshape(a, v.shape[0] // a, *v.shape[1:]) if a > 1 else v
                out[k] = jax.make_array_from_callback(v.shape, layout, lambda index, v=v: v[index])
            return out

    def controls_at(self, tokens_seen: int):
        """The token-scheduled scalars for the next step (MTP weight, balancing rate)."""
        with jax.transfer_guard_host_to_device("allow"):
            return controls(mtp_weight_at(self.loss_cfg, tokens_seen), rate_at(self.balance_cfg, tokens_seen))


def build(config: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None) -> Run:
    """Config -> mesh -> model -> optimizer -> train state and jitted steps (nothing compiled yet)."""
    tcfg = config.train
    model_cfg = model_config_from_dict(config.model)
    loss_cfg, balance_cfg, optim_cfg = LossConfig(**config.loss), BalanceConfig(**config.balance), \
        OptimConfig(**config.optim)
    accum = int(tcfg.accum_steps)
    if accum < 1 or tcfg.global_batch % accum:
        raise ValueError(f"train.accum_steps={accum} must be >= 1 and divide train.global_batch={tcfg.global_batch}")
    mesh = sharding.make_mesh(dict(config.mesh), devices, cfg=model_cfg, global_batch=tcfg.global_batch // accum)
    graphdef, params, buffers = init_model(model_cfg, mesh, tcfg.seed)
    tx, lr_schedule = build_optimizer(optim_cfg, params)
    step_cfg = StepConfig(loss=loss_cfg, balance_mtp=balance_cfg.include_mtp, accum_steps=accum)
    with sharding.use_mesh(mesh):
        state = init_state(params, buffers, tx)
    return Run(model_cfg=model_cfg, loss_cfg=loss_cfg, balance_cfg=balance_cfg, mesh=mesh, state=state,
               lr_schedule=lr_schedule, accum_steps=accum,
               train_step=make_train_step(graphdef, tx, model_cfg, step_cfg, lr_schedule=lr_schedule),
               eval_step=make_eval_step(graphdef, model_cfg, loss_cfg),
               flops_per_token=flops_per_token(model_cfg, tcfg.seq_len))


def _scalars(values: dict[str, Any], prefix: str) -> dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in jax.device_get(values).items()}


def train(config: ml_collections.ConfigDict,
          devices: Sequence[jax.Device] | None = None) -> tuple[TrainState, dict[str, Any]]:
    """Run the whole training job on `devices` (default: all); returns (final state, summary)."""
    t_start = time.perf_counter()
    is_main = jax.process_index() == 0
    tcfg = config.train

    # --- Run dir, model, optimizer, steps -----------------------------------------------------
    run_dir = os.path.abspath(config.run_dir)
    if is_main:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    run = build(config, devices)
    state = run.state
    run.state = None  # the loop owns the state (the step donates it)
    tokens_per_step = tcfg.global_batch * tcfg.seq_len
    peak, peak_source = metrics.system_peak(list(run.mesh.devices.flatten()))
    logging.info("MFU peak: %s (%s); %.3g model FLOPs per token", peak, peak_source, run.flops_per_token)

    # --- Data --------------------------------------------------------------------------------
    corpus = bytes_corpus.stdlib_docstrings()
    if run.model_cfg.vocab_size < bytes_corpus.VOCAB_SIZE:
        raise ValueError(f"byte corpus needs vocab_size >= {bytes_corpus.VOCAB_SIZE}, "
                         f"model has {run.model_cfg.vocab_size}")
    train_batches = bytes_corpus.train_batches(corpus.train, tcfg.global_batch, tcfg.seq_len, tcfg.seed)
    eval_set = [run.device_batch(b, train=False) for b in
                bytes_corpus.eval_batches(corpus.heldout, tcfg.global_batch, tcfg.seq_len, tcfg.eval_batches)]
    logging.info("corpus: %d train / %d held-out byte tokens from %d / %d stdlib modules", len(corpus.train),
                 len(corpus.heldout), len(corpus.train_modules), len(corpus.heldout_modules))

    # --- Compile ahead of time: compile time is measured on its own, and a batch of the wrong
    # shape fails loudly instead of silently recompiling.
    tokens_seen = 0
    with sharding.use_mesh(run.mesh):
        batch, ctrl = run.device_batch(next(train_batches)), run.controls_at(tokens_seen)
        t0 = time.perf_counter()
        train_step = run.train_step.lower(state, batch, ctrl).compile()
        eval_step = run.eval_step.lower(state, eval_set[0], ctrl).compile()
        compile_s = time.perf_counter() - t0
    logging.info("compiled train + eval step in %.1f s", compile_s)

    def evaluate(ctrl) -> dict[str, float]:
        per_batch = jax.device_get([eval_step(state, b, ctrl) for b in eval_set])
        out = {f"eval/{k}": float(np.mean([m[k] for m in per_batch])) for k in per_batch[0]}
        out["eval/ppl"] = float(np.exp(out["eval/ce"]))  # of the mean CE, not the mean of ppls
        return out

    # --- Train loop --------------------------------------------------------------------------
    history: collections.deque = collections.deque(maxlen=_END_WINDOW)  # device metrics, fetched at the end
    first: dict[str, float] = {}
    last_eval: dict[str, float] = {}
    t_first_done = t_log = time.perf_counter()
    last_logged = 0
    writer = metrics.MetricWriter(run_dir, enabled=is_main, tensorboard=tcfg.tensorboard)
    # Host<->device copies in the loop must be explicit (device_get / make_array_from_callback).
    with writer, sharding.use_mesh(run.mesh), jax.transfer_guard("disallow"), \
            tqdm(total=tcfg.steps, disable=not is_main, desc="train") as bar:
        for step in range(1, tcfg.steps + 1):
            state, step_metrics = train_step(state, batch, ctrl)
            tokens_seen += tokens_per_step
            history.append(step_metrics)
            if step < tcfg.steps:  # prepared while the step runs
                batch, ctrl = run.device_batch(next(train_batches)), run.controls_at(tokens_seen)
            in_a_row = int(jax.device_get(step_metrics["nonfinite_in_a_row"]))
            if in_a_row >= tcfg.max_nonfinite:
                raise FloatingPointError(
                    f"step {step}: loss or gradient not finite for {in_a_row} steps in a row "
                    f"(train.max_nonfinite={tcfg.max_nonfinite}); the updates were skipped, the last finite "
                    f"parameters are in memory. Lower optim.lr, raise optim.warmup_steps or check the data.")
            if step == 1 or step % tcfg.log_every == 0 or step == tcfg.steps:
                values = _scalars(step_metrics, "train")
                now = time.perf_counter()
                step_s = (now - t_log) / (step - last_logged)
                t_log, last_logged = now, step
                values.update({"train/step_s": step_s, "train/tokens_per_s": tokens_per_step / step_s,
                               "train/tokens_seen": float(tokens_seen)})
                if peak and step > 1:  # step 1's time is dispatch + first run, not a step
                    values["train/mfu"] = run.flops_per_token * tokens_per_step / step_s / peak
                if step == 1:
                    first, t_first_done = values, now
                writer.write(step, values)
                bar.set_postfix(loss=f"{values['train/loss']:.3f}", ce=f"{values['train/ce']:.3f}")
            if step % tcfg.eval_every == 0 or step == tcfg.steps:
                last_eval = evaluate(ctrl)
                writer.write(step, last_eval)
                t_log = time.perf_counter()  # keep eval time out of train/step_s
            bar.update(1)
    t_loop_end = time.perf_counter()

    # --- Final checkpoint and summary --------------------------------------------------------
    ckpt_dir = checkpoint.save_params(os.path.join(run_dir, "checkpoints"), tcfg.steps, state.params,
                                      state.buffers, run.model_cfg)
    tail = jax.device_get(list(history))
    step_s = (t_loop_end - t_first_done) / max(tcfg.steps - 1, 1)
    summary = {
        "start_loss": first["train/ce"], "end_loss": float(np.mean([m["ce"] for m in tail])),
        "start_total_loss": first["train/loss"], "end_total_loss": float(np.mean([m["loss"] for m in tail])),
        **last_eval, "compile_s": compile_s, "step_s": step_s, "tokens_per_s": tokens_per_step / step_s,
        "mfu": run.flops_per_token * tokens_per_step / step_s / peak if peak else None,
        "tokens_seen": tokens_seen, "wall_s": time.perf_counter() - t_start, "checkpoint": ckpt_dir,
    }
    if is_main:
        print(f"start loss {summary['start_loss']:.3f} -> end loss {summary['end_loss']:.3f} "
              f"(next-token CE, nats/token; mean of the last {len(tail)} steps; total loss with MTP and aux: "
              f"{summary['start_total_loss']:.3f} -> {summary['end_total_loss']:.3f}; "
              f"held-out CE {last_eval.get('eval/ce', float('nan')):.3f})")
        mfu = f"{summary['mfu']:.1%} MFU vs {peak_source}" if peak else "MFU n/a"
        print(f"compile {compile_s:.1f} s, {step_s * 1e3:.0f} ms/step, {summary['tokens_per_s']:.0f} tokens/s, "
              f"{mfu}; wall {summary['wall_s']:.1f} s; checkpoint {ckpt_dir}")
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

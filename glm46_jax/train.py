"""Training entry point: config -> run config -> recipe -> resume or init -> trainer.fit -> summary.

    python -m glm46_jax.train --config=configs/pretrain.py:tiny [--config.train.steps=10 ...]

The config file (ml_collections, with `--config.x.y=` overrides) is turned into a typed
`run_config.RunConfig` once, in `main`; a bad value stops the run there with one line (exit 2).
The recipe is looked up by `config.recipe` in `run_config.RECIPES`, which names its builder and config sections:
pre-training over the curriculum (`pretrain.Pretraining`), "sft" fine-tuning on chat data (`sft.FineTuning`,
configs/sft.py), "grpo" and "ppo" reinforcement learning (`recipes.rl.grpo.recipe`, `recipes.rl.ppo.recipe`),
"reward" and "dpo" on preference pairs (`recipes.preference.recipe`); every recipe is driven the same way
(`trainer.Recipe`), and the loop around the step (evaluation, bad steps, metrics, checkpoints, preemption) is
`trainer.fit`'s.

Writes to `run_dir`: config.json (the config as given), tokenizer.json (the corpus's),
metrics.jsonl and tensorboard/ (`monitor.sinks`: also Prometheus and W&B; docs/monitoring.md), checkpoints/<step>/ (`checkpoint.Checkpointer`:
weights, optimizer, data-iterator state, meta), from which a restarted run resumes, and at the end
status.json: {"state": "complete" | "stopped" (by SIGTERM/SIGUSR1, saved and resumable), "step",
"total_steps", "reason"[, "rolled_back_to"]}, or "hung" (written by the watchdog, glm46_jax/monitoring/watchdog.py).
A run its recipe ends early (`Recipe.stop_reason`, e.g. RL's reward-model check) is "complete", the reason given; with
checkpoint.keep_best it ends on its best step (`rolled_back_to`), as a completed run does with checkpoint.end_on_best.

Multi-process (`distributed.initialize`, called first by `main`: Slurm's srun, or
`launch/local_multiprocess.sh N`): every process runs this same program on its own devices and
reads its own share of the data (or, with data.process_split="rows", the whole batch); all of them
take part in checkpointing; only process 0 prints or writes metrics.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import flags, logging
from ml_collections import config_flags

from glm46_jax import atomic, cli, run_config
from glm46_jax.errors import InputError
from glm46_jax.parallel import distributed
from glm46_jax.run_config import RunConfig
from glm46_jax.training import checkpoint, trainer
from glm46_jax.training.step import TrainState


def _run_tokenizer(run_dir: str, source: str | None, is_main: bool) -> dict[str, str] | None:
    """Copy the recipe's tokenizer.json into the run dir (scoring, generation and export find it there); None
    when there is none."""
    if not source or not os.path.exists(source):
        return None
    with open(source, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    target = os.path.join(run_dir, "tokenizer.json")
    if is_main and os.path.abspath(source) != os.path.abspath(target):
        shutil.copy(source, target)
    return {"path": target, "source": os.path.abspath(source), "sha256": digest}


def _check_not_finished(start_step: int, total_steps: int, ckpt: checkpoint.Checkpointer) -> None:
    if start_step > total_steps:
        raise InputError(
            f"{ckpt.directory}: this run already finished ({start_step - 1} of {total_steps} steps), nothing to do. "
            "To train it further, raise --config.train.steps or the curriculum's token budgets (the run resumes "
            "from its last checkpoint); to start over, pass a new --config.run_dir.")


def train(cfg: RunConfig, devices: Sequence[jax.Device] | None = None) -> tuple[TrainState, dict[str, Any]]:
    """Run the whole training job on `devices` (default: all); returns (final state, summary)."""
    t_start = time.perf_counter()
    is_main = jax.process_index() == 0
    if is_main:
        os.makedirs(cfg.run_dir, exist_ok=True)
        atomic.write_json(os.path.join(cfg.run_dir, "config.json"), cfg.source)

    recipe, state = run_config.RECIPES[cfg.recipe].load()(cfg, devices)  # starting weights: init_from's or random
    recipe.tokenizer = _run_tokenizer(cfg.run_dir, recipe.tokenizer_source(), is_main)

    c = cfg.checkpoint
    ckpt = checkpoint.Checkpointer(cfg.run_dir, every=c.every, keep=c.keep or None, async_save=c.async_save,
                                   best_metric=c.best_metric if c.keep_best else None, best_mode=c.best_mode)
    try:
        start_step, state, data_state = checkpoint.resume(ckpt, state, resume=c.resume,
                                                          global_rows=recipe.global_rows)
        _check_not_finished(start_step, recipe.total_steps, ckpt)
        recipe.start(state, data_state)
        with trainer.Preemption(multi_process=jax.process_count() > 1) as stop:
            state, summary = trainer.fit(recipe, state, ckpt, cfg.train, run_dir=cfg.run_dir, start_step=start_step,
                                         stop=stop, global_rows=recipe.global_rows, monitor_cfg=cfg.monitor)
        if (summary["early_stop"] or c.end_on_best) and c.keep_best and not stop.requested:
            state, summary = _roll_back(ckpt, state, summary, recipe.global_rows)
        if not stop.requested:  # e.g. LoRA: the merged weights
            summary["merged"] = recipe.finish(state, summary.get("rolled_back_to") or summary["steps"], cfg.run_dir,
                                              summary["tokens_seen"])
    finally:
        recipe.close()
        ckpt.close()  # waits for the last write

    step = summary["steps"]
    if is_main:  # for schedulers: launch/slurm_pretrain.sbatch requeues a run that stopped early
        status = {"state": "stopped" if stop.requested else "complete", "step": step,
                  "total_steps": recipe.total_steps, "reason": stop.requested or summary["early_stop"]}
        if summary.get("rolled_back_to") is not None:
            status["rolled_back_to"] = summary["rolled_back_to"]
        atomic.write_json(os.path.join(cfg.run_dir, "status.json"), status)
    summary.update(wall_s=time.perf_counter() - t_start, checkpoint=os.path.join(ckpt.directory, str(step)),
                   total_steps=recipe.total_steps)
    if is_main:
        print(_summary_lines(summary))
    return state, summary


def _roll_back(ckpt: checkpoint.Checkpointer, state: TrainState, summary: dict[str, Any], global_rows: bool
               ) -> tuple[TrainState, dict[str, Any]]:
    """A run its recipe stopped (or any completed one, with checkpoint.end_on_best) ends on its best kept step
    (checkpoint.keep_best), not on its last one."""
    best = ckpt.best_step()
    summary["rolled_back_to"] = best
    if best is not None and best != summary["steps"]:
        state, _, _ = ckpt.restore(best, state, global_rows)
        logging.warning("the run ended at step %d (%s): rolled back to step %d, the best by %s", summary["steps"],
                        summary["early_stop"] or "checkpoint.end_on_best", best, ckpt.best_metric)
    return state, summary


def _summary_lines(s: dict[str, Any]) -> str:
    held_out = format(s["eval/ce"], ".3f") if "eval/ce" in s else "n/a: no eval ran"
    if "eval/accuracy" in s:  # an RL run's held-out metric
        held_out = f"n/a; held-out accuracy {s['eval/accuracy']:.3f}"
    mfu = f"{s['mfu']:.1%} MFU vs {s['mfu_peak_source']}" if s["mfu"] else "MFU n/a"
    if np.isnan(s["start_loss"]) and np.isnan(s["end_loss"]):  # no next-token CE: a reward model's pairs
        loss = (f"start loss {s['start_total_loss']:.3f} -> end loss {s['end_total_loss']:.3f} (the recipe's loss; "
                f"mean of the last {s['end_window']} steps; held-out CE {held_out})\n")
    else:
        loss = (f"start loss {s['start_loss']:.3f} -> end loss {s['end_loss']:.3f} (next-token CE, nats/token; mean "
                f"of the last {s['end_window']} steps; total loss with MTP and aux: {s['start_total_loss']:.3f} -> "
                f"{s['end_total_loss']:.3f}; held-out CE {held_out})\n")
    return (loss +
            f"steps {s['start_step']}-{s['steps']} of {s['total_steps']} through phases {' -> '.join(s['phases'])} "
            f"({s['tokens_seen']:,} tokens seen); compile {s['compile_s']:.1f} s, {s['step_s'] * 1e3:.0f} ms/step, "
            f"{mfu}; wall {s['wall_s']:.1f} s; checkpoint {s['checkpoint']} ({len(s['save_block_s'])} saves, the loop "
            f"blocked {1e3 * float(np.mean(s['save_block_s'] or [0])):.0f} ms per save on average)")


def main(argv: Sequence[str]) -> None:
    del argv
    cfg = run_config.from_config_dict(flags.FLAGS.config)  # the one place a ConfigDict is read
    distributed.initialize(cfg.distributed)  # before anything touches a device
    if jax.process_index() != 0:
        logging.set_verbosity(logging.WARNING)
    train(cfg)


if __name__ == "__main__":
    # Defined here, not at import: bench and train each own a --config flag.
    config_flags.DEFINE_config_file("config", None, "Training config file, e.g. configs/pretrain.py:tiny.",
                                      lock_config=True)
    cli.run_absl(main)

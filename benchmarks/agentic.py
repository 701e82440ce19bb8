"""Agentic GRPO with rollouts sampled ahead: wall time per RL step with rl.rollouts_ahead = 0 (synchronous) and 1
(the rollout worker samples the next rollout while the trainer updates), and where it goes (docs/rl.md#rollouts-ahead).

    PYTHONPATH=. python benchmarks/agentic.py --init-from runs/sft_agent_calc --data data/agent_calc --rollouts 10
    PYTHONPATH=. python benchmarks/agentic.py --ahead 0 1 2 --out results.json

Each setting runs configs/grpo.py:agent (episodes with the calculator tool) for `--rollouts` rollouts twice in one
process: the first run compiles every program (and is discarded), the second is timed, so compile time is left out.
Per setting: the timed run's wall time per RL step (one rollout and its `rl.minibatches` updates, held-out
evaluation off), the median sampling time of a rollout (`train/sampling_s`: the episodes' generate calls, in the
worker's thread when ahead), the median time the trainer waited for its rollout (`train/rollout_wait_s`: all of
the sampling when synchronous, the part the worker did not hide when ahead), the rest of the RL step (the updates,
the correction's forward, the host work) and the ratio of the synchronous step time to this one. With K > 0 a step also holds the current policy's log-probs of the
rollout (the off-policy correction's forward). Held-out success is not the point here (too few rollouts).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from glm46_jax import run_config, train
from glm46_jax.run_config import config_file

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs")


def config(args, ahead: int):
    c = config_file(os.path.join(CONFIGS, "grpo.py"), "agent")
    with c.unlocked():
        c.run_dir = tempfile.mkdtemp(prefix=f"agentic_bench_{ahead}_")
        c.checkpoint.update(init_from=args.init_from, every=1000, async_save=False)
        c.train.update(eval_every=0, log_every=1, seed=args.seed)
        c.monitor.sinks = "jsonl"
        c.rl.update(prompts=os.path.join(args.data, "prompts_train.jsonl"), eval_batch=8,
                    heldout=os.path.join(args.data, "prompts_heldout.jsonl"), rollouts=args.rollouts,
                    rollouts_ahead=ahead)
    return run_config.from_config_dict(c)


def timed(args, ahead: int) -> dict[str, float]:
    train.train(config(args, ahead), jax.devices()[:1])  # compiles
    cfg = config(args, ahead)
    t0 = time.perf_counter()
    train.train(cfg, jax.devices()[:1])
    wall = time.perf_counter() - t0
    with open(os.path.join(cfg.run_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "train/loss" in r]
    per = cfg.rl.updates_per_rollout
    sampling = [r["train/sampling_s"] for r in rows[::per]]
    waited = [r["train/rollout_wait_s"] for r in rows[::per]]
    return {"ahead": ahead, "wall_s": wall, "rl_step_s": wall / args.rollouts,
            "sampling_s": float(np.median(sampling)), "wait_s": float(np.median(waited)),
            "rest_s": wall / args.rollouts - float(np.mean(waited)),
            "staleness": float(np.mean([r.get("train/staleness", 0.0) for r in rows]))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init-from", default="runs/sft_agent_calc")
    p.add_argument("--data", default="data/agent_calc")
    p.add_argument("--rollouts", type=int, default=10)
    p.add_argument("--ahead", type=int, nargs="+", default=[0, 1])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    args = p.parse_args()
    results = [timed(args, k) for k in args.ahead]
    base = results[0]["rl_step_s"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    print(f"commit {commit}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"jax {jax.__version__}, {jax.devices()[0].platform}; {args.rollouts} rollouts per setting")
    print("| rollouts_ahead | wall s | RL step s | sampling s (median) | waited for the rollout s (median) | "
          "rest of the step s | mean staleness | speed vs K=0 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['ahead']} | {r['wall_s']:.1f} | {r['rl_step_s']:.2f} | {r['sampling_s']:.2f} | {r['wait_s']:.2f} | "
              f"{r['rest_s']:.2f} | {r['staleness']:.2f} | {base / r['rl_step_s']:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"commit": commit, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

"""Where an RL step's time goes: rollout (sampling + rewards) vs the GRPO updates, tokens/s of each.

    PYTHONPATH=. python benchmarks/rl.py                                    # tiny model, random init, CPU
    PYTHONPATH=. python benchmarks/rl.py --init-from runs/sft_rl_addition --data data/rl_addition --rollouts 8
    PYTHONPATH=. python benchmarks/rl.py --preset small --group-size 16 --max-new-tokens 256 --out results.json

Builds the GRPO recipe (`glm46_jax.recipes.grpo.recipe`) from configs/grpo.py:tiny with the given overrides, compiles
everything first (one warm-up rollout and one update per minibatch shape), then times `--rollouts` RL steps:
each is one rollout (`prompts_per_step` x `group_size` samples from the generator, rewards, training rows) and
`minibatches` optimizer steps on it. Rollout tokens/s counts generated tokens; training tokens/s counts the
trained rows' token slots (prompt + completion, padding included: what the update computes on). Wall times are
synchronised (block_until_ready) so each phase is charged with its own device work.
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

from data_prep import rl_tasks  # noqa: E402
from glm46_jax import run_config
from glm46_jax.parallel import sharding  # noqa: E402
from glm46_jax.recipes.grpo import recipe as rl_recipe  # noqa: E402
from glm46_jax.run_config import config_file  # noqa: E402


def build_config(args, data: str):
    c = config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "grpo.py"), "tiny")
    with c.unlocked():
        c.run_dir = tempfile.mkdtemp(prefix="rl_bench_")
        if args.preset != "tiny":
            base = config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs",
                                            "pretrain.py"), args.preset)
            c.model = base.model
        c.model.dtype = args.dtype
        c.checkpoint.update(init_from=args.init_from)
        c.train.update(eval_batches=1)
        c.rl.update(prompts=os.path.join(data, "prompts_train.jsonl"),
                    heldout=os.path.join(data, "prompts_heldout.jsonl"),
                    tokenizer="" if args.init_from else os.path.join(data, "tokenizer.json"),
                    group_size=args.group_size, prompts_per_step=args.prompts, minibatches=args.minibatches,
                    max_new_tokens=args.max_new_tokens, dynamic_sampling=False, eval_batch=8,
                    routing_replay=not args.no_replay)
    return run_config.from_config_dict(c)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", help="model preset of configs/pretrain.py (random init)")
    p.add_argument("--init-from", default="", help="start from this run's weights (and tokenizer)")
    p.add_argument("--data", default="", help="a data_prep.rl_tasks directory (default: generated in a temp dir)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--rollouts", type=int, default=5)
    p.add_argument("--no-replay", action="store_true", help="routing replay off (no routing recorded)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()

    data = args.data or tempfile.mkdtemp(prefix="rl_bench_data_")
    if not args.data:
        rl_tasks.write(data, seed=0, heldout=8, sft=0)
    cfg = build_config(args, data)
    recipe, state = rl_recipe.build(cfg)
    recipe.start(None, None)
    step = recipe.steps_for(recipe.segment())

    def rollout(state):
        """(rollout seconds, of which sampling, generated tokens) of a rollout sampled from `state`."""
        t0 = time.perf_counter()
        recipe._rollout(state)
        seconds = time.perf_counter() - t0
        stats = dict(recipe.stats)
        return seconds, stats["sampling_s"], stats["response_len"] * stats["sampled_groups"] * args.group_size

    def update(state):
        inp = recipe.next_input(state, float("inf"))
        t0 = time.perf_counter()
        with sharding.use_mesh(recipe.mesh):
            state, metrics = step(state, inp.batch, inp.controls, recipe.frozen)
            jax.block_until_ready(metrics)
        return state, time.perf_counter() - t0, inp.batch["inputs"].size

    # Warm-up: compile the sampler and the update.
    rollout(state)
    for _ in range(args.minibatches):
        state, *_ = update(state)
    rows = []
    for _ in range(args.rollouts):
        roll_s, sample_s, new_tokens = rollout(state)
        train_s, train_tokens = 0.0, 0
        for _ in range(args.minibatches):
            state, seconds, tokens = update(state)
            train_s, train_tokens = train_s + seconds, train_tokens + tokens
        rows.append((roll_s, sample_s, new_tokens, train_s, train_tokens))
    roll_s, sample_s, new_tokens, train_s, train_tokens = (float(np.median(c)) for c in zip(*rows))
    total = roll_s + train_s
    result = {
        "device": f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind}, {len(jax.devices())} devices)",
        "host": platform.machine(), "model": args.preset, "dtype": args.dtype,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 check=False).stdout.strip(),
        "samples_per_rollout": args.prompts * args.group_size, "max_new_tokens": args.max_new_tokens,
        "updates_per_rollout": args.minibatches, "routing_replay": not args.no_replay,
        "rollout_s": roll_s, "sampling_s": sample_s, "train_s": train_s,
        "rollout_tokens_per_s": new_tokens / sample_s, "train_tokens_per_s": train_tokens / train_s,
        "rollout_share": roll_s / total, "train_share": train_s / total, "rl_steps_timed": args.rollouts,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

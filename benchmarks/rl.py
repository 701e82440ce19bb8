"""Where an RL step's time goes, GRPO and PPO side by side: rollout (sampling + rewards), the rollout-time
forwards + advantages, the policy update, the critic update (PPO), and tokens/s of each.

    PYTHONPATH=. python benchmarks/rl.py                                    # both recipes, tiny model, random init, CPU
    PYTHONPATH=. python benchmarks/rl.py --recipe grpo --rollouts 3         # GRPO only (--recipe ppo: PPO only)
    PYTHONPATH=. python benchmarks/rl.py --kl-coef 0.02                     # with the KL reference's forward
    PYTHONPATH=. python benchmarks/rl.py --init-from runs/sft_rl_addition --data data/rl_addition --rollouts 8
    PYTHONPATH=. python benchmarks/rl.py --preset small --group-size 16 --max-new-tokens 256 --out results.json

Builds each recipe from its config (GRPO: `glm46_jax.recipes.rl.grpo.recipe`, configs/grpo.py:tiny; PPO:
`glm46_jax.recipes.rl.ppo.recipe`, configs/ppo.py:addition, the verifiable-reward preset, which needs no reward
model) with the same overrides (model, rollout shape, rewards, curriculum, KL coefficient), so both sample, score
and train the same rows. Everything is compiled first (one warm-up rollout and one update per minibatch, of each
timed program), then `--rollouts` RL steps are timed; an RL step is one rollout (`prompts_per_step` x `group_size`
samples, rewards, training rows) and the `minibatches` optimizer steps on it. Per RL step, the phases:

  rollout      sampling + reward scoring + building the rows (`next_rollout` less `with_advantages`)
  forwards     `with_advantages` (GRPO: the group advantages on the host; PPO: the critic's forward for the old
               values, with rl.kl_coef > 0 the reference's log-probs, per-token rewards, GAE, whitening) plus
               `next_input` (the minibatch's transfer; GRPO with rl.kl_coef > 0: the reference's forward there);
               `model_forwards_s` is its part in the critic's and the reference's jitted forwards (synchronised),
               the rest is host work (GAE, whitening, rewards: eager jax.numpy on [b, t] arrays) and transfers
  policy       GRPO: its update step. PPO: a policy-only step (ppo_loss with the value term and the critic
               removed, make_step over the policy alone), timed on the same minibatch
  critic       PPO: the joint step (make_ppo_step, what the trainer runs) minus the policy-only step. As a
               cross-check a critic-only step (the value loss alone, make_step over the critic) is timed too
               (`critic_only_s`): joint vs policy-only + critic-only is what the one program saves or costs

Shares are of rollout + forwards + the update the trainer runs (GRPO's step, PPO's joint step): the policy-only
and critic-only variants only split the joint step, their updates advance the state but are not counted. Each
minibatch runs joint, policy-only, critic-only in that order. Every number is the median over the timed RL steps.
Rollout tokens/s counts generated tokens per sampling second; update tokens/s counts the trained rows' token slots
(prompt + completion, padding included: what the update computes on) per second of the update; step tokens/s is
generated tokens per second of the whole RL step. Wall times are synchronised (block_until_ready / device_get), so
each phase is charged with its own device work.
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
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from data_prep import rl_tasks
from glm46_jax import run_config
from glm46_jax.parallel import sharding
from glm46_jax.recipes.rl import objective as policy_objective
from glm46_jax.recipes.rl.grpo import recipe as grpo_recipe
from glm46_jax.recipes.rl.logprobs import completion_logprobs, like
from glm46_jax.recipes.rl.ppo import objective as ppo_objective
from glm46_jax.recipes.rl.ppo import recipe as ppo_recipe
from glm46_jax.recipes.rl.ppo.step import critic_values
from glm46_jax.run_config import config_file
from glm46_jax.training.step import ModelState, TrainState, make_step

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs")
RECIPES = {"grpo": (grpo_recipe.GRPO, "grpo.py", "tiny"), "ppo": (ppo_recipe.PPO, "ppo.py", "addition")}


def build_config(args, data: str, recipe: str):
    _, file, preset = RECIPES[recipe]
    c = config_file(os.path.join(CONFIGS, file), preset)
    with c.unlocked():
        c.run_dir = tempfile.mkdtemp(prefix=f"rl_bench_{recipe}_")
        if args.preset != "tiny":
            c.model = config_file(os.path.join(CONFIGS, "pretrain.py"), args.preset).model
        c.model.dtype = args.dtype
        c.checkpoint.update(init_from=args.init_from)
        c.train.update(eval_batches=1)
        c.rl.update(prompts=os.path.join(data, "prompts_train.jsonl"),
                    heldout=os.path.join(data, "prompts_heldout.jsonl"),
                    tokenizer="" if args.init_from else os.path.join(data, "tokenizer.json"),
                    group_size=args.group_size, prompts_per_step=args.prompts, minibatches=args.minibatches,
                    max_new_tokens=args.max_new_tokens, dynamic_sampling=False, eval_batch=8,
                    routing_replay=not args.no_replay, rewards=("exact_answer",), reward_weights=(1.0,),
                    curriculum_buckets=1, epochs=1)
        if args.kl_coef is not None:
            c.rl.kl_coef = args.kl_coef
        if recipe == "ppo":
            c.ppo.critic_warmup = 0  # every measured step trains both models
    return run_config.from_config_dict(c)


def _only_frozen(frozen, names):
    kept = {k: v for k, v in (frozen or {}).items() if k in names}
    return kept or None


def ppo_variants(recipe):
    """(policy_step, critic_step) of a PPO recipe: ppo_loss's policy terms over the policy alone, and its value term
    over the critic alone, each in the same make_step as the joint update. Both take and return the PPO state."""
    rl, ppo, m = recipe.rl, recipe.ppo, recipe.built.models
    policy, critic = m["policy"], m["critic"]

    def policy_loss(params, buffers, batch, ctx):  # ppo.step.ppo_loss without critic_values and value_loss
        logp, entropy, _ = completion_logprobs(params["policy"], buffers["policy"], policy.graphdef, batch,
                                               rl.temperature, rl.routing_replay)
        mask, old = like(batch["completion_mask"], logp), like(batch["old_logprobs"], logp)
        pg, stats = policy_objective.policy_loss(logp, old, like(batch["advantages"], logp), mask,
                                               clip_low=rl.clip_low, clip_high=rl.clip_high, aggregation="token")
        n = jnp.maximum(mask.sum(), 1.0)
        ent = jnp.sum(entropy * mask) / n
        loss = pg - ppo.entropy_coef * ent
        if ppo.kl_kind == "k3" and rl.kl_coef > 0:
            kl = policy_objective.kl_k3(logp, like(batch["ref_logprobs"], logp))
            loss = loss + rl.kl_coef * jnp.sum(kl * mask) / n
        return loss, {"loss": loss, "pg_loss": pg, "entropy": ent, **stats}

    def critic_loss(params, buffers, batch, ctx):  # ppo.step.ppo_loss's value term alone
        values = critic_values(params["critic"], buffers["critic"], critic.graphdef, batch["inputs"])
        mask = like(batch["completion_mask"], values)
        vloss, vstats = ppo_objective.value_loss(values, like(batch["old_values"], values),
                                                 like(batch["returns"], values), mask, ppo.vf_clip)
        loss = ppo.vf_coef * vloss
        return loss, {"loss": loss, "value_loss": vloss, **vstats}

    p_step = make_step(policy_loss, {"policy": policy.tx}, "policy", lr_schedule=policy.lr_schedule)
    c_step = make_step(critic_loss, {"critic": critic.tx}, "critic", lr_schedule=critic.lr_schedule)

    def run_policy(state, batch, controls, frozen):
        new, metrics = p_step(state.replace(others={}), batch, controls, _only_frozen(frozen, {"policy"}))
        return new.replace(others=state.others), metrics

    def run_critic(state, batch, controls, frozen):
        c = state.others["critic"]
        alone = TrainState(step=state.step, params=c.params, buffers=c.buffers, opt_state=c.opt_state)
        new, metrics = c_step(alone, batch, controls, _only_frozen(frozen, {"critic"}))
        # its step counter was donated: the new one stands for both (it counts attempted steps only)
        return state.replace(step=new.step, others={"critic": ModelState(new.params, new.buffers, new.opt_state)}), \
            metrics

    return run_policy, run_critic


def bench(args, data: str, name: str) -> dict:
    recipe_class = RECIPES[name][0]
    cfg = build_config(args, data, name)
    t0 = time.perf_counter()
    recipe, state = recipe_class.build(cfg)
    build_s = time.perf_counter() - t0
    recipe.start(None, None)
    main_step = recipe.steps_for(recipe.segment())
    variants = ppo_variants(recipe) if name == "ppo" else ()
    forward_s = [0.0]
    with_advantages = recipe.with_advantages

    def timed_with_advantages(state, batch, rewards):  # synchronous: both recipes return host arrays
        t0 = time.perf_counter()
        out = with_advantages(state, batch, rewards)
        forward_s[0] += time.perf_counter() - t0
        return out

    recipe.with_advantages = timed_with_advantages
    model_s = [0.0]

    def synced(fn):  # the critic's and the reference's forwards, charged on their own (inside `forwards`)
        def run(*a):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*a))
            model_s[0] += time.perf_counter() - t0
            return out
        return run

    recipe.ref_logprobs = synced(recipe.ref_logprobs)
    if name == "ppo":
        recipe.__dict__["_values"] = synced(recipe._values)  # a cached_property: the instance's copy

    def timed(fn, *a):
        t0 = time.perf_counter()
        with sharding.use_mesh(recipe.mesh):
            out = fn(*a)
            jax.block_until_ready(out)
        return out, time.perf_counter() - t0

    def next_input(state):
        inp = recipe.next_input(state, float("inf"))
        jax.block_until_ready(inp.batch)
        return inp

    def rl_step(state):
        forward_s[0] = model_s[0] = 0.0
        t0 = time.perf_counter()
        recipe.next_rollout(state)
        rollout_s = time.perf_counter() - t0
        stats = dict(recipe.stats)
        row = {"rollout_s": rollout_s - forward_s[0], "sampling_s": stats["sampling_s"],
               "new_tokens": stats["response_len"] * stats["sampled_groups"] * args.group_size,
               "forwards_s": forward_s[0], "train_s": 0.0, "policy_s": 0.0, "critic_only_s": 0.0,
               "train_tokens": 0}
        for _ in range(args.minibatches):
            inp, seconds = timed(next_input, state)
            row["forwards_s"] += seconds
            row["train_tokens"] += inp.batch["inputs"].size
            (state, _), seconds = timed(main_step, state, inp.batch, inp.controls, recipe.frozen)
            row["train_s"] += seconds
            if variants:
                for key, fn in zip(("policy_s", "critic_only_s"), variants):
                    (state, _), seconds = timed(fn, state, inp.batch, inp.controls, recipe.frozen)
                    row[key] += seconds
        row["model_forwards_s"] = model_s[0]
        if not variants:
            row["policy_s"] = row["train_s"]
        row["critic_s"] = row["train_s"] - row["policy_s"]  # PPO: joint - policy-only; GRPO: 0
        return state, row

    t0 = time.perf_counter()
    state, warm = rl_step(state)  # warm-up: compiles the sampler, the forwards and every update program
    compile_s = time.perf_counter() - t0
    rows = []
    for _ in range(args.rollouts):
        state, row = rl_step(state)
        rows.append(row)
    med = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
    total = med["rollout_s"] + med["forwards_s"] + med["train_s"]
    result = {
        "recipe": name, "config": f"configs/{RECIPES[name][1]}:{RECIPES[name][2]}", "kl_coef": cfg.rl.kl_coef,
        **{k: med[k] for k in ("rollout_s", "sampling_s", "forwards_s", "model_forwards_s", "train_s", "policy_s",
                               "critic_s")},
        "rollout_share": med["rollout_s"] / total, "forwards_share": med["forwards_s"] / total,
        "policy_share": med["policy_s"] / total, "critic_share": med["critic_s"] / total,
        "train_share": med["train_s"] / total, "step_s": total,
        "rollout_tokens_per_s": med["new_tokens"] / med["sampling_s"],
        "train_tokens_per_s": med["train_tokens"] / med["train_s"],
        "step_tokens_per_s": med["new_tokens"] / total,
        "build_s": build_s, "warmup_s": compile_s,
        "warmup_phases_s": {k: v for k, v in warm.items() if k.endswith("_s") and k != "critic_s"},
        "rl_steps_timed": args.rollouts,
    }
    if variants:
        result["critic_only_s"] = med["critic_only_s"]
        result["policy_tokens_per_s"] = med["train_tokens"] / med["policy_s"]
    recipe.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="both", choices=("grpo", "ppo", "both"))
    p.add_argument("--preset", default="tiny", help="model preset of configs/pretrain.py (random init)")
    p.add_argument("--init-from", default="", help="start from this run's weights (and tokenizer)")
    p.add_argument("--data", default="", help="a data_prep.rl_tasks directory (default: generated in a temp dir)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--rollouts", type=int, default=5)
    p.add_argument("--kl-coef", type=float, default=None,
                   help="rl.kl_coef for both recipes (default: the presets', 0); > 0 adds the reference's forward")
    p.add_argument("--no-replay", action="store_true", help="routing replay off (no routing recorded)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()

    data = args.data or tempfile.mkdtemp(prefix="rl_bench_data_")
    if not args.data:
        rl_tasks.write(data, seed=0, heldout=8, sft=0)
    names = ("grpo", "ppo") if args.recipe == "both" else (args.recipe,)
    result = {
        "device": f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind}, {len(jax.devices())} devices)",
        "host": platform.machine(), "model": args.preset, "dtype": args.dtype,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 check=False).stdout.strip(),
        "samples_per_rollout": args.prompts * args.group_size, "max_new_tokens": args.max_new_tokens,
        "updates_per_rollout": args.minibatches, "routing_replay": not args.no_replay,
    }
    for name in names:
        result[name] = bench(args, data, name)
        print(json.dumps({name: result[name]}, indent=2), flush=True)
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

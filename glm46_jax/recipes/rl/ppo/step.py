"""The jitted PPO update of the policy and the critic together (docs/rl.md#ppo).

    step = make_ppo_step(policy_graphdef, critic_graphdef, {"policy": tx, "critic": tx_c}, run_cfg.rl, run_cfg.ppo)
    state, metrics = step(state, batch, controls, frozen)    # training.step.TrainState: policy inline, critic in others

A batch is the rollout's rows (rollout.trajectory_rows) plus [b, s-1] "advantages" (GAE, per token), "returns" and
"old_values" (the critic's values at the rollout), and "ref_logprobs" with a k3 KL. The loss is
    clipped policy loss - entropy_coef * entropy (+ kl_coef * k3) + vf_coef * clipped value loss;
the policy's parameters reach only the first terms and the critic's only the last, so one `make_step` with each
model's own optimizer applies PPO's two updates. Neither model's correction biases move.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Float

from glm46_jax.model import apply
from glm46_jax.recipes.rl import objective as policy_objective
from glm46_jax.recipes.rl.config import RLConfig
from glm46_jax.recipes.rl.logprobs import completion_logprobs, like
from glm46_jax.recipes.rl.ppo import objective
from glm46_jax.recipes.rl.ppo.config import PPOConfig
from glm46_jax.training.schedule import Schedule
from glm46_jax.training.step import make_step


def critic_values(params: nnx.State, buffers: nnx.State, graphdef: nnx.GraphDef, inputs: Array
                  ) -> Float[Array, "b t"]:
    """V(inputs[:, :t + 1]) for t < s - 1 (the positions that predict a token), fp32."""
    out = apply(graphdef, params, buffers, inputs, with_mtp=False, with_logits=False)
    return out.scores[:, :-1, 0]


def ppo_loss(params: dict[str, nnx.State], buffers: dict[str, nnx.State], batch: dict[str, Array],
             policy: nnx.GraphDef, critic: nnx.GraphDef, rl: RLConfig, ppo: PPOConfig,
             policy_weight: Array | float = 1.0, kl_coef: Array | float | None = None
             ) -> tuple[Array, dict[str, Array]]:
    """The PPO loss; policy_weight 0 (the critic's warm-up) leaves the policy's gradient zero and so, under Adam
    with zeroed moments, its weights in place (but for decoupled weight decay, when optim.weight_decay > 0).
    `kl_coef`: the k3 term's weight (the step's control, which the adaptive controller moves); None = rl.kl_coef."""
    logp, entropy, differs = completion_logprobs(params["policy"], buffers["policy"], policy, batch,
                                                 rl.temperature, rl.routing_replay)
    mask, old = like(batch["completion_mask"], logp), like(batch["old_logprobs"], logp)
    adv = like(batch["advantages"], logp)
    weights = like(batch["is_weights"], logp) if "is_weights" in batch else None  # rollouts sampled ahead
    pg, stats = policy_objective.policy_loss(logp, old, adv, mask, clip_low=rl.clip_low, clip_high=rl.clip_high,
                                             aggregation="token", weights=weights)
    n = jnp.maximum(mask.sum(), 1.0)
    token_mean = lambda x: jnp.sum(x * mask) / n  # noqa: E731
    ent = token_mean(entropy)
    policy_loss = pg - ppo.entropy_coef * ent
    metrics = {"pg_loss": pg, "entropy": ent, "ce": -token_mean(logp), "logprob_diff": token_mean(jnp.abs(logp - old)),
               "completion_tokens": mask.sum(), **stats}
    if ppo.kl_kind == "k3" and rl.kl_coef > 0:  # else the KL is in the rewards (k1) or off
        kl = token_mean(policy_objective.kl_k3(logp, like(batch["ref_logprobs"], logp)))
        policy_loss = policy_loss + (rl.kl_coef if kl_coef is None else kl_coef) * kl
        metrics["kl"] = kl
    values = critic_values(params["critic"], buffers["critic"], critic, batch["inputs"])
    values = like(values, logp)
    vloss, vstats = objective.value_loss(values, like(batch["old_values"], logp), like(batch["returns"], logp), mask,
                                         ppo.vf_clip)
    metrics.update(vstats, value_loss=vloss, value_mean=token_mean(values))
    if differs is not None:
        fed = like(batch["replay_mask"], differs)
        metrics["replay_mismatch"] = jnp.sum(differs * fed) / jnp.maximum(fed.sum(), 1.0)
    loss = policy_weight * policy_loss + ppo.vf_coef * vloss
    metrics["loss"] = loss
    return loss, metrics


def make_ppo_step(policy: nnx.GraphDef, critic: nnx.GraphDef, txs: dict[str, optax.GradientTransformation],
                  rl: RLConfig, ppo: PPOConfig, *, lr_schedule: Schedule | None = None) -> Callable:
    """step(state, batch, controls[, frozen]) -> (state, metrics): `ppo_loss` in the one update step (the spike /
    non-finite skip covers both models)."""
    return _ppo_step(policy, critic, tuple(txs.items()), rl, ppo, lr_schedule)


@functools.cache  # one jitted step per (graphdefs, optimizers, sections): the next seed in a process reuses it
def _ppo_step(policy: nnx.GraphDef, critic: nnx.GraphDef, txs: tuple, rl: RLConfig, ppo: PPOConfig,
              lr_schedule: Schedule | None) -> Callable:
    def loss(params, buffers, batch, ctx):
        return ppo_loss(params, buffers, batch, policy, critic, rl, ppo, ctx.get("policy_weight", 1.0),
                        ctx.get("kl_coef"))

    return make_step(loss, dict(txs), "policy", lr_schedule=lr_schedule)


@functools.cache
def values_fn(critic: nnx.GraphDef) -> Callable:
    """jit(params, buffers, inputs) -> the critic's values [b, s-1] (at rollout time)."""
    return jax.jit(lambda p, b, inputs: critic_values(p, b, critic, inputs))

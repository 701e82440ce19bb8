"""The jitted GRPO update: the policy's log-probs of the sampled completions (with the rollout's routing
replayed), the clipped loss of `rl.objective` on group advantages, an optimizer step (docs/rl.md#the-update).

    step = make_grpo_step(graphdef, tx, run_cfg.rl, lr_schedule=schedule)
    state, metrics = step(state, batch, controls, frozen)  # training.step.TrainState, donated

Batches are `rollout.training_rows` plus "advantages" [b] (and "ref_logprobs" [b, s-1] with a KL term).
The loss plugs into the one update step (`training.step.make_step`: the same TrainState, optimizer, non-finite skip
and frozen weights for LoRA as pre-training's), so the generic trainer runs it; the correction biases stay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Float

from glm46_jax.recipes.rl import objective
from glm46_jax.recipes.rl.config import RLConfig
from glm46_jax.recipes.rl.logprobs import completion_logprobs, like
from glm46_jax.training.schedule import Schedule
from glm46_jax.training.step import make_step


def grpo_loss(params: nnx.State, buffers: nnx.State, batch: dict[str, Array], graphdef: nnx.GraphDef,
              rl: RLConfig) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The loss the step differentiates and its metrics (scalars); the settings are the run's `rl` section (the
    sampler's temperature and routing, the clip range, the aggregation over rl.max_new_tokens, rl.kl_coef)."""
    logp, entropy, differs = completion_logprobs(params, buffers, graphdef, batch, rl.temperature, rl.routing_replay)
    mask, old = like(batch["completion_mask"], logp), like(batch["old_logprobs"], logp)
    adv = like(batch["advantages"], logp[:, 0])
    pg, stats = objective.policy_loss(logp, old, adv, mask,
                                      clip_low=rl.clip_low, clip_high=rl.clip_high,
                                      aggregation=rl.aggregation, max_tokens=rl.max_new_tokens,
                                      weights=like(batch["is_weights"], logp) if "is_weights" in batch else None)
    n = jnp.maximum(mask.sum(), 1.0)
    token_mean = lambda x: jnp.sum(x * mask) / n  # noqa: E731
    metrics = {"pg_loss": pg, "ce": -token_mean(logp), "entropy": token_mean(entropy),
               "logprob_diff": token_mean(jnp.abs(logp - old)),
               "completion_tokens": mask.sum(), **stats}
    loss = pg
    if rl.kl_coef > 0:
        kl = objective.aggregate(objective.kl_k3(logp, like(batch["ref_logprobs"], logp)), mask, rl.aggregation,
                                 rl.max_new_tokens)
        loss = loss + rl.kl_coef * kl
        metrics["kl"] = kl
    if differs is not None:
        fed = like(batch["replay_mask"], differs)
        metrics["replay_mismatch"] = jnp.sum(differs * fed) / jnp.maximum(fed.sum(), 1.0)
    metrics["loss"] = loss
    return loss, metrics


@functools.cache  # one jitted step per (graphdef, optimizer, rl section): the next seed in a process reuses it
def make_grpo_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, rl: RLConfig, *,
                   lr_schedule: Schedule | None = None, name: str = "policy") -> Callable:
    """step(state, batch, controls[, frozen]) -> (state, metrics): `grpo_loss` in the one update step
    (`training.step.make_step`: the spike / non-finite skip, the lr metric); the correction biases are not moved.
    `frozen` ({name: FrozenModel(base)} for LoRA) as in `training.step.make_train_step`."""

    def loss(params, buffers, batch, ctx):
        return grpo_loss(params[name], buffers[name], batch, graphdef, rl)

    return make_step(loss, {name: tx}, name, lr_schedule=lr_schedule)

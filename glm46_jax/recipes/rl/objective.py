"""The policy-gradient objective GRPO and PPO share, as pure functions: the clipped surrogate loss, its aggregation
over the completion tokens, and the k3 KL estimate (docs/rl.md#the-objective).

    loss, stats = policy_loss(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.28, aggregation="token")
    kl = kl_k3(logp, ref_logp)                                              # [b, t], never negative
    weights, stats = truncated_importance(logp, behaviour_logp, mask, cap=2.0)   # rollouts sampled ahead

The per-token loss is -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) with
ratio = exp(logp - old_logp) and A per sequence (GRPO's group advantages) or per token (PPO's GAE), aggregated over
the completion tokens (mask) as
  token     sum over all tokens / number of tokens (DAPO's token-level mean)
  sequence  mean over sequences of each sequence's token mean (the original GRPO)
  constant  sum over all tokens / (sequences * max_tokens) (Dr. GRPO: no length normalisation)
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

AGGREGATIONS = ("token", "sequence", "constant")


def aggregate(per_token: Float[Array, "b t"], mask: Float[Array, "b t"], aggregation: str,
              max_tokens: int) -> Float[Array, ""]:
    """One scalar from per-token values over the masked (completion) tokens; see the module docstring."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"loss aggregation {aggregation!r}: one of {AGGREGATIONS}")
    mask = mask.astype(jnp.float32)
    total = jnp.sum(per_token * mask)
    if aggregation == "token":
        return total / jnp.maximum(mask.sum(), 1.0)
    if aggregation == "constant":
        return total / (per_token.shape[0] * max_tokens)
    count = mask.sum(axis=1)
    per_seq = jnp.sum(per_token * mask, axis=1) / jnp.maximum(count, 1.0)
    has = (count > 0).astype(jnp.float32)
    return jnp.sum(per_seq * has) / jnp.maximum(has.sum(), 1.0)


def policy_loss(logp: Float[Array, "b t"], old_logp: Float[Array, "b t"], adv: Float[Array, "b"] | Float[Array, "b t"],
                mask: Float[Array, "b t"], *, clip_low: float, clip_high: float, aggregation: str = "token",
                max_tokens: int = 1, weights: Float[Array, "b t"] | None = None
                ) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The clipped surrogate loss (to minimise) and its statistics: clip_frac (the share of tokens whose
    clipped term is the active one, i.e. whose gradient is cut off) and ratio_mean, over masked tokens.
    `weights`: per-token factors of the loss (`truncated_importance`'s, for rollouts sampled ahead)."""
    mask = mask.astype(jnp.float32)
    ratio = jnp.exp(logp - old_logp)
    a = adv[:, None] if adv.ndim == 1 else adv  # per sequence (GRPO) or per token (PPO's GAE)
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = -jnp.minimum(ratio * a, clipped_ratio * a)
    if weights is not None:
        per_token = per_token * weights
    cut = ((ratio < 1.0 - clip_low) & (a < 0)) | ((ratio > 1.0 + clip_high) & (a > 0))
    n = jnp.maximum(mask.sum(), 1.0)
    stats = {"clip_frac": jnp.sum(cut * mask) / n, "ratio_mean": jnp.sum(ratio * mask) / n}
    return aggregate(per_token, mask, aggregation, max_tokens), stats


def kl_k3(logp: Float[Array, "b t"], ref_logp: Float[Array, "b t"]) -> Float[Array, "b t"]:
    """Per-token KL(policy || reference) estimate exp(d) - d - 1 with d = ref_logp - logp (Schulman's k3:
    unbiased on the policy's own samples, never negative)."""
    d = ref_logp - logp
    return jnp.exp(d) - d - 1.0


def truncated_importance(logp: Float[Array, "b t"], behaviour_logp: Float[Array, "b t"], mask: Float[Array, "b t"],
                         cap: float) -> tuple[Float[Array, "b t"], dict[str, float]]:
    """Per-token weights min(exp(logp - behaviour_logp), cap) on masked tokens (0 elsewhere) for a rollout whose
    sampler (the behaviour policy) is older than the policy `logp` is of (truncated importance sampling, as slime and
    verl correct their asynchronous rollouts), and the share of masked tokens the cap cut (is_clipped_frac) and the
    mean weight (is_weight_mean)."""
    mask = jnp.asarray(mask, jnp.float32)
    ratio = jnp.exp(jnp.asarray(logp, jnp.float32) - jnp.asarray(behaviour_logp, jnp.float32))
    weights = jnp.minimum(ratio, cap) * mask
    n = jnp.maximum(mask.sum(), 1.0)
    return weights, {"is_clipped_frac": float(jnp.sum((ratio > cap) * mask) / n),
                     "is_weight_mean": float(jnp.sum(weights) / n)}

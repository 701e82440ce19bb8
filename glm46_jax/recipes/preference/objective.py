"""Preference losses as pure functions of sequence log-probabilities (or rewards), one value per pair.

    losses, stats = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.1, loss_type="sigmoid", label_smoothing=0.0)
    losses, stats = simpo_loss(avg_c, avg_r, beta=2.0, gamma=0.5)
    losses, stats = bradley_terry_loss(score_c, score_r, margin=0.0)

With h = (pi_c - pi_r) - (ref_c - ref_r), the policy's log-ratio of chosen over rejected minus the reference's:
  sigmoid  -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)     (DPO; eps = label smoothing, cDPO)
  ipo      (h - 1 / (2 beta))^2                                           (IPO, Azar et al. 2023, eq. 17)
The caller chooses what a sequence log-prob is: a sum over the completion tokens (DPO) or their mean (IPO as TRL
runs it); the functions only combine them. SimPO has no reference: with length-averaged log-probs a_c, a_r,
  simpo    -(1 - eps) log sigmoid(beta (a_c - a_r) - gamma) - eps log sigmoid(-(beta (a_c - a_r) - gamma)).
Bradley-Terry (reward model): -log sigmoid(s_c - s_r - margin) [+ center (s_c + s_r)^2, TRL's reward centering].
Implicit rewards reported: beta (pi - ref) for chosen and rejected (DPO/IPO), beta a (SimPO).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

DPO_LOSS_TYPES = ("sigmoid", "ipo")


def _smoothed(z: Float[Array, "n"], label_smoothing: float) -> Float[Array, "n"]:
    return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)


def dpo_loss(chosen: Float[Array, "n"], rejected: Float[Array, "n"], ref_chosen: Float[Array, "n"],
             ref_rejected: Float[Array, "n"], *, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, mask: Float[Array, "n"] | None = None
             ) -> tuple[Float[Array, "n"], dict[str, Array]]:
    """Per-pair losses and statistics (implicit rewards of chosen and rejected, their margin, accuracy; over the
    pairs `mask` keeps, default all)."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"DPO loss type {loss_type!r}: one of {DPO_LOSS_TYPES}")
    h = (chosen - rejected) - (ref_chosen - ref_rejected)
    losses = _smoothed(beta * h, label_smoothing) if loss_type == "sigmoid" else (h - 1.0 / (2.0 * beta)) ** 2
    return losses, _reward_stats(beta * (chosen - ref_chosen), beta * (rejected - ref_rejected), mask)


def simpo_loss(avg_chosen: Float[Array, "n"], avg_rejected: Float[Array, "n"], *, beta: float, gamma: float,
               label_smoothing: float = 0.0, mask: Float[Array, "n"] | None = None
               ) -> tuple[Float[Array, "n"], dict[str, Array]]:
    """SimPO (Meng et al. 2024) on length-averaged completion log-probs; no reference model."""
    losses = _smoothed(beta * (avg_chosen - avg_rejected) - gamma, label_smoothing)
    return losses, _reward_stats(beta * avg_chosen, beta * avg_rejected, mask)


def bradley_terry_loss(chosen: Float[Array, "n"], rejected: Float[Array, "n"],
                       margin: Float[Array, "n"] | float = 0.0, mask: Float[Array, "n"] | None = None,
                       center: float = 0.0) -> tuple[Float[Array, "n"], dict[str, Array]]:
    """The reward model's pairwise loss on scalar scores, with an optional (per-pair) margin and TRL's centering term
    center x (chosen + rejected)^2."""
    losses = -jax.nn.log_sigmoid(chosen - rejected - margin) + center * jnp.square(chosen + rejected)
    return losses, _reward_stats(chosen, rejected, mask)


def masked_mean(x: Float[Array, "n"], mask: Float[Array, "n"] | None) -> Float[Array, ""]:
    """The mean over the pairs `mask` keeps (all without one; 0 when it keeps none)."""
    if mask is None:
        return x.mean()
    mask = mask.astype(x.dtype)
    return jnp.sum(x * mask) / jnp.maximum(mask.sum(), 1.0)


def _reward_stats(chosen: Float[Array, "n"], rejected: Float[Array, "n"], mask: Float[Array, "n"] | None = None
                  ) -> dict[str, Array]:
    return {"chosen": masked_mean(chosen, mask), "rejected": masked_mean(rejected, mask),
            "margin": masked_mean(chosen - rejected, mask),
            "accuracy": masked_mean((chosen > rejected).astype(chosen.dtype), mask)}

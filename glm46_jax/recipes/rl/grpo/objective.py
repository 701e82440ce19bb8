"""GRPO's group advantages: each sample's reward measured against the other samples of its prompt.

    adv = advantages(rewards, group_size=8, estimator="grpo")          # [groups * G]

Definitions (docs/rl.md#the-objective): for a group of G samples of one prompt with rewards r,
  grpo    A_i = (r_i - mean(r)) / (std(r) + eps)       (population std: a one-sample group gets A = 0)
  drgrpo  A_i = r_i - mean(r)                          (Dr. GRPO: no std scaling)
  rloo    A_i = r_i - mean(r without r_i) = G / (G - 1) * (r_i - mean(r))   (0 for G = 1)
They enter the clipped policy loss both RL recipes share (`rl.objective.policy_loss`), one per sequence.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

ESTIMATORS = ("grpo", "drgrpo", "rloo")


def advantages(rewards: Float[Array, "n"], group_size: int, estimator: str = "grpo",
               eps: float = 1e-6) -> Float[Array, "n"]:
    """Per-sample advantages; rewards are grouped as consecutive runs of `group_size` (one prompt each)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage estimator {estimator!r}: one of {ESTIMATORS}")
    r = jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)
    centred = r - r.mean(axis=1, keepdims=True)
    if estimator == "grpo":
        adv = centred / (r.std(axis=1, keepdims=True) + eps)
    elif estimator == "drgrpo":
        adv = centred
    else:
        adv = centred * (group_size / (group_size - 1)) if group_size > 1 else jnp.zeros_like(centred)
    return adv.reshape(-1)

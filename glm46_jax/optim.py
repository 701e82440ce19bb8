"""The optimizer: clip -> AdamW under a warmup + cosine schedule.

Muon for the matrices (AdamW for embeddings, head, norms, router) replaces this in a later
issue; train_step stays optimizer-agnostic, it only sees an `optax.GradientTransformation`.
"""

from __future__ import annotations

import dataclasses

import jax
import optax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 2.5e-4  # peak
    end_lr: float = 2.5e-5
    warmup_steps: int = 2000
    decay_steps: int = 100_000  # total schedule length, warmup included (optax convention)
    weight_decay: float = 0.1
    clip: float = 1.0  # global grad-norm clip
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8


def lr_schedule(cfg: OptimConfig) -> optax.Schedule:
    """0 -> lr linearly over warmup_steps, then cosine to end_lr at decay_steps, flat after."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.decay_steps, cfg.warmup_steps + 1), end_value=cfg.end_lr)


def _is_decayed(path, _) -> bool:
    # Decay matrices only. Norm weights and biases are stacked per layer in the scanned blocks
    # ([layers, d]), so `ndim >= 2` cannot tell them apart: go by name (`*norm`, `*_bias`).
    names = [str(getattr(key, "key", "")) for key in path]
    return not any(n.endswith(("norm", "_bias")) for n in names)


def weight_decay_mask(params: nnx.State):
    """True for every parameter that gets weight decay (all matrices; no norms, no biases)."""
    return jax.tree_util.tree_map_with_path(_is_decayed, params)


def adamw(cfg: OptimConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The transformation and its schedule (the schedule is returned so the step can log the lr)."""
    schedule = lr_schedule(cfg)
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.clip),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                    mask=weight_decay_mask),
    )
    return tx, schedule

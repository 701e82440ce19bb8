"""Loss-free load balancing (Wang et al. 2024; DeepSeek-V3; docs/training.md#loss-free-balancing) and load statistics.

After every optimizer step, for each MoE layer with global top-k counts load_i over E experts:

    b_i <- b_i + rate * sign(mean_j load_j - load_i)

`b` is the router's `e_score_correction_bias`: it only changes which experts are chosen, never
the combine weights, gets no gradient and is not an optimizer leaf (it lives in the buffers).
`rate` is scheduled by tokens seen (GLM-4.5: 1e-3 for the first 15T tokens, then 0).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from glm46_jax.errors import check_range
from glm46_jax.model.paths import path_names


@dataclasses.dataclass(frozen=True)
class BalanceConfig:
    rate: float = 1e-3
    rate_after: float = 0.0
    boundary_tokens: float = 15e12  # switch rate -> rate_after once this many tokens were trained on
    include_mtp: bool = True  # MTP router balanced too (unconfirmed for GLM: docs/training.md#unconfirmed-details)

    def __post_init__(self):
        # A negative rate would push load toward the busiest experts.
        for f in ("rate", "rate_after"):
            check_range("balance", self, f, ge=0, meaning="the bias step per update; 0 = off")
        check_range("balance", self, "boundary_tokens", ge=0, meaning="tokens before rate_after applies")


def rate_at(cfg: BalanceConfig, tokens_seen: int) -> float:
    """The bias update rate for a step that starts after `tokens_seen` tokens (host-side, exact ints)."""
    return cfg.rate if tokens_seen < cfg.boundary_tokens else cfg.rate_after


def bias_update(bias: Float[Array, "*l e"], load: Float[Array, "*l e"], rate: float | Array) -> Float[Array, "*l e"]:
    """One sign step per layer toward equal load; equal loads (and rate 0) leave the bias unchanged."""
    load = load.astype(jnp.float32)
    step = jnp.sign(load.mean(-1, keepdims=True) - load)
    return (bias + jnp.asarray(rate, jnp.float32) * step).astype(bias.dtype)


def update_buffers(buffers: nnx.State, loads: dict[str, Array], rate: float | Array,
                   include_mtp: bool = True) -> nnx.State:
    """Every `e_score_correction_bias` in `buffers` stepped with its layer's load.

    `loads["expert_load"]` is [moe layers, E] (the scanned trunk stack), `loads["mtp_expert_load"]`
    is [E]; a bias whose load is missing (MTP off, or `include_mtp=False`) is left as it is.
    """

    def leaf(path, bias):
        key = "mtp_expert_load" if path_names(path)[0] == "mtp" else "expert_load"
        if (key == "mtp_expert_load" and not include_mtp) or key not in loads:
            return bias
        return bias_update(bias, loads[key], rate)

    return jax.tree_util.tree_map_with_path(leaf, buffers)


def load_stats(load: Float[Array, "l e"]) -> dict[str, Array]:
    """Per layer: coefficient of variation (std / mean) and max / min of the expert loads.

    max/min uses min(load, 1) floor so a starved expert gives max/1 instead of infinity.
    """
    load = load.astype(jnp.float32)
    mean = load.mean(-1)
    cv = load.std(-1) / jnp.maximum(mean, 1e-9)
    ratio = load.max(-1) / jnp.maximum(load.min(-1), 1.0)
    return {"cv": cv, "max_min": ratio}


def bias_stats(buffers: nnx.State) -> dict[str, Array]:
    """Spread of the correction biases over all layers: mean |b|, max |b|, std across experts."""
    biases = [b.reshape(-1, b.shape[-1]).astype(jnp.float32) for b in jax.tree.leaves(buffers)]
    if not biases:
        return {}
    b = jnp.concatenate(biases)
    return {"abs_mean": jnp.abs(b).mean(), "abs_max": jnp.abs(b).max(), "std": b.std(-1).mean()}


def describe_loads(metrics: dict[str, Any]) -> dict[str, Array]:
    """Flat scalar metrics for logging: per-layer CV and max/min, their means, dropped fractions."""
    out: dict[str, Array] = {}
    for prefix, key in (("", "expert_load"), ("mtp_", "mtp_expert_load")):
        if key not in metrics:
            continue
        load = metrics[key].reshape(-1, metrics[key].shape[-1])
        stats = load_stats(load)
        for name, per_layer in stats.items():
            out[f"{prefix}load_{name}"] = per_layer.mean()
            if not prefix:
                for i in range(per_layer.shape[0]):
                    out[f"load_{name}/moe_layer_{i:02d}"] = per_layer[i]
    for key in ("dropped_frac", "mtp_dropped_frac"):
        if key in metrics:
            out[key] = jnp.mean(metrics[key])
    return out

"""GLM MoE block: sigmoid router with correction bias, routed experts, shared expert (spec §3.5).

The routed experts run as sort-by-expert + capacity-padded batched einsum. `jax.lax.ragged_dot`
alone would be simpler, but XLA lowers it to a dense product over every group on CPU and (by
default) on NVIDIA GPUs: about 90x slower on this CPU for 64 experts (STYLE.md). Capacity
C = tokens gives exact dropless routing (top-k experts are distinct, so no expert can receive
more than every token once).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from glm46_jax.config import ModelConfig
from glm46_jax.model.layers import MLP, ExpertBias, param
from glm46_jax.sharding import constrain, logical, mesh_axes, weight


def route(x: Float[Array, "n d"], w_router_de: Array, bias_e: Array,
          cfg: ModelConfig) -> tuple[Int[Array, "n k"], Float[Array, "n k"], Float[Array, "n e"]]:
    """DeepSeek-V3 "noaux_tc" routing as in HF Glm4MoeTopkRouter, all in fp32.

    Returns the chosen experts, their combine weights, and the raw sigmoid scores.
    The correction bias only chooses experts; the weights come from the unbiased scores.
    """
    logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), w_router_de.astype(jnp.float32))
    scores = jax.nn.sigmoid(logits)
    choice = scores + jax.lax.stop_gradient(bias_e.astype(jnp.float32))
    n, e = choice.shape
    if cfg.n_group > 1:
        grouped = choice.reshape(n, cfg.n_group, e // cfg.n_group)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # HF: sum of each group's top-2
        _, kept = jax.lax.top_k(group_score, cfg.topk_group)
        keep = (kept[:, :, None] == jnp.arange(cfg.n_group)).any(axis=1)  # [n, groups]
        # -inf (HF >= 5, Megatron); HF 4.5x filled 0.0, which lets dropped groups win (spec §3.7).
        choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(n, e)
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(choice), cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return idx, weights * cfg.routed_scaling_factor, scores


def expert_capacity(num_tokens: int, cfg: ModelConfig) -> int:
    if cfg.moe_capacity_factor <= 0:
        return num_tokens  # dropless
    per_expert = num_tokens * cfg.num_experts_per_tok / cfg.n_routed_experts
    return max(1, min(num_tokens, math.ceil(cfg.moe_capacity_factor * per_expert)))


def grouped_experts(x: Float[Array, "n d"], idx: Int[Array, "n k"], weights: Float[Array, "n k"],
                    w_gate_edf: Array, w_up_edf: Array, w_down_efd: Array,
                    capacity: int) -> tuple[Float[Array, "n d"], Float[Array, ""]]:
    """Sum_j weights[:, j] * Expert_{idx[:, j]}(x) with per-expert capacity; returns (y, dropped fraction).

    Assignments are sorted by expert (stable, so earlier tokens win when an expert is full),
    gathered into an [E, C, d] buffer, run through one batched SwiGLU einsum, and gathered back.
    Everything is a gather, so the backward pass is scatter-adds XLA handles well.
    """
    n, k = idx.shape
    e = w_gate_edf.shape[0]
    dt = x.dtype
    flat_e = idx.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)  # assignment ids grouped by expert
    counts = jnp.bincount(flat_e, length=e)
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(capacity)
    slot_valid = slot[None, :] < counts[:, None]  # [E, C]
    slot_assign = order[jnp.minimum(starts[:, None] + slot[None, :], n * k - 1)]
    x_ecd = jnp.where(slot_valid[..., None], x[slot_assign // k], 0).astype(dt)

    gate = jnp.einsum("ecd,edf->ecf", x_ecd, w_gate_edf.astype(dt))
    up = jnp.einsum("ecd,edf->ecf", x_ecd, w_up_edf.astype(dt))
    y_ecd = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, w_down_efd.astype(dt))

    # Where each assignment landed: its rank among the assignments of its expert.
    rank = jnp.zeros(n * k, jnp.int32).at[order].set(jnp.arange(n * k, dtype=jnp.int32)) - starts[flat_e]
    kept = rank < capacity
    y_a = jnp.where(kept[:, None], y_ecd[flat_e, jnp.minimum(rank, capacity - 1)], 0)
    # HF combines in fp32 (bf16 expert output x fp32 weight) and casts once at the end.
    y = jnp.einsum("nkd,nk->nd", y_a.reshape(n, k, -1).astype(jnp.float32), weights.astype(jnp.float32))
    return y.astype(dt), 1.0 - kept.mean()


def dispatch(x: Float[Array, "n d"], idx: Int[Array, "n k"], weights: Float[Array, "n k"],
             w_gate_edf: Array, w_up_edf: Array, w_down_efd: Array,
             cfg: ModelConfig) -> tuple[Float[Array, "n d"], Array, Int[Array, "e"]]:
    """The routed experts as one shard_map: tokens stay on their batch shard, experts replicated.

    Returns (routed output, dropped fraction, global tokens-per-expert counts).
    """
    tok = logical("batch", None)
    batch_axes = mesh_axes("batch")
    rep = jax.P()

    @partial(jax.shard_map, in_specs=(tok, tok, tok, rep, rep, rep), out_specs=(tok, rep, rep))
    def local(x, idx, weights, wg, wu, wd):
        y, dropped = grouped_experts(x, idx, weights, wg, wu, wd, expert_capacity(x.shape[0], cfg))
        load = jnp.bincount(idx.reshape(-1), length=cfg.n_routed_experts)
        return y, jax.lax.pmean(dropped, batch_axes), jax.lax.psum(load, batch_axes)

    tokens = [jax.sharding.reshard(a, tok) for a in (x, idx, weights)]
    replicated = [jax.sharding.reshard(w, rep) for w in (w_gate_edf, w_up_edf, w_down_efd)]
    return local(*tokens, *replicated)


class MoE(nnx.Module):
    """Routed experts + one always-on shared expert (not scaled by routed_scaling_factor)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, e, f = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.router = param(rngs, (d, e), ("embed", "router_exp"), cfg)
        self.e_score_correction_bias = ExpertBias(jnp.zeros((e,), jnp.float32), out_sharding=("router_exp",))
        self.gate_proj = param(rngs, (e, d, f), ("exp", "embed_moe", "mlp_moe"), cfg)
        self.up_proj = param(rngs, (e, d, f), ("exp", "embed_moe", "mlp_moe"), cfg)
        self.down_proj = param(rngs, (e, f, d), ("exp", "mlp_moe", "embed_moe"), cfg)
        self.shared_experts = MLP(cfg, cfg.shared_intermediate_size, rngs=rngs)
        self.cfg = cfg

    def __call__(self, x: Float[Array, "b s d"]) -> tuple[Float[Array, "b s d"], dict[str, Array]]:
        cfg = self.cfg
        b, s, d = x.shape
        x_nd = x.reshape(b * s, d)
        idx, weights, scores = route(x_nd, weight(self.router), self.e_score_correction_bias[...], cfg)
        routed, dropped, load = dispatch(
            x_nd, idx, weights, weight(self.gate_proj), weight(self.up_proj), weight(self.down_proj), cfg)
        # Pin the layout: with a batch of 1 the reshape would otherwise move the token sharding to seq.
        y = constrain(routed.reshape(b, s, d), "batch", "seq", "act_embed") + self.shared_experts(x)
        aux = {
            "expert_load": load,  # global top-k counts
            "dropped_frac": dropped,
            "router_topk": idx.reshape(b, s, -1),
            "router_scores": scores.reshape(b, s, -1),
        }
        return y, aux

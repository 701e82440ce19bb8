"""GLM MoE block: sigmoid router with correction bias, routed experts, shared expert (spec §3.5).

The routed experts run in one `jax.shard_map` (`dispatch`); inside it every strategy ends in the
local grouped matmul of `experts.py`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from glm46_jax.config import ModelConfig
from glm46_jax.model.experts import expert_capacity, grouped_experts
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
        dropped_frac = jax.lax.psum(dropped, batch_axes) / (jax.lax.psum(idx.size, batch_axes))
        return y, dropped_frac, jax.lax.psum(load, batch_axes)

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

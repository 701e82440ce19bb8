"""GLM MoE block: sigmoid router with correction bias, routed experts, shared expert (docs/architecture.md#moe-block).

The routed experts run in one `jax.shard_map` (`dispatch`); inside it every strategy ends in the
local grouped matmul of `experts.py`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from glm46_jax.config import ModelConfig
from glm46_jax.model.adapters import adapted
from glm46_jax.model.experts import expert_capacity, grouped_experts, local_experts
from glm46_jax.model.layers import MLP, ExpertBias, param
from glm46_jax.parallel.sharding import (constrain, flatten_tokens, logical, mesh_axes, shard_map, spec_axes,
                                         unflatten_tokens, unsharded_singletons, weight)


def choose_experts(x: Float[Array, "n d"], w_router_de: Array, bias_e: Array,
                   cfg: ModelConfig) -> tuple[Int[Array, "n k"], Float[Array, "n e"]]:
    """The router's own top-k choice and the raw sigmoid scores (fp32): `route` without the combine weights."""
    logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), w_router_de.astype(jnp.float32))
    scores = jax.nn.sigmoid(logits)
    choice = scores + jax.lax.stop_gradient(bias_e.astype(jnp.float32))
    n, e = choice.shape
    if cfg.n_group > 1:
        grouped = choice.reshape(n, cfg.n_group, e // cfg.n_group)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # HF: sum of each group's top-2
        _, kept = jax.lax.top_k(group_score, cfg.topk_group)
        keep = (kept[:, :, None] == jnp.arange(cfg.n_group)).any(axis=1)  # [n, groups]
        # -inf (HF >= 5, Megatron); HF 4.5x filled 0.0, which lets dropped groups win
        # (docs/architecture.md#group-limited-top-k).
        choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(n, e)
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(choice), cfg.num_experts_per_tok)
    return idx, scores


def combine_weights(scores: Float[Array, "n e"], idx: Int[Array, "n k"], cfg: ModelConfig) -> Float[Array, "n k"]:
    """The chosen experts' combine weights, from the unbiased scores: the router's gradient path."""
    # One token (a decode step of one row): take_along_axis gathers a size-1 token axis as a slice, not as a batch
    # axis, and a slice of a sharded axis cannot be typed; a size-1 axis needs no layout.
    weights = jnp.take_along_axis(unsharded_singletons(scores), unsharded_singletons(idx), axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor


def route(x: Float[Array, "n d"], w_router_de: Array, bias_e: Array,
          cfg: ModelConfig) -> tuple[Int[Array, "n k"], Float[Array, "n k"], Float[Array, "n e"]]:
    """DeepSeek-V3 "noaux_tc" routing as in HF Glm4MoeTopkRouter, all in fp32.

    Returns the chosen experts, their combine weights, and the raw sigmoid scores.
    The correction bias only chooses experts; the weights come from the unbiased scores.
    """
    idx, scores = choose_experts(x, w_router_de, bias_e, cfg)
    return idx, combine_weights(scores, idx, cfg), scores


def replay_differs(natural: Int[Array, "n k"], replayed: Int[Array, "n k"]) -> Float[Array, "n"]:
    """1.0 where the router's own expert set differs from the replayed one (order within the top-k ignored)."""
    return jnp.any(jnp.sort(natural, axis=-1) != jnp.sort(replayed, axis=-1), axis=-1).astype(jnp.float32)


@jax.named_scope("moe_dispatch")  # the shard_map and its collectives; "experts" inside is the local compute
def dispatch(x: Float[Array, "n d"], idx: Int[Array, "n k"], weights: Float[Array, "n k"],
             w_gate_edf: Array, w_up_edf: Array, w_down_efd: Array,
             cfg: ModelConfig) -> tuple[Float[Array, "n d"], Array, Int[Array, "e"]]:
    """The routed experts as one shard_map; returns (output, dropped fraction, global tokens per expert).

    Tokens are sharded over the batch axes (data x expert) and the sequence's `context` shards (more token
    shards: loads and drops are summed over all three), experts over `expert`, each expert's FFN over `tensor`.
    Strategies (`cfg.moe_dispatch`) differ only in how tokens meet experts:
      allgather  gather the expert group's tokens, run the local experts on all of them, and
                 reduce-scatter the partial outputs back (simple; reported faster than ragged
                 all-to-all on GPUs at moderate expert-parallel sizes)
      alltoall   send each assignment to the shard owning its expert in capacity-sized buffers
                 with `all_to_all`, compute, send back (communication ~ k x tokens, not E x tokens)
    """
    tok = logical("tokens", None)  # batch x seq flattened: data x expert (x pipeline) x context
    exp = logical("exp", None, "mlp_moe")
    exp_down = logical("exp", "mlp_moe", None)
    # The token spec's axes, not mesh_axes("batch"): inside a pipeline stage `pipeline` is not among them.
    batch_axes = spec_axes(tok[0])
    local_fn = _allgather if cfg.moe_dispatch == "allgather" else _alltoall

    def local(x, idx, weights, wg, wu, wd):
        y, dropped = local_fn(x, idx, weights, wg, wu, wd, cfg)
        # FFN hidden is tensor-sharded: every tensor shard holds a partial sum of y.
        y = jax.lax.psum(y, mesh_axes("mlp_moe")) if mesh_axes("mlp_moe") else y
        load = jax.lax.psum(jnp.bincount(idx.reshape(-1), length=cfg.n_routed_experts), batch_axes)
        dropped_frac = jax.lax.psum(dropped, batch_axes) / jax.lax.psum(idx.size, batch_axes)
        return y.astype(x.dtype), dropped_frac, load

    in_specs = (tok, tok, tok, exp, exp, exp_down)
    # Inside a pipeline stage its backward recomputes `local` in a shard_map of its own: one extra routed forward
    # per MoE layer (docs/pipeline.md#nested-shard-map).
    mapped = shard_map(local, in_specs, (tok, jax.P(), jax.P()), diff_argnums=(0, 2, 3, 4, 5))
    tokens = [jax.sharding.reshard(a, tok) for a in (x, idx, weights)]
    experts = [jax.sharding.reshard(w, spec) for w, spec in
               ((w_gate_edf, exp), (w_up_edf, exp), (w_down_efd, exp_down))]
    return mapped(*tokens, *experts)


def _expert_group() -> tuple[str, ...]:
    return mesh_axes("exp")


def _first_local_expert(num_local: int):
    axes = _expert_group()
    return jax.lax.axis_index(axes) * num_local if axes else 0


def _allgather(x, idx, weights, wg, wu, wd, cfg):
    """All tokens of the expert group visit this shard's experts; partial outputs are reduce-scattered."""
    axes = _expert_group()
    if axes:
        x, idx, weights = (jax.lax.all_gather(a, axes, axis=0, tiled=True) for a in (x, idx, weights))
    e_local = wg.shape[0]
    y, dropped = local_experts(x, idx, weights, wg, wu, wd, cfg, expert_offset=_first_local_expert(e_local))
    if axes:
        y = jax.lax.psum_scatter(y.astype(jnp.float32), axes, scatter_dimension=0, tiled=True)
    return y, dropped


def _alltoall(x, idx, weights, wg, wu, wd, cfg):
    """Each (token, expert) assignment travels to its expert's shard in a capacity-sized slot."""
    axes = _expert_group()
    n, k = idx.shape
    e_local = wg.shape[0]
    shards = cfg.n_routed_experts // e_local
    dropless = cfg.moe_capacity_factor <= 0
    # Per destination shard: at most n * min(k, e_local) assignments can arrive (experts are distinct).
    send_cap = n * min(k, e_local) if dropless else \
        max(1, min(n * min(k, e_local), math.ceil(cfg.moe_capacity_factor * n * k / shards)))
    flat_e = idx.reshape(-1)
    dest = flat_e // e_local
    order = jnp.argsort(dest, stable=True)  # earlier tokens win a full destination
    counts = jnp.bincount(dest, length=shards)
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(send_cap)
    valid = slot[None, :] < counts[:, None]  # [shards, send_cap]
    src = order[jnp.minimum(starts[:, None] + slot[None, :], n * k - 1)]
    send_x = jnp.where(valid[..., None], x[src // k], 0)
    send_e = jnp.where(valid, flat_e[src], -1)  # -1: an empty slot, ignored by every expert
    send_w = jnp.where(valid, weights.reshape(-1)[src], 0)
    unsent = jnp.sum(jnp.maximum(counts - send_cap, 0))

    def exchange(a):
        return jax.lax.all_to_all(a, axes, 0, 0, tiled=True) if axes else a

    recv_x, recv_e, recv_w = exchange(send_x), exchange(send_e), exchange(send_w)
    m = shards * send_cap
    recv = (recv_x.reshape(m, -1), recv_e.reshape(m, 1), recv_w.reshape(m, 1), wg, wu, wd)
    offset = _first_local_expert(e_local)
    if dropless:  # the local experts run only the received assignments' blocks, however large the buffer
        y, dropped = local_experts(*recv, cfg, expert_offset=offset)
    else:  # capacity per expert as if the group's n * shards tokens had been routed here
        y, dropped = grouped_experts(*recv, min(expert_capacity(n * shards, cfg), m), expert_offset=offset)
    back = exchange(y.astype(jnp.float32).reshape(shards, send_cap, -1))
    back = jnp.where(valid[..., None], back, 0)
    out = jnp.zeros((n, x.shape[-1]), jnp.float32).at[(src // k).reshape(-1)].add(back.reshape(m, -1))
    return out, dropped + unsent


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

    def __call__(self, x: Float[Array, "b s d"], expert_ids: Int[Array, "b s k"] | None = None
                 ) -> tuple[Float[Array, "b s d"], dict[str, Array]]:
        """`expert_ids` (routing replay, docs/rl.md#routing-replay): use these experts instead of the router's
        choice; the router still scores every expert and its weights get gradients through the combine weights
        gathered at the replayed ids. aux then also has "replay_differs" [b, s]: where its own choice differs."""
        cfg = self.cfg
        b, s, d = x.shape
        x_nd = flatten_tokens(x)
        replay = {}
        with jax.named_scope("router"):
            if expert_ids is None:
                idx, weights, scores = route(x_nd, weight(self.router), self.e_score_correction_bias[...], cfg)
            else:
                natural, scores = choose_experts(x_nd, weight(self.router), self.e_score_correction_bias[...], cfg)
                idx = flatten_tokens(expert_ids).astype(jnp.int32)
                weights = combine_weights(scores, idx, cfg)
                replay = {"replay_differs": unflatten_tokens(replay_differs(natural, idx), b, s)}
        routed, dropped, load = dispatch(
            x_nd, idx, weights, adapted(self, "gate_proj"), adapted(self, "up_proj"), adapted(self, "down_proj"), cfg)
        # Named for the save_matmuls remat policy: kept only where a backward reads it (the MTP layer's final norm),
        # which would otherwise re-run the routed experts' forward.
        routed = checkpoint_name(routed, "experts_out")
        with jax.named_scope("shared_expert"):
            shared = self.shared_experts(x)
        y = constrain(unflatten_tokens(routed, b, s), "batch", "seq", "act_embed") + shared
        aux = {
            "expert_load": load,  # global top-k counts
            "dropped_frac": dropped,
            "router_topk": unflatten_tokens(idx, b, s),
            "router_scores": unflatten_tokens(scores, b, s),
            **replay,
        }
        return y, aux

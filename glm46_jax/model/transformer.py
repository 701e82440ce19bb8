"""Decoder layers, the scanned layer stacks, the MTP layer and the full GLM-MoE causal LM."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jaxtyping import Array, Float, Int

from glm46_jax.config import ModelConfig
from glm46_jax.model import pipeline
from glm46_jax.model.attention import Attention, KVCache, cache_mask, self_attention_mask
from glm46_jax.model.layers import MLP, Head, RMSNorm, normal_init, param, rope_cos_sin
from glm46_jax.model.moe import MoE
from glm46_jax.parallel.sharding import context_size, load_balanced_order, logical, weight, whole_along


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + Attn(norm(x)), then x + FFN(norm(x)); FFN is a dense MLP or the MoE."""

    def __init__(self, cfg: ModelConfig, moe: bool, *, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg)
        self.mlp = MoE(cfg, rngs=rngs) if moe else MLP(cfg, cfg.intermediate_size, rngs=rngs)

    def __call__(self, x, cos, sin, mask, expert_ids=None, *, cache: KVCache | None = None, layer=0, index=0
                 ) -> tuple[Array, dict[str, Array], KVCache | None]:
        """(x out, the MoE's router statistics ({} for a dense layer), the cache with this layer's k/v written)."""
        a, cache = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer, index)
        x = x + a
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            with jax.named_scope("moe"):
                y, aux = self.mlp(h, expert_ids)
        else:
            with jax.named_scope("mlp"):
                y, aux = self.mlp(h), {}
        return x + y, aux, cache


def _stack(cfg: ModelConfig, moe: bool, n: int, rngs: nnx.Rngs, axis: str = "layers") -> DecoderLayer:
    """n layers with parameters stacked on a leading `axis` ("layers", or the pipeline's "stage_layers")."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make(rngs):
        return DecoderLayer(cfg, moe, rngs=rngs)

    return make(rngs)


def _keeping_attention(policy=None):
    """`policy`, plus the attention forward's outputs (the output and its softmax statistics), which its backward
    reads: cuDNN's forward custom call (matched by primitive name, as jax names no value inside its rule) and
    blockwise's named values. Otherwise the rebuilt layer re-runs the attention forward
    (docs/performance.md#attention)."""
    both = jax.checkpoint_policies.save_from_both_policies
    keep = both(lambda prim, *_, **__: prim.name == "dot_product_attention_fwd_wrapper",
                jax.checkpoint_policies.save_only_these_names("attention_out", "attention_lse"))
    return keep if policy is None else both(keep, policy)


_REMAT_POLICIES = {
    # Recompute the whole layer but its attention forward. The grouped experts' gate/up are not kept: 2 k f values
    # per token, times the expert shards with allgather (docs/performance.md#dropless-experts), several times the
    # layer input this policy keeps.
    "full": _keeping_attention(),
    # Plus the grouped experts' gate/up (model/grouped_gemm.py) and the routed experts' output (model/moe.py; only
    # the MTP layer's final norm reads it): the backward runs no forward expert GEMM again.
    "save_matmuls": _keeping_attention(jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("experts_gate_up", "experts_out"))),
}


def _run_stack(stack: DecoderLayer, x, cos, sin, mask, cfg: ModelConfig, expert_ids=None, cache: KVCache | None = None,
               index=0) -> tuple[Array, dict[str, Array], KVCache | None]:
    """lax.scan over the stacked layers: compile time stays flat in depth. `expert_ids` [layers, b, s, k]: each
    layer's replayed experts (scanned with its weights). Returns x, each layer's router statistics stacked
    [layers, ...] and the cache.

    The cache rides in the carry (not as scanned xs -> ys) so each layer's update is a dynamic_update_slice into
    the one buffer: no per-step copy of the stack's cache.
    """
    graphdef, state = nnx.split(stack)

    def body(carry, xs):
        x, cache = carry
        layer, layer_state, ids = xs
        x, aux, cache = nnx.merge(graphdef, layer_state)(x, cos, sin, mask, ids, cache=cache, layer=layer,
                                                         index=index)
        return (x, cache), aux

    if cfg.remat != "none" and cache is None:  # remat matters only under a gradient, i.e. without a cache
        body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
    layers = jnp.arange(jax.tree.leaves(state)[0].shape[0], dtype=jnp.int32)
    (x, cache), aux = jax.lax.scan(body, (x, cache), (layers, state, expert_ids), unroll=cfg.scan_unroll)
    return x, aux, cache


@struct.dataclass
class GenerationCache:
    """KV caches of the dense and MoE layer stacks (None where the model has no such layers), and of the
    MTP layer's block when it drafts tokens (speculative decoding)."""
    dense: KVCache | None
    moe: KVCache | None
    mtp: KVCache | None = None

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, max_len: int, *, mtp: bool = False) -> GenerationCache:
        def make(n):
            return KVCache.zeros(n, batch, max_len, cfg) if n else None
        return cls(make(cfg.num_dense_layers), make(cfg.num_moe_layers), make(1) if mtp else None)

    @property
    def max_len(self) -> int:
        return (self.dense or self.moe).k.shape[2]


class MTPLayer(nnx.Module):
    """Multi-token prediction, depth 1: row t sees embed(x[t+1]) and h[t], predicts x[t+2].

    Embedding and output head are the main model's (shared), as in GLM-4.6 / DeepSeek-V3
    (docs/architecture.md#mtp-layer).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg)
        self.hnorm = RMSNorm(d, cfg)
        self.eh_proj = param(rngs, (2 * d, d), ("eh_in", "embed"), cfg)  # input = [emb ‖ hidden]
        self.block = DecoderLayer(cfg, moe=True, rngs=rngs)
        self.shared_head_norm = RMSNorm(d, cfg)

    def __call__(self, h_final, next_emb, cos, sin, mask, cache: KVCache | None = None, index=0
                 ) -> tuple[Array, dict[str, Array], KVCache | None]:
        """With a `cache` (drafting) its block attends over, and writes, its own one-layer KV cache."""
        z, aux, cache = self.block(self._project(h_final, next_emb), cos, sin, mask, cache=cache, index=index)
        return self.shared_head_norm(z), aux, cache

    def _project(self, h_final, next_emb):
        z = jnp.concatenate([self.enorm(next_emb), self.hnorm(h_final)], axis=-1)
        return jnp.einsum("bsi,id->bsd", z, weight(self.eh_proj, z.dtype))


@struct.dataclass
class ModelOutput:
    logits: Float[Array, "b s v"]
    hidden: Float[Array, "b s d"]  # final-normed hidden state (what the MTP layer consumes)
    mtp_logits: Float[Array, "b s v"] | None  # row t predicts token t+2; the last row has no target
    aux: dict[str, Any]  # per-MoE-layer router statistics, stacked [num_moe_layers (+1 for MTP), ...]
    cache: GenerationCache | None = None  # with a cache in: the cache with these rows written
    scores: Float[Array, "b s n"] | None = None  # the score head's outputs (fp32), with model.score_head > 0

    @property
    def routing(self) -> Int[Array, "l b s k"] | None:
        """The experts each trunk MoE layer chose for these rows (what routing replay records); None without."""
        return self.aux.get("router_topk")


class GLMMoE(nnx.Module):
    """`Glm4MoeForCausalLM` (+ its MTP layer) as an NNX module.

    `stages` (default: the mesh's `pipeline` size) > 1 stores the MoE stack in pipeline slot order and runs it
    through the pipeline (docs/pipeline.md); the dense layers, head and MTP layer run data-parallel over it.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stages: int | None = None):
        self.cfg = cfg
        self.stages = pipeline.mesh_stages() if stages is None else stages
        self.embed_tokens = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg)
        self.dense_layers = _stack(cfg, False, cfg.num_dense_layers, rngs) if cfg.num_dense_layers else None
        if not cfg.num_moe_layers:
            self.moe_layers = None
        elif self.stages > 1:
            self.moe_layers = _stack(cfg, True, pipeline.layout(cfg, self.stages).slots, rngs, "stage_layers")
        else:
            self.moe_layers = _stack(cfg, True, cfg.num_moe_layers, rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg)
        self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg)
        self.mtp = MTPLayer(cfg, rngs=rngs) if cfg.num_nextn_predict_layers else None
        if cfg.score_head:  # HF's *ForSequenceClassification `score`: a bias-free linear map of the final hidden
            self.score = Head(normal_init(cfg)(rngs.params(), (cfg.hidden_size, cfg.score_head),
                                               jnp.dtype(cfg.param_dtype)), out_sharding=("embed", None))
        else:
            self.score = None

    def __call__(self, tokens: Int[Array, "b s"] | None, positions: Int[Array, "b s"] | None = None,
                 segment_ids: Int[Array, "b s"] | None = None, *, cache: GenerationCache | None = None,
                 index: Int[Array, ""] | Int[Array, "b"] | int = 0, start: Int[Array, "b"] | None = None,
                 expert_ids: Int[Array, "l b s k"] | None = None, next_tokens: Int[Array, "b s"] | None = None,
                 with_mtp: bool = True, hidden: Float[Array, "b s d"] | None = None,
                 with_logits: bool = True) -> ModelOutput:
        """The forward pass (every caller's: training, scoring, generation, speculative decoding, RL replay).

        Without a cache: whole rows, causal (+ same-document with `segment_ids`). On a mesh with a context axis > 1
        every [b, s] input is in the load-balanced layout (`loader.to_context_layout`), and `next_tokens` (the MTP
        layer's input: the token after each one) must be given, since a row's next token is not the next slot.
        With a `cache` (generation): the s new rows go to cache slots [index, index + s) (`index` may differ per row,
        [b]); `positions` are their RoPE positions and `start[b]` is row b's first real slot (earlier slots are left
        padding, masked out of every attention). The MTP layer then runs only when asked for, with `next_tokens`, on
        `cache.mtp`. `hidden` (the final-normed trunk output of an earlier call, `tokens` None): run only the MTP
        layer on it (speculative drafting, once the next tokens are known). `expert_ids`: routing replay for the
        trunk's MoE layers (not the MTP layer's). `with_logits=False` skips the LM head (a reward model or critic
        reads only `scores`)."""
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        if cache is not None:
            if self.stages > 1:
                raise ValueError("generation runs the layers in order on a mesh without pipeline stages; load the "
                                 "weights on a mesh with mesh.pipeline=1 (checkpoints are stored in layer order)")
            if context_size() > 1:
                raise ValueError("generation keeps each sequence whole (its KV cache is not split over `context`); "
                                 "run it on a mesh with mesh.context=1")
        b, s = (tokens if tokens is not None else next_tokens).shape
        if cache is None:
            mask = self_attention_mask(cfg, segment_ids, s)
            if positions is None:
                positions = jnp.broadcast_to(jnp.asarray(load_balanced_order(s, context_size())), (b, s))
        else:
            mask = cache_mask(start, index, s, cache.max_len)
        cos, sin = rope_cos_sin(positions, cfg, dt)  # shared by every layer (and the MTP layer)
        embed = weight(self.embed_tokens)
        act = logical("batch", "seq", "act_embed")
        head = weight(self.lm_head, dt)

        aux: dict[str, Any] = {}
        logits = None
        if hidden is None:
            x = embed.at[tokens].get(out_sharding=act).astype(dt)
            x, aux, cache = self._trunk(x, cos, sin, mask, expert_ids, cache, index)
            hidden = self.norm(x)
            if with_logits:
                with jax.named_scope("lm_head"):
                    logits = jnp.einsum("bsd,dv->bsv", hidden, head)

        mtp_logits = None
        if with_mtp and self.mtp is not None:
            with jax.named_scope("mtp"):
                if next_tokens is None:  # shift by one inside the row; the wrapped last row is never a valid target
                    if context_size() > 1 or cache is not None:
                        raise ValueError("the MTP layer on a context-sharded row, or with a cache, needs next_tokens")
                    next_tokens = jnp.roll(whole_along(tokens, 1), -1, axis=1)
                next_emb = embed.at[next_tokens].get(out_sharding=act).astype(dt)
                mtp_graphdef, mtp_state = nnx.split(self.mtp)

                def mtp(state, *args):
                    return nnx.merge(mtp_graphdef, state)(*args)
                if cfg.remat != "none" and cache is None:  # a whole MoE layer: remat it like the trunk's layers
                    mtp = jax.checkpoint(mtp, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
                z, mtp_aux, mtp_cache = mtp(mtp_state, hidden, next_emb, cos, sin, mask,
                                            None if cache is None else cache.mtp, index)
                mtp_logits = jnp.einsum("bsd,dv->bsv", z, head)
            aux = {"mtp": mtp_aux, **aux}
            if cache is not None:
                cache = cache.replace(mtp=mtp_cache)
        scores = None
        if self.score is not None:
            with jax.named_scope("score"):
                scores = jnp.einsum("bsd,dn->bsn", hidden.astype(jnp.float32),
                                    weight(self.score).astype(jnp.float32))
        return ModelOutput(logits=logits, hidden=hidden, mtp_logits=mtp_logits, aux=aux, cache=cache, scores=scores)

    def _trunk(self, x, cos, sin, mask, expert_ids, cache: GenerationCache | None, index
               ) -> tuple[Array, dict[str, Any], GenerationCache | None]:
        """The dense then the MoE layer stack (the MoE stack through the pipeline on a mesh with stages)."""
        cfg = self.cfg
        dense, moe = (None, None) if cache is None else (cache.dense, cache.moe)
        aux: dict[str, Any] = {}
        # Scopes named like the parameter subtrees, so a profile's ops map onto the checkpoint's names.
        if self.dense_layers is not None:
            with jax.named_scope("dense_layers"):
                x, _, dense = _run_stack(self.dense_layers, x, cos, sin, mask, cfg, None, dense, index)
        if self.moe_layers is not None and self.stages > 1:
            if expert_ids is not None:  # run_config refuses RL on a pipeline mesh; this guards direct callers
                raise ValueError("routing replay (expert_ids) is not supported with pipeline stages; run the model "
                                 "on a mesh with mesh.pipeline=1")
            with jax.named_scope("moe_layers"):
                graphdef, state = nnx.split(self.moe_layers)

                def layer(layer_state, *args):
                    return nnx.merge(graphdef, layer_state)(*args)[:2]
                x, aux = pipeline.run(state, x, cos, sin, mask, cfg, layer, _REMAT_POLICIES.get(cfg.remat),
                                      remat=cfg.remat != "none")
        elif self.moe_layers is not None:
            with jax.named_scope("moe_layers"):
                x, aux, moe = _run_stack(self.moe_layers, x, cos, sin, mask, cfg, expert_ids, moe, index)
        return x, aux, None if cache is None else cache.replace(dense=dense, moe=moe)

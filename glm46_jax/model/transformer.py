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
from glm46_jax.model.layers import MLP, RMSNorm, param, rope_cos_sin
from glm46_jax.model.moe import MoE
from glm46_jax.parallel.sharding import context_size, load_balanced_order, logical, weight, whole_along


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + Attn(norm(x)), then x + FFN(norm(x)); FFN is a dense MLP or the MoE."""

    def __init__(self, cfg: ModelConfig, moe: bool, *, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg)
        self.mlp = MoE(cfg, rngs=rngs) if moe else MLP(cfg, cfg.intermediate_size, rngs=rngs)

    def __call__(self, x, cos, sin, mask, expert_ids=None) -> tuple[Array, dict[str, Array]]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            with jax.named_scope("moe"):
                y, aux = self.mlp(h, expert_ids)
        else:
            with jax.named_scope("mlp"):
                y, aux = self.mlp(h), {}
        return x + y, aux

    def cached(self, x, cos, sin, mask, cache: KVCache, layer, index) -> tuple[Array, KVCache, Array | None]:
        """The same block for generation: attention reads and writes `cache`. Of the router stats only the
        chosen experts [b, s, k] are kept (None for a dense layer): what routing replay records."""
        a, cache = self.self_attn.cached(self.input_layernorm(x), cos, sin, mask, cache, layer, index)
        x = x + a
        h = self.post_attention_layernorm(x)
        topk = None
        with jax.named_scope("moe" if isinstance(self.mlp, MoE) else "mlp"):
            if isinstance(self.mlp, MoE):
                y, aux = self.mlp(h)
                topk = aux["router_topk"]
            else:
                y = self.mlp(h)
        return x + y, cache, topk


def _stack(cfg: ModelConfig, moe: bool, n: int, rngs: nnx.Rngs, axis: str = "layers") -> DecoderLayer:
    """n layers with parameters stacked on a leading `axis` ("layers", or the pipeline's "stage_layers")."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make(rngs):
        return DecoderLayer(cfg, moe, rngs=rngs)

    return make(rngs)


_REMAT_POLICIES = {
    "full": None,  # save nothing, recompute the whole layer
    "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _run_stack(stack: DecoderLayer, x, cos, sin, mask, cfg: ModelConfig, expert_ids=None):
    """lax.scan over the stacked layers: compile time stays flat in depth. `expert_ids` [layers, b, s, k]:
    each layer's replayed experts (scanned with its weights)."""
    graphdef, state = nnx.split(stack)

    def body(x, xs):
        layer_state, ids = xs
        return nnx.merge(graphdef, layer_state)(x, cos, sin, mask, ids)

    if cfg.remat != "none":
        body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
    return jax.lax.scan(body, x, (state, expert_ids), unroll=cfg.scan_unroll)


def _run_stack_cached(stack: DecoderLayer, x, cos, sin, mask, cache: KVCache, index
                      ) -> tuple[Array, KVCache, Array | None]:
    """lax.scan over the stacked layers with the whole stack's cache in the carry; also each layer's chosen
    experts [layers, b, s, k] (None for a dense stack).

    The cache rides in the carry (not as scanned xs -> ys) so each layer's update is a
    dynamic_update_slice into the one buffer: no per-step copy of the stack's cache.
    """
    graphdef, state = nnx.split(stack)

    def body(carry, xs):
        x, cache = carry
        layer, layer_state = xs
        x, cache, topk = nnx.merge(graphdef, layer_state).cached(x, cos, sin, mask, cache, layer, index)
        return (x, cache), topk

    n = cache.k.shape[0]
    (x, cache), topk = jax.lax.scan(body, (x, cache), (jnp.arange(n, dtype=jnp.int32), state))
    return x, cache, topk


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

    def __call__(self, h_final, next_emb, cos, sin, mask) -> tuple[Array, dict[str, Array]]:
        z, aux = self.block(self._project(h_final, next_emb), cos, sin, mask)
        return self.shared_head_norm(z), aux

    def cached(self, h_final, next_emb, cos, sin, mask, cache: KVCache, index) -> tuple[Array, KVCache]:
        """The same layer for drafting: its block attends over (and writes) its own one-layer cache."""
        z, cache, _ = self.block.cached(self._project(h_final, next_emb), cos, sin, mask, cache, 0, index)
        return self.shared_head_norm(z), cache

    def _project(self, h_final, next_emb):
        z = jnp.concatenate([self.enorm(next_emb), self.hnorm(h_final)], axis=-1)
        return jnp.einsum("bsi,id->bsd", z, weight(self.eh_proj, z.dtype))


@struct.dataclass
class ModelOutput:
    logits: Float[Array, "b s v"]
    hidden: Float[Array, "b s d"]  # final-normed hidden state (what the MTP layer consumes)
    mtp_logits: Float[Array, "b s v"] | None  # row t predicts token t+2; the last row has no target
    aux: dict[str, Any]  # per-MoE-layer router statistics, stacked [num_moe_layers (+1 for MTP), ...]


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

    def __call__(self, tokens: Int[Array, "b s"], positions: Int[Array, "b s"] | None = None,
                 segment_ids: Int[Array, "b s"] | None = None, *, with_mtp: bool = True,
                 next_tokens: Int[Array, "b s"] | None = None,
                 expert_ids: Int[Array, "l b s k"] | None = None) -> ModelOutput:
        """On a mesh with a context axis > 1 every [b, s] input is in the load-balanced layout
        (`loader.to_context_layout`); `next_tokens` (the MTP layer's input: the token after each one) must then
        be given, since the row's next token is not the next slot. `expert_ids`: routing replay for the trunk's
        MoE layers (num_moe_layers of them; not the MTP layer)."""
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        b, s = tokens.shape
        mask = self_attention_mask(cfg, segment_ids, s)
        if positions is None:
            positions = jnp.broadcast_to(jnp.asarray(load_balanced_order(s, context_size())), (b, s))
        cos, sin = rope_cos_sin(positions, cfg, dt)  # shared by every layer (and the MTP layer)
        embed = weight(self.embed_tokens)
        act = logical("batch", "seq", "act_embed")

        x = embed.at[tokens].get(out_sharding=act).astype(dt)
        aux: dict[str, Any] = {}
        # Scopes named like the parameter subtrees, so a profile's ops map onto the checkpoint's names.
        if self.dense_layers is not None:
            with jax.named_scope("dense_layers"):
                x, _ = _run_stack(self.dense_layers, x, cos, sin, mask, cfg)
        if self.moe_layers is not None and self.stages > 1:
            if expert_ids is not None:  # run_config refuses RL on a pipeline mesh; this guards direct callers
                raise ValueError("routing replay (expert_ids) is not supported with pipeline stages; run the model "
                                 "on a mesh with mesh.pipeline=1")
            with jax.named_scope("moe_layers"):
                graphdef, state = nnx.split(self.moe_layers)

                def layer(layer_state, *args):
                    return nnx.merge(graphdef, layer_state)(*args)
                x, aux = pipeline.run(state, x, cos, sin, mask, cfg, layer, _REMAT_POLICIES.get(cfg.remat),
                                      remat=cfg.remat != "none")
        elif self.moe_layers is not None:
            with jax.named_scope("moe_layers"):
                x, aux = _run_stack(self.moe_layers, x, cos, sin, mask, cfg, expert_ids)
        hidden = self.norm(x)
        head = weight(self.lm_head, dt)
        with jax.named_scope("lm_head"):
            logits = jnp.einsum("bsd,dv->bsv", hidden, head)

        mtp_logits = None
        if with_mtp and self.mtp is not None:
            with jax.named_scope("mtp"):
                if next_tokens is None:  # shift by one inside the row; the wrapped last row is never a valid target
                    if context_size() > 1:
                        raise ValueError("the MTP layer on a context-sharded row needs next_tokens")
                    next_tokens = jnp.roll(whole_along(tokens, 1), -1, axis=1)
                next_emb = embed.at[next_tokens].get(out_sharding=act).astype(dt)
                mtp_graphdef, mtp_state = nnx.split(self.mtp)

                def mtp(state, *args):
                    return nnx.merge(mtp_graphdef, state)(*args)
                if cfg.remat != "none":  # a whole MoE layer: remat it like the trunk's layers
                    mtp = jax.checkpoint(mtp, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
                z, mtp_aux = mtp(mtp_state, hidden, next_emb, cos, sin, mask)
                mtp_logits = jnp.einsum("bsd,dv->bsv", z, head)
            aux = {"mtp": mtp_aux, **aux}
        return ModelOutput(logits=logits, hidden=hidden, mtp_logits=mtp_logits, aux=aux)

    def forward_cached(self, tokens: Int[Array, "b s"], positions: Int[Array, "b s"], cache: GenerationCache,
                       index: Int[Array, ""] | Int[Array, "b"] | int, start: Int[Array, "b"]
                       ) -> tuple[Float[Array, "b s v"], GenerationCache]:
        """The main model (no MTP) over s new tokens at cache slots [index, index + s).

        `positions` are the RoPE positions (each row's own token index); `start[b]` is row b's first
        real slot: slots before it are left padding and are masked out of every attention.
        Prefill is s = prompt length at index 0; a decode step is s = 1. `index` may differ per row ([b]).
        """
        hidden, cache, _ = self.routed_cached(tokens, positions, cache, index, start)
        return self.head(hidden), cache

    def forward_cached_routed(self, tokens: Int[Array, "b s"], positions: Int[Array, "b s"],
                              cache: GenerationCache, index: Int[Array, ""] | Int[Array, "b"] | int,
                              start: Int[Array, "b"]
                              ) -> tuple[Float[Array, "b s v"], GenerationCache, Int[Array, "l b s k"] | None]:
        """`forward_cached` and the experts each MoE layer chose for the new tokens (None without MoE layers)."""
        hidden, cache, routing = self.routed_cached(tokens, positions, cache, index, start)
        return self.head(hidden), cache, routing

    def head(self, hidden: Float[Array, "b s d"]) -> Float[Array, "b s v"]:
        """The output projection of final-normed hidden states (shared by the main model and the MTP layer)."""
        with jax.named_scope("lm_head"):
            return jnp.einsum("bsd,dv->bsv", hidden, weight(self.lm_head, jnp.dtype(self.cfg.dtype)))

    def mtp_cached(self, hidden: Float[Array, "b s d"], next_tokens: Int[Array, "b s"], positions: Int[Array, "b s"],
                   cache: GenerationCache, index: Int[Array, ""] | Int[Array, "b"] | int, start: Int[Array, "b"]
                   ) -> tuple[Float[Array, "b s v"], GenerationCache]:
        """MTP logits for rows at cache slots [index, index + s): row t reads the main model's final-normed
        hidden[t] and the token at t + 1 and predicts the token at t + 2 (its draft), with `cache.mtp` as the
        block's KV cache (positions and masking as in `forward_cached`)."""
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        cos, sin = rope_cos_sin(positions, cfg, dt)
        mask = cache_mask(start, index, next_tokens.shape[1], cache.max_len)
        act = logical("batch", "seq", "act_embed")
        next_emb = weight(self.embed_tokens).at[next_tokens].get(out_sharding=act).astype(dt)
        with jax.named_scope("mtp"):
            z, mtp = self.mtp.cached(hidden, next_emb, cos, sin, mask, cache.mtp, index)
        return self.head(z), cache.replace(mtp=mtp)

    def hidden_cached(self, tokens: Int[Array, "b s"], positions: Int[Array, "b s"], cache: GenerationCache,
                      index: Int[Array, ""] | Int[Array, "b"] | int, start: Int[Array, "b"]
                      ) -> tuple[Float[Array, "b s d"], GenerationCache]:
        """`forward_cached` up to the final norm: the hidden states the MTP layer drafts from."""
        return self.routed_cached(tokens, positions, cache, index, start)[:2]

    def routed_cached(self, tokens: Int[Array, "b s"], positions: Int[Array, "b s"], cache: GenerationCache,
                      index: Int[Array, ""] | Int[Array, "b"] | int, start: Int[Array, "b"]
                      ) -> tuple[Float[Array, "b s d"], GenerationCache, Int[Array, "l b s k"] | None]:
        """`hidden_cached` and the MoE layers' chosen experts for the new tokens."""
        cfg = self.cfg
        if self.stages > 1:
            raise ValueError("generation runs the layers in order on a mesh without pipeline stages; load the "
                             "weights on a mesh with mesh.pipeline=1 (checkpoints are stored in layer order)")
        if context_size() > 1:
            raise ValueError("generation keeps each sequence whole (its KV cache is not split over `context`); run "
                             "it on a mesh with mesh.context=1")
        dt = jnp.dtype(cfg.dtype)
        s = tokens.shape[1]
        cos, sin = rope_cos_sin(positions, cfg, dt)
        mask = cache_mask(start, index, s, cache.max_len)
        act = logical("batch", "seq", "act_embed")
        x = weight(self.embed_tokens).at[tokens].get(out_sharding=act).astype(dt)
        dense, moe, routing = cache.dense, cache.moe, None
        if self.dense_layers is not None:
            with jax.named_scope("dense_layers"):
                x, dense, _ = _run_stack_cached(self.dense_layers, x, cos, sin, mask, dense, index)
        if self.moe_layers is not None:
            with jax.named_scope("moe_layers"):
                x, moe, routing = _run_stack_cached(self.moe_layers, x, cos, sin, mask, moe, index)
        return self.norm(x), cache.replace(dense=dense, moe=moe), routing

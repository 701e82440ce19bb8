"""GQA self-attention with q/k/v bias, per-head QK-norm and partial half-split RoPE (docs/architecture.md#attention)."""

from __future__ import annotations

import einops
import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from glm46_jax.config import ModelConfig
from glm46_jax.model.layers import RMSNorm, apply_partial_rope, param
from glm46_jax.sharding import logical, weight


def attention_mask(segment_ids: Int[Array, "b s"] | None, seq_len: int) -> Bool[Array, "b 1 s t"]:
    """Causal, and documents packed in one row never see each other (segment ids differ)."""
    causal = jnp.tril(jnp.ones((seq_len, seq_len), bool))[None, None]
    if segment_ids is None:
        return causal
    same_doc = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return causal & same_doc


class Attention(nnx.Module):
    """Einsum letters: b batch, s/t query/key position, d model, h query heads, k kv heads,
    g query heads per kv head, c head_dim."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, k, c = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = param(rngs, (d, h, c), ("embed", "heads", "head_dim"), cfg)
        self.k_proj = param(rngs, (d, k, c), ("embed", "kv_heads", "head_dim"), cfg)
        self.v_proj = param(rngs, (d, k, c), ("embed", "kv_heads", "head_dim"), cfg)
        self.o_proj = param(rngs, (h, c, d), ("heads", "head_dim", "embed"), cfg)
        if cfg.attention_bias:  # q/k/v only; o_proj never has a bias
            self.q_bias = param(None, (h, c), ("heads", "head_dim"), cfg, init="zeros")
            self.k_bias = param(None, (k, c), ("kv_heads", "head_dim"), cfg, init="zeros")
            self.v_bias = param(None, (k, c), ("kv_heads", "head_dim"), cfg, init="zeros")
        if cfg.use_qk_norm:  # one [head_dim] weight shared by all heads
            self.q_norm = RMSNorm(c, cfg)
            self.k_norm = RMSNorm(c, cfg)
        self.cfg = cfg

    @jax.named_scope("attention")  # op names in profiles and HLO dumps: .../attention/...
    def __call__(self, x: Float[Array, "b s d"], cos: Array, sin: Array,
                 mask: Bool[Array, "b 1 s t"]) -> Float[Array, "b s d"]:
        cfg, dt = self.cfg, x.dtype
        q = jnp.einsum("bsd,dhc->bshc", x, weight(self.q_proj, dt))
        k = jnp.einsum("bsd,dkc->bskc", x, weight(self.k_proj, dt))
        v = jnp.einsum("bsd,dkc->bskc", x, weight(self.v_proj, dt))
        if cfg.attention_bias:
            q, k, v = q + weight(self.q_bias, dt), k + weight(self.k_bias, dt), v + weight(self.v_bias, dt)
        if cfg.use_qk_norm:  # after the bias, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        scale = cfg.head_dim ** -0.5  # 1/sqrt(head_dim), not 1/sqrt(hidden/heads)
        if cfg.attention_impl == "xla":
            out = _xla_attention(q, k, v, mask, scale)
        else:  # jax.nn.dot_product_attention: cuDNN flash attention on GPU when asked for
            impl = "cudnn" if cfg.attention_impl == "cudnn" else None
            out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=impl)
        # Heads are tensor-sharded: the contraction is a reduce-scatter/all-reduce into the residual layout.
        return jnp.einsum("bshc,hcd->bsd", out, weight(self.o_proj, dt),
                          out_sharding=logical("batch", "seq", "act_embed"))


def _xla_attention(q, k, v, mask, scale):
    # The reference path: HF eager semantics (scores in the activation dtype, softmax in fp32).
    # Query head h uses kv head h // g (HF repeat_kv), so heads split as (kv head, group member).
    q = einops.rearrange(q, "b s (k g) c -> b s k g c", k=k.shape[2])
    scores = jnp.einsum("bskgc,btkc->bkgst", q, k) * scale
    scores = jnp.where(mask[:, :, None], scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgst,btkc->bskgc", probs, v)
    return einops.rearrange(out, "b s k g c -> b s (k g) c")

"""Small building blocks: RMSNorm, the SwiGLU MLP, partial rotary embeddings, initialisers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from glm46_jax.config import ModelConfig
from glm46_jax.model.adapters import adapted
from glm46_jax.parallel.sharding import logical, weight


class ExpertBias(nnx.Variable):
    """`e_score_correction_bias`: changed only by the loss-free balancing rule, never by gradients.

    A Variable type of its own so `nnx.split(model, nnx.Param, ExpertBias)` keeps it out of the
    differentiated and optimised parameter tree.
    """


class Head(nnx.Param):
    """The score head's weight (a reward model's, a critic's): a Param of its own kind so that a LoRA run trains it
    in full beside the adapters (PEFT's `modules_to_save`), while the backbone stays frozen."""


def normal_init(cfg: ModelConfig):
    # HF `_init_weights`: normal(0, initializer_range) for linear, embedding and router weights.
    return nnx.initializers.normal(cfg.initializer_range)


def param(rngs: nnx.Rngs | None, shape: tuple[int, ...], names: tuple[str | None, ...], cfg: ModelConfig,
          init: str = "normal") -> nnx.Param:
    dtype = jnp.dtype(cfg.param_dtype)
    if init == "normal":
        value = normal_init(cfg)(rngs.params(), shape, dtype)
    elif init == "ones":
        value = jnp.ones(shape, dtype)
    else:
        value = jnp.zeros(shape, dtype)
    return nnx.Param(value, out_sharding=names)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, cfg: ModelConfig):
        self.weight = param(None, (dim,), ("norm",), cfg, init="ones")
        self.eps = cfg.rms_norm_eps

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        # Statistics in fp32; HF casts back to the input dtype *before* scaling by the weight.
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return weight(self.weight, x.dtype) * y.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU FFN, no biases: dense layers and the shared expert."""

    def __init__(self, cfg: ModelConfig, intermediate: int, *, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.gate_proj = param(rngs, (d, intermediate), ("embed", "mlp"), cfg)
        self.up_proj = param(rngs, (d, intermediate), ("embed", "mlp"), cfg)
        self.down_proj = param(rngs, (intermediate, d), ("mlp", "embed"), cfg)

    def __call__(self, x: Float[Array, "b s d"]) -> Float[Array, "b s d"]:
        dt = x.dtype
        gate = jnp.einsum("bsd,df->bsf", x, adapted(self, "gate_proj", dt))
        up = jnp.einsum("bsd,df->bsf", x, adapted(self, "up_proj", dt))
        return jnp.einsum("bsf,fd->bsd", jax.nn.silu(gate) * up, adapted(self, "down_proj", dt),
                          out_sharding=logical("batch", "seq", "act_embed"))


def rope_cos_sin(positions: Int[Array, "b s"], cfg: ModelConfig, dtype) -> tuple[Array, Array]:
    """cos/sin tables [b, s, rotary_dim] for half-split (NeoX) RoPE on the first rotary_dim dims.

    Frequencies and the position product are fp32 exactly as HF computes them, then cast to the
    activation dtype (docs/architecture.md#partial-rope: at 128K positions the fp32 product matters).
    """
    r = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, r, 2, dtype=jnp.float32) / r))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_partial_rope(x: Float[Array, "b s h c"], cos: Array, sin: Array) -> Float[Array, "b s h c"]:
    """Rotate the first rotary_dim dims of every head in half-split form; the rest pass through."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)

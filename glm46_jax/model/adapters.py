"""LoRA / DoRA adapters inside the model: the Variable kind, the per-weight adapter module, and the one
function the model calls where it reads a projection weight (docs/lora.md#how-the-model-uses-them).

A module with an adapter on its weight `q_proj` holds it as the attribute `q_proj_lora`; `adapted(module,
"q_proj", dt)` then returns the effective weight, else exactly `weight(module.q_proj, dt)` (so a model
without adapters traces to the same program as before). Attaching adapters is `glm46_jax.model.lora`'s job.
"""

from __future__ import annotations

import string

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from glm46_jax.parallel.sharding import weight


class LoRA(nnx.Param):
    """An adapter parameter (A, B, DoRA magnitude). A Param of its own kind: `nnx.split(model, LoRA,
    nnx.Param, ExpertBias)` puts the adapters first, so gradients and the optimizer can cover only them."""


def lora_delta(a: Float[Array, "*lead_in r"], b: Float[Array, "*lead r_out"], n_in: int) -> Array:
    """A·B contracted over the rank: a [*lead, *in, r], b [*lead, r, *out] -> [*lead, *in, *out].

    `lead` (stacked layers, routed experts) is whatever leads `a` beyond its n_in input axes.
    """
    n_lead = a.ndim - 1 - n_in
    n_out = b.ndim - 1 - n_lead
    letters = iter(string.ascii_lowercase.replace("r", ""))
    lead = "".join(next(letters) for _ in range(n_lead))
    ins = "".join(next(letters) for _ in range(n_in))
    outs = "".join(next(letters) for _ in range(n_out))
    return jnp.einsum(f"{lead}{ins}r,{lead}r{outs}->{lead}{ins}{outs}", a, b)


def effective_weight(w: Array, a: Array, b: Array, magnitude: Array | None, scale: float,
                     n_in: int, n_out: int) -> Array:
    """W + scale·A·B, or DoRA's m · (W + scale·A·B) / ||W + scale·A·B|| (all in fp32).

    `w` is [*lead, *in, *out]. `a`/`b` may lack an expert axis that `w` has (one adapter shared by all
    routed experts): the delta then broadcasts over it. The DoRA norm is PEFT's: for each output feature,
    over the input features, treated as a constant in the backward pass as PEFT does (DoRA paper 4.3),
    so gradients match a PEFT run (docs/lora.md#dora).
    """
    delta = lora_delta(a.astype(jnp.float32), b.astype(jnp.float32), n_in) * scale
    n_lead_w = w.ndim - n_in - n_out
    while delta.ndim < w.ndim:  # shared across experts: broadcast over the expert axis (the last lead axis)
        delta = jnp.expand_dims(delta, n_lead_w - 1)
    v = w.astype(jnp.float32) + delta
    if magnitude is None:
        return v
    in_axes = tuple(range(n_lead_w, n_lead_w + n_in))
    norm = jax.lax.stop_gradient(jnp.sqrt(jnp.sum(v * v, axis=in_axes, keepdims=True)))
    # A pipeline's identity padding slots hold W = 0 (and m = 0): 0 / 0 there would put NaNs into the backward
    # of the skipped layer. A real weight's column never has norm 0, so this changes nothing else.
    norm = jnp.where(norm > 0, norm, jnp.ones((), norm.dtype))
    return jnp.expand_dims(magnitude.astype(jnp.float32), in_axes) * v / norm


class Adapter(nnx.Module):
    """The adapter of one weight: A [*lead, *in, r], B [*lead, r, *out] and, for DoRA, the magnitude
    [*lead_of_weight, *out]. Stacked layers add a leading "layers" axis to all of them (on a pipeline mesh the MoE
    stack's "stage_layers" slot axis, padding slots included, as its weights have: docs/lora.md#pipeline-meshes)."""

    def __init__(self, a: LoRA, b: LoRA, magnitude: LoRA | None, scale: float, n_in: int, n_out: int):
        self.a, self.b, self.magnitude = a, b, magnitude
        self.scale, self.n_in, self.n_out = scale, n_in, n_out

    def __call__(self, w: Array) -> Array:
        mag = None if self.magnitude is None else weight(self.magnitude)
        return effective_weight(w, weight(self.a), weight(self.b), mag, self.scale, self.n_in, self.n_out)


def adapted(module: nnx.Module, name: str, dtype=None) -> Array:
    """`weight(module.<name>, dtype)`, with the module's adapter on it merged in when it has one.

    Merged weight, not a low-rank side path x·A·B: inside the layer scan only one layer's effective weight
    exists at a time; it costs in·out·r flops per layer and step (less than the side path's
    tokens·(in + out)·r once a batch holds more than ~in·out/(in + out) tokens), it is the only form DoRA's
    column norm allows, and the routed experts' grouped matmul (custom VJP) needs no change. The price:
    no LoRA dropout (docs/lora.md#merged-weights-not-a-side-path).
    """
    adapter = getattr(module, f"{name}_lora", None)
    if adapter is None:
        return weight(getattr(module, name), dtype)
    w = adapter(weight(getattr(module, name)))
    return w if dtype is None else w.astype(dtype)

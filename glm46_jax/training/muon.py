"""Muon's update: momentum + Nesterov, Newton-Schulz orthogonalisation, RMS scaling, and which axes are the matrix.

    chain(scale_by_muon(momentum, ns_steps, ns_dtype), scale_by_consistent_rms(rms))  # optim.muon_adamw's Muon

Muon (docs/training.md#muon; the state and numbers of optax 0.2.8 `optax.contrib.scale_by_muon`):
  * Nesterov momentum 0.95 (optax's bias-corrected EMA form; Newton-Schulz normalises the scale
    away, so the direction equals Moonlight's `g + mu*buf` at step 1 and asymptotically after),
  * Newton-Schulz, 5 steps, (a, b, c) = (3.4445, -4.7750, 2.0315), X / (||X||_F + 1e-8) first,
    X^T X instead of X X^T when rows > cols; matmul inputs in `ns_dtype` (bf16 on GPU/TPU, as
    Keller Jordan's muon.py), accumulated in fp32 (`newton_schulz`),
  * update RMS matched to 0.2: scaled by 0.2 * sqrt(max(fan_in, fan_out)) (Moonlight, "Muon is
    scalable"). optax exports no public `scale_by_shape`; `scale_by_consistent_rms` below is that
    transform (optax.contrib._muon.scale_by_shape with consistent_rms) written out.
The matrix each Muon leaf is orthogonalised as is `muon_dims`; every other axis is a batch axis (stacked layers,
experts, heads). Which leaves are Muon, the weight decay and the lr are training/optim.py's.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from glm46_jax.model.paths import path_names

MDN = optax.contrib.MuonDimensionNumbers
NS_COEFFS = (3.4445, -4.7750, 2.0315)
# auto: bfloat16 when the program is compiled for a GPU/TPU; float32 for a CPU, whose tiny runs gain nothing from
# bf16 and whose tests and fixtures are fp32 references (measured: docs/performance.md#muon-in-bf16).
NS_DTYPES = ("auto", "float32", "bfloat16")


def muon_dims(path, x) -> MDN:
    """How a Muon leaf is seen as a batch of (fan_in, fan_out) matrices; other axes are batch axes.

    q/k/v_proj  [L?, D, heads, head_dim]  reduction D, output head_dim: orthogonalised per head
                (per head group for k/v under GQA), heads and layers batched. Per head rather than
                the fused [D, heads*head_dim] matrix, as MaxText does for its attention kernels.
    o_proj      [L?, heads, head_dim, D]  reduction head_dim, output D, per head.
    experts     [L?, E, in, out]          per expert (L, E batch).
    dense / shared-expert FFN [L?, in, out], eh_proj [2D, D], router [L?, D, E], lm_head [D, V]:
                the last two axes, layers batched.
    """
    if path_names(path)[-1] in ("q_proj", "k_proj", "v_proj"):
        return MDN(reduction_axis=-3, output_axis=-1)
    return MDN(reduction_axis=-2, output_axis=-1)


def _muon_dims_tree(updates):
    """`muon_dims` at Muon leaves, MaskedNode where optax.partition masked a leaf out."""
    masked = lambda x: isinstance(x, optax.MaskedNode)
    return jax.tree_util.tree_map_with_path(lambda p, x: x if masked(x) else muon_dims(p, x), updates,
                                            is_leaf=masked)


def newton_schulz(x: jax.Array, dtype: Any = jnp.float32, steps: int = 5, coeffs=NS_COEFFS,
                  eps: float = 1e-8) -> jax.Array:
    """Orthogonalise the matrices in x's last two axes (leading axes are batch axes); returns fp32.

    X = x / (||x||_F + eps), normalised in fp32 and rounded once to `dtype`; then `steps` quintic iterations
    X <- a X + (b A + c A A) X with A = X X^T (A = X^T X and X <- a X + X (b A + c A A) when rows > cols: the
    same map transposed, so A is the small Gram matrix and nothing is transposed in memory). Every matmul takes
    `dtype` inputs and accumulates in fp32; each polynomial is summed in fp32 and rounded once, each iterate is
    stored in `dtype` (as Keller Jordan's muon.py does; an fp32 iterate measured no more accurate), the last
    one returned unrounded. optax's `orthogonalize_via_newton_schulz` computes in its input's dtype (every
    product rounded: 2.4x this error in bf16), hence this function.
    """
    a, b, c = coeffs
    tall = x.shape[-2] > x.shape[-1]
    # A scope of its own, so a profile tells these GEMMs and the casts between them from the rest of the
    # optimizer (benchmarks/gpu/components.py); a named scope only names ops, the program is the same.
    with jax.named_scope("newton_schulz"):
        x = x.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
        y = (x * (1.0 / (norm + eps))).astype(dtype)
        mm = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
        for i in range(steps):
            gram = mm("...ji,...jk->...ik" if tall else "...ij,...kj->...ik", y, y)
            poly = (b * gram + c * mm("...ij,...jk->...ik", gram.astype(dtype), gram.astype(dtype))).astype(dtype)
            out = a * y.astype(jnp.float32) + (mm("...ij,...jk->...ik", y, poly) if tall else
                                               mm("...ij,...jk->...ik", poly, y))
            y = out if i == steps - 1 else out.astype(dtype)
        return y.astype(jnp.float32)


def _matrices(x: jax.Array, dims: MDN):
    """x as [batch, fan_in, fan_out], every batch axis merged into one (as optax does), and the inverse. Kept
    apart, the batch axes of a pipeline-staged, expert-sharded leaf gave XLA:CPU a partitioned program whose
    collectives deadlocked (tests/test_pipeline.py); `sharded_update` pins the result's layout either way."""
    red = tuple(a % x.ndim for a in _axes(dims.reduction_axis))
    out = tuple(a % x.ndim for a in _axes(dims.output_axis))
    batch = tuple(a for a in range(x.ndim) if a not in red + out)
    perm = batch + red + out
    moved = tuple(x.shape[a] for a in perm)
    shape = (math.prod(moved[:len(batch)]), math.prod(x.shape[a] for a in red), math.prod(x.shape[a] for a in out))
    inverse = lambda m: m.reshape(moved).transpose(tuple(perm.index(a) for a in range(x.ndim)))  # noqa: E731
    return x.transpose(perm).reshape(shape), inverse


# The most elements `_by_shape` concatenates into one Newton-Schulz call (4 MiB in fp32): on the CPU, larger batches
# ran slower than their leaves one by one (docs/performance.md#muon-leaves-batched-by-shape).
BATCH_ELEMENTS = 1 << 20


def _one_device() -> bool:
    """No mesh, or one of a single device: nothing is sharded, so any leaves may share one Newton-Schulz call."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or mesh.size == 1


def _by_shape(xs: dict[int, jax.Array], orthogonalise) -> dict[int, jax.Array]:
    """`orthogonalise` of every [batch, fan_in, fan_out] array in xs; those of one matrix shape are concatenated on
    their batch axis into one call of at most BATCH_ELEMENTS (a larger leaf goes alone). Each matrix is still
    normalised and iterated on its own (the same numbers), but a step has about one Newton-Schulz per matrix shape
    instead of one per leaf: the optimizer was a third of the tiny model's train-step compile
    (docs/performance.md#muon-leaves-batched-by-shape). Only without sharding (`_one_device`): concatenating leaves
    of different layouts would move them between devices."""
    calls: dict[tuple[int, ...], list[list[int]]] = {}  # matrix shape -> the leaves of each call, the last one open
    for i, x in xs.items():
        shape_calls = calls.setdefault(x.shape[1:], [[]])
        if shape_calls[-1] and sum(xs[j].size for j in shape_calls[-1]) + x.size > BATCH_ELEMENTS:
            shape_calls.append([])
        shape_calls[-1].append(i)
    out = {}
    for members in (m for shape_calls in calls.values() for m in shape_calls):
        together = orthogonalise(jnp.concatenate([xs[i] for i in members]))
        ends = list(itertools.accumulate(xs[i].shape[0] for i in members))
        out.update({i: together[start:end] for i, start, end in zip(members, [0, *ends[:-1]], ends, strict=True)})
    return out


def ns_dtype_branches(name: str) -> dict[str, Any]:
    """`ns_dtype` (one of NS_DTYPES) as `jax.lax.platform_dependent` branches of dtypes: "auto" is decided by the
    platform the program is compiled for (so a GPU program lowered on a CPU host gets bf16), never by the host."""
    if name == "auto":
        return dict(cpu=jnp.float32, default=jnp.bfloat16)
    return dict(default=jnp.dtype(name).type)


def scale_by_muon(momentum: float = 0.95, ns_steps: int = 5, ns_dtype: str = "auto") -> optax.GradientTransformation:
    """optax.contrib.scale_by_muon(NS_COEFFS, ns_steps, momentum, eps=1e-8, nesterov=True,
    weight_dimension_numbers=muon_dims): the same state (`MuonState`, checkpoints unchanged) and the same
    update, with Newton-Schulz in `ns_dtype` (`newton_schulz`) and the momentum, bias corrections
    and Nesterov mix as one expression per leaf, so no bias-corrected fp32 copy of the state is kept.
    """
    beta = momentum
    reference = optax.contrib.scale_by_muon(ns_coeffs=NS_COEFFS, ns_steps=ns_steps, beta=beta,
                                            eps=1e-8, nesterov=True, weight_dimension_numbers=_muon_dims_tree)
    dtypes = ns_dtype_branches(ns_dtype)
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        t = count.astype(jnp.float32)
        # optax's Nesterov: beta * mu_t / (1 - beta^(t+1)) + (1 - beta) * g_t / (1 - beta^t)
        c_mu, c_g = beta / (1 - beta ** (t + 1)), (1 - beta) / (1 - beta ** t)

        ns = {k: functools.partial(newton_schulz, dtype=d, steps=ns_steps) for k, d in dtypes.items()}
        orthogonalise = (lambda x: jax.lax.platform_dependent(x, **ns)) if len(ns) > 1 else ns["default"]

        def moment(g, m):
            return g if masked(g) else (beta * m + (1 - beta) * g).astype(m.dtype)

        def direction(path, g, m):
            if masked(g):
                return g
            x, inverse = _matrices(c_mu * m + c_g * g, muon_dims(path, g))
            return inverse(orthogonalise(x)).astype(g.dtype)

        mu = jax.tree.map(moment, updates, state.mu, is_leaf=masked)
        if not _one_device():  # sharded leaves: one Newton-Schulz each (see _by_shape)
            new_updates = jax.tree_util.tree_map_with_path(direction, updates, mu, is_leaf=masked)
            return new_updates, state._replace(count=count, mu=mu)
        flat, treedef = jax.tree_util.tree_flatten_with_path(updates, is_leaf=masked)
        matrices = {i: _matrices(c_mu * m + c_g * g, muon_dims(path, g))
                    for i, ((path, g), m) in enumerate(zip(flat, treedef.flatten_up_to(mu), strict=True))
                    if not masked(g)}
        out = _by_shape({i: x for i, (x, _) in matrices.items()}, orthogonalise)
        new_updates = treedef.unflatten([g if i not in out else matrices[i][1](out[i]).astype(g.dtype)
                                         for i, (_, g) in enumerate(flat)])
        return new_updates, state._replace(count=count, mu=mu)

    return optax.GradientTransformation(reference.init, update)


def scale_by_consistent_rms(rms: float) -> optax.GradientTransformation:
    """Scale each orthogonalised update by rms * sqrt(max(fan_in, fan_out)) (its RMS becomes ~rms).

    Same as optax.contrib._muon.scale_by_shape(consistent_rms=rms), which 0.2.8 does not export.
    """

    def scale(path, u):
        if isinstance(u, optax.MaskedNode):
            return u
        dims = muon_dims(path, u)
        fan_in = math.prod(u.shape[a] for a in _axes(dims.reduction_axis))
        fan_out = math.prod(u.shape[a] for a in _axes(dims.output_axis))
        return u * jnp.asarray(rms * math.sqrt(max(fan_in, fan_out)), u.dtype)

    def update(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(scale, updates,
                                                is_leaf=lambda x: isinstance(x, optax.MaskedNode)), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def _axes(a) -> tuple[int, ...]:
    return (a,) if isinstance(a, int) else tuple(a)

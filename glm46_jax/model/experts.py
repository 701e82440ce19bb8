"""Local routed-expert compute: the grouped SwiGLU matmul every dispatch strategy ends in.

Sort-by-expert + capacity-padded batched einsum. `jax.lax.ragged_dot` alone would be simpler,
but XLA lowers it to a dense product over every group on CPU and (by default) on NVIDIA GPUs:
about 90x slower on this CPU for 64 experts (docs/sharding.md#grouped-expert-matmul). Capacity C = tokens gives exact
dropless routing (top-k experts are distinct, so no expert can receive more than every token once).

The gather -> SwiGLU -> combine core has a hand-written VJP (`_routed_swiglu`, reverse mode only).
Against plain autodiff of the same forward it brings the layer's fwd+bwd from ~1.35x to ~1.2x a dense
FFN of the same FLOPs on CPU (benchmarks/moe_dispatch.py, RESULTS.md); the saving is all memory traffic:
  * the combine and the input gradient are k [n, d] gathers summed in one fusion, never an
    [n, k, d] tensor, and the transposes of the gathers are gathers (no zero-fill + scatter-add);
  * the combine-weight gradient is taken in the hidden space, <dy @ W_down^T, h> per slot, so the
    [E, C, d] expert output is not kept for the backward pass and no [n, k, d] product is formed.
Freshly written buffers are expensive on CPU (XLA:CPU page-faults every large buffer on each call),
so each [E, C, d] tensor not written saves several percent of the step. Inside a shard_map the
cotangents get their primals' varying axes back (`_like`), as autodiff would give them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from glm46_jax.config import ModelConfig


def expert_capacity(num_tokens: int, cfg: ModelConfig) -> int:
    if cfg.moe_capacity_factor <= 0:
        return num_tokens  # dropless
    per_expert = num_tokens * cfg.num_experts_per_tok / cfg.n_routed_experts
    return max(1, min(num_tokens, math.ceil(cfg.moe_capacity_factor * per_expert)))


@jax.named_scope("experts")
def grouped_experts(x: Float[Array, "n d"], idx: Int[Array, "n k"], weights: Float[Array, "n k"],
                    w_gate_edf: Array, w_up_edf: Array, w_down_efd: Array, capacity: int,
                    expert_offset: Array | int = 0) -> tuple[Float[Array, "n d"], Int[Array, ""]]:
    """Sum_j weights[:, j] * Expert_{idx[:, j]}(x) over the experts held here; returns (y, dropped count).

    The weights hold experts [expert_offset, expert_offset + E_local); assignments to other experts
    contribute nothing here (another shard computes them) and are not drops. Assignments are
    sorted by expert (stable, so earlier tokens win when an expert is full), gathered into an
    [E_local, C, d] buffer (empty slots are zeros), run through one batched SwiGLU einsum, and
    combined back in fp32 as HF does (expert output x fp32 weight, one cast at the end).
    """
    n, k = idx.shape
    a = n * k
    e = w_gate_edf.shape[0]
    dt = x.dtype
    local_e = idx.reshape(-1) - expert_offset
    is_local = (local_e >= 0) & (local_e < e)
    flat_e = jnp.where(is_local, local_e, e)  # other shards' assignments sort last, into bucket e
    order = jnp.argsort(flat_e, stable=True)  # assignment ids grouped by expert
    counts = jnp.bincount(flat_e, length=e + 1)[:e]
    starts = jnp.cumsum(counts) - counts
    # Slot -> assignment (and token); empty slots point at token n, which the gathers read as zeros.
    slot = jnp.arange(capacity)
    slot_valid = slot[None, :] < counts[:, None]  # [E, C]
    slot_assign = order[jnp.minimum(starts[:, None] + slot[None, :], a - 1)]
    slot_token = jnp.where(slot_valid, slot_assign // k, n)
    # Assignment -> slot: its rank among the assignments of its expert.
    position = jnp.zeros(a, jnp.int32).at[order].set(jnp.arange(a, dtype=jnp.int32))
    expert = jnp.minimum(flat_e, e - 1)
    rank = position - starts[expert]
    kept = is_local & (rank < capacity)
    dest = (expert * capacity + jnp.clip(rank, 0, capacity - 1)).reshape(n, k)  # only read where kept

    kept_nk = kept.reshape(n, k)
    w_nk = jnp.where(kept_nk, weights.astype(jnp.float32), 0)
    y = _routed_swiglu(x, w_gate_edf.astype(dt), w_up_edf.astype(dt), w_down_efd.astype(dt), w_nk,
                       slot_token, slot_assign, slot_valid, dest, kept_nk)
    return y.astype(dt), jnp.sum(is_local & ~kept)


def _take_rows(table: Array, rows: Array) -> Array:
    """table[rows], zeros for rows == len(table) (the empty-slot marker)."""
    return table.at[rows].get(mode="fill", fill_value=0)


def _gather_sum(table: Float[Array, "s d"], dest: Int[Array, "n k"], w: Float[Array, "n k"],
                mask: Bool[Array, "n k"]) -> Float[Array, "n d"]:
    """sum_j where(mask, w[:, j] * table[dest[:, j]], 0) in fp32: k row gathers, one fused loop each.

    Unrolled over k on purpose: XLA:CPU materialises `table[dest]` as [n, k, d] (~8x slower here).
    The `where` (not a 0 weight) keeps an inf/nan in a slot from leaking into tokens that do not use it.
    """
    acc = None
    for j in range(dest.shape[1]):
        term = jnp.where(mask[:, j:j + 1], table[dest[:, j]].astype(jnp.float32) * w[:, j:j + 1], 0)
        acc = term if acc is None else acc + term
    return acc


def _swiglu_in(x, slot_token, wg, wu):
    x_ecd = _take_rows(x, slot_token)
    gate = jnp.einsum("ecd,edf->ecf", x_ecd, wg)
    up = jnp.einsum("ecd,edf->ecf", x_ecd, wu)
    return x_ecd, gate, up


@jax.custom_vjp
def _routed_swiglu(x, wg, wu, wd, w_nk, slot_token, slot_assign, slot_valid, dest, kept):
    """y[t] = sum_j w_nk[t, j] * SwiGLU_{expert}(x[t]) for kept assignments (fp32 [n, d])."""
    return _routed_swiglu_fwd(x, wg, wu, wd, w_nk, slot_token, slot_assign, slot_valid, dest, kept)[0]


def _routed_swiglu_fwd(x, wg, wu, wd, w_nk, slot_token, slot_assign, slot_valid, dest, kept):
    x_ecd, gate, up = _swiglu_in(x, slot_token, wg, wu)
    y_ecd = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, wd)
    e, c, d = y_ecd.shape
    y = _gather_sum(y_ecd.reshape(e * c, d), dest, w_nk, kept)
    return y, (x, x_ecd, gate, up, wg, wu, wd, w_nk, slot_token, slot_assign, slot_valid, dest, kept)


def _routed_swiglu_bwd(res, dy):
    x, x_ecd, gate, up, wg, wu, wd, w_nk, slot_token, slot_assign, slot_valid, dest, kept = res
    dt = x_ecd.dtype
    e, c, d = x_ecd.shape
    # Every filled slot holds exactly one kept assignment, so the combine's transpose is a gather.
    w_slot = jnp.where(slot_valid, w_nk.reshape(-1)[slot_assign], 0)[..., None]  # [E, C, 1] fp32
    dy_ecd = _take_rows(dy, slot_token).astype(dt)  # unweighted: the weight is applied in f-space below
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    h = silu * up
    dh_unweighted = jnp.einsum("ecd,efd->ecf", dy_ecd, wd)
    # d/dw <dy, w * h @ Wd> = <dy @ Wd^T, h>: no [E, C, d] expert output needs to be kept.
    dw_slot = jnp.sum(dh_unweighted.astype(jnp.float32) * h.astype(jnp.float32), axis=-1)
    dw_nk = jnp.where(kept, dw_slot.reshape(-1)[dest], 0)
    dwd = jnp.einsum("ecf,ecd->efd", (h * w_slot).astype(dt), dy_ecd)
    dh = dh_unweighted * w_slot
    dgate = (dh * up * (sig * (1 + gate * (1 - sig)))).astype(dt)
    dup = (dh * silu).astype(dt)
    dwg = jnp.einsum("ecd,ecf->edf", x_ecd, dgate)
    dwu = jnp.einsum("ecd,ecf->edf", x_ecd, dup)
    dx_ecd = jnp.einsum("ecf,edf->ecd", dgate, wg) + jnp.einsum("ecf,edf->ecd", dup, wu)
    ones = jnp.ones(kept.shape, jnp.float32)
    dx = _gather_sum(dx_ecd.reshape(e * c, d), dest, ones, kept).astype(dt)
    grads = [_like(ct, primal) for ct, primal in zip((dx, dwg, dwu, dwd, dw_nk), (x, wg, wu, wd, w_nk))]
    return (*grads, None, None, None, None, None)


_routed_swiglu.defvjp(_routed_swiglu_fwd, _routed_swiglu_bwd)


def _varying(a: Array) -> frozenset:
    return jax.typeof(a).manual_axis_type.varying


def _like(ct: Array, primal: Array) -> Array:
    """Give a cotangent its primal's varying mesh axes inside a shard_map (no-op outside one).

    Autodiff inserts these itself: where the forward mixed an operand with one that varies over
    more axes (x with tensor-sharded weights), the transpose of that implicit `pvary` is a psum.
    """
    extra = tuple(sorted(_varying(ct) - _varying(primal)))
    ct = jax.lax.psum(ct, extra) if extra else ct
    missing = tuple(sorted(_varying(primal) - _varying(ct)))
    return jax.lax.pcast(ct, missing, to="varying") if missing else ct

"""Local routed-expert compute: the grouped SwiGLU matmul every dispatch strategy ends in.

Two layouts of the same sum_j w[t, j] * Expert_{idx[t, j]}(x[t]) (docs/sharding.md#grouped-expert-matmul):

* **dropless** (`moe_capacity_factor = 0`, the default; `dropless_experts`): assignments sorted by expert, each
  expert's group padded to a multiple of `moe_block_size` rows, and a loop over the *used* blocks only,
  `moe_block_group` blocks per step, each block a [block, d] x [d, f] matmul against its own expert's weights (one
  batched matmul per step), added into its tokens' fp32 output rows. The work is the routed work plus at most
  E_local x (block - 1) padding rows and group - 1 empty blocks, whatever the routing, and tokens routed to
  another shard's experts cost nothing here; no activation buffer is sized by the worst-case row space.
  `jax.lax.ragged_dot` would express the same thing, but XLA lowers it to a dense product over every group on CPU
  (and, by default, on NVIDIA GPUs; docs/performance.md#dropless-experts). The loop's trip count is
  data-dependent (a while loop): XLA's cost analysis counts its body once, so tests count its FLOPs as
  body x trips (tests/test_experts.py).
  That is the CPU's implementation (`moe_impl` "loop"). On an sm90 GPU `moe_impl` "auto" runs
  `grouped_gemm.grouped_dropless` instead (sort once, one grouped GEMM per projection, no loop), behind the same
  signature; "grouped" forces it anywhere (off such a GPU its GEMMs are XLA's dense `ragged_dot`).
* **capacity** (`moe_capacity_factor > 0`; `grouped_experts`): an [E_local, C, d] buffer per expert, one batched
  einsum; assignments past an expert's capacity are dropped (earlier tokens win).

Both have hand-written VJPs (reverse mode only). What they save against plain autodiff is memory traffic:
  * capacity: the combine and the input gradient are k [n, d] gathers summed in one fusion, never an [n, k, d]
    tensor, and the transposes of the gathers are gathers (no zero-fill + scatter-add);
  * the combine-weight gradient is taken in the hidden space, <dy @ W_down^T, h> per slot, so the expert output
    is not kept for the backward pass and no [n, k, d] product is formed;
  * the dropless backward recomputes each block's gate/up products instead of saving them: on CPU writing two
    [rows, f] buffers costs more than the two matmuls (docs/performance.md#dropless-experts).
Freshly written buffers are expensive on CPU (XLA:CPU page-faults every large buffer on each call). Inside a
shard_map the cotangents get their primals' varying axes back (`sharding.cotangent_like`), as autodiff would
give them.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from glm46_jax.config import ModelConfig
from glm46_jax.model import grouped_gemm
from glm46_jax.parallel.sharding import cotangent_like


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
    grads = [cotangent_like(ct, primal) for ct, primal in zip((dx, dwg, dwu, dwd, dw_nk), (x, wg, wu, wd, w_nk))]
    return (*grads, None, None, None, None, None)


_routed_swiglu.defvjp(_routed_swiglu_fwd, _routed_swiglu_bwd)


def local_experts(x: Float[Array, "n d"], idx: Int[Array, "n k"], weights: Float[Array, "n k"],
                  w_gate_edf: Array, w_up_edf: Array, w_down_efd: Array, cfg: ModelConfig,
                  expert_offset: Array | int = 0) -> tuple[Float[Array, "n d"], Int[Array, ""]]:
    """The experts held here on these tokens, dropless or with a capacity as `cfg` says: (y, dropped count)."""
    if cfg.moe_capacity_factor <= 0:
        y = dropless_experts(x, idx, weights, w_gate_edf, w_up_edf, w_down_efd, cfg.moe_block_size, expert_offset,
                             cfg.moe_block_group, cfg.moe_impl)
        return y, jnp.zeros((), jnp.int32)
    return grouped_experts(x, idx, weights, w_gate_edf, w_up_edf, w_down_efd, expert_capacity(x.shape[0], cfg),
                           expert_offset)


@struct.dataclass
class BlockLayout:
    """Where each assignment sits in the expert-sorted, block-padded row space [rows, d].

    Rows [b * block, (b + 1) * block) all belong to expert `block_expert[b]`; only the first `used` blocks hold
    assignments. Padding rows point at token n / assignment n * k, which the gathers read as zeros.
    """
    row: Int[Array, "n k"]  # the row of each assignment (0 where it is not local: masked by `local`)
    local: Bool[Array, "n k"]  # the assignment's expert is held here
    row_token: Int[Array, " rows"]
    row_assign: Int[Array, " rows"]
    block_expert: Int[Array, " blocks"]
    used: Int[Array, ""]


def block_layout(idx: Int[Array, "n k"], num_local: int, expert_offset: Array | int, block: int,
                 group: int = 1) -> BlockLayout:
    """Sort assignments by (local) expert and pad each expert's group to a multiple of `block` rows.

    The row space is sized for the worst case (every assignment local: n * k + num_local * (block - 1) rows),
    rounded up to whole groups of `group` blocks (the loops step a group at a time); the loops only visit the
    groups that hold the `used` blocks.
    """
    n, k = idx.shape
    a = n * k
    local_e = idx.reshape(-1) - expert_offset
    is_local = (local_e >= 0) & (local_e < num_local)
    flat_e = jnp.where(is_local, local_e, num_local)  # other shards' assignments: bucket num_local, no rows
    counts = jnp.bincount(flat_e, length=num_local + 1)[:num_local]
    padded = (counts + block - 1) // block * block
    padded_end = jnp.cumsum(padded)
    order = jnp.argsort(flat_e, stable=True)
    position = jnp.zeros(a, jnp.int32).at[order].set(jnp.arange(a, dtype=jnp.int32))  # rank in sorted order
    expert = jnp.minimum(flat_e, num_local - 1)
    start = jnp.cumsum(counts) - counts
    row = jnp.where(is_local, padded_end[expert] - padded[expert] + position - start[expert], 0)
    rows = -(-(a + num_local * (block - 1)) // (block * group)) * block * group
    target = jnp.where(is_local, row, rows)  # out of range: dropped by the scatters below
    assign = jnp.arange(a, dtype=jnp.int32)
    row_assign = jnp.full((rows,), a, jnp.int32).at[target].set(assign, mode="drop", unique_indices=True)
    row_token = jnp.where(row_assign < a, row_assign // k, n)
    block_start = jnp.arange(rows // block) * block
    block_expert = jnp.minimum(jnp.searchsorted(padded_end, block_start, side="right"), num_local - 1)
    return BlockLayout(row=row.reshape(n, k).astype(jnp.int32), local=is_local.reshape(n, k),
                       row_token=row_token, row_assign=row_assign, block_expert=block_expert.astype(jnp.int32),
                       used=(padded_end[-1] // block).astype(jnp.int32))


def dropless_impl(impl: str, dtype, d: int, f: int, rows: int | None = None) -> str:
    """Which dropless implementation `impl` ("auto" | "loop" | "grouped") runs for these shapes (`rows`: the
    assignments, n * k): "loop" or "grouped". "auto" is grouped where its kernels run (an sm90 GPU, 16-bit compute,
    d and f per shard multiples of 64, >= 128 rows) and the loop elsewhere, where it measures best
    (docs/performance.md#dropless-experts)."""
    if impl == "auto":
        return "grouped" if _kernels_run(dtype, d, f, rows) else "loop"
    if impl not in ("loop", "grouped"):
        raise ValueError(f"dropless_impl: {impl!r} is not one of auto, loop, grouped")
    return impl


def dropless_stats(idx: Int[Array, "n k"], num_local: int, d: int, f: int, dtype, block: int, group: int = 1,
                   impl: str = "auto", expert_offset: Array | int = 0) -> dict[str, Array | str]:
    """What an implementation does beyond the routed rows, for benchmarks: {"impl", "padded_rows", "trips"}.

    loop: padded_rows = rows of the used blocks past the routed ones, trips = loop trips (data-dependent);
    grouped: padded_rows = rows of the forward kernel's 128-row tiles past the routed ones, trips = 0 (no loop).
    """
    impl = dropless_impl(impl, dtype, d, f, idx.size)
    if impl == "grouped":
        layout = grouped_gemm.sorted_layout(idx, num_local, expert_offset)
        return {"impl": impl, "padded_rows": grouped_gemm.tile_padding(layout.group_sizes),
                "trips": jnp.zeros((), jnp.int32)}
    layout = block_layout(idx, num_local, expert_offset, block, group)
    return {"impl": impl, "padded_rows": layout.used * block - jnp.sum(layout.local), "trips": _trips(layout, group)}


def _kernels_run(dtype, d: int, f: int, rows: int | None) -> bool:
    return grouped_gemm.kernel_device() and grouped_gemm.kernel_supported(d, f, dtype, rows)


@jax.named_scope("experts")
def dropless_experts(x: Float[Array, "n d"], idx: Int[Array, "n k"], weights: Float[Array, "n k"],
                     w_gate_edf: Array, w_up_edf: Array, w_down_efd: Array, block: int,
                     expert_offset: Array | int = 0, group: int = 1, impl: str = "auto") -> Float[Array, "n d"]:
    """Sum_j weights[:, j] * Expert_{idx[:, j]}(x) over the experts held here, every assignment computed.

    `impl` (`dropless_impl`) picks the grouped GEMMs (`grouped_gemm.grouped_dropless`; `block` and `group` unused)
    or the block loop. The loops take `group` blocks per step, each block against its own expert's weights, as one
    batched matmul (docs/performance.md#dropless-experts: on XLA:CPU a [block, d] x [d, f] product alone runs on
    one core). Combined in fp32 as HF does (expert output x fp32 weight, one cast at the end); assignments to
    experts held elsewhere contribute nothing here.
    """
    shapes = (x.dtype, x.shape[1], w_gate_edf.shape[2], idx.size)
    if dropless_impl(impl, *shapes) == "grouped":
        backend = "mosaic" if _kernels_run(*shapes) else "xla"
        return grouped_gemm.grouped_dropless(x, idx, weights, w_gate_edf, w_up_edf, w_down_efd, expert_offset,
                                             backend)
    dt = x.dtype
    layout = block_layout(idx, w_gate_edf.shape[0], expert_offset, block, group)
    w_nk = jnp.where(layout.local, weights.astype(jnp.float32), 0)
    y = _blocked_swiglu(x, w_gate_edf.astype(dt), w_up_edf.astype(dt), w_down_efd.astype(dt), w_nk, layout,
                        block, group)
    return y.astype(dt)


def _group_rows(a: Array, i: Array, block: int, group: int) -> Array:
    """Step i's rows of a per-row array, as [group, block]."""
    return jax.lax.dynamic_slice_in_dim(a, i * block * group, block * group).reshape(group, block)


def _experts_of(w: Array, e: Array) -> Array:
    """w[e] for an expert id or a [group] vector of them: one dynamic slice per block (no gather op)."""
    if e.ndim == 0:
        return jax.lax.dynamic_index_in_dim(w, e, keepdims=False)
    return jnp.stack([jax.lax.dynamic_index_in_dim(w, e[g], keepdims=False) for g in range(e.shape[0])])


def _step_blocks(layout: BlockLayout, i: Array, block: int, group: int) -> tuple[Array, Array]:
    """Loop step i's blocks: their token rows [group, block] and their experts [group]."""
    return (_group_rows(layout.row_token, i, block, group),
            jax.lax.dynamic_slice_in_dim(layout.block_expert, i * group, group))


def _trips(layout: BlockLayout, group: int) -> Array:
    return (layout.used + group - 1) // group


@partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _blocked_swiglu(x, wg, wu, wd, w_nk, layout: BlockLayout, block: int, group: int):
    """y[t] = sum_j w_nk[t, j] * SwiGLU_{expert}(x[t]) (fp32 [n, d]); a loop over the used blocks."""
    return _blocked_swiglu_fwd(x, wg, wu, wd, w_nk, layout, block, group)[0]


def _blocked_swiglu_fwd(x, wg, wu, wd, w_nk, layout: BlockLayout, block: int, group: int):
    w_row = _take_rows(w_nk.reshape(-1), layout.row_assign)  # fp32, 0 on padding rows

    def body(i, y):
        tokens, experts = _step_blocks(layout, i, block, group)
        y_b = block_forward(x, wg, wu, wd, tokens, experts)
        # Straight into the token's output: no [rows, d] buffer sized for the worst case. A block holds one
        # expert, so one block's tokens are distinct (a group's may repeat a token: two of its experts); padding
        # rows (token n) fall outside and are dropped.
        weighted = y_b.astype(jnp.float32) * _group_rows(w_row, i, block, group)[..., None]
        return y.at[tokens.reshape(-1)].add(weighted.reshape(-1, x.shape[1]), mode="drop",
                                            unique_indices=group == 1)

    y = _pvary(jnp.zeros(x.shape, jnp.float32), x, wg, wu, wd, w_nk, layout.row_token)
    return jax.lax.fori_loop(0, _trips(layout, group), body, y), (x, wg, wu, wd, w_nk, w_row, layout)


def _mm(a: Array, b: Array) -> Array:
    """a @ b over the last two axes, batched over the leading (block) axis when there is one."""
    return jnp.einsum("...ij,...jk->...ik", a, b)


def _t(a: Array) -> Array:
    return jnp.swapaxes(a, -1, -2)


def block_forward(x: Float[Array, "n d"], wg: Array, wu: Array, wd: Array, tokens: Int[Array, "*g block"],
                  e: Int[Array, "*g"]) -> Float[Array, "*g block d"]:
    """Blocks of the dropless loop: expert e's SwiGLU on rows x[tokens] (token n reads as zeros); `tokens` one
    block with `e` a scalar, or [group, block] with one expert per block."""
    x_b = _take_rows(x, tokens)
    return _mm(jax.nn.silu(_mm(x_b, _experts_of(wg, e))) * _mm(x_b, _experts_of(wu, e)), _experts_of(wd, e))


def block_backward(x: Float[Array, "n d"], dy: Float[Array, "n d"], w_b: Float[Array, "*g block"], wg: Array,
                   wu: Array, wd: Array, tokens: Int[Array, "*g block"], e: Int[Array, "*g"]) -> tuple[Array, ...]:
    """Blocks of the dropless backward loop (shapes as `block_forward`): (dW_gate[e], dW_up[e], dW_down[e],
    dx rows, d combine weight), the weight gradients one per block."""
    dt = x.dtype
    x_b, dy_b = _take_rows(x, tokens), _take_rows(dy, tokens).astype(dt)
    w_b = w_b[..., None]
    w_gate, w_up, w_down = _experts_of(wg, e), _experts_of(wu, e), _experts_of(wd, e)
    gate, up = _mm(x_b, w_gate), _mm(x_b, w_up)  # recomputed: cheaper than keeping them (module docstring)
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    h = silu * up
    dh_unweighted = _mm(dy_b, _t(w_down))
    # d/dw <dy, w * h @ Wd> = <dy @ Wd^T, h>: no expert output needs to be kept.
    dw_b = jnp.sum(dh_unweighted.astype(jnp.float32) * h.astype(jnp.float32), axis=-1)
    dh = dh_unweighted * w_b
    dgate = (dh * up * (sig * (1 + gate * (1 - sig)))).astype(dt)
    dup = (dh * silu).astype(dt)
    dx_b = (_mm(dgate, _t(w_gate)) + _mm(dup, _t(w_up))).astype(dt)
    return _mm(_t(x_b), dgate), _mm(_t(x_b), dup), _mm(_t((h * w_b).astype(dt)), dy_b), dx_b, dw_b


def _blocked_swiglu_bwd(block, group, res, dy):
    x, wg, wu, wd, w_nk, w_row, layout = res
    rows = layout.row_token.shape[0]

    def body(i, carry):
        dwg, dwu, dwd, dx, dw_rows = carry
        tokens, experts = _step_blocks(layout, i, block, group)
        dwg_b, dwu_b, dwd_b, dx_b, dw_b = block_backward(x, dy, _group_rows(w_row, i, block, group), wg, wu, wd,
                                                         tokens, experts)
        for g in range(group):  # blocks of one expert may share a group: added one at a time, in place
            dwg, dwu, dwd = (_add_expert(acc, experts[g], upd[g]) for acc, upd in
                             ((dwg, dwg_b), (dwu, dwu_b), (dwd, dwd_b)))
        return (dwg, dwu, dwd,
                dx.at[tokens.reshape(-1)].add(dx_b.reshape(-1, x.shape[1]).astype(jnp.float32), mode="drop",
                                              unique_indices=group == 1),
                jax.lax.dynamic_update_slice_in_dim(dw_rows, dw_b.reshape(-1), i * block * group, 0))

    operands = (x, wg, wu, wd, dy, layout.row_token)
    init = tuple(_pvary(z, *operands) for z in (jnp.zeros_like(wg), jnp.zeros_like(wu), jnp.zeros_like(wd),
                                               jnp.zeros(x.shape, jnp.float32), jnp.zeros((rows,), jnp.float32)))
    dwg, dwu, dwd, dx, dw_rows = jax.lax.fori_loop(0, _trips(layout, group), body, init)
    dw_nk = jnp.where(layout.local, dw_rows[layout.row], 0)
    grads = [cotangent_like(ct, primal)
             for ct, primal in zip((dx.astype(x.dtype), dwg, dwu, dwd, dw_nk), (x, wg, wu, wd, w_nk))]
    return (*grads, None)


_blocked_swiglu.defvjp(_blocked_swiglu_fwd, _blocked_swiglu_bwd)


def _add_expert(acc: Array, e: Array, update: Array) -> Array:
    """acc[e] += update as a dynamic slice + update in place (`.at[e].add` is a scatter that rewrites acc)."""
    current = jax.lax.dynamic_index_in_dim(acc, e, keepdims=True)
    return jax.lax.dynamic_update_index_in_dim(acc, current + update[None].astype(acc.dtype), e, 0)


def _pvary(a: Array, *like: Array) -> Array:
    """`a` varying over every mesh axis any of `like` varies over (a loop carry must keep one type)."""
    axes = frozenset().union(*(_varying(v) for v in like)) - _varying(a)
    return jax.lax.pcast(a, tuple(sorted(axes)), to="varying") if axes else a


def _varying(a: Array) -> frozenset:
    return jax.typeof(a).manual_axis_type.varying

"""Dropless routed experts as grouped GEMMs: sort once, one grouped GEMM per projection, un-permute once.

The GPU layout of `experts.dropless_experts` (docs/performance.md#dropless-experts): the n x k assignments are
sorted by expert once (other shards' experts last), gate, up and down are one grouped GEMM each over the sorted
rows with the group sizes on the device, and the outputs are combined back per token in fp32. The backward is
hand-written: two more grouped GEMMs against the transposed weights (dy @ W_down^T; [dgate | dup] @ [W_gate |
W_up]^T, gate and up side by side), and the weight gradients as two transposed-ragged GEMMs (the sum over each
expert's rows, accumulated in fp32 inside the kernel and rounded once). No loop, no trip count, no device-to-host copy.

GEMM backends (`backend`):
  mosaic     jax's Pallas Mosaic-GPU grouped kernels (sm90 wgmma), vendored below
  interpret  the same kernels in Pallas' GPU interpret mode, on CPU (the tests)
  xla        `jax.lax.ragged_dot(_general)`: the reference; XLA lowers it densely (every row x every group)

Kernel contract, emulated by `xla` so CPU tests see it: rows past sum(group_sizes) of a grouped GEMM's output are
not written (garbage); the transposed kernel masks its input rows by multiplying, so garbage there (NaN x 0) would
leak into the weight gradients: every GEMM output is zeroed past the routed rows before it is used.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float, Int

from glm46_jax.parallel.sharding import cotangent_like

BACKENDS = ("mosaic", "interpret", "xla")
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)  # wgmma's 16-bit inputs
_BLOCK_K = 64  # 128-byte rows of 16-bit elements: the kernels' swizzle
_STAGES = 4  # pipelined K steps in shared memory: (128x64 + 64x128) x 2 B x 4 + the output tile < 227 KiB
_INTERPRET_SMS = 4  # simulated SMs in interpret mode: every SM is a thread of the simulation


def _tile(dim: int) -> int:
    return 128 if dim % 128 == 0 else 64


def kernel_supported(d: int, f: int, dtype, rows: int | None = None) -> bool:
    """Whether the Mosaic-GPU kernels take these shapes: 16-bit inputs, d and f (per shard) multiples of 64, and
    at least one 128-row tile of assignments (fewer, as in decoding, would load tiles larger than the array)."""
    return (jnp.dtype(dtype) in [jnp.dtype(t) for t in KERNEL_DTYPES] and d % 64 == 0 and f % 64 == 0
            and (rows is None or rows >= 128))


def kernel_device() -> bool:
    """The default device runs the kernels: an NVIDIA sm90 (Hopper) GPU (wgmma; Blackwell has no wgmma)."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9.")


# --- Kernels -----------------------------------------------------------------------------------------------------
# Adapted from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu / transposed_ragged_dot_mgpu (The JAX Authors,
# Apache-2.0, as jax itself; identical in jax 0.11.2 and 0.12.0.1), which are examples whose signatures fix the SM
# count (132, or the device's core_count, which a CPU device lacks) and take no interpret flag. Changed: those two
# became arguments, and the forward skips the K loop of tiles without routed rows (with experts sharded, other
# shards' rows would each cost a full tile), with `pl.when` around `emit_pipeline` inside the accumulator's scope,
# as the transposed kernel skips empty groups.

def _group_info(group_sizes, tile: int, tid):
    """The group and block of sorted rows that persistent tile `tid` computes (each group's tiles are numbered
    after the previous group's, so a block shared by two groups is computed once per group)."""
    tile = jnp.int32(tile)
    group_end = group_start = block = group = end = jnp.array(0, dtype=jnp.int32)
    for i in range(group_sizes.shape[0]):  # few groups: unrolled, selects instead of an early exit
        start = end
        end = start + group_sizes[i]
        start_block = lax.div(start, tile)
        final_block = lax.div(end - 1, tile)
        tid_begin = start_block + i
        tid_end = final_block + 1 + i
        this_is_group = (tid_begin <= tid) & (tid < tid_end)
        block = lax.select(this_is_group, tid - tid_begin + start_block, block)
        group = lax.select(this_is_group, jnp.int32(i), group)
        group_start = lax.select(this_is_group, start, group_start)
        group_end = lax.select(this_is_group, end, group_end)
    block_start = block * tile
    actual_start = jnp.maximum(group_start, block_start)
    actual_end = jnp.minimum(group_end, block_start + tile)
    return group, block, block_start, actual_start - block_start, actual_end - actual_start


def ragged_dot_kernel(lhs, rhs, group_sizes, *, transpose_rhs: bool = False, num_sms: int = 132,
                      interpret=None) -> jax.Array:
    """lhs [M, K] x rhs [G, K, N] ([G, N, K] with transpose_rhs) -> [M, N], rows grouped by `group_sizes`."""
    from jax.experimental.pallas import mosaic_gpu as plgpu  # here, not at the top: 0.3 s of every process's import

    m, k = lhs.shape
    g, k2, n = rhs.shape
    if transpose_rhs:
        k2, n = n, k2
    block_m, block_n, block_k = 128, _tile(n), _BLOCK_K
    if k != k2 or k % block_k or n % block_n:
        raise ValueError(f"ragged_dot_kernel: lhs {lhs.shape}, rhs {rhs.shape} do not fit tiles of {block_k}")

    def body(rows_per_expert_gmem, lhs_gmem, rhs_gmem, o_gmem):
        grid_m = pl.cdiv(m, block_m) + g - 1
        grid_n = pl.cdiv(n, block_n)

        @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
        def mn_loop(loop_info: plgpu.NDLoopInfo):
            mi, ni = plgpu.planar_snake(loop_info.index[0], (grid_m, grid_n), 1, 1)
            group, block, block_start, start_within_block, actual_size = _group_info(
                rows_per_expert_gmem, block_m, mi)

            def acc_scope(acc_ref):
                @pl.when(actual_size > 0)  # a tile without routed rows (other shards') skips the K loop
                def _():
                    plgpu.emit_pipeline(
                        lambda _, lhs_smem, rhs_smem: plgpu.wgmma(
                            acc_ref, lhs_smem, rhs_smem.transpose((1, 0)) if transpose_rhs else rhs_smem),
                        grid=(k // block_k,),
                        in_specs=[
                            plgpu.BlockSpec((block_m, block_k), lambda kk: (block, kk), delay_release=1),
                            plgpu.BlockSpec((block_n, block_k) if transpose_rhs else (block_k, block_n),
                                            lambda kk: (ni, kk) if transpose_rhs else (kk, ni), delay_release=1),
                        ],
                        max_concurrent_steps=_STAGES,
                    )(lhs_gmem, rhs_gmem.at[group])

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((block_m, block_n)))

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_m, block_n), dtype=o_gmem.dtype))
            def store_scope(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                # TMA stores need static row counts: a ladder of power-of-two stores writes the group's rows.
                smem_start = start_within_block
                remaining_rows = min(block_m, m)
                while remaining_rows > 0:
                    const_rows_len = 1 << int(math.log2(remaining_rows))
                    remaining_rows //= 2

                    @pl.when(actual_size & const_rows_len != 0)  # runs now: the loop variables are current
                    def _():
                        plgpu.copy_smem_to_gmem(
                            o_smem.at[pl.ds(smem_start, const_rows_len)],  # noqa: B023
                            o_gmem.at[pl.ds(block_start + smem_start, const_rows_len),  # noqa: B023
                                      pl.ds(ni * block_n, block_n)])

                    smem_start += actual_size & const_rows_len
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, n), lhs.dtype), grid=(num_sms,),
                          grid_names=("sm",), interpret=interpret,
                          compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return kernel(group_sizes, lhs, rhs)


def transposed_ragged_dot_kernel(lhs, rhs, group_sizes, *, num_sms: int = 132, interpret=None) -> jax.Array:
    """lhs [K, M] x rhs [K, N] -> [G, M, N]: out[g] = lhs[rows of g].T @ rhs[rows of g] (the weight gradients)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu  # as in ragged_dot_kernel

    k, m = lhs.shape
    k2, n = rhs.shape
    g = group_sizes.shape[0]
    block_m, block_n, block_k = _tile(m), _tile(n), _BLOCK_K
    if k != k2 or m % block_m or n % block_n:
        raise ValueError(f"transposed_ragged_dot_kernel: lhs {lhs.shape}, rhs {rhs.shape} do not fit the tiles")
    group_sizes = group_sizes.astype(jnp.int32)
    group_ends = jnp.cumsum(group_sizes)
    group_starts = group_ends - group_sizes
    group_block_starts = group_starts // block_k * block_k
    group_num_blocks = (-(group_ends // -block_k) * block_k - group_block_starts) // block_k
    swizzle = plgpu.find_swizzle(block_k * jnp.dtype(lhs.dtype).itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(lhs.dtype).itemsize)),
                  plgpu.SwizzleTransform(swizzle))

    def body(group_sizes_gmem, group_starts_gmem, group_ends_gmem, group_num_blocks_gmem, group_block_starts_gmem,
             lhs_gmem, rhs_gmem, o_gmem):
        grid_m = pl.cdiv(m, block_m)
        grid_n = pl.cdiv(n, block_n)

        @plgpu.nd_loop((g, grid_m * grid_n), collective_axes="sm")
        def mn_loop(loop_info: plgpu.NDLoopInfo):
            g_i = loop_info.index[0]
            m_i, n_i = plgpu.planar_snake(loop_info.index[1], (grid_m, grid_n), 1, 1)
            # Possibly out of bounds; the pipeline never reads past the group's blocks.
            gmem_slice = pl.ds(pl.multiple_of(group_block_starts_gmem[g_i], block_k), k)

            def acc_scope(acc_ref):
                def block_matmul(block_idx, lhs_smem, rhs_smem):
                    block_idx = block_idx[0]

                    def mask_rows(keep):  # zero the rows of a block that belong to a neighbouring group
                        rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (block_k, block_m), 0),
                                                 plgpu.Layout.WGMMA)
                        lhs_smem[...] = lhs_smem[...] * keep(rows).astype(lhs_smem.dtype)
                        plgpu.commit_smem()

                    @pl.when(block_idx == 0)
                    def _():
                        mask_rows(lambda r: r >= lax.rem(group_starts_gmem[g_i], block_k))

                    @pl.when(block_idx == group_num_blocks_gmem[g_i] - 1)
                    def _():
                        mask_rows(lambda r: r <= lax.rem(group_ends_gmem[g_i] - 1, block_k))

                    plgpu.wgmma(acc_ref, lhs_smem.transpose((1, 0)), rhs_smem)

                @pl.when(group_sizes_gmem[g_i] > 0)
                def _():
                    plgpu.emit_pipeline(
                        block_matmul,
                        grid=(group_num_blocks_gmem[g_i],),
                        in_specs=[plgpu.BlockSpec((block_k, block_m), lambda k_i: (k_i, m_i), delay_release=1,
                                                  transforms=transforms),
                                  plgpu.BlockSpec((block_k, block_n), lambda k_i: (k_i, n_i), delay_release=1,
                                                  transforms=transforms)],
                        max_concurrent_steps=_STAGES,
                    )(lhs_gmem.at[gmem_slice, :], rhs_gmem.at[gmem_slice, :])

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((block_m, block_n)))

            @functools.partial(pl.run_scoped,
                               o_smem=plgpu.SMEM((block_m, block_n), dtype=o_gmem.dtype, transforms=transforms))
            def store_scope(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem, o_gmem.at[g_i, pl.ds(m_i * block_m, block_m), pl.ds(n_i * block_n, block_n)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((g, m, n), lhs.dtype), grid=(num_sms,),
                          grid_names=("sm",), interpret=interpret,
                          compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return kernel(group_sizes, group_starts, group_ends, group_num_blocks, group_block_starts, lhs, rhs)


# --- Backends ----------------------------------------------------------------------------------------------------

def _interpret_params():
    from jax.experimental.pallas import mosaic_gpu as plgpu  # as in ragged_dot_kernel

    return plgpu.InterpretGPUParams()


def _kernel_args(backend: str) -> dict:
    if backend == "interpret":
        return {"num_sms": _INTERPRET_SMS, "interpret": _interpret_params()}
    return {"num_sms": getattr(jax.devices()[0], "core_count", None) or 132}


def _ragged(lhs, rhs, group_sizes, backend: str, transpose_rhs: bool = False):
    """Grouped GEMM, rows past sum(group_sizes) unspecified (the xla backend makes them NaN, as a kernel may)."""
    if backend != "xla":
        return ragged_dot_kernel(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, **_kernel_args(backend))
    out = lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs, group_sizes,
                         preferred_element_type=jnp.float32)
    routed = jnp.arange(lhs.shape[0])[:, None] < jnp.sum(group_sizes)
    return jnp.where(routed, out, jnp.nan).astype(lhs.dtype)


def _ragged_t(lhs, rhs, group_sizes, backend: str):
    """[G, M, N]: lhs[rows of g].T @ rhs[rows of g], accumulated in fp32, one rounding to lhs's dtype."""
    if backend != "xla":
        return transposed_ragged_dot_kernel(lhs, rhs, group_sizes, **_kernel_args(backend))
    dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
                                         rhs_group_dimensions=[])
    return lax.ragged_dot_general(lhs, rhs, group_sizes, dims, preferred_element_type=jnp.float32).astype(lhs.dtype)


# --- The grouped dropless experts -------------------------------------------------------------------------------

@struct.dataclass
class SortedLayout:
    """The n x k assignments sorted by local expert; other shards' assignments last, past sum(group_sizes)."""
    row: Int[Array, "n k"]  # each assignment's sorted row
    local: Bool[Array, "n k"]  # its expert is held here
    row_token: Int[Array, " a"]  # each sorted row's token
    row_assign: Int[Array, " a"]  # each sorted row's assignment (flat n * k index)
    group_sizes: Int[Array, " e"]


def sorted_layout(idx: Int[Array, "n k"], num_local: int, expert_offset: Array | int = 0) -> SortedLayout:
    n, k = idx.shape
    local_e = idx.reshape(-1) - expert_offset
    is_local = (local_e >= 0) & (local_e < num_local)
    flat_e = jnp.where(is_local, local_e, num_local)
    order = jnp.argsort(flat_e, stable=True).astype(jnp.int32)
    row = jnp.zeros(n * k, jnp.int32).at[order].set(jnp.arange(n * k, dtype=jnp.int32))
    group_sizes = jnp.bincount(flat_e, length=num_local + 1)[:num_local].astype(jnp.int32)
    return SortedLayout(row=row.reshape(n, k), local=is_local.reshape(n, k), row_token=order // k,
                        row_assign=order, group_sizes=group_sizes)


def tile_padding(group_sizes: Int[Array, " e"], tile: int = 128) -> Int[Array, ""]:
    """Rows the forward kernel computes beyond the routed ones: each group's tiles are whole tiles."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    tiles = jnp.where(group_sizes > 0, (ends - 1) // tile - starts // tile + 1, 0)
    return jnp.sum(tiles) * tile - jnp.sum(group_sizes)


@jax.named_scope("experts_grouped")
def grouped_dropless(x: Float[Array, "n d"], idx: Int[Array, "n k"], weights: Float[Array, "n k"],
                     w_gate_edf: Array, w_up_edf: Array, w_down_efd: Array, expert_offset: Array | int = 0,
                     backend: str = "mosaic") -> Float[Array, "n d"]:
    """Sum_j weights[:, j] * Expert_{idx[:, j]}(x) over the experts held here, as grouped GEMMs (module doc)."""
    if backend not in BACKENDS:
        raise ValueError(f"grouped_dropless: backend {backend!r} is not one of {BACKENDS}")
    dt = x.dtype
    layout = sorted_layout(idx, w_gate_edf.shape[0], expert_offset)
    w_nk = jnp.where(layout.local, weights.astype(jnp.float32), 0)
    y = _grouped_swiglu(x, w_gate_edf.astype(dt), w_up_edf.astype(dt), w_down_efd.astype(dt), w_nk, layout,
                        backend)
    return y.astype(dt)


def _combine(rows: Array, layout: SortedLayout, w_nk: Array) -> Float[Array, "n d"]:
    """sum_j where(local, w[:, j] * rows[row[:, j]], 0) in fp32, unrolled over k (one fused gather each)."""
    acc = None
    for j in range(layout.row.shape[1]):
        term = jnp.where(layout.local[:, j:j + 1], rows[layout.row[:, j]].astype(jnp.float32) * w_nk[:, j:j + 1], 0)
        acc = term if acc is None else acc + term
    return acc


def _routed(a: Array, layout: SortedLayout) -> Array:
    """Zero the rows past the routed ones (a kernel leaves them unwritten)."""
    routed = jnp.arange(a.shape[0])[:, None] < jnp.sum(layout.group_sizes)
    return jnp.where(routed, a, 0).astype(a.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _grouped_swiglu(x, wg, wu, wd, w_nk, layout: SortedLayout, backend: str):
    return _grouped_swiglu_fwd(x, wg, wu, wd, w_nk, layout, backend)[0]


def _grouped_swiglu_fwd(x, wg, wu, wd, w_nk, layout: SortedLayout, backend: str):
    gs = layout.group_sizes
    xs = x[layout.row_token]  # permute once
    gate = _routed(_ragged(xs, wg, gs, backend), layout)
    up = _routed(_ragged(xs, wu, gs, backend), layout)
    # gate and up are kept (2 [a, f] buffers) rather than recomputed: on a GPU two more GEMMs cost more. Named for
    # the save_matmuls remat policy, which keeps them: its backward then runs no forward GEMM again.
    gate, up = checkpoint_name(gate, "experts_gate_up"), checkpoint_name(up, "experts_gate_up")
    out = _ragged(jax.nn.silu(gate) * up, wd, gs, backend)
    return _combine(out, layout, w_nk), (x, wg, wu, wd, w_nk, gate, up, layout)


def _grouped_swiglu_bwd(backend, res, dy):
    x, wg, wu, wd, w_nk, gate, up, layout = res
    dt = x.dtype
    gs = layout.group_sizes
    xs = _routed(x[layout.row_token], layout)
    dy_s = _routed(dy[layout.row_token].astype(dt), layout)  # unweighted: the weight is applied in f-space
    w_s = w_nk.reshape(-1)[layout.row_assign][:, None]  # fp32, 0 for other shards' rows
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    h = silu * up
    dh_unweighted = _routed(_ragged(dy_s, wd, gs, backend, transpose_rhs=True), layout)
    # d/dw <dy, w * h @ Wd> = <dy @ Wd^T, h>: no expert output is kept.
    dw_row = jnp.sum(dh_unweighted.astype(jnp.float32) * h.astype(jnp.float32), axis=-1)
    dw_nk = jnp.where(layout.local, dw_row[layout.row], 0)
    dh = dh_unweighted * w_s
    dgate = (dh * up * (sig * (1 + gate * (1 - sig)))).astype(dt)
    dup = (dh * silu).astype(dt)
    # Gate and up side by side ([a, 2f] against [E, d, 2f]): dx is one GEMM summing both in fp32, and their weight
    # gradients one GEMM reading x's rows once.
    f = gate.shape[1]
    dgate_up = jnp.concatenate([dgate, dup], axis=-1)
    dx_s = _ragged(dgate_up, jnp.concatenate([wg, wu], axis=-1), gs, backend, transpose_rhs=True)
    dx = _combine(dx_s, layout, jnp.ones(w_nk.shape, jnp.float32)).astype(dt)
    dwgu = _ragged_t(xs, dgate_up, gs, backend)
    dwg, dwu = dwgu[..., :f], dwgu[..., f:]
    dwd = _ragged_t((h * w_s).astype(dt), dy_s, gs, backend)
    grads = [cotangent_like(ct, primal) for ct, primal in zip((dx, dwg, dwu, dwd, dw_nk), (x, wg, wu, wd, w_nk))]
    return (*grads, None)


_grouped_swiglu.defvjp(_grouped_swiglu_fwd, _grouped_swiglu_bwd)

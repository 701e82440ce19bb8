"""The grouped-GEMM dropless experts (model/grouped_gemm.py): the Mosaic-GPU kernels run in Pallas' GPU interpret
mode on CPU, forward and backward, against float64 NumPy and against the block loop (model/experts.py); the same
code through XLA's ragged_dot in fp32 on every routing and on expert-parallel meshes; the kernels lowered for CUDA.

The NumPy reference (`numpy_moe`, tests/test_experts.py) is independent of both implementations. The kernels take
16-bit inputs only: their cases round the inputs to bf16 first and feed the reference the rounded values, so what
remains is the kernels' bf16 intermediates (gate, up, h, outputs), bounded at 2% of each result's largest entry.
"""

import dataclasses
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_experts import _routing, numpy_moe

from glm46_jax.errors import InputError
from glm46_jax.config import TINY
from glm46_jax.model import abstract_model, apply, grouped_gemm, init_model
from glm46_jax.model.experts import dropless_experts, dropless_impl, dropless_stats
from glm46_jax.model.grouped_gemm import (
    grouped_dropless,
    ragged_dot_kernel,
    sorted_layout,
    tile_padding,
    transposed_ragged_dot_kernel,
)
from glm46_jax.model.moe import dispatch
from glm46_jax.parallel import sharding

INTERPRET = {"num_sms": 4, "interpret": grouped_gemm._interpret_params()}
# Group sizes of 80 sorted rows (the kernels' tiles: 128 rows forward, 64 rows per K step transposed): an empty
# expert at the start and in the middle, groups straddling tile edges, rows past the routed ones (other shards').
GROUPS = {"mixed": [0, 10, 0, 25, 37, 3], "one_group": [0, 0, 80, 0, 0, 0], "partial": [1, 64, 0, 0, 2, 0]}


def _bf16(rng, *shape, scale=1.0):
    return np.array(jnp.asarray(rng.normal(size=shape) * scale, jnp.bfloat16).astype(jnp.float32))


def _close(got, want, rel=2e-2, what=""):
    got = np.asarray(jnp.asarray(got, jnp.float32))
    assert np.isfinite(got).all(), what
    np.testing.assert_allclose(got, want, atol=rel * np.abs(want).max(), rtol=0, err_msg=what)


@pytest.mark.parametrize("groups", sorted(GROUPS))
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_ragged_dot_kernel_interpret_matches_float64(groups, transpose_rhs):
    rng = np.random.default_rng(0)
    gs = np.asarray(GROUPS[groups], np.int32)
    m, k, n = 80, 128, 64
    lhs, rhs = _bf16(rng, m, k), _bf16(rng, len(gs), k, n)
    routed = int(gs.sum())
    want = np.zeros((routed, n))
    for g, (s, e) in enumerate(zip(np.cumsum(gs) - gs, np.cumsum(gs))):
        want[s:e] = lhs[s:e].astype(np.float64) @ rhs[g]
    rhs_in = np.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    got = jax.jit(lambda a, b, g: ragged_dot_kernel(a, b, g, transpose_rhs=transpose_rhs, **INTERPRET))(
        jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs_in, jnp.bfloat16), jnp.asarray(gs))
    _close(got[:routed], want, rel=1e-2)  # rows past the routed ones are the kernel's garbage


@pytest.mark.parametrize("groups", sorted(GROUPS))
def test_transposed_ragged_dot_kernel_interpret_matches_float64(groups):
    rng = np.random.default_rng(1)
    gs = np.asarray(GROUPS[groups], np.int32)
    rows, m, n = 80, 64, 128
    lhs, rhs = _bf16(rng, rows, m), _bf16(rng, rows, n)
    routed = int(gs.sum())
    lhs[routed:], rhs[routed:] = 1e4, 1e4  # finite junk past the routed rows must not reach any group
    want = np.zeros((len(gs), m, n))
    for g, (s, e) in enumerate(zip(np.cumsum(gs) - gs, np.cumsum(gs))):
        want[g] = lhs[s:e].T.astype(np.float64) @ rhs[s:e]
    got = jax.jit(lambda a, b, g: transposed_ragged_dot_kernel(a, b, g, **INTERPRET))(
        jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16), jnp.asarray(gs))
    _close(got, want, rel=1e-2)
    assert not np.asarray(got[np.asarray(gs) == 0], np.float32).any()  # empty experts: zero gradient


def _problem(kind, seed, n=37, d=64, f=64, e=8, bf16=False):
    rng = np.random.default_rng(seed)
    idx = _routing(kind, n, e, rng).astype(np.int32)
    k = idx.shape[1]
    make = (lambda *s, scale=1.0: _bf16(rng, *s, scale=scale)) if bf16 else \
        (lambda *s, scale=1.0: (rng.normal(size=s) * scale).astype(np.float32))
    x, dy = make(n, d), make(n, d)
    w = rng.uniform(0.1, 1.0, size=(n, k)).astype(np.float32)
    wg, wu, wd = make(e, d, f, scale=0.2), make(e, d, f, scale=0.2), make(e, f, d, scale=0.2)
    return idx, x, w, wg, wu, wd, dy


def _value_and_grads(fn, idx, x, w, wg, wu, wd, dy, dtype):
    def loss(x, w, wg, wu, wd):
        y = fn(x.astype(dtype), jnp.asarray(idx), w, wg.astype(dtype), wu.astype(dtype), wd.astype(dtype))
        return jnp.vdot(y.astype(jnp.float32), jnp.asarray(dy)), y
    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=range(5), has_aux=True))(x, w, wg, wu, wd)
    return y, grads


# empty_expert with offset 3: experts 3..5 held here, expert 3 never chosen, most assignments another shard's.
@pytest.mark.parametrize("kind,offset,num_local", [("empty_expert", 3, 3), ("one_expert", 0, 8), ("k8", 0, 8)])
def test_grouped_kernels_interpret_forward_backward_match_float64_and_loop(kind, offset, num_local):
    idx, x, w, wg, wu, wd, dy = _problem(kind, 2, bf16=True)
    local = slice(offset, offset + num_local)
    y_ref, grads_ref = numpy_moe(x, idx, w, wg[local], wu[local], wd[local], dy, offset)
    args = (idx, x, w, wg[local], wu[local], wd[local], dy, jnp.bfloat16)
    y, grads = _value_and_grads(lambda *a: grouped_dropless(*a, offset, "interpret"), *args)
    y_loop, grads_loop = _value_and_grads(lambda *a: dropless_experts(*a, 16, offset, 1, "loop"), *args)
    _close(y, y_ref, what="y")
    _close(y, np.asarray(y_loop, np.float32), what="y vs loop")
    for name, got, want, loop in zip(("x", "weights", "w_gate", "w_up", "w_down"), grads, grads_ref, grads_loop):
        _close(got, want, what=f"d{name}")
        _close(got, np.asarray(jnp.asarray(loop, jnp.float32)), what=f"d{name} vs loop")


@pytest.mark.parametrize("kind", ["skewed", "empty_expert", "one_expert", "k1", "k8"])
@pytest.mark.parametrize("offset,num_local", [(0, 8), (3, 3)])
def test_grouped_path_fp32_matches_float64(kind, offset, num_local):
    """The permutation, the combine and the hand-written backward alone (XLA's ragged_dot, fp32), to 1e-5."""
    idx, x, w, wg, wu, wd, dy = _problem(kind, 3, d=12, f=6)
    local = slice(offset, offset + num_local)
    y_ref, grads_ref = numpy_moe(x, idx, w, wg[local], wu[local], wd[local], dy, offset)
    y, grads = _value_and_grads(lambda *a: dropless_experts(*a, 4, offset, 1, "grouped"), idx, x, w, wg[local],
                                wu[local], wd[local], dy, jnp.float32)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for name, got, want in zip(("x", "weights", "w_gate", "w_up", "w_down"), grads, grads_ref):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("shape,kind", [((1, 1, 8, 1), "allgather"), ((2, 2, 2, 1), "allgather"),
                                        ((1, 2, 4, 1), "alltoall")])
def test_expert_parallel_dispatch_grouped_matches_loop(shape, kind):
    """moe.dispatch's shard_map unchanged: the grouped path on expert- (and tensor-) sharded meshes, forward and
    every gradient, equals the loop."""
    cfg = dataclasses.replace(TINY, vocab_size=128, num_hidden_layers=2, moe_dispatch=kind)
    mesh = sharding.make_mesh(dict(zip(sharding.MESH_AXES, shape)), cfg=cfg, global_batch=8)
    idx, x, w, wg, wu, wd, dy = _problem("skewed", 4, n=32, d=cfg.hidden_size, f=cfg.moe_intermediate_size,
                                         e=cfg.n_routed_experts)

    def run(impl):
        c = dataclasses.replace(cfg, moe_impl=impl)

        def loss(x, w, wg, wu, wd):
            y, _, _ = dispatch(x, jnp.asarray(idx), w, wg, wu, wd, c)
            return jnp.vdot(y, jnp.asarray(dy))
        with sharding.use_mesh(mesh):
            return jax.jit(jax.value_and_grad(loss, argnums=range(5)))(x, w, wg, wu, wd)

    (v_grouped, g_grouped), (v_loop, g_loop) = run("grouped"), run("loop")
    np.testing.assert_allclose(v_grouped, v_loop, rtol=1e-5)
    for got, want in zip(g_grouped, g_loop):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


def test_expert_shards_of_the_interpreted_kernels_sum_to_float64():
    """What each of 2 expert shards computes (4 experts each, every other shard's rows sorted past its routed
    ones), forward and backward, summed over the shards, against float64. The shards run one after another: in a
    shard_map over 8 virtual CPU devices Pallas' GPU interpreter did not finish within 10 minutes here (cause not
    investigated); the shard_map around the grouped path is tested with XLA's GEMMs above."""
    idx, x, w, wg, wu, wd, dy = _problem("skewed", 5, n=16, bf16=True)
    y_ref, grads_ref = numpy_moe(x, idx, w, wg, wu, wd, dy)
    shard = jnp.asarray(np.stack([wg, wu, wd]).reshape(3, 2, 4, 64, 64), jnp.bfloat16)  # [gate|up|down, shard, ...]

    @jax.jit
    def run(offset, ws):  # one compile for every shard: the offset is traced, as in the shard_map
        def loss(x, w, wg, wu, wd):
            y = grouped_dropless(x.astype(jnp.bfloat16), jnp.asarray(idx), w, wg, wu, wd, offset, "interpret")
            return jnp.vdot(y.astype(jnp.float32), jnp.asarray(dy)), y
        return jax.value_and_grad(loss, argnums=range(5), has_aux=True)(x, w, *ws)

    y, dx, dw, shards_wg, shards_wu, shards_wd = 0, 0, 0, [], [], []
    for i in range(2):
        (_, y_s), (dx_s, dw_s, dwg, dwu, dwd) = run(4 * i, tuple(shard[:, i]))
        y, dx, dw = y + np.asarray(y_s, np.float32), dx + np.asarray(dx_s), dw + np.asarray(dw_s)
        shards_wg.append(dwg), shards_wu.append(dwu), shards_wd.append(dwd)
    _close(y, y_ref, what="y")
    for name, got, want in zip(("x", "weights", "w_gate", "w_up", "w_down"),
                               (dx, dw, *(np.concatenate(g) for g in (shards_wg, shards_wu, shards_wd))), grads_ref):
        _close(got, want, what=f"d{name}")


def test_kernels_lower_for_cuda_without_a_gpu():
    """The Mosaic-GPU kernels (not the interpreter) lower for CUDA at the small preset's expert shapes: forward and
    backward are 7 kernels, and nothing else is a custom call (no host callback)."""
    n, d, f, e, k = 256, 1024, 512, 64, 8
    s = jax.ShapeDtypeStruct

    def fwd_bwd(x, idx, w, wg, wu, wd):
        return jax.value_and_grad(lambda *a: jnp.sum(grouped_dropless(a[0], idx, *a[1:], 0, "mosaic")
                                                     .astype(jnp.float32)), argnums=(0, 1, 2, 3, 4))(x, w, wg, wu, wd)
    text = jax.jit(fwd_bwd).trace(s((n, d), jnp.bfloat16), s((n, k), jnp.int32), s((n, k), jnp.float32),
                                  s((e, d, f), jnp.bfloat16), s((e, d, f), jnp.bfloat16),
                                  s((e, f, d), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"stablehlo\.custom_call @(\w+)", text)
    # 3 forward GEMMs; backward: dy @ W_down^T, [dgate | dup] @ [W_gate | W_up]^T and 2 weight-gradient GEMMs.
    assert calls == ["mosaic_gpu_v2"] * 7, calls
    assert "stablehlo.while" not in text  # no data-dependent loop around them


def test_moe_dispatch_on_an_sm90_gpu_runs_the_kernels(monkeypatch):
    """model.moe_impl "auto" where the kernels run (pretended: the platform check answers yes) picks them inside
    moe.dispatch's shard_map; lowered for CUDA on a one-device mesh, forward and backward (the 7 kernels)."""
    monkeypatch.setattr(grouped_gemm, "kernel_device", lambda: True)
    cfg = dataclasses.replace(TINY, hidden_size=128, moe_intermediate_size=64, dtype="bfloat16")
    mesh = sharding.make_mesh({"data": 1, "tensor": 1, "expert": 1, "pipeline": 1}, jax.devices()[:1])
    idx, x, w, wg, wu, wd, _ = _problem("skewed", 6, n=96, d=128, f=64, e=cfg.n_routed_experts)  # 192 rows
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)

    def loss(x, w, wg, wu, wd):
        return jnp.sum(dispatch(x, jnp.asarray(idx), w, wg, wu, wd, cfg)[0].astype(jnp.float32))
    with sharding.use_mesh(mesh):
        text = jax.jit(jax.value_and_grad(loss, argnums=range(5))).trace(
            bf(x), w, bf(wg), bf(wu), bf(wd)).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"stablehlo\.custom_call @(\w+)", text) == ["mosaic_gpu_v2"] * 7
    assert "stablehlo.while" not in text


def test_impl_choice_and_stats():
    with pytest.raises(InputError, match="moe_impl.*auto.*loop.*grouped"):
        TINY.replace(moe_impl="megablox")
    assert dropless_impl("auto", jnp.bfloat16, 1024, 512) == "loop"  # no sm90 GPU here
    assert dropless_impl("grouped", jnp.float32, 12, 6) == "grouped"
    assert grouped_gemm.kernel_supported(1024, 512, jnp.bfloat16)
    assert not grouped_gemm.kernel_supported(1024, 512, jnp.float32)
    assert not grouped_gemm.kernel_supported(64, 32, jnp.bfloat16)
    assert not grouped_gemm.kernel_supported(1024, 512, jnp.bfloat16, rows=64)  # a decode step's few assignments
    # Experts 0..3 with loads 3, 0, 130, 1: tiles of 128 rows from row 0 -> e0 rows 0-2 in tile 0, e2 rows 3-132 in
    # tiles 0 and 1, e3 row 133 in tile 1: 4 tiles = 512 rows for 134 routed.
    idx = jnp.asarray([0] * 3 + [2] * 130 + [3], jnp.int32)[:, None]
    assert list(sorted_layout(idx, 4).group_sizes) == [3, 0, 130, 1]
    assert int(tile_padding(sorted_layout(idx, 4).group_sizes)) == 512 - 134
    stats = dropless_stats(idx, 4, 12, 6, jnp.float32, block=64, impl="grouped")
    assert stats["impl"] == "grouped" and int(stats["padded_rows"]) == 378 and int(stats["trips"]) == 0
    # The loop at block 64, group 2: e0 1 block, e2 3 blocks, e3 1 block = 5 blocks = 320 rows; 3 trips.
    stats = dropless_stats(idx, 4, 12, 6, jnp.float32, block=64, group=2, impl="loop")
    assert stats["impl"] == "loop" and int(stats["padded_rows"]) == 320 - 134 and int(stats["trips"]) == 3


def _model_kernel_calls(remat: str, monkeypatch, mesh_shape=None) -> Counter:
    """The tiny model's (d 128, f 64, bf16, moe_impl="grouped") loss gradient lowered for CUDA on this CPU machine,
    the kernels pretended runnable: its Mosaic-GPU calls, by kind, told apart by operand shapes (d != f)."""
    monkeypatch.setattr(grouped_gemm, "kernel_device", lambda: True)
    cfg = dataclasses.replace(TINY, vocab_size=128, hidden_size=128, moe_intermediate_size=64, dtype="bfloat16",
                              attention_impl="xla", moe_impl="grouped", remat=remat)
    mesh_shape = mesh_shape or {"data": 1}
    mesh = sharding.make_mesh(mesh_shape, jax.devices()[:int(np.prod(list(mesh_shape.values())))])
    graphdef, params, buffers = abstract_model(cfg, mesh)
    rows = jax.ShapeDtypeStruct((4, 32), jnp.int32)  # 128 tokens, top-2: >= one 128-row tile on every shard

    def loss(p, b, tokens):
        out = apply(graphdef, p, b, tokens)
        return out.logits.astype(jnp.float32).mean() + out.mtp_logits.astype(jnp.float32).mean()
    with sharding.use_mesh(mesh):
        text = jax.jit(jax.grad(loss)).trace(params, buffers, rows).lower(lowering_platforms=("cuda",)).as_text()
    d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts // mesh_shape.get("expert", 1)
    kinds = {(f"{d}xbf16", f"{e}x{d}x{f}xbf16"): "gate/up", (f"{f}xbf16", f"{e}x{f}x{d}xbf16"): "down",
             (f"{d}xbf16", f"{e}x{f}x{d}xbf16"): "dh", (f"{2 * f}xbf16", f"{e}x{d}x{2 * f}xbf16"): "dx"}
    calls = Counter()
    for line in text.splitlines():
        if "custom_call @mosaic_gpu" in line:
            operands = re.findall(r"tensor<([\dx]+\w+)>", line.split(" : ")[-1].split("->")[0])
            # lhs [rows, K] and rhs [E, K, N] of a grouped GEMM; the weight-gradient GEMMs take 7 operands
            key = (operands[-2].split("x", 1)[1], operands[-1]) if len(operands) == 3 else None
            calls[kinds.get(key, "weight grad" if len(operands) == 7 else "other")] += 1
    return calls


@pytest.mark.parametrize("remat, mesh_shape", [("none", None), ("save_matmuls", None), ("full", None),
                                               ("save_matmuls", {"data": 2, "expert": 2})])
def test_save_matmuls_runs_no_forward_grouped_gemm_again(monkeypatch, remat, mesh_shape):
    """One forward per MoE site (the MoE stack's scan body and the MTP layer): 2 gate/up and 1 down GEMMs each, and
    the backward's 4. save_matmuls keeps the grouped path's gate/up (and the MTP layer's routed output, which its
    final norm's backward reads), so its backward runs none of the forward GEMMs again; "full", which keeps none of
    them, re-runs gate and up at both sites and the MTP layer's down."""
    calls = _model_kernel_calls(remat, monkeypatch, mesh_shape)
    again = {"full": {"gate/up": 4, "down": 1}}.get(remat, {})
    assert calls == {"gate/up": 4 + again.get("gate/up", 0), "down": 2 + again.get("down", 0), "dh": 2, "dx": 2,
                     "weight grad": 4}, calls


def test_remat_policies_give_the_grouped_path_the_same_gradients(mesh1):
    """What the policies keep of the grouped path (gate/up, the MTP layer's routed output) is what the backward
    would have recomputed: the tiny model's gradients (XLA's GEMMs, fp32, MTP in the loss) agree across policies."""
    cfg = dataclasses.replace(TINY, vocab_size=128, moe_impl="grouped")
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 8)), jnp.int32)
    grads = []
    for remat in ("none", "full", "save_matmuls"):
        graphdef, params, buffers = init_model(cfg.replace(remat=remat), mesh1, seed=5)

        def loss(p, b, graphdef=graphdef):
            out = apply(graphdef, p, b, tokens)
            return out.logits.astype(jnp.float32).std() + out.mtp_logits.astype(jnp.float32).std()
        with sharding.use_mesh(mesh1):
            grads.append(jax.jit(jax.grad(loss))(params, buffers))
    for other in grads[1:]:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), grads[0], other)


def test_activation_estimate_counts_the_kept_gate_up():
    """The grouped path keeps gate and up (bf16, f = 32) for each of the 4 GEMM rows per token an allgather over 2
    expert shards hands a shard (2 shards x top-2), with none and save_matmuls, in the 2 scanned MoE layers and
    the MTP layer: 2 x 4 x 32 x 2 B = 512 B per token and layer more than the loop; not with full."""
    from glm46_jax.model.activations import activation_estimate
    mesh = {"data": 1, "tensor": 1, "expert": 2, "pipeline": 1, "context": 1}
    cfg = TINY.replace(dtype="bfloat16", moe_dispatch="allgather")
    assert (cfg.num_moe_layers, cfg.num_nextn_predict_layers, cfg.moe_intermediate_size) == (2, 1, 32)
    for remat, kept in (("none", 512), ("save_matmuls", 512), ("full", 0)):
        grouped, loop = (activation_estimate(cfg.replace(moe_impl=impl), mesh, 1, 64, remat)
                         for impl in ("grouped", "loop"))
        assert grouped.saved_layers - loop.saved_layers == 64 * 2 * kept, remat
        assert grouped.mtp - loop.mtp == 64 * kept, remat

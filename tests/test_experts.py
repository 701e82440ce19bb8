"""Dropless grouped experts (model/experts.py) against a float64 NumPy MoE, and their compiled FLOPs.

The reference is written independently of the JAX code: one assignment at a time, forward and the hand-derived
SwiGLU backward in float64. Routings cover the cases a block layout can get wrong: skewed loads, an expert with
no tokens, every token on one expert, k = 1 and k = E = 8, and experts held by another shard (expert_offset).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm46_jax.config import TINY
from glm46_jax.model import experts
from glm46_jax.model.experts import block_backward, block_forward, block_layout, dropless_experts, local_experts


def numpy_moe(x, idx, w, wg, wu, wd, dy, offset=0):
    """y = sum_j w[t, j] * SwiGLU_{idx[t, j]}(x[t]) over experts [offset, offset + E_local), and every gradient of
    <y, dy>, in float64, one assignment at a time."""
    x, w, wg, wu, wd, dy = (np.asarray(a, np.float64) for a in (x, w, wg, wu, wd, dy))
    n, k = idx.shape
    y = np.zeros_like(x)
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    dwg, dwu, dwd = np.zeros_like(wg), np.zeros_like(wu), np.zeros_like(wd)
    for t in range(n):
        for j in range(k):
            e = int(idx[t, j]) - offset
            if not 0 <= e < wg.shape[0]:
                continue
            gate, up = x[t] @ wg[e], x[t] @ wu[e]
            sig = 1 / (1 + np.exp(-gate))
            h = gate * sig * up
            out = h @ wd[e]
            y[t] += w[t, j] * out
            dw[t, j] = dy[t] @ out
            dh = w[t, j] * (wd[e] @ dy[t])
            dwd[e] += w[t, j] * np.outer(h, dy[t])
            dgate = dh * up * sig * (1 + gate * (1 - sig))
            dup = dh * gate * sig
            dwg[e] += np.outer(x[t], dgate)
            dwu[e] += np.outer(x[t], dup)
            dx[t] += wg[e] @ dgate + wu[e] @ dup
    return y, (dx, dw, dwg, dwu, dwd)


def _routing(kind: str, n: int, e: int, rng) -> np.ndarray:
    if kind == "skewed":  # expert 0 takes most first choices, expert e-1 almost none
        p = np.geomspace(1.0, 0.01, e)
        return np.stack([rng.choice(e, 2, replace=False, p=p / p.sum()) for _ in range(n)])
    if kind == "empty_expert":  # expert 3 never chosen
        return np.stack([rng.choice([i for i in range(e) if i != 3], 2, replace=False) for _ in range(n)])
    if kind == "one_expert":  # k = 1, every token on expert 2
        return np.full((n, 1), 2)
    if kind == "k1":
        return rng.integers(0, e, (n, 1))
    if kind == "k8":  # k = E: every token visits every expert
        return np.stack([rng.permutation(e) for _ in range(n)])
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["skewed", "empty_expert", "one_expert", "k1", "k8"])
# group 3: a loop step takes 3 blocks, which may belong to one expert (k8, one_expert) or to several that share
# tokens, and the used blocks rarely fill the last step.
@pytest.mark.parametrize("block,offset,num_local,group", [(4, 0, 8, 1), (16, 0, 8, 1), (4, 3, 3, 1), (4, 0, 8, 3),
                                                          (4, 3, 3, 3)])
def test_dropless_matches_float64_numpy(kind, block, offset, num_local, group):
    rng = np.random.default_rng(abs(hash((kind, block, offset))) % 2**32)
    n, d, f, e = 37, 12, 6, 8  # 37 tokens: no block size divides any group evenly by construction
    idx = _routing(kind, n, e, rng).astype(np.int32)
    k = idx.shape[1]
    x = rng.normal(size=(n, d)).astype(np.float32)
    w = rng.uniform(0.1, 1.0, size=(n, k)).astype(np.float32)
    wg, wu = (rng.normal(size=(e, d, f)).astype(np.float32) * 0.4 for _ in range(2))
    wd = rng.normal(size=(e, f, d)).astype(np.float32) * 0.4
    dy = rng.normal(size=(n, d)).astype(np.float32)
    local = slice(offset, offset + num_local)
    y_ref, grads_ref = numpy_moe(x, idx, w, wg[local], wu[local], wd[local], dy, offset)

    def loss(x, w, wg, wu, wd):
        y = dropless_experts(x, jnp.asarray(idx), w, wg, wu, wd, block, offset, group)
        return jnp.vdot(y, jnp.asarray(dy)), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=range(5), has_aux=True))(
        x, w, wg[local], wu[local], wd[local])
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for name, got, want in zip(("x", "weights", "w_gate", "w_up", "w_down"), grads, grads_ref):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5, err_msg=f"d{name}")


def test_layout_pads_each_expert_to_whole_blocks_and_counts_used_blocks():
    # Hand-made: experts 0..3, block 2. Loads: e0 = 3 (tokens 0, 1, 2), e1 = 0, e2 = 1 (token 3), e3 = 2 (4, 5).
    idx = jnp.asarray([[0], [0], [0], [2], [3], [3]], jnp.int32)
    lay = block_layout(idx, 4, 0, 2)
    # e0 -> rows 0-2 (+1 pad) = blocks 0-1, e2 -> row 4 (+1 pad) = block 2, e3 -> rows 6-7 = block 3.
    assert int(lay.used) == 4
    np.testing.assert_array_equal(lay.row[:, 0], [0, 1, 2, 4, 6, 7])
    np.testing.assert_array_equal(lay.block_expert[:4], [0, 0, 2, 3])
    np.testing.assert_array_equal(lay.row_token[:8], [0, 1, 2, 6, 3, 6, 4, 5])  # 6 = n: a zero row
    # The worst case (all 6 assignments on one expert) fits: 6 + 4 * (2 - 1) = 10 rows -> 5 blocks.
    assert lay.row_token.shape == (10,) and lay.block_expert.shape == (5,)


def test_other_shards_assignments_take_no_rows():
    idx = jnp.asarray([[0, 5], [6, 1], [7, 4]], jnp.int32)  # this shard holds experts 4..7
    lay = block_layout(idx, 4, 4, 4)
    np.testing.assert_array_equal(lay.local, [[False, True], [True, False], [True, True]])
    assert int(lay.used) == 4  # experts 4, 5, 6, 7 hold one assignment each: one block apiece


def _cost(fn, *args) -> float:
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


@pytest.mark.parametrize("group", [1, 4])
def test_dropless_compiled_flops_are_the_routed_flops_not_all_experts(group):
    """XLA's cost analysis counts a while loop's body once, so the executed FLOPs are the whole program's count
    plus (trips - 1) x the loop bodies', each body compiled on its own from the same functions the loops call."""
    rng = np.random.default_rng(0)
    n, d, f, e, k, block = 512, 64, 32, 16, 2, 16
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    w = jnp.asarray(rng.uniform(size=(n, k)), jnp.float32)
    wg = wu = jnp.asarray(rng.normal(size=(e, d, f)), jnp.float32)
    wd = jnp.asarray(rng.normal(size=(e, f, d)), jnp.float32)

    def fwd_bwd(x, w, wg, wu, wd):
        return jax.grad(lambda *a: jnp.sum(dropless_experts(a[0], jnp.asarray(idx), *a[1:], block, 0, group)),
                        argnums=range(5))(x, w, wg, wu, wd)

    # One loop step: a block (group 1) or `group` blocks, each against its own expert.
    shape = (block,) if group == 1 else (group, block)
    tokens, expert = jnp.zeros(shape, jnp.int32), jnp.zeros(shape[:-1], jnp.int32)
    body_fwd = _cost(block_forward, x, wg, wu, wd, tokens, expert)
    body_bwd = _cost(block_backward, x, x, jnp.zeros(shape), wg, wu, wd, tokens, expert)
    trips = -(-int(block_layout(jnp.asarray(idx), e, 0, block, group).used) // group)
    # Under grad the program runs the custom VJP's forward loop and its backward loop, once each.
    program = _cost(fwd_bwd, x, w, wg, wu, wd)
    executed = program + (trips - 1) * (body_fwd + body_bwd)
    routed = n * k * d * f * 2 * 3  # the three expert matmuls of every assignment, forward
    # Forward + backward: 3 matmuls forward, 6 backward, 2 recomputed (gate, up) = 11/3 x the forward.
    assert executed <= 1.3 * routed * 11 / 3, (executed, routed)
    assert executed >= routed * 11 / 3  # sanity: the count is not trivially small
    # The old path (capacity = every token) would run E/k = 8x the routed work.
    assert body_fwd == pytest.approx(group * block * d * f * 2 * 3, rel=0.05)


def test_local_experts_chooses_the_layout_from_the_config():
    rng = np.random.default_rng(1)
    n, d, f, e = 16, 8, 4, 8
    idx = jnp.asarray(np.stack([rng.choice(e, 2, replace=False) for _ in range(n)]), jnp.int32)
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    w = jnp.ones((n, 2), jnp.float32)
    wg = wu = jnp.asarray(rng.normal(size=(e, d, f)), jnp.float32)
    wd = jnp.asarray(rng.normal(size=(e, f, d)), jnp.float32)
    y, dropped = local_experts(x, idx, w, wg, wu, wd, dataclasses.replace(TINY, moe_capacity_factor=0.0))
    y_ref, _ = numpy_moe(x, np.asarray(idx), w, wg, wu, wd, np.zeros((n, d)))
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    assert int(dropped) == 0
    # Capacity 1 token per expert: the capacity path, which drops.
    tight = dataclasses.replace(TINY, moe_capacity_factor=0.25, n_routed_experts=e, num_experts_per_tok=2)
    assert experts.expert_capacity(n, tight) == 1
    _, dropped = local_experts(x, idx, w, wg, wu, wd, tight)
    assert int(dropped) > 0

"""Model pieces against independent references: a float64 NumPy MoE, hand-counted capacity drops,
packed rows vs documents alone, and the alternative attention / remat paths vs the reference path."""

import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm46_jax.parallel import sharding
from glm46_jax.config import TINY
from glm46_jax.model import abstract_model, apply, init_model

from conftest import jitted_apply
from glm46_jax.model.experts import grouped_experts

CFG = dataclasses.replace(TINY, vocab_size=128)


def _np_moe(x, w_router, bias, wg, wu, wd, sg, su, sd, cfg):
    """Float64 per-token loop of the MoE block (routing, group limit, weights, experts, shared expert),
    docs/architecture.md#moe-block."""
    x = x.astype(np.float64)
    out = np.zeros_like(x)
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    e, g = cfg.n_routed_experts, cfg.n_group
    for t in range(x.shape[0]):
        s = 1 / (1 + np.exp(-(x[t] @ w_router)))
        c = s + bias
        groups = c.reshape(g, e // g)
        gscore = np.sort(groups, -1)[:, -2:].sum(-1)
        kept = np.argsort(-gscore, kind="stable")[: cfg.topk_group]
        c = np.where(np.isin(np.arange(e) // (e // g), kept), c, -np.inf)
        idx = np.argsort(-c, kind="stable")[: cfg.num_experts_per_tok]
        w = s[idx] / (s[idx].sum() + 1e-20) * cfg.routed_scaling_factor
        for j, ex in zip(idx, w):
            out[t] += ex * ((silu(x[t] @ wg[j]) * (x[t] @ wu[j])) @ wd[j])
        out[t] += (silu(x[t] @ sg) * (x[t] @ su)) @ sd
    return out


def _moe_params(params, buffers, layer=0):
    moe = params["moe_layers"]["mlp"]
    get = lambda v: np.asarray(v.get_value())[layer].astype(np.float64)  # noqa: E731
    bias = np.asarray(buffers["moe_layers"]["mlp"]["e_score_correction_bias"].get_value())[layer]
    return (get(moe["router"]), bias.astype(np.float64), get(moe["gate_proj"]), get(moe["up_proj"]),
            get(moe["down_proj"]), get(moe["shared_experts"]["gate_proj"]),
            get(moe["shared_experts"]["up_proj"]), get(moe["shared_experts"]["down_proj"]))


def _randomize(params, buffers, seed=0, scale=0.3):
    """Larger-than-init weights and a non-zero correction bias so routing is non-trivial."""
    keys = iter(jax.random.split(jax.random.key(seed), 200))
    params = jax.tree.map(lambda p: p + scale * jax.random.normal(next(keys), p.shape, p.dtype), params)
    buffers = jax.tree.map(lambda b: 0.1 * jax.random.normal(next(keys), b.shape, b.dtype), buffers)
    return params, buffers


@pytest.mark.parametrize("n_group, topk_group", [(1, 1), (2, 1), (4, 2)])
def test_moe_layer_matches_float64_numpy(mesh1, n_group, topk_group):
    cfg = dataclasses.replace(CFG, n_group=n_group, topk_group=topk_group, num_experts_per_tok=2)
    graphdef, params, buffers = init_model(cfg, mesh1, seed=1)
    params, buffers = _randomize(params, buffers)
    model = nnx.merge(graphdef, params, buffers)
    moe = jax.tree.map(lambda a: a, model.moe_layers)  # first stacked layer, sliced below
    x = np.asarray(jax.random.normal(jax.random.key(2), (2, 16, cfg.hidden_size)), np.float32)
    g, st = nnx.split(moe)
    layer = nnx.merge(g, jax.tree.map(lambda a: a[0], st))
    with sharding.use_mesh(mesh1):
        y, aux = jax.jit(lambda m, x: m.mlp(x))(layer, jnp.asarray(x))
    want = _np_moe(x.reshape(-1, cfg.hidden_size), *_moe_params(params, buffers), cfg)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, cfg.hidden_size), want, atol=2e-5, rtol=1e-5)
    assert float(aux["dropped_frac"]) == 0.0
    assert int(aux["expert_load"].sum()) == 32 * cfg.num_experts_per_tok


def test_capacity_drops_match_hand_count():
    """Skewed routing: 10 tokens, k=2, every token picks expert 0 plus a second expert."""
    n, d, e, f, k = 10, 4, 4, 3, 2
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, d)).astype(np.float32)
    second = np.array([1, 1, 1, 1, 1, 2, 2, 3, 3, 3])
    idx = np.stack([np.zeros(n, int), second], 1).astype(np.int32)
    w = np.full((n, k), 0.5, np.float32)
    wg, wu = rng.normal(size=(2, e, d, f)).astype(np.float32)
    wd = rng.normal(size=(e, f, d)).astype(np.float32)
    capacity = 3
    y, dropped = grouped_experts(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w), wg, wu, wd, capacity)
    # expert 0: 10 assigned, keeps 3 (tokens 0-2); expert 1: 5 -> 3 (tokens 0-2); expert 2: 2; expert 3: 3.
    assert int(dropped) == 7 + 2
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    expert = lambda j, t: (silu(x[t] @ wg[j]) * (x[t] @ wu[j])) @ wd[j]  # noqa: E731
    kept = {0: [0, 1, 2], 1: [0, 1, 2], 2: [5, 6], 3: [7, 8, 9]}
    want = np.zeros((n, d))
    for j, tokens in kept.items():
        for t in tokens:
            want[t] += 0.5 * expert(j, t)
    np.testing.assert_allclose(np.asarray(y), want, atol=1e-5)
    y_big, dropped_big = grouped_experts(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w), wg, wu, wd, n)
    assert int(dropped_big) == 0
    # Expert parallel: a shard holding experts 2..3 computes only their (kept) assignments.
    y_shard, dropped_shard = grouped_experts(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w),
                                             wg[2:], wu[2:], wd[2:], capacity, expert_offset=2)
    want_shard = np.zeros((n, d))
    for j in (2, 3):
        for t in kept[j]:
            want_shard[t] += 0.5 * expert(j, t)
    np.testing.assert_allclose(np.asarray(y_shard), want_shard, atol=1e-5)
    assert int(dropped_shard) == 0


def _logits(mesh, graphdef, params, buffers, tokens, positions=None, segments=None, **kw):
    with sharding.use_mesh(mesh):
        return jitted_apply(graphdef, **kw)(params, buffers, tokens, positions, segments)


def test_packed_documents_do_not_attend_to_each_other(mesh1):
    graphdef, params, buffers = init_model(CFG, mesh1, seed=3)
    params, buffers = _randomize(params, buffers, seed=3)
    rng = np.random.default_rng(1)
    doc_a, doc_b = rng.integers(0, CFG.vocab_size, 9), rng.integers(0, CFG.vocab_size, 7)
    packed = jnp.asarray(np.concatenate([doc_a, doc_b])[None], jnp.int32)
    positions = jnp.asarray(np.concatenate([np.arange(9), np.arange(7)])[None], jnp.int32)
    segments = jnp.asarray(np.array([1] * 9 + [2] * 7)[None], jnp.int32)
    out = _logits(mesh1, graphdef, params, buffers, packed, positions, segments)
    alone_b = _logits(mesh1, graphdef, params, buffers, jnp.asarray(doc_b[None], jnp.int32))
    alone_a = _logits(mesh1, graphdef, params, buffers, jnp.asarray(doc_a[None], jnp.int32))
    np.testing.assert_allclose(out.logits[0, 9:], alone_b.logits[0], atol=2e-5)
    np.testing.assert_allclose(out.logits[0, :9], alone_a.logits[0], atol=2e-5)
    # MTP rows whose t+1 token is still inside the document are document-local too.
    np.testing.assert_allclose(out.mtp_logits[0, 9:15], alone_b.mtp_logits[0, :6], atol=2e-5)


@pytest.mark.parametrize("impl", ["dot_product"])
def test_attention_impls_agree(mesh1, impl):
    graphdef, params, buffers = init_model(CFG, mesh1, seed=4)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 12)), jnp.int32)
    segments = jnp.asarray(np.array([[1] * 5 + [2] * 7, [1] * 12]), jnp.int32)
    ref = _logits(mesh1, graphdef, params, buffers, tokens, None, segments)
    graphdef2, _, _ = init_model(dataclasses.replace(CFG, attention_impl=impl), mesh1, seed=4)
    out = _logits(mesh1, graphdef2, params, buffers, tokens, None, segments)
    np.testing.assert_allclose(out.logits, ref.logits, atol=1e-5)


def test_remat_policies_give_the_same_gradients(mesh1):
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, CFG.vocab_size, (2, 8)), jnp.int32)
    grads = []
    for remat in ("none", "full", "save_matmuls"):
        graphdef, params, buffers = init_model(dataclasses.replace(CFG, remat=remat), mesh1, seed=5)

        def loss(p, b, graphdef=graphdef):
            return apply(graphdef, p, b, tokens).logits.astype(jnp.float32).std()
        with sharding.use_mesh(mesh1):
            grads.append(jax.jit(jax.grad(loss))(params, buffers))
    for other in grads[1:]:
        chex.assert_trees_all_close(grads[0], other, rtol=1e-7, atol=1e-6)  # rtol: numpy's default, as before


def test_bf16_compute_tracks_fp32(mesh1):
    graphdef, params, buffers = init_model(CFG, mesh1, seed=6)
    graphdef16, _, _ = init_model(dataclasses.replace(CFG, dtype="bfloat16"), mesh1, seed=6)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, CFG.vocab_size, (2, 12)), jnp.int32)
    ref = _logits(mesh1, graphdef, params, buffers, tokens)
    out = _logits(mesh1, graphdef16, params, buffers, tokens)
    assert out.logits.dtype == jnp.bfloat16
    assert params["lm_head"].get_value().dtype == jnp.float32  # master weights stay fp32
    err = np.abs(np.asarray(out.logits, np.float32) - np.asarray(ref.logits)).max()
    assert err < 0.05 * np.abs(np.asarray(ref.logits)).max()


@pytest.mark.parametrize("capacity, offset", [(24, 0), (5, 0), (24, 3)])
def test_grouped_experts_gradients_match_naive_autodiff(capacity, offset):
    """The grouped matmul (custom VJP) against plain autodiff of a dense every-expert formulation."""
    n, d, e_all, f, k = 24, 8, 6, 5, 2
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    idx = np.stack([rng.choice(e_all, k, replace=False) for _ in range(n)]).astype(np.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, size=(n, k)), jnp.float32)
    e_local = e_all - offset
    wg, wu = (jnp.asarray(rng.normal(size=(e_local, d, f)) * 0.3, jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.normal(size=(e_local, f, d)) * 0.3, jnp.float32)
    # Which assignments survive: hand rule "earlier tokens win", per local expert.
    seen, kept = np.zeros(e_all, int), np.zeros((n, k), bool)
    for t in range(n):
        for j in range(k):
            ex = idx[t, j]
            if ex >= offset:
                kept[t, j] = seen[ex] < capacity
                seen[ex] += 1
    g = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)

    def naive(x, w, wg, wu, wd):
        y_ned = jnp.einsum("nef,efd->ned", jax.nn.silu(jnp.einsum("nd,edf->nef", x, wg))
                           * jnp.einsum("nd,edf->nef", x, wu), wd)  # every token through every expert
        onehot = jax.nn.one_hot(idx - offset, e_local) * (w * kept)[..., None]  # [n, k, e]
        return jnp.sum(jnp.einsum("nke,ned->nd", onehot, y_ned) * g)

    def grouped(x, w, wg, wu, wd):
        y, _ = grouped_experts(x, jnp.asarray(idx), w, wg, wu, wd, capacity, expert_offset=offset)
        return jnp.sum(y * g)

    args = (x, w, wg, wu, wd)
    np.testing.assert_allclose(grouped(*args), naive(*args), rtol=1e-5)
    chex.assert_trees_all_close(jax.grad(grouped, argnums=range(5))(*args), jax.grad(naive, argnums=range(5))(*args),
                                rtol=1e-4, atol=1e-5)


def test_named_scopes_reach_the_program(mesh1):
    """A GPU profile groups ops by `jax.named_scope`: the scopes must be in the lowered program's op names,
    nested as the model nests them (the MTP layer is a whole MoE decoder layer of its own)."""
    graphdef, params, buffers = abstract_model(CFG, mesh1)
    with sharding.use_mesh(mesh1):
        lowered = jax.jit(lambda p, b, t: apply(graphdef, p, b, t)).lower(
            params, buffers, jax.ShapeDtypeStruct((2, 8), jnp.int32))
    # Op locations look like loc("jit(<lambda>)/moe_layers/while/body/.../moe/router/dot_general"); file
    # names (attention.py) are locations too, so only the jit(...)-rooted op paths count.
    ops = [name.split("/") for name in re.findall(r'loc\("(jit\([^"]*)"', lowered.as_text(debug_info=True))]

    def has(*scopes):  # some op path holds `scopes` as consecutive components
        n = len(scopes)
        return any(path[i:i + n] == list(scopes) for path in ops for i in range(len(path)))

    assert has("dense_layers") and has("moe_layers") and has("mtp", "moe") and has("lm_head")
    assert has("attention") and has("mlp")
    assert has("moe", "router") and has("moe", "moe_dispatch") and has("moe", "shared_expert")
    assert has("moe_dispatch", "experts")  # the grouped matmul runs inside the dispatch's shard_map
    assert not has("no_such_scope")

"""SPMD on 8 virtual CPU devices: every mesh and dispatch strategy against the single-device run,
parameter/gradient layouts against the rule table, capacity drops, and mesh validation errors."""

import dataclasses
import functools
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import FIXTURES
from glm46_jax.parallel import sharding
from glm46_jax.errors import InputError
from glm46_jax.config import TINY
from glm46_jax.interop.hf import load_hf, read_config
from glm46_jax.model import abstract_model, apply, init_model
from glm46_jax.model.moe import dispatch

P = jax.P
CFG = dataclasses.replace(TINY, vocab_size=128, num_hidden_layers=2)  # 1 dense + 1 MoE + MTP: every layer kind
CFG16 = dataclasses.replace(CFG, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
MESHES = [(8, 1, 1, 1), (2, 2, 2, 1), (1, 2, 4, 1), (2, 1, 4, 1), (1, 4, 2, 1)]
BATCH = 8


def _mesh(shape, cfg=CFG):
    return sharding.make_mesh(dict(zip(sharding.MESH_AXES, shape)), cfg=cfg, global_batch=BATCH)


def _loss(graphdef):
    def f(params, buffers, tokens):
        out = apply(graphdef, params, buffers, tokens)
        z = out.logits.astype(jnp.float32)
        return jnp.mean(z * z) + jnp.mean(out.mtp_logits.astype(jnp.float32) ** 2), out.logits
    return jax.value_and_grad(f, has_aux=True)


def _run(cfg, mesh, params, buffers, tokens):
    graphdef, abs_params, abs_buffers = abstract_model(cfg, mesh)
    put = lambda tree, like: jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), tree, like)  # noqa: E731
    tokens = jax.device_put(tokens, jax.NamedSharding(mesh, sharding.logical("batch", "seq")))
    with sharding.use_mesh(mesh):
        (_, logits), grads = jax.jit(_loss(graphdef))(put(params, abs_params), put(buffers, abs_buffers), tokens)
    return logits, grads


_REFERENCE = {}


def _reference(cfg, mesh1):
    """The single-device run every mesh is compared with (computed once per config)."""
    if cfg not in _REFERENCE:
        graphdef, params, buffers = init_model(cfg, mesh1, seed=0)
        keys = iter(jax.random.split(jax.random.key(1), 100))  # non-zero bias: routing is biased
        buffers = jax.tree.map(lambda b: 0.05 * jax.random.normal(next(keys), b.shape), buffers)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (BATCH, 16)), jnp.int32)
        _REFERENCE[cfg] = (params, buffers, tokens, *_run(cfg, mesh1, params, buffers, tokens))
    return _REFERENCE[cfg]


def _assert_same(ref_logits, ref_grads, logits, grads):
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-5,
                               atol=1e-5 * float(np.abs(np.asarray(ref_logits)).max()))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads)):
        a, b = np.asarray(a), np.asarray(b)
        scale = float(np.abs(a).max()) or 1.0
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
@pytest.mark.parametrize("dispatch_kind", ["allgather", "alltoall"])
@pytest.mark.parametrize("shape", MESHES)
def test_mesh_matches_single_device(shape, dispatch_kind, mesh1):
    params, buffers, tokens, ref_logits, ref_grads = _reference(CFG, mesh1)
    cfg = dataclasses.replace(CFG, moe_dispatch=dispatch_kind)
    logits, grads = _run(cfg, _mesh(shape, cfg), params, buffers, tokens)
    _assert_same(ref_logits, ref_grads, logits, grads)


@pytest.mark.slow
@pytest.mark.parametrize("dispatch_kind", ["allgather", "alltoall"])
@pytest.mark.parametrize("shape", [(2, 1, 4, 1), (1, 2, 4, 1)])
def test_sixteen_experts_match_single_device(shape, dispatch_kind, mesh1):
    params, buffers, tokens, ref_logits, ref_grads = _reference(CFG16, mesh1)
    cfg = dataclasses.replace(CFG16, moe_dispatch=dispatch_kind)
    logits, grads = _run(cfg, _mesh(shape, cfg), params, buffers, tokens)
    _assert_same(ref_logits, ref_grads, logits, grads)


# Expected layouts on (data=2, tensor=2, expert=2), written out by hand from the rule table:
# FSDP over data through the model dim, heads / FFN / vocab over tensor, experts over expert.
EXPECTED_SPECS = {
    "embed_tokens": P("tensor", "data"),
    "lm_head": P("data", "tensor"),
    "norm/weight": P(None),
    "dense_layers/self_attn/q_proj": P(None, "data", "tensor", None),
    "dense_layers/self_attn/k_proj": P(None, "data", "tensor", None),
    "dense_layers/self_attn/o_proj": P(None, "tensor", None, "data"),
    "dense_layers/self_attn/q_bias": P(None, "tensor", None),
    "dense_layers/self_attn/q_norm/weight": P(None, None),
    "dense_layers/mlp/gate_proj": P(None, "data", "tensor"),
    "dense_layers/mlp/down_proj": P(None, "tensor", "data"),
    "moe_layers/mlp/router": P(None, "data", None),
    "moe_layers/mlp/gate_proj": P(None, "expert", "data", "tensor"),
    "moe_layers/mlp/down_proj": P(None, "expert", "tensor", "data"),
    "moe_layers/mlp/shared_experts/up_proj": P(None, "data", "tensor"),
    "mtp/eh_proj": P(None, "data"),
    "mtp/block/mlp/gate_proj": P("expert", "data", "tensor"),
    "mtp/block/self_attn/v_proj": P("data", "tensor", None),
}


def _specs(tree):
    return {"/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)): x.sharding.spec
            for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_parameters_are_created_sharded_and_grads_keep_the_layout():
    mesh = _mesh((2, 2, 2, 1))
    graphdef, params, buffers = init_model(CFG, mesh, seed=0)
    got = _specs(params)
    for name, spec in EXPECTED_SPECS.items():
        assert got[name] == spec, f"{name}: {got[name]} != {spec}"
    assert _specs(buffers)["moe_layers/mlp/e_score_correction_bias"] == P(None, None)
    # A shard of the expert weights holds 4 experts' halves, not the whole tensor.
    w = params["moe_layers"]["mlp"]["gate_proj"].get_value()
    chex.assert_shape(w.addressable_shards[0].data, (1, 4, 32, 16))
    tokens = jax.device_put(jnp.zeros((BATCH, 16), jnp.int32), jax.NamedSharding(mesh, sharding.logical("batch", "seq")))
    with sharding.use_mesh(mesh):
        _, grads = jax.jit(_loss(graphdef))(params, buffers, tokens)
    assert _specs(grads) == got


def _dispatch(mesh, cfg, idx, n_tokens):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(n_tokens, cfg.hidden_size)), jnp.float32)
    w = jnp.full(idx.shape, 0.5, jnp.float32)
    e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    wg, wu = (jnp.asarray(rng.normal(size=(e, d, f)) * 0.1, jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.normal(size=(e, f, d)) * 0.1, jnp.float32)
    with sharding.use_mesh(mesh):
        return jax.jit(lambda *a: dispatch(*a, cfg))(x, jnp.asarray(idx, jnp.int32), w, wg, wu, wd)


def test_capacity_drops_match_hand_count():
    """16 tokens, k=2, every token routed to experts 0 and 1, mesh data=2 x expert=4 (2 experts/shard)."""
    mesh = _mesh((2, 1, 4, 1))
    idx = np.tile([0, 1], (16, 1))
    tight = dict(moe_capacity_factor=1.0)
    # allgather: a data group gathers 8 tokens; capacity ceil(1.0 * 8 * 2 / 8) = 2 per expert, so
    # experts 0 and 1 each keep 2 of 8: 12 of 16 assignments dropped per group, 24 of 32 overall.
    _, dropped, load = _dispatch(mesh, dataclasses.replace(CFG, moe_dispatch="allgather", **tight), idx, 16)
    assert float(dropped) == 24 / 32
    np.testing.assert_array_equal(load, [16, 16, 0, 0, 0, 0, 0, 0])
    # alltoall: 2 tokens per device = 4 assignments, all for shard 0; send capacity
    # ceil(1.0 * 2 * 2 / 4) = 1, so 3 stay home (24 over 8 devices). Shard 0 of each data group
    # receives 4 (each device's first: token 0 -> expert 0); receive capacity ceil(8 * 2 / 8) = 2
    # per expert keeps 2 of them: 2 more dropped per group. 28 of 32.
    _, dropped, _ = _dispatch(mesh, dataclasses.replace(CFG, moe_dispatch="alltoall", **tight), idx, 16)
    assert float(dropped) == 28 / 32
    for kind in ("allgather", "alltoall"):
        _, dropped, _ = _dispatch(mesh, dataclasses.replace(CFG, moe_dispatch=kind, moe_capacity_factor=8.0),
                                  idx, 16)
        assert float(dropped) == 0.0


def test_capacity_output_matches_hand_computed_survivors():
    """With capacity, the allgather output equals the experts of exactly the surviving assignments."""
    mesh = _mesh((1, 1, 8, 1))
    cfg = dataclasses.replace(CFG, moe_dispatch="allgather", moe_capacity_factor=1.0)
    idx = np.stack([np.zeros(16, int), 1 + np.arange(16) % 7], 1)  # expert 0 oversubscribed
    y, dropped, _ = _dispatch(mesh, cfg, idx, 16)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, cfg.hidden_size))
    e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    wg, wu = rng.normal(size=(e, d, f)) * 0.1, rng.normal(size=(e, d, f)) * 0.1
    wd = rng.normal(size=(e, f, d)) * 0.1
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    capacity = 4  # ceil(1.0 * 16 tokens * 2 / 8 experts); earlier tokens win
    seen = np.zeros(e, int)
    want = np.zeros_like(x)
    for t in range(16):
        for j in idx[t]:
            if seen[j] < capacity:
                want[t] += 0.5 * ((silu(x[t] @ wg[j]) * (x[t] @ wu[j])) @ wd[j])
            seen[j] += 1
    np.testing.assert_allclose(np.asarray(y), want, atol=1e-5)
    assert float(dropped) == (16 - capacity) / 32


@pytest.mark.parametrize("shape, cfg, batch, message", [
    ({"data": 3}, CFG, None, r"multiplies to 3 devices but there are 8; make the mesh\.\* sizes multiply to 8"),
    ({"data": 2, "expert": 3, "tensor": -1}, CFG, None, "mesh.tensor=-1 .* fixed axes multiply to 6"),
    ({"data": -1, "expert": -1}, CFG, None, "mesh.data=-1 and mesh.expert=-1: only one axis may be -1"),
    ({"data": 8, "tensor": 0}, CFG, None, "mesh.tensor=0: an axis size must be >= 1"),
    ({"data": 8, "model": 1}, CFG, None, "mesh.model: unknown mesh axis; the axes are data, tensor, expert"),
    ({"data": "eight"}, CFG, None, "mesh.data='eight': expected an integer size"),
    ({"data": 1, "expert": 8}, dataclasses.replace(CFG, n_routed_experts=12, n_group=1, topk_group=1),
     None, r"n_routed_experts=12 is not divisible by the expert mesh size 8 \(mesh.expert=8\); choose a mesh.expert"),
    # Fewer KV heads than tensor devices are copied (4 over tensor 8 is fine), but one must divide the other.
    ({"data": 2, "tensor": 4}, dataclasses.replace(CFG, num_attention_heads=12, num_key_value_heads=6), None,
     r"num_key_value_heads=6 is not divisible by the tensor mesh size 4 \(mesh.tensor=4\), nor does it divide it"),
    ({"data": 2, "tensor": 4}, dataclasses.replace(CFG, num_attention_heads=6, num_key_value_heads=2), None,
     "num_attention_heads=6 is not divisible by the tensor mesh size 4"),
    ({"data": 2, "tensor": 4}, dataclasses.replace(CFG, intermediate_size=130), None,
     "intermediate_size=130 is not divisible"),
    ({"data": 2, "tensor": 4}, dataclasses.replace(CFG, moe_intermediate_size=30), None,
     "moe_intermediate_size=30 is not divisible"),
    ({"data": 2, "tensor": 4}, dataclasses.replace(CFG, vocab_size=130), None, "vocab_size=130 is not divisible"),
    ({"data": 4, "expert": 2}, CFG, 12,
     r"global_batch=12 is not divisible by the data x expert mesh size 8 \(mesh.data=4 x mesh.expert=2\)"),
    # Pipeline stages (docs/pipeline.md): every stage must hold a layer; micro-batches must fit the schedule.
    ({"data": 4, "pipeline": 2}, CFG.replace(num_hidden_layers=2), None,
     r"the model has 1 MoE layers .* fewer than stages x repeats"),
    ({"data": 4, "pipeline": 2}, CFG.replace(num_hidden_layers=9, pipeline_repeats=2, pipeline_microbatches=1), None,
     r"pipeline_microbatches=1: the circular schedule .* at least as many micro-batches as stages"),
    ({"data": 2, "expert": 2, "pipeline": 2}, CFG.replace(num_hidden_layers=3, pipeline_microbatches=4), 8,
     r"global_batch=8: each of the data x expert = 4 batch shards .* a multiple of 16"),
    ({"data": 2, "expert": 2, "pipeline": 2}, CFG.replace(num_hidden_layers=3, pipeline_microbatches=1), 4,
     r"global_batch=4 is not divisible by the data x expert x pipeline mesh size 8"),
])
def test_invalid_meshes_say_what_to_change(shape, cfg, batch, message):
    # InputError: the CLIs print it as one `error:` line (exit 2) instead of a traceback.
    with pytest.raises(InputError, match=message):
        sharding.make_mesh(shape, cfg=cfg, global_batch=batch)


def test_ragged_alltoall_is_refused_clearly():
    with pytest.raises(ValueError, match=r"moe_dispatch\W+'ragged_alltoall'.*\(a ragged all-to-all needs a GPU/TPU"):
        dataclasses.replace(CFG, moe_dispatch="ragged_alltoall")


def test_init_on_a_mesh_equals_single_device_init(mesh1):
    _, p1, _ = init_model(CFG, mesh1, seed=3)
    _, p8, _ = init_model(CFG, _mesh((2, 2, 2, 1)), seed=3)
    # The same random bits on both (the key is split the same way); the normal transform is compiled into
    # differently partitioned programs, and on some CPUs (seen on AVX-512) rounds 1 element of 512 one ulp
    # apart. A wrong key or layout would differ everywhere by O(initializer_range).
    chex.assert_trees_all_close(p8, p1, rtol=1e-6, atol=0)
    assert isinstance(p8, nnx.State)


def test_one_kv_head_train_step_on_tensor_2_matches_one_device(mesh1):
    """MQA (the hf_mqa fixture, issue 27) on (data 2, tensor 2, expert 2): the k/v weights are replicated over
    `tensor`, the KV head copied to both tensor devices (in the KV cache too); a train step equals one device's.

    SGD, so the update is the gradient itself: Adam would divide rounding noise in the router's gradient (only the
    aux loss's ~5e-6 with top-1 routing, whose normalised combine weight is constant) by that gradient's own size."""
    import optax

    from glm46_jax.model.transformer import GenerationCache
    from glm46_jax.training.step import controls, init_state, make_train_step

    d = os.path.join(FIXTURES, "hf_mqa")
    x = np.random.default_rng(0).integers(0, 128, (4, 17)).astype(np.int32)
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:]}
    mesh = sharding.make_mesh({"data": 2, "tensor": 2, "expert": 2}, cfg=read_config(d), global_batch=4)
    tx = optax.sgd(0.5)
    results = {}
    for name, m in (("one", mesh1), ("mesh", mesh)):
        cfg, graphdef, params, buffers = load_hf(d, m)
        layout = jax.NamedSharding(m, sharding.logical("batch", "seq"))
        with sharding.use_mesh(m):
            state = init_state(params, buffers, tx)
            step = make_train_step(graphdef, tx, cfg)
            state, metrics = step(state, {k: jax.device_put(v, layout) for k, v in batch.items()}, controls(0.3, 1e-2))
            cache = jax.eval_shape(functools.partial(GenerationCache.zeros, cfg, 4, 8))
        # By path: the k/v weights' logical names differ between the meshes (replicated where tensor > 1 KV head).
        results[name] = jax.device_get((metrics, *({jax.tree_util.keystr(path): leaf for path, leaf in
                                                    jax.tree_util.tree_leaves_with_path(tree)}
                                                   for tree in (state.params, state.buffers))))
    specs = _specs(state.params)
    assert specs["dense_layers/self_attn/k_proj"] == P(None, "data", None, None)
    assert specs["mtp/block/self_attn/v_bias"] == P(None, None)
    assert specs["dense_layers/self_attn/q_proj"] == P(None, "data", "tensor", None)
    assert cache.moe.k.shape[3] == 2 and cache.moe.k.sharding.spec[3] == "tensor"
    keys = ("loss", "ce", "mtp_ce", "aux_loss", "grad_norm", "load_cv")
    chex.assert_trees_all_close({k: results["mesh"][0][k] for k in keys}, {k: results["one"][0][k] for k in keys},
                                rtol=1e-5, atol=0)
    chex.assert_trees_all_close(results["mesh"][1:], results["one"][1:], atol=1e-6, rtol=0)

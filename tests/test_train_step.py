"""The train step: loss-free balancing against a hand-computed sign rule, gradient accumulation
against one big batch, a (2,2,2,1)-sharded step against one device, the non-finite skip, a
learnable task with Muon, and the expert-load CV with balancing on and off."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm46_jax.training import balancing
from glm46_jax.parallel import sharding
from glm46_jax.config import get_preset
from glm46_jax.training.loss import loss_fn
from glm46_jax.model import init_model
from glm46_jax.training.optim import OptimConfig, build_optimizer
from glm46_jax.training.step import StepConfig, controls, init_state, make_train_step

CFG = get_preset("tiny")
OPTIM = OptimConfig(lr=1e-2, end_lr=1e-3, warmup_steps=0, decay_steps=100)
B, S = 8, 32


def _batch(seed: int, b: int = B, s: int = S) -> dict[str, np.ndarray]:
    x = np.random.default_rng(seed).integers(2, CFG.vocab_size, (b, s + 1)).astype(np.int32)
    return {"inputs": x[:, :-1], "targets": x[:, 1:]}


def _put(batch, mesh, *leading):
    layout = jax.NamedSharding(mesh, sharding.logical(*leading, "batch", "seq"))
    return {k: jax.device_put(v, layout) for k, v in batch.items()}


def _fresh(mesh, seed=0, step_cfg=StepConfig(), optim=OPTIM):
    """(state, jitted step) for a new model: the step donates its state, so every test gets its own."""
    graphdef, params, buffers = init_model(CFG, mesh, seed)
    tx, schedule = build_optimizer(optim, params)
    with sharding.use_mesh(mesh):
        state = init_state(params, buffers, tx)
    return graphdef, state, make_train_step(graphdef, tx, CFG, step_cfg, lr_schedule=schedule)


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _leaves(tree):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


# --- loss-free balancing --------------------------------------------------------------------

def test_bias_update_is_the_sign_rule():
    bias = jnp.array([[0.0, 0.1, -0.2, 0.3], [0.0, 0.0, 0.0, 0.0]])
    load = jnp.array([[10, 2, 6, 6], [5, 5, 5, 5]])  # layer 0: mean 6; layer 1: balanced
    got = np.asarray(balancing.bias_update(bias, load, 0.01))
    want = np.array([[0.0 - 0.01, 0.1 + 0.01, -0.2, 0.3], [0, 0, 0, 0]])  # over -> down, under -> up, at mean -> 0
    np.testing.assert_allclose(got, want, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(balancing.bias_update(bias, load, 0.0)), np.asarray(bias))


def test_update_buffers_routes_each_layer_its_load(mesh1):
    _, _, buffers = init_model(CFG, mesh1, 0)
    loads = {"expert_load": jnp.array([[9, 1, 1, 1, 1, 1, 1, 1], [1] * 7 + [0]]),
             "mtp_expert_load": jnp.array([0, 2, 2, 2, 2, 2, 2, 2])}
    new = balancing.update_buffers(buffers, loads, 0.5)
    trunk = np.asarray(new["moe_layers"]["mlp"]["e_score_correction_bias"][...])
    np.testing.assert_allclose(trunk[0], [-0.5] + [0.5] * 7)  # mean 2: expert 0 over, the rest under
    np.testing.assert_allclose(trunk[1], [-0.5] * 7 + [0.5])  # mean 7/8
    np.testing.assert_allclose(np.asarray(new["mtp"]["block"]["mlp"]["e_score_correction_bias"][...]),
                               [0.5] + [-0.5] * 7)
    frozen = balancing.update_buffers(buffers, loads, 0.5, include_mtp=False)
    assert not np.asarray(frozen["mtp"]["block"]["mlp"]["e_score_correction_bias"][...]).any()


def test_step_moves_bias_by_the_batch_loads_and_never_by_gradient(mesh1):
    """The bias after one step = before + rate * sign(mean - load) with the loads of a separate
    forward pass; the loss has no gradient w.r.t. the bias; rate 0 leaves it bit-identical."""
    graphdef, state, step = _fresh(mesh1)
    batch = _put(_batch(1), mesh1)
    with sharding.use_mesh(mesh1):
        grad_b = jax.jit(jax.grad(lambda b: loss_fn(state.params, b, batch, graphdef, CFG)[0]))(state.buffers)
        _, m = jax.jit(lambda p, b: loss_fn(p, b, batch, graphdef, CFG))(state.params, state.buffers)
        loads = _host({"trunk": m["expert_load"], "mtp": m["mtp_expert_load"]})
        assert all(not g.any() for g in _leaves(grad_b).values())
        bias0 = _host(state.buffers)
        state, metrics = step(state, batch, controls(0.3, 0.01))
        state, _ = step(state, batch, controls(0.3, 0.0))
    assert float(metrics["bias_rate"]) == pytest.approx(0.01)

    def rule(b, load):
        return b + 0.01 * np.sign(load.mean(-1, keepdims=True) - load)

    got = _host(state.buffers)
    np.testing.assert_allclose(got["moe_layers"]["mlp"]["e_score_correction_bias"],
                               rule(bias0["moe_layers"]["mlp"]["e_score_correction_bias"], loads["trunk"]), atol=1e-7)
    np.testing.assert_allclose(got["mtp"]["block"]["mlp"]["e_score_correction_bias"],
                               rule(bias0["mtp"]["block"]["mlp"]["e_score_correction_bias"], loads["mtp"]), atol=1e-7)
    assert float(metrics["bias_abs_max"]) == pytest.approx(0.01)  # every bias moved by one step from 0


# --- accumulation, sharding, non-finite -----------------------------------------------------

@pytest.mark.slow
def test_accumulating_four_micro_batches_equals_one_big_batch(mesh1):
    big = _batch(2, b=4 * 2)  # 4 micro-batches of 2 rows
    micro = {k: v.reshape(4, 2, S) for k, v in big.items()}
    _, state_big, step_big = _fresh(mesh1)
    _, state_acc, step_acc = _fresh(mesh1, step_cfg=StepConfig(accum_steps=4))
    with sharding.use_mesh(mesh1):
        ctrl = controls(0.3, 1e-3)
        state_big, m_big = step_big(state_big, _put(big, mesh1), ctrl)
        state_acc, m_acc = step_acc(state_acc, _put(micro, mesh1, None), ctrl)
    m_big, m_acc = _host(m_big), _host(m_acc)
    keys = ("loss", "ce", "mtp_ce", "aux_loss", "tokens", "grad_norm", "load_cv", "dropped_frac")
    chex.assert_trees_all_close({k: m_acc[k] for k in keys}, {k: m_big[k] for k in keys}, rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_close((_leaves(state_acc.params), _leaves(state_acc.buffers)),
                                (_leaves(state_big.params), _leaves(state_big.buffers)), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_sharded_step_matches_one_device(mesh1):
    """Two Muon steps on (data 2, tensor 2, expert 2): the same metrics, params and biases as on one
    device, and every parameter and moment keeps its logical layout."""
    mesh = sharding.make_mesh({"data": 2, "tensor": 2, "expert": 2}, cfg=CFG, global_batch=B)
    results = {}
    for name, m in (("one", mesh1), ("mesh", mesh)):
        _, state, step = _fresh(m)
        want = jax.tree.map(lambda x: x.sharding, state.params)
        with sharding.use_mesh(m):
            for seed in (3, 4):
                state, metrics = step(state, _put(_batch(seed), m), controls(0.3, 1e-2))
        assert jax.tree.map(lambda x: x.sharding, state.params) == want
        results[name] = _host(metrics), _leaves(state.params), _leaves(state.buffers)
    assert results["mesh"][1]["['moe_layers']['mlp']['gate_proj'].value"].shape == (2, 8, 64, 32)
    keys = ("loss", "ce", "mtp_ce", "aux_loss", "grad_norm", "update_rms", "load_cv")
    chex.assert_trees_all_close({k: results["mesh"][0][k] for k in keys}, {k: results["one"][0][k] for k in keys},
                                rtol=1e-5, atol=0)
    # Adam divides each element by its own gradient RMS: where that is ~1e-7 the reduction-order
    # noise of a sharded sum (~1e-7 relative) becomes a visible fraction of one lr-sized step.
    # Measured: a handful of elements off by 1-2e-5 (1 of 32768 in lm_head; on an AVX-512 host also 1 of
    # the MTP layer's 128 q_bias entries) at lr 1e-2; everything else < 1e-5. So: every element within 1e-4,
    # and fewer than 0.1% of all elements beyond 1e-5.
    chex.assert_trees_all_close(results["mesh"][1:], results["one"][1:], atol=1e-4, rtol=0)
    pairs = [(results["mesh"][i][path], want) for i in (1, 2) for path, want in results["one"][i].items()]
    off = sum(int(np.sum(np.abs(got - want) > 1e-5)) for got, want in pairs)
    total = sum(want.size for _, want in pairs)
    assert off < 1e-3 * total, (off, total)

def test_step_names_its_loss_and_optimizer_for_profiles(mesh1):
    """Profiles group ops by these scope names; the lowered step carries them as op locations."""
    _, state, step = _fresh(mesh1)
    with sharding.use_mesh(mesh1):
        text = step.lower(state, _put(_batch(0), mesh1), controls(0.3, 1e-2)).as_text(debug_info=True)
    for scope in ("jit(step)/optimizer/", "jvp(loss)/", "/mtp_loss/", "/aux_loss/"):
        assert scope in text, scope


def test_nonfinite_step_is_skipped_and_counted(mesh1):
    _, state, step = _fresh(mesh1)
    batch = _put(_batch(5), mesh1)
    good = _host(state.params)
    layout = state.params["embed_tokens"][...].sharding
    table = np.array(good["embed_tokens"][...])  # a writable copy
    bad = table.copy()
    bad[:, 0] = np.nan  # one feature of every token's embedding
    def with_embedding(state, table):
        put = lambda p, x: jax.device_put(table, layout) if "embed_tokens" in jax.tree_util.keystr(p) else x
        return state.replace(params=jax.tree_util.tree_map_with_path(put, state.params))

    with sharding.use_mesh(mesh1):
        state = with_embedding(state, bad)
        poisoned = _leaves(state.params)
        bias0 = _leaves(state.buffers)
        for n in (1, 2):
            state, m = step(state, batch, controls(0.3, 1e-2))
            assert (int(m["skipped"]), int(m["nonfinite_in_a_row"]), int(m["nonfinite_total"])) == (1, n, n)
            assert float(m["bias_rate"]) == 0.0
        # Nothing moved, not even the biases.
        chex.assert_trees_all_equal((_leaves(state.params), _leaves(state.buffers)), (poisoned, bias0))
        state = with_embedding(state, table)
        before = state
        state, m = step(state, batch, controls(0.3, 1e-2))
    # The state is donated: the step reuses its buffers, so the old params, biases and moments are gone
    # (scalar bookkeeping such as apply_if_finite's `last_finite` may be passed through instead).
    arrays = [x for x in jax.tree.leaves((before.params, before.opt_state, before.buffers)) if x.ndim]
    assert len(arrays) > 50 and all(x.is_deleted() for x in arrays)
    assert (int(m["skipped"]), int(m["nonfinite_in_a_row"]), int(m["nonfinite_total"])) == (0, 0, 2)
    assert int(state.step) == 3 and float(m["lr"]) == pytest.approx(OPTIM.lr)  # lr of the first applied update


# --- learning and balancing -----------------------------------------------------------------

def _cycle_batch(step: int) -> dict[str, np.ndarray]:
    """A learnable stream: each row counts up by a row-specific stride mod 64 (+2 to skip pad/eos)."""
    rng = np.random.default_rng(step)
    start, stride = rng.integers(0, 64, (B, 1)), rng.integers(1, 4, (B, 1))
    x = 2 + (start + stride * np.arange(S + 1)) % 64
    return {"inputs": x[:, :-1].astype(np.int32), "targets": x[:, 1:].astype(np.int32)}


@pytest.mark.slow
def test_muon_learns_a_synthetic_task_and_balancing_lowers_load_cv(mesh1):
    """(1) 60 Muon steps on the counting task take next-token CE from ln(512) ~ 6.2 to < 1.0
    (chance given the stride is ~1.1 nats for the first token of each row; the rest is determined).
    (2) From a skewed start (experts 0, 1 favoured by +0.3 correction bias in every layer) the
    expert-load CV over steps 31-40 is far lower with balancing (rate 1e-2) than without (rate 0)."""
    _, state, step = _fresh(mesh1)
    with sharding.use_mesh(mesh1):
        for i in range(60):
            state, m = step(state, _put(_cycle_batch(i), mesh1), controls(0.3, 1e-3))
            if i == 0:
                first_ce = float(m["ce"])
    assert first_ce > 5.5 and float(m["ce"]) < 1.0, (first_ce, float(m["ce"]))

    skew = np.zeros(CFG.n_routed_experts, np.float32)
    skew[:2] = 0.3
    slow = OptimConfig(lr=1e-3, end_lr=1e-4, warmup_steps=0, decay_steps=100)  # the router drifts less
    cvs = {}
    for rate in (0.0, 1e-2):
        _, state, step = _fresh(mesh1, seed=1, optim=slow)
        trace = []
        with sharding.use_mesh(mesh1):
            state = state.replace(buffers=jax.tree.map(lambda b: b + skew, state.buffers))
            for i in range(40):
                state, m = step(state, _put(_batch(100 + i), mesh1), controls(0.3, rate))
                trace.append(float(m["load_cv"]))
        cvs[rate] = trace[0], float(np.mean(trace[-10:]))
    # k=2 of 8 experts all on experts 0 and 1: loads (n, n, 0, ...) -> CV = sqrt(3) ~ 1.73.
    # Measured (last-10 mean): 1.73 without balancing, 0.46 with it (it takes ~15 steps of 0.01
    # to undo a 0.3 head start, then hovers).
    assert cvs[0.0][0] > 1.7 and cvs[1e-2][0] > 1.7, cvs
    assert cvs[0.0][1] > 1.5 and cvs[1e-2][1] < 0.8, cvs


def test_frozen_weights_are_not_trained_and_the_rest_steps_as_in_the_full_model(mesh1):
    """A step over a trained subset (the others frozen, as a LoRA run's base) equals the full model's gradient
    restricted to that subset, put through the same optimizer by hand; frozen weights never change."""
    import optax
    from flax import nnx

    from glm46_jax.training.step import FrozenModel, make_eval_step

    graphdef, params, buffers = init_model(CFG, mesh1, 0)
    trained = lambda path, _: "self_attn" in jax.tree_util.keystr(path)  # noqa: E731
    train_p, frozen = nnx.split_state(params, trained, ...)
    tx = optax.sgd(0.5)
    batch = _put(_batch(3), mesh1)
    ctrl = controls(0.3, 0.0)
    with sharding.use_mesh(mesh1):
        # Reference: gradients of the whole model, kept where trained, one SGD step by hand.
        grads = jax.grad(lambda p: loss_fn(p, buffers, batch, graphdef, CFG, StepConfig().loss, 0.3)[0])(params)
        want = {k: v - 0.5 * _leaves(grads)[k] for k, v in _leaves(params).items() if "self_attn" in k}
        frozen_before, n_all = _host(frozen), len(_leaves(params))  # (the step donates the trained leaves)
        step = make_train_step(graphdef, tx, CFG)
        state = init_state(train_p, buffers, tx)
        state, metrics = step(state, batch, ctrl, {"model": FrozenModel(frozen)})
        evaluate = make_eval_step(graphdef, CFG)
        ce_after = float(evaluate(state, batch, ctrl, {"model": FrozenModel(frozen)})["ce"])
    got = _leaves(state.params)
    assert set(got) == set(want) and len(got) < n_all
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    chex.assert_trees_all_equal(_host(frozen), frozen_before)
    assert np.isfinite(float(metrics["loss"])) and ce_after < float(metrics["ce"])


def test_equal_configs_share_one_optimizer_and_one_jitted_step(mesh1):
    """A second run in one process (a resume, another seed) gets the jitted step the first one traced: the
    optimizer of one OptimConfig is one object, and the step of equal (graphdef, optimizer, configs) one function;
    any field that differs gives new ones."""
    from glm46_jax.model import abstract_model

    tx, schedule = build_optimizer(OptimConfig(lr=1e-2))
    assert build_optimizer(OptimConfig(lr=1e-2)) == (tx, schedule)
    assert build_optimizer(OptimConfig(lr=2e-2))[0] is not tx
    assert build_optimizer(OptimConfig(lr=1e-2), sharded=False)[0] is not tx
    graphdef = abstract_model(CFG, mesh1)[0]
    step = make_train_step(graphdef, tx, CFG, StepConfig(), lr_schedule=schedule)
    assert make_train_step(abstract_model(CFG, mesh1)[0], tx, CFG, StepConfig(), lr_schedule=schedule) is step
    assert make_train_step(graphdef, tx, CFG, StepConfig(accum_steps=2), lr_schedule=schedule) is not step
    assert make_train_step(graphdef, build_optimizer(OptimConfig(lr=2e-2))[0], CFG, StepConfig(),
                           lr_schedule=schedule) is not step

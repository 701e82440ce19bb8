"""Pipeline stages (docs/pipeline.md): the slot layout against hand-written permutations, the schedule against a
sequential loop of layers, the tiny model on pipeline meshes against one device (logits, MTP logits, every
gradient, expert loads), a few train steps on (data 2, pipeline 2, expert 2) against one device, and checkpoints
moving between pipeline=1 and pipeline=2."""

import dataclasses
import importlib.util
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import init_placed

from glm46_jax.training import checkpoint
from glm46_jax import run_config
from glm46_jax.parallel import sharding
from glm46_jax.errors import InputError
from glm46_jax.config import get_preset
from glm46_jax.training.loss import loss_fn
from glm46_jax.model import GenerationCache, apply, init_model, pipeline
from glm46_jax.training.optim import OptimConfig, build_optimizer
from glm46_jax.training.step import controls, init_state, make_train_step

TINY = get_preset("tiny")


def _leaves(tree):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_slot_layout_is_a_permuted_padded_view():
    # 5 layers, 2 stages, 2 repeats: chunks of 2, 8 slots. Stage 0 runs layers 0,1 then (repeat 1) 4,5;
    # stage 1 runs 2,3 then 6,7; layers 5, 6, 7 do not exist (identity padding).
    lay = pipeline.Layout(layers=5, stages=2, repeats=2)
    assert (lay.per_chunk, lay.slots) == (2, 8)
    assert lay.layer_of_slot().tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert lay.slot_of_layer().tolist() == [0, 1, 4, 5, 2]
    assert pipeline.Layout(89, 8).slots == 96  # GLM-4.5's MoE stack on 8 stages: 7 identity slots
    assert pipeline.Layout(8, 4, 2).bubble(4) == pytest.approx(3 / 11)  # (S - 1) / (R M + S - 1)

    mesh = sharding.make_mesh({"pipeline": 2, "data": 4})
    stack = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)
    with sharding.use_mesh(mesh):
        slots = jax.jit(lambda t: pipeline.to_slots(t, lay))({"moe_layers": jnp.asarray(stack), "other": jnp.ones(2)})
        assert slots["moe_layers"].sharding.spec[0] == "pipeline"
        back = jax.jit(lambda t: pipeline.to_layers(t, lay))(slots)
    want = np.zeros((8, 3), np.float32)
    want[[0, 1, 4, 5, 2]] = stack[[0, 1, 2, 3, 4]]
    np.testing.assert_array_equal(np.asarray(slots["moe_layers"]), want)
    np.testing.assert_array_equal(np.asarray(back["moe_layers"]), stack)
    np.testing.assert_array_equal(np.asarray(back["other"]), np.ones(2))


def _toy_layer(state, h, cos, sin, mask):
    """A residual tanh layer with the MoE's kinds of statistics: a count, a fraction and a per-token value."""
    aux = {"count": jnp.sum(h > 0).astype(jnp.int32), "frac": jnp.mean(h > 0.1), "tok": h[..., :3] * cos[..., :1]}
    return jnp.tanh(h @ state["w"]) + h, aux


@pytest.mark.parametrize("layers, stages, repeats, micro", [
    (4, 2, 1, 2), (4, 2, 1, 4), (5, 2, 1, 2), (8, 4, 2, 4), (5, 2, 2, 2), (7, 4, 1, 8), (6, 2, 3, 4)])
def test_schedule_equals_the_layers_in_sequence(layers, stages, repeats, micro):
    """Outputs, statistics and the gradients of weights and inputs equal a plain loop over the layers (NumPy-free
    reference: the same layer function, no pipeline), for GPipe and circular schedules, micro-batches = and >
    stages, and layer counts that do not divide stages x repeats. Both in float64: in float32 the two summation
    orders differed by up to 3e-6 of the outputs on an Intel host (bit-equal on AMD Zen 4)."""
    with jax.enable_x64(True):
        _schedule_equals_the_layers_in_sequence(layers, stages, repeats, micro)


def _schedule_equals_the_layers_in_sequence(layers, stages, repeats, micro):
    cfg = TINY.replace(num_hidden_layers=layers + 1, pipeline_repeats=repeats, pipeline_microbatches=micro)
    lay = pipeline.layout(cfg, stages)
    w = jax.random.normal(jax.random.key(0), (layers, 16, 16)) * 0.3
    x = jax.random.normal(jax.random.key(1), (16, 4, 16))
    cos = jax.random.normal(jax.random.key(2), (16, 4, 2))
    assert w.dtype == x.dtype == jnp.float64

    def objective(y, aux):
        return jnp.sum(jnp.sin(y)) + jnp.sum(jnp.cos(aux["tok"]) * jnp.arange(3)) + jnp.sum(aux["frac"])

    def sequential(w, x):
        h, stats = x, []
        for i in range(layers):
            h, a = _toy_layer({"w": w[i]}, h, cos, cos, None)
            stats.append(a)
        aux = jax.tree.map(lambda *a: jnp.stack(a), *stats)
        return objective(h, aux), (h, aux)

    (want_loss, (want_y, want_aux)), want_grads = jax.value_and_grad(sequential, (0, 1), has_aux=True)(w, x)

    mesh = sharding.make_mesh({"pipeline": stages, "data": 8 // stages})
    with sharding.use_mesh(mesh):
        slots = jax.jit(lambda t: pipeline.to_slots(t, lay))({"moe_layers": {"w": w}})

        def piped(slots, x, cos):
            y, aux = pipeline.run(slots["moe_layers"], x, cos, cos, jnp.ones((1,)), cfg, _toy_layer)
            return objective(y, aux), (y, aux)

        put = [jax.sharding.reshard(a, sharding.logical("batch", None, None)) for a in (x, cos)]
        (loss, (y, aux)), grads = jax.jit(jax.value_and_grad(piped, (0, 1), has_aux=True))(slots, *put)
        grad_w = jax.jit(lambda g: pipeline.to_layers(g, lay))(grads[0])["moe_layers"]["w"]
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(y, want_y, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(aux["count"], want_aux["count"])  # summed over micro-batches
    np.testing.assert_allclose(aux["frac"], want_aux["frac"], rtol=1e-6)  # averaged over micro-batches
    np.testing.assert_allclose(aux["tok"], want_aux["tok"], rtol=1e-6)
    for got, want in ((grad_w, want_grads[0]), (grads[1], want_grads[1])):  # 1e-5 of the scale: summation order
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def _model_run(cfg, mesh, batch):
    """(loss metrics, gradients in layer order, logits, MTP logits) of the tiny model on `mesh`."""
    with sharding.use_mesh(mesh):
        graphdef, params, buffers = init_placed(cfg, mesh, seed=0)
        put = {k: jax.device_put(v, jax.NamedSharding(mesh, sharding.logical("batch", None))) for k, v in batch.items()}
        grad_fn = jax.value_and_grad(lambda p: loss_fn(p, buffers, put, graphdef, cfg), has_aux=True)
        (_, metrics), grads = jax.jit(grad_fn)(params)
        out = jax.jit(lambda p: apply(graphdef, p, buffers, put["inputs"]))(params)
        grads = pipeline.in_layer_order(grads, cfg)
        return jax.device_get((metrics, _leaves(grads), out.logits, out.mtp_logits))


def _batch(seed, b=8, s=16):
    x = np.random.default_rng(seed).integers(2, TINY.vocab_size, (b, s + 1)).astype(np.int32)
    return {"inputs": x[:, :-1], "targets": x[:, 1:]}


def _assert_same_model_run(got, want):
    metrics, grads, logits, mtp_logits = got
    np.testing.assert_allclose(logits, want[2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mtp_logits, want[3], rtol=1e-5, atol=1e-5)
    for key in ("expert_load", "mtp_expert_load"):
        np.testing.assert_array_equal(metrics[key], want[0][key])
    for key in ("loss", "ce", "mtp_ce", "aux_loss", "dropped_frac"):
        np.testing.assert_allclose(metrics[key], want[0][key], rtol=1e-5)
    assert grads.keys() == want[1].keys()
    for path, g in want[1].items():  # rtol 1e-5 of each leaf's scale: sharded sums add in another order
        np.testing.assert_allclose(grads[path], g, rtol=0, atol=1e-5 * np.abs(g).max(), err_msg=path)


MESHES = {
    "p2": ({"pipeline": 2, "data": 4}, 4, 1, 0),  # 3 MoE layers on 2 stages: one identity slot
    "d2e2p2": ({"data": 2, "expert": 2, "pipeline": 2}, 4, 1, 2),
    "p2t2e2-circular": ({"pipeline": 2, "tensor": 2, "expert": 2}, 5, 2, 4),
    "p4d2-circular": ({"pipeline": 4, "data": 2}, 9, 2, 4),
    "p4t2-uneven": ({"pipeline": 4, "tensor": 2}, 7, 1, 8),
}


@pytest.mark.parametrize("name", [
    "d2e2p2", pytest.param("p2t2e2-circular", marks=pytest.mark.slow),
    pytest.param("p2", marks=pytest.mark.slow), pytest.param("p4d2-circular", marks=pytest.mark.slow),
    pytest.param("p4t2-uneven", marks=pytest.mark.slow)])
def test_model_on_a_pipeline_mesh_equals_one_device(name, mesh1):
    """Logits, MTP logits, loss terms, expert loads and every gradient of the tiny model equal one device's."""
    shape, layers, repeats, micro = MESHES[name]
    cfg = TINY.replace(num_hidden_layers=layers, pipeline_repeats=repeats, pipeline_microbatches=micro)
    batch = _batch(0)
    mesh = sharding.make_mesh(shape, cfg=cfg, global_batch=8)
    _assert_same_model_run(_model_run(cfg, mesh, batch), _model_run(cfg, mesh1, batch))


OPTIM = OptimConfig(lr=1e-2, end_lr=1e-3, warmup_steps=0, decay_steps=100)


def _train(cfg, mesh, steps):
    graphdef, params, buffers = init_placed(cfg, mesh, 0)
    tx, schedule = build_optimizer(OPTIM, params)
    with sharding.use_mesh(mesh):
        state = init_state(params, buffers, tx)
        step = make_train_step(graphdef, tx, cfg, lr_schedule=schedule)
        history = []
        for seed in range(steps):
            batch = {k: jax.device_put(v, jax.NamedSharding(mesh, sharding.logical("batch", "seq")))
                     for k, v in _batch(seed).items()}
            state, metrics = step(state, batch, controls(0.3, 1e-2))
            history.append(jax.device_get(metrics))
    return history, state


def test_training_on_data_pipeline_expert_gives_the_one_device_losses(mesh1, tmp_path):
    """Three Muon steps on (data 2, pipeline 2, expert 2): the same losses, and the same loss-free-balancing
    biases, as on one device. The final state saved there restores on one device and back."""
    cfg = TINY.replace(num_hidden_layers=4, pipeline_microbatches=2)
    mesh = sharding.make_mesh({"data": 2, "pipeline": 2, "expert": 2}, cfg=cfg, global_batch=8)
    want, one = _train(cfg, mesh1, 3)
    got, piped = _train(cfg, mesh, 3)
    keys = ("loss", "ce", "mtp_ce", "aux_loss", "grad_norm", "load_cv")
    chex.assert_trees_all_close([{k: m[k] for k in keys} for m in got], [{k: m[k] for k in keys} for m in want],
                                rtol=2e-5, atol=0)
    biases = pipeline.in_layer_order(piped.buffers, cfg)
    chex.assert_trees_all_close(_leaves(biases), _leaves(one.buffers), atol=1e-6, rtol=0)

    # Checkpoints hold layer order: pipeline=2 -> disk -> pipeline=1 (and the optimizer state with it) -> back.
    meta = {"model_config": dataclasses.asdict(cfg)}
    saver = checkpoint.Checkpointer(str(tmp_path / "a"), every=1, async_save=False)
    saver.save(1, piped, {"pos": 0}, meta)
    saver.wait()
    step, restored_one, _, _ = saver.restore_latest(one)
    assert step == 1
    chex.assert_trees_all_close(_leaves(restored_one.params), _leaves(pipeline.in_layer_order(piped.params, cfg)))
    chex.assert_trees_all_close(_leaves(restored_one.opt_state),
                                _leaves(pipeline.in_layer_order(piped.opt_state, cfg)))
    saver.close()
    saver = checkpoint.Checkpointer(str(tmp_path / "b"), every=1, async_save=False)
    saver.save(1, restored_one, {"pos": 0}, meta)
    saver.wait()
    _, back, _, _ = saver.restore_latest(piped)
    saver.close()
    assert back.params["moe_layers"]["mlp"]["gate_proj"][...].sharding.spec[0] == "pipeline"
    chex.assert_trees_all_close(_leaves(back.params), _leaves(piped.params))
    chex.assert_trees_all_close(_leaves(back.buffers), _leaves(piped.buffers))


def test_weights_saved_on_a_pipeline_mesh_load_anywhere(tmp_path):
    """save_params from pipeline=2 (3 MoE layers on 2 stages: padded) writes the layer-order stack that
    load_params reads on one device, and on pipeline=2 again into the slot layout. What it writes is the one-device
    init: init on a pipeline mesh gives the same weights (the tests above take them placed: conftest.init_placed)."""
    cfg = TINY.replace(num_hidden_layers=4)
    mesh = sharding.make_mesh({"pipeline": 2, "data": 4}, cfg=cfg)
    _, params, buffers = init_model(cfg, mesh, 0)
    path = checkpoint.save_params(tmp_path, 0, params, buffers, cfg)
    one = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    _, _, loaded, _ = checkpoint.load_params(path, one)
    assert loaded["moe_layers"]["mlp"]["router"][...].shape[0] == 3
    chex.assert_trees_all_close(_leaves(loaded), _leaves(init_model(cfg, one, 0)[1]))
    _, _, again, _ = checkpoint.load_params(path, mesh)
    chex.assert_trees_all_close(_leaves(again), _leaves(params))


def _config_file(name: str, preset: str):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(f"{name}_config", os.path.join(root, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(preset)


def test_unsupported_combinations_are_config_errors():
    """Never silent replication: RL with pipeline stages is refused in one line, generation on a pipeline mesh with
    a clear error. Layer-wise lr decay, once refused too, is accepted: it counts depth in layer order there
    (tests/test_lora_pipeline.py compares its updates with one device's)."""
    config = _config_file("pretrain", "tiny")
    config.mesh = {"data": -1, "pipeline": 2}
    config.optim.layer_decay = 0.9
    cfg = run_config.from_config_dict(config)
    assert (cfg.optim.layer_decay, cfg.mesh.sizes()["pipeline"]) == (0.9, 2)
    rl = _config_file("grpo", "tiny")  # RL samples with the in-order generator and replays routing
    rl.mesh = {"data": -1, "pipeline": 2}
    with pytest.raises(InputError, match=r"mesh.pipeline=2 with recipe grpo: .* set mesh.pipeline=1"):
        run_config.from_config_dict(rl)
    one = sharding.make_mesh({"pipeline": 2, "data": 4}, cfg=TINY.replace(num_hidden_layers=3))
    graphdef, params, buffers = init_placed(TINY.replace(num_hidden_layers=3), one)
    with sharding.use_mesh(one), pytest.raises(ValueError, match="generation runs the layers in order"):
        apply(graphdef, params, buffers, jnp.zeros((8, 1), jnp.int32), jnp.zeros((8, 1), jnp.int32),
              cache=GenerationCache.zeros(TINY.replace(num_hidden_layers=3), 8, 4), index=0,
              start=jnp.zeros(8, jnp.int32))

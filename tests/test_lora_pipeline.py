"""LoRA / DoRA adapters and layer-wise lr decay on pipeline meshes (docs/lora.md#pipeline-meshes,
docs/pipeline.md#limits). The reference is always the same run on one device: a few adapter-training steps on
pipeline 2 and on pipeline 2 x expert 2 give its losses and adapters, the PEFT export is its export, and Muon with
layer_decay gives its update of every leaf. The tiny model has 5 MoE layers on 2 stages x 2 repeats: 3 of the 8 slots
are identity padding, whose adapters must see exactly zero gradient and stay zero."""

import importlib.util
import os

import chex
import jax
import numpy as np
import pytest
from conftest import init_placed
from flax import nnx
from safetensors.numpy import load_file

from glm46_jax import run_config
from glm46_jax.config import get_preset
from glm46_jax.interop.peft import load_peft, save_peft
from glm46_jax.model import pipeline
from glm46_jax.model.lora import LoRAConfig, add_adapters
from glm46_jax.parallel import sharding
from glm46_jax.training.optim import OptimConfig, build_optimizer, layer_depths
from glm46_jax.training.step import FrozenModel, controls, init_state, make_train_step

# 5 MoE layers on 2 stages x 2 repeats: the 8 slots hold layers 0, 1, 4, (5), 2, 3, (6), (7), the ones in brackets
# identity padding, so slot order is not layer order. No dense layer and no MTP layer: they run outside the pipeline,
# and each would add its own layer to compile in every program here.
CFG = get_preset("tiny").replace(num_hidden_layers=5, first_k_dense_replace=0, num_nextn_predict_layers=0,
                                 pipeline_microbatches=2, pipeline_repeats=2)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# DoRA on every attention projection (what PEFT can express) and per-expert adapters on the routed experts' gate:
# the padding slots' zero weights are DoRA's 0 / 0 case, and expert adapters shard over `expert` too.
LORA = LoRAConfig(rank=2, alpha=4.0, dora=True, targets=(*ATTENTION, "experts.gate_proj"), experts="per_expert")
ADAMW = OptimConfig(lr=2e-2, end_lr=2e-3, warmup_steps=0, decay_steps=100, algorithm="adamw", weight_decay=0.1)
MUON_DECAY = OptimConfig(lr=1e-2, end_lr=1e-3, warmup_steps=0, decay_steps=100, layer_decay=0.5)
MESHES = {"p2": {"pipeline": 2, "data": 4}, "p2e2": {"pipeline": 2, "expert": 2, "data": 2}}
STEPS = 3
METRICS = ("loss", "ce", "aux_loss", "grad_norm")
SLOT_LAYERS = pipeline.layout(CFG, 2).layer_of_slot()
PADDING, REAL = np.flatnonzero(SLOT_LAYERS >= CFG.num_moe_layers), np.flatnonzero(SLOT_LAYERS < CFG.num_moe_layers)


def _leaves(tree):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _batch(mesh, seed, b=8, s=16):
    x = np.random.default_rng(seed).integers(2, CFG.vocab_size, (b, s + 1)).astype(np.int32)
    put = jax.NamedSharding(mesh, sharding.logical("batch", "seq"))
    return {"inputs": jax.device_put(x[:, :-1], put), "targets": jax.device_put(x[:, 1:], put)}


def _lora_run(mesh):
    """STEPS adapter-training steps (AdamW) from the same base and adapter init: metrics per step, the adapters
    before (in the mesh's layout and in layer order) and after (the final state), the frozen base before and after."""
    graphdef, params, buffers = init_placed(CFG, mesh)
    graphdef, adapters, base, buffers = add_adapters(graphdef, params, buffers, LORA, mesh, seed=0)
    base_before, adapters_before = _leaves(base), _leaves(adapters)
    init_in_layer_order = _leaves(pipeline.in_layer_order(adapters, CFG))
    tx, schedule = build_optimizer(ADAMW, adapters)
    with sharding.use_mesh(mesh):
        state = init_state(adapters, buffers, tx)
        step = make_train_step(graphdef, tx, CFG, lr_schedule=schedule)
        history = []
        for seed in range(STEPS):
            state, metrics = step(state, _batch(mesh, seed), controls(0.3, 1e-2), {"model": FrozenModel(base)})
            history.append({k: float(metrics[k]) for k in METRICS})
    return {"history": history, "before": adapters_before, "init": init_in_layer_order, "state": state,
            "base_before": base_before, "base_after": _leaves(base)}


@pytest.fixture(scope="module")
def runs(mesh1):
    out = {"one": _lora_run(mesh1)}
    for name, shape in MESHES.items():
        out[name] = _lora_run(sharding.make_mesh(shape, cfg=CFG, global_batch=8))
    return out


@pytest.mark.parametrize("name", list(MESHES))
def test_lora_training_on_a_pipeline_mesh_gives_the_one_device_run(runs, name):
    """Losses and gradient norms per step, the initial and the trained adapters (in layer order) equal one device's;
    the base stays bit for bit what it was, and the state holds only adapters."""
    got, want = runs[name], runs["one"]
    # rtol 2e-5, as tests/test_pipeline.py's training on a pipeline mesh: sharded sums add in another order.
    chex.assert_trees_all_close(got["history"], want["history"], rtol=2e-5, atol=0)
    # The same init: A drawn in layer order and placed in slots (DoRA's magnitudes: norms summed in another order).
    assert got["init"].keys() == want["init"].keys()
    for key, w in want["init"].items():
        np.testing.assert_allclose(got["init"][key], w, rtol=1e-6, atol=0, err_msg=key)
    assert got["base_after"].keys() == got["base_before"].keys()
    for key, w in got["base_before"].items():
        np.testing.assert_array_equal(got["base_after"][key], w, err_msg=key)
    adapters = pipeline.in_layer_order(got["state"].params, CFG)
    assert {path[-1] for path, _ in nnx.to_flat_state(adapters)} == {"a", "b", "magnitude"}
    trained, reference = _leaves(adapters), _leaves(want["state"].params)
    assert trained.keys() == reference.keys()
    # 1e-3 of each leaf's scale (the losses above agree to 2e-5): Adam's m / sqrt(v) turns the rounding of tiny
    # gradients (per-expert adapters of experts that got few tokens) into visible steps; seen up to 2.4e-4.
    for key, w in reference.items():
        assert not np.array_equal(w, want["init"][key]), f"{key} trains"
        np.testing.assert_allclose(trained[key], w, rtol=0, atol=1e-3 * np.abs(w).max(), err_msg=key)


@pytest.mark.parametrize("name", list(MESHES))
def test_padding_slots_get_zero_gradients_and_stay_zero(runs, name):
    """The identity slots' adapters start at zero (their weights are zero: DoRA's magnitudes too), their Adam
    moments stay exactly zero (zero gradients) and so do they; the real slots' adapters all move."""
    state = runs[name]["state"]
    assert PADDING.tolist() == [3, 6, 7]
    before, after = runs[name]["before"], _leaves(state.params)
    assert after.keys() == before.keys() and all(k.startswith("['moe_layers']") for k in after)
    for key, value in after.items():
        assert value.shape[0] == 8 and np.all(before[key][PADDING] == 0) and np.all(value[PADDING] == 0), key
        assert all(not np.array_equal(value[s], before[key][s]) for s in REAL), f"{key}: every real slot trains"
    moments = [np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state.opt_state)
               if "moe_layers" in jax.tree_util.keystr(p) and np.ndim(x) >= 2]
    assert len(moments) == 2 * len(after)  # Adam's mu and nu of every adapter leaf
    assert all(np.all(m[PADDING] == 0) and np.abs(m[REAL]).max() > 0 for m in moments)


def _attention_only(adapters):  # what PEFT can express (docs/lora.md#what-peft-can-express)
    return nnx.from_flat_state([(p, v) for p, v in nnx.to_flat_state(adapters) if p[1] == "self_attn"])


def test_peft_export_from_a_pipeline_run_is_the_one_device_export(runs, tmp_path):
    """The PP2 x EP2 run's PEFT directory holds the one-device run's tensors (layer order, no padding slot) and
    imports back on the pipeline mesh into its slot layout, bit for bit."""
    lcfg = LoRAConfig(rank=LORA.rank, alpha=LORA.alpha, dora=True, targets=ATTENTION)
    for name in ("one", "p2e2"):
        save_peft(str(tmp_path / name), CFG, lcfg, _attention_only(runs[name]["state"].params))
    got, want = (load_file(str(tmp_path / n / "adapter_model.safetensors")) for n in ("p2e2", "one"))
    assert sorted(got) == sorted(want)
    layers = {int(k.split(".")[4]) for k in got}
    assert layers == set(range(CFG.num_hidden_layers)) and len(got) == 5 * 4 * 3  # layers x q/k/v/o x A/B/m
    for key, w in want.items():  # the trained adapters' tolerance above
        np.testing.assert_allclose(got[key], w, rtol=0, atol=1e-3 * np.abs(w).max(), err_msg=key)

    mesh = sharding.make_mesh(MESHES["p2e2"], cfg=CFG, global_batch=8)
    _, _, adapters, _, _ = load_peft(str(tmp_path / "p2e2"), *init_placed(CFG, mesh), mesh)
    chex.assert_trees_all_equal(_leaves(adapters), _leaves(_attention_only(runs["p2e2"]["state"].params)))
    assert adapters["moe_layers"]["self_attn"]["q_proj_lora"]["a"][...].sharding.spec[0] == "pipeline"


def _decayed_update(mesh, mesh1, layout):
    """One Muon update with layer_decay of the same gradients (cos(3 w) of the init; in slot order padding slots get
    zeros, as real gradients there are), returned in layer order."""
    _, params, _ = init_placed(CFG, mesh)
    _, reference, _ = init_placed(CFG, mesh1)
    target = pipeline.layer_order_target(params, CFG)  # as conftest.init_placed places weights
    grads = jax.tree.map(lambda x: x, target)
    nnx.replace_by_pure_dict(grads, jax.tree.map(lambda x: np.cos(3 * np.asarray(x)), nnx.to_pure_dict(reference)))
    grads = pipeline.in_slot_order(jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), grads, target), CFG,
                                   like=params)
    tx, _ = build_optimizer(MUON_DECAY, params, layout=layout)
    with sharding.use_mesh(mesh):
        updates, _ = jax.jit(tx.update)(grads, jax.jit(tx.init)(params), params)
    return _leaves(pipeline.in_layer_order(updates, CFG))


def test_layer_decay_on_a_pipeline_mesh_scales_each_layer_as_on_one_device(mesh1):
    """Muon with layer_decay=0.5 on pipeline 2 x 2 repeats (slot order is not layer order): each leaf's update, MoE
    layer by MoE layer, is the one-device update, though the depths scale every layer's differently."""
    mesh = sharding.make_mesh(MESHES["p2"], cfg=CFG, global_batch=8)
    want = _decayed_update(mesh1, mesh1, None)
    got = _decayed_update(mesh, mesh1, pipeline.layout(CFG, 2))
    with pytest.raises(ValueError, match="needs the MoE stack's layout"):  # never depths counted along the slots
        _decayed_update(mesh, mesh1, None)
    assert got.keys() == want.keys()
    for key, w in want.items():  # 1e-4 of the scale: Newton-Schulz on sharded matrices sums in another order
        np.testing.assert_allclose(got[key], w, rtol=0, atol=1e-4 * np.abs(w).max(), err_msg=key)
    # decay ** (L + 1 - depth): layer i of the MoE stack at depth 2 + i moves twice as far as layer i - 1.
    q = "['moe_layers']['self_attn']['q_proj'].value"
    sizes = [np.abs(want[q][i]).mean() for i in range(CFG.num_moe_layers)]
    np.testing.assert_allclose(np.array(sizes[1:]) / sizes[:-1], 2, rtol=0.2)


def test_layer_depths_follow_the_layer_a_slot_holds():
    """5 MoE layers on 2 stages x 2 repeats (8 slots, 3 identity): each slot's depth is the depth its layer has in
    the layer-order stack; identity slots get the top (their updates are zero anyway)."""
    lay = pipeline.Layout(layers=5, stages=2, repeats=2)
    layer_tree = {"embed_tokens": np.zeros((4, 2)), "dense_layers": np.zeros((1, 3)), "moe_layers": np.zeros((5, 3)),
                  "norm": np.zeros(2)}
    slot_tree = {**layer_tree, "moe_layers": np.zeros((8, 3))}
    (want, want_top), (got, got_top) = layer_depths(layer_tree), layer_depths(slot_tree, lay)
    assert got_top == want_top == 7
    for key in ("embed_tokens", "dense_layers", "norm"):
        np.testing.assert_array_equal(got[key], want[key])
    holds = lay.layer_of_slot()
    for slot, layer in enumerate(holds):
        assert got["moe_layers"][slot] == (want["moe_layers"][layer] if layer < 5 else want_top), slot
    with pytest.raises(ValueError, match="8 slots"):
        layer_depths(layer_tree, lay)


def test_lora_sft_with_layer_decay_on_a_pipeline_mesh_is_a_valid_run_config():
    """Both were refused on a pipeline mesh before (one InputError each); the config now parses as asked."""
    path = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "sft.py")
    spec = importlib.util.spec_from_file_location("sft_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("tiny")
    config.mesh = {"data": -1, "pipeline": 2}
    config.optim.layer_decay = 0.8
    config.train.steps = 2  # the length, so nothing reads the (absent) dataset's size
    cfg = run_config.from_config_dict(config)
    assert (cfg.sft.method, cfg.mesh.sizes()["pipeline"], cfg.optim.layer_decay) == ("lora", 2, 0.8)

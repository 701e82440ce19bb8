"""Host offload (training/offload.py): the optimizer state, and with it the master weights, in host memory between
steps give bit-identical losses, parameters and optimizer state to the same run on the device, across a checkpoint
and a resume; with a bf16 compute dtype the device's compute copy computes the same step; recipes whose other
programs read the weights refuse the master-weights offload."""

import dataclasses
import json
import math
import os
from functools import partial

import jax
import numpy as np
import pytest
from conftest import init_placed
from test_pipeline import _config_file
from test_train import _one_phase_config

from glm46_jax.config import get_preset
from glm46_jax.errors import InputError
from glm46_jax.model import init_model, pipeline
from glm46_jax.parallel import sharding
from glm46_jax.run_config import from_config_dict
from glm46_jax.train import train
from glm46_jax.training import offload, streamed
from glm46_jax.training.optim import OptimConfig, build_optimizer
from glm46_jax.training.step import controls, init_state, make_train_step

STEPS = 4


def _losses(run_dir: str) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["train/loss"] for r in map(json.loads, f) if "train/loss" in r}


def _config(run_dir, corpus, steps, mode):
    config = _one_phase_config(run_dir, corpus, steps)  # test_train's shapes and mesh: its programs are shared
    config.optim.offload = mode
    config.checkpoint.update(every=2, async_save=False)
    config.optim.update(decay_steps=STEPS)  # the same schedule for the interrupted run
    return config


def _memory_kinds(tree) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


@pytest.fixture(scope="module")
def on_device(tmp_path_factory, sample_corpus):
    run_dir = str(tmp_path_factory.mktemp("device"))
    state, _ = train(from_config_dict(_config(run_dir, sample_corpus, STEPS, "none")), jax.devices()[:1])
    assert _memory_kinds(state.opt_state) == _memory_kinds(state.params) == {"device"}
    return run_dir, state


@pytest.mark.parametrize("mode", ["optimizer", "optimizer_and_params"])
def test_offloaded_run_resumes_with_the_on_device_runs_numbers(on_device, mode, tmp_path, sample_corpus):
    """fp32 (the tiny preset): stopped after step 2 and resumed, the offloaded run equals the device run bit for bit
    (losses, params, optimizer state), its offloaded state in pinned_host memory after the resume too."""
    devices = jax.devices()[:1]
    run_dir = str(tmp_path / mode)
    train(from_config_dict(_config(run_dir, sample_corpus, 2, mode)), devices)  # stops after step 2
    state, summary = train(from_config_dict(_config(run_dir, sample_corpus, STEPS, mode)), devices)
    assert summary["start_step"] == 3
    assert _memory_kinds(state.opt_state) == {"pinned_host"}
    assert _memory_kinds(state.params) == {"pinned_host" if mode == "optimizer_and_params" else "device"}
    want_dir, want = on_device
    assert sorted(_losses(want_dir)) == list(range(1, STEPS + 1)) and _losses(run_dir) == _losses(want_dir)
    for tree in ("params", "opt_state"):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(getattr(want, tree)),
                                jax.tree.leaves(getattr(state, tree)), strict=True):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"{tree}{jax.tree_util.keystr(path)}")


def test_a_bf16_models_compute_copy_steps_like_its_fp32_masters(mesh1):
    """bf16 compute, fp32 masters, one device, no accumulation: the projections come to the forward as a bf16 copy
    (`paths.COMPUTE_CAST`, which the model casts to bf16 anyway) and their gradients are cast back to fp32 for the
    update, so two steps give the device run's metrics, params and optimizer state exactly."""
    cfg = dataclasses.replace(get_preset("tiny"), dtype="bfloat16")
    graphdef, params, buffers = init_model(cfg, mesh1, 0)
    tx, schedule = build_optimizer(OptimConfig(lr=1e-2, warmup_steps=0, decay_steps=10), params)
    step = make_train_step(graphdef, tx, cfg, lr_schedule=schedule)
    x = np.random.default_rng(0).integers(2, cfg.vocab_size, (2, 4, 33)).astype(np.int32)
    runs = {}
    for mode in ("none", "optimizer_and_params"):
        with sharding.use_mesh(mesh1):
            fresh = jax.tree.map(lambda a: a.copy(), (params, buffers))  # the step donates its state
            state = offload.place(init_state(*fresh, tx), {"model": mode}, "model")
            metrics = []
            for b in x:
                state, m = step(state, {"inputs": b[:, :-1], "targets": b[:, 1:]}, controls(0.3, 1e-3))
                metrics.append(jax.device_get(m))
        runs[mode] = (metrics, jax.device_get(state.params), jax.device_get(state.opt_state))
    assert _memory_kinds(state.params) == {"pinned_host"}
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(runs["none"]),
                            jax.tree.leaves(runs["optimizer_and_params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(path))


def test_offload_config_errors(tmp_path, sample_corpus):
    with pytest.raises(InputError, match=r"optim.offload='gpu'.*one of \('none', 'optimizer', 'optimizer_and_params'\)"):
        from_config_dict(_config(str(tmp_path), sample_corpus, 1, "gpu"))
    for recipe, why in (("grpo", "rollouts read them too"), ("dpo", "only the language-model step")):
        config = _config_file(recipe, "tiny")
        config.optim.offload = "optimizer_and_params"
        with pytest.raises(InputError, match=f"optim.offload=optimizer_and_params with recipe {recipe}: .*{why}"):
            from_config_dict(config)
        config.optim.offload = "optimizer"  # the optimizer state alone: every recipe
        from_config_dict(config)
    config = _config_file("sft", "tiny")  # LoRA
    config.optim.offload = "optimizer_and_params"
    with pytest.raises(InputError, match="sft.method=lora with optim.offload=optimizer_and_params"):
        from_config_dict(config)


@pytest.mark.parametrize("shape", [{"data": 1}, {"data": 2, "tensor": 2, "expert": 2}, {"pipeline": 2, "data": 4}],
                         ids=["one_device", "data_tensor_expert", "pipeline"])
def test_the_layer_streamed_update_is_the_whole_tree_update(shape):
    """With the optimizer state offloaded, the step updates each layer stack one layer at a time (training/streamed.py:
    the lowered program has one `while` more per streamed stack) and gets the whole-tree update's numbers: Muon +
    AdamW with layer-wise lr decay and a clip that bites, two steps bit for bit on one device; one step to float32
    rounding on data x tensor x expert (Newton-Schulz under auto_axes) and on a pipeline mesh, whose MoE stack (layer
    axis sharded over the stages) is updated whole while the dense stack streams. update_rms sums the squares in
    another order."""
    cfg = get_preset("tiny").replace(num_hidden_layers=4, **({"pipeline_microbatches": 2} if "pipeline" in shape else {}))
    mesh = sharding.make_mesh(shape, jax.devices()[:math.prod(shape.values())], cfg=cfg, global_batch=8)
    graphdef, params, buffers = init_placed(cfg, mesh)
    layout = pipeline.layout(cfg, shape["pipeline"]) if "pipeline" in shape else None
    exact = len(mesh.devices.flat) == 1
    x = np.random.default_rng(0).integers(2, cfg.vocab_size, (2 if exact else 1, 8, 33)).astype(np.int32)
    runs, loops, rms = {}, {}, {}
    for mode in ("none", "optimizer"):
        opt = OptimConfig(lr=1e-2, warmup_steps=0, decay_steps=10, layer_decay=0.8, clip=0.5, offload=mode)
        tx, schedule = build_optimizer(opt, params, layout=layout)
        assert isinstance(tx, streamed.LayerStreamed) == (mode == "optimizer")
        step = make_train_step(graphdef, tx, cfg, lr_schedule=schedule)
        with sharding.use_mesh(mesh):
            fresh = jax.tree.map(lambda a: a.copy(), (params, buffers))  # the step donates its state
            state = offload.place(init_state(*fresh, tx), {"model": mode}, "model")
            batch = {"inputs": x[0, :, :-1], "targets": x[0, :, 1:]}
            loops[mode] = step.lower(state, batch, controls(0.3, 1e-3)).as_text().count("stablehlo.while")
            metrics = []
            for b in x:
                state, m = step(state, {"inputs": b[:, :-1], "targets": b[:, 1:]}, controls(0.3, 1e-3))
                metrics.append(jax.device_get(m))
        assert _memory_kinds(state.opt_state) == {"pinned_host" if mode == "optimizer" else "device"}
        runs[mode] = ([{k: v for k, v in m.items() if k != "update_rms"} for m in metrics],
                      jax.device_get(state.params), jax.device_get(state.opt_state))
        rms[mode] = [m["update_rms"] for m in metrics]
    assert loops["optimizer"] == loops["none"] + (1 if "pipeline" in shape else 2)  # the dense (and MoE) stack
    assert runs["none"][0][0]["grad_norm"] > 0.5 and runs["none"][0][0]["skipped"] == 0  # the clip bites
    # On a mesh XLA partitions Newton-Schulz's products of a one-layer slice and of the whole stack differently, so
    # their sums run in another order: one step's numbers agree to float32 rounding (measured <= 3.2e-8; a second
    # step's AdamW divides those differences by sqrt(nu) where a gradient is tiny, up to 3.4e-6; AdamW alone measured
    # bit for bit over two steps there).
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(runs["none"]), jax.tree.leaves(runs["optimizer"]),
                            strict=True):
        check = np.testing.assert_array_equal if exact else partial(np.testing.assert_allclose, rtol=1e-6, atol=2e-7)
        check(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(path))
    np.testing.assert_allclose(rms["optimizer"], rms["none"], rtol=1e-6)

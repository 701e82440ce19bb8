"""Host offload (training/offload.py, training/streamed.py): the optimizer state, and with it the master weights, in
host memory between steps give bit-identical losses, parameters and optimizer state to the same run on the device,
across a checkpoint and a resume; with a bf16 compute dtype the device's compute copy and the update streamed a layer
at a time compute the same step; on meshes the streamed update equals the whole-tree update to float32 rounding;
recipes whose other programs read the weights refuse the master-weights offload. Where two different programs are
compared bit for bit, both are compiled with `conftest.PINNED_CODEGEN` (what XLA:CPU's default code leaves to the
host: tests/README.md#one-hosts-numbers)."""

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import PINNED_CODEGEN, init_placed
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
# Muon + AdamW with layer-wise lr decay and a clip the tiny model's first gradients exceed: every part of the update
STREAM_OPTIM = OptimConfig(lr=1e-2, warmup_steps=0, decay_steps=10, layer_decay=0.8, clip=0.5)


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


def test_a_bf16_models_compute_copy_and_streamed_update_step_like_the_device_run(mesh1):
    """bf16 compute, fp32 masters, one device, no accumulation: the projections come to the forward as a bf16 copy
    (`paths.COMPUTE_CAST`, which the model casts to bf16 anyway) and their gradients are cast back to fp32 for the
    update, which streams each layer stack one layer at a time (training/streamed.py: the lowered program has one
    `while` more per stack). Two Muon + AdamW steps with layer-wise lr decay and a clip that bites give the device
    run's metrics, params and optimizer state exactly (update_rms sums the same squares in another order) when both
    programs are compiled with `conftest.PINNED_CODEGEN`. Under XLA:CPU's default code generation they agree to
    float32 rounding only (docs/training.md#host-offload): the two programs fuse the gradients' norms and Newton-Schulz
    differently, so a reduction that one hands to YNNPACK the other may emit itself, and the two sum in lanes of
    different widths wherever YNNPACK's kernel (chosen by the CPU: 16 floats with AVX-512) is not the compile target's
    (8 at AVX2): aux_loss 1 ulp apart at step 2 on an AVX-512 host, grad_norm here with --xla_cpu_max_isa=SSE4_2.
    The default code's agreement is test_the_layer_streamed_update_on_a_mesh's (one device included)."""
    cfg = dataclasses.replace(get_preset("tiny"), dtype="bfloat16")
    graphdef, params, buffers = init_model(cfg, mesh1, 0)
    x = np.random.default_rng(0).integers(2, cfg.vocab_size, (2, 4, 33)).astype(np.int32)
    runs, loops, rms = {}, {}, {}
    for mode in ("none", "optimizer_and_params"):
        tx, schedule = build_optimizer(dataclasses.replace(STREAM_OPTIM, offload=mode), params)
        assert isinstance(tx, streamed.LayerStreamed) == (mode != "none")
        step = make_train_step(graphdef, tx, cfg, lr_schedule=schedule)
        with sharding.use_mesh(mesh1):
            fresh = jax.tree.map(lambda a: a.copy(), (params, buffers))  # the step donates its state
            state = offload.place(init_state(*fresh, tx), {"model": mode}, "model")
            batch = {"inputs": x[0, :, :-1], "targets": x[0, :, 1:]}
            lowered = step.lower(state, batch, controls(0.3, 1e-3))
            loops[mode] = lowered.as_text().count("stablehlo.while")
            compiled = lowered.compile(PINNED_CODEGEN)
            metrics = []
            for b in x:
                state, m = compiled(state, {"inputs": b[:, :-1], "targets": b[:, 1:]}, controls(0.3, 1e-3))
                metrics.append(jax.device_get(m))
        runs[mode] = ([{k: v for k, v in m.items() if k != "update_rms"} for m in metrics],
                      jax.device_get(state.params), jax.device_get(state.opt_state))
        rms[mode] = [m["update_rms"] for m in metrics]
    assert _memory_kinds(state.params) == _memory_kinds(state.opt_state) == {"pinned_host"}
    assert loops["optimizer_and_params"] == loops["none"] + 2  # the dense and the MoE stack
    assert runs["none"][0][0]["grad_norm"] > STREAM_OPTIM.clip and runs["none"][0][0]["skipped"] == 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(runs["none"]),
                            jax.tree.leaves(runs["optimizer_and_params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(path))
    np.testing.assert_allclose(rms["optimizer_and_params"], rms["none"], rtol=1e-6)


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
def test_the_layer_streamed_update_on_a_mesh(shape):
    """streamed.apply against the whole-tree update and apply_updates on the same gradients (random, in the params'
    shardings, their norm above the clip), the state in host memory: two updates, then a poisoned one (a loss
    spike) that both skip and count, under XLA:CPU's default code generation. On one device every stack streams,
    and Newton-Schulz's batches differ (one layer's matrices of a shape against every layer's: muon._by_shape), as
    do the reductions YNNPACK takes (see the bf16 test above). On data x tensor x expert the MoE stack streams with its experts and matrices
    sharded (Newton-Schulz under auto_axes); on a pipeline mesh the MoE stack, its layer axis split over the stages,
    is updated whole while the dense stack streams. XLA partitions Newton-Schulz's products of one layer and of the
    whole stack differently, so their sums run in another order: equal to float32 rounding (measured <= 3.2e-8 after
    one update; AdamW alone bit for bit), the skipped update exactly."""
    cfg = get_preset("tiny").replace(**({"pipeline_microbatches": 2} if "pipeline" in shape else {}))
    mesh = sharding.make_mesh(shape, jax.devices()[:math.prod(shape.values())], cfg=cfg)
    _, params, _ = init_placed(cfg, mesh)
    layout = pipeline.layout(cfg, shape["pipeline"]) if "pipeline" in shape else None
    tx = build_optimizer(dataclasses.replace(STREAM_OPTIM, offload="optimizer"), params, layout=layout)[0]
    rng = np.random.default_rng(0)
    grads = [jax.tree.map(lambda p: jax.device_put(rng.standard_normal(p.shape).astype(p.dtype), p.sharding), params)
             for _ in range(3)]

    def whole(p, s, g, spike):
        g = jax.tree.map(lambda x: jnp.where(spike, jnp.nan, x), g)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    def pieces(p, s, g, spike):
        new_p, new_s, _ = streamed.apply(tx, g, spike, s, p, {})
        return new_p, offload.store_like(new_s, s)  # as the train step returns it

    runs = {}
    with sharding.use_mesh(mesh):
        for name, update in (("whole", whole), ("streamed", pieces)):
            p = jax.tree.map(lambda a: a.copy(), params)
            s = jax.jit(tx.init)(p)
            s = offload.to_host(s) if name == "streamed" else s
            run = jax.jit(update, donate_argnums=(0, 1))
            out = []
            for g, spike in zip(grads, (False, False, True), strict=True):
                p, s = run(p, s, g, jnp.bool_(spike))
                out.append(jax.device_get((p, s)))
            runs[name] = out
    assert _memory_kinds(s) == {"pinned_host"}
    assert runs["whole"][2][1].notfinite_count == 1 and runs["whole"][2][1].total_notfinite == 1
    for i, (a, b) in enumerate(zip(runs["whole"], runs["streamed"], strict=True)):
        for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-6, atol=2e-7,
                                       err_msg=f"update {i + 1} {jax.tree_util.keystr(path)}")
    for x, y in zip(jax.tree.leaves(runs["streamed"][1]), jax.tree.leaves(runs["streamed"][2]), strict=True):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x)) if np.ndim(x) else None  # skipped: unchanged

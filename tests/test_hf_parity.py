"""Logit parity with HF transformers (golden fixtures made by tests/fixtures/make_hf_fixtures.py)
and the HF checkpoint round trip."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import FIXTURES
from glm46_jax import sharding
from glm46_jax.hf import load_hf, save_hf
from glm46_jax.model import apply

CASES = ["hf_full", "hf_air"]


def _forward(mesh, graphdef, params, buffers, gold):
    with sharding.use_mesh(mesh):
        fn = jax.jit(lambda p, b, t, pos: apply(graphdef, p, b, t, pos))
        return fn(params, buffers, jnp.asarray(gold["input_ids"]), jnp.asarray(gold["position_ids"]))


@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf_golden(case, mesh1):
    d = os.path.join(FIXTURES, case)
    gold = np.load(os.path.join(d, "golden.npz"))
    cfg, graphdef, params, buffers = load_hf(d, mesh1)
    out = _forward(mesh1, graphdef, params, buffers, gold)
    k = cfg.num_experts_per_tok

    err = np.abs(np.asarray(out.logits) - gold["logits"]).max()
    assert err <= 1e-4, f"main logits max |Δ| = {err}"
    # Our MTP rows cover all T positions (the last has no target); HF's cover T-1.
    mtp_err = np.abs(np.asarray(out.mtp_logits)[:, :-1] - gold["mtp_logits"]).max()
    assert mtp_err <= 1e-4, f"MTP logits max |Δ| = {mtp_err}"
    topk = np.sort(np.asarray(out.aux["router_topk"]).reshape(cfg.num_moe_layers, -1, k), -1)
    np.testing.assert_array_equal(topk, gold["router_topk"])
    mtp_topk = np.sort(np.asarray(out.aux["mtp"]["router_topk"])[:, :-1].reshape(1, -1, k), -1)
    np.testing.assert_array_equal(mtp_topk, gold["mtp_router_topk"])
    print(f"{case}: logits max|Δ|={err:.2e} mtp max|Δ|={mtp_err:.2e}")


def _fuse_experts(src: str, dst: str, num_layers: int, num_experts: int):
    """Rewrite a released-layout checkpoint with transformers-5 fused expert names."""
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    t = load_file(os.path.join(src, "model.safetensors"))
    for layer in range(num_layers + 1):
        p = f"model.layers.{layer}.mlp.experts."
        if f"{p}0.gate_proj.weight" not in t:
            continue
        gate_up, down = [], []
        for e in range(num_experts):
            gate_up.append(np.concatenate([t.pop(f"{p}{e}.gate_proj.weight"), t.pop(f"{p}{e}.up_proj.weight")]))
            down.append(t.pop(f"{p}{e}.down_proj.weight"))
        t[p + "gate_up_proj"], t[p + "down_proj"] = np.stack(gate_up), np.stack(down)
    save_file(t, os.path.join(dst, "model.safetensors"))


def test_fused_expert_names_load_identically(tmp_path, mesh1):
    d = os.path.join(FIXTURES, "hf_full")
    cfg, _, params, buffers = load_hf(d, mesh1)
    fused = str(tmp_path / "fused")
    _fuse_experts(d, fused, cfg.num_hidden_layers, cfg.n_routed_experts)
    _, _, params2, buffers2 = load_hf(fused, mesh1)
    for a, b in zip(jax.tree.leaves((params, buffers)), jax.tree.leaves((params2, buffers2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("case", CASES)
def test_save_reproduces_released_tensors_and_round_trips(case, tmp_path, mesh1):
    d = os.path.join(FIXTURES, case)
    cfg, _, params, buffers = load_hf(d, mesh1)
    out = str(tmp_path / "export")
    save_hf(out, cfg, params, buffers, dtype="float32", mtp_copies=True)
    original = load_file(os.path.join(d, "model.safetensors"))
    written = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        np.testing.assert_array_equal(written[name], tensor, err_msg=name)
    cfg2, _, params2, buffers2 = load_hf(out, mesh1)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves((params, buffers)), jax.tree.leaves((params2, buffers2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_export_and_shards(tmp_path, mesh1):
    d = os.path.join(FIXTURES, "hf_full")
    cfg, _, params, buffers = load_hf(d, mesh1)
    out = str(tmp_path / "bf16")
    save_hf(out, cfg, params, buffers, dtype="bfloat16", max_shard_bytes=64 * 1024)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    assert len(files) > 1
    tensors = {k: v for f in files for k, v in load_file(os.path.join(out, f)).items()}
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert tensors[bias].dtype == np.float32  # released checkpoints keep it fp32
    assert tensors["model.layers.1.self_attn.q_proj.weight"].dtype == ml_dtypes.bfloat16
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    _, _, params2, _ = load_hf(out, mesh1)
    want = np.asarray(params["embed_tokens"].get_value()).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(params2["embed_tokens"].get_value()), want)


def _broken_copy(tmp_path, edit):
    src = os.path.join(FIXTURES, "hf_air")
    dst = tmp_path / "broken"
    dst.mkdir()
    shutil.copy(os.path.join(src, "config.json"), dst)
    t = load_file(os.path.join(src, "model.safetensors"))
    edit(t)
    save_file(t, str(dst / "model.safetensors"))
    return str(dst)


def test_missing_tensor_names_it_and_its_shape(tmp_path, mesh1):
    d = _broken_copy(tmp_path, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(KeyError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight.*\[16, 32\]"):
        load_hf(d, mesh1)


def test_misshaped_tensor_names_it_and_both_shapes(tmp_path, mesh1):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((30, 32), np.float32)
    d = _broken_copy(tmp_path, edit)
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\[30, 32\].*expected \[32, 32\]"):
        load_hf(d, mesh1)


def test_unexpected_tensor_is_not_silently_dropped(tmp_path, mesh1):
    def edit(t):
        t["model.layers.7.mlp.gate.weight"] = np.zeros((8, 32), np.float32)
    d = _broken_copy(tmp_path, edit)
    with pytest.raises(ValueError, match=r"model\.layers\.7\.mlp\.gate\.weight"):
        load_hf(d, mesh1)


def test_missing_directory(tmp_path, mesh1):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(str(tmp_path / "nope"), mesh1)

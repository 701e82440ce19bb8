"""Logit parity with HF transformers (golden fixtures made by tests/fixtures/make_hf_fixtures.py)
and the HF checkpoint round trip."""

import json
import logging
import os
import re
import shutil

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import FIXTURES, jitted_apply
from glm46_jax.parallel import sharding
from glm46_jax.errors import InputError
from glm46_jax.interop.hf import load_hf, read_config, save_hf
from glm46_jax.model import apply

CASES = ["hf_full", "hf_air", "hf_mqa"]


def _forward(mesh, graphdef, params, buffers, gold):
    with sharding.use_mesh(mesh):
        return jitted_apply(graphdef)(params, buffers, jnp.asarray(gold["input_ids"]), jnp.asarray(gold["position_ids"]))


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


# One KV head (hf_mqa, issue 27) where `tensor` has 2 devices: each holds a copy of it. The golden rows are tiled to
# fill the data x expert batch shards; the context mesh runs blockwise attention over load-balanced rows.
MQA_MESHES = {
    "data2-tensor2-expert2": ({"data": 2, "tensor": 2, "expert": 2}, "xla"),
    "data2-tensor2-context2-blockwise": ({"data": 2, "tensor": 2, "context": 2}, "blockwise"),
}


@pytest.mark.parametrize("mesh_id", MQA_MESHES)
def test_mqa_logits_match_hf_golden_on_8_devices(mesh_id):
    shape, impl = MQA_MESHES[mesh_id]
    d = os.path.join(FIXTURES, "hf_mqa")
    gold = np.load(os.path.join(d, "golden.npz"))
    ids = np.tile(gold["input_ids"], (2, 1))
    b, s = ids.shape
    mesh = sharding.make_mesh(shape, cfg=read_config(d, attention_impl=impl), global_batch=b)
    cfg, graphdef, params, buffers = load_hf(d, mesh, attention_impl=impl)
    assert params["dense_layers"]["self_attn"]["k_proj"].get_value().sharding.spec == jax.P(None, "data", None, None)
    order = sharding.load_balanced_order(s, shape.get("context", 1))  # slot j holds token order[j]
    with sharding.use_mesh(mesh):
        fn = jax.jit(lambda p, bu, t, pos, nxt: apply(graphdef, p, bu, t, pos, next_tokens=nxt))
        out = fn(params, buffers, jnp.asarray(ids[:, order]), jnp.asarray(np.broadcast_to(order, (b, s))),
                 jnp.asarray(np.roll(ids, -1, axis=1)[:, order]))
    logits, mtp_logits = np.empty((b, s, cfg.vocab_size), np.float32), np.empty((b, s, cfg.vocab_size), np.float32)
    logits[:, order], mtp_logits[:, order] = np.asarray(out.logits), np.asarray(out.mtp_logits)
    for rows in (slice(0, 2), slice(2, 4)):
        err = np.abs(logits[rows] - gold["logits"]).max()
        assert err <= 1e-4, f"main logits max |Δ| = {err}"
        mtp_err = np.abs(mtp_logits[rows, :-1] - gold["mtp_logits"]).max()
        assert mtp_err <= 1e-4, f"MTP logits max |Δ| = {mtp_err}"


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
    chex.assert_trees_all_equal((params, buffers), (params2, buffers2))


@pytest.mark.parametrize("case", ["hf_full", "hf_air"])
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
    chex.assert_trees_all_equal((params, buffers), (params2, buffers2))


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
    with pytest.raises(InputError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight.*\[16, 32\]"):
        load_hf(d, mesh1)


def test_misshaped_tensor_names_it_and_both_shapes(tmp_path, mesh1):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((30, 32), np.float32)
    d = _broken_copy(tmp_path, edit)
    with pytest.raises(InputError, match=r"k_proj\.weight.*\[30, 32\].*expected \[32, 32\]"):
        load_hf(d, mesh1)


def test_unexpected_tensor_is_not_silently_dropped(tmp_path, mesh1):
    def edit(t):
        t["model.layers.7.mlp.gate.weight"] = np.zeros((8, 32), np.float32)
    d = _broken_copy(tmp_path, edit)
    with pytest.raises(InputError, match=r"model\.layers\.7\.mlp\.gate\.weight"):
        load_hf(d, mesh1)


def test_missing_directory(tmp_path, mesh1):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(str(tmp_path / "nope"), mesh1)


def without_mtp(src: str, dst: str, keep=lambda name: False) -> str:
    """`src` as transformers' `save_pretrained` writes it: config.json unchanged (still
    num_nextn_predict_layers=1) but no MTP tensors (layer `num_hidden_layers`), the rest in two shards
    with their index. MTP tensors for which `keep(name)` is true stay (a partially dropped layer)."""
    with open(os.path.join(src, "config.json")) as f:
        mtp = f"model.layers.{json.load(f)['num_hidden_layers']}."
    t = load_file(os.path.join(src, "model.safetensors"))
    t = {k: v for k, v in t.items() if not k.startswith(mtp) or keep(k)}
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    names = sorted(t)
    halves = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, keys in halves.items():
        save_file({k: t[k] for k in keys}, os.path.join(dst, fname), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(v.nbytes for v in t.values())},
             "weight_map": {k: fname for fname, keys in halves.items() for k in keys}}
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return dst


@pytest.mark.parametrize("case", CASES)
def test_dir_saved_by_transformers_without_mtp_loads_the_main_model(case, tmp_path, mesh1, caplog):
    d = without_mtp(os.path.join(FIXTURES, case), str(tmp_path / "no_mtp"))
    gold = np.load(os.path.join(FIXTURES, case, "golden.npz"))
    with caplog.at_level(logging.WARNING):
        cfg, graphdef, params, buffers = load_hf(d, mesh1)
    warnings = [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert re.search(r"no MTP tensors \(model\.layers\.3\.\*", warnings[0]), warnings[0]
    assert cfg.num_nextn_predict_layers == 0 and "mtp" not in params and "mtp" not in buffers

    out = _forward(mesh1, graphdef, params, buffers, gold)
    assert out.mtp_logits is None
    err = np.abs(np.asarray(out.logits) - gold["logits"]).max()
    assert err <= 1e-4, f"main logits max |Δ| = {err}"
    topk = np.sort(np.asarray(out.aux["router_topk"]).reshape(cfg.num_moe_layers, -1, cfg.num_experts_per_tok), -1)
    np.testing.assert_array_equal(topk, gold["router_topk"])


@pytest.mark.parametrize("drop_also, keep_mtp, missing", [
    # One MTP tensor dropped: the layer is partially there, so it must be complete.
    ((), lambda k: k != "model.layers.3.eh_proj.weight", r"'model\.layers\.3\.eh_proj\.weight' \(expected shape \[32, 64\]\)"),
    # Only the MTP layer's copies of the embedding and head left: still a partial layer.
    ((), lambda k: k.endswith((".embed_tokens.weight", ".shared_head.head.weight")), r"'model\.layers\.3\.[^']+' .* is missing"),
    # The whole MTP layer absent is tolerated, a missing main-model tensor is not.
    (("model.layers.1.mlp.gate.weight",), lambda k: False, r"'model\.layers\.1\.mlp\.gate\.weight' \(expected shape \[8, 32\]\)"),
], ids=["one-mtp-tensor-missing", "only-mtp-copies-left", "main-tensor-missing"])
def test_partially_missing_mtp_or_main_tensor_still_fails(drop_also, keep_mtp, missing, tmp_path, mesh1):
    d = without_mtp(os.path.join(FIXTURES, "hf_full"), str(tmp_path / "broken"), keep_mtp)
    for name in drop_also:  # rewrite the shard holding it, and the index
        with open(os.path.join(d, "model.safetensors.index.json")) as f:
            index = json.load(f)
        fname = index["weight_map"].pop(name)
        t = load_file(os.path.join(d, fname))
        del t[name]
        save_file(t, os.path.join(d, fname), metadata={"format": "pt"})
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
    with pytest.raises(InputError, match=missing):
        load_hf(d, mesh1)

"""LoRA / DoRA adapters (glm46_jax.model.lora) and PEFT adapter directories (glm46_jax.interop.peft).

References: the base model's own logits (B = 0), float64 NumPy merges, hand-chained gradients of the merged
model, PeftModel logits from transformers + peft (tests/fixtures/make_peft_fixtures.py), a one-device run."""

import json
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FIXTURES, jitted_apply
from flax import nnx
from safetensors.numpy import load_file, save_file

from glm46_jax.parallel import sharding
from glm46_jax.errors import InputError
from glm46_jax.interop.hf import load_hf
from glm46_jax.model.lora import LoRAConfig, add_adapters, combine, merge_adapters, partition
from glm46_jax.training.loss import token_nll
from glm46_jax.model import apply
from glm46_jax.interop.peft import load_peft, save_peft

HF_FULL = os.path.join(FIXTURES, "hf_full")


@pytest.fixture(scope="module")
def base(mesh1):
    cfg, graphdef, params, buffers = load_hf(HF_FULL, mesh1)
    return cfg, graphdef, params, buffers, np.load(os.path.join(HF_FULL, "golden.npz"))["input_ids"]


def _logits(mesh, graphdef, params, buffers, ids):
    with sharding.use_mesh(mesh):
        return np.asarray(jitted_apply(graphdef)(params, buffers, jnp.asarray(ids)).logits)


def _randomize_b(adapters, seed=0, std=0.2):
    """Nonzero B (and perturbed DoRA magnitudes), so the adapters change the model."""
    flat = []
    for i, (path, var) in enumerate(nnx.to_flat_state(adapters)):
        v = var.get_value()
        noise = jax.random.normal(jax.random.key(seed * 1000 + i), v.shape) * std
        if path[-1] == "b":
            v = jax.device_put(noise, v.sharding)
        elif path[-1] == "magnitude":
            v = jax.device_put(v * (1 + noise), v.sharding)
        flat.append((path, var.replace(v)))
    return nnx.from_flat_state(flat)


ALL = LoRAConfig(rank=3, alpha=5.0, experts="per_expert")


def test_zero_b_is_the_base_model_bit_for_bit(base, mesh1):
    _cfg, graphdef, params, buffers, ids = base
    g, adapters, frozen, buf = add_adapters(graphdef, params, buffers, ALL, mesh1)
    assert all(path[-1] in ("a", "b") for path, _ in nnx.to_flat_state(adapters))
    np.testing.assert_array_equal(_logits(mesh1, g, combine(adapters, frozen), buf, ids),
                                  _logits(mesh1, graphdef, params, buffers, ids))


def test_dora_at_init_is_the_base_model(base, mesh1):
    _cfg, graphdef, params, buffers, ids = base
    g, adapters, frozen, buf = add_adapters(graphdef, params, buffers, LoRAConfig(rank=2, dora=True), mesh1)
    np.testing.assert_allclose(_logits(mesh1, g, combine(adapters, frozen), buf, ids),
                               _logits(mesh1, graphdef, params, buffers, ids), atol=2e-5)


def _flat(state):
    return {tuple(str(p) for p in path): np.asarray(v.get_value(), np.float64) for path, v in nnx.to_flat_state(state)}


@pytest.mark.parametrize("experts", ["per_expert", "shared"])
def test_merged_weights_are_base_plus_scaled_ab_in_float64(base, mesh1, experts):
    _cfg, graphdef, params, buffers, _ = base
    lcfg = LoRAConfig(rank=3, alpha=5.0, rslora=True, experts=experts)
    assert lcfg.scale == 5.0 / np.sqrt(3)
    g, adapters, frozen, buf = add_adapters(graphdef, params, buffers, lcfg, mesh1)
    adapters = _randomize_b(adapters)
    _, merged = merge_adapters(g, adapters, frozen, buf, mesh1)
    before, after, ad = _flat(params), _flat(merged), _flat(adapters)
    s = 5.0 / np.sqrt(3)
    checked = set()
    for key, w in before.items():
        lora = key[:-1] + (key[-1] + "_lora",)
        if lora + ("a",) not in ad:
            np.testing.assert_array_equal(after[key], w)
            continue
        a, b = ad[lora + ("a",)], ad[lora + ("b",)]
        if key[-1] == "o_proj":  # [L, h, c, d]: A [L, h, c, r], B [L, r, d]
            want = w + s * np.einsum("lhcr,lrd->lhcd", a, b)
        elif key[1] == "self_attn":  # [L, d, h, c]: A [L, d, r], B [L, r, h, c]
            want = w + s * np.einsum("ldr,lrhc->ldhc", a, b)
        elif key[:3] == ("moe_layers", "mlp", key[2]) and w.ndim == 4:  # routed [L, E, in, out]
            want = w + s * (np.einsum("leir,lero->leio", a, b) if experts == "per_expert"
                            else np.einsum("lir,lro->lio", a, b)[:, None])
        else:  # dense MLP / shared expert [L, in, out]
            want = w + s * np.einsum("lir,lro->lio", a, b)
        np.testing.assert_allclose(after[key], want, rtol=1e-6, atol=1e-6)
        checked.add(key[-1] if key[1] == "self_attn" else ".".join(key[1:]))
    assert checked == {"q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                       "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"}


def test_dora_merge_matches_peft_definition_in_float64(base, mesh1):
    _cfg, graphdef, params, buffers, _ = base
    g, adapters, frozen, buf = add_adapters(graphdef, params, buffers, LoRAConfig(rank=2, alpha=3.0, dora=True,
                                                                                  targets=("o_proj", "q_proj")), mesh1)
    adapters = _randomize_b(adapters, seed=3)
    _, merged = merge_adapters(g, adapters, frozen, buf, mesh1)
    w, ad = _flat(params)[("moe_layers", "self_attn", "o_proj")], _flat(adapters)
    a, b, m = (ad[("moe_layers", "self_attn", "o_proj_lora", k)] for k in ("a", "b", "magnitude"))
    # PEFT: W [out, in]; norm over dim 1 (the inputs) per output feature; ours is [L, h, c, d] = [L, in..., out]
    v = w + 1.5 * np.einsum("lhcr,lrd->lhcd", a, b)
    want = m[:, None, None, :] * v / np.sqrt((v ** 2).sum(axis=(1, 2), keepdims=True))
    np.testing.assert_allclose(_flat(merged)[("moe_layers", "self_attn", "o_proj")], want, rtol=1e-5, atol=1e-6)


def _loss_fn(graphdef, buffers, ids):
    def loss(params):
        logits = apply(graphdef, params, buffers, ids, with_mtp=False).logits
        return jnp.mean(token_nll(logits, jnp.roll(ids, -1, axis=1)))
    return loss


def test_lora_gradients_are_the_merged_models_chained_by_hand(base, mesh1):
    _cfg, graphdef, params, buffers, ids = base
    lcfg = LoRAConfig(rank=2, alpha=4.0, targets=("q_proj", "o_proj", "shared_experts.down_proj", "mlp.gate_proj"))
    g, adapters, frozen, buf = add_adapters(graphdef, params, buffers, lcfg, mesh1)
    adapters = _randomize_b(adapters, seed=5)
    plain, merged = merge_adapters(g, adapters, frozen, buf, mesh1)
    with sharding.use_mesh(mesh1):
        ids = jnp.asarray(ids)
        grads = jax.jit(jax.grad(lambda a: _loss_fn(g, buf, ids)(combine(a, frozen))))(adapters)
        dw = jax.jit(jax.grad(_loss_fn(plain, buf, ids)))(merged)
    grads, dw, ad = _flat(grads), _flat(dw), _flat(adapters)
    s = lcfg.scale
    for key in [k[:-1] for k in ad if k[-1] == "a"]:
        wkey = key[:-1] + (key[-1].removesuffix("_lora"),)
        a, b, d = ad[key + ("a",)], ad[key + ("b",)], dw[wkey]
        n_in = a.ndim - 2  # [L, *in, r]
        lead = d.shape[0]
        d2 = d.reshape(lead, int(np.prod(d.shape[1:1 + n_in])), -1)  # dL/dW as [L, in, out]
        a2, b2 = a.reshape(lead, -1, a.shape[-1]), b.reshape(lead, b.shape[1], -1)
        da = s * np.einsum("lio,lro->lir", d2, b2)  # W = W0 + s A B: dA = s dW B^T, dB = s A^T dW
        db = s * np.einsum("lir,lio->lro", a2, d2)
        np.testing.assert_allclose(grads[key + ("a",)].reshape(da.shape), da, rtol=2e-4, atol=1e-7)
        np.testing.assert_allclose(grads[key + ("b",)].reshape(db.shape), db, rtol=2e-4, atol=1e-7)
        assert np.abs(da).max() > 0 and np.abs(db).max() > 0


def test_only_adapters_change_after_an_optimizer_step(base, mesh1):
    _cfg, graphdef, params, buffers, ids = base
    g, adapters, frozen, buf = add_adapters(graphdef, params, buffers, LoRAConfig(rank=2, base_dtype="bfloat16"),
                                            mesh1)
    assert {v.get_value().dtype for _, v in nnx.to_flat_state(frozen)} == {jnp.dtype(jnp.bfloat16)}
    assert {v.get_value().dtype for _, v in nnx.to_flat_state(adapters)} == {jnp.dtype(jnp.float32)}
    adapters = _randomize_b(adapters, seed=1)  # B = 0 would leave A's first gradient (s dW B^T) at zero
    tx = optax.adam(1e-2)
    with sharding.use_mesh(mesh1):
        ids = jnp.asarray(ids)

        @jax.jit
        def step(adapters, frozen, buffers, opt_state):
            grads = jax.grad(lambda a: _loss_fn(g, buffers, ids)(combine(a, frozen)))(adapters)
            updates, opt_state = tx.update(grads, opt_state, adapters)
            return combine(optax.apply_updates(adapters, updates), frozen), buffers

        new_params, new_buffers = step(adapters, frozen, buf, tx.init(adapters))
    new_adapters, new_base = partition(new_params)
    before, after = _flat(adapters), _flat(new_adapters)
    assert sorted(before) == sorted(after)
    assert all(not np.array_equal(before[k], after[k]) for k in before), "every adapter leaf moves"
    # The base is the loaded checkpoint cast to bf16, bit for bit; the buffers are the loaded ones.
    chex.assert_trees_all_equal(new_base, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
    chex.assert_trees_all_equal(new_buffers, buffers)


def test_sharded_equals_single_device(base, mesh1):
    _cfg, graphdef, params, buffers, ids = base
    ids = np.concatenate([ids, ids[:, ::-1]])  # the batch splits over data x expert = 4
    lcfg = LoRAConfig(rank=2, alpha=3.0, dora=True, experts="per_expert")
    g, adapters, frozen, buf = add_adapters(graphdef, params, buffers, lcfg, mesh1)
    adapters = _randomize_b(adapters, seed=7)
    want = _logits(mesh1, g, combine(adapters, frozen), buf, ids)
    mesh8 = sharding.make_mesh({"data": 2, "tensor": 2, "expert": 2}, jax.devices()[:8])
    _, g8, p8, b8 = load_hf(HF_FULL, mesh8)
    g8, ad8, fr8, buf8 = add_adapters(g8, p8, b8, lcfg, mesh8)
    ad8 = jax.tree.map(lambda x, ref: jax.device_put(np.asarray(ref), x.sharding), ad8, adapters)
    q_b = nnx.to_flat_state(ad8)
    assert any(v.get_value().sharding.spec != jax.P() and "tensor" in str(v.get_value().sharding.spec)
               for _, v in q_b), "adapters are sharded like their weights"
    np.testing.assert_allclose(_logits(mesh8, g8, combine(ad8, fr8), buf8, ids), want, atol=2e-5)


@pytest.mark.parametrize("case", ["peft_lora", "peft_dora"])
def test_peft_import_matches_peftmodel_logits(base, mesh1, case):
    _cfg, graphdef, params, buffers, _ = base
    d = os.path.join(FIXTURES, case)
    gold = np.load(os.path.join(d, "golden.npz"))
    lcfg, g, adapters, frozen, buf = load_peft(d, graphdef, params, buffers, mesh1)
    peft_cfg = _json(os.path.join(d, "adapter_config.json"))
    assert (lcfg.rank, lcfg.alpha, lcfg.rslora, lcfg.dora) == (peft_cfg["r"], peft_cfg["lora_alpha"],
                                                               peft_cfg["use_rslora"], peft_cfg["use_dora"])
    out = _logits(mesh1, g, combine(adapters, frozen), buf, gold["input_ids"])
    err = np.abs(out - gold["logits"]).max()
    assert err <= 1e-4, f"{case}: logits max |Δ| vs PeftModel = {err}"
    assert np.abs(_logits(mesh1, graphdef, params, buffers, gold["input_ids"]) - gold["logits"]).max() > 1e-1


@pytest.mark.parametrize("case", ["peft_lora", "peft_dora"])
def test_peft_export_import_round_trip_is_bit_identical(base, mesh1, tmp_path, case):
    cfg, graphdef, params, buffers, _ = base
    d = os.path.join(FIXTURES, case)
    lcfg, g, adapters, _frozen, _buf = load_peft(d, graphdef, params, buffers, mesh1)
    save_peft(str(tmp_path / "out"), cfg, lcfg, adapters, "tests/fixtures/hf_full")
    # What PEFT wrote, tensor for tensor (names, shapes, dtypes and bits)...
    ours, theirs = load_file(str(tmp_path / "out" / "adapter_model.safetensors")), \
        load_file(os.path.join(d, "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        assert ours[k].dtype == theirs[k].dtype and np.array_equal(ours[k], theirs[k]), k
    written = _json(tmp_path / "out" / "adapter_config.json")
    peft_cfg = _json(os.path.join(d, "adapter_config.json"))
    for field in ("peft_type", "task_type", "r", "lora_alpha", "use_rslora", "use_dora", "target_modules", "bias"):
        assert written[field] == peft_cfg[field], field
    # ... and back: the same adapters.
    lcfg2, g2, adapters2, _, _ = load_peft(str(tmp_path / "out"), graphdef, params, buffers, mesh1)
    assert lcfg2 == lcfg and g2 == g
    chex.assert_trees_all_equal(adapters2, adapters)


def test_export_refuses_mlp_adapters(base, mesh1, tmp_path):
    cfg, graphdef, params, buffers, _ = base
    for lcfg in (LoRAConfig(targets=("q_proj", "shared_experts.up_proj")),
                 LoRAConfig(targets=("experts.down_proj",), experts="shared")):
        _, adapters, _, _ = add_adapters(graphdef, params, buffers, lcfg, mesh1)
        with pytest.raises(InputError, match="no PEFT form") as e:
            save_peft(str(tmp_path / "x"), cfg, lcfg, adapters)
        assert "\n" not in str(e.value)


def _json(path):
    with open(path) as f:
        return json.load(f)


def _copy(tmp_path, name="bad"):
    d = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, "peft_lora"), d)
    return d


@pytest.mark.parametrize("change,match", [
    (lambda t: {k.replace("model.model.layers", "model.transformer.h"): v for k, v in t.items()}, "another arch"),
    (lambda t: {k: (np.zeros((4, 48), np.float32) if "q_proj.lora_A" in k else v) for k, v in t.items()},
     "another model"),
    (lambda t: {k: v for k, v in t.items() if "layers.2." not in k}, "needs one"),
])
def test_peft_import_errors_are_one_line(base, mesh1, tmp_path, change, match):
    _cfg, graphdef, params, buffers, _ = base
    d = _copy(tmp_path)
    save_file(change(load_file(str(d / "adapter_model.safetensors"))), str(d / "adapter_model.safetensors"))
    with pytest.raises(InputError, match=match) as e:
        load_peft(str(d), graphdef, params, buffers, mesh1)
    assert "\n" not in str(e.value)


def test_peft_config_errors_are_one_line(base, mesh1, tmp_path):
    _cfg, graphdef, params, buffers, _ = base
    for edit, match in (({"peft_type": "IA3"}, "only LORA"), ({"r": 0}, "lora.rank=0"),
                        ({"target_parameters": ["gate_up_proj"]}, "target_parameters")):
        d = _copy(tmp_path, f"c{len(os.listdir(tmp_path))}")
        (d / "adapter_config.json").write_text(json.dumps({**_json(d / "adapter_config.json"), **edit}))
        with pytest.raises(InputError, match=match) as e:
            load_peft(str(d), graphdef, params, buffers, mesh1)
        assert "\n" not in str(e.value)


def test_config_errors_are_one_line(base, mesh1):
    _cfg, graphdef, params, buffers, _ = base
    for kwargs, match in (({"rank": 0}, "lora.rank=0"), ({"rank": -2}, "lora.rank=-2"),
                          ({"experts": "all"}, "lora.experts"), ({"dropout": 0.1}, "lora.dropout"),
                          ({"alpha": 0}, "lora.alpha")):
        with pytest.raises(InputError, match=match) as e:
            LoRAConfig(**kwargs)
        assert "\n" not in str(e.value)
    with pytest.raises(InputError, match="'qkv_proj' names no adaptable weight") as e:
        add_adapters(graphdef, params, buffers, LoRAConfig(targets=("q_proj", "qkv_proj")), mesh1)
    assert "\n" not in str(e.value)
    with pytest.raises(InputError, match="names no adaptable weight"):  # routed experts need lora.experts
        add_adapters(graphdef, params, buffers, LoRAConfig(targets=("experts.gate_proj",)), mesh1)

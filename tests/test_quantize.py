"""The FP8 / W4A16 quantizer (glm46_jax/interop/quantize.py) against float64 NumPy and hand-computed values.

The serving venv's loaders (transformers, compressed-tensors, vLLM) check the same exports in tests/serving/.
"""

import json
import os
import re

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from glm46_jax.errors import InputError
from glm46_jax.interop import convert
from glm46_jax.interop import quantize as qz
from tests.safetensors_file import read_safetensors
from tests.test_score import assert_one_line_error, run_cli

# Every finite FP8-E4M3 value, for a nearest-value search that does not use ml_dtypes' cast.
_FP8_VALUES = np.unique(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64))
_FP8_VALUES = _FP8_VALUES[np.isfinite(_FP8_VALUES)]


def _nearest_fp8(x: np.ndarray) -> np.ndarray:
    """Round to the nearest E4M3 value, ties to the one with an even mantissa (IEEE round-half-even)."""
    x = np.clip(x, -448.0, 448.0)
    idx = np.searchsorted(_FP8_VALUES, x)
    lo, hi = _FP8_VALUES[np.clip(idx - 1, 0, None)], _FP8_VALUES[np.clip(idx, None, len(_FP8_VALUES) - 1)]
    pick_hi = (hi - x < x - lo) | ((hi - x == x - lo) & (_mantissa_even(hi)))
    return np.where(pick_hi, hi, lo)


def _mantissa_even(v: np.ndarray) -> np.ndarray:
    return (v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8) & 1) == 0


@pytest.fixture(scope="module")
def weight():
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.02, (256, 384)).astype(np.float32)
    w[3] *= 50  # one loud channel, one loud block
    w[:, 0] = 0.0
    w[128:256, 128:256] = 0.0  # an all-zero block and group: eps scale, zeros back
    return w


def test_fp8_channel_weights_are_the_nearest_e4m3_values_of_w_over_amax_448(weight):
    t = qz.quantize_weight(weight, "fp8_dynamic")
    w = weight.astype(np.float64)
    scale = np.abs(w).max(axis=1, keepdims=True) / 448.0
    np.testing.assert_allclose(t["weight_scale"], scale, rtol=1e-7)
    assert t["weight_scale"].dtype == np.float32 and t["weight_scale"].shape == (256, 1)
    # The quotient is float32's (IEEE division, as compressed-tensors computes it); rounding it is what is checked.
    expected = _nearest_fp8((weight / t["weight_scale"]).astype(np.float64))
    np.testing.assert_array_equal(t["weight"].astype(np.float64), expected)
    deq = qz.dequantize_weight(t, "fp8_dynamic")
    np.testing.assert_array_equal(deq, (expected * t["weight_scale"]).astype(np.float32))
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 on values above the subnormal range.
    big = np.abs(w) > 2.0**-6 * scale
    assert np.all(np.abs(deq - w)[big] <= 2.0**-4 * np.abs(w)[big] + 1e-12)


def test_fp8_block_scales_are_per_128x128_block(weight):
    t = qz.quantize_weight(weight, "fp8_block")
    w = weight.astype(np.float64)
    assert t["weight_scale"].shape == (2, 3)
    for bi in range(2):
        for bj in range(3):
            block = w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
            amax = np.abs(block).max()
            expected_scale = amax / 448.0 if amax else np.finfo(np.float32).eps
            np.testing.assert_allclose(t["weight_scale"][bi, bj], expected_scale, rtol=1e-7)
            q = t["weight"][bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128].astype(np.float64)
            quotient = (block.astype(np.float32) / t["weight_scale"][bi, bj]).astype(np.float64)
            np.testing.assert_array_equal(q, _nearest_fp8(quotient))
    assert not np.any(qz.dequantize_weight(t, "fp8_block")[128:, 128:256])


def test_int4_packing_matches_the_hand_computed_words():
    # Nibbles from the lowest: q + 8 = 8, 9, ..., 15 -> 0xFEDCBA98; q = -8 everywhere -> 0.
    q = np.array([[0, 1, 2, 3, 4, 5, 6, 7], [-8] * 8, [-1, 0, 0, 0, 0, 0, 0, 0]], np.int8)
    packed = qz.pack_int4(q)
    assert packed.dtype == np.int32
    assert packed.view(np.uint32).ravel().tolist() == [0xFEDCBA98, 0x00000000, 0x88888887]
    np.testing.assert_array_equal(qz.unpack_int4(packed, (3, 8)), q)


def test_w4a16_groups_round_to_nearest_in_minus8_to_7(weight):
    t = qz.quantize_weight(weight, "w4a16")
    w = weight.astype(np.float64)
    assert t["weight_packed"].shape == (256, 48) and t["weight_scale"].shape == (256, 3)
    assert t["weight_shape"].tolist() == [256, 384]
    groups = w.reshape(256, 3, 128)
    amax = np.abs(groups).max(axis=2)
    np.testing.assert_allclose(t["weight_scale"], np.where(amax > 0, amax / 7.5, np.finfo(np.float32).eps),
                               rtol=1e-7)
    q = qz.unpack_int4(t["weight_packed"], (256, 384)).astype(np.float64).reshape(256, 3, 128)
    scale = t["weight_scale"].astype(np.float64)[:, :, None]
    quotient = (weight.reshape(256, 3, 128) / t["weight_scale"][:, :, None]).astype(np.float64)
    np.testing.assert_array_equal(q, np.clip(np.round(quotient), -8, 7))
    deq = qz.dequantize_weight(t, "w4a16")
    # Round to nearest: half a step (the clamp of +7.5 to 7 is half a step too), plus float32 rounding.
    assert np.all(np.abs(deq - w).reshape(256, 3, 128) <= scale * (0.5 + 1e-6))


def _fake_export(root: str, *, hidden: int = 256, quantized: bool = False) -> str:
    """An export's file layout with the names `convert ckpt-to-hf` writes (two shards), random tensors."""
    d = os.path.join(root, f"export_{hidden}{'_q' if quantized else ''}")
    os.makedirs(d)
    rng = np.random.default_rng(1)
    bf = ml_dtypes.bfloat16

    def r(*shape):
        return rng.normal(0, 0.05, shape).astype(bf)

    first = {"model.embed_tokens.weight": r(512, hidden), "model.layers.0.self_attn.q_proj.weight": r(256, hidden),
             "model.layers.0.self_attn.q_proj.bias": r(256), "model.layers.0.mlp.down_proj.weight": r(hidden, 512),
             "model.layers.0.input_layernorm.weight": r(hidden)}
    second = {"model.layers.1.mlp.gate.weight": r(8, hidden), "model.layers.1.mlp.experts.3.up_proj.weight":
              r(256, hidden), "model.layers.1.mlp.gate.e_score_correction_bias": np.zeros(8, np.float32),
              "model.layers.1.mlp.shared_experts.down_proj.weight": r(hidden, 256),
              "model.layers.2.eh_proj.weight": r(hidden, 2 * hidden), "model.layers.2.shared_head.head.weight":
              r(512, hidden), "lm_head.weight": r(512, hidden)}
    save_file(first, os.path.join(d, "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(second, os.path.join(d, "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {**{k: "model-00001-of-00002.safetensors" for k in first},
                                            **{k: "model-00002-of-00002.safetensors" for k in second}}}
    config = {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "hidden_size": hidden}
    if quantized:
        config["quantization_config"] = qz.quantization_config("fp8_dynamic")
    for name, content in {"model.safetensors.index.json": index, "config.json": config,
                          "generation_config.json": {"eos_token_id": 1}}.items():
        with open(os.path.join(d, name), "w") as f:
            json.dump(content, f)
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        f.write('{"fake": true}')
    return d


@pytest.mark.parametrize("scheme", qz.SCHEMES)
def test_an_export_is_rewritten_in_compressed_tensors_layout(scheme, tmp_path):
    src = _fake_export(str(tmp_path))
    out = convert.quantize_export(src, str(tmp_path / "out"), scheme)
    config = json.load(open(os.path.join(out, "config.json")))
    q = config.pop("quantization_config")
    assert config == {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 256}
    assert q["quant_method"] == "compressed-tensors" and q["format"] == ("pack-quantized" if scheme == "w4a16"
                                                                         else "float-quantized")
    assert q["ignore"] == ["lm_head", "re:.*mlp\\.gate$", "re:.*eh_proj$", "re:.*shared_head\\.head$"]
    for name in ("tokenizer.json", "generation_config.json"):
        assert open(os.path.join(out, name)).read() == open(os.path.join(src, name)).read()
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"]
    stored, source = {}, {}
    for shard in sorted(set(index.values())):
        stored.update(read_safetensors(os.path.join(out, shard)))
        source.update(read_safetensors(os.path.join(src, shard)))
    assert set(index) == set(stored)
    targets = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj",
               "model.layers.1.mlp.experts.3.up_proj", "model.layers.1.mlp.shared_experts.down_proj"]
    for module in targets:
        local = {k.rsplit(".", 1)[1]: v for k, v in stored.items()
                 if k.rsplit(".", 1)[0] == module and k.rsplit(".", 1)[1] != "bias"}
        w = source[f"{module}.weight"].astype(np.float32)
        expected = qz.quantize_weight(w, scheme)
        assert sorted(local) == sorted(expected), module
        for k in expected:
            np.testing.assert_array_equal(local[k].view(np.uint8), expected[k].view(np.uint8), err_msg=module)
    kept = sorted(set(source) - {f"{m}.weight" for m in targets})
    assert len(kept) == 8  # embeddings, head, head copy, router + its bias, eh_proj, a norm, a bias
    for name in kept:
        assert stored[name].dtype == source[name].dtype
        np.testing.assert_array_equal(stored[name], source[name], err_msg=name)


def test_bad_inputs_are_one_line_and_write_nothing(tmp_path):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("not an export")
    odd = _fake_export(str(tmp_path), hidden=192)  # 192 = 1.5 blocks / groups
    quantized = _fake_export(str(tmp_path), quantized=True)
    out = str(tmp_path / "out")
    # The command line once (error -> one line, exit 2: glm46_jax.cli.main_guard), the other cases in-process.
    proc = run_cli("glm46_jax.convert", "quantize", "--hf-dir", str(junk), "--out", out, "--scheme", "fp8_dynamic")
    assert_one_line_error(proc, f"{junk}: not a Hugging Face export (no config.json)")
    cases = [([_fake_export(str(tmp_path), hidden=128), "int3"], "--scheme 'int3': unknown"),
             ([odd, "fp8_block"], "model.layers.0.mlp.down_proj.weight [192, 512]: not divisible into fp8_block's "
                                  "128x128 blocks"),
             ([odd, "w4a16"], "model.layers.0.self_attn.q_proj.weight [256, 192]: not divisible into w4a16's groups "
                              "of 128 inputs"),
             ([quantized, "w4a16"], "already quantized (float-quantized)")]
    for (src, scheme), message in cases:
        with pytest.raises(InputError, match=re.escape(message)):
            convert.main(["quantize", "--hf-dir", src, "--out", out, "--scheme", scheme])
    assert not os.path.exists(out) and not [p for p in os.listdir(tmp_path) if ".partial-" in p]

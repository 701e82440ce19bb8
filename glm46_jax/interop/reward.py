"""A reward model (or critic) on disk: the causal-LM export plus the score head, and loading one back.

transformers has no `Glm4MoeForSequenceClassification`, so the export is the `Glm4MoeForCausalLM` directory that
`convert ckpt-to-hf` writes (servers and transformers load it as a language model) plus:

    score.safetensors   "score.weight" [outputs, hidden] (torch Linear layout, no bias)
    reward_model.json   {"score_head": outputs, "read_at": "last_token"}

A sequence's reward is score.weight @ h[t] for the final-normed hidden state h at its last token t (the last token
of the assistant's reply; docs/preferences.md#loading-a-reward-model). In torch:

    model = AutoModelForCausalLM.from_pretrained(d)
    w = safetensors.torch.load_file(f"{d}/score.safetensors")["score.weight"]
    reward = model.model(input_ids).last_hidden_state[:, -1] @ w.T        # right-aligned rows: the last position

    cfg, graphdef, params, buffers = load_reward_model(d, mesh)            # here: a model with cfg.score_head
"""

from __future__ import annotations

import os

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from glm46_jax import atomic
from glm46_jax.errors import InputError
from glm46_jax.config import ModelConfig
from glm46_jax.parallel import sharding

SCORE_FILE = "score.safetensors"
MARKER = "reward_model.json"


def save_score_head(out_dir: str, cfg: ModelConfig, params: nnx.State, dtype: str = "bfloat16") -> None:
    """Write the score head of `params` (a model with cfg.score_head) beside an HF export in `out_dir`."""
    w = np.asarray(jax.device_get(params["score"].get_value()), np.float32)  # [hidden, outputs]
    storage = np.dtype("float32") if dtype == "float32" else np.dtype(dtype) if dtype != "bfloat16" else None
    if storage is None:  # NumPy has no bfloat16: ml_dtypes' (what jax uses) writes safetensors' BF16
        import ml_dtypes
        storage = np.dtype(ml_dtypes.bfloat16)
    with atomic.atomic_path(os.path.join(out_dir, SCORE_FILE)) as tmp:
        save_file({"score.weight": np.ascontiguousarray(w.T.astype(storage))}, tmp, metadata={"format": "pt"})
    atomic.write_json(os.path.join(out_dir, MARKER), {"score_head": cfg.score_head, "read_at": "last_token"})


def is_reward_dir(path: str) -> bool:
    """An HF export with a score head (`save_score_head`)."""
    return os.path.isfile(os.path.join(path, SCORE_FILE)) and os.path.isfile(os.path.join(path, "config.json"))


def check_reward_dir(path: str) -> None:
    """`path` is a reward model (`load_reward_model` would load it), checked from its files alone: an InputError
    naming it otherwise."""
    if not os.path.isdir(path):
        raise InputError(f"{path}: no such reward-model directory (an export of a reward run: `python -m "
                         "glm46_jax.convert ckpt-to-hf --run-dir <reward run> --out DIR`, or the run itself)")
    if is_reward_dir(path):
        return
    from glm46_jax.training import checkpoint
    try:
        step_dir = checkpoint.latest_checkpoint(path)
    except FileNotFoundError:
        raise InputError(f"{path}: not a reward model (no {SCORE_FILE} beside a config.json, and no checkpoint of "
                         "a reward run); point it at a `reward` run or its ckpt-to-hf export") from None
    if not checkpoint.read_meta(step_dir)["model_config"].get("score_head"):
        raise InputError(f"{path}: its checkpoint {step_dir} is a language model without a score head, not a "
                         "reward model; point it at a `reward` run or its ckpt-to-hf export")


def load_reward_model(path: str, mesh: jax.sharding.Mesh, dtype: str = "float32"
                      ) -> tuple[ModelConfig, nnx.GraphDef, nnx.State, nnx.State]:
    """(cfg, graphdef, params, buffers) of a reward model: an HF export with score.safetensors, or a training run /
    checkpoint of one (a `reward` run). Anything else is an InputError naming `path`."""
    check_reward_dir(path)
    if is_reward_dir(path):
        return _load_hf_reward(path, mesh, dtype)
    from glm46_jax.training import checkpoint
    return checkpoint.load_params(checkpoint.latest_checkpoint(path), mesh, dtype=dtype)


def _load_hf_reward(path: str, mesh: jax.sharding.Mesh, dtype: str):
    from glm46_jax.interop.hf import load_hf
    from glm46_jax.model import abstract_model
    cfg, _, params, buffers = load_hf(path, mesh, dtype=dtype)
    tensors = load_file(os.path.join(path, SCORE_FILE))
    w = tensors.get("score.weight")
    if w is None or w.ndim != 2 or w.shape[1] != cfg.hidden_size or len(tensors) != 1:
        raise InputError(f"{os.path.join(path, SCORE_FILE)}: expected exactly one tensor 'score.weight' "
                         f"[outputs, {cfg.hidden_size}]; found {({k: v.shape for k, v in tensors.items()})}")
    cfg = cfg.replace(score_head=int(w.shape[0]))
    graphdef, abstract, _ = abstract_model(cfg, mesh)
    spec = abstract["score"].get_value()
    value = np.asarray(w, np.float32).T.astype(spec.dtype)
    with sharding.use_mesh(mesh):
        array = jax.make_array_from_callback(value.shape, spec.sharding, lambda index: value[index])
    flat = [*nnx.to_flat_state(params), (("score",), abstract["score"].replace(array))]
    return cfg, graphdef, nnx.from_flat_state(flat), buffers

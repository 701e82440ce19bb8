"""Names in the model's parameter tree: turning jax key paths into plain names, and which top-level
subtrees are stacked layers (a leading, unsharded "layers" axis)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

LAYER_STACKS = ("dense_layers", "moe_layers")  # leaves under these carry a leading, unsharded "layers" axis
# Weights the model reads only through a cast to its compute dtype (attention, MLP and expert projections, the
# MTP projection, the head), so a copy already in that dtype computes the same (training/offload.py). The router,
# embedding, norms, biases and adapters are read at their own precision.
COMPUTE_CAST = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "eh_proj",
                          "lm_head"})


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_names(path: str | Sequence[Any]) -> list[str]:
    if isinstance(path, str):
        return re.findall(r"\w+", path)
    return [n for n in map(_key_name, path) if n != "value"]  # nnx.State leaves end in `.value`

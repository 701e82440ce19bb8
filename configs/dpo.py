"""DPO configs (and IPO, SimPO by `preference.loss_type`): `get_config("<preset>")` for tiny | glm46.

    make dpo                                                   # tiny: after make train && make sft
    python -m glm46_jax.train --config=configs/dpo.py:tiny --config.preference.loss_type=ipo
    python -m glm46_jax.train --config=configs/dpo.py:glm46 --config.checkpoint.init_from=runs/sft_glm46/merged

The policy starts from `checkpoint.init_from` (an SFT run) and learns from chosen/rejected pairs prepared by
`python -m data_prep preferences` (docs/preferences.md). The reference is a frozen copy of the starting weights
(preference.method=full), the same base with the adapters off (lora: no second copy), or none (simpo). Held-out
metrics: the implicit-reward accuracy and margin, and `eval/len_norm_accuracy`, the share of held-out pairs whose
chosen reply has the higher mean token log-prob. Every other field is configs/pretrain.py's.
"""

import dataclasses
import os

import ml_collections

from glm46_jax.errors import InputError
from glm46_jax.model.lora import LoRAConfig
from glm46_jax.recipes.preference.config import PreferenceConfig
from glm46_jax.run_config import fine_tuning_config

_PRESETS = {
    # After make train && make sft: LoRA DPO of the chat model on the sample pairs (addition answers and chat
    # replies that end at the turn's end vs. ones that ramble). Measured (docs/preferences.md#the-cpu-demos): implicit-
    # reward accuracy 0 -> 0.72 on the 36 held-out pairs at lr 1e-3 or 5e-3; the chosen replies' mean log-prob fell
    # from -32 to -60 nats at 1e-3 and to -112 at 5e-3.
    "tiny": dict(
        base="tiny", init_from="runs/sft_tiny/merged", root="data/sample_preferences",
        preference=dict(method="lora", loss_type="sigmoid", beta=0.1, seq_len=512, global_batch=8, pairs_per_row=4),
        train=dict(steps=80, log_every=10, eval_every=40, eval_batches=4),
        checkpoint=dict(every=40, keep=1),
        optim=dict(lr=1e-3, end_lr=1e-4, warmup_steps=5, algorithm="adamw", weight_decay=0.0, clip=1.0),
        lora=dict(rank=16, alpha=32.0),
    ),
    "glm46": dict(
        base="glm46", init_from="", root="data/preferences",
        preference=dict(method="lora", loss_type="sigmoid", beta=0.1, seq_len=8192, global_batch=64, pairs_per_row=4),
        train=dict(log_every=10, eval_every=200, eval_batches=8),
        checkpoint=dict(every=200, keep=3),
        optim=dict(lr=5e-6, end_lr=5e-7, warmup_steps=50, algorithm="adamw", weight_decay=0.0),
        lora=dict(rank=64, alpha=128.0, base_dtype="bfloat16"),
    ),
}


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    if preset not in _PRESETS:
        raise InputError(f"unknown preset {preset!r}; choose one of {sorted(_PRESETS)}")
    p = _PRESETS[preset]
    c = fine_tuning_config(os.path.dirname(os.path.abspath(__file__)), "dpo", preset, p)
    c.preference = dataclasses.asdict(PreferenceConfig(root=p["root"], **p["preference"]))
    c.lora = dataclasses.asdict(LoRAConfig(**(p["lora"] or {})))
    return c

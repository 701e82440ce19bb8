"""Supervised fine-tuning configs: `get_config("<preset>")` for tiny | tiny_full | serve | glm46 | rl_addition |
agent_calc.

    make train && make sft                                   # tiny: LoRA on make train's run, the sample chats
    python -m glm46_jax.train --config=configs/sft.py:tiny --config.lora.rank=32 --config.lora.alpha=64
    python -m glm46_jax.train --config=configs/sft.py:glm46 --config.checkpoint.init_from=runs/glm46_hf \
        --config.sft.root=data/my_chats

The run starts from another run's weights (`checkpoint.init_from`: a pre-training run, or an HF import written
by `python -m glm46_jax.convert hf-to-ckpt`) and trains on conversations prepared by `python -m data_prep sft`,
with the loss on assistant tokens only. `sft.method` is "lora" (adapters on frozen weights; the checkpoints
hold only the adapters, and the run ends by writing the merged weights to <run_dir>/merged) or "full".
Held-out `eval/ce` is the assistant-token CE of the held-out conversations (docs/sft.md#the-sft-recipe).

Every other field is `configs/pretrain.py`'s. Fine-tuning comes after GLM's 15T boundary: the MTP weight is its
later 0.1 and loss-free balancing is off (the correction biases stay as pre-trained).
"""

import dataclasses
import os

import ml_collections

from glm46_jax.errors import InputError
from glm46_jax.model.lora import LoRAConfig
from glm46_jax.recipes.sft import SFTConfig
from glm46_jax.run_config import fine_tuning_config

_PRESETS = {
    # LoRA rank 16 on every attention projection and dense/shared-expert FFN of make train's run: ~120 steps
    # (10 nominal passes over the 50k-token sample chats), ~2.5 min on a 2-core CPU.
    "tiny": dict(
        base="tiny", init_from="runs/tiny", method="lora", root="data/sample_sft",
        sft=dict(seq_len=512, global_batch=8, epochs=10.0),
        train=dict(log_every=10, eval_every=50, eval_batches=4),
        checkpoint=dict(every=50, keep=2),
        optim=dict(lr=1e-2, end_lr=1e-3, warmup_steps=10, algorithm="adamw", weight_decay=0.0),
        lora=dict(rank=16, alpha=32.0),
    ),
    "glm46": dict(
        base="glm46", init_from="", method="lora", root="data/sft",
        sft=dict(seq_len=32768, global_batch=128, epochs=2.0),
        train=dict(log_every=10, eval_every=200, eval_batches=8),
        checkpoint=dict(every=200, keep=3),
        optim=dict(lr=1e-4, end_lr=1e-5, warmup_steps=100, algorithm="adamw", weight_decay=0.0),
        lora=dict(rank=64, alpha=128.0, base_dtype="bfloat16"),
    ),
}
# The RL demo's first stage (make rl, docs/rl.md#the-cpu-demo): the tiny model, from random weights, taught the
# addition chats of `python -m data_prep.rl_tasks` only partly (200 steps: held-out greedy accuracy 0.29 of 500),
# so that GRPO has accuracy to add.
_PRESETS["rl_addition"] = dict(
    base="tiny", init_from="", method="full", root="data/rl_addition/sft",
    sft=dict(seq_len=64, global_batch=16, epochs=1.0),
    train=dict(steps=200, log_every=25, eval_every=0, eval_batches=2),
    checkpoint=dict(every=1000, keep=1),
    optim=dict(lr=3e-3, end_lr=3e-4, warmup_steps=20, algorithm="adamw", weight_decay=0.0),
    lora=None,
)
# The agentic RL demo's first stage (make agent, docs/rl.md#agentic-rl): make train's model taught the calculator tool
# by 400 traces of `python -m data_prep.agent_tasks` (the call, then the answer copied from the tool's reply), only
# partly (150 steps: held-out success 0.585), so that agentic GRPO has success to add.
_PRESETS["agent_calc"] = dict(
    base="tiny", init_from="runs/tiny", method="full", root="data/agent_calc/sft",
    sft=dict(seq_len=96, global_batch=16, epochs=1.0),
    train=dict(steps=150, log_every=25, eval_every=0, eval_batches=2),
    checkpoint=dict(every=1000, keep=1),
    optim=dict(lr=3e-3, end_lr=3e-4, warmup_steps=20, algorithm="adamw", weight_decay=0.0),
    lora=None,
)
# The same run, every weight trained (held-out assistant CE 1.04 after the same 123 steps: benchmarks/RESULTS.md).
_PRESETS["tiny_full"] = {**_PRESETS["tiny"], "method": "full", "lora": None,
                         "optim": {**_PRESETS["tiny"]["optim"], "lr": 1e-3, "end_lr": 1e-4}}

# The serving tests' adapters (tests/serving/, docs/serving.md#lora-adapters): the same LoRA run on the serve model,
# on the attention projections only, the adapters PEFT (and so vLLM) can load (docs/lora.md#what-peft-can-express).
_PRESETS["serve"] = {**_PRESETS["tiny"], "base": "serve", "init_from": "runs/serve",
                     "lora": {**_PRESETS["tiny"]["lora"], "targets": ("q_proj", "k_proj", "v_proj", "o_proj")}}


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    if preset not in _PRESETS:
        raise InputError(f"unknown preset {preset!r}; choose one of {sorted(_PRESETS)}")
    p = _PRESETS[preset]
    c = fine_tuning_config(os.path.dirname(os.path.abspath(__file__)), "sft", preset, p)
    c.sft = dataclasses.asdict(SFTConfig(root=p["root"], method=p["method"], **p["sft"]))
    c.lora = dataclasses.asdict(LoRAConfig(**(p["lora"] or {})))
    return c

"""GRPO configs (reinforcement learning with verifiable rewards): `get_config("<preset>")` for tiny | agent | glm46.

    make rl                                                   # tiny: the CPU demo (SFT on addition, then GRPO)
    python -m glm46_jax.train --config=configs/grpo.py:tiny --config.rl.group_size=16 --config.train.seed=1
    python -m glm46_jax.train --config=configs/grpo.py:glm46 --config.checkpoint.init_from=runs/sft_glm46/merged \
        --config.rl.prompts=data/math/train.jsonl --config.rl.heldout=data/math/heldout.jsonl

The policy starts from `checkpoint.init_from` (an SFT run); prompts come from a JSONL file (`rl.prompts`), are
sampled `rl.group_size` times each with the project's generator, scored by the rewards named in `rl.rewards`, and
the policy trained by GRPO's clipped objective (docs/rl.md). Held-out `eval/accuracy` is greedy exact-match on
`rl.heldout`. Every other field is configs/pretrain.py's; as in SFT, loss-free balancing is off (the correction
biases stay as trained) and there is no MTP loss.
"""

import dataclasses
import os

import ml_collections

from glm46_jax.errors import InputError
from glm46_jax.model.lora import LoRAConfig
from glm46_jax.recipes.rl.config import RLConfig
from glm46_jax.run_config import fine_tuning_config

_PRESETS = {
    # After `configs/sft.py:rl_addition` (held-out greedy accuracy ~0.3): 150 rollouts of 8 prompts x 8 samples,
    # 2 AdamW updates each. The SFT model's expected reward is sharply curved: along the exact gradient a step of
    # norm 1e-2 already lowers it, so the lr is small (docs/rl.md#the-cpu-demo). Uniform prompt draws: with a
    # carry/no-carry curriculum the loader moved to the carry bucket at once and trained the policy to carry.
    "tiny": dict(
        base="tiny", init_from="runs/sft_rl_addition",
        rl=dict(prompts="data/rl_addition/prompts_train.jsonl", heldout="data/rl_addition/prompts_heldout.jsonl",
                group_size=8, prompts_per_step=8, minibatches=2, rollouts=150, max_prompt_len=16,
                max_new_tokens=6, eval_batch=250, curriculum_buckets=1),
        train=dict(log_every=10, eval_every=100, eval_batches=2),
        checkpoint=dict(every=100, keep=2),
        optim=dict(lr=1e-4, end_lr=1e-4, warmup_steps=0, algorithm="adamw", weight_decay=0.0, clip=1.0),
    ),
    # make agent (docs/rl.md#agentic-rl): after `configs/sft.py:agent_calc`, episodes with the calculator tool on
    # 4-digit x 2-digit products; a turn reads up to 72 tokens and writes up to 40 (prompt 16 + call 37 + tool turn 15).
    "agent": dict(
        base="tiny", init_from="runs/sft_agent_calc",
        rl=dict(prompts="data/agent_calc/prompts_train.jsonl", heldout="data/agent_calc/prompts_heldout.jsonl",
                environment="calculator", list_tools=False, max_turns=3, group_size=8, prompts_per_step=8,
                minibatches=2, rollouts=30, max_prompt_len=72, max_new_tokens=40, eval_batch=200,
                curriculum_buckets=1),
        train=dict(log_every=10, eval_every=0, eval_batches=1),
        checkpoint=dict(every=20, keep=2),
        optim=dict(lr=1e-4, end_lr=1e-4, warmup_steps=0, algorithm="adamw", weight_decay=0.0, clip=1.0),
    ),
    "glm46": dict(
        base="glm46", init_from="",
        rl=dict(prompts="data/rl/train.jsonl", heldout="data/rl/heldout.jsonl", method="lora", group_size=16,
                prompts_per_step=64, minibatches=4, rollouts=500, max_prompt_len=1024, max_new_tokens=8192,
                eval_batch=64, curriculum_buckets=3, rewards=("exact_answer", "think_answer_format"),
                reward_weights=(1.0, 0.1), pass_threshold=1.0),
        train=dict(log_every=1, eval_every=40, eval_batches=4),
        checkpoint=dict(every=40, keep=3),
        optim=dict(lr=1e-6, end_lr=1e-6, warmup_steps=10, algorithm="adamw", weight_decay=0.0),
    ),
}


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    if preset not in _PRESETS:
        raise InputError(f"unknown preset {preset!r}; choose one of {sorted(_PRESETS)}")
    p = _PRESETS[preset]
    c = fine_tuning_config(os.path.dirname(os.path.abspath(__file__)), "grpo", preset, p)
    rl = dataclasses.asdict(RLConfig())
    rl.update(p["rl"])
    c.rl = rl  # tuples stay tuples: ml_collections overrides them from the command line, lists it cannot
    c.lora = dataclasses.asdict(LoRAConfig(rank=16, alpha=32.0))
    return c

"""PPO configs: `get_config("<preset>")` for tiny | addition | agent | glm46.

    make rlhf                                                  # tiny: reward model (configs/reward.py:tiny), then PPO
    python -m glm46_jax.train --config=configs/ppo.py:addition --config.train.seed=1   # a verifiable reward, no RM
    python -m glm46_jax.train --config=configs/ppo.py:glm46 --config.checkpoint.init_from=runs/sft_glm46/merged \
        --config.rl.reward_model=runs/reward_glm46 --config.rl.prompts=data/rl/train.jsonl

The policy starts from `checkpoint.init_from`, the critic from `ppo.critic_init` (default: the reward run, else the
policy's weights) with a fresh score head where they have none. Prompts, sampling, the clip range, the rewards
(`rl.rewards`, e.g. ("reward_model",) with `rl.reward_model`) and the KL coefficient are the `rl` section's, as in
GRPO (configs/grpo.py); the critic and the PPO objective are the `ppo` section's (docs/rl.md#ppo). Held-out
`eval/accuracy` is greedy exact-match on `rl.heldout` (`rl.heldout_rewards`). Every other field is
configs/pretrain.py's.
"""

import dataclasses
import os

import ml_collections

from glm46_jax.errors import InputError
from glm46_jax.model.lora import LoRAConfig
from glm46_jax.recipes.rl.config import RLConfig
from glm46_jax.recipes.rl.ppo.config import PPOConfig
from glm46_jax.run_config import fine_tuning_config

# 150 rollouts of 32 prompts x 2 samples, 2 AdamW updates each at lr 1e-4 (as GRPO's, whose curvature argument
# holds here: lr 2e-4 lowered held-out accuracy). The critic cannot tell prompts apart on this task (its value loss
# stays at half the reward variance), so its baseline is about the batch mean: 8 samples of 8 prompts gained
# +0.025 on average over 3 seeds, 2 samples of 32 prompts +0.08 (docs/rl.md#ppo).
_ADDITION = dict(prompts="data/rl_addition/prompts_train.jsonl", heldout="data/rl_addition/prompts_heldout.jsonl",
                 group_size=2, prompts_per_step=32, minibatches=2, rollouts=150, max_prompt_len=16,
                 max_new_tokens=6, eval_batch=250, clip_low=0.2, clip_high=0.2, dynamic_sampling=False)
_CRITIC = dict(gamma=1.0, lam=1.0, vf_coef=0.5, vf_clip=0.2, critic_lr=1e-4, critic_warmup=10)
_PRESETS = {
    # The RLHF demo's second stage (make rlhf): the addition SFT model trained against the ensemble of its two reward
    # models (configs/reward.py:tiny) alone (the critic starts from the first); held-out accuracy is still exact
    # match. The reward models' check (rl.labeller) every 10 rollouts stops a run whose reward model and labeller
    # diverge, which then ends on its best checked step by the labeller (docs/rl.md#the-reward-model-check). A run
    # nothing stopped ends on its last step: the best of 15 checks of 256 samples is partly noise
    # (checkpoint.end_on_best picked step 40 in one of three seeds, 0.226 held-out where the last step had 0.316). Its
    # task holds out 2,000 problems (data/rlhf_addition: make rl's SFT chats): each evaluation is greedy on all of
    # them (standard error 0.01).
    "tiny": dict(
        base="tiny", init_from="runs/sft_rl_addition",
        rl=dict(_ADDITION, prompts="data/rlhf_addition/prompts_train.jsonl",
                heldout="data/rlhf_addition/prompts_heldout.jsonl", rewards=("reward_model",), reward_weights=(1.0,),
                reward_model="runs/rlhf_tiny/round1/reward", reward_ensemble=("runs/rlhf_tiny/round1/reward_1",),
                heldout_rewards=("exact_answer",), kl_coef=0.02, labeller="exact_answer"),
        ppo=dict(_CRITIC, normalize_rewards=True),
        train=dict(log_every=10, eval_every=20, eval_batches=8),
        checkpoint=dict(every=20, keep=1, keep_best=True, best_metric="eval/check_win_rate", best_mode="max"),
        optim=dict(lr=1e-4, end_lr=1e-4, warmup_steps=0, algorithm="adamw", weight_decay=0.0, clip=1.0),
    ),
    # PPO with the verifiable reward (exact answer): the critic starts from the policy's weights.
    "addition": dict(
        base="tiny", init_from="runs/sft_rl_addition",
        rl=dict(_ADDITION, rewards=("exact_answer",), reward_weights=(1.0,)),
        ppo=dict(_CRITIC),
        train=dict(log_every=10, eval_every=0, eval_batches=2),
        checkpoint=dict(every=100, keep=1),
        optim=dict(lr=1e-4, end_lr=1e-4, warmup_steps=0, algorithm="adamw", weight_decay=0.0, clip=1.0),
    ),
    # Agentic PPO (docs/rl.md#agentic-rl): configs/grpo.py:agent's episodes (the calculator, 3 turns) with a critic
    # from the policy's weights and the exact-answer reward, 32 prompts x 2 samples per rollout.
    "agent": dict(
        base="tiny", init_from="runs/sft_agent_calc",
        rl=dict(_ADDITION, prompts="data/agent_calc/prompts_train.jsonl",
                heldout="data/agent_calc/prompts_heldout.jsonl", rollouts=30, environment="calculator",
                list_tools=False, max_turns=3, max_prompt_len=72, max_new_tokens=40, eval_batch=200,
                rewards=("exact_answer",), reward_weights=(1.0,)),
        ppo=dict(_CRITIC),
        train=dict(log_every=10, eval_every=0, eval_batches=1),
        checkpoint=dict(every=20, keep=2),
        optim=dict(lr=1e-4, end_lr=1e-4, warmup_steps=0, algorithm="adamw", weight_decay=0.0, clip=1.0),
    ),
    "glm46": dict(
        base="glm46", init_from="",
        rl=dict(prompts="data/rl/train.jsonl", heldout="data/rl/heldout.jsonl", method="lora", group_size=4,
                prompts_per_step=128, minibatches=4, rollouts=500, max_prompt_len=1024, max_new_tokens=4096,
                eval_batch=64, rewards=("reward_model",), reward_weights=(1.0,), reward_model="runs/reward_glm46",
                heldout_rewards=("exact_answer",), kl_coef=0.01, clip_low=0.2, clip_high=0.2,
                dynamic_sampling=False),
        ppo=dict(critic_method="lora", critic_lr=5e-6, normalize_rewards=True, reward_clip=5.0),
        train=dict(log_every=1, eval_every=40, eval_batches=4),
        checkpoint=dict(every=40, keep=3),
        optim=dict(lr=1e-6, end_lr=1e-6, warmup_steps=10, algorithm="adamw", weight_decay=0.0),
    ),
}


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    if preset not in _PRESETS:
        raise InputError(f"unknown preset {preset!r}; choose one of {sorted(_PRESETS)}")
    p = _PRESETS[preset]
    c = fine_tuning_config(os.path.dirname(os.path.abspath(__file__)), "ppo", preset, p)
    rl = dataclasses.asdict(RLConfig())
    rl.update(p["rl"])
    c.rl = rl  # tuples stay tuples: ml_collections overrides them from the command line, lists it cannot
    c.ppo = dataclasses.asdict(PPOConfig(**p["ppo"]))
    c.lora = dataclasses.asdict(LoRAConfig(rank=16, alpha=32.0))
    return c

"""`--config.ppo.<field>` (recipe "ppo", beside the rl section): PPOConfig, the critic and the PPO objective, handed
to the recipe as `cfg.ppo`. A leaf, named in `run_config.SECTIONS` like the rl section."""

from __future__ import annotations

import dataclasses
from typing import Any

from glm46_jax.errors import InputError, check_at_least, check_choice, check_range


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    gamma: float = 1.0  # GAE's discount over a completion's tokens
    lam: float = 0.95  # GAE's lambda
    vf_coef: float = 0.5  # the value loss's weight (it scales the critic's gradient; the critic has its own optimizer)
    vf_clip: float = 0.2  # the value clip range around the rollout's values
    entropy_coef: float = 0.0  # the entropy bonus's weight
    # k1: -rl.kl_coef * (logp - ref_logp) added to each token's reward (Ziegler et al., TRL); k3: rl.kl_coef * k3 in
    # the loss (as GRPO's); either needs rl.kl_coef > 0 to do anything
    kl_kind: str = "k1"
    # > 0: the KL coefficient adapts toward this KL per completion (InstructGPT's / TRL's adaptive controller,
    # docs/rl.md#adaptive-kl): rl.kl_coef is its start, and after each rollout it is multiplied by
    # 1 + clip(KL / kl_target - 1, -0.2, 0.2) x samples / kl_horizon; 0 = a fixed rl.kl_coef
    kl_target: float = 0.0
    kl_horizon: int = 10_000  # samples over which the coefficient may move by a factor of about e^0.2
    whiten_advantages: bool = True  # over each rollout's completion tokens
    normalize_rewards: bool = False  # scores divided by their running std (count, mean, variance in the checkpoint)
    reward_clip: float = 0.0  # |normalised score| clipped to this; 0 = no clip
    # The critic's starting weights: "" = rl.reward_model when that is a training run, else checkpoint.init_from;
    # a score head is added (fresh) when they have none.
    critic_init: str = ""
    critic_method: str = "full"  # full | lora (the score head trains in full)
    critic_lr: float = 0.0  # 0 = optim.lr
    # the first critic_warmup rollouts train only the critic (verl's trainer.critic_warmup): a fresh value head's
    # advantages are noise, and the policy's first updates would follow it
    critic_warmup: int = 0

    def __post_init__(self):
        check_range("ppo", self, "gamma", ge=0, le=1)
        check_range("ppo", self, "lam", ge=0, le=1)
        check_at_least("ppo", self, 0, "vf_coef", "vf_clip", "entropy_coef", "reward_clip", "critic_lr",
                       "critic_warmup", "kl_target")
        check_range("ppo", self, "kl_horizon", ge=1, meaning="samples")
        check_choice("ppo", self, "kl_kind", ("k1", "k3"), "k1 in the reward, k3 in the loss")
        check_choice("ppo", self, "critic_method", ("full", "lora"))

    def check_run(self, cfg: Any) -> None:
        """What PPO cannot run with beyond the rl section's rules (`cfg`: the RunConfig)."""
        if self.kl_target > 0 and cfg.rl.kl_coef <= 0:
            raise InputError(f"ppo.kl_target={self.kl_target} adapts the KL coefficient from rl.kl_coef, which is "
                             f"{cfg.rl.kl_coef}: set --config.rl.kl_coef to its starting value (> 0, e.g. 0.05)")
        if self.critic_method == "lora" and cfg.lora is None:
            raise InputError("ppo.critic_method=lora needs a config.lora section (rank, alpha, targets; see "
                             "configs/ppo.py)")

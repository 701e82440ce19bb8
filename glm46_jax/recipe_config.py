"""The recipe-specific sections of a run's config, each a frozen dataclass that checks itself like the run-level
sections of `run_config` (which re-exports them): `sft` (SFTConfig), `rl` (RLConfig: GRPO and PPO), `ppo`
(PPOConfig), `preference` (PreferenceConfig: the reward model and DPO), and each recipe's length rule."""

from __future__ import annotations

import dataclasses
import math

from glm46_jax.errors import check_at_least, check_choice, check_field, check_range


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """`--config.sft.<field>` (recipe "sft"): the chat data and how much of the model trains."""
    root: str = "data/sample_sft"  # written by `python -m data_prep sft`
    seq_len: int = 512
    global_batch: int = 16
    epochs: float = 1.0  # the run's length when train.steps = 0: passes over the train split's tokens
    pack: str = "best_fit"
    method: str = "lora"  # lora: adapters on frozen base weights | full: every weight trains
    num_workers: int = 0

    def __post_init__(self):
        check_at_least("sft", self, 2, "seq_len")
        check_at_least("sft", self, 1, "global_batch")
        check_at_least("sft", self, 0, "num_workers")
        check_range("sft", self, "epochs", gt=0, meaning="passes over the train split (used when train.steps=0)")
        check_choice("sft", self, "pack", ("best_fit", "first_fit"))
        check_choice("sft", self, "method", ("lora", "full"), "lora: adapters on frozen weights; full: all weights")


def sft_steps(sft: SFTConfig, train_steps: int) -> int:
    """train.steps when > 0, else `epochs` passes over the train split's tokens in batches of
    global_batch x seq_len (packing pads a little, so a nominal pass is slightly short of a real one)."""
    if train_steps > 0:
        return train_steps
    from glm46_jax.data.sft_loader import read_sft_metadata  # the dataset's size: read once the config is known
    tokens = int(read_sft_metadata(sft.root)["splits"]["train"]["tokens"])
    return max(1, math.ceil(sft.epochs * tokens / (sft.global_batch * sft.seq_len)))


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """`--config.rl.<field>` (recipe "grpo"): prompts, sampling, the GRPO objective, rewards, curriculum
    (docs/rl.md#configuration)."""
    prompts: str = "data/rl_addition/prompts_train.jsonl"  # JSONL: {"prompt", "answer" | "tests", "difficulty"?}
    heldout: str = "data/rl_addition/prompts_heldout.jsonl"  # held-out accuracy (eval/accuracy)
    tokenizer: str = ""  # "" = the tokenizer of checkpoint.init_from's run
    chat: bool = True  # prompts as a user turn of the chat format (no thinking); else raw text
    method: str = "full"  # full | lora
    group_size: int = 8  # G samples per prompt
    prompts_per_step: int = 8  # groups per rollout
    minibatches: int = 2  # optimizer steps per pass over a rollout
    epochs: int = 1  # passes over each rollout
    rollouts: int = 20  # the run's length when train.steps = 0
    max_prompt_len: int = 32
    max_new_tokens: int = 8
    temperature: float = 1.0
    advantage: str = "grpo"  # grpo | drgrpo | rloo
    adv_eps: float = 1e-6
    clip_low: float = 0.2
    clip_high: float = 0.28  # DAPO's clip-higher
    aggregation: str = "token"  # token | sequence | constant
    kl_coef: float = 0.0  # > 0: k3 KL to the starting policy (GLM-4.5: none)
    routing_replay: bool = True
    rewards: tuple[str, ...] = ("exact_answer",)
    reward_weights: tuple[float, ...] = (1.0,)
    reward_model: str = ""  # with "reward_model" in rewards: a `reward` run or its export (scored on the mesh)
    heldout_rewards: tuple[str, ...] = ()  # held-out accuracy's rewards (weight 1 each); () = rewards, weighted
    pass_threshold: float = 1.0  # a sample passes when its weighted reward reaches this
    dynamic_sampling: bool = True  # drop groups whose rewards all agree, refill from the pool
    max_refill_rounds: int = 3
    curriculum_buckets: int = 1
    curriculum_advance_at: float = 0.8
    curriculum_ema: float = 0.7
    code_timeout_s: float = 5.0
    code_memory_mb: int = 512
    eval_batch: int = 32  # held-out prompts per eval batch (train.eval_batches of them)

    def __post_init__(self):
        for f in ("group_size", "prompts_per_step", "minibatches", "epochs", "rollouts", "max_prompt_len",
                  "max_new_tokens", "curriculum_buckets", "code_memory_mb", "eval_batch"):
            check_range("rl", self, f, ge=1)
        check_at_least("rl", self, 0, "max_refill_rounds", "kl_coef", "adv_eps")
        check_range("rl", self, "temperature", gt=0, meaning="sampling temperature (the trainer divides logits "
                    "by it too, so the log-probs agree)")
        check_range("rl", self, "clip_low", ge=0, le=1)
        check_range("rl", self, "clip_high", ge=0)
        check_range("rl", self, "code_timeout_s", gt=0)
        check_range("rl", self, "curriculum_ema", ge=0, le=1)
        check_choice("rl", self, "method", ("full", "lora"))
        check_choice("rl", self, "advantage", ("grpo", "drgrpo", "rloo"))
        check_choice("rl", self, "aggregation", ("token", "sequence", "constant"))
        check_field("rl", "minibatches", self.minibatches,
                    (self.prompts_per_step * self.group_size) % self.minibatches == 0,
                    f"must divide the rollout's prompts_per_step x group_size = "
                    f"{self.prompts_per_step * self.group_size} samples", "set --config.rl.minibatches")
        check_field("rl", "rewards", self.rewards, len(self.rewards) == len(self.reward_weights) > 0,
                    f"needs one weight each (reward_weights={self.reward_weights})",
                    "set --config.rl.rewards and --config.rl.reward_weights to lists of the same length")
        named = "reward_model" in self.rewards + self.heldout_rewards
        check_field("rl", "reward_model", self.reward_model, bool(self.reward_model) == named,
                    "must be set exactly when rl.rewards or rl.heldout_rewards names \"reward_model\" "
                    f"(rewards={self.rewards}, heldout_rewards={self.heldout_rewards})",
                    "set --config.rl.reward_model=<reward run or export>, or drop \"reward_model\" from the rewards")

    @property
    def updates_per_rollout(self) -> int:
        return self.minibatches * self.epochs


def rl_steps(rl: RLConfig, train_steps: int) -> int:
    """train.steps when > 0, else rollouts x (optimizer steps per rollout)."""
    return train_steps if train_steps > 0 else rl.rollouts * rl.updates_per_rollout


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
                       "critic_warmup")
        check_choice("ppo", self, "kl_kind", ("k1", "k3"), "k1 in the reward, k3 in the loss")
        check_choice("ppo", self, "critic_method", ("full", "lora"))


LOSS_TYPES = ("sigmoid", "ipo", "simpo")


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    root: str = "data/sample_preferences"  # written by `python -m data_prep preferences`
    seq_len: int = 256  # tokens per packed row (a pair's chosen and rejected share a row)
    global_batch: int = 8  # rows per step
    pairs_per_row: int = 4  # most pairs packed into one row
    epochs: float = 1.0  # the run's length when train.steps = 0: passes over the train split's tokens
    method: str = "full"  # full | lora (adapters on the frozen backbone; a reward model's score head trains in full)
    num_workers: int = 0
    # dpo: sigmoid (DPO) | ipo | simpo; the sequence log-prob is the sum over the reply's tokens for sigmoid, their
    # mean for ipo and simpo (docs/preferences.md#the-losses)
    loss_type: str = "sigmoid"
    beta: float = 0.1  # DPO/IPO: the KL strength (IPO: its tau); SimPO: the reward scale (its paper uses 2-2.5)
    label_smoothing: float = 0.0  # the assumed share of flipped labels (cDPO); sigmoid and simpo
    gamma: float = 0.5  # SimPO's target margin (its gamma; TRL's simpo_gamma)
    use_margin: bool = False  # reward: subtract each pair's "margin" in the Bradley-Terry loss (Llama 2)

    def __post_init__(self):
        check_at_least("preference", self, 2, "seq_len")
        check_at_least("preference", self, 1, "global_batch", "pairs_per_row")
        check_at_least("preference", self, 0, "num_workers")
        check_range("preference", self, "epochs", gt=0, meaning="passes over the train split (when train.steps=0)")
        check_choice("preference", self, "method", ("full", "lora"))
        check_choice("preference", self, "loss_type", LOSS_TYPES)
        check_range("preference", self, "beta", gt=0)
        check_range("preference", self, "label_smoothing", ge=0, lt=0.5,
                    meaning="the share of flipped labels assumed (below 0.5)")
        check_at_least("preference", self, 0, "gamma")


def preference_steps(pref: PreferenceConfig, train_steps: int) -> int:
    """train.steps when > 0, else `epochs` passes over the train split's tokens in rows of seq_len."""
    if train_steps > 0:
        return train_steps
    from glm46_jax.data.preference_loader import read_preference_metadata  # read once the config is known
    tokens = int(read_preference_metadata(pref.root)["splits"]["train"]["tokens"])
    return max(1, math.ceil(pref.epochs * tokens / (pref.global_batch * pref.seq_len)))

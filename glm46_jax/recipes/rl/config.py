"""`--config.rl.<field>` (recipes "grpo" and "ppo"): RLConfig, the section both RL recipes are handed as `cfg.rl`,
with the run's length and what RL cannot run with. A leaf: `run_config` names it in its SECTIONS table (by string:
the recipes import run_config) and the config files import it."""

from __future__ import annotations

import dataclasses
from typing import Any

from glm46_jax.errors import InputError, check_at_least, check_choice, check_field, check_range


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
    reward_ensemble: tuple[str, ...] = ()  # more reward models (e.g. other seeds): the reward is mean - penalty x std
    ensemble_penalty: float = 1.0  # lambda of the ensemble's conservative score
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
    # Agentic RL (docs/rl.md#agentic-rl): multi-turn episodes with a tool environment. A turn reads at most
    # max_prompt_len tokens (prompt, earlier turns, tool turns) and writes at most max_new_tokens.
    environment: str = ""  # "" = one completion per prompt; else calculator | python | lookup | none | module:function
    environment_store: str = ""  # the lookup environment's document store (JSONL of {"id", "title", "text"})
    max_turns: int = 4  # model turns per episode
    list_tools: bool = True  # the tools' schemas in a system turn (GLM's template); False: taught by fine-tuning
    # Rollouts ahead of training: rollout r is sampled with the policy as it was after rollout r - 1 - rollouts_ahead
    # (0: the current policy, synchronous); tokens are reweighted by min(pi_old / pi_behaviour, importance_cap).
    rollouts_ahead: int = 0
    importance_cap: float = 2.0
    # The reward model's check (docs/rl.md#the-reward-model-check): at every evaluation, fresh samples of the first
    # check_prompts prompts of rl.prompts judged by the labeller and by the reward model against the starting policy's.
    labeller: str = ""  # "" = no check; else a labeller name (recipes/rl/labellers.py), e.g. "exact_answer"
    check_prompts: int = 64
    check_samples: int = 4  # per prompt
    check_max_gap: float = 0.15  # stop when the reward model's win rate exceeds the labeller's by more than this

    def __post_init__(self):
        for f in ("group_size", "prompts_per_step", "minibatches", "epochs", "rollouts", "max_prompt_len",
                  "max_new_tokens", "curriculum_buckets", "code_memory_mb", "eval_batch", "check_prompts",
                  "check_samples", "max_turns"):
            check_range("rl", self, f, ge=1)
        check_at_least("rl", self, 0, "max_refill_rounds", "kl_coef", "adv_eps", "rollouts_ahead")
        check_range("rl", self, "importance_cap", ge=1)
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
        check_range("rl", self, "check_max_gap", ge=0)
        check_range("rl", self, "ensemble_penalty", ge=0)
        check_field("rl", "reward_ensemble", self.reward_ensemble, not self.reward_ensemble or bool(self.reward_model),
                    "adds members to rl.reward_model's ensemble, which is not set",
                    "set --config.rl.reward_model (the first member), or --config.rl.reward_ensemble=()")
        check_field("rl", "labeller", self.labeller, not self.labeller or "reward_model" in self.rewards,
                    f"checks the reward model, which rl.rewards={self.rewards} does not use",
                    "add \"reward_model\" to rl.rewards, or set --config.rl.labeller=''")
        named = "reward_model" in self.rewards + self.heldout_rewards
        check_field("rl", "reward_model", self.reward_model, bool(self.reward_model) == named,
                    "must be set exactly when rl.rewards or rl.heldout_rewards names \"reward_model\" "
                    f"(rewards={self.rewards}, heldout_rewards={self.heldout_rewards})",
                    "set --config.rl.reward_model=<reward run or export>, or drop \"reward_model\" from the rewards")

        if self.environment:
            check_field("rl", "environment", self.environment, self.chat,
                        "runs episodes in the chat format, and rl.chat=False", "set --config.rl.chat=True")
            check_field("rl", "rewards", self.rewards,
                        self.rewards == ("exact_answer",) and not self.heldout_rewards and not self.reward_model,
                        f"with rl.environment={self.environment!r} the environment rewards each episode",
                        "leave rl.rewards, rl.heldout_rewards and rl.reward_model at their defaults")
            check_field("rl", "environment_store", self.environment_store,
                        bool(self.environment_store) == (self.environment == "lookup"),
                        "is the lookup environment's document store: set exactly with rl.environment=lookup",
                        "set --config.rl.environment_store=<documents.jsonl> (or clear it)")

    @property
    def updates_per_rollout(self) -> int:
        return self.minibatches * self.epochs

    def steps(self, train_steps: int) -> int:
        """The run's length: train.steps when > 0, else rollouts x (optimizer steps per rollout)."""
        return train_steps if train_steps > 0 else self.rollouts * self.updates_per_rollout

    def check_run(self, cfg: Any) -> None:
        """What GRPO and PPO cannot run with (`cfg`: the RunConfig), as one InputError."""
        stages, context = cfg.mesh.sizes().get("pipeline", 1), cfg.mesh.sizes().get("context", 1)
        if stages > 1:
            raise InputError(f"mesh.pipeline={stages} with recipe {cfg.recipe}: RL samples with the KV-cache generator "
                             "and replays routing, which run the layers in order, not in pipeline stages; set "
                             "mesh.pipeline=1 (give the devices to mesh.data or mesh.expert)")
        if cfg.optim.offload == "optimizer_and_params":
            raise InputError(f"optim.offload=optimizer_and_params with recipe {cfg.recipe}: only the language-model "
                             "step (pretrain, mid-training, SFT) reads the weights through their device copy; "
                             "rollouts read them too: set optim.offload=optimizer (the optimizer state alone)")
        if context > 1:
            raise InputError(f"mesh.context={context} with recipe {cfg.recipe}: RL samples with the KV-cache "
                             "generator, which keeps each sequence whole on a device; set mesh.context=1 (give the "
                             "devices to mesh.data or mesh.expert)")

"""PPO as a recipe of the generic trainer: the shared RL loop (`rl.base.RLRecipe`: sampler, routing replay, rewards,
the prompt pool, the refresh after each update) with a critic in place of group baselines (docs/rl.md#ppo).

    recipe, state = build(run_cfg)            # policy (checkpoint.init_from), critic (ppo.critic_init), reference
    recipe.start(state, data_state)
    state, summary = trainer.fit(recipe, state, ...)

Each rollout: `rl.prompts_per_step` prompts x `rl.group_size` samples from the current policy, scored by rl.rewards
(a reward model and/or verifiable functions); the critic's values and (with rl.kl_coef > 0) the reference's
log-probs at every completion token; the score (optionally normalised by its running std and clipped) at each
completion's last token, minus kl_coef times the k1 KL per token (ppo.kl_kind="k1"; the coefficient adapts toward
ppo.kl_target when that is set, docs/rl.md#adaptive-kl); GAE(gamma, lambda); advantages
whitened over the rollout. Then `rl.minibatches` x `rl.epochs` joint updates of the policy (clipped loss, entropy
bonus, k3 KL if ppo.kl_kind="k3") and the critic (clipped value loss), each with its own optimizer.

The train state holds the policy (inline) and the critic (`others["critic"]`); the data state the prompt pool, the
rollout count, the score statistics and the KL coefficient: a run resumed at a rollout boundary continues
bit-identically.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from glm46_jax.config import RUNTIME_FIELDS, model_config_from_dict
from glm46_jax.errors import InputError
from glm46_jax.parallel import sharding
from glm46_jax.recipes import models
from glm46_jax.recipes.base import warn_random_start
from glm46_jax.recipes.rl.base import RLRecipe, device_batch
from glm46_jax.recipes.rl.build import check_rl, model_scorer, policy_spec, reference_weights, rollout_batch
from glm46_jax.recipes.rl.ppo import objective
from glm46_jax.recipes.rl.ppo.config import PPOConfig
from glm46_jax.recipes.rl.ppo.step import make_ppo_step, values_fn
from glm46_jax.recipes.rl.prompts import rl_inputs
from glm46_jax.run_config import RunConfig
from glm46_jax.training import checkpoint
from glm46_jax.training.step import TrainState, with_frozen


@dataclasses.dataclass
class PPO(RLRecipe):
    """The PPO recipe (`trainer.Recipe`)."""
    moments: objective.RunningMoments = dataclasses.field(default_factory=objective.RunningMoments)
    # The KL coefficient of the rollout being trained on, and of the next one (ppo.kl_target > 0 moves it after
    # each rollout; otherwise both stay rl.kl_coef). The checkpoint holds the next one.
    kl_coef: float | None = None
    next_kl_coef: float | None = None

    @property
    def ppo(self) -> PPOConfig:
        return self.cfg.ppo

    @property
    def dynamic_sampling(self) -> bool:
        return False  # every sample has its own advantage: nothing to drop

    def steps_for(self, segment: Any) -> Any:
        return self._ppo_step

    @functools.cached_property
    def _ppo_step(self) -> Any:
        models_ = self.built.models
        return make_ppo_step(models_["policy"].graphdef, models_["critic"].graphdef,
                             {"policy": models_["policy"].tx, "critic": models_["critic"].tx}, self.rl, self.ppo,
                             lr_schedule=models_["policy"].lr_schedule)

    @functools.cached_property
    def _values(self) -> Any:
        return values_fn(self.built.models["critic"].graphdef)

    def extra_meta(self) -> dict[str, Any]:
        return {**super().extra_meta(), "ppo": dataclasses.asdict(self.ppo)}

    def controls(self, max_loss: float) -> dict[str, jax.Array]:
        # the rollout now being trained on is number rollouts_done (1-based); the policy waits for the critic
        return {**super().controls(max_loss), "policy_weight": jnp.float32(self.rollouts_done > self.ppo.critic_warmup),
                "kl_coef": jnp.float32(self.rl.kl_coef if self.kl_coef is None else self.kl_coef)}

    def data_state(self) -> dict[str, Any]:
        return {**super().data_state(), "reward_moments": self.moments.to_dict(), "kl_coef": self._next_kl_coef()}

    def restore_data_state(self, data_state: Mapping[str, Any]) -> None:
        super().restore_data_state(data_state)
        self.moments = objective.RunningMoments.from_dict(data_state["reward_moments"])
        self.next_kl_coef = float(data_state.get("kl_coef", self.rl.kl_coef))  # older checkpoints: the fixed one

    def _next_kl_coef(self) -> float:
        return self.rl.kl_coef if self.next_kl_coef is None else self.next_kl_coef

    def with_advantages(self, state: TrainState, batch: dict[str, np.ndarray], rewards: np.ndarray
                        ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Values, reference log-probs, per-token rewards, GAE advantages and returns of one rollout."""
        ppo = self.ppo
        critic = state.others["critic"]
        with jax.transfer_guard("allow"), sharding.use_mesh(self.mesh):
            device = device_batch(batch, self.mesh)
            frozen = self.frozen.get("critic") if self.frozen else None
            values = self._values(with_frozen(critic.params, frozen.params if frozen else None), critic.buffers,
                                  device["inputs"])
            ref = self.ref_logprobs(state.buffers, device) if self.reference is not None else None
            values, ref = jax.device_get((values, ref))
        mask, old = batch["completion_mask"], batch["old_logprobs"]
        scores = rewards.astype(np.float64)
        if ppo.normalize_rewards:
            self.moments = self.moments.update(scores)
            scores = np.asarray(objective.normalize_scores(scores, 0.0, self.moments.std,
                                                           ppo.reward_clip or None))
        elif ppo.reward_clip:
            scores = np.clip(scores, -ppo.reward_clip, ppo.reward_clip)
        kl = np.asarray(objective.kl_penalty(old, ref, "k1")) if ref is not None else np.zeros_like(old)
        self.kl_coef = self._next_kl_coef()
        k1_coef = self.kl_coef if ppo.kl_kind == "k1" and ref is not None else 0.0
        adv, returns = jax.device_get(rollout_advantages(scores.astype(np.float32), mask, values, kl, k1_coef,
                                                         ppo.gamma, ppo.lam, ppo.whiten_advantages))
        n = max(float(mask.sum()), 1.0)
        batch.update(advantages=np.asarray(adv, np.float32), returns=np.asarray(returns, np.float32),
                     old_values=np.asarray(values, np.float32) * mask)
        stats = {"score_mean": float(scores.mean()), "value_rollout": float(np.sum(values * mask) / n),
                 "return_mean": float(np.sum(np.asarray(returns) * mask) / n)}
        if ref is not None:
            batch["ref_logprobs"] = np.asarray(ref, np.float32)
            stats["kl_rollout"] = float(np.sum(np.asarray(kl) * mask) / n)
            # the controller's measure: the k1 KL per completion (summed over its tokens), averaged over the rollout
            kl_per_completion = float(np.mean(np.sum(np.asarray(kl, np.float64) * mask, axis=1)))
            stats.update(kl_per_completion=kl_per_completion, kl_coef=self.kl_coef)
            if ppo.kl_target > 0:
                self.next_kl_coef = objective.adaptive_kl_coef(self.kl_coef, kl_per_completion, ppo.kl_target,
                                                               len(mask), ppo.kl_horizon)
        return batch, stats

    @staticmethod
    def build(cfg: RunConfig, devices: Sequence[jax.Device] | None = None) -> tuple[PPO, TrainState]:
        """Mesh -> policy, critic (and KL reference) -> optimizers -> train state, prompts and rewards; nothing
        sampled."""
        rl = cfg.rl
        check_rl(cfg)
        inputs = rl_inputs(cfg)
        policy = policy_spec(cfg)
        warn_random_start(policy, "PPO from")
        critic = critic_spec(cfg)
        built = models.build(cfg, devices, [policy, critic], [rollout_batch(cfg)])
        logging.info("%d PPO steps (%d per rollout) on %s; critic from %s", cfg.total_steps, rl.updates_per_rollout,
                     rl.prompts, critic.init_from or "a random init")
        recipe = PPO(cfg, built, reference_weights(cfg, built), scorer=model_scorer(cfg, built.mesh), **inputs)
        return recipe, built.state


@functools.partial(jax.jit, static_argnames=("whiten",))
def rollout_advantages(scores, mask, values, kl, kl_coef, gamma, lam, whiten: bool):
    """(advantages, returns) [b, t] of one rollout: token rewards (score at the last completion token, minus
    kl_coef x kl per token), GAE, whitening. One compiled program (eagerly, the GAE scan re-traces on every call)."""
    adv, returns = objective.gae(objective.token_rewards(scores, mask, kl, kl_coef), values, mask, gamma, lam)
    return (objective.whiten(adv, mask) if whiten else adv), returns


def _is_run(path: str) -> bool:
    try:
        checkpoint.latest_checkpoint(path)
        return True
    except FileNotFoundError:
        return False


def critic_spec(cfg: RunConfig) -> models.ModelSpec:
    """The critic: ppo.critic_init's architecture (else the reward run's, else the policy's) with a score head, the
    run's runtime settings, its own lr if ppo.critic_lr is set."""
    ppo, rl = cfg.ppo, cfg.rl
    source = ppo.critic_init or (rl.reward_model if rl.reward_model and _is_run(rl.reward_model)
                                 else cfg.checkpoint.init_from)
    model_cfg = cfg.model
    if source:
        if not _is_run(source):
            raise InputError(f"ppo.critic_init={source}: not a training run or checkpoint (an HF export can be "
                             "imported with `python -m glm46_jax.convert hf-to-ckpt`)")
        saved = model_config_from_dict(checkpoint.read_meta(checkpoint.latest_checkpoint(source))["model_config"])
        model_cfg = dataclasses.replace(saved, **{f: getattr(cfg.model, f) for f in RUNTIME_FIELDS})
    optim = None
    if ppo.critic_lr:
        scale = ppo.critic_lr / cfg.optim.lr
        optim = dataclasses.replace(cfg.optim, lr=ppo.critic_lr, end_lr=cfg.optim.end_lr * scale)
    return models.ModelSpec("critic", dataclasses.replace(model_cfg, score_head=1), init_from=source,
                            lora=cfg.lora if ppo.critic_method == "lora" else None, optim=optim, seed_offset=1)


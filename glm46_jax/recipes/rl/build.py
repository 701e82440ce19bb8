"""What the RL recipes' `build`s share: the settings every RL run needs, the policy's spec and KL reference, the
rollout's batch shape, the reward model(s) as a scorer (docs/rl.md#the-grpo-recipe).

    check_rl(cfg); spec = policy_spec(cfg); built = models.build(cfg, devices, [spec], [rollout_batch(cfg)])
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm46_jax.errors import InputError
from glm46_jax.recipes import models
from glm46_jax.recipes.rl.prompts import tokenizer_path
from glm46_jax.recipes.rl.reward_model import EnsembleScorer, ModelScorer
from glm46_jax.run_config import RunConfig


def check_rl(cfg: RunConfig) -> None:
    """What every RL recipe needs of the run's settings."""
    rl = cfg.rl
    if cfg.checkpoint.every % rl.updates_per_rollout:
        raise InputError(f"checkpoint.every={cfg.checkpoint.every} must be a multiple of the optimizer steps per "
                         f"rollout ({rl.updates_per_rollout} = rl.minibatches x rl.epochs), so that checkpoints fall "
                         "between rollouts and a resumed run continues exactly")
    if cfg.model.moe_capacity_factor > 0:
        raise InputError("model.moe_capacity_factor > 0: RL needs dropless routing (0), or the sampler's and the "
                         "trainer's batches drop different tokens")


def policy_spec(cfg: RunConfig) -> models.ModelSpec:
    """The policy: checkpoint.init_from's weights, adapters with rl.method=lora. The KL reference is a copy of the
    starting weights, so with rl.kl_coef > 0 they are read on a resume too."""
    return models.ModelSpec("policy", cfg.model, init_from=cfg.checkpoint.init_from,
                            lora=cfg.lora if cfg.rl.method == "lora" else None, load_when_resuming=cfg.rl.kl_coef > 0)


def reference_weights(cfg: RunConfig, built: models.Built) -> nnx.State | None:
    """The KL reference (rl.kl_coef > 0): a copy of the policy's starting trained weights."""
    return jax.tree.map(jnp.copy, built.state.params) if cfg.rl.kl_coef > 0 else None


def rollout_batch(cfg: RunConfig) -> models.BatchShape:
    rl = cfg.rl
    return models.BatchShape("rl.prompts_per_step x rl.group_size / rl.minibatches",
                             rl.prompts_per_step * rl.group_size // rl.minibatches,
                             "rl.max_prompt_len + rl.max_new_tokens", rl.max_prompt_len + rl.max_new_tokens)


def model_scorer(cfg: RunConfig, mesh: jax.sharding.Mesh) -> ModelScorer | EnsembleScorer | None:
    """The reward model (or rl.reward_ensemble's conservative score) when rl.rewards or rl.heldout_rewards names it, on
    the run's mesh."""
    rl = cfg.rl
    if "reward_model" not in rl.rewards + rl.heldout_rewards:
        return None
    members = [ModelScorer.load(path, mesh, policy_tokenizer=tokenizer_path(cfg), pad_id=cfg.model.pad_token_id or 0,
                                row_len=rl.max_prompt_len + rl.max_new_tokens)
               for path in (rl.reward_model, *rl.reward_ensemble)]
    return members[0] if len(members) == 1 else EnsembleScorer(members, rl.ensemble_penalty)

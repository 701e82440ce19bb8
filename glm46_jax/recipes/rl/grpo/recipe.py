"""GRPO as a recipe of the generic trainer (docs/rl.md#the-grpo-recipe): the shared RL loop (`rl.base.RLRecipe`)
with group advantages, dynamic sampling (rl.dynamic_sampling: groups whose rewards all agree are dropped and refilled
from the pool) and the GRPO update (`step.make_grpo_step`).

    recipe, state = build(run_cfg)        # mesh, policy weights (checkpoint.init_from), LoRA, optimizer, prompts
    recipe.start(state, data_state)       # the prompt pool (and where a resumed run left it)
    state, summary = trainer.fit(recipe, state, ...)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from glm46_jax.recipes import models
from glm46_jax.recipes.base import warn_random_start
from glm46_jax.recipes.rl.base import RLRecipe
from glm46_jax.recipes.rl.build import check_rl, model_scorer, policy_spec, reference_weights, rollout_batch
from glm46_jax.recipes.rl.grpo import objective
from glm46_jax.recipes.rl.grpo.step import make_grpo_step
from glm46_jax.recipes.rl.prompts import rl_inputs
from glm46_jax.run_config import RunConfig
from glm46_jax.training.step import TrainState
from glm46_jax.training.trainer import Segment


@dataclasses.dataclass
class GRPO(RLRecipe):
    """The GRPO recipe (`trainer.Recipe`)."""

    @property
    def dynamic_sampling(self) -> bool:
        return self.rl.dynamic_sampling

    def steps_for(self, segment: Segment) -> Any:
        return self._grpo_step

    @functools.cached_property
    def _grpo_step(self) -> Any:  # one segment: traced once
        return make_grpo_step(self.main.graphdef, self.main.tx, self.rl, lr_schedule=self.main.lr_schedule,
                              name="policy")

    def with_advantages(self, state: TrainState, batch: dict[str, np.ndarray], rewards: np.ndarray
                        ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The rollout's rows with their group advantages (one per row)."""
        rl = self.rl
        batch["advantages"] = np.asarray(objective.advantages(jnp.asarray(rewards), rl.group_size, rl.advantage,
                                                              rl.adv_eps), np.float32)
        return batch, {}

    @staticmethod
    def build(cfg: RunConfig, devices: Sequence[jax.Device] | None = None) -> tuple[GRPO, TrainState]:
        """Mesh -> policy weights -> (adapters) -> optimizer -> train state, prompts and rewards; nothing sampled."""
        rl = cfg.rl
        check_rl(cfg)
        inputs = rl_inputs(cfg)
        spec = policy_spec(cfg)
        warn_random_start(spec, "reinforcement learning from")
        built = models.build(cfg, devices, [spec], [rollout_batch(cfg)])
        logging.info("%d GRPO steps (%d per rollout) on %s", cfg.total_steps, rl.updates_per_rollout, rl.prompts)
        recipe = GRPO(cfg, built, reference_weights(cfg, built), scorer=model_scorer(cfg, built.mesh), **inputs)
        return recipe, built.state


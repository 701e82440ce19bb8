"""`--config.preference.<field>` (recipes "reward" and "dpo"): PreferenceConfig, the section both preference recipes
are handed as `cfg.preference`, with its length rule and what it cannot run with. A leaf: `run_config` names it in
its SECTIONS table (by string: the recipes import run_config) and the config files import it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from glm46_jax.errors import InputError, check_at_least, check_choice, check_range

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
    # reward: + center_rewards x (s_chosen + s_rejected)^2 per pair (TRL's center_rewards_coefficient, Eisenstein et
    # al. 2023): the loss alone fixes only score differences, so each prompt's scores would float by their own offset
    center_rewards: float = 0.0

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
        check_at_least("preference", self, 0, "gamma", "center_rewards")

    def steps(self, train_steps: int) -> int:
        """The run's length: train.steps when > 0, else `epochs` passes over the train split's tokens in rows of
        seq_len."""
        if train_steps > 0:
            return train_steps
        from glm46_jax.data.preference_loader import read_preference_metadata  # read once the config is known
        tokens = int(read_preference_metadata(self.root)["splits"]["train"]["tokens"])
        return max(1, math.ceil(self.epochs * tokens / (self.global_batch * self.seq_len)))

    def check_run(self, cfg: Any) -> None:
        """What the reward and DPO recipes cannot run with (`cfg`: the RunConfig), as one InputError."""
        stages, context = cfg.mesh.sizes().get("pipeline", 1), cfg.mesh.sizes().get("context", 1)
        if cfg.optim.offload == "optimizer_and_params":
            raise InputError(f"optim.offload=optimizer_and_params with recipe {cfg.recipe}: only the language-model "
                             "step (pretrain, mid-training, SFT) reads the weights through their device copy; "
                             "set optim.offload=optimizer (the optimizer state alone)")
        if context > 1:
            raise InputError(f"mesh.context={context} with recipe {cfg.recipe}: a preference batch reads each reply's "
                             "last position per row, which the context layout splits; set mesh.context=1")
        if stages > 1 and self.method == "lora":
            raise InputError(f"mesh.pipeline={stages} with preference.method=lora: the reward and DPO recipes do not "
                             "run LoRA on a pipeline mesh yet (SFT does: docs/lora.md#pipeline-meshes); set "
                             "mesh.pipeline=1 (or preference.method=full)")

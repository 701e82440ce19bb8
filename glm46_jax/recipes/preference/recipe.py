"""The preference recipes of the generic trainer: "reward" (a reward model: the GLM backbone and a score head,
Bradley-Terry on chosen/rejected pairs) and "dpo" (DPO, IPO or SimPO on the policy), full or LoRA.

    recipe, state = Pairs.build_dpo(run_cfg)   # mesh, policy (checkpoint.init_from), reference, optimizer
    recipe.start(state, data_state=None)          # packed pairs of `python -m data_prep preferences`
    state, summary = trainer.fit(recipe, state, ...)

Both read the same batches (glm46_jax.data.preference_loader) and differ only in their models and loss
(glm46_jax.recipes.preference.step). DPO's reference is a frozen copy of the starting weights (full fine-tuning),
the base with the adapters off (LoRA: no second copy), or none (SimPO). Held-out metrics are averaged over the
held-out pairs (`eval/accuracy`, `eval/margin`, ...); the run ends by writing <run_dir>/heldout.json with the
starting model's and the final model's values (docs/preferences.md#the-recipes).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from glm46_jax import atomic
from glm46_jax.data import iterator_state, loader, preference_loader
from glm46_jax.model import abstract_model
from glm46_jax.parallel import sharding
from glm46_jax.recipes import models
from glm46_jax.recipes.base import HeldOut, RecipeBase, warn_random_start
from glm46_jax.recipes.preference import step as pair_step
from glm46_jax.recipes.preference.config import PreferenceConfig
from glm46_jax.recipes.preference.agreement import calibration
from glm46_jax.run_config import RunConfig
from glm46_jax.training.step import LossFn, TrainState
from glm46_jax.training.trainer import Segment, StepInput


@dataclasses.dataclass
class Pairs(RecipeBase):
    """A recipe that trains one model (`name`) with `loss` on preference pairs (`trainer.Recipe`)."""
    name: str = "policy"
    loss: LossFn | None = None
    data: Any = None  # the train iterator, set by `start`
    tokens_seen: int = 0  # token slots of the batches so far (global_batch x seq_len per step)
    start_metrics: dict[str, float] | None = None

    @property
    def pref(self) -> PreferenceConfig:
        return self.cfg.preference

    @property
    def segment(self) -> Segment:
        return Segment(f"{self.cfg.recipe}_{self.pref.method}", self.pref.seq_len)

    def current_segment(self) -> Segment:
        return self.segment

    def tokenizer_source(self) -> str | None:
        return os.path.join(self.pref.root, "tokenizer.json")

    def extra_meta(self) -> dict[str, Any]:
        return {"preference": {"method": self.pref.method, "loss_type": self.pref.loss_type}}

    def _loader_cfg(self, split: str, **kw: Any) -> preference_loader.PreferenceLoaderConfig:
        return preference_loader.PreferenceLoaderConfig(root=self.pref.root, split=split, seed=self.cfg.data.seed,
                                                        pairs_per_row=self.pref.pairs_per_row, **kw)

    def start(self, state: TrainState, data_state: Any | None = None) -> None:
        self.data = iter(preference_loader.preference_batches(self._loader_cfg("train"), self.pref.seq_len,
                                                              self.pref.global_batch))
        if data_state is not None:
            iterator_state.restore(self.data, data_state["iterator"])
            self.tokens_seen = int(data_state["tokens_seen"])
        elif state is not None:
            self.start_metrics = self.held_out(state)
            if self.start_metrics:
                logging.info("held-out pairs, starting model: %s", _fmt(self.start_metrics))

    def next_input(self, state: TrainState, max_loss: float) -> StepInput:
        local = next(self.data)
        self.tokens_seen += self.pref.global_batch * self.pref.seq_len
        data_state = {"iterator": iterator_state.to_json(self.data), "tokens_seen": self.tokens_seen}
        batch = loader.to_global(local, self.mesh, accum_steps=self.cfg.train.accum_steps)
        with jax.transfer_guard_host_to_device("allow"):
            controls = {"max_loss": jnp.float32(max_loss), "lr": self.lr_inputs}
        return StepInput(self.segment, batch, controls, self.tokens_seen, data_state)

    def steps_for(self, segment: Any) -> Any:
        return self._train_step

    @functools.cached_property
    def _train_step(self) -> Any:  # one segment: traced once
        return pair_step.make_pair_step(self.loss, self.main.tx, self.name, accum_steps=self.cfg.train.accum_steps,
                                        lr_schedule=self.main.lr_schedule)

    # --- held-out pairs -----------------------------------------------------------------------

    def heldout_sets(self, segment: Any) -> dict[str, list[dict[str, jax.Array]]]:
        """The first train.eval_batches batches of one pass over the held-out pairs (every process reads them
        whole and keeps its rows) as the segment's one set; {} without a held-out split."""
        meta = preference_loader.read_preference_metadata(self.pref.root)
        if not meta["splits"].get("heldout", {}).get("pairs"):
            logging.warning("%s: no held-out pairs; no eval metrics (data_prep preferences --heldout-fraction)",
                            self.pref.root)
            return {}
        cfg = self._loader_cfg("heldout", num_epochs=1, shuffle=False, process_index=0, process_count=1)
        it = iter(preference_loader.preference_batches(cfg, self.pref.seq_len, self.pref.global_batch))
        return {"": [loader.to_global(b, self.mesh, global_rows=True)
                     for _, b in zip(range(self.cfg.train.eval_batches), it)]}

    @functools.cached_property
    def _heldout(self) -> HeldOut:  # the base's held-out path: one compiled eval program, the batches read once
        return HeldOut(lambda segment: pair_step.make_pair_eval(self.loss, self.name), self.heldout_sets,
                       summarize=_pair_mean)

    def held_out(self, state: TrainState) -> dict[str, float]:
        """Each metric averaged over the held-out pairs (batches weighted by their pairs); {} without any."""
        with sharding.use_mesh(self.mesh):  # also called outside the trainer's loop (start, finish)
            return self._heldout.scores(state, self.segment, {}, self.frozen).get("", {})

    def evaluate(self, state: TrainState, segment: Any, controls: Any) -> dict[str, float]:
        return {f"eval/{k}": v for k, v in self.held_out(state).items()}

    def calibration(self, state: TrainState) -> list[dict[str, float]]:
        """A reward model's held-out pairs per |score margin| bucket: how many, the share it orders right, and the
        share a calibrated Bradley-Terry model would (`agreement.calibration`)."""
        scores = pair_step.make_reward_scores(self.main.graphdef, self.name)
        chosen, rejected = [], []
        with sharding.use_mesh(self.mesh), jax.transfer_guard("allow"):
            for batch in self.heldout_sets(self.segment).get("", []):
                c, r, mask = (np.asarray(x) for x in jax.device_get(scores(state, batch, self.frozen)))
                chosen.append(c[mask > 0])
                rejected.append(r[mask > 0])
        return calibration(np.concatenate(chosen), np.concatenate(rejected)) if chosen else []

    def finish(self, state: TrainState, step: int, run_dir: str, tokens_seen: int) -> str | None:
        """Writes <run_dir>/heldout.json (the held-out metrics before and after); LoRA: also the merged weights."""
        after = self.held_out(state)
        result = {"start": self.start_metrics, "end": after, "steps": step}
        if self.name == "reward" and after:
            result["calibration"] = self.calibration(state)
        if jax.process_index() == 0 and after:
            atomic.write_json(os.path.join(run_dir, "heldout.json"), result)
        if after:
            logging.info("held-out pairs, final model: %s", _fmt(after))
        return super().finish(state, step, run_dir, tokens_seen)

    def close(self) -> None:
        self.data = None

    @staticmethod
    def build_reward(cfg: RunConfig, devices: Sequence[jax.Device] | None = None) -> tuple[Pairs, TrainState]:
        """A reward model: checkpoint.init_from's backbone with a one-output score head (fresh unless init_from has
        one), full or LoRA (the head then trains in full)."""
        pref = cfg.preference
        preference_loader.read_preference_metadata(pref.root)  # a missing or foreign dataset fails here, naming it
        model_cfg = dataclasses.replace(cfg.model, score_head=1)
        spec = models.ModelSpec("reward", model_cfg, init_from=cfg.checkpoint.init_from,
                                lora=cfg.lora if pref.method == "lora" else None)
        warn_random_start(spec, "the reward model trains")
        built = models.build(cfg, devices, [spec], [_batch_shape(cfg)])
        loss = pair_step.reward_objective(built.models["reward"].graphdef, pref, "reward")
        logging.info("%d steps of %s reward-model training on %s", cfg.total_steps, pref.method, pref.root)
        return Pairs(cfg, built, name="reward", loss=loss), built.state

    @staticmethod
    def build_dpo(cfg: RunConfig, devices: Sequence[jax.Device] | None = None) -> tuple[Pairs, TrainState]:
        """DPO / IPO / SimPO of checkpoint.init_from's model; the reference is a frozen copy of it (full), its base
        with the adapters off (LoRA) or none (SimPO)."""
        pref = cfg.preference
        preference_loader.read_preference_metadata(pref.root)
        lora_cfg = cfg.lora if pref.method == "lora" else None
        specs = [models.ModelSpec("policy", cfg.model, init_from=cfg.checkpoint.init_from, lora=lora_cfg)]
        needs_reference = pref.loss_type != "simpo"
        if needs_reference and lora_cfg is None:
            specs.append(models.ModelSpec("reference", cfg.model, init_from=cfg.checkpoint.init_from, trained=False))
        warn_random_start(specs[0], "preference optimisation starts from")
        built = models.build(cfg, devices, specs, [_batch_shape(cfg)])
        reference = None
        if needs_reference and lora_cfg is None:
            reference = pair_step.Reference("reference", built.models["reference"].graphdef)
        elif needs_reference:
            reference = pair_step.Reference("base", abstract_model(cfg.model, built.mesh)[0])
        loss = pair_step.dpo_objective(built.models["policy"].graphdef, pref, reference, "policy")
        logging.info("%d steps of %s %s on %s (reference: %s)", cfg.total_steps, pref.method, pref.loss_type, pref.root,
                     reference.source if reference else "none")
        return Pairs(cfg, built, name="policy", loss=loss), built.state


def _pair_mean(per_batch: list[dict[str, Any]]) -> dict[str, float]:
    """Each metric averaged over the pairs (batches weighted by their pair counts), and the pair count."""
    pairs = np.array([m["pairs"] for m in per_batch], np.float64)
    out = {k: float(np.sum([m[k] for m in per_batch] * pairs) / max(pairs.sum(), 1.0))
           for k in per_batch[0] if k != "pairs"}
    out["pairs"] = float(pairs.sum())
    return out


def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in metrics.items())


def _batch_shape(cfg: RunConfig) -> models.BatchShape:
    pref = cfg.preference
    return models.BatchShape("preference.global_batch", pref.global_batch, "preference.seq_len", pref.seq_len,
                             cfg.train.accum_steps)


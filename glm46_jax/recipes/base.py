"""What every recipe shares, written once: `RecipeBase` (the `trainer.Recipe` members that do not depend on the
recipe) and `LanguageModeling` (next-token training on token batches: pre-training, mid-training, SFT).

    class MyRecipe(RecipeBase):        # implement start, next_input, steps_for, evaluate (docs/trainer.md)
        ...
        @staticmethod
        def build(cfg, devices):       # named in run_config.RECIPES: "<module>:MyRecipe.build"
            built = models.build(cfg, devices, [ModelSpec(...)], [BatchShape(...)])
            return MyRecipe(cfg, built), built.state
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from absl import logging

from glm46_jax.config import ModelConfig
from glm46_jax.data import loader
from glm46_jax.model.attention import check_documents_fit
from glm46_jax.model.counting import flops_per_token
from glm46_jax.recipes import models
from glm46_jax.run_config import RunConfig
from glm46_jax.training import compiled
from glm46_jax.training.balancing import rate_at
from glm46_jax.training.loss import mtp_weight_at
from glm46_jax.training.step import StepConfig, TrainState, controls, make_eval_step, make_train_step


@dataclasses.dataclass
class RecipeBase:
    """The recipe-independent half of `trainer.Recipe`; subclasses add the batches, the step and evaluation."""
    cfg: RunConfig
    built: models.Built
    tokenizer: dict[str, str] | None = dataclasses.field(default=None, kw_only=True)  # set by train.py

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.built.mesh

    @property
    def frozen(self) -> Any:
        return self.built.frozen

    @property
    def main(self) -> models.Model:
        return self.built.main

    @property
    def total_steps(self) -> int:
        return self.cfg.total_steps

    @functools.cached_property
    def lr_inputs(self) -> dict[str, dict[str, jax.Array]]:
        """Each trained model's lr-schedule numbers by name: every step's controls["lr"], so they are inputs of the
        compiled step rather than constants in it (training/schedule.py)."""
        with jax.transfer_guard_host_to_device("allow"):
            return {m.spec.name: m.lr_schedule.inputs() for m in self.built.models.values() if m.spec.trained}

    @property
    def global_rows(self) -> bool:
        """Every process reads the whole batch (so the data state restores on any process count)."""
        return False

    def tokenizer_source(self) -> str | None:
        """The tokenizer.json the run's tokens come from (copied into the run dir); None = none known."""
        return None

    def model_for(self, segment: Any) -> ModelConfig:
        return self.main.config

    def flops_per_token(self, segment: Any) -> float:
        model = self.model_for(segment)
        if not self.cfg.loss.mtp:  # the MTP layer exists but never runs: its FLOPs are not the step's
            model = model.replace(num_nextn_predict_layers=0)
        return flops_per_token(model, segment.seq_len)

    def describe(self, segment: Any) -> dict[str, float]:
        return {"seq_len": segment.seq_len}

    def extra_meta(self) -> dict[str, Any]:
        """Recipe-specific entries of the checkpoint meta."""
        return {}

    def checkpoint_meta(self, segment: Any, tokens_seen: int) -> dict[str, Any]:
        meta = {"model_config": dataclasses.asdict(self.model_for(segment)), "phase": segment.name,
                "tokens_seen": tokens_seen, "tokenizer": self.tokenizer, "config": dict(self.cfg.source),
                **self.extra_meta()}
        meta["init_from"] = self.main.spec.init_from
        if self.main.spec.lora is not None:
            meta["lora"] = self.main.spec.lora.to_dict()
        trained = [m for m in self.built.models.values() if m.spec.trained and m is not self.main]
        if trained:  # the further models' architectures, for restoring them (checkpoint.Checkpointer)
            meta["model_configs"] = {m.spec.name: dataclasses.asdict(m.config) for m in trained}
        return meta

    def current_segment(self) -> Any:
        """The segment the run ended in (for the meta of what `finish` writes)."""
        raise NotImplementedError

    def stop_reason(self) -> str | None:
        return None  # runs its steps to the end

    def finish(self, state: TrainState, step: int, run_dir: str, tokens_seen: int) -> str | None:
        """After a completed run: with LoRA, the merged weights at <run_dir>/merged/<step> (their path)."""
        if self.main.spec.lora is None:
            return None
        return models.save_merged(self.main, state, self.frozen, self.mesh, run_dir, step,
                                  self.checkpoint_meta(self.current_segment(), tokens_seen))

    def close(self) -> None:
        pass


def mean_and_perplexity(per_batch: list[dict[str, Any]]) -> dict[str, float]:
    """Each metric's mean over the batches, and the perplexity of the mean CE (not the mean of perplexities)."""
    out = {k: float(np.mean([m[k] for m in per_batch])) for k in per_batch[0]}
    out["ppl"] = float(np.exp(out["ce"]))
    return out


class HeldOut:
    """Held-out sets scored by one compiled eval program per segment and batch shape (`compiled.CompileOnce`), each
    set's per-batch metrics reduced by `summarize`: `eval/<metric>` for the segment's own set (name ""),
    `eval/<set>/<metric>` for a named set (a domain); {} without held-out data."""

    def __init__(self, eval_step_for: Callable[[Any], Callable], sets_for: Callable[[Any], dict[str, list]],
                 summarize: Callable[[list[dict[str, Any]]], dict[str, float]] = mean_and_perplexity):
        self.eval_step_for, self.sets_for, self.summarize = eval_step_for, sets_for, summarize
        self.sets: dict[str, dict[str, list]] = {}
        self.programs = compiled.CompileOnce("eval step")

    def scores(self, state: Any, segment: Any, ctrl: Any, frozen: Any) -> dict[str, dict[str, float]]:
        """Each held-out set's metrics: {set name: {metric: value}}; sets without batches left out."""
        if segment.name not in self.sets:
            self.sets[segment.name] = self.sets_for(segment)
        out = {}
        for name, batches in self.sets[segment.name].items():
            if batches:
                run = self.programs.get(segment.name, batches[0]["inputs"].shape, lambda: self.eval_step_for(segment),
                                        state, batches[0], ctrl, frozen)
                out[name] = self.summarize(jax.device_get([run(state, b, ctrl, frozen) for b in batches]))
        return out

    def __call__(self, state: Any, segment: Any, ctrl: Any, frozen: Any) -> dict[str, float]:
        return {f"eval/{name}/{k}" if name else f"eval/{k}": v
                for name, metrics in self.scores(state, segment, ctrl, frozen).items() for k, v in metrics.items()}


class LanguageModeling(RecipeBase):
    """Next-token training (CE, MTP and aux losses, loss-free balancing) of one model on token batches; a
    subclass brings the batches (`next_input`, `eval_sets`)."""

    def __post_init__(self):
        self.held_out = HeldOut(self.eval_step_for, lambda seg: self.eval_sets(seg, self.cfg.train.eval_batches))
        self._steps: dict[tuple, Callable] = {}  # segments with the same model config share one traced step

    @property
    def step_cfg(self) -> StepConfig:
        return StepConfig(loss=self.cfg.loss, balance_mtp=self.cfg.balance.include_mtp,
                          accum_steps=self.cfg.train.accum_steps)

    def steps_for(self, segment: Any) -> Callable:
        cfg, main = self.model_for(segment), self.main
        if ("train", cfg) not in self._steps:
            self._steps["train", cfg] = make_train_step(self.graphdef_for(segment), main.tx, cfg, self.step_cfg,
                                                        lr_schedule=main.lr_schedule, name=main.spec.name)
        return self._steps["train", cfg]

    def eval_step_for(self, segment: Any) -> Callable:
        cfg = self.model_for(segment)
        if ("eval", cfg) not in self._steps:
            self._steps["eval", cfg] = make_eval_step(self.graphdef_for(segment), cfg, self.cfg.loss,
                                                      name=self.main.spec.name)
        return self._steps["eval", cfg]

    def graphdef_for(self, segment: Any):
        return self.main.graphdef

    def evaluate(self, state: TrainState, segment: Any, ctrl: Any) -> dict[str, float]:
        return self.held_out(state, segment, ctrl, self.frozen)

    def eval_sets(self, segment: Any, count: int) -> dict[str, list[dict[str, jax.Array]]]:
        raise NotImplementedError

    def controls_at(self, tokens_seen: int, max_loss: float = float("inf")):
        """The token-scheduled scalars for a step starting after `tokens_seen` tokens."""
        with jax.transfer_guard_host_to_device("allow"):
            return {**controls(mtp_weight_at(self.cfg.loss, tokens_seen), rate_at(self.cfg.balance, tokens_seen),
                               max_loss), "lr": self.lr_inputs}

    def device_batch(self, local: Mapping[str, np.ndarray], *, train: bool = True) -> dict[str, jax.Array]:
        if "segment_ids" in local:  # cuDNN's packed attention has a documents-per-row limit: refuse here, not NaN
            check_documents_fit(self.cfg.model, local["segment_ids"], platform=self.mesh.devices.flat[0].platform,
                                context=self.mesh.shape.get("context", 1))
        return loader.to_global(local, self.mesh, accum_steps=self.cfg.train.accum_steps if train else 1,
                                global_rows=self.global_rows)


def warn_random_start(spec: models.ModelSpec, what: str) -> None:
    if not spec.init_from:
        logging.warning("checkpoint.init_from is empty: %s randomly initialised weights", what)


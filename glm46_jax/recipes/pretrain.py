"""Pre-training (and mid-training) as a recipe of the generic trainer: a curriculum of phases.

    recipe, state = Pretraining.build(run_cfg)        # mesh, model, optimizer, state; nothing compiled
    recipe.start(state, data_state=None)              # the curriculum's batches, from the start or a checkpoint
    state, summary = trainer.fit(recipe, state, ...)

Each curriculum phase (`data.curriculum.Phase`) is a segment of the run: it brings its sequence
length, batch, mixture, packing and RoPE theta, so the step is traced per RoPE theta and compiled
per batch shape. The step is `training.step.make_train_step` (Muon + AdamW, MTP and aux losses,
loss-free balancing); the MTP weight and the balancing rate follow the tokens seen (`controls_at`).
The starting weights are `checkpoint.init_from`'s (mid-training) or a random init (`models.build`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax
from absl import logging

from glm46_jax.config import ModelConfig
from glm46_jax.data import loader
from glm46_jax.data.curriculum import Curriculum, CurriculumIterator, Phase
from glm46_jax.data.loader import LoaderConfig
from glm46_jax.model import abstract_model
from glm46_jax.recipes.base import LanguageModeling
from glm46_jax.run_config import RunConfig
from glm46_jax.recipes import models
from glm46_jax.training.step import TrainState
from glm46_jax.training.trainer import StepInput


@dataclasses.dataclass
class Pretraining(LanguageModeling):
    """The pre-training recipe (`trainer.Recipe`): curriculum batches into the language-model step."""
    loader_cfg: LoaderConfig | None = None
    data: CurriculumIterator | None = None  # set by `start`

    @property
    def curriculum(self) -> Curriculum:
        return self.cfg.data.curriculum

    @property
    def global_rows(self) -> bool:
        """data.process_split="rows": every process reads the whole batch."""
        return self.cfg.data.process_split == "rows"

    def tokenizer_source(self) -> str | None:
        return os.path.join(self.cfg.data.root, "tokenizer.json")

    def model_for(self, phase: Phase) -> ModelConfig:
        return dataclasses.replace(self.cfg.model, rope_theta=float(phase.rope_theta))

    def graphdef_for(self, phase: Phase):
        return abstract_model(self.model_for(phase), self.mesh)[0]  # the parameters are the same for every theta

    def describe(self, phase: Phase) -> dict[str, float]:
        return {"seq_len": phase.seq_len, "rope_theta": phase.rope_theta}

    def current_segment(self) -> Phase:
        return self.curriculum.phases[-1]

    # --- the batch source ---------------------------------------------------------------------

    def start(self, state: TrainState, data_state: Any | None = None) -> None:
        self.data = CurriculumIterator(self.curriculum, self.loader_cfg)
        if data_state is not None:
            self.data.set_state(data_state)

    def next_input(self, state: TrainState, max_loss: float) -> StepInput:
        tokens_before = self.data.tokens_seen
        phase, local = next(self.data)
        # The iterator's state right after this batch is what a checkpoint after its step holds.
        return StepInput(phase, self.device_batch(local), self.controls_at(tokens_before, max_loss),
                         self.data.tokens_seen, self.data.get_state())

    def eval_sets(self, phase: Phase, count: int) -> dict[str, list[dict[str, jax.Array]]]:
        """`count` held-out batches of the phase's mixture (name ""), length and packing, and with
        train.eval_per_domain of each of its domains alone (named by the domain: "domain vs general" in
        mid-training). A domain without held-out data is left out with a warning; {} when none has any."""
        mixture = {d: w for d, w in phase.mixture.items() if w > 0}
        present = {d: w for d, w in mixture.items() if loader.has_split(self.loader_cfg.root, d, "heldout")}
        if present.keys() != mixture.keys():
            logging.warning("phase %s: no held-out data for %s in %s; evaluating on %s", phase.name,
                            sorted(mixture.keys() - present.keys()), self.loader_cfg.root, sorted(present) or "nothing")
        if not present:
            return {}
        sets = {"": present}
        if self.cfg.train.eval_per_domain:
            sets.update({d: {d: 1.0} for d in present})
        cfg = dataclasses.replace(self.loader_cfg, split="heldout")
        out = {}
        for name, weights in sets.items():
            it = iter(loader.training_batches(cfg, weights, phase.seq_len, phase.global_batch, phase.pack))
            out[name] = [self.device_batch(next(it), train=False) for _ in range(count)]
        return out

    def close(self) -> None:
        if self.data is not None:
            self.data.close()

    @staticmethod
    def build(cfg: RunConfig, devices: Sequence[jax.Device] | None = None) -> tuple[Pretraining, TrainState]:
        """Mesh -> model (`checkpoint.init_from`'s weights or a random init) -> optimizer -> train state (nothing
        compiled, no data read yet)."""
        accum = cfg.train.accum_steps
        # A ramped phase's batches grow by rows_unit, so that is what must split.
        batches = [models.BatchShape(f"data.phases.{p.name}.global_batch (or its batch_ramp increment)", p.rows_unit,
                                     f"data.phases.{p.name}.seq_len", p.seq_len, accum)
                   for p in cfg.data.curriculum.phases]
        built = models.build(cfg, devices, [models.ModelSpec("model", cfg.model, init_from=cfg.checkpoint.init_from)],
                             batches)
        d = cfg.data
        rows = {"process_index": 0, "process_count": 1} if d.process_split == "rows" else {}
        loader_cfg = LoaderConfig(root=d.root, seed=d.seed, num_workers=d.num_workers, read_threads=d.read_threads,
                                  **rows)
        logging.info("%d steps over phases %s", cfg.total_steps, [p.name for p in cfg.data.curriculum.phases])
        return Pretraining(cfg, built, loader_cfg=loader_cfg), built.state


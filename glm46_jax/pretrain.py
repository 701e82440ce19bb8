"""Pre-training (and mid-training) as a recipe of the generic trainer: a curriculum of phases.

    recipe, state = pretrain.build(run_cfg)          # mesh, model, optimizer, state; nothing compiled
    recipe.start(data_state=None)                     # the curriculum's batches, from the start or a checkpoint
    state, summary = trainer.fit(recipe, state, ...)

Each curriculum phase (`data.curriculum.Phase`) is a segment of the run: it brings its sequence
length, batch, mixture, packing and RoPE theta, so the step is traced per RoPE theta and compiled
per batch shape. The step is `train_step.make_train_step` (Muon + AdamW, MTP and aux losses,
loss-free balancing); the MTP weight and the balancing rate follow the tokens seen (`controls_at`).
A fine-tuning or RL recipe implements the same `trainer.Recipe` methods with its own batches
and step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from absl import logging

from glm46_jax import sharding
from glm46_jax.balancing import rate_at
from glm46_jax.cli import InputError
from glm46_jax.config import ModelConfig
from glm46_jax.counting import flops_per_token
from glm46_jax.data import loader
from glm46_jax.data.curriculum import Curriculum, CurriculumIterator, Phase
from glm46_jax.data.loader import LoaderConfig
from glm46_jax.loss import mtp_weight_at
from glm46_jax.model import abstract_model, init_model
from glm46_jax.optim import build_optimizer
from glm46_jax.run_config import RunConfig
from glm46_jax.train_step import StepConfig, TrainState, controls, init_state, make_eval_step, make_train_step
from glm46_jax.trainer import StepInput


@dataclasses.dataclass
class Pretraining:
    """The pre-training recipe (`trainer.Recipe`): curriculum batches into the train step."""
    cfg: RunConfig
    mesh: jax.sharding.Mesh
    tx: optax.GradientTransformation
    lr_schedule: optax.Schedule
    loader_cfg: LoaderConfig
    tokenizer: dict[str, str] | None = None  # the corpus's tokenizer.json, recorded in checkpoints
    data: CurriculumIterator | None = None  # set by `start`

    @property
    def total_steps(self) -> int:
        return self.cfg.total_steps

    @property
    def curriculum(self) -> Curriculum:
        return self.cfg.data.curriculum

    @property
    def global_rows(self) -> bool:
        """data.process_split="rows": every process reads the whole batch."""
        return self.cfg.data.process_split == "rows"

    @property
    def step_cfg(self) -> StepConfig:
        return StepConfig(loss=self.cfg.loss, balance_mtp=self.cfg.balance.include_mtp,
                          accum_steps=self.cfg.train.accum_steps)

    def model_for(self, phase: Phase) -> ModelConfig:
        return dataclasses.replace(self.cfg.model, rope_theta=float(phase.rope_theta))

    def steps_for(self, phase: Phase) -> tuple[Any, Any]:
        """(train_step, eval_step), jitted, for the phase's model config (phases sharing a RoPE
        theta share one traced step)."""
        return _steps(self.model_for(phase), self.mesh, self.tx, self.step_cfg, self.lr_schedule)

    def flops_per_token(self, phase: Phase) -> float:
        return flops_per_token(self.cfg.model, phase.seq_len)

    def describe(self, phase: Phase) -> dict[str, float]:
        return {"seq_len": phase.seq_len, "rope_theta": phase.rope_theta}

    def controls_at(self, tokens_seen: int, max_loss: float = float("inf")):
        """The token-scheduled scalars for a step starting after `tokens_seen` tokens."""
        with jax.transfer_guard_host_to_device("allow"):
            return controls(mtp_weight_at(self.cfg.loss, tokens_seen), rate_at(self.cfg.balance, tokens_seen),
                            max_loss)

    def device_batch(self, local: Mapping[str, np.ndarray], *, train: bool = True) -> dict[str, jax.Array]:
        return loader.to_global(local, self.mesh, accum_steps=self.cfg.train.accum_steps if train else 1,
                                global_rows=self.global_rows)

    # --- the batch source ---------------------------------------------------------------------

    def start(self, data_state: Any | None = None) -> None:
        self.data = CurriculumIterator(self.curriculum, self.loader_cfg)
        if data_state is not None:
            self.data.set_state(data_state)

    def next_input(self, max_loss: float) -> StepInput:
        tokens_before = self.data.tokens_seen
        phase, local = next(self.data)
        # The iterator's state right after this batch is what a checkpoint after its step holds.
        return StepInput(phase, self.device_batch(local), self.controls_at(tokens_before, max_loss),
                         self.data.tokens_seen, self.data.get_state())

    def eval_batches(self, phase: Phase, count: int) -> dict[str, list[dict[str, jax.Array]]]:
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

    def checkpoint_meta(self, phase: Phase, tokens_seen: int) -> dict[str, Any]:
        return {"model_config": dataclasses.asdict(self.model_for(phase)), "phase": phase.name,
                "tokens_seen": tokens_seen, "tokenizer": self.tokenizer, "config": dict(self.cfg.source)}

    def close(self) -> None:
        if self.data is not None:
            self.data.close()


@functools.lru_cache(maxsize=8)
def _steps(cfg: ModelConfig, mesh, tx, step_cfg: StepConfig, lr_schedule):
    graphdef = abstract_model(cfg, mesh)[0]  # the parameters are the same for every RoPE theta
    return (make_train_step(graphdef, tx, cfg, step_cfg, lr_schedule=lr_schedule),
            make_eval_step(graphdef, cfg, step_cfg.loss))


def _check_batches(curriculum: Curriculum, accum: int, batch_shards: int, context: int) -> None:
    for p in curriculum.phases:
        sharding.check_context_split(p.seq_len, context, f"data.phases.{p.name}.seq_len")
        unit = p.rows_unit
        if unit % accum or (unit // accum) % batch_shards:
            raise InputError(
                f"data.phases.{p.name}: batches of {unit} rows (global_batch, or the ramp's increment) must split "
                f"into train.accum_steps={accum} micro-batches of a multiple of {batch_shards} rows (the mesh's "
                f"data x expert devices). Change the phase's global_batch / batch_ramp, accum_steps or the mesh.")


def build(cfg: RunConfig, devices: Sequence[jax.Device] | None = None) -> tuple[Pretraining, TrainState]:
    """Mesh -> model -> optimizer -> train state (nothing compiled, no data read yet)."""
    accum = cfg.train.accum_steps
    sizes = sharding.mesh_shape(cfg.mesh.sizes(), len(devices) if devices is not None else jax.device_count())
    _check_batches(cfg.data.curriculum, accum, sizes["data"] * sizes["expert"], sizes["context"])
    first = cfg.data.curriculum.phases[0]
    mesh = sharding.make_mesh(cfg.mesh.sizes(), devices, cfg=cfg.model, global_batch=first.rows_unit // accum)
    _, params, buffers = init_model(cfg.model, mesh, cfg.train.seed)
    tx, lr_schedule = build_optimizer(cfg.optim, params)
    with sharding.use_mesh(mesh):
        state = init_state(params, buffers, tx)
    d = cfg.data
    rows = {"process_index": 0, "process_count": 1} if d.process_split == "rows" else {}
    loader_cfg = LoaderConfig(root=d.root, seed=d.seed, num_workers=d.num_workers, read_threads=d.read_threads,
                              **rows)
    return Pretraining(cfg, mesh, tx, lr_schedule, loader_cfg), state

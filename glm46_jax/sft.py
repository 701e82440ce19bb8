"""Supervised fine-tuning on chat data as a recipe of the generic trainer: full fine-tuning or LoRA.

    recipe, state = sft.build(run_cfg)       # mesh, base weights (checkpoint.init_from), adapters, optimizer
    recipe.start(data_state=None)            # packed conversations of `python -m data_prep sft`
    state, summary = trainer.fit(recipe, state, ...)

The batches are the pre-training dict with the loss mask on assistant tokens only (glm46_jax.data.sft_loader),
so the step is pre-training's `train_step` unchanged: the CE (and the MTP CE, if on) counts only what the
assistant says, and the held-out `eval/ce` is the assistant-token CE of the held-out conversations.

`sft.method="lora"`: the base weights come from `checkpoint.init_from` and stay frozen (a jit argument of the
step, not part of the train state), so gradients, the optimizer state and the checkpoints hold only the
adapters (glm46_jax.lora). At the end the run also writes `<run_dir>/merged/<step>`: the weights with the
adapters merged in, which generate/score/eval/convert read like any checkpoint. `sft.method="full"` trains every
weight, starting from `init_from` (docs/sft.md#the-sft-recipe).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from absl import logging
from flax import nnx

from glm46_jax import checkpoint, lora, sharding
from glm46_jax.balancing import rate_at
from glm46_jax.cli import InputError
from glm46_jax.config import ModelConfig
from glm46_jax.counting import flops_per_token
from glm46_jax.data import iterator_state, loader, sft_loader
from glm46_jax.loss import mtp_weight_at
from glm46_jax.model import abstract_model, init_model
from glm46_jax.optim import build_optimizer
from glm46_jax.run_config import RunConfig, SFTConfig, sft_steps
from glm46_jax.train_step import StepConfig, TrainState, controls, init_state, make_eval_step, make_train_step
from glm46_jax.trainer import StepInput


@dataclasses.dataclass(frozen=True)
class Stage:
    """The run's one segment (the trainer compiles per segment and batch shape)."""
    name: str
    seq_len: int


@dataclasses.dataclass
class FineTuning:
    """The SFT recipe (`trainer.Recipe`)."""
    cfg: RunConfig
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    lr_schedule: optax.Schedule
    frozen: nnx.State | None  # LoRA: the base weights; full fine-tuning: None
    tokenizer: dict[str, str] | None = None
    data: Any = None  # the train iterator, set by `start`
    tokens_seen: int = 0  # token slots of the batches so far (global_batch x seq_len per step)

    @property
    def sft(self) -> SFTConfig:
        return self.cfg.sft

    @property
    def total_steps(self) -> int:
        return sft_steps(self.sft, self.cfg.train.steps)

    @property
    def global_rows(self) -> bool:
        return False

    @property
    def stage(self) -> Stage:
        return Stage(f"sft_{self.sft.method}", self.sft.seq_len)

    @property
    def step_cfg(self) -> StepConfig:
        return StepConfig(loss=self.cfg.loss, balance_mtp=self.cfg.balance.include_mtp,
                          accum_steps=self.cfg.train.accum_steps)

    def steps_for(self, stage: Stage) -> tuple[Any, Any]:
        model = self.cfg.model
        return (make_train_step(self.graphdef, self.tx, model, self.step_cfg, lr_schedule=self.lr_schedule,
                                frozen=self.frozen),
                make_eval_step(self.graphdef, model, self.step_cfg.loss, frozen=self.frozen))

    def flops_per_token(self, stage: Stage) -> float:
        return flops_per_token(self.cfg.model, stage.seq_len)

    def describe(self, stage: Stage) -> dict[str, float]:
        return {"seq_len": stage.seq_len}

    def _loader_cfg(self, split: str, **kw: Any) -> sft_loader.SFTLoaderConfig:
        return sft_loader.SFTLoaderConfig(root=self.sft.root, split=split, seed=self.cfg.data.seed, pack=self.sft.pack,
                                          num_workers=self.sft.num_workers if split == "train" else 0, **kw)

    def _device_batch(self, local: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        return loader.to_global(local, self.mesh, accum_steps=self.cfg.train.accum_steps)

    def start(self, data_state: Any | None = None) -> None:
        self.data = iter(sft_loader.sft_batches(self._loader_cfg("train"), self.sft.seq_len, self.sft.global_batch))
        if data_state is not None:
            iterator_state.restore(self.data, data_state["iterator"])
            self.tokens_seen = int(data_state["tokens_seen"])

    def next_input(self, max_loss: float) -> StepInput:
        before = self.tokens_seen
        local = next(self.data)
        # The batch's token slots (padding included), the same on every process, so the schedules the controls
        # follow agree everywhere; the trained (assistant) tokens of a step are its "tokens" metric.
        self.tokens_seen += self.sft.global_batch * self.sft.seq_len
        with jax.transfer_guard_host_to_device("allow"):
            ctrl = controls(mtp_weight_at(self.cfg.loss, before), rate_at(self.cfg.balance, before), max_loss)
        state = {"iterator": iterator_state.to_json(self.data), "tokens_seen": self.tokens_seen}
        return StepInput(self.stage, self._device_batch(local), ctrl, self.tokens_seen, state)

    def eval_batches(self, stage: Stage, count: int) -> dict[str, list[dict[str, jax.Array]]]:
        """The first `count` batches of the held-out conversations (one pass, fixed order): eval/ce is their
        assistant-token CE. {} when the dataset has no held-out split."""
        meta = sft_loader.read_sft_metadata(self.sft.root)
        if not meta["splits"].get("heldout", {}).get("samples"):
            logging.warning("%s: no held-out conversations; no eval/ce (data_prep sft --heldout-fraction)",
                            self.sft.root)
            return {}
        # Every process reads the whole held-out batches (one pass of a small split could give processes
        # different batch counts) and keeps its rows: the same eval set for any number of processes.
        cfg = self._loader_cfg("heldout", num_epochs=1, shuffle=False, process_index=0, process_count=1)
        it = iter(sft_loader.sft_batches(cfg, self.sft.seq_len, self.sft.global_batch))
        return {"": [loader.to_global(b, self.mesh, global_rows=True) for _, b in zip(range(count), it)]}

    def checkpoint_meta(self, stage: Stage, tokens_seen: int) -> dict[str, Any]:
        meta = {"model_config": dataclasses.asdict(self.cfg.model), "phase": stage.name, "tokens_seen": tokens_seen,
                "tokenizer": self.tokenizer, "config": dict(self.cfg.source), "sft_method": self.sft.method,
                "init_from": self.cfg.checkpoint.init_from}
        if self.frozen is not None:
            meta["lora"] = self.cfg.lora.to_dict()
        return meta

    def finish(self, state: TrainState, step: int, run_dir: str) -> str | None:
        """LoRA: write the merged weights to <run_dir>/merged/<step> (what generate/eval/convert load)."""
        if self.frozen is None:
            return None
        _, params = lora.merge_adapters(self.graphdef, state.params, self.frozen, state.buffers, self.mesh)
        params = jax.tree.map(lambda x: x.astype(self.cfg.model.param_dtype), params)
        path = checkpoint.save_params(os.path.join(run_dir, "merged"), step, params, state.buffers, self.cfg.model,
                                      meta={**self.checkpoint_meta(self.stage, self.tokens_seen),
                                            "merged_from": "lora"})
        logging.info("merged the adapters into the base weights: %s", path)
        return path

    def close(self) -> None:
        self.data = None


def load_base(init_from: str, model_cfg: ModelConfig, mesh: jax.sharding.Mesh, seed: int):
    """(params, buffers) to fine-tune: `init_from`'s weights (architecture checked against config.model), or a
    random init with a warning (for debugging: fine-tuning random weights teaches little)."""
    if not init_from:
        logging.warning("checkpoint.init_from is empty: fine-tuning randomly initialised weights")
        _, params, buffers = init_model(model_cfg, mesh, seed)
        return params, buffers
    init_cfg, _, params, buffers = checkpoint.load_params(init_from, mesh)
    checkpoint.check_same_model(init_cfg, model_cfg, f"checkpoint.init_from={init_from}")
    return params, buffers


def build(cfg: RunConfig, devices: Sequence[jax.Device] | None = None) -> tuple[FineTuning, TrainState]:
    """Mesh -> base weights -> (adapters) -> optimizer -> train state. Nothing compiled, no data read."""
    sft, accum = cfg.sft, cfg.train.accum_steps
    sizes = sharding.mesh_shape(cfg.mesh.sizes(), len(devices) if devices is not None else jax.device_count())
    shards = sizes["data"] * sizes["expert"]
    if sft.global_batch % accum or (sft.global_batch // accum) % shards:
        raise InputError(f"sft.global_batch={sft.global_batch} must split into train.accum_steps={accum} "
                         f"micro-batches of a multiple of {shards} rows (the mesh's data x expert devices)")
    sharding.check_context_split(sft.seq_len, sizes["context"], "sft.seq_len")
    sft_loader.read_sft_metadata(sft.root)  # a missing or foreign dataset fails here, naming the path
    mesh = sharding.make_mesh(cfg.mesh.sizes(), devices, cfg=cfg.model, global_batch=sft.global_batch // accum)
    graphdef = abstract_model(cfg.model, mesh)[0]
    params, buffers = load_base(cfg.checkpoint.init_from, cfg.model, mesh, cfg.train.seed)
    frozen = None
    if sft.method == "lora":
        graphdef, params, frozen, buffers = lora.add_adapters(graphdef, params, buffers, cfg.lora, mesh,
                                                              seed=cfg.train.seed)
    tx, lr_schedule = build_optimizer(cfg.optim, params)
    with sharding.use_mesh(mesh):
        state = init_state(params, buffers, tx)
    return FineTuning(cfg, mesh, graphdef, tx, lr_schedule, frozen), state

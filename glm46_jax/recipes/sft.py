"""Supervised fine-tuning on chat data as a recipe of the generic trainer: full fine-tuning or LoRA.

    recipe, state = FineTuning.build(run_cfg)     # mesh, base weights (checkpoint.init_from), adapters, optimizer
    recipe.start(state, data_state=None)     # packed conversations of `python -m data_prep sft`
    state, summary = trainer.fit(recipe, state, ...)

The batches are the pre-training dict with the loss mask on assistant tokens only (glm46_jax.data.sft_loader),
so the step is pre-training's `train_step` unchanged: the CE (and the MTP CE, if on) counts only what the
assistant says, and the held-out `eval/ce` is the assistant-token CE of the held-out conversations.

`sft.method="lora"`: the base weights come from `checkpoint.init_from` and stay frozen (`recipe.frozen`, a jit
argument of the step, not part of the train state), so gradients, the optimizer state and the checkpoints hold only
the adapters (glm46_jax.model.lora). At the end the run also writes `<run_dir>/merged/<step>`: the weights with the
adapters merged in, which generate/score/eval/convert read like any checkpoint. `sft.method="full"` trains every
weight, starting from `init_from` (docs/sft.md#the-sft-recipe).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
from absl import logging

from glm46_jax.data import iterator_state, loader, sft_loader
from glm46_jax.errors import InputError, check_at_least, check_choice, check_range
from glm46_jax.recipes.base import LanguageModeling, warn_random_start
from glm46_jax.run_config import RunConfig
from glm46_jax.recipes import models
from glm46_jax.training.step import TrainState
from glm46_jax.training.trainer import Segment, StepInput


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """`--config.sft.<field>` (recipe "sft", handed to it as `cfg.sft`): the chat data and how much of the model
    trains. `run_config.SECTIONS` names it (by string: this module imports run_config)."""
    root: str = "data/sample_sft"  # written by `python -m data_prep sft`
    seq_len: int = 512
    global_batch: int = 16
    epochs: float = 1.0  # the run's length when train.steps = 0: passes over the train split's tokens
    pack: str = "best_fit"
    method: str = "lora"  # lora: adapters on frozen base weights | full: every weight trains
    num_workers: int = 0

    def __post_init__(self):
        check_at_least("sft", self, 2, "seq_len")
        check_at_least("sft", self, 1, "global_batch")
        check_at_least("sft", self, 0, "num_workers")
        check_range("sft", self, "epochs", gt=0, meaning="passes over the train split (used when train.steps=0)")
        check_choice("sft", self, "pack", ("best_fit", "first_fit"))
        check_choice("sft", self, "method", ("lora", "full"), "lora: adapters on frozen weights; full: all weights")

    def steps(self, train_steps: int) -> int:
        """The run's length: train.steps when > 0, else `epochs` passes over the train split's tokens in batches of
        global_batch x seq_len (packing pads a little, so a nominal pass is slightly short of a real one)."""
        if train_steps > 0:
            return train_steps
        tokens = int(sft_loader.read_sft_metadata(self.root)["splits"]["train"]["tokens"])
        return max(1, math.ceil(self.epochs * tokens / (self.global_batch * self.seq_len)))

    def check_run(self, cfg: RunConfig) -> None:
        """What SFT cannot run with, as one InputError. Both methods run on every mesh the model runs on; on a
        pipeline mesh the LoRA adapters take the MoE stack's slot layout (docs/lora.md#pipeline-meshes)."""
        if self.method == "lora" and cfg.optim.offload == "optimizer_and_params":
            raise InputError("sft.method=lora with optim.offload=optimizer_and_params: the trained weights are the "
                             "adapters, too small to move (the frozen base stays on the device); set "
                             "optim.offload=optimizer or none")


@dataclasses.dataclass
class FineTuning(LanguageModeling):
    """The SFT recipe (`trainer.Recipe`)."""
    data: Any = None  # the train iterator, set by `start`
    tokens_seen: int = 0  # token slots of the batches so far (global_batch x seq_len per step)

    @property
    def sft(self) -> SFTConfig:
        return self.cfg.sft

    @property
    def segment(self) -> Segment:
        return Segment(f"sft_{self.sft.method}", self.sft.seq_len)

    def current_segment(self) -> Segment:
        return self.segment

    def tokenizer_source(self) -> str | None:
        return os.path.join(self.sft.root, "tokenizer.json")

    def extra_meta(self) -> dict[str, Any]:
        return {"sft_method": self.sft.method}

    def _loader_cfg(self, split: str, **kw: Any) -> sft_loader.SFTLoaderConfig:
        return sft_loader.SFTLoaderConfig(root=self.sft.root, split=split, seed=self.cfg.data.seed, pack=self.sft.pack,
                                          num_workers=self.sft.num_workers if split == "train" else 0, **kw)

    def start(self, state: TrainState, data_state: Any | None = None) -> None:
        self.data = iter(sft_loader.sft_batches(self._loader_cfg("train"), self.sft.seq_len, self.sft.global_batch))
        if data_state is not None:
            iterator_state.restore(self.data, data_state["iterator"])
            self.tokens_seen = int(data_state["tokens_seen"])

    def next_input(self, state: TrainState, max_loss: float) -> StepInput:
        before = self.tokens_seen
        local = next(self.data)
        # The batch's token slots (padding included), the same on every process, so the schedules the controls
        # follow agree everywhere; the trained (assistant) tokens of a step are its "tokens" metric.
        self.tokens_seen += self.sft.global_batch * self.sft.seq_len
        data_state = {"iterator": iterator_state.to_json(self.data), "tokens_seen": self.tokens_seen}
        return StepInput(self.segment, self.device_batch(local), self.controls_at(before, max_loss), self.tokens_seen,
                         data_state)

    def eval_sets(self, segment: Segment, count: int) -> dict[str, list[dict[str, jax.Array]]]:
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

    def close(self) -> None:
        self.data = None

    @staticmethod
    def build(cfg: RunConfig, devices: Sequence[jax.Device] | None = None) -> tuple[FineTuning, TrainState]:
        """Mesh -> base weights -> (adapters) -> optimizer -> train state. Nothing compiled, no data read."""
        sft = cfg.sft
        sft_loader.read_sft_metadata(sft.root)  # a missing or foreign dataset fails here, naming the path
        spec = models.ModelSpec("model", cfg.model, init_from=cfg.checkpoint.init_from,
                                lora=cfg.lora if sft.method == "lora" else None)
        warn_random_start(spec, "fine-tuning")
        built = models.build(cfg, devices, [spec], [models.BatchShape(
            "sft.global_batch", sft.global_batch, "sft.seq_len", sft.seq_len, cfg.train.accum_steps)])
        logging.info("%d steps of %s fine-tuning on %s", cfg.total_steps, sft.method, sft.root)
        return FineTuning(cfg, built), built.state


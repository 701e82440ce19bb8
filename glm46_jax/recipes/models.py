"""A run's named models, built one way for every recipe: mesh -> weights -> adapters -> optimizers -> state.

    built = models.build(run_cfg, devices, [ModelSpec("model", run_cfg.model, init_from=...)], batches)
    built.mesh, built.models["model"].graphdef, built.state, built.frozen

A recipe names the models it needs (`ModelSpec`): pre-training, SFT and GRPO one ("model" / "policy"), PPO a policy
and a critic and a frozen reference, DPO a policy and a frozen reference. Each trained model gets its own
optimizer; the first one's weights are `TrainState.params` (what every checkpoint has), the others'
`TrainState.others[name]`. Weights that are read but not trained (a LoRA run's base, a frozen model) are
`built.frozen`, which the steps take as a jit argument (docs/trainer.md#models-and-the-train-state).

Starting weights come from one place, `load_weights`: a checkpoint (`init_from`: another run, or an HF import
written by `convert hf-to-ckpt`), else a random init from the run's seed. A run that will resume reads `init_from`
only for what its checkpoints do not hold: frozen weights (a LoRA base, a frozen model).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from absl import logging
from flax import nnx

from glm46_jax.errors import InputError
from glm46_jax.config import ModelConfig
from glm46_jax.model import abstract_model, init_model, lora, pipeline
from glm46_jax.model.layers import normal_init
from glm46_jax.model.lora import LoRAConfig
from glm46_jax.parallel import sharding
from glm46_jax.run_config import RunConfig
from glm46_jax.training import checkpoint, offload
from glm46_jax.training.optim import OptimConfig, build_optimizer
from glm46_jax.training.schedule import Schedule
from glm46_jax.training.step import FrozenModel, ModelState, TrainState, init_opt_state


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model a recipe needs."""
    name: str
    config: ModelConfig
    init_from: str = ""  # a checkpoint / run dir; "" = a random init
    trained: bool = True  # False: a frozen model (e.g. a reference), read by the steps, never updated
    lora: LoRAConfig | None = None  # trained through adapters on frozen base weights
    optim: OptimConfig | None = None  # a trained model's optimizer; None = the run's (config.optim)
    seed_offset: int = 0  # its random init uses train.seed + this (models of one run start differently)
    # Read init_from even when the run resumes (by default a trained model without adapters then starts from a
    # random init, which the checkpoint overwrites, instead of reading init_from's weights for nothing).
    load_when_resuming: bool = False


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """A batch the run will step on, checked against the mesh before anything is built."""
    rows_field: str  # how the user sets `rows`, for the error message (e.g. "sft.global_batch")
    rows: int  # global rows per step
    seq_field: str  # ... and `seq_len` (e.g. "sft.seq_len")
    seq_len: int
    accum_steps: int = 1


@dataclasses.dataclass
class Model:
    """One built model: its (LoRA-adapted) graph and, when trained, its optimizer."""
    spec: ModelSpec
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation | None = None
    lr_schedule: Schedule | None = None

    @property
    def config(self) -> ModelConfig:
        return self.spec.config


@dataclasses.dataclass
class Built:
    mesh: jax.sharding.Mesh
    models: dict[str, Model]  # in the recipe's order; the first trained one is the state's main model
    state: TrainState
    frozen: dict[str, FrozenModel] | None  # by model name; None when nothing is frozen

    @property
    def main(self) -> Model:
        return next(m for m in self.models.values() if m.spec.trained)


def check_batches(batches: Sequence[BatchShape], sizes: dict[str, int]) -> None:
    """Every batch splits into its micro-batches of a multiple of the mesh's batch shards, and every row into
    the context axis's chunks."""
    shards = sizes["data"] * sizes["expert"]
    for b in batches:
        sharding.check_context_split(b.seq_len, sizes["context"], b.seq_field)
        if b.rows % b.accum_steps or (b.rows // b.accum_steps) % shards:
            raise InputError(
                f"{b.rows_field}={b.rows}: batches must split into train.accum_steps={b.accum_steps} micro-batches "
                f"of a multiple of {shards} rows (the mesh's data x expert devices). Change {b.rows_field}, "
                "train.accum_steps or the mesh.")


def load_weights(init_from: str, model_cfg: ModelConfig, mesh: jax.sharding.Mesh, seed: int
                 ) -> tuple[nnx.State, nnx.State]:
    """(params, buffers) to start from: `init_from`'s weights (its architecture must be `model_cfg`'s), else a
    random init from `seed`."""
    if not init_from:
        _, params, buffers = init_model(model_cfg, mesh, seed)
        return params, buffers
    init_cfg, _, params, buffers = checkpoint.load_params(init_from, mesh)
    if init_cfg.score_head != model_cfg.score_head:  # a reward model from a policy, or a policy from a reward model
        params = with_score_head(params, model_cfg, mesh, seed, init_from)
        init_cfg = dataclasses.replace(init_cfg, score_head=model_cfg.score_head)
    checkpoint.check_same_model(init_cfg, model_cfg, f"checkpoint.init_from={init_from}")
    fresh = checkpoint.read_meta(checkpoint.latest_checkpoint(init_from)).get("fresh_init") or []
    if fresh:
        logging.warning("checkpoint.init_from=%s: %s were not in the imported weights and start from a fresh "
                        "initialisation", init_from, ", ".join(fresh))
    logging.info("initialised the weights from %s", init_from)
    return params, buffers


def with_score_head(params: nnx.State, model_cfg: ModelConfig, mesh: jax.sharding.Mesh, seed: int,
                    source: str) -> nnx.State:
    """`params` of a checkpoint with `model_cfg`'s score head: a fresh one (HF's init: normal(0,
    initializer_range), from `seed`) when the checkpoint has none, none when `model_cfg` has none."""
    flat = {path: v for path, v in nnx.to_flat_state(params) if path[0] != "score"}
    if model_cfg.score_head:
        shape, dtype = (model_cfg.hidden_size, model_cfg.score_head), jnp.dtype(model_cfg.param_dtype)
        with sharding.use_mesh(mesh):
            value = jax.jit(lambda key: jax.sharding.reshard(normal_init(model_cfg)(key, shape, dtype),
                                                             sharding.logical("embed", None)))(jax.random.key(seed))
        flat[("score",)] = abstract_model(model_cfg, mesh)[1]["score"].replace(value)
        logging.info("%s has no score head: a fresh one (%d output(s)) starts from a random init", source,
                     model_cfg.score_head)
    return nnx.from_flat_state(list(flat.items()))


def build(cfg: RunConfig, devices: Sequence[jax.Device] | None, specs: Sequence[ModelSpec],
          batches: Sequence[BatchShape]) -> Built:
    """Mesh -> each model's weights -> (adapters) -> optimizers -> train state. Nothing compiled, no data read."""
    if not any(s.trained for s in specs):
        raise ValueError("a recipe needs at least one trained model")
    sizes = sharding.mesh_shape(cfg.mesh.sizes(), len(devices) if devices is not None else jax.device_count())
    check_batches(batches, sizes)
    main = next(s for s in specs if s.trained)
    rows = batches[0].rows // batches[0].accum_steps if batches else None
    mesh = sharding.make_mesh(cfg.mesh.sizes(), devices, cfg=main.config, global_batch=rows)
    for s in specs:
        if s is not main:
            sharding.validate_mesh(sizes, s.config, rows)
    resuming = cfg.checkpoint.resume == "auto" and bool(checkpoint.saved_steps(cfg.run_dir))
    models, trained, frozen = {}, {}, {}
    for s in specs:
        restored = resuming and s.trained and s.lora is None and not s.load_when_resuming
        params, buffers = load_weights("" if restored else s.init_from, s.config, mesh, cfg.train.seed + s.seed_offset)
        graphdef = abstract_model(s.config, mesh)[0]
        if not s.trained:
            models[s.name] = Model(s, graphdef)
            frozen[s.name] = FrozenModel(params, buffers)
            continue
        if s.lora is not None:
            graphdef, params, base, buffers = lora.add_adapters(graphdef, params, buffers, s.lora, mesh,
                                                                seed=cfg.train.seed + s.seed_offset)
            frozen[s.name] = FrozenModel(base)
        stages = mesh.shape["pipeline"]  # layer-wise lr decay counts depth in layer order, not the slots'
        tx, schedule = build_optimizer(s.optim or cfg.optim, params,
                                       layout=pipeline.layout(s.config, stages) if stages > 1 else None)
        models[s.name] = Model(s, graphdef, tx, schedule)
        with sharding.use_mesh(mesh):
            trained[s.name] = ModelState(params, buffers, init_opt_state(params, tx))
    first = trained.pop(main.name)
    with sharding.use_mesh(mesh):  # the step counter replicated over the mesh, like everything in the state
        step = jax.numpy.zeros((), jax.numpy.int32)
    state = TrainState(step=step, params=first.params, buffers=first.buffers, opt_state=first.opt_state,
                       others=trained)
    state = offload.place(state, {s.name: (s.optim or cfg.optim).offload for s in specs if s.trained}, main.name)
    return Built(mesh, models, state, frozen or None)


def merged_weights(model: Model, state_params: nnx.State, buffers: nnx.State, frozen: FrozenModel,
                   mesh: jax.sharding.Mesh) -> nnx.State:
    """A LoRA model's adapters merged into its base, in the base's dtype: the plain model's params."""
    _, params = lora.merge_adapters(model.graphdef, state_params, frozen.params, buffers, mesh)
    return jax.tree.map(lambda x: x.astype(model.config.param_dtype), params)


def save_merged(model: Model, state: TrainState, frozen: dict[str, FrozenModel], mesh: jax.sharding.Mesh,
                run_dir: str, step: int, meta: dict[str, Any]) -> str | None:
    """LoRA: write the main model's merged weights to <run_dir>/merged/<step> (what generate/eval/convert load);
    None without adapters."""
    if model.spec.lora is None:
        return None
    params = merged_weights(model, state.params, state.buffers, frozen[model.spec.name], mesh)
    path = checkpoint.save_params(os.path.join(run_dir, "merged"), step, params, state.buffers, model.config,
                                  meta={**meta, "merged_from": "lora"})
    logging.info("merged the adapters into the base weights: %s", path)
    return path

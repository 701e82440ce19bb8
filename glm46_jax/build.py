"""A training run's parts, built from the config: mesh, model, optimizer, state, curriculum, steps.

    run = build(config)                       # nothing compiled yet
    train_step, eval_step = run.steps_for(phase)

`train.py` drives a `Run` through the curriculum; `bench.py` times its step. Everything that is
fixed for the whole run lives here; what changes with the curriculum phase (RoPE theta, batch
shape) is looked up per phase, and the jitted steps are cached per model config.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
import optax

from glm46_jax import sharding
from glm46_jax.balancing import BalanceConfig, rate_at
from glm46_jax.config import ModelConfig, model_config_from_dict
from glm46_jax.counting import flops_per_token
from glm46_jax.data import curriculum as curriculum_lib
from glm46_jax.data.curriculum import Curriculum, Phase
from glm46_jax.data.loader import LoaderConfig
from glm46_jax.loss import LossConfig, mtp_weight_at
from glm46_jax.model import abstract_model, init_model
from glm46_jax.optim import OptimConfig, build_optimizer
from glm46_jax.train_step import StepConfig, TrainState, controls, init_state, make_eval_step, make_train_step


@dataclasses.dataclass
class Run:
    model_cfg: ModelConfig  # the config's model; each phase overrides rope_theta (`model_for`)
    loss_cfg: LossConfig
    balance_cfg: BalanceConfig
    step_cfg: StepConfig
    curriculum: Curriculum
    loader_cfg: LoaderConfig
    mesh: jax.sharding.Mesh
    state: TrainState | None  # handed to the caller, who owns it from then on (the step donates it)
    tx: optax.GradientTransformation
    lr_schedule: optax.Schedule
    total_steps: int  # of this run: the curriculum's, or train.steps if smaller
    global_rows: bool = False  # data.process_split="rows": every process reads the whole batch

    @property
    def accum_steps(self) -> int:
        return self.step_cfg.accum_steps

    def model_for(self, phase: Phase) -> ModelConfig:
        return dataclasses.replace(self.model_cfg, rope_theta=float(phase.rope_theta))

    def steps_for(self, phase: Phase) -> tuple[Any, Any]:
        """(train_step, eval_step), jitted, for the phase's model config (cached: phases sharing a
        RoPE theta share one traced step; a new batch shape still compiles once)."""
        return _steps(self.model_for(phase), self.mesh, self.tx, self.step_cfg, self.lr_schedule)

    def flops_per_token(self, phase: Phase) -> int:
        return flops_per_token(self.model_cfg, phase.seq_len)

    def device_batch(self, local: Mapping[str, np.ndarray], *, train: bool = True) -> dict[str, jax.Array]:
        """This process's rows (with `global_rows`: the whole batch) -> global arrays over the mesh's
        batch axes; for the train step with accumulation, [accum, rows / accum, seq] with the
        micro-batch axis unsharded."""
        a = self.accum_steps if train else 1
        layout = jax.NamedSharding(self.mesh, sharding.logical(*((None,) if a > 1 else ()), "batch", "seq"))
        out = {}
        # The sanctioned host->device copy of the training loop (it runs under a transfer guard).
        with jax.transfer_guard_host_to_device("allow"):
            for k, v in local.items():
                v = np.asarray(v)
                v = v.reshape(a, v.shape[0] // a, *v.shape[1:]) if a > 1 else v
                if self.global_rows:  # each device takes its slice of the same global rows
                    out[k] = jax.make_array_from_callback(v.shape, layout, lambda index, v=v: v[index])
                else:
                    out[k] = jax.make_array_from_process_local_data(layout, v)
        return out

    def controls_at(self, tokens_seen: int, max_loss: float = float("inf")):
        """The token-scheduled scalars for a step starting after `tokens_seen` tokens."""
        with jax.transfer_guard_host_to_device("allow"):
            return controls(mtp_weight_at(self.loss_cfg, tokens_seen), rate_at(self.balance_cfg, tokens_seen),
                            max_loss)


@functools.lru_cache(maxsize=8)
def _steps(cfg: ModelConfig, mesh, tx, step_cfg: StepConfig, lr_schedule):
    graphdef = abstract_model(cfg, mesh)[0]  # the parameters are the same for every RoPE theta
    return (make_train_step(graphdef, tx, cfg, step_cfg, lr_schedule=lr_schedule),
            make_eval_step(graphdef, cfg, step_cfg.loss))


def _check_batches(curriculum: Curriculum, accum: int, batch_shards: int) -> None:
    for p in curriculum.phases:
        unit = p.rows_unit
        if unit % accum or (unit // accum) % batch_shards:
            raise ValueError(
                f"data.phases.{p.name}: batches of {unit} rows (global_batch, or the ramp's increment) must split "
                f"into train.accum_steps={accum} micro-batches of a multiple of {batch_shards} rows (the mesh's "
                f"data x expert devices). Change the phase's global_batch / batch_ramp, accum_steps or the mesh.")


def build(config: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None) -> Run:
    """Config -> curriculum -> mesh -> model -> optimizer -> train state (nothing compiled)."""
    tcfg = config.train
    model_cfg = model_config_from_dict(config.model)
    loss_cfg, balance_cfg = LossConfig(**config.loss), BalanceConfig(**config.balance)
    curriculum = curriculum_lib.from_config(config.data.phases, config.data.phase_order)
    total = curriculum_lib.num_steps(curriculum)
    total = min(total, tcfg.steps) if tcfg.steps > 0 else total
    optim = dict(config.optim)
    if optim["decay_steps"] <= 0:  # the schedule spans the run
        optim["decay_steps"] = total
    optim_cfg = OptimConfig(**optim)

    accum = int(tcfg.accum_steps)
    if accum < 1:
        raise ValueError(f"train.accum_steps={accum}: must be >= 1")
    sizes = sharding.mesh_shape(dict(config.mesh), len(devices) if devices is not None else jax.device_count())
    _check_batches(curriculum, accum, sizes["data"] * sizes["expert"])
    first = curriculum.phases[0]
    mesh = sharding.make_mesh(dict(config.mesh), devices, cfg=model_cfg, global_batch=first.rows_unit // accum)
    _, params, buffers = init_model(model_cfg, mesh, tcfg.seed)
    tx, lr_schedule = build_optimizer(optim_cfg, params)
    with sharding.use_mesh(mesh):
        state = init_state(params, buffers, tx)
    d = config.data
    split = d.get("process_split", "documents")
    if split not in ("documents", "rows"):
        raise ValueError(f"data.process_split={split!r}: expected 'documents' or 'rows'")
    rows = {"process_index": 0, "process_count": 1} if split == "rows" else {}
    loader_cfg = LoaderConfig(root=d.root, seed=d.seed, num_workers=d.num_workers, read_threads=d.read_threads,
                              **rows)
    return Run(model_cfg=model_cfg, loss_cfg=loss_cfg, balance_cfg=balance_cfg,
               step_cfg=StepConfig(loss=loss_cfg, balance_mtp=balance_cfg.include_mtp, accum_steps=accum),
               curriculum=curriculum, loader_cfg=loader_cfg, mesh=mesh, state=state, tx=tx,
               lr_schedule=lr_schedule, total_steps=total, global_rows=split == "rows")

"""Minimal final-weights checkpoint: params + buffers + model config, enough to score a run.

    save_params(run_dir / "checkpoints", step, params, buffers, model_cfg)
    cfg, graphdef, params, buffers = load_params(run_dir, mesh)

Layout of one checkpoint, `<dir>/<step>/`:
    state/              Orbax StandardCheckpointer: {"params": ..., "buffers": ...} as pure dicts
    model_config.json   dataclasses.asdict(ModelConfig); written last, so its presence marks a
                        complete checkpoint

Weights are stored as plain nested dicts (`nnx.to_pure_dict`), not NNX Variables, so the
on-disk format does not depend on Flax internals. This is not the training checkpoint: the
resumable Orbax CheckpointManager (optimizer state, data iterator, async, preemption) arrives in
a later issue.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

from glm46_jax.config import RUNTIME_FIELDS, ModelConfig, model_config_from_dict
from glm46_jax.model import abstract_model

MODEL_CONFIG = "model_config.json"
STATE = "state"
# How the model runs may change at load time; what it is (param_dtype included) comes from the weights.
_OVERRIDABLE = tuple(f for f in RUNTIME_FIELDS if f != "param_dtype")


@contextlib.contextmanager
def _quiet_orbax():
    # Orbax logs a few dozen INFO lines per save/restore through absl; keep the console readable.
    level = logging.get_verbosity()  # absl: larger = more verbose
    logging.set_verbosity(min(level, logging.WARNING))
    try:
        yield
    finally:
        logging.set_verbosity(level)


def save_params(directory: str | os.PathLike, step: int, params: nnx.State, buffers: nnx.State,
                model_cfg: ModelConfig) -> str:
    """Write `<directory>/<step>/`; every process must call it (Orbax saves collectively)."""
    step_dir = os.path.join(os.path.abspath(os.fspath(directory)), str(int(step)))
    tree = {"params": nnx.to_pure_dict(params), "buffers": nnx.to_pure_dict(buffers)}
    with _quiet_orbax(), ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(step_dir, STATE), tree)
        checkpointer.wait_until_finished()
    if jax.process_index() == 0:
        with open(os.path.join(step_dir, MODEL_CONFIG), "w") as f:
            json.dump(dataclasses.asdict(model_cfg), f, indent=2)
    return step_dir


def latest_checkpoint(path: str | os.PathLike) -> str:
    """A step directory from a step dir, a `checkpoints/` dir, or a run dir (the highest step wins)."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, MODEL_CONFIG)):
        return path
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    steps = [int(d) for d in os.listdir(path) if d.isdigit() and os.path.isfile(os.path.join(path, d, MODEL_CONFIG))] \
        if os.path.isdir(path) else []
    if not steps:
        raise FileNotFoundError(f"{path}: no complete checkpoint (a <step>/{MODEL_CONFIG} directory) found")
    return os.path.join(path, str(max(steps)))


def load_params(path: str | os.PathLike, mesh: jax.sharding.Mesh, **runtime: Any
                ) -> tuple[ModelConfig, nnx.GraphDef, nnx.State, nnx.State]:
    """Restore (cfg, graphdef, params, buffers), every array placed directly in its `mesh` sharding.

    The mesh may differ from the one the checkpoint was saved on: the restore target's shardings
    come from the model's logical axes on *this* mesh. `runtime` overrides non-architecture
    fields of the saved config (dtype, attention_impl, remat, ...); weights keep `param_dtype`.
    """
    step_dir = os.path.abspath(latest_checkpoint(path))
    with open(os.path.join(step_dir, MODEL_CONFIG)) as f:
        cfg = model_config_from_dict(json.load(f))
    unknown = sorted(set(runtime) - set(_OVERRIDABLE))
    if unknown:
        raise ValueError(f"load_params: {unknown} are not runtime fields {_OVERRIDABLE}; the architecture "
                         "comes from the checkpoint")
    cfg = cfg.replace(**runtime)
    graphdef, abstract_params, abstract_buffers = abstract_model(cfg, mesh)
    target = {"params": nnx.to_pure_dict(abstract_params), "buffers": nnx.to_pure_dict(abstract_buffers)}
    with _quiet_orbax(), ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(os.path.join(step_dir, STATE), target)
    nnx.replace_by_pure_dict(abstract_params, restored["params"])
    nnx.replace_by_pure_dict(abstract_buffers, restored["buffers"])
    return cfg, graphdef, abstract_params, abstract_buffers

"""Checkpoints: Orbax `CheckpointManager`, one composite checkpoint per step, async, resumable.

    ckpt = Checkpointer(run_dir, every=100, keep=3)
    ckpt.save(step, state, data_state, meta)               # async; returns at once
    restored = ckpt.restore_latest(target_state)           # None when there is nothing to resume
    cfg, graphdef, params, buffers = load_params(run_dir_or_step_dir, mesh)   # weights only

Layout, `<run>/checkpoints/<step>/` (Orbax writes it under a temporary name and renames it when
complete, so a half-written step never looks like a step):
    model/       params + buffers (the routers' correction biases) as pure nested dicts
    optimizer/   {"step", "opt_state"}: the optax state mirrors the params (nnx.State leaves)
    data/        JSON: every process's data-iterator state (the curriculum's, see data.curriculum)
    meta/        JSON: model config, resolved run config, tokens seen, tokenizer reference
    others/      only with several trained models (`TrainState.others`): {name: {params, buffers, opt_state}},
                 their architectures in meta's "model_configs"
`save_params` (final weights, `convert hf-to-ckpt`) writes only model/ and meta/.

Random state: the train step draws no random numbers (GLM trains without dropout and routes
deterministically), and the weights' init key is only used at step 0. The one random stream of a run is
the data order, a seeded Grain pipeline: its position is data/ and its seeds are in meta/'s config, so
the checkpoint holds all the randomness a resumed run needs (bit-identical resume is tested).

Nothing on any load path unpickles: Orbax arrays (OCDBT/zarr) and JSON only.
"""

from __future__ import annotations

import dataclasses
import json
import logging as std_logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import flags, logging
from flax import nnx
from jax.experimental import multihost_utils

from glm46_jax.errors import InputError
from glm46_jax.config import RUNTIME_FIELDS, ModelConfig, model_config_from_dict
from glm46_jax.model import abstract_model, pipeline

CHECKPOINTS = "checkpoints"
ITEMS = ("model", "optimizer", "data", "meta", "others")
# How the model runs may change at load time; what it is (param_dtype included) comes from the weights.
_OVERRIDABLE = tuple(f for f in RUNTIME_FIELDS if f != "param_dtype")


class _OrbaxInfoFilter(std_logging.Filter):
    # Orbax logs a few dozen INFO lines per save through absl, many from its background save threads,
    # so a verbosity switch around our calls cannot catch them. Its warnings and errors still pass.
    def filter(self, record: std_logging.LogRecord) -> bool:
        return record.levelno >= std_logging.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname


def _setup_orbax() -> None:
    absl_logger = logging.get_absl_logger()
    if not any(isinstance(f, _OrbaxInfoFilter) for f in absl_logger.filters):
        absl_logger.addFilter(_OrbaxInfoFilter())
    # Replicated arrays are written whole by their first replica: Orbax's replica-parallel default (off GPU) compiles a
    # slice per leaf shape and device (docs/performance.md#checkpoint-saves-on-a-multi-device-cpu-mesh).
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if getattr(handler, "_use_replica_parallel", False):  # Orbax's own field: only its constructor sets it
        ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
            use_replica_parallel=False, array_metadata_store=handler._array_metadata_store), override=True)


def _model_tree(params: nnx.State, buffers: nnx.State) -> dict[str, Any]:
    # Pure dicts, not NNX Variables: the weights' on-disk format does not depend on Flax internals.
    return {"params": nnx.to_pure_dict(params), "buffers": nnx.to_pure_dict(buffers)}


def _others_tree(others: dict[str, Any], meta: dict[str, Any], target: bool = False) -> dict[str, Any]:
    """The further trained models' weights and optimizer states as pure trees, each MoE stack in layer order."""
    out = {}
    for name, m in others.items():
        cfg = model_config_from_dict(meta["model_configs"][name])
        trees = (m.params, m.buffers, m.opt_state)
        params, buffers, opt_state = (pipeline.layer_order_target if target else pipeline.in_layer_order)(trees, cfg)
        out[name] = {**_model_tree(params, buffers), "opt_state": opt_state}
    return out


def _others_from_tree(restored: dict[str, Any], target: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, m in target.items():
        cfg = model_config_from_dict(meta["model_configs"][name])
        in_order = pipeline.layer_order_target((m.params, m.buffers, m.opt_state), cfg)
        params, buffers = jax.tree.map(lambda x: x, in_order[:2])  # copies of the structure
        nnx.replace_by_pure_dict(params, restored[name]["params"])
        nnx.replace_by_pure_dict(buffers, restored[name]["buffers"])
        placed = pipeline.in_slot_order((params, buffers, restored[name]["opt_state"]), cfg,
                                        like=(m.params, m.buffers, m.opt_state))
        out[name] = m.replace(params=placed[0], buffers=placed[1], opt_state=placed[2])
    return out


def _all_processes_json(obj: Any) -> list[Any]:
    """Every process's `obj` (JSON-able), gathered: each holds a different data-iterator state."""
    if jax.process_count() == 1:
        return [obj]
    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    size = int(np.max(multihost_utils.process_allgather(np.int32(raw.size))))
    padded = np.zeros(size, np.uint8)
    padded[:raw.size] = raw
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(r).rstrip(b"\0").decode()) for r in rows]


def _manager(directory: str, every: int = 1, keep: int | None = None, *, async_save: bool = True,
             best_metric: str | None = None, best_mode: str = "min") -> ocp.CheckpointManager:
    _setup_orbax()
    # The last `keep` steps, and with `best_metric` also the best one by it (`best_mode`). Spelled out as
    # a preservation policy: Orbax's `best_fn` option alone would keep *only* the best `keep` and could delete
    # the newest step (e.g. a preemption save). Orbax deletes an old step only after the new one is committed.
    policies = [ocp.checkpoint_managers.LatestN(n=keep)]
    if best_metric:
        policies.append(ocp.checkpoint_managers.BestN(
            get_metric_fn=lambda m: m[best_metric], reverse=best_mode == "min", n=1,
            keep_checkpoints_without_metrics=False))
    # Every `every` steps, or when a preemption notice reached any process; spelled out because the
    # default policy also saves the first step it is asked about (Orbax's InitialSavePolicy).
    decision = ocp.checkpoint_managers.AnySavePolicy([
        ocp.checkpoint_managers.FixedIntervalPolicy(max(int(every), 1)),
        ocp.checkpoint_managers.PreemptionCheckpointingPolicy()])
    if jax.process_count() > 1:
        # Orbax's barriers (here and at every save) then wait on the coordination service for minutes instead of
        # being a device all-gather, whose Gloo communicator waits 30 s: one process can trail another by more
        # than that after a compile (see `distributed.barrier`). Orbax reads the flag only once absl has parsed.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS(["glm46_jax"], known_only=True)
        flags.FLAGS.experimental_orbax_use_distributed_barrier = True
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=decision, enable_async_checkpointing=async_save, create=True,
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies))
    return ocp.CheckpointManager(directory, item_names=ITEMS, options=options)


class IncompatibleCheckpoint(ValueError):
    """A checkpoint that reads fine but cannot continue this run (e.g. another process count)."""


class Checkpointer:
    """The run's training checkpoints (`<run_dir>/checkpoints`); every process must make the same calls."""

    def __init__(self, run_dir: str, *, every: int, keep: int | None = 3, async_save: bool = True,
                 best_metric: str | None = None, best_mode: str = "min"):
        self.directory = os.path.join(os.path.abspath(run_dir), CHECKPOINTS)
        self.best_metric, self.best_mode = best_metric, best_mode
        self._mngr = _manager(self.directory, every, keep, async_save=async_save, best_metric=best_metric,
                              best_mode=best_mode)

    def should_save(self, step: int) -> bool:
        """A regular save is due after `step` (Orbax's interval policy, or a preemption notice)."""
        return self._mngr.should_save(step)

    def preemption_step(self, step: int) -> bool:
        """With several processes: a preemption notice reached one of them and all agreed to save
        and stop after `step` (JAX's preemption sync point, via Orbax; False with one process)."""
        return self._mngr.reached_preemption(step)

    def save(self, step: int, state, data_state: Any, meta: dict[str, Any],
             metrics: dict[str, float] | None = None) -> None:
        """Start writing `step` (async: returns once the arrays are copied off the devices).

        Always saves: callers ask `should_save` first, and save regardless at the end and on preemption.
        """
        # On disk the MoE stack is always in layer order: any mesh restores it (docs/pipeline.md#checkpoints).
        cfg = model_config_from_dict(meta["model_config"]) if "model_config" in meta else None
        params, buffers, opt_state = ((state.params, state.buffers, state.opt_state) if cfg is None else
                                      pipeline.in_layer_order((state.params, state.buffers, state.opt_state), cfg))
        items = dict(
            model=ocp.args.StandardSave(_model_tree(params, buffers)),
            optimizer=ocp.args.StandardSave({"step": state.step, "opt_state": opt_state}),
            data=ocp.args.JsonSave({"processes": _all_processes_json(data_state)}),
            meta=ocp.args.JsonSave({**meta, "metrics": metrics} if metrics else meta))
        if state.others:
            items["others"] = ocp.args.StandardSave(_others_tree(state.others, meta))
        self._mngr.save(step, args=ocp.args.Composite(**items), metrics=metrics, force=True)

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def best_step(self) -> int | None:
        """The kept step with the best `best_metric` (the earliest of equals); None without one that has it."""
        self.wait()  # the step's metrics are in its meta (Orbax keeps them in memory only)
        metrics = {s: read_meta(os.path.join(self.directory, str(s))).get("metrics") or {} for s in self.steps()}
        ranked = [(m[self.best_metric], s) for s, m in metrics.items() if self.best_metric in m]
        if not ranked:
            return None
        sign = 1.0 if self.best_mode == "min" else -1.0
        return min(ranked, key=lambda vs: (sign * vs[0], vs[1]))[1]

    def restore(self, step: int, target, global_rows: bool = False) -> tuple[Any, Any, dict[str, Any]]:
        """(state, this process's data state, meta) of `step`, laid out like `target` (see `restore_latest`)."""
        self.wait()
        return self._restore(step, target, global_rows)

    def restore_latest(self, target, global_rows: bool = False) -> tuple[int, Any, Any, dict[str, Any]] | None:
        """(step, state, this process's data state, meta) of the newest checkpoint that restores.

        `target` is a TrainState laid out on the *current* mesh (e.g. a freshly initialised one):
        its shardings are the restore target, so a checkpoint saved on another mesh lands directly
        in this one's layout. A damaged newest step (missing or truncated file) is skipped with a
        warning naming it, and the one before is tried. `global_rows`: every process read the same
        data (`data.process_split="rows"`), so the data state restores on any number of processes.
        """
        # A save cut off mid-write is never listed as a step, so say so here.
        for name in sorted(ocp.path.step.tmp_checkpoints(self.directory)):
            logging.warning("checkpoint %s was never committed (a save cut off mid-write); ignoring it",
                            os.path.join(self.directory, name))
        failures = []
        for step in reversed(self.steps()):
            try:
                return (step, *self._restore(step, target, global_rows))
            except IncompatibleCheckpoint:
                raise  # readable, but not by this run: no older step would be either
            except Exception as e:  # noqa: BLE001 - any failure to read a step means: try the previous one
                where = os.path.join(self.directory, str(step))
                failures.append(f"{where}: {type(e).__name__}: {str(e)[:300]}")
                logging.warning("checkpoint %s is damaged or incomplete (%s: %s); trying the previous one",
                                where, type(e).__name__, str(e)[:300])
        if failures:  # starting over would later collide with (and could replace) the steps on disk
            raise RuntimeError(f"no checkpoint in {self.directory} restores, so the run cannot resume:\n  "
                               + "\n  ".join(failures) + "\nMove the damaged steps aside (or use a new run_dir) "
                               "to start over; nothing was deleted.")
        return None

    def _restore(self, step: int, target, global_rows: bool):
        abstract = lambda tree: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
        meta = read_meta(os.path.join(self.directory, str(step)))
        cfg = model_config_from_dict(meta["model_config"])
        in_order = pipeline.layer_order_target((target.params, target.buffers, target.opt_state), cfg)
        model_target = abstract(_model_tree(*in_order[:2]))
        opt_target = abstract({"step": target.step, "opt_state": in_order[2]})
        items = dict(model=ocp.args.StandardRestore(model_target), optimizer=ocp.args.StandardRestore(opt_target),
                     data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore())
        if target.others:
            items["others"] = ocp.args.StandardRestore(abstract(_others_tree(target.others, meta, target=True)))
        r = self._mngr.restore(step, args=ocp.args.Composite(**items))
        processes = r["data"]["processes"]
        if global_rows:
            processes = processes[:1] * jax.process_count()
        elif len(processes) != jax.process_count():
            raise IncompatibleCheckpoint(
                f"{self.directory}/{step} was saved by {len(processes)} processes, restoring with "
                f"{jax.process_count()}: their data iterators cannot be split differently. Resume with the same "
                "number of processes, or start a new run from these weights with checkpoint.init_from")
        params, buffers = jax.tree.map(lambda x: x, in_order[:2])  # copies of the structure
        nnx.replace_by_pure_dict(params, r["model"]["params"])
        nnx.replace_by_pure_dict(buffers, r["model"]["buffers"])
        params, buffers, opt_state = pipeline.in_slot_order((params, buffers, r["optimizer"]["opt_state"]), cfg,
                                                            like=(target.params, target.buffers, target.opt_state))
        state = target.replace(step=r["optimizer"]["step"], params=params, buffers=buffers, opt_state=opt_state)
        if target.others:
            state = state.replace(others=_others_from_tree(r["others"], target.others, meta))
        # in the memory the target's leaves live in: a host-offloaded optimizer state (training/offload.py)
        state = jax.tree.map(lambda x, t: x if x.sharding.memory_kind == t.sharding.memory_kind
                             else jax.device_put(x, t.sharding), state, target)
        return state, processes[jax.process_index()], dict(r["meta"])

    def close(self) -> None:
        self.wait()
        self._mngr.close()


def resume(ckpt: Checkpointer, state, *, resume: str, global_rows: bool = False) -> tuple[int, Any, Any | None]:
    """(first step to run, state, data-iterator state to continue from or None) for a starting run.

    resume="auto": the newest complete checkpoint in `ckpt`, if any; else a fresh start from `state` as built
    (its starting weights are `models.build`'s). resume="never" refuses a run dir that already holds checkpoints:
    starting over would overwrite them.
    """
    if resume == "auto":
        restored = ckpt.restore_latest(state, global_rows=global_rows)
        if restored is not None:
            step, state, data_state, _ = restored
            logging.info("resumed from %s (step %d)", ckpt.directory, step)
            return step + 1, state, data_state
    elif ckpt.steps():
        raise InputError(f"{ckpt.directory} already holds checkpoints {ckpt.steps()} and checkpoint.resume=never: "
                         "use a new --config.run_dir, or --config.checkpoint.resume=auto to continue that run")
    return 1, state, None


def check_same_model(saved: ModelConfig, configured: ModelConfig, what: str) -> None:
    """`saved` (a checkpoint's model) must have `configured`'s architecture; runtime fields and RoPE theta may
    differ. `what` names the checkpoint in the error."""
    differ = {f.name for f in dataclasses.fields(saved) if f.name not in RUNTIME_FIELDS + ("rope_theta",)
              and getattr(saved, f.name) != getattr(configured, f.name)}
    if differ:
        raise InputError(f"{what}: its model differs from config.model in {sorted(differ)}; set those "
                         "config.model fields to the checkpoint's values")


# --- weights only: final params, scoring, export --------------------------------------------

def save_params(directory: str | os.PathLike, step: int, params: nnx.State, buffers: nnx.State,
                model_cfg: ModelConfig, meta: dict[str, Any] | None = None) -> str:
    """Write `<directory>/<step>/{model,meta}` synchronously; every process must call it."""
    directory = os.path.abspath(os.fspath(directory))
    mngr = _manager(directory, async_save=False)
    params, buffers = pipeline.in_layer_order((params, buffers), model_cfg)
    args = {"model": ocp.args.StandardSave(_model_tree(params, buffers)),
            "meta": ocp.args.JsonSave({**(meta or {}), "model_config": dataclasses.asdict(model_cfg)})}
    mngr.save(int(step), args=ocp.args.Composite(**args), force=True)
    mngr.wait_until_finished()
    mngr.close()
    return os.path.join(directory, str(int(step)))


def saved_steps(run_dir: str) -> list[int]:
    """The committed training checkpoints of a run dir (no manager is created, nothing is written)."""
    directory = os.path.join(os.path.abspath(run_dir), CHECKPOINTS)
    return sorted(ocp.utils.checkpoint_steps(directory)) if os.path.isdir(directory) else []


def latest_checkpoint(path: str | os.PathLike) -> str:
    """A step directory from a step dir, a `checkpoints/` dir, or a run dir (the highest step wins)."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(os.path.join(path, "meta", "metadata")):
        return path
    if os.path.isdir(os.path.join(path, CHECKPOINTS)):
        path = os.path.join(path, CHECKPOINTS)
    # Orbax lists committed steps only (a save cut off mid-write keeps its temporary name).
    steps = ocp.utils.checkpoint_steps(path) if os.path.isdir(path) else []
    steps = [s for s in steps if os.path.isfile(os.path.join(path, str(s), "meta", "metadata"))]
    if not steps:
        raise FileNotFoundError(f"{path}: not a checkpoint: no complete <step>/ directory (with meta/ and model/) "
                                "found. Pass a run dir, its checkpoints/ dir or one step dir.")
    return os.path.join(path, str(max(steps)))


def read_meta(step_dir: str) -> dict[str, Any]:
    with open(os.path.join(step_dir, "meta", "metadata")) as f:
        return json.load(f)


def tokenizer_path(step_dir: str) -> str | None:
    """The run's tokenizer.json: next to the weights, in the run dir, or where the corpus had it."""
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(step_dir)))
    candidates = [os.path.join(step_dir, "tokenizer.json"), os.path.join(run_dir, "tokenizer.json"),
                  (read_meta(step_dir).get("tokenizer") or {}).get("path") or ""]
    return next((p for p in candidates if p and os.path.isfile(p)), None)


def load_params(path: str | os.PathLike, mesh: jax.sharding.Mesh, **runtime: Any
                ) -> tuple[ModelConfig, nnx.GraphDef, nnx.State, nnx.State]:
    """Restore (cfg, graphdef, params, buffers), every array placed directly in its `mesh` sharding.

    The mesh may differ from the one the checkpoint was saved on: the restore target's shardings
    come from the model's logical axes on *this* mesh. `runtime` overrides non-architecture
    fields of the saved config (dtype, attention_impl, remat, ...); weights keep `param_dtype`.
    """
    step_dir = latest_checkpoint(path)
    cfg = model_config_from_dict(read_meta(step_dir)["model_config"])
    unknown = sorted(set(runtime) - set(_OVERRIDABLE))
    if unknown:
        raise ValueError(f"load_params: {unknown} are not runtime fields {_OVERRIDABLE}; the architecture "
                         "comes from the checkpoint")
    cfg = cfg.replace(**runtime)
    graphdef, abstract_params, abstract_buffers = abstract_model(cfg, mesh)
    params, buffers = restore_model(step_dir, abstract_params, abstract_buffers)
    return cfg, graphdef, params, buffers


def restore_model(step_dir: str, params: nnx.State, buffers: nnx.State) -> tuple[nnx.State, nnx.State]:
    """A step's saved weights, into the structure, shapes and shardings of `params` / `buffers` (arrays or
    ShapeDtypeStructs): e.g. a LoRA run's adapters, whose train state holds only them."""
    cfg = model_config_from_dict(read_meta(step_dir)["model_config"])
    wanted = (params, buffers)
    in_order = pipeline.layer_order_target(jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=x.sharding), wanted), cfg)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          _model_tree(*in_order))
    _setup_orbax()
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(os.path.join(step_dir, "model"), target)
    params, buffers = jax.tree.map(lambda x: x, in_order)  # new containers, the caller's left as they are
    nnx.replace_by_pure_dict(params, restored["params"])
    nnx.replace_by_pure_dict(buffers, restored["buffers"])
    return pipeline.in_slot_order((params, buffers), cfg, like=wanted)

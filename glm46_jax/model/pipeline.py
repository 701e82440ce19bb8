"""Pipeline parallelism over the MoE layer stack: GPipe and the circular (repeats) schedule (docs/pipeline.md).

The MoE stack is stored in *slot order* on a mesh with `pipeline` > 1: stage s holds slots
[s R c, (s + 1) R c) (c = layers per chunk, R = repeats), slot s R c + r c + j being layer (r S + s) c + j,
and slots past the model's last layer are identity padding. `to_slots` / `to_layers` convert between that
and the ordinary [layers] stack (checkpoints, HF export), which it is a permuted, padded view of.

`run` is one `jax.shard_map` manual over `pipeline` only: the other mesh axes stay Explicit inside it, so a
stage shards over data / tensor / expert as the whole model does, and the MoE's own shard_map nests inside.
Micro-batches stream through a `lax.scan` over R M + S - 1 iterations; each iteration every stage runs
one chunk of c layers and hands its output to the next stage with `ppermute` (the last stage's goes round
to stage 0, which keeps it until that micro-batch's next repeat). The backward pass is autodiff of that scan.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from glm46_jax.config import ModelConfig
from glm46_jax.model.attention import SequenceMask
from glm46_jax.parallel.sharding import pipeline_microbatches, spec_axes

STACK = "moe_layers"  # the pipelined stack's name in the parameter tree
SLOT_AXIS = "stage_layers"  # the logical name of its leading (slot) dimension on a pipeline mesh


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each of `layers` MoE layers sits among the S R c pipeline slots."""
    layers: int
    stages: int
    repeats: int = 1

    @property
    def per_chunk(self) -> int:  # c: layers a stage runs per visit of a micro-batch
        return -(-self.layers // (self.stages * self.repeats))

    @property
    def slots(self) -> int:
        return self.stages * self.repeats * self.per_chunk

    def layer_of_slot(self) -> np.ndarray:
        """[slots] the layer each slot holds; >= layers means identity padding."""
        s, r, j = np.meshgrid(np.arange(self.stages), np.arange(self.repeats), np.arange(self.per_chunk),
                              indexing="ij")
        return ((r * self.stages + s) * self.per_chunk + j).reshape(-1)

    def slot_of_layer(self) -> np.ndarray:
        """[layers] the slot holding each layer."""
        return np.argsort(self.layer_of_slot())[:self.layers]

    def bubble(self, microbatches: int) -> float:
        """Idle fraction of the schedule: (S - 1) / (R M + S - 1)."""
        return (self.stages - 1) / (self.repeats * microbatches + self.stages - 1)


def layout(cfg: ModelConfig, stages: int) -> Layout:
    return Layout(cfg.num_moe_layers, stages, cfg.pipeline_repeats)


def mesh_stages() -> int:
    """The `pipeline` size of the mesh in context (1 without one)."""
    return dict(jax.sharding.get_abstract_mesh().shape).get("pipeline", 1)


# --- the stored layout ----------------------------------------------------------------------------------

def _in_stack(path) -> bool:
    return any(getattr(k, "key", getattr(k, "name", None)) == STACK for k in path)


def _without_pipeline(spec: jax.P) -> jax.P:
    def drop(entry):
        if entry is None:
            return None
        kept = tuple(a for a in spec_axes(entry) if a != "pipeline")
        return None if not kept else kept[0] if len(kept) == 1 else kept
    return jax.P(*(drop(e) for e in spec))


def _convert(tree, lay: Layout, to_slots: bool):
    index = lay.layer_of_slot() if to_slots else lay.slot_of_layer()
    real = index < lay.layers if to_slots else np.ones(index.shape, bool)

    def leaf(path, x):
        if not _in_stack(path) or not hasattr(x, "shape"):
            return x
        spec = jax.typeof(x).sharding.spec
        rest = tuple(spec[1:]) + (None,) * (x.ndim - 1 - len(spec[1:]))
        x = jax.sharding.reshard(x, _without_pipeline(jax.P(None, *rest)))
        y = jnp.take(x, jnp.asarray(np.minimum(index, x.shape[0] - 1)), axis=0)
        if not real.all():  # padding slots hold zeros: never used, no gradient
            y = jnp.where(jnp.asarray(real).reshape(-1, *([1] * (x.ndim - 1))), y, jnp.zeros((), y.dtype))
        return jax.sharding.reshard(y, jax.P("pipeline" if to_slots else None, *_without_pipeline(jax.P(*rest))))

    return jax.tree_util.tree_map_with_path(leaf, tree)


def to_slots(tree, lay: Layout):
    """Every array under the MoE stack in `tree` (params, LoRA adapters, buffers, optimizer moments) from
    [layers, ...] to the pipeline's [slots, ...], slot dimension on `pipeline`. Call under jit inside the mesh."""
    return _convert(tree, lay, True)


def to_layers(tree, lay: Layout):
    """The inverse of `to_slots`: [slots, ...] back to the ordinary [layers, ...] stack (padding dropped)."""
    return _convert(tree, lay, False)


def with_stage_axis(tree):
    """Abstract arrays whose MoE stack's leading (slot) dimension is on `pipeline`, as its "stage_layers" name
    says: `nnx.vmap` records the stacked axis' name but leaves that axis unsharded in the abstract array."""
    def leaf(path, x):
        mesh = x.sharding.mesh
        if not _in_stack(path) or dict(mesh.shape).get("pipeline", 1) == 1:
            return x
        spec = jax.P("pipeline", *tuple(x.sharding.spec)[1:])
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.NamedSharding(mesh, spec))
    return jax.tree_util.tree_map_with_path(leaf, tree)


# --- what init, the train step and checkpoints see: layer order in, the stored order out, and back ----------------

def in_layer_order(tree, cfg: ModelConfig):
    """`tree` (arrays, or traced under jit on the mesh) with its MoE stack in layer order:
    what checkpoints store, the HF export writes and per-layer metrics read. Unchanged where it already is."""
    lay = _stored_layout(tree, cfg)
    if lay is None:
        return tree
    if _traced(tree):
        return to_layers(tree, lay)
    with jax.set_mesh(_mesh_of(tree)):
        return _jitted_to_layers(lay)(tree)


def in_slot_order(tree, cfg: ModelConfig, like=None):
    """The inverse of `in_layer_order`: `tree` (layer order) in the stored order and shardings of `like` (arrays or
    ShapeDtypeStructs, e.g. a restore target), or without `like`, traced under jit, of the mesh in context. A bare
    array is a stack itself (per-layer statistics, [layers, ...]); identity slots get zeros."""
    if hasattr(tree, "shape"):
        return in_slot_order({STACK: tree}, cfg, like)[STACK]
    if like is None:
        stages = mesh_stages()
        return tree if stages == 1 else to_slots(tree, layout(cfg, stages))
    lay = _stored_layout(like, cfg)
    if lay is None:
        return tree
    shardings = jax.tree.map(lambda x: x.sharding, like)
    with jax.set_mesh(_mesh_of(like)):
        return jax.jit(lambda t: to_slots(t, lay), out_shardings=shardings)(tree)


def layer_order_target(tree, cfg: ModelConfig):
    """Abstract arrays (ShapeDtypeStructs) of `tree` in layer order: what to read a checkpoint into before
    `in_slot_order(restored, cfg, like=tree)` moves it into `tree`'s layout."""
    lay = _stored_layout(tree, cfg)
    if lay is None:
        return tree

    def leaf(path, x):
        if not _in_stack(path):
            return x
        spec = _without_pipeline(jax.P(None, *tuple(x.sharding.spec)[1:]))
        return jax.ShapeDtypeStruct((lay.layers, *x.shape[1:]), x.dtype, sharding=jax.NamedSharding(x.sharding.mesh,
                                                                                                     spec))
    return jax.tree_util.tree_map_with_path(leaf, tree)


def _traced(tree) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


def _stored_layout(tree, cfg: ModelConfig) -> Layout | None:
    """The slot layout `tree`'s MoE stack is in (its mesh has `pipeline` > 1; traced: the mesh in context), or None
    (layer order)."""
    if _traced(tree):
        stages = mesh_stages()
        return layout(cfg, stages) if stages > 1 else None
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        sharding = getattr(x, "sharding", None)
        if _in_stack(path) and isinstance(sharding, jax.NamedSharding):
            stages = dict(sharding.mesh.shape).get("pipeline", 1)
            return layout(cfg, stages) if stages > 1 else None
    return None


@functools.lru_cache(maxsize=8)
def _jitted_to_layers(lay: Layout):  # one compiled conversion per layout: every checkpoint save runs it
    return jax.jit(functools.partial(to_layers, lay=lay))


def _mesh_of(tree) -> jax.sharding.Mesh:
    return next(x.sharding.mesh for x in jax.tree.leaves(tree) if isinstance(getattr(x, "sharding", None),
                                                                         jax.NamedSharding))


# --- the schedule ---------------------------------------------------------------------------------------

def _batch_shards(a: Array) -> int:
    spec = jax.typeof(a).sharding.spec
    entry = spec[0] if len(spec) else None
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape[x] for x in spec_axes(entry))


def _split(a: Array, m: int, axis: int = 0) -> Array:
    """[.., b, ..] -> [m, .., b / m, ..]: micro-batch i is block i of every batch shard's rows (no data moves)."""
    a = jnp.moveaxis(a, axis, 0)
    rows_spec, rest = _row_spec(a)
    shards, b = _batch_shards(a), a.shape[0]
    a = jnp.reshape(a, (shards, m, b // (shards * m), *a.shape[1:]), out_sharding=jax.P(rows_spec, None, None, *rest))
    a = jnp.reshape(jnp.swapaxes(a, 0, 1), (m, b // m, *a.shape[3:]), out_sharding=jax.P(None, rows_spec, *rest))
    return jnp.moveaxis(a, 1, axis + 1)


def _merge(a: Array, axis: int = 0) -> Array:
    """The inverse of `_split`: [m, .., b / m, ..] (micro-batch axis first) -> [.., b, ..]."""
    a = jnp.moveaxis(a, axis + 1, 1)
    rows_spec, rest = _row_spec(a[0])
    m, rows = a.shape[:2]
    shards = _batch_shards(a[0])
    a = jnp.reshape(a, (m, shards, rows // shards, *a.shape[2:]), out_sharding=jax.P(None, rows_spec, None, *rest))
    a = jnp.reshape(jnp.swapaxes(a, 0, 1), (m * rows, *a.shape[3:]), out_sharding=jax.P(rows_spec, *rest))
    return jnp.moveaxis(a, 0, axis)


def _row_spec(a: Array):
    """(the batch axes of a's leading dimension, the specs of the others)."""
    spec = tuple(jax.typeof(a).sharding.spec) + (None,) * a.ndim
    return spec[0], spec[1:a.ndim]


def _split_mask(mask, b: int, m: int):
    if isinstance(mask, SequenceMask):
        seg = None if mask.segment_ids is None else _split(mask.segment_ids, m)
        return mask.replace(segment_ids=seg), lambda s, i: s.replace(
            segment_ids=None if s.segment_ids is None else s.segment_ids[i])
    if mask.shape[0] == b:
        return _split(mask, m), lambda s, i: s[i]
    return mask, lambda s, i: s


LayerCall = Callable[..., tuple[Array, dict[str, Array]]]  # (layer_state, x, cos, sin, mask) -> (x, aux)


def run(state, x: Float[Array, "b s d"], cos: Array, sin: Array, mask, cfg: ModelConfig, layer_call: LayerCall,
        remat_policy: Any = None, remat: bool = False) -> tuple[Float[Array, "b s d"], dict[str, Array]]:
    """The MoE stack (its state in slot order) over x through the pipeline; (x, per-layer aux in layer order).

    `layer_call` runs one decoder layer from its state; each is rematerialised with `remat_policy` when
    `remat`, as in the unpipelined stack. Outside this function the batch is also split over `pipeline`;
    inside, every stage sees the whole (data x expert)-sharded batch, micro-batch by micro-batch.
    """
    stages = mesh_stages()
    lay = layout(cfg, stages)
    m = pipeline_microbatches(cfg, stages)
    reps, chunk, last = lay.repeats, lay.per_chunk, stages - 1
    b = x.shape[0]

    def gathered(a):  # the stage's view: batch over data x expert only (an all-gather over `pipeline`)
        return jax.sharding.reshard(a, _without_pipeline(jax.typeof(a).sharding.spec))

    outside = jax.typeof(x).sharding.spec  # the batch over data x expert x pipeline, as around the trunk
    x, cos, sin, mask = jax.tree.map(gathered, (x, cos, sin, mask))

    def chunk_runner(cos, sin, mask):
        def layer(h, xs):
            layer_state, active = xs
            y, aux = layer_call(layer_state, h, cos, sin, mask)
            return jnp.where(active, y, h), aux
        # Per layer, as in the unpipelined stack: a stage iteration then keeps only its layers' inputs.
        return jax.checkpoint(layer, policy=remat_policy, prevent_cse=False) if remat else layer

    def stage_body(state, x, cos, sin, mask):
        stage = jax.lax.axis_index("pipeline")
        vary = lambda a: jax.lax.pcast(a, ("pipeline",), to="varying")
        inputs, cos_m, sin_m = (_split(a, m) for a in (x, cos, sin))
        mask_m, mask_at = _split_mask(mask, b, m)

        def chunk_of(r):
            if reps == 1:
                return state
            return jax.tree.map(lambda p: jax.lax.dynamic_slice_in_dim(p, r * chunk, chunk), state)

        def run_chunk(r, h, i):
            active = (r * stages + stage) * chunk + jnp.arange(chunk) < lay.layers
            layer = chunk_runner(cos_m[i], sin_m[i], mask_at(mask_m, i))
            return jax.lax.scan(layer, h, (chunk_of(r), active))

        shape = jax.eval_shape(lambda: run_chunk(0, vary(inputs[0]), 0))
        aux_spec = shape[1]

        def per_token(a):  # router choices / scores: [chunk, rows, seq, ...], kept per micro-batch
            return a.ndim >= 3 and a.shape[1:3] == inputs.shape[1:3]

        def zeros_like(a, lead):  # one layer's aux `a` ([chunk, ...]) with the leading axes `lead`
            spec = tuple(a.sharding.spec)[1:] + (None,) * (a.ndim - 1 - len(tuple(a.sharding.spec)[1:]))
            return vary(jnp.zeros((*lead, *a.shape[1:]), a.dtype, out_sharding=jax.P(*(None,) * len(lead), *spec)))

        acc0 = {k: zeros_like(a, (reps, chunk, m)) if per_token(a) else zeros_like(a, (reps, chunk))
                for k, a in aux_spec.items()}
        carry0 = (vary(jnp.zeros_like(inputs[0])), vary(jnp.zeros_like(inputs)), vary(jnp.zeros_like(inputs)), acc0)

        def iteration(carry, t):
            recv, loop, out, acc = carry
            # Stage 0 keeps what the last stage sent last iteration (micro-batch t - S) for its next repeat.
            back = t - stages
            keep = (back >= 0) & (back < reps * m)
            loop = jax.lax.dynamic_update_index_in_dim(
                loop, jnp.where(keep, recv, loop[back % m]), back % m, 0)
            k = t - stage
            i, r = k % m, jnp.clip(k // m, 0, reps - 1)
            valid = (k >= 0) & (k < reps * m)
            h = jnp.where(stage == 0, jnp.where(r == 0, inputs[i], loop[i]), recv)
            y, aux = run_chunk(r, h, i)
            done = valid & (stage == last) & (r == reps - 1)
            out = jax.lax.dynamic_update_index_in_dim(out, jnp.where(done, y, out[i]), i, 0)
            new_acc = {}
            for key, a in aux.items():
                if per_token(a):
                    cur = acc[key][r, :, i]
                    new_acc[key] = acc[key].at[r, :, i].set(jnp.where(valid, a, cur))
                else:
                    new_acc[key] = acc[key].at[r].add(jnp.where(valid, a, jnp.zeros_like(a)))
            ring = [(s, (s + 1) % stages) for s in range(stages)]
            return (jax.lax.ppermute(y, "pipeline", ring), loop, out, new_acc), None

        (_, _, out, acc), _ = jax.lax.scan(iteration, carry0, jnp.arange(reps * m + stages - 1))
        y = jax.lax.psum(jnp.where(stage == last, _merge(out), jnp.zeros_like(_merge(out))), "pipeline")
        aux = {}
        for key, a in acc.items():
            if per_token(aux_spec[key]):
                a = _merge(jnp.moveaxis(a, 2, 0), axis=2)  # [reps, chunk, m, rows, ...] -> [reps, chunk, b, ...]
            elif not jnp.issubdtype(a.dtype, jnp.integer):  # fractions average over micro-batches
                a = a / m
            aux[key] = a.reshape(reps * chunk, *a.shape[2:])[None]
        return y, aux

    specs = jax.tree.map(lambda _: jax.P("pipeline"), state)
    y, aux = jax.shard_map(stage_body, in_specs=(specs, jax.P(), jax.P(), jax.P(), jax.P()),
                           out_specs=(jax.P(), jax.P("pipeline")), axis_names={"pipeline"})(state, x, cos, sin, mask)
    # [stages, repeats * chunk, ...] (slot order) -> [layers, ...]
    order = jnp.asarray(lay.slot_of_layer())
    aux = {k: jnp.take(gathered(a).reshape(lay.slots, *a.shape[2:]), order, axis=0) for k, a in aux.items()}
    # Back to the outside layout (local slices): per-token statistics' batch axis and the trunk's output.
    aux = {k: jax.sharding.reshard(a, jax.P(None, outside[0])) if a.ndim >= 3 and a.shape[1] == b else a
           for k, a in aux.items()}
    return jax.sharding.reshard(y, outside), aux

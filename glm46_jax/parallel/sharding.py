"""The device mesh and the one table of logical-axis rules.

Model code names array axes logically ("embed", "heads", "exp", ...); only this module knows
which mesh axis (data, tensor, expert, pipeline, context) each logical name lands on.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

from glm46_jax.errors import InputError

# `context` is last: the fastest-varying axis, so a sequence's shards sit on neighbouring devices
# (docs/long_context.md#the-context-axis).
MESH_AXES = ("data", "tensor", "expert", "pipeline", "context")

# logical name -> mesh axis (or tuple of axes, or None = replicated).
# Parameters are FSDP-sharded over `data` through their "embed" dimension (ZeRO-3 style).
# Outside the pipelined MoE trunk the `pipeline` axis is one more data-parallel axis; inside a stage it is
# manual, and `logical` leaves it out (docs/pipeline.md#layout).
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "expert", "pipeline")),
    ("seq", "context"),
    # The MoE shard_map's flattened (batch x seq) token axis: a sequence's context shards are more token shards.
    ("tokens", ("data", "expert", "pipeline", "context")),
    ("cache_slots", None),  # KV-cache slots: generation keeps a sequence whole
    ("act_embed", None),
    ("layers", None),
    ("stage_layers", "pipeline"),  # the MoE stack in pipeline slot order: stage-major, one block per stage
    ("vocab", "tensor"),
    ("embed", "data"),
    ("embed_moe", "data"),
    ("eh_in", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("exp", "expert"),
    ("mlp_moe", "tensor"),
    ("router_exp", None),
    ("norm", None),
)


def make_mesh(shape: Mapping[str, int] | None = None, devices: Sequence[jax.Device] | None = None,
              cfg=None, global_batch: int | None = None) -> jax.sharding.Mesh:
    """A mesh over MESH_AXES; one axis may be -1 to take the remaining devices.

    With `cfg` (and `global_batch`) the layout is validated against the model first.
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = mesh_shape(shape, len(devices))
    if cfg is not None:
        validate_mesh(sizes, cfg, global_batch)
    return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                         axis_types=(AxisType.Explicit,) * len(MESH_AXES), devices=devices)


# Weights are stored FSDP-sharded over `data` but used gathered: these logical names are
# replicated in the compute layout (the all-gather XLA inserts is the ZeRO-3 parameter gather).
# The plan tool counts the gathered copies from the same set.
FSDP_LOGICAL = frozenset({"embed", "embed_moe"})


def mesh_shape(shape: Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """Resolve a {axis: size} mapping (one size may be -1 = the remaining devices) over num_devices.

    A bad mesh is the user's (`mesh.<axis>` in the config, --mesh on the command line): InputError.
    """
    shape = dict(shape or {"data": -1})
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise InputError(f"mesh.{unknown[0]}: unknown mesh axis; the axes are {', '.join(MESH_AXES)} "
                         "(a missing axis has size 1)")
    sizes = {}
    for a in MESH_AXES:
        try:
            sizes[a] = int(shape.get(a, 1))
        except (TypeError, ValueError):
            raise InputError(f"mesh.{a}={shape[a]!r}: expected an integer size (or -1 for the remaining "
                             "devices)") from None
    given = " ".join(f"mesh.{a}={n}" for a, n in sizes.items())
    fill = [a for a, n in sizes.items() if n == -1]
    if len(fill) > 1:
        raise InputError(f"{' and '.join(f'mesh.{a}=-1' for a in fill)}: only one axis may be -1 (the remaining "
                         "devices); give the others a size")
    bad = [a for a, n in sizes.items() if n == 0 or n < -1]
    if bad:
        raise InputError(f"mesh.{bad[0]}={sizes[bad[0]]}: an axis size must be >= 1 (or -1 for the remaining "
                         "devices)")
    if fill:
        rest = math.prod(n for n in sizes.values() if n != -1)
        if num_devices % rest:
            raise InputError(f"mesh.{fill[0]}=-1 takes the remaining devices, but the fixed axes multiply to "
                             f"{rest}, which does not divide the {num_devices} devices; choose sizes whose "
                             f"product divides {num_devices}")
        sizes[fill[0]] = num_devices // rest
    if math.prod(sizes.values()) != num_devices:
        raise InputError(f"mesh ({given}) multiplies to {math.prod(sizes.values())} devices but there are "
                         f"{num_devices}; make the mesh.* sizes multiply to {num_devices} (or set one to -1 "
                         "for the remaining devices)")
    return sizes


def validate_mesh(sizes: Mapping[str, int], cfg, global_batch: int | None = None) -> None:
    """Clear errors for a mesh the model cannot be laid out on (checked before anything is built).

    Sequence lengths are checked per phase with `check_context_split`."""
    def need(dim: int, axes: tuple[str, ...], what: str, fix: str):
        n = math.prod(sizes.get(a, 1) for a in axes)
        if dim % n:
            fields = " x ".join(f"mesh.{a}={sizes.get(a, 1)}" for a in axes)
            raise InputError(f"{what}={dim} is not divisible by the {' x '.join(axes)} mesh size {n} ({fields}); "
                             f"{fix}")

    if sizes.get("pipeline", 1) > 1:
        _validate_pipeline(cfg, sizes, global_batch)
    if sizes.get("context", 1) > 1 and cfg.attention_impl not in ("blockwise", "auto"):  # auto: blockwise there
        raise InputError(f"model.attention_impl={cfg.attention_impl!r}: a sequence split over mesh.context="
                         f"{sizes['context']} needs attention_impl='blockwise' (queries of one shard attend to the "
                         "gathered keys by position); set --config.model.attention_impl=blockwise or mesh.context=1")
    tensor, expert = ("tensor",), ("expert",)
    need(cfg.n_routed_experts, expert, "model.n_routed_experts", "choose a mesh.expert that divides it")
    need(cfg.num_attention_heads, tensor, "model.num_attention_heads", "choose a mesh.tensor that divides it")
    kv, tp = cfg.num_key_value_heads, sizes.get("tensor", 1)
    if kv % tp and tp % kv:  # fewer KV heads than `tensor` are copied (`copies_to_split`), so either may divide
        raise InputError(f"model.num_key_value_heads={kv} is not divisible by the tensor mesh size {tp} "
                         f"(mesh.tensor={tp}), nor does it divide it (fewer KV heads than mesh.tensor are copied, "
                         "each to mesh.tensor / num_key_value_heads devices); choose a mesh.tensor that divides it "
                         "or is a multiple of it")
    for field in ("intermediate_size", "moe_intermediate_size", "vocab_size"):
        need(getattr(cfg, field), tensor, f"model.{field}", "choose a mesh.tensor that divides it")
    # Parameters are FSDP-sharded over `data` through their model dimension.
    need(cfg.hidden_size, ("data",), "model.hidden_size", "choose a mesh.data that divides it")
    if global_batch is not None:
        # Outside the pipelined trunk the batch is split over `pipeline` too; named only when it is in use.
        axes = tuple(a for a in mesh_axes("batch") if a != "pipeline" or sizes.get(a, 1) > 1)
        need(global_batch, axes, "train.global_batch",
             f"the batch is split over the {' and '.join(axes)} axes; make it a multiple of their product")


def pipeline_microbatches(cfg, stages: int) -> int:
    """Micro-batches each batch shard streams through the pipeline's stages (0 in the config = one per stage)."""
    return cfg.pipeline_microbatches or stages


def _validate_pipeline(cfg, sizes: Mapping[str, int], global_batch: int | None) -> None:
    """Clear errors for a pipeline schedule (model/pipeline.py) the model or batch cannot be run with."""
    stages = sizes["pipeline"]
    repeats, m = cfg.pipeline_repeats, pipeline_microbatches(cfg, stages)
    where = f"mesh.pipeline={stages}"
    if cfg.num_moe_layers < stages * repeats:
        raise InputError(f"{where} x model.pipeline_repeats={repeats}: the model has {cfg.num_moe_layers} MoE "
                         "layers (the pipelined stack), fewer than stages x repeats, so some stage would hold no "
                         "layer; lower mesh.pipeline or model.pipeline_repeats")
    if repeats > 1 and m < stages:
        raise InputError(f"model.pipeline_microbatches={m}: the circular schedule (pipeline_repeats={repeats}) "
                         f"needs at least as many micro-batches as stages ({where}); raise "
                         "model.pipeline_microbatches")
    if global_batch is not None:
        rows = math.prod(sizes.get(a, 1) for a in ("data", "expert"))
        if global_batch % rows or (global_batch // rows) % m:
            raise InputError(f"train.global_batch={global_batch}: each of the data x expert = {rows} batch shards "
                             f"streams its rows through the pipeline in model.pipeline_microbatches={m} "
                             f"micro-batches; make the batch a multiple of {rows * m}")


def check_context_split(seq_len: int, context: int, field: str) -> None:
    """InputError naming `field` unless a row of `seq_len` tokens splits into the 2 x context chunks of
    `load_balanced_order`."""
    if seq_len % (2 * context):
        raise InputError(f"{field}={seq_len} is not a multiple of 2 x mesh.context = {2 * context} (each context "
                         "shard holds an early and a late chunk of every row); choose a multiple, or a smaller "
                         "mesh.context")


def load_balanced_order(seq_len: int, context: int) -> np.ndarray:
    """The row index held at each slot of a row laid out for `context` shards (docs/long_context.md#load-balance).

    The row is cut into 2C chunks; shard i holds chunks i and 2C-1-i, so each shard gets the same causal work
    (an early chunk sees few keys, its late partner many). Slot j of the laid-out row holds token
    `order[j]` of the original row; C = 1 is the identity.
    """
    if context == 1:
        return np.arange(seq_len, dtype=np.int32)
    if seq_len % (2 * context):
        raise ValueError(f"a row of {seq_len} tokens does not split into 2 x {context} equal chunks")
    chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * context, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * context - 1 - i]]) for i in range(context)])


def context_size() -> int:
    """Size of the `context` axis of the mesh in use (1 outside a mesh)."""
    return dict(jax.sharding.get_abstract_mesh().shape).get("context", 1)


def logical(*names: str | None) -> PartitionSpec:
    """PartitionSpec for an array whose axes have these logical names.

    Mesh axes that are manual here (inside a pipeline stage's shard_map: `pipeline`) are left out: a
    stage's arrays are laid out over the remaining axes only.
    """
    rules = dict(LOGICAL_RULES)
    manual = jax.sharding.get_abstract_mesh().manual_axes

    def spec(name):
        axes = rules.get(name) if name is not None else None
        if axes is None or not manual:
            return axes
        kept = tuple(a for a in spec_axes(axes) if a not in manual)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return PartitionSpec(*(spec(n) for n in names))


def copies_to_split(name: str, size: int) -> int:
    """How many copies of each of its `size` entries an axis named `name` needs to split evenly over `name`'s
    mesh axes in the mesh in use: 1 where `size` divides already (and outside a mesh).

    Fewer entries than devices is MQA/GQA with fewer KV heads than `tensor`: as in transformers-compatible serving
    engines (vLLM, SGLang), each KV head's projection is replicated and its k/v copied to the
    `tensor / num_key_value_heads` devices whose query heads read it; `validate_mesh` refuses sizes where neither
    divides the other.
    """
    shape = dict(jax.sharding.get_abstract_mesh().shape)
    n = math.prod(shape.get(a, 1) for a in mesh_axes(name))
    if size % n == 0:
        return 1
    if n % size:
        raise ValueError(f"{size} entries of {name!r} neither split over nor divide its {n} devices")
    return n // size


def spec_axes(entry: str | Sequence[str] | None) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis name, or a tuple of them), as a tuple."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def mesh_axes(name: str) -> tuple[str, ...]:
    """The mesh axes a logical name is sharded over (for collectives inside shard_map)."""
    return spec_axes(dict(LOGICAL_RULES).get(name))


def weight(p: nnx.Variable, dtype=None) -> jax.Array:
    """A parameter in its compute layout: FSDP axes gathered, tensor/expert axes kept."""
    value = p[...]
    # Layers stacked for lax.scan keep the stack's ("layers", ...) names on each slice.
    names = tuple(p.get_metadata().get("out_sharding", ()))[-value.ndim:] if value.ndim else ()
    if names and any(n in FSDP_LOGICAL for n in names):
        value = jax.sharding.reshard(value, logical(*(None if n in FSDP_LOGICAL else n for n in names)))
    return value if dtype is None else value.astype(dtype)


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """Pin an activation's layout at a block boundary (Explicit mode: a real reshard)."""
    return jax.sharding.reshard(x, logical(*names))


def flatten_tokens(x: jax.Array) -> jax.Array:
    """[b, s, ...] -> [b * s, ...] laid out as "tokens" (data x expert x context), by a reshape on each
    device: its block of rows x slots becomes its block of tokens, nothing moves. The global token order is
    then (batch shard, context shard, row, slot), row-major only without a context axis: token-wise work
    (routing, experts) does not care, and `unflatten_tokens` puts every token back."""
    if jax.sharding.get_abstract_mesh().empty:
        return x.reshape(-1, *x.shape[2:])
    rest = (None,) * (x.ndim - 2)
    if context_size() == 1:  # rows stay whole: a global reshape is the per-device one (and needs no shard_map,
        # which inside a pipeline stage autodiff could not transpose: docs/pipeline.md#nested-shard-map)
        x = jax.sharding.reshard(x, logical("batch", None, *rest))
        return jax.sharding.reshard(x.reshape(-1, *x.shape[2:]), logical("tokens", *rest))
    rows = logical("batch", "seq", *rest)
    mapped = shard_map(lambda a: (a.reshape(-1, *a.shape[2:]),), (rows,), (logical("tokens", *rest),),
                       diff_argnums=_float_args(x))
    return mapped(jax.sharding.reshard(x, rows))[0]


def unflatten_tokens(x: jax.Array, b: int, s: int) -> jax.Array:
    """The inverse of `flatten_tokens`: [b * s, ...] "tokens" -> [b, s, ...] (batch, seq)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x.reshape(b, s, *x.shape[1:])
    rest = (None,) * (x.ndim - 1)
    if context_size() == 1:
        x = jax.sharding.reshard(x, logical("batch", *rest))  # the same devices' blocks: context is 1
        return jax.sharding.reshard(x.reshape(b, s, *x.shape[1:]), logical("batch", "seq", *rest))
    sizes = dict(mesh.shape)
    # The batch spec's axes, not mesh_axes("batch"): inside a pipeline stage `pipeline` is manual and `b` local.
    batch_axes = spec_axes(logical("batch")[0])
    local_b, local_s = b // math.prod(sizes[a] for a in batch_axes), s // sizes["context"]
    tokens = logical("tokens", *rest)
    mapped = shard_map(lambda a: (a.reshape(local_b, local_s, *a.shape[1:]),), (tokens,),
                       (logical("batch", "seq", *rest),), diff_argnums=_float_args(x))
    return mapped(jax.sharding.reshard(x, tokens))[0]


def _float_args(*args: jax.Array) -> tuple[int, ...]:
    return tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.inexact))


def whole_along(x: jax.Array, axis: int) -> jax.Array:
    """`x` with `axis` unsharded (all-gathered; a no-op outside a mesh): for ops along the sequence (a roll,
    an [s, t] comparison), which the seq axis's `context` sharding forbids, even at size 1."""
    layout = jax.typeof(x).sharding
    if layout.mesh.empty:
        return x
    spec = list(layout.spec) + [None] * (x.ndim - len(layout.spec))
    spec[axis] = None
    return jax.sharding.reshard(x, layout.update(spec=jax.P(*spec)))


def unsharded_singletons(x: jax.Array) -> jax.Array:
    """`x` with its size-1 axes unsharded: free, as such an axis can only be split over mesh axes of size 1.

    For operands that meet after different reshapes: JAX's reshape rules keep a size-1 axis's layout in some
    reshapes and drop it in others (all of them, in a reshape that only adds or removes size-1 axes), so two
    operands of one product could otherwise disagree on it."""
    layout = jax.typeof(x).sharding
    if layout.mesh.empty:
        return x
    spec = list(layout.spec) + [None] * (x.ndim - len(layout.spec))
    spec = [None if size == 1 else axes for size, axes in zip(x.shape, spec)]
    return jax.sharding.reshard(x, layout.update(spec=jax.P(*spec)))


@contextlib.contextmanager
def use_mesh(mesh: jax.sharding.Mesh) -> Iterator[jax.sharding.Mesh]:
    """Context in which NNX modules are created and the model runs: mesh + logical rules."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(LOGICAL_RULES):
        yield mesh


def shard_map(local: Callable[..., tuple], in_specs: tuple, out_specs: tuple, *, diff_argnums: Sequence[int],
              diff_outnums: Sequence[int] = (0,)) -> Callable[..., tuple]:
    """`jax.shard_map(local, ...)` that can also be differentiated inside a pipeline stage.

    Outside a shard_map this is the plain one. Inside a pipeline stage (manual over `pipeline`) JAX 0.12 cannot
    transpose a nested shard_map (its residuals get the wrong local shapes: docs/pipeline.md#nested-shard-map), so
    there the VJP is written out: the primal inputs are the only residuals and `local` is recomputed under `jax.vjp`
    in the backward's own shard_map. `local` returns a tuple; gradients flow to the inputs `diff_argnums` from
    the outputs `diff_outnums` (the others are statistics: no cotangent).
    """
    nested = bool(jax.sharding.get_abstract_mesh().manual_axes)
    # Nested, varying-axis checks stay off: JAX 0.12 would give the residuals it splits off this shard_map
    # the outer manual axis too.
    mapped = jax.shard_map(local, in_specs=in_specs, out_specs=out_specs, check_vma=not nested)
    if not nested:
        return mapped

    def forward(*args):
        # check_vma=False types the outputs as invariant over the outer manual axis although they vary with
        # the stage; left so, autodiff would psum their cotangents over the stages. No autodiff runs here.
        outer = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in args))
        return tuple(jax.lax.pcast(o, tuple(sorted(outer - jax.typeof(o).manual_axis_type.varying)), to="varying")
                     for o in mapped(*args))

    if not diff_argnums:  # integer inputs (router choices): nothing to differentiate
        return forward

    @jax.custom_vjp
    def run(*args):
        return forward(*args)

    def fwd(*args):
        return forward(*args), args

    def bwd(args, cts):
        def local_bwd(*args_and_cts):
            primals, cts = args_and_cts[:len(args)], args_and_cts[len(args):]

            def differentiable(*diff):
                full = list(primals)
                for i, a in zip(diff_argnums, diff):
                    full[i] = a
                outs = local(*full)
                return tuple(outs[j] for j in diff_outnums)
            outs, pullback = jax.vjp(differentiable, *(primals[i] for i in diff_argnums))
            return pullback(tuple(cotangent_like(ct, o) for ct, o in zip(cts, outs)))

        grads = jax.shard_map(local_bwd, in_specs=(*in_specs, *(out_specs[j] for j in diff_outnums)),
                              out_specs=tuple(in_specs[i] for i in diff_argnums))(
                                  *args, *(cts[j] for j in diff_outnums))
        full = [None] * len(args)
        for i, g in zip(diff_argnums, grads):
            full[i] = g
        return tuple(full)

    run.defvjp(fwd, bwd)
    return run


def cotangent_like(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """Give a cotangent its primal's varying mesh axes inside a shard_map (no-op outside one).

    Autodiff inserts these itself: where the forward mixed an operand with one that varies over
    more axes (x with tensor-sharded weights), the transpose of that implicit `pvary` is a psum.
    """
    varying = lambda a: jax.typeof(a).manual_axis_type.varying  # noqa: E731
    extra = tuple(sorted(varying(ct) - varying(primal)))
    ct = jax.lax.psum(ct, extra) if extra else ct
    missing = tuple(sorted(varying(primal) - varying(ct)))
    return jax.lax.pcast(ct, missing, to="varying") if missing else ct

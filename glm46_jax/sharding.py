"""The device mesh and the one table of logical-axis rules.

Model code names array axes logically ("embed", "heads", "exp", ...); only this module knows
which mesh axis (data, tensor, expert, pipeline) each logical name lands on.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

from glm46_jax.cli import InputError

MESH_AXES = ("data", "tensor", "expert", "pipeline")

# logical name -> mesh axis (or tuple of axes, or None = replicated).
# Parameters are FSDP-sharded over `data` through their "embed" dimension (ZeRO-3 style).
# Outside the pipelined MoE trunk the `pipeline` axis is one more data-parallel axis; inside a stage it is
# manual, and `logical` leaves it out (docs/pipeline.md#layout).
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "expert", "pipeline")),
    ("seq", None),
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
    """A mesh over (data, tensor, expert, pipeline); one axis may be -1 to take the remaining devices.

    With `cfg` (and `global_batch`) the layout is validated against the model first.
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = mesh_shape(shape, len(devices))
    if cfg is not None:
        validate_mesh(sizes, cfg, global_batch)
    return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Explicit,) * 4,
                         devices=devices)


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
    """Clear errors for a mesh the model cannot be laid out on (checked before anything is built)."""
    def need(dim: int, axes: tuple[str, ...], what: str, fix: str):
        n = math.prod(sizes.get(a, 1) for a in axes)
        if dim % n:
            fields = " x ".join(f"mesh.{a}={sizes.get(a, 1)}" for a in axes)
            raise InputError(f"{what}={dim} is not divisible by the {' x '.join(axes)} mesh size {n} ({fields}); "
                             f"{fix}")

    if sizes.get("pipeline", 1) > 1:
        from glm46_jax.model.pipeline import validate  # the schedule's own constraints live with the schedule
        validate(cfg, sizes, global_batch)
    tensor, expert = ("tensor",), ("expert",)
    need(cfg.n_routed_experts, expert, "model.n_routed_experts", "choose a mesh.expert that divides it")
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
                  "vocab_size"):
        need(getattr(cfg, field), tensor, f"model.{field}", "choose a mesh.tensor that divides it")
    # Parameters are FSDP-sharded over `data` through their model dimension.
    need(cfg.hidden_size, ("data",), "model.hidden_size", "choose a mesh.data that divides it")
    if global_batch is not None:
        # Outside the pipelined trunk the batch is split over `pipeline` too; named only when it is in use.
        axes = tuple(a for a in mesh_axes("batch") if a != "pipeline" or sizes.get(a, 1) > 1)
        need(global_batch, axes, "train.global_batch",
             f"the batch is split over the {' and '.join(axes)} axes; make it a multiple of their product")


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
        kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a not in manual)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return PartitionSpec(*(spec(n) for n in names))


def mesh_axes(name: str) -> tuple[str, ...]:
    """The mesh axes a logical name is sharded over (for collectives inside shard_map)."""
    axes = dict(LOGICAL_RULES).get(name)
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


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


@contextlib.contextmanager
def use_mesh(mesh: jax.sharding.Mesh) -> Iterator[jax.sharding.Mesh]:
    """Context in which NNX modules are created and the model runs: mesh + logical rules."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(LOGICAL_RULES):
        yield mesh

"""Host offload: the optimizer state, and optionally the master weights, in host memory between steps
(docs/training.md#host-offload).

    state = offload.place(state, {"model": "optimizer"}, "model")  # after init or restore: its opt state -> host
    state, metrics = step(state, batch, controls)  # the step fetches it for the update and stores it back

The state's arrays keep their shardings and only change memory kind (`pinned_host`: page-locked, so the
transfers are DMA). The step (training/step.py) needs no setting: inside jit an array's type says which memory it
lives in, so `fetch` moves the host-resident leaves to the device before they are read and `store_like` returns
the new state to the memory each leaf came from. The update brings the state in one layer at a time
(training/streamed.py). Nothing here changes a number: the same update runs on the same values.

"optimizer_and_params" also keeps the (fp32) master weights on the host. The forward and backward then run on
`compute_copy`: the weights the model only reads cast to its compute dtype (`paths.COMPUTE_CAST`) come to the
device in that dtype, so the device holds them and their gradients at compute precision; the update fetches those
masters again (`masters`; the other leaves' copies are their masters) and casts the gradients to their dtype. In fp32 that is the no-offload step exactly; with a bf16
compute dtype the gradients a data-parallel reduction or a micro-batch accumulation sums are bf16 instead of fp32.

The CPU backend has the same memory kinds (`pinned_host`, `unpinned_host`), so the tests run this path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from glm46_jax.model.paths import COMPUTE_CAST, path_names

OFFLOAD = ("none", "optimizer", "optimizer_and_params")  # what `optim.offload` may name
HOST = "pinned_host"


def to_host(tree: Any) -> Any:
    """Every array of `tree` in host memory, sharded as before (outside jit)."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(HOST)), tree)


def place(state: Any, offload: Mapping[str, str], main: str) -> Any:
    """`state` (a training.step.TrainState whose first model is `main`) with each model's optimizer state, and for
    "optimizer_and_params" its trained weights, in host memory as `offload` maps its name ("none" or absent: left
    where they are). `models.build` calls it after init; a restore puts each leaf back in the memory its target's
    leaf lives in (training/checkpoint.py)."""
    models = state.models(main)

    def placed(name, m):
        mode = offload.get(name, "none")
        if mode == "none":
            return m
        return m.replace(opt_state=to_host(m.opt_state),
                         params=to_host(m.params) if mode == "optimizer_and_params" else m.params)

    return state.with_models(main, {n: placed(n, m) for n, m in models.items()})


def on_host(x: Any) -> bool:
    """Inside jit: whether the traced array lives in host memory."""
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def fetch(tree: Any) -> Any:
    """Inside jit: the host-resident leaves of `tree` copied to the device, the rest as they are."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device) if on_host(x) else x, tree)


def compute_copy(params: Any, dtype: Any = None) -> Any:
    """Inside jit: the weights a forward and backward read. Host-resident ones come to the device, those named in
    `paths.COMPUTE_CAST` in `dtype` (None: as stored); device-resident ones are returned as they are."""
    def leaf(path, x):
        if not on_host(x):
            return x
        x = jax.device_put(x, jax.memory.Space.Device)
        cast = dtype is not None and path_names(path)[-1] in COMPUTE_CAST and jnp.issubdtype(x.dtype, jnp.floating)
        return x.astype(dtype) if cast else x
    return jax.tree_util.tree_map_with_path(leaf, params)


def masters(copy: Any, stored: Any) -> Any:
    """Inside jit: the master weights the update reads: a leaf of the compute copy where it is the stored value
    itself (on the device, or fetched without a cast), else the stored leaf fetched again."""
    return jax.tree.map(lambda c, p: c if c.dtype == p.dtype else jax.device_put(p, jax.memory.Space.Device),
                        copy, stored)


def like_masters(grads: Any, masters: Any) -> Any:
    """Gradients of a compute copy in their master weights' dtypes (unchanged where they already are)."""
    return jax.tree.map(lambda g, p: g if g.dtype == p.dtype else g.astype(p.dtype), grads, masters)


def store_like(tree: Any, like: Any) -> Any:
    """Inside jit: each leaf of `tree` moved to host memory where `like`'s leaf (its input) lives there."""
    return jax.tree.map(lambda x, l: jax.device_put(x, jax.memory.Space.Host) if on_host(l) else x, tree, like)

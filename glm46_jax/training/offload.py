"""Host offload: the optimizer state kept in host memory between steps (docs/training.md#host-offload).

    state = offload.place(state, {"model": "optimizer"}, "model")  # after init or restore: its opt state -> host
    state, metrics = step(state, batch, controls)  # the step fetches it for the update and stores it back

The state's arrays keep their shardings and only change memory kind (`pinned_host`: page-locked, so the
transfers are DMA). The step (training/step.py) needs no setting: inside jit an array's type says which memory it
lives in, so `fetch` moves the host-resident leaves to the device before the optimizer reads them and
`store_like` returns the new state to the memory each leaf came from. XLA schedules the transfers; each leaf's
device copy is needed only for its own update, which lets the scheduler stream them instead of holding the whole
state at once. Nothing here changes a number: the same update runs on the same values.

The CPU backend has the same memory kinds (`pinned_host`, `unpinned_host`), so the tests run this path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

OFFLOAD = ("none", "optimizer")  # what `optim.offload` may name
HOST = "pinned_host"


def to_host(tree: Any) -> Any:
    """Every array of `tree` in host memory, sharded as before (outside jit)."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(HOST)), tree)


def place(state: Any, offload: Mapping[str, str], main: str) -> Any:
    """`state` (a training.step.TrainState whose first model is `main`) with the optimizer state of each model
    that `offload` maps to "optimizer" in host memory, the others' where they are. Idempotent: call it after init
    and after every restore."""
    models = state.models(main)
    return state.with_models(main, {n: m.replace(opt_state=to_host(m.opt_state)) if offload.get(n) == "optimizer"
                                    else m for n, m in models.items()})


def on_host(x: Any) -> bool:
    """Inside jit: whether the traced array lives in host memory."""
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def fetch(tree: Any) -> Any:
    """Inside jit: the host-resident leaves of `tree` copied to the device, the rest as they are."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device) if on_host(x) else x, tree)


def store_like(tree: Any, like: Any) -> Any:
    """Inside jit: each leaf of `tree` moved to host memory where `like`'s leaf (its input) lives there."""
    return jax.tree.map(lambda x, l: jax.device_put(x, jax.memory.Space.Host) if on_host(l) else x, tree, like)

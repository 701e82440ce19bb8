"""The fewest devices a training step fits on, and its layout: the plan of every mesh of N devices.

    python -m glm46_jax.plan --config=configs/pretrain.py:glm46 --phase=long_context_200k --device-memory=80GB \\
        --search

N runs over powers of two (8, 16, 32, ... up to `max_devices`), each mesh axis a power of two as well; the
first N where some layout fits in (1 - margin) of the device's memory wins. Layouts the model or the batch cannot
be laid out on (`plan` raises InputError: heads, experts or the batch not divisible, a sequence that does not
split over `context`, a pipeline schedule the batch cannot stream) are skipped. `tensor` stays within `max_tensor` devices (8: one NVLink node)
and `pipeline` within `max_pipeline` (1 by default: at micro-batch 1 the schedule's bubble is nearly half).

Among the layouts that fit on those N devices the one picked has the fewest pipeline stages, then the fewest
context shards (each costs attention traffic: docs/long_context.md#attention-across-shards), then the fewest
tensor shards (activations all-reduced per layer), then the most memory left.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from glm46_jax import errors


def _powers(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def layouts(devices: int, *, max_tensor: int = 8, max_pipeline: int = 1) -> Iterator[dict[str, int]]:
    """Every mesh of `devices` (a power of two) with power-of-two axes, tensor <= max_tensor and
    pipeline <= max_pipeline."""
    for tensor in _powers(min(max_tensor, devices)):
        for pipeline in _powers(min(max_pipeline, devices // tensor)):
            for expert in _powers(devices // (tensor * pipeline)):
                for context in _powers(devices // (tensor * pipeline * expert)):
                    data = devices // (tensor * pipeline * expert * context)
                    yield {"data": data, "tensor": tensor, "expert": expert, "pipeline": pipeline, "context": context}


def _preference(r: Any) -> tuple:
    return r.mesh["pipeline"], r.mesh["context"], r.mesh["tensor"], r.total


def smallest_fitting(plan_at: Callable[[Mapping[str, int]], Any], device_memory: int, *, margin: float = 0.1,
                     max_devices: int = 16384, max_tensor: int = 8, max_pipeline: int = 1) -> Any | None:
    """The preferred layout (module docstring) among those whose plan needs at most (1 - margin) x device_memory
    per device, on the fewest devices; None when nothing up to `max_devices` fits.

    `plan_at(mesh)` is the plan of one mesh (`plan.plan` with the model and batch bound): a result with `total`
    (bytes per device) and `mesh`, or an InputError for a mesh the model or batch cannot
    be laid out on. The margin is XLA's: workspace, fragmentation and collective buffers the plan leaves out."""
    if device_memory <= 0 or not 0 <= margin < 1:
        raise errors.InputError(f"device memory {device_memory} and margin {margin}: the search needs a positive "
                                "--device-memory and 0 <= --margin < 1")
    budget = (1 - margin) * device_memory
    for devices in _powers(max_devices)[3:]:
        fitting = []
        for mesh in layouts(devices, max_tensor=max_tensor, max_pipeline=max_pipeline):
            try:
                r = plan_at(mesh)
            except errors.InputError:
                continue
            if r.total <= budget:
                fitting.append(r)
        if fitting:
            return min(fitting, key=_preference)
    return None

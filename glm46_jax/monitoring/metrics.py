"""Training metrics on the host: peak FLOP/s, MFU, device memory. Where they are written: sinks.py.

Nothing here is jitted: these run between steps on values already fetched to the host.
The MFU numerator comes from `glm46_jax.model.counting.flops_per_token(cfg, seq_len)`; the denominator
is `peak_flops` (datasheet) where the chip is known, else `measure_matmul_peak` (e.g. on CPU).
"""

from __future__ import annotations

import functools
import resource
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

# Dense (no 2:4 sparsity) per-chip peak FLOP/s from the vendors' datasheets / whitepapers; the
# datasheets' headline tensor-core numbers are the sparse ones, i.e. twice these.
# Keys are case-insensitive substrings of `jax.Device.device_kind`; the longest matching key wins,
# so "H100 PCIe" beats "H100" and "TPU v5 lite" (v5e) beats "TPU v5" (v5p's device_kind).
# float32 on NVIDIA is the plain (non-tensor-core) FP32 rate: XLA's default matmul precision may use
# TF32 tensor cores instead (H100 SXM: 494.7e12), so a float32 MFU against this can exceed 1.
# TPUs have no float32 datasheet number (the MXU emulates it with bf16 passes): lookups give None.
# An empty entry shadows a shorter key that would otherwise match a different chip.
PEAK_FLOPS_PER_DEVICE: dict[str, dict[str, float]] = {
    # Hopper. "NVIDIA H100 80GB HBM3" is the SXM part; GH200's device_kind contains "H200" and its
    # GPU has the same rates as H100 SXM.
    "H100": {"bfloat16": 989.4e12, "float32": 66.9e12},
    "H100 PCIe": {"bfloat16": 756e12, "float32": 51.2e12},
    "H100 NVL": {"bfloat16": 835.5e12, "float32": 60e12},
    "H200": {"bfloat16": 989.4e12, "float32": 66.9e12},
    "H200 NVL": {"bfloat16": 835.5e12, "float32": 60e12},
    "H800": {"bfloat16": 989.4e12, "float32": 66.9e12},
    "H800 PCIe": {"bfloat16": 756e12, "float32": 51.2e12},
    # Ampere / Ada.
    "A100": {"bfloat16": 312e12, "float32": 19.5e12},
    "A10": {"bfloat16": 125e12, "float32": 31.2e12},
    "A10G": {},  # AWS's A10 variant has lower clocks and no public datasheet: unknown, not A10's
    "L4": {"bfloat16": 121e12, "float32": 30.3e12},
    # Blackwell: no per-GPU dense FP32 number on the HGX datasheet, so bf16 only.
    "B200": {"bfloat16": 2.25e15},
    "GB200": {"bfloat16": 2.5e15},
    # TPUs, per chip (v4 onwards is one JAX device per chip).
    "TPU v4": {"bfloat16": 275e12},
    "TPU v4 lite": {},  # v4i, an inference chip: not v4's rate
    "TPU v5": {"bfloat16": 459e12},  # v5p reports device_kind "TPU v5"
    "TPU v5p": {"bfloat16": 459e12},
    "TPU v5 lite": {"bfloat16": 197e12},
    "TPU v5e": {"bfloat16": 197e12},
    "TPU v6 lite": {"bfloat16": 918e12},
    "TPU v6e": {"bfloat16": 918e12},
}


def peak_flops(device: jax.Device, dtype: str) -> float | None:
    """Datasheet dense peak FLOP/s of one `device` for matmuls in `dtype`; None when not in the table.

    `dtype` is a name, "bfloat16" or "float32". CPUs are never in the table: use
    `measure_matmul_peak` there.
    """
    kind = device.device_kind.lower()
    matches = [key for key in PEAK_FLOPS_PER_DEVICE if key.lower() in kind]
    if not matches:
        return None
    return PEAK_FLOPS_PER_DEVICE[max(matches, key=len)].get(dtype)


def measure_matmul_peak(
    dtype: str = "float32",
    sizes: tuple[int, ...] = (1024, 2048),
    repeats: int = 5,
    device: jax.Device | None = None,
) -> float:
    """Best measured FLOP/s of a square `a @ b` (2 n^3 FLOPs) on `device` over `sizes` and `repeats`.

    The best, not the mean: it stands in for a datasheet peak, the most the device does on a plain
    matmul, so scheduler noise should not lower it. Compilation and a first run are excluded.
    """
    device = device or jax.devices()[0]
    matmul = jax.jit(jnp.matmul)
    best = 0.0
    for n in sizes:
        ka, kb = jax.random.split(jax.random.key(n))
        a = jax.device_put(jax.random.normal(ka, (n, n), dtype), device)
        b = jax.device_put(jax.random.normal(kb, (n, n), dtype), device)
        matmul(a, b).block_until_ready()
        for _ in range(repeats):
            start = time.perf_counter()
            matmul(a, b).block_until_ready()
            best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


def mfu(flops_per_token: float, tokens_per_s: float, num_devices: int, peak_per_device: float) -> float:
    """Model FLOPs utilisation: flops_per_token * tokens_per_s / (num_devices * peak_per_device).

    `flops_per_token` is the model's training FLOPs per token, `glm46_jax.model.counting.flops_per_token`:
    6 x (matmul weights each token touches: attention projections, dense FFNs, router, the k routed
    + shared experts, MTP, output head) + causal attention, 6 * seq_len * heads * head_dim per layer.
    Remat recompute is not counted, so this is model FLOPs, not hardware FLOPs.
    `tokens_per_s` is global (all devices); `peak_per_device` is `peak_flops` or `measure_matmul_peak`.
    """
    return flops_per_token * tokens_per_s / (num_devices * peak_per_device)


@functools.cache
def _host_matmul_peak() -> float:
    """Measured once per process: the host does not change between the runs a process makes (a few seconds each)."""
    return measure_matmul_peak("float32", device=jax.devices("cpu")[0])


def system_peak(devices: Sequence[jax.Device]) -> tuple[float | None, str]:
    """(peak FLOP/s of `devices` together, where the number comes from) for MFU.

    Accelerators: datasheet dense bf16 x device count (the usual MFU convention, whatever the
    compute dtype). CPU: the host's measured fp32 matmul throughput, not multiplied: virtual CPU
    devices (--xla_force_host_platform_device_count) share the same cores.
    """
    if devices[0].platform == "cpu":
        return _host_matmul_peak(), "measured fp32 matmul, host"
    per_device = peak_flops(devices[0], "bfloat16")
    if per_device is None:
        return None, f"no datasheet peak for {devices[0].device_kind!r}"
    return per_device * len(devices), f"datasheet dense bf16 x {len(devices)}"


def device_memory_peak_bytes(device: jax.Device | None = None) -> int | None:
    """Peak bytes in use on `device` (default: the first device) since the process started.

    GPU/TPU: the allocator's `peak_bytes_in_use`. CPU has no such statistic, so it is the host
    process's peak resident set size (ru_maxrss), which covers everything the process holds, not
    only arrays. None when neither is available.
    """
    device = device or jax.devices()[0]
    stats = device.memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"])
    if device.platform == "cpu":
        max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(max_rss if sys.platform == "darwin" else max_rss * 1024)  # macOS: bytes; Linux: KiB
    return None

"""Process-wide CPU settings applied before XLA starts (docs/performance.md#cpu-host-settings).

    from glm46_jax import host
    host.configure_cpu()          # first thing in a CPU entry point: before any jax device is touched

The CLIs do this in `cli.main_guard` / `cli.run_absl`. The one setting: glibc malloc with one arena, no mmap and
no trimming. XLA:CPU allocates an executable's temporaries as one large buffer per call from its worker threads;
glibc serves that from a fresh mmap in the thread's arena and unmaps it on free, so every call page-faults all of
it again. Served from the main heap and kept, the same pages are reused. Set with `mallopt`, which must run before
XLA's threads pick their arenas. No XLA flag is set: the one that measured faster, oneDNN dot fusion, computes
wrong results (measurements: docs/performance.md#cpu-host-settings).

Only where jax will run on CPU (JAX_PLATFORMS says cpu, or no accelerator plugin is installed), and not at all
with GLM46_JAX_CPU_TUNING=0. Malloc settings the user chose (GLIBC_TUNABLES with malloc tunables, MALLOC_*
variables) are left alone. Import-light: no jax here.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
from collections.abc import MutableMapping

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")
_applied: list[str] | None = None


def runs_on_cpu(env: MutableMapping[str, str]) -> bool:
    """Whether jax will pick the CPU backend: JAX_PLATFORMS names only cpu, or no accelerator plugin is installed."""
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return platforms == ["cpu"]
    if any(importlib.util.find_spec(name) is not None for name in _ACCELERATOR_PLUGINS):
        return False
    return not importlib.metadata.entry_points(group="jax_plugins")


def user_set_malloc(env: MutableMapping[str, str]) -> bool:
    return "glibc.malloc." in env.get("GLIBC_TUNABLES", "") or any(k.startswith("MALLOC_") for k in env)


def _glibc_mallopt():
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl and macOS have other mallocs
        return libc.mallopt
    except (OSError, AttributeError):
        return None


def configure_cpu(env: MutableMapping[str, str] | None = None) -> list[str]:
    """Apply the CPU settings once per process (later calls return the first call's answer): what was applied."""
    global _applied
    if _applied is not None:
        return _applied
    env = os.environ if env is None else env
    applied: list[str] = []
    if env.get("GLM46_JAX_CPU_TUNING", "1") != "0" and runs_on_cpu(env):
        mallopt = _glibc_mallopt()
        if mallopt is not None and not user_set_malloc(env):
            ok = all(mallopt(p, v) == 1 for p, v in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0),
                                                     (_M_TRIM_THRESHOLD, 2**31 - 1)))
            if ok:
                applied.append("malloc: arena_max=1 mmap_max=0 trim_threshold=2GiB")
    _applied = applied
    return applied

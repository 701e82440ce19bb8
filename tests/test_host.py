"""glm46_jax.host: the CPU start-up settings (docs/performance.md#cpu-host-settings)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from glm46_jax import host

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))


@pytest.mark.parametrize("env, on_cpu", [({"JAX_PLATFORMS": "cpu"}, True), ({"JAX_PLATFORMS": "cuda"}, False),
                                         ({"JAX_PLATFORMS": "cuda,cpu"}, False), ({"JAX_PLATFORMS": " cpu "}, True)])
def test_jax_platforms_decides_the_backend(env, on_cpu):
    assert host.runs_on_cpu(env) is on_cpu


@pytest.mark.parametrize("env, user_set", [({}, False), ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, True),
                                           ({"GLIBC_TUNABLES": "glibc.rtld.nns=2"}, False),
                                           ({"MALLOC_ARENA_MAX": "4"}, True)])
def test_malloc_settings_of_the_user_are_recognised(env, user_set):
    assert host.user_set_malloc(env) is user_set


# A fresh process (malloc settings must precede XLA's threads) runs a jitted function whose 512 MiB of temporaries
# XLA allocates on every call, and reports the size of glibc's main heap ([heap] in /proc/self/maps). By default
# glibc serves that from a fresh mmap per call (and page-faults all of it again each time); with the settings it
# comes from the heap and stays there for the next call. (Page-fault counts would say the same on a plain host,
# but this test must not depend on the host: a VM whose balloon pages out idle memory faults it back in anyway.)
_HEAP = """
import re
from glm46_jax import host
applied = host.configure_cpu()
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.cumsum(jnp.exp(x))[-1])
x = jnp.ones(64 * 2**20, jnp.float32)
for _ in range(3):
    f(x).block_until_ready()
heap = [int(m[1], 16) - int(m[0], 16) for m in re.findall(r"^([0-9a-f]+)-([0-9a-f]+) .*\\[heap\\]$",
                                                           open("/proc/self/maps").read(), re.M)]
print(len(applied), sum(heap))
"""


def _heap_bytes(tuning: str) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "GLIBC_TUNABLES")
           and not k.startswith("MALLOC_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, GLM46_JAX_CPU_TUNING=tuning)
    out = subprocess.run([sys.executable, "-c", _HEAP], env=env, capture_output=True, text=True, check=True)
    applied, heap = out.stdout.split()
    return int(applied), int(heap)


@pytest.mark.skipif(not sys.platform.startswith("linux") or host._glibc_mallopt() is None, reason="glibc only")
def test_xla_temporaries_come_from_the_kept_heap():
    applied, heap = _heap_bytes("1")
    off_applied, off_heap = _heap_bytes("0")
    assert applied == 1 and off_applied == 0
    assert heap >= 512 * 2**20 > off_heap, (heap, off_heap)

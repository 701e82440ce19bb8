"""LLVM -O2 for the programs of a test that mostly runs them rather than compiles them.

The suite compiles at -O0 (tests/conftest.py): most of its time is XLA compiling hundreds of small programs. A test
whose time goes into running a few programs hundreds of times (an RL or SFT run) wraps that run in `optimized()`,
and the programs compiled inside get LLVM -O2: the full-SFT run in test_sft took 837 ms/step at -O0 and 287 at -O2
(its compile 7.0 -> 9.4 s), a GRPO seed of test_rl 37.8 -> 29.8 s (2026-11-28, 2-core AMD EPYC). Neither level uses
fast-math, but their last bits can differ (below).

JAX's own setting for this, `jax_optimization_level`, is part of the persistent-cache key (through the compile
options below) but not of jit's in-memory cache, and XLA:CPU does not read it; the hook below passes it on as XLA's
`xla_backend_optimization_level` to the compiles made under it. Private API: JAX has no other way to set XLA options
for programs it compiles on the product's behalf.

The two levels round differently in the last bits (the tiny init: 15,639 of 365,952 weights differ by up to 7.5e-9),
so `optimized()` drops jax's in-memory caches on entry and on exit: otherwise a program an earlier test of the process
compiled at -O0 (the model's init, say) ran inside at -O0, and what a run computed depended on which tests ran before
it in the worker (test_rl's SFT warm-up ended at held-out accuracy 0.282 after the file's earlier tests, 0.264 when it
ran first).
"""

import contextlib
import os

import jax
from jax._src import compiler, config

LEVEL = "O2"


def _install() -> None:
    get = compiler.get_compile_options
    if getattr(get, "passes_optimization_level", False):
        return

    def get_compile_options(*args, env_options_overrides=None, **kwargs):
        if config.optimization_level.value == LEVEL:
            env_options_overrides = {"xla_backend_optimization_level": 2, **(env_options_overrides or {})}
        return get(*args, env_options_overrides=env_options_overrides, **kwargs)

    get_compile_options.passes_optimization_level = True
    compiler.get_compile_options = get_compile_options


@contextlib.contextmanager
def optimized(subprocesses: bool = False):
    """Programs compiled inside (in this thread) get LLVM -O2 instead of the suite's -O0; with `subprocesses`, so do
    the JAX processes started inside that inherit this one's XLA_FLAGS (the RLHF rounds' `python -m data_prep`)."""
    _install()
    jax.clear_caches()  # nothing compiled at -O0 before runs inside (above)
    flags = os.environ.get("XLA_FLAGS", "")
    if subprocesses:
        os.environ["XLA_FLAGS"] = flags.replace("--xla_backend_optimization_level=0",
                                                "--xla_backend_optimization_level=2")
    try:
        with config.optimization_level(LEVEL):
            yield
    finally:
        os.environ["XLA_FLAGS"] = flags
        jax.clear_caches()  # and nothing compiled at -O2 inside runs after

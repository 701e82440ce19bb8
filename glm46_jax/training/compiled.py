"""Compile once, barrier, cache: the trainer's train steps and the recipes' eval steps, each compiled ahead of time
once per segment and batch shape and kept.

    train_steps = compiled.CompileOnce("train step", while_compiling=watch.paused, after=timer.exclude)
    step = train_steps.get(segment.name, batch["inputs"].shape, lambda: recipe.steps_for(segment),
                           state, batch, controls, frozen)
    state, metrics = step(state, batch, controls, frozen)

Ahead of time (`jitted.lower(*args).compile()`) rather than jit's own cache: a batch of another shape than the one
compiled for fails loudly instead of silently compiling again. After each compile every process meets at a barrier
(`distributed.barrier`: a program's first collective must not wait on another process still compiling).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable
from typing import Any

from absl import logging

from glm46_jax.parallel import distributed


class CompileOnce:
    """Programs of one kind (`what`: "train step", "eval step"), compiled by the first `get` of each (segment name,
    batch shape) and kept. `while_compiling(label)` is entered around each compile and barrier (the trainer pauses
    its hang watchdog); `after(seconds)` is told each compile's time (the trainer keeps it out of step time)."""

    def __init__(self, what: str, *,
                 while_compiling: Callable[[str], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 after: Callable[[float], Any] = lambda seconds: None):
        self.what, self.while_compiling, self.after = what, while_compiling, after
        self.programs: dict[tuple[str, Hashable], Any] = {}
        self.seconds = 0.0  # every compile so far, barriers included

    def get(self, name: str, shape: Hashable, jitted: Callable[[], Any], *args: Any) -> Any:
        """The program for (`name`, `shape`); the first call compiles `jitted()` for `args` (`jitted` builds or
        returns the jitted function, so a cached program costs no tracing)."""
        key = (name, shape)
        if key not in self.programs:
            t0 = time.perf_counter()
            with self.while_compiling(f"compiling {name}"):  # a compile is not a hang
                self.programs[key] = jitted().lower(*args).compile()
                distributed.barrier(f"compiled {name} {self.what}")  # before its first collective
            seconds = time.perf_counter() - t0
            self.seconds += seconds
            self.after(seconds)
            logging.info("%s: compiled the %s for batch %s in %.1f s", name, self.what, shape, seconds)
        return self.programs[key]

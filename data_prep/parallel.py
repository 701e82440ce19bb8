"""Ordered parallel map over a process pool, with a tqdm bar; `workers <= 1` runs in-process.

Results always come back in input order, so every stage's output is identical for any worker count.
Pools use the "spawn" start method: forking a parent that has imported a multithreaded library
(tokenizers' Rust pool, or jax in a test process) can deadlock the child.
"""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")
R = TypeVar("R")


def _call(fn: Callable[..., R], extra: tuple, item: Any) -> R:
    return fn(item, *extra)


def imap(fn: Callable[..., R], items: Sequence[T], workers: int, desc: str, extra: tuple = (),
         initializer: Callable[..., None] | None = None, initargs: tuple = ()) -> Iterator[R]:
    """Yields `fn(item, *extra)` for each item, in order. `fn` and `initializer` must be module-level."""
    bar = tqdm(total=len(items), desc=desc, unit="task", disable=None, leave=False)
    try:
        if workers <= 1 or len(items) <= 1:
            if initializer is not None:
                initializer(*initargs)
            for item in items:
                yield fn(item, *extra)
                bar.update()
            return
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(min(workers, len(items)), initializer=initializer, initargs=initargs) as pool:
            for result in pool.imap(functools.partial(_call, fn, extra), items, chunksize=1):
                yield result
                bar.update()
    finally:
        bar.close()


def chunked(items: Sequence[T], num_chunks: int) -> list[Sequence[T]]:
    """`items` cut into at most `num_chunks` contiguous, nearly equal slices (none empty)."""
    num_chunks = max(1, min(num_chunks, len(items)))
    bounds = [len(items) * k // num_chunks for k in range(num_chunks + 1)]
    return [items[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def map_chunks(fn: Callable[..., R], items: Sequence[T], workers: int, desc: str, extra: tuple = (),
               chunks_per_worker: int = 4) -> list[R]:
    """`[fn(chunk, *extra) for chunk in chunks]` over contiguous chunks of `items`, in order."""
    if not items:
        return []
    return list(imap(fn, chunked(items, max(1, workers) * chunks_per_worker), workers, desc, extra))

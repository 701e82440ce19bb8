"""Tokens per second the Grain loader delivers, per pack mode and sequence length, from a prepared corpus.

    PYTHONPATH=. python benchmarks/data_loader.py --root data/sample [--workers 0 2] [--batches 50]

Rows come from `loader.training_batches` exactly as `train` reads them (mixture, packing, shift,
batching), after a warm-up batch; no device copy. Compare the figures with the training step's
consumption (`python -m glm46_jax.bench`): a loader that delivers more tokens/s than the step
consumes never starves it. Shapes: the tiny preset (16 x 128, 16 x 256) and the small preset's
4096-token rows (a batch of 8 rows per process, as one data-parallel host would read).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from absl import flags

from glm46_jax.data.loader import LoaderConfig, training_batches
from glm46_jax.bench import git_commit

SHAPES = (  # (name, seq_len, rows, pack)
    ("tiny general", 128, 16, "concat"),
    ("tiny code_long", 256, 16, "best_fit"),
    ("small general", 4096, 8, "concat"),
    ("small best_fit", 4096, 8, "best_fit"),
)


def measure(root: str, seq_len: int, rows: int, pack: str, workers: int, batches: int) -> float:
    cfg = LoaderConfig(root=root, num_workers=workers, read_threads=2)
    it = iter(training_batches(cfg, {"code": 0.5, "prose": 0.5}, seq_len, rows, pack))
    next(it)  # warm-up: pipeline start (and worker spawn)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    seconds = time.perf_counter() - t0
    if hasattr(it, "close"):
        it.close()
    return rows * seq_len * batches / seconds


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="data/sample")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--batches", type=int, default=50)
    args = p.parse_args()
    flags.FLAGS.mark_as_parsed()  # grain's mp_prefetch reads absl flags
    commit = git_commit()
    print(f"device: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; commit {commit}")
    print(f"{'shape':<16} {'seq':>6} {'rows':>5} {'pack':<9} {'workers':>7} {'tokens/s':>12}")
    results = []
    for name, seq_len, rows, pack in SHAPES:
        for workers in args.workers:
            tps = measure(args.root, seq_len, rows, pack, workers, args.batches)
            results.append(dict(shape=name, seq_len=seq_len, rows=rows, pack=pack, workers=workers, tokens_per_s=tps))
            print(f"{name:<16} {seq_len:>6} {rows:>5} {pack:<9} {workers:>7} {tps:>12,.0f}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()

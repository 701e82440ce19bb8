"""Pipeline stages on 8 CPU devices: step time at pipeline 1 / 2 / 4 for one global batch, against the bubble.

    PYTHONPATH=. python benchmarks/pipeline.py              # table + one JSON line
    PYTHONPATH=. python benchmarks/pipeline.py --quick      # fewer rounds, smaller compile sweep

Each configuration times a jitted `value_and_grad` of the training loss (`loss.loss_fn`: forward, MTP, aux loss,
backward) of a GLM-shaped tiny model on the same global batch: pipeline 1 is (data 8), pipeline S is
(data 8/S, pipeline S) with M = 4 S micro-batches (GPipe, R = 1) and, where the layers allow, the circular
schedule with R = 2. The configurations run in turns for `--rounds` rounds (the 2-core box is shared:
taking turns exposes each to the same background load) and each time is the median over rounds.

What "the bubble formula" predicts here (docs/pipeline.md#benchmark): in one SPMD program every stage computes
on every one of the R M + S - 1 iterations, idle ones included, and the 8 virtual CPU devices share the same
cores, so the bubble shows up as extra work, not idle time: the pipelined trunk costs (R M + S - 1) / (R M)
times the unpipelined one, times slots / layers for identity padding. The measured overhead is
t(pipeline S) / t(pipeline 1); the goal is within 1.2x of that prediction at M = 4 S.
Compile time is measured for pipeline 2 as the MoE stack grows (lax.scan keeps it flat in depth).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

# 8 virtual CPU devices, set before jax initialises its backends.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

from glm46_jax.config import TINY
from glm46_jax.model import init_model, pipeline
from glm46_jax.parallel import sharding
from glm46_jax.bench import git_commit
from glm46_jax.training.loss import loss_fn

CFG = TINY.replace(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=9,
                   remat="full")


def _step(cfg, mesh_shape, batch):
    """(compiled grad step, its arguments, compile seconds) for `cfg` on a mesh of `mesh_shape`."""
    mesh = sharding.make_mesh(mesh_shape, cfg=cfg, global_batch=batch["inputs"].shape[0])
    with sharding.use_mesh(mesh):
        graphdef, params, buffers = init_model(cfg, mesh, 0)
        put = {k: jax.device_put(v, jax.NamedSharding(mesh, sharding.logical("batch", None))) for k, v in batch.items()}
        fn = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, buffers, b, graphdef, cfg), has_aux=True))
        start = time.perf_counter()
        compiled = fn.lower(params, put).compile()
        seconds = time.perf_counter() - start
    return mesh, compiled, (params, put), seconds


def _time(mesh, compiled, args) -> float:
    with sharding.use_mesh(mesh):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rounds = 3 if args.quick else args.rounds
    x = np.random.default_rng(0).integers(2, CFG.vocab_size, (args.batch, args.seq + 1)).astype(np.int32)
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:]}

    configs = {"pipeline 1": (CFG, {"data": 8}, None)}
    for s in (2, 4):
        for r in (1, 2):
            if CFG.num_moe_layers >= s * r:
                cfg = CFG.replace(pipeline_microbatches=4 * s, pipeline_repeats=r)
                configs[f"pipeline {s} R={r} M={4 * s}"] = (cfg, {"data": 8 // s, "pipeline": s},
                                                           pipeline.layout(cfg, s))
    built = {name: _step(cfg, shape, batch) for name, (cfg, shape, _) in configs.items()}
    for name, (mesh, compiled, step_args, _) in built.items():
        _time(mesh, compiled, step_args)  # warm-up
    times = {name: [] for name in built}
    for _ in range(rounds):
        for name, (mesh, compiled, step_args, _) in built.items():
            times[name].append(_time(mesh, compiled, step_args))

    base = statistics.median(times["pipeline 1"])
    rows = []
    print(f"tiny GLM (hidden {CFG.hidden_size}, {CFG.num_dense_layers} dense + {CFG.num_moe_layers} MoE layers, "
          f"remat {CFG.remat}), global batch {args.batch} x {args.seq}, 8 CPU devices, median of {rounds} rounds")
    print(f"{'config':26}{'step ms':>10}{'compile s':>11}{'bubble':>9}{'predicted':>11}{'measured':>10}{'ratio':>8}")
    for name, (cfg, _, lay) in configs.items():
        t = statistics.median(times[name])
        if lay is None:
            bubble, predicted = 0.0, 1.0
        else:
            m = cfg.pipeline_microbatches
            bubble = lay.bubble(m)
            predicted = (lay.repeats * m + lay.stages - 1) / (lay.repeats * m) * lay.slots / lay.layers
        measured = t / base
        rows.append({"config": name, "step_ms": 1e3 * t, "compile_s": built[name][3], "bubble": bubble,
                     "predicted_overhead": predicted, "measured_overhead": measured, "ratio": measured / predicted})
        print(f"{name:26}{1e3 * t:>10.1f}{built[name][3]:>11.1f}{100 * bubble:>8.1f}%{predicted:>11.3f}"
              f"{measured:>10.3f}{measured / predicted:>8.2f}")

    compile_rows = []
    for moe_layers in ((4, 8) if args.quick else (4, 8, 16, 32)):
        cfg = CFG.replace(num_hidden_layers=moe_layers + 1, pipeline_microbatches=8)
        seconds = _step(cfg, {"data": 4, "pipeline": 2}, batch)[3]
        compile_rows.append({"moe_layers": moe_layers, "compile_s": seconds})
        print(f"compile, pipeline 2, {moe_layers:3d} MoE layers: {seconds:.1f} s")
    print(json.dumps({"benchmark": "pipeline", "commit": git_commit(), "rows": rows, "compile": compile_rows,
                      "devices": [str(d) for d in jax.devices()][:1] + [f"x{len(jax.devices())}"]}))


if __name__ == "__main__":
    main()

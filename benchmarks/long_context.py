"""Attention alone at long sequence lengths: dense (`attention_impl="xla"`) vs blockwise, forward + backward.

    PYTHONPATH=. python benchmarks/long_context.py                       # 1K..32K, the tiny preset's heads
    PYTHONPATH=. python benchmarks/long_context.py --seq-lens=4096,16384 --repeats=3

For each length: one jitted function computing the attention output and the q/k/v gradients of
<attention(q, k, v), dout> on one device, causal, one row (`--batch`). Reported per implementation:

- compiled memory from XLA's memory analysis (nothing has to run): scratch (`temp_size_in_bytes`) and
  peak = arguments + outputs + scratch;
- tokens/s = batch * seq / the fastest of `--repeats` timed calls after one warm-up (the fastest, because the
  CPU box is shared), and GFLOP/s with causal attention's 6 * seq^2 * heads * head_dim FLOPs for forward +
  backward (the convention of `glm46_jax.counting.flops_per_token`; the blockwise backward's recomputation of
  the scores is not counted).

The dense path is only run where its compiled scratch fits `--max-run-gib` (its memory is still reported).
Context parallelism (a query shard per device against gathered K/V, `--context`) comes with issue 15's
second part; this script is single device. The memory goal: blockwise at 16K <= 1/10 of the dense path.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from glm46_jax.bench import git_commit
from glm46_jax.config import TINY
from glm46_jax.model.attention import _xla_attention, attention_mask
from glm46_jax.model.blockwise_attention import blockwise_attention

GIB = 2 ** 30


def fwd_bwd(attend):
    def f(q, k, v, dout):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(dout))
    return jax.jit(f)


def measure(name, attend, shapes, repeats, max_run_bytes, seed=0):
    q, kv = shapes
    compiled = fwd_bwd(attend).lower(q, kv, kv, q).compile()
    mem = compiled.memory_analysis()
    row = {"impl": name, "temp_bytes": mem.temp_size_in_bytes,
           "peak_bytes": mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes,
           "seconds": None}
    if mem.temp_size_in_bytes > max_run_bytes:
        return row
    rng = np.random.default_rng(seed)
    args = [jnp.asarray(rng.normal(size=s.shape), s.dtype) for s in (q, kv, kv, q)]
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    row["seconds"] = min(times)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", default="1024,2048,4096,8192,16384,32768")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=TINY.num_attention_heads)
    p.add_argument("--kv-heads", type=int, default=TINY.num_key_value_heads)
    p.add_argument("--head-dim", type=int, default=TINY.head_dim)
    p.add_argument("--block-q", type=int, default=TINY.attention_block_q)
    p.add_argument("--block-kv", type=int, default=TINY.attention_block_kv)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-run-gib", type=float, default=4.0, help="run the dense path only below this scratch")
    args = p.parse_args(argv)

    dt, c = jnp.dtype(args.dtype), args.head_dim
    rows = []
    for s in (int(x) for x in args.seq_lens.split(",")):
        shapes = (jax.ShapeDtypeStruct((args.batch, s, args.heads, c), dt),
                  jax.ShapeDtypeStruct((args.batch, s, args.kv_heads, c), dt))
        mask = attention_mask(None, s)
        impls = {
            "xla": lambda q, k, v, mask=mask: _xla_attention(q, k, v, mask, c ** -0.5),
            "blockwise": lambda q, k, v: blockwise_attention(q, k, v, block_q=args.block_q, block_kv=args.block_kv),
        }
        for name, attend in impls.items():
            row = {"seq": s, **measure(name, attend, shapes, args.repeats, args.max_run_gib * GIB)}
            flops = 6 * args.batch * s * s * args.heads * c
            row["tokens_per_s"] = None if row["seconds"] is None else args.batch * s / row["seconds"]
            row["gflop_per_s"] = None if row["seconds"] is None else flops / row["seconds"] / 1e9
            rows.append(row)
            print(json.dumps(row), flush=True)

    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()}, {os.cpu_count()} CPUs)"
    print(f"\nattention fwd+bwd, batch {args.batch}, {args.heads} heads / {args.kv_heads} kv heads x {c}, "
          f"{args.dtype}, blocks {args.block_q}x{args.block_kv}; device {device}; commit {git_commit()}")
    print("| seq | impl | scratch | peak | tokens/s | GFLOP/s | scratch vs xla |\n|---|---|---|---|---|---|---|")
    dense = {r["seq"]: r["temp_bytes"] for r in rows if r["impl"] == "xla"}
    for r in rows:
        speed = "not run" if r["seconds"] is None else f"{r['tokens_per_s']:,.0f}"
        gflops = "-" if r["seconds"] is None else f"{r['gflop_per_s']:.1f}"
        ratio = f"{r['temp_bytes'] / dense[r['seq']]:.4f}"
        print(f"| {r['seq']:,} | {r['impl']} | {r['temp_bytes'] / 2**20:,.1f} MiB | {r['peak_bytes'] / 2**20:,.1f} MiB "
              f"| {speed} | {gflops} | {ratio} |")
    return 0


if __name__ == "__main__":
    main()

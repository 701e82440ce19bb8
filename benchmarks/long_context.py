"""Attention alone at long sequence lengths: dense (`attention_impl="xla"`) vs blockwise, forward + backward.

    PYTHONPATH=. python benchmarks/long_context.py                       # 1K..32K, the tiny preset's heads
    PYTHONPATH=. python benchmarks/long_context.py --seq-lens=4096,16384 --repeats=3
    PYTHONPATH=. python benchmarks/long_context.py --context=1,2,4,8 --impls=blockwise   # context parallelism

For each length: one jitted function computing the attention output and the q/k/v gradients of
<attention(q, k, v), dout> on one device, causal, one row (`--batch`). Reported per implementation:

- compiled memory from XLA's memory analysis (nothing has to run): scratch (`temp_size_in_bytes`) and
  peak = arguments + outputs + scratch;
- tokens/s = batch * seq / the fastest of `--repeats` timed calls after one warm-up (the fastest, because the
  CPU box is shared), and GFLOP/s with causal attention's 6 * seq^2 * heads * head_dim FLOPs for forward +
  backward (the convention of `glm46_jax.model.counting.flops_per_token`; the blockwise backward's recomputation of
  the scores is not counted).

The dense path is only run where its compiled scratch fits `--max-run-gib` (its memory is still reported).

`--context C1,C2,...`: blockwise attention with the sequence split over a `context` mesh axis of C devices
(`context_parallel_attention`: each device's queries, in the load-balanced layout, against the K/V gathered
from all C), one row per C > 1; memory is per device (XLA's analysis of the SPMD program). On CPU the C
devices are virtual (`--xla_force_host_platform_device_count`, set here before jax starts) and share the
host's cores, so their tokens/s shows the overhead of the split, not a speed-up; the memory column is what
a real device would hold. The memory goal: blockwise at 16K <= 1/10 of the dense path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

if "--context" in " ".join(sys.argv) and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from glm46_jax.config import TINY  # noqa: E402
from glm46_jax.model.attention import _xla_attention, attention_mask, context_parallel_attention  # noqa: E402
from glm46_jax.model.blockwise_attention import blockwise_attention  # noqa: E402
from glm46_jax.parallel import sharding  # noqa: E402
from glm46_jax.bench import git_commit  # noqa: E402

GIB = 2 ** 30


def fwd_bwd(attend):
    def f(q, k, v, dout):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(dout))
    return jax.jit(f)


def measure(name, attend, shapes, repeats, max_run_bytes, seed=0, mesh=None):
    q, kv = shapes
    if mesh is not None:  # laid out as the model's activations: the sequence over `context`
        q_sh, kv_sh = (jax.NamedSharding(mesh, sharding.logical("batch", "seq", heads, None))
                       for heads in ("heads", "kv_heads"))
        q, kv = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a, sh in ((q, q_sh), (kv, kv_sh)))
    compiled = fwd_bwd(attend).lower(q, kv, kv, q).compile()
    mem = compiled.memory_analysis()
    row = {"impl": name, "temp_bytes": mem.temp_size_in_bytes,
           "peak_bytes": mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes,
           "seconds": None}
    if mem.temp_size_in_bytes > max_run_bytes:
        return row
    rng = np.random.default_rng(seed)
    args = [jax.device_put(jnp.asarray(rng.normal(size=s.shape), s.dtype), getattr(s, "sharding", None))
            for s in (q, kv, kv, q)]
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
    p.add_argument("--impls", default="xla,blockwise", help="single-device implementations to run")
    p.add_argument("--context", default="1", help="context axis sizes for blockwise attention (1 = one device)")
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
        runs = [(name, impls[name], None) for name in args.impls.split(",")]
        for ctx in (int(x) for x in args.context.split(",")):
            if ctx > 1:
                runs.append((f"blockwise, context {ctx}", _context_attention(s, ctx, c, args), _context_mesh(ctx)))
        for name, attend, mesh in runs:
            with sharding.use_mesh(mesh) if mesh is not None else contextlib.nullcontext():
                row = {"seq": s, **measure(name, attend, shapes, args.repeats, args.max_run_gib * GIB, mesh=mesh)}
            flops = 6 * args.batch * s * s * args.heads * c
            row["tokens_per_s"] = None if row["seconds"] is None else args.batch * s / row["seconds"]
            row["gflop_per_s"] = None if row["seconds"] is None else flops / row["seconds"] / 1e9
            rows.append(row)
            print(json.dumps(row), flush=True)

    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()}, {os.cpu_count()} CPUs)"
    print(f"\nattention fwd+bwd, batch {args.batch}, {args.heads} heads / {args.kv_heads} kv heads x {c}, "
          f"{args.dtype}, blocks {args.block_q}x{args.block_kv}; device {device}; commit {git_commit()}")
    if any(r["impl"].startswith("blockwise, context") for r in rows):
        print("context rows: scratch and peak per device; the devices are virtual and share the CPU's cores")
    print("| seq | impl | scratch | peak | tokens/s | GFLOP/s | scratch vs xla |\n|---|---|---|---|---|---|---|")
    dense = {r["seq"]: r["temp_bytes"] for r in rows if r["impl"] == "xla"}
    for r in rows:
        speed = "not run" if r["seconds"] is None else f"{r['tokens_per_s']:,.0f}"
        gflops = "-" if r["seconds"] is None else f"{r['gflop_per_s']:.1f}"
        ratio = f"{r['temp_bytes'] / dense[r['seq']]:.4f}" if r["seq"] in dense else "-"
        print(f"| {r['seq']:,} | {r['impl']} | {r['temp_bytes'] / 2**20:,.1f} MiB | {r['peak_bytes'] / 2**20:,.1f} MiB "
              f"| {speed} | {gflops} | {ratio} |")
    return 0


def _context_mesh(context: int):
    if context > len(jax.devices()):
        raise SystemExit(f"error: --context {context} needs {context} devices, {len(jax.devices())} present")
    return sharding.make_mesh({"context": context}, jax.devices()[:context])


def _context_attention(seq: int, context: int, head_dim: int, args):
    """Blockwise attention over a `context` mesh: the row in the load-balanced layout, positions saying where
    each slot came from, K/V gathered per device (as the model does on a context mesh)."""
    positions = jnp.asarray(sharding.load_balanced_order(seq, context))

    def attend(q, k, v):
        return context_parallel_attention(q, k, v, q_positions=positions, k_positions=positions, q_segment_ids=None,
                                          k_segment_ids=None, scale=head_dim ** -0.5, block_q=args.block_q,
                                          block_kv=args.block_kv)
    return attend


if __name__ == "__main__":
    main()

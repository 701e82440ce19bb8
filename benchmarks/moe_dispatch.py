"""MoE layer vs a dense FFN of the same active FLOPs vs plain `ragged_dot`: forward + backward on one device.

    PYTHONPATH=. python benchmarks/moe_dispatch.py            # table + one JSON line
    PYTHONPATH=. python benchmarks/moe_dispatch.py --out      # also appends a section to benchmarks/RESULTS.md

Three layers on the same tokens, each timed as a jitted `jax.grad` of <layer(x), g> w.r.t. x and every weight:

  (a) moe:    the real routed path, called directly (no mesh, no shard_map): `moe.route` (sigmoid +
              correction bias + top-k) -> `experts.local_experts` + one shared SwiGLU expert. Dropless (the
              default: expert-sorted rows padded to whole blocks, a loop over the used blocks) and at each
              `--capacity-factors` value (capacity-padded batched einsum, drops past capacity).
  (b) dense:  one SwiGLU FFN of width (k + n_shared) * expert_ffn: the same matmul FLOPs as (a) at capacity
              factor 1.0, router excluded (its 2*d*E per token is in (a)'s FLOP column; ~1% here).
  (c) ragged: the same router and shared expert, routed experts as plain `jax.lax.ragged_dot` over the
              assignments sorted by expert (dropless, no capacity).

The goal is dropless (a)/(b) <= 1.3 on CPU. (a) and (b) run in turns for `--repeats` rounds after `--warmup`
calls, and each ratio is the median over rounds of (a)/(b) from the same round: the 2-core box is shared, so
taking turns exposes both to the same background load. (c) is slow and gets `--slow-repeats` calls.
Process CPU time is reported next to wall time; it moves less when another job takes a core.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp

from glm46_jax.config import TINY
from glm46_jax.model.experts import block_layout, expert_capacity, local_experts
from glm46_jax.model.moe import route
from glm46_jax.bench import git_commit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")


def swiglu(x, wg, wu, wd):
    return jnp.einsum("nf,fd->nd", jax.nn.silu(x @ wg) * (x @ wu), wd)


def moe_layer(params, x, cfg):
    idx, weights, _ = route(x, params["router"], params["bias"], cfg)
    y, _ = local_experts(x, idx, weights, params["wg"], params["wu"], params["wd"], cfg)
    return y + swiglu(x, params["sg"], params["su"], params["sd"])


def ragged_layer(params, x, cfg):
    idx, weights, _ = route(x, params["router"], params["bias"], cfg)
    k = idx.shape[1]
    e = params["wg"].shape[0]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[order // k]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, params["wg"], sizes)) * jax.lax.ragged_dot(xs, params["wu"], sizes)
    ys = jax.lax.ragged_dot(h, params["wd"], sizes) * weights.reshape(-1)[order][:, None]
    y = jnp.zeros_like(x).at[order // k].add(ys)
    return y + swiglu(x, params["sg"], params["su"], params["sd"])


def dense_layer(params, x):
    return swiglu(x, params["wg"], params["wu"], params["wd"])


def grad_fn(layer):
    """jit(grad) of <layer(x), g> w.r.t. (params, x): a fixed random cotangent, so nothing is trivial."""
    def loss(params, x, g):
        return jnp.vdot(layer(params, x), g)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def time_interleaved(fns: dict, warmup: int, repeats: int) -> dict[str, dict]:
    """Median wall and process-CPU ms per call, taking the candidates in turn in every round.

    The 2-core box is shared: taking turns exposes every candidate to the same background load, and
    the CPU time (both cores' seconds) moves less than the wall time when another job takes a core.
    """
    out = {}
    for name, (fn, args) in fns.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out[name] = {"first_call_s": time.perf_counter() - t0, "wall": [], "cpu": []}
        for _ in range(warmup - 1):
            jax.block_until_ready(fn(*args))
    for _ in range(repeats):
        for name, (fn, args) in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*args))
            out[name]["wall"].append(time.perf_counter() - t0)
            out[name]["cpu"].append(time.process_time() - c0)
    return out


def _summary(r: dict) -> dict:
    return {"median_ms": 1e3 * statistics.median(r["wall"]), "min_ms": 1e3 * min(r["wall"]),
            "cpu_median_ms": 1e3 * statistics.median(r["cpu"]), "first_call_s": r["first_call_s"],
            "repeats": len(r["wall"])}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--expert-ffn", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--shared", type=int, default=1, help="shared experts (each expert_ffn wide)")
    p.add_argument("--capacity-factors", default="1.0,1.25")
    p.add_argument("--block", type=int, default=TINY.moe_block_size, help="dropless rows per block")
    p.add_argument("--no-ragged", action="store_true", help="skip (c), the slow plain ragged_dot run")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--slow-repeats", type=int, default=2, help="repeats for ragged_dot")
    p.add_argument("--router-bias-std", type=float, default=0.0,
                   help="random expert-bias spread; 0 = the balanced state loss-free balancing aims at")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", action="store_true", help=f"append a Markdown section to {RESULTS}")
    args = p.parse_args(argv)

    n, d, e, f, k, s = args.tokens, args.d_model, args.experts, args.expert_ffn, args.top_k, args.shared
    dt = jnp.dtype(args.dtype)
    cfg = TINY.replace(hidden_size=d, n_routed_experts=e, moe_intermediate_size=f, num_experts_per_tok=k,
                       n_shared_experts=s, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                       moe_block_size=args.block)
    dense_ffn = (k + s) * f

    keys = iter(jax.random.split(jax.random.key(args.seed), 16))
    normal = lambda shape, scale: (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dt)
    x = normal((n, d), 1.0)
    g = normal((n, d), 1.0)
    moe_params = {
        "router": normal((d, e), d ** -0.5), "bias": normal((e,), args.router_bias_std),
        "wg": normal((e, d, f), d ** -0.5), "wu": normal((e, d, f), d ** -0.5), "wd": normal((e, f, d), f ** -0.5),
        "sg": normal((d, s * f), d ** -0.5), "su": normal((d, s * f), d ** -0.5), "sd": normal((s * f, d), f ** -0.5),
    }
    dense_params = {"wg": normal((d, dense_ffn), d ** -0.5), "wu": normal((d, dense_ffn), d ** -0.5),
                    "wd": normal((dense_ffn, d), dense_ffn ** -0.5)}

    idx, _, _ = jax.jit(partial(route, cfg=cfg))(x, moe_params["router"], moe_params["bias"])
    load = jnp.bincount(idx.reshape(-1), length=e)

    # (a) dropless and at each capacity factor, and (b), timed in turns; (c) is slow: a few calls after.
    settings = [("moe dropless", 0.0)] + [(f"moe cf={float(c):g}", float(c))
                                          for c in args.capacity_factors.split(",") if c]
    fast_fns = {"dense": (grad_fn(dense_layer), (dense_params, x, g))}
    slow_fns = {}
    # Forward matmul FLOPs per token (the backward is 2x that for every layer alike); MoE rows include the
    # router's 2*d*E and the padding: E*C/n slots per token instead of k with a capacity, the block padding
    # dropless (rows in used blocks / n).
    meta: dict[str, dict] = {"dense": {"flops_per_token": 6 * d * dense_ffn}}
    for name, cf in settings:
        layer_cfg = cfg.replace(moe_capacity_factor=cf)
        fast_fns[name] = (grad_fn(partial(moe_layer, cfg=layer_cfg)), (moe_params, x, g))
        if cf > 0:
            capacity = expert_capacity(n, layer_cfg)
            rows, kept = e * capacity, int(jnp.minimum(load, capacity).sum())
        else:
            capacity, kept = "-", n * k
            rows = int(block_layout(idx, e, 0, args.block).used) * args.block
        meta[name] = {"capacity_factor": cf, "capacity": capacity, "dropped_frac": 1 - kept / (n * k),
                      "flops_per_token": 6 * d * f * (rows / n + s) + 2 * d * e}
    if not args.no_ragged:
        slow_fns["ragged_dot"] = (grad_fn(partial(ragged_layer, cfg=cfg)), (moe_params, x, g))
        meta["ragged_dot"] = {"flops_per_token": 6 * d * f * (k + s) + 2 * d * e}

    raw = time_interleaved(fast_fns, args.warmup, args.repeats)
    results = {name: {**_summary(r), **meta[name]} for name, r in raw.items()}
    for name, r in raw.items():  # per-round ratios: each round's dense call ran next to it
        results[name]["ratio_to_dense"] = statistics.median(a / b for a, b in zip(r["wall"], raw["dense"]["wall"]))
        results[name]["cpu_ratio_to_dense"] = statistics.median(r["cpu"]) / statistics.median(raw["dense"]["cpu"])
    if slow_fns:  # a few calls each, against the dense median of the main rounds
        for name, r in time_interleaved(slow_fns, 1, args.slow_repeats).items():
            results[name] = {**_summary(r), **meta[name]}
            results[name]["ratio_to_dense"] = results[name]["median_ms"] / results["dense"]["median_ms"]
            results[name]["cpu_ratio_to_dense"] = results[name]["cpu_median_ms"] / results["dense"]["cpu_median_ms"]

    info = {
        "benchmark": "moe_dispatch", "device": jax.devices()[0].device_kind, "cpu": cpu_model(),
        "cores": os.cpu_count(), "jax": jax.__version__, "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "shapes": {"tokens": n, "d_model": d, "experts": e, "expert_ffn": f, "top_k": k, "shared": s,
                   "dense_ffn": dense_ffn, "dtype": args.dtype},
        "max_expert_load_over_mean": float(load.max() / (n * k / e)),
        "results": results,
    }

    info["ratios"] = {name: round(r["ratio_to_dense"], 3) for name, r in results.items() if name != "dense"}
    print(f"{info['cpu']} ({info['cores']} cores), jax {info['jax']}, {dt.name}; tokens={n} d={d} E={e} "
          f"f={f} k={k} shared={s} dense_ffn={dense_ffn}; max expert load = "
          f"{info['max_expert_load_over_mean']:.2f} x mean")
    print(f"{'layer':<14}{'capacity':>9}{'dropped':>9}{'MFLOP/tok fwd':>15}{'wall ms':>10}{'/ dense':>9}"
          f"{'cpu ms':>10}{'/ dense':>9}")
    for name, r in results.items():
        cap = str(r.get("capacity", "-"))
        drop = f"{100 * r['dropped_frac']:.1f}%" if "dropped_frac" in r else "-"
        print(f"{name:<14}{cap:>9}{drop:>9}{r['flops_per_token'] / 1e6:>15.2f}{r['median_ms']:>10.1f}"
              f"{r['ratio_to_dense']:>9.2f}{r['cpu_median_ms']:>10.1f}{r['cpu_ratio_to_dense']:>9.2f}")
    print(json.dumps(info))

    if args.out:
        with open(RESULTS, "a") as fh:
            fh.write(_markdown(info, argv))
        print(f"appended to {RESULTS}")
    return info


def _markdown(info: dict, argv) -> str:
    sh = info["shapes"]
    env = "".join(f"{v}={shlex.quote(os.environ[v])} " for v in ("GLIBC_TUNABLES", "XLA_FLAGS") if os.environ.get(v))
    cmd = f"{env}PYTHONPATH=. python benchmarks/moe_dispatch.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    lines = [
        "",
        f"## MoE dispatch vs dense FFN (`benchmarks/moe_dispatch.py`), {info['date']}",
        "",
        (f"- device: {info['cpu']}, {info['cores']} cores ({info['device']}), jax {info['jax']}, commit "
         f"{info['commit']}"),
        f"- command: `{cmd.strip()}`",
        (f"- shapes: {sh['tokens']} tokens, d_model {sh['d_model']}, {sh['experts']} experts x ffn "
         f"{sh['expert_ffn']}, top-{sh['top_k']}, {sh['shared']} shared expert; dense ffn {sh['dense_ffn']} "
         f"= (k + shared) x expert ffn; {sh['dtype']}; max expert load {info['max_expert_load_over_mean']:.2f}x "
         "the mean"),
        ("- forward + backward (`jax.grad` of <layer(x), g> w.r.t. x and every weight), jitted; median of the "
         "repeats after warm-up, the candidates timed in turns. `/ dense` is the median over rounds of "
         "(this call / that round's dense call); `cpu` is process CPU time (both cores). The dense FFN has "
         "the MoE's matmul FLOPs at capacity factor 1.0, router excluded (it is the 2*d*E in the MoE rows)."),
        "",
        "| layer | capacity | dropped | fwd MFLOP/token | fwd+bwd wall ms | / dense | cpu ms | / dense (cpu) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in info["results"].items():
        drop = f"{100 * r['dropped_frac']:.1f}%" if "dropped_frac" in r else "-"
        lines.append(f"| {name} | {r.get('capacity', '-')} | {drop} | {r['flops_per_token'] / 1e6:.2f} | "
                     f"{r['median_ms']:.1f} | {r['ratio_to_dense']:.2f} | {r['cpu_median_ms']:.1f} | "
                     f"{r['cpu_ratio_to_dense']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

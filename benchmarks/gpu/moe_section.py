"""The MoE layer alone, per implementation, against a dense FFN of the same active FLOPs; and XLA flag sets A/B.

Forward + backward (the grad of <layer(x), g> w.r.t. x and every weight) of the model's MoE block (router, dropless
routed experts, shared expert) per `model.moe_impl` ("loop": the dropless block loop; "grouped": one grouped GEMM
per projection; whichever the config offers), all with the SAME weights, each checked against the loop in the same
run (max |diff| of the output and of every gradient), and of one SwiGLU FFN of width (top-k + shared) x expert
width. The loop's padded rows and trip count come from the routing's expert loads (`block_layout`'s arithmetic).
`flag_ab` compiles one function under several sets of XLA compiler options and times them interleaved.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm46_jax.bench import interleave
from glm46_jax.config import ModelConfig
from glm46_jax.model.grouped_gemm import tile_padding
from glm46_jax.model.layers import MLP
from glm46_jax.model.moe import MoE
from glm46_jax.parallel import sharding


def loop_layout(load: np.ndarray, block: int, group: int) -> dict[str, int]:
    """Rows the dropless loop pads (each expert's assignments rounded up to whole blocks) and its trips (used
    blocks / blocks per trip, rounded up), from the per-expert assignment counts."""
    load = np.asarray(load, np.int64)
    blocks = int(np.sum(-(-load // block)))
    return {"assignments": int(load.sum()), "padded_rows": blocks * block - int(load.sum()), "blocks": blocks,
            "trips": -(-blocks // group)}


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return first, times


def _max_diff(a, b) -> float:
    leaves = jax.tree.leaves(jax.tree.map(lambda u, v: jnp.max(jnp.abs(u.astype(jnp.float32) - v.astype(jnp.float32))),
                                          a, b))
    return float(max(leaves)) if leaves else 0.0


def _max_abs(a) -> float:
    return float(max(jnp.max(jnp.abs(u.astype(jnp.float32))) for u in jax.tree.leaves(a)))


def moe_section(model_cfg: ModelConfig, device, batch: int, seq_len: int, repeats: int,
                flag_sets: dict[str, dict[str, Any]] | None = None, flag_rounds: int = 5,
                probe: Callable[[], Any] | None = None) -> dict[str, Any]:
    c = model_cfg.replace(moe_capacity_factor=0.0)
    d, e, f, k, s = (c.hidden_size, c.n_routed_experts, c.moe_intermediate_size, c.num_experts_per_tok,
                     c.n_shared_experts)
    mesh = sharding.make_mesh({"data": 1, "tensor": 1, "expert": 1, "pipeline": 1}, [device])
    dt = jnp.dtype(c.dtype)
    kx, kg = jax.random.split(jax.random.key(1))
    x = jax.device_put(jax.random.normal(kx, (batch, seq_len, d), dt), device)
    g = jax.device_put(jax.random.normal(kg, (batch, seq_len, d), dt), device)
    tokens = batch * seq_len
    moe_flops = 3 * (2 * 3 * d * (k + s) * f + 2 * d * e)  # fwd + bwd = 3 x fwd; the router's 2 d E counted
    dense_flops = 3 * (2 * 3 * d * (k + s) * f)
    out: dict[str, Any] = {"shapes": {"tokens": tokens, "d_model": d, "experts": e, "expert_ffn": f, "top_k": k,
                                      "shared": s, "dense_ffn": (k + s) * f, "dtype": c.dtype,
                                      "block": c.moe_block_size, "group": c.moe_block_group},
                           "impls": {}}
    with sharding.use_mesh(mesh):
        impls = ("loop", "grouped")  # model.moe_impl's two; "auto" is one of them
        layers = {name: MoE(c.replace(moe_impl=name), rngs=nnx.Rngs(0)) for name in impls}
        _, params, _ = nnx.split(layers["loop"], nnx.Param, ...)  # every implementation gets the loop's weights

        def fns(layer):
            graphdef, _, rest = nnx.split(layer, nnx.Param, ...)

            def forward(params, x):
                return nnx.merge(graphdef, params, rest)(x)

            def loss(params, x, g):
                y = forward(params, x)[0]
                return jnp.vdot(y.astype(jnp.float32), g.astype(jnp.float32))
            return jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1)))

        reference = None
        for name, layer in layers.items():
            forward, grad = fns(layer)
            row: dict[str, Any] = {}
            try:
                first, times = timed(lambda grad=grad: grad(params, x, g), repeats)
                ms = 1e3 * statistics.median(times)
                row.update(median_ms=ms, min_ms=1e3 * min(times), first_call_s=first, flops_per_token=moe_flops,
                           tflops=moe_flops * tokens / (ms / 1e3) / 1e12)
                y, aux = forward(params, x)
                grads = grad(params, x, g)
                if reference is None:
                    reference = (y, grads)
                    row.update(loop_layout(np.asarray(aux["expert_load"]), c.moe_block_size, c.moe_block_group))
                    row["output_max_abs"], row["grad_max_abs"] = _max_abs(y), _max_abs(grads)
                else:
                    row["max_abs_diff_vs_loop"] = {"output": _max_diff(y, reference[0]),
                                                   "grads": _max_diff(grads, reference[1])}
                    # the forward kernel's 128-row tiles past the routed rows (grouped_gemm.tile_padding)
                    row["padded_rows"] = int(tile_padding(jnp.asarray(aux["expert_load"])))
            except Exception as err:  # noqa: BLE001 - one implementation failing leaves the others' rows
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
            out["impls"][name] = row
        dense = MLP(c, (k + s) * f, rngs=nnx.Rngs(0))
        graphdef, dparams, rest = nnx.split(dense, nnx.Param, ...)

        def dense_loss(params, x, g):
            y = nnx.merge(graphdef, params, rest)(x)
            return jnp.vdot(y.astype(jnp.float32), g.astype(jnp.float32))
        dgrad = jax.jit(jax.grad(dense_loss, argnums=(0, 1)))
        first, times = timed(lambda: dgrad(dparams, x, g), repeats)
        ms = 1e3 * statistics.median(times)
        out["dense"] = {"median_ms": ms, "min_ms": 1e3 * min(times), "first_call_s": first,
                        "flops_per_token": dense_flops, "tflops": dense_flops * tokens / (ms / 1e3) / 1e12}
        for name, row in out["impls"].items():
            if "median_ms" in row:
                row["moe_over_dense"] = row["median_ms"] / ms
                if row.get("trips"):
                    row["per_trip_overhead_us"] = 1e3 * (row["median_ms"] - ms) / row["trips"]
        if flag_sets:
            _, loop_grad = fns(layers["loop"])
            out["flags"] = flag_ab(loop_grad, (params, x, g), flag_sets, flag_rounds, probe)
    return out


def flag_ab(fn, args: tuple, flag_sets: dict[str, dict[str, Any]], rounds: int,
            probe: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Compile jitted `fn` once per named set of XLA compiler options, then time them A, B, C, ... per round
    (`probe`, e.g. the matmul peak, timed in the same rounds; bench.interleave rotates each round's order): per set
    the median ms and the ratio to the first set's median, compile seconds."""
    lowered = fn.lower(*args)
    compiled, compile_s, texts = {}, {}, {}
    for name, options in flag_sets.items():
        t0 = time.perf_counter()
        compiled[name] = lowered.compile(compiler_options=options or None)
        compile_s[name] = time.perf_counter() - t0
        texts[name] = compiled[name].as_text()
        jax.block_until_ready(compiled[name](*args))
    calls = {name: (lambda ex=ex: jax.block_until_ready(ex(*args))) for name, ex in compiled.items()}
    if probe is not None:
        calls["matmul probe"] = probe
    times = interleave(calls, rounds)  # each round in a rotated order
    first = next(iter(flag_sets))
    base = statistics.median(times[first])
    # An option that leaves the compiled program as it was did nothing here (its timing is then noise).
    return {name: {"median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t),
                   "vs_first": statistics.median(t) / base, "compile_s": compile_s.get(name),
                   "options": flag_sets.get(name),
                   "hlo_differs_from_first": texts[name] != texts[first] if name in texts else None}
            for name, t in times.items()}

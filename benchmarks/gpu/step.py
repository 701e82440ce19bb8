"""The `small` preset's train step on one GPU: tokens/s, MFU, peak memory, a per-op profile, MoE vs dense FFN.

    bash benchmarks/gpu/run.sh                                   # on the GPU machine (installs the carried wheels)
    PYTHONPATH=. python benchmarks/gpu/step.py --out /tmp/gpu    # anywhere; without a GPU: the CPU fallback

What it runs (docs/gpu.md#what-the-gpu-benchmark-reports):
  1. the bf16 matmul peak measured on this device (8192^3, `metrics.measure_matmul_peak`);
  2. `glm46_jax.bench.bench`: the real train step of `configs/pretrain.py:<preset>` (Muon + AdamW, MTP, the
     loss-free router's bias update, dropless MoE, remat from the preset) on random tokens -> tokens/s, MFU
     against the datasheet peak (989.4 TFLOP/s on H100/H200 SXM) and against the measured peak, peak memory;
  3. a few more steps under `jax.profiler`, the trace's device ops summed per HLO op and per named scope
     (scope = the op's `op_name` metadata in the compiled HLO, e.g. moe_layers/moe/moe_dispatch/experts);
  4. the MoE layer alone (router + routed experts + shared expert) vs one SwiGLU FFN of the same active
     matmul FLOPs, forward + backward, on the step's tokens.
On a GPU: preset small, bf16, cuDNN attention when a probe compiles it (else XLA's), batch --batch x --seq-len.
Without one (the CPU fallback a test runs): preset tiny, fp32, XLA attention, a few short rows.
Writes result.json, report.md and the trace (trace.json.gz) to --out (default $OUT, else runs/gpu_bench).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import importlib.metadata
import json
import os
import re
import shutil
import statistics
import sys
import time
import traceback
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run as a script from anywhere: the package is the checkout's
    sys.path.insert(0, ROOT)

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm46_jax import run_config
from glm46_jax.model.layers import MLP
from glm46_jax.model.moe import MoE
from glm46_jax.parallel import sharding
from glm46_jax.training import metrics
from glm46_jax.bench import bench, git_commit

CONFIG_FILE = os.path.join(ROOT, "configs", "pretrain.py")
DATASHEET_BF16 = 989.4e12  # H100/H200 SXM dense bf16 (metrics.PEAK_FLOPS_PER_DEVICE): the 989 TFLOP/s
# Named-scope path components that say how an op was traced, not where in the model it is.
_NOISE = re.compile(r"^(while|body|cond|branch_\d+(_fun)?|closed_call|checkpoint|remat|rematted_computation|"
                    r"core_call|eval_jaxpr|shard_map|custom_vjp_call|custom_jvp_call|pjit|scan|vmap)$")


def log(msg: str) -> None:
    print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def is_oom(err: BaseException) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


# --- settings ------------------------------------------------------------------------------------------------


def defaults(platform: str) -> dict[str, Any]:
    """The GPU run (issue 16: small, bf16, cuDNN, dropless) or the CPU fallback (tiny, fp32, XLA attention)."""
    if platform == "cpu":
        return {"preset": "tiny", "dtype": "float32", "attention": "xla", "batch": 2, "seq_len": 32, "steps": 2,
                "warmup": 1, "profile_steps": 1, "moe_repeats": 2, "matmul_sizes": (512,), "matmul_dtype": "float32",
                "moe_block": 128, "moe_blocks": "128"}
    return {"preset": "small", "dtype": "bfloat16", "attention": "auto", "batch": 8, "seq_len": 4096, "steps": 10,
            "warmup": 2, "profile_steps": 2, "moe_repeats": 10, "matmul_sizes": (8192,), "matmul_dtype": "bfloat16",
            # Dropless rows per block: 128 measured best on CPU; on a GPU a block is one kernel launch per matmul,
            # so larger blocks are likely better. Unmeasured: the MoE section sweeps --moe-blocks to find out.
            "moe_block": 512, "moe_blocks": "128,256,512,1024"}


def cudnn_attention_works(cfg, device: jax.Device) -> tuple[bool, str]:
    """Compile and run cuDNN's fused attention at the model's head layout (GQA, explicit causal mask) once."""
    if device.platform != "gpu":
        return False, f"no cuDNN on {device.platform}"
    try:
        b, s = 1, 256
        key = jax.random.key(0)
        q = jax.random.normal(key, (b, s, cfg.num_attention_heads, cfg.head_dim), jnp.bfloat16)
        kv = jax.random.normal(key, (b, s, cfg.num_key_value_heads, cfg.head_dim), jnp.bfloat16)
        mask = jnp.tril(jnp.ones((s, s), bool))[None, None]
        attend = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn"))
        jax.block_until_ready(attend(q, kv, kv))
        return True, "cuDNN fused attention compiled and ran"
    except Exception as err:  # noqa: BLE001 - any failure means: use XLA's attention and say why
        return False, f"cuDNN attention unavailable ({type(err).__name__}: {str(err).splitlines()[0][:200]})"


def run_config_for(args, batch: int):
    """configs/pretrain.py:<preset> with the benchmark's overrides, one device, the first phase resized."""
    config = run_config.config_file(CONFIG_FILE, args.preset)
    config.run_dir = os.path.join(args.out, "run")  # nothing is written there: bench saves no checkpoints
    config.mesh = {"data": 1, "tensor": 1, "expert": 1, "pipeline": 1}
    config.model.dtype = args.dtype
    config.model.attention_impl = args.attention
    config.model.moe_capacity_factor = 0.0  # dropless, as GLM-4.5 trains
    config.model.moe_block_size = args.moe_block
    if args.moe_group:  # dropless blocks per loop step; unset: the model's default
        config.model.moe_block_group = args.moe_group
    if args.remat:
        config.model.remat = args.remat
    config.train.accum_steps = 1
    first = config.data.phase_order[0]
    phase = config.data.phases[first]
    phase.update(global_batch=batch, seq_len=args.seq_len)
    if "batch_ramp" in phase:  # the glm45 presets ramp their batch; the benchmark times one fixed batch
        del phase["batch_ramp"]
    return run_config.from_config_dict(config)


# --- the profile ---------------------------------------------------------------------------------------------


def hlo_scopes(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its op_name metadata (the jax named-scope path), over every computation."""
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*?op_name=\"([^\"]*)\"",
                         hlo_text, re.MULTILINE):
        out[m.group(1)] = m.group(2)
    return out


def scope_of(op_name: str) -> tuple[str, str]:
    """("moe_layers/moe/moe_dispatch/experts", "bwd") from a jax op_name; the primitive (last part) is dropped."""
    direction = "bwd" if "transpose(" in op_name else "fwd"
    parts = [p for p in op_name.split("/")[:-1] if re.fullmatch(r"[A-Za-z_][\w\-]*", p) and not _NOISE.match(p)]
    return "/".join(parts) or "(unscoped: optimizer, casts, ...)", direction


def trace_ops(trace_dir: str) -> tuple[list[dict[str, Any]], str | None]:
    """The perfetto trace's complete events that name an HLO op: device streams where there are any (GPU), else
    the host's XLA:CPU thunks. Returns (events as {hlo_op, module, dur_us}, path of the trace file)."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)) or \
        sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    if not paths:
        return [], None
    with gzip.open(paths[-1], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    process = {e["pid"]: e["args"].get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    ops = [e for e in events if e.get("ph") == "X" and isinstance(e.get("args"), dict) and "hlo_op" in e["args"]]
    on_device = [e for e in ops if "/device:" in process.get(e.get("pid"), "")]
    return [{"hlo_op": e["args"]["hlo_op"], "module": e["args"].get("hlo_module", ""), "dur_us": self_us}
            for e, self_us in self_times(on_device or ops)], paths[-1]


def self_times(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float]]:
    """Each event's duration less its children's on the same thread: XLA:CPU's while/conditional thunks enclose
    their body's ops (GPU kernels do not nest; there this changes nothing), and summing both would count twice."""
    out = []
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[list] = []  # [event, end, children's time]
        for e in evs:
            start, dur = float(e["ts"]), float(e["dur"])
            while stack and start >= stack[-1][1]:
                done = stack.pop()
                out.append((done[0], float(done[0]["dur"]) - done[2]))
            if stack:
                stack[-1][2] += dur
            stack.append([e, start + dur, 0.0])
        out += [(done[0], float(done[0]["dur"]) - done[2]) for done in stack]
    return out


def breakdown(ops: list[dict[str, Any]], scopes: dict[str, str], module: str, steps: int,
              top: int) -> dict[str, Any]:
    """Per-step op time summed by named scope (+ fwd/bwd) and by HLO op, largest first."""
    mine = [o for o in ops if not module or o["module"] in ("", module)] or ops
    total = sum(o["dur_us"] for o in mine)
    by_scope: dict[tuple[str, str], float] = collections.defaultdict(float)
    by_op: dict[str, float] = collections.defaultdict(float)
    for o in mine:
        by_scope[scope_of(scopes.get(o["hlo_op"], ""))] += o["dur_us"]
        by_op[o["hlo_op"]] += o["dur_us"]

    def rows(table, key):
        return [{**key(k), "ms_per_step": v / 1e3 / steps, "share": v / total if total else 0.0}
                for k, v in sorted(table.items(), key=lambda kv: -kv[1])[:top]]
    return {
        "source": "jax.profiler trace (perfetto JSON): device op durations summed per HLO op; scope from the "
                  "compiled HLO's op_name metadata",
        "op_ms_per_step": total / 1e3 / steps, "events": len(mine), "steps": steps,
        "by_scope": rows(by_scope, lambda k: {"scope": k[0], "pass": k[1]}),
        "by_op": rows(by_op, lambda k: {"hlo_op": k, "scope": "{} ({})".format(*scope_of(scopes.get(k, "")))}),
    }


def profile_step(cfg, device, steps: int, trace_dir: str, top: int) -> dict[str, Any]:
    """Build the same step bench timed (the persistent compilation cache makes the rebuild cheap on GPU) and
    trace `steps` of it."""
    from glm46_jax.recipes import pretrain

    run, state = pretrain.build(cfg, [device])
    phase = cfg.data.curriculum.phases[0]
    x = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (phase.global_batch, phase.seq_len + 1))
    with sharding.use_mesh(run.mesh):
        batch = run.device_batch({"inputs": x[:, :-1].astype(np.int32), "targets": x[:, 1:].astype(np.int32)})
        ctrl = run.controls_at(0)
        compiled = run.steps_for(phase).lower(state, batch, ctrl, run.frozen).compile()
        state, _ = compiled(state, batch, ctrl, run.frozen)
        jax.block_until_ready(state)
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        try:
            for _ in range(steps):
                state, _ = compiled(state, batch, ctrl, run.frozen)
            jax.block_until_ready(state)
        finally:
            jax.profiler.stop_trace()
    ops, path = trace_ops(trace_dir)
    if not ops:
        return {"error": f"the trace in {trace_dir} has no events naming an HLO op ({path or 'no trace file'})"}
    hlo = compiled.as_text()
    module = re.search(r"^HloModule\s+([\w.\-]+)", hlo, re.MULTILINE)
    result = breakdown(ops, hlo_scopes(hlo), module.group(1) if module else "", steps, top)
    result["trace_file"] = path
    return result


# --- MoE layer alone -----------------------------------------------------------------------------------------


def moe_vs_dense(model_cfg, device, batch: int, seq_len: int, repeats: int,
                 blocks: tuple[int, ...] = ()) -> dict[str, Any]:
    """Forward + backward (grad of <layer(x), g> w.r.t. x and every weight) of the model's MoE block and of one
    SwiGLU FFN of width (k + shared) x expert width: the same matmul FLOPs per token, router aside. `blocks`: also
    time the MoE at these dropless block sizes (rows "moe block=<b>")."""
    c = model_cfg.replace(moe_capacity_factor=0.0)
    d, e, f, k, s = (c.hidden_size, c.n_routed_experts, c.moe_intermediate_size, c.num_experts_per_tok,
                     c.n_shared_experts)
    mesh = sharding.make_mesh({"data": 1, "tensor": 1, "expert": 1, "pipeline": 1}, [device])
    dt = jnp.dtype(c.dtype)
    kx, kg = jax.random.split(jax.random.key(1))
    x = jax.device_put(jax.random.normal(kx, (batch, seq_len, d), dt), device)
    g = jax.device_put(jax.random.normal(kg, (batch, seq_len, d), dt), device)
    tokens = batch * seq_len
    results: dict[str, Any] = {}
    with sharding.use_mesh(mesh):
        layers = {"moe": MoE(c, rngs=nnx.Rngs(0)), "dense": MLP(c, (k + s) * f, rngs=nnx.Rngs(0))}
        layers.update({f"moe block={b}": MoE(c.replace(moe_block_size=b), rngs=nnx.Rngs(0))
                       for b in blocks if b != c.moe_block_size})
        for name, layer in layers.items():
            graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

            def loss(params, x, g, graphdef=graphdef, rest=rest):
                y = nnx.merge(graphdef, params, rest)(x)
                y = y[0] if isinstance(y, tuple) else y  # MoE also returns its routing statistics
                return jnp.vdot(y.astype(jnp.float32), g.astype(jnp.float32))

            step = jax.jit(jax.grad(loss, argnums=(0, 1)))
            t0 = time.perf_counter()
            jax.block_until_ready(step(params, x, g))
            first = time.perf_counter() - t0
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(step(params, x, g))
                times.append(time.perf_counter() - t0)
            # forward matmul FLOPs per token x 3 (backward = 2 x forward); the router's 2*d*E counted for MoE
            fwd = 2 * 3 * d * (k + s) * f + (2 * d * e if name.startswith("moe") else 0)
            ms = 1e3 * statistics.median(times)
            results[name] = {"median_ms": ms, "min_ms": 1e3 * min(times), "first_call_s": first,
                             "flops_per_token": 3 * fwd, "tflops": 3 * fwd * tokens / (ms / 1e3) / 1e12}
    results["moe_over_dense"] = results["moe"]["median_ms"] / results["dense"]["median_ms"]
    results["shapes"] = {"tokens": tokens, "d_model": d, "experts": e, "expert_ffn": f, "top_k": k, "shared": s,
                         "dense_ffn": (k + s) * f, "dtype": c.dtype, "dispatch": "dropless", "block": c.moe_block_size}
    return results


# --- the run -------------------------------------------------------------------------------------------------


def main(argv=None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "runs", "gpu_bench"))
    for name in ("preset", "dtype", "attention", "remat"):
        p.add_argument(f"--{name}", default=None)
    for name in ("batch", "seq-len", "steps", "warmup", "profile-steps", "moe-repeats", "moe-block", "moe-group"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--moe-blocks", default=None, help="comma list of dropless block sizes the MoE section times")
    p.add_argument("--top", type=int, default=25, help="rows of each profile table")
    p.add_argument("--cpu", action="store_true", help="the CPU fallback even where a GPU is visible")
    p.add_argument("--skip", default="", help="comma list of sections to skip: profile,moe")
    args = p.parse_args(argv)

    device = jax.devices("cpu")[0] if args.cpu else jax.devices()[0]
    for key, value in defaults(device.platform).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    os.makedirs(args.out, exist_ok=True)
    # profile_step rebuilds bench's step: with a persistent compilation cache its compile comes from disk.
    jax.config.update("jax_compilation_cache_dir", os.path.join(args.out, "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    skip = {s for s in args.skip.split(",") if s}
    if device.platform != "gpu":
        log(f"no GPU visible (default device: {device.device_kind}, platform {device.platform}): CPU fallback, "
            f"preset {args.preset}, {args.dtype}, {args.attention} attention. The numbers say nothing about a GPU.")
    result: dict[str, Any] = {
        "benchmark": "gpu_step", "commit": git_commit(), "date": time.strftime("%Y-%m-%d"),
        "python": sys.version.split()[0], "jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
        "device": device.device_kind, "platform": device.platform, "devices_visible": jax.device_count(),
        "argv": sys.argv[1:] if argv is None else list(argv), "errors": {},
    }

    log(f"matmul peak: {args.matmul_dtype} {'/'.join(map(str, args.matmul_sizes))}^3 on {device.device_kind}")
    measured = metrics.measure_matmul_peak(args.matmul_dtype, sizes=args.matmul_sizes, repeats=10, device=device)
    result["matmul_peak"] = {"tflops": measured / 1e12, "dtype": args.matmul_dtype, "sizes": args.matmul_sizes}
    log(f"  {measured / 1e12:.1f} TFLOP/s")

    if args.attention == "auto":
        probe_cfg = run_config_for(args, args.batch).model
        ok, why = cudnn_attention_works(probe_cfg, device)
        args.attention = "cudnn" if ok else "xla"
        result["attention_probe"] = why
        log(f"attention: {args.attention} ({why})")

    # The train step; on OOM, half the rows (the issue asks for a number, not for one batch size).
    batch, step = args.batch, None
    while step is None:
        cfg = run_config_for(args, batch)
        log(f"train step: {args.preset}, {batch} x {args.seq_len} tokens, {cfg.model.dtype}, "
            f"{cfg.model.attention_impl} attention, remat {cfg.model.remat}, dropless")
        try:
            step = bench(cfg, steps=args.steps, warmup=args.warmup, devices=[device])
        except Exception as err:
            if not is_oom(err) or batch == 1:
                raise
            result["errors"].setdefault("train_step_oom", []).append(f"batch {batch}: {str(err).splitlines()[0]}")
            batch //= 2
            log(f"  out of memory; retrying with batch {batch}")
    step["mfu_vs_datasheet_989"] = step["achieved_tflops"] * 1e12 / DATASHEET_BF16
    step["mfu_vs_measured_matmul"] = step["achieved_tflops"] * 1e12 / measured
    step["memory_stats"] = {k: v for k, v in (device.memory_stats() or {}).items()
                            if k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit", "largest_alloc_size")}
    result["train_step"] = step
    log(f"  {step['tokens_per_s']:,.0f} tokens/s, {step['achieved_tflops']:.1f} TFLOP/s, MFU "
        f"{step['mfu_vs_datasheet_989']:.1%} of 989 TFLOP/s, {step['mfu_vs_measured_matmul']:.1%} of measured; "
        f"peak memory {step['peak_memory_gib']:.2f} GiB")

    if "profile" not in skip:
        log(f"profile: {args.profile_steps} steps under jax.profiler")
        trace_dir = os.path.join(args.out, "trace")
        shutil.rmtree(trace_dir, ignore_errors=True)
        try:
            prof = profile_step(cfg, device, args.profile_steps, trace_dir, args.top)
            if prof.get("trace_file"):  # $OUT brings back files at most 2 folders down: copy it up
                shutil.copy(prof["trace_file"], os.path.join(args.out, "trace.json.gz"))
            result["profile"] = prof
        except Exception as err:  # noqa: BLE001 - the other sections are still worth having
            result["errors"]["profile"] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
    if "moe" not in skip:
        log(f"MoE layer vs dense FFN: {batch} x {args.seq_len} tokens, fwd + bwd")
        try:
            blocks = tuple(int(b) for b in args.moe_blocks.split(",") if b)
            result["moe_vs_dense"] = moe_vs_dense(cfg.model, device, batch, args.seq_len, args.moe_repeats, blocks)
            log(f"  MoE / dense = {result['moe_vs_dense']['moe_over_dense']:.2f}")
        except Exception as err:  # noqa: BLE001
            result["errors"]["moe_vs_dense"] = f"{type(err).__name__}: {err}"
            traceback.print_exc()

    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    report = markdown(result)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(report)
    print(report, flush=True)
    log(f"wrote {args.out}/result.json, report.md" + (", trace.json.gz" if "profile" in result else ""))
    return result


def markdown(r: dict[str, Any]) -> str:
    s = r["train_step"]
    lines = [
        f"## GPU train-step benchmark (`benchmarks/gpu/run.sh`), {r['date']}", "",
        f"- device: {r['device']} ({r['platform']}), jax {r['jax']}, Python {r['python']}, commit {r['commit']}",
        (f"- step: preset {s['preset']}, {s['global_batch']} x {s['seq_len']} tokens, {s['dtype']}, remat "
         f"{s['remat']}, dropless; {r.get('attention_probe', 'attention as configured')}"),
        f"- measured {r['matmul_peak']['dtype']} matmul peak: {r['matmul_peak']['tflops']:.1f} TFLOP/s", "",
        "| tokens/s | model TFLOP/s | MFU vs 989 TFLOP/s | MFU vs measured matmul | peak memory | step ms |",
        "|---|---|---|---|---|---|",
        (f"| {s['tokens_per_s']:,.0f} | {s['achieved_tflops']:.1f} | {s['mfu_vs_datasheet_989']:.1%} | "
         f"{s['mfu_vs_measured_matmul']:.1%} | {s['peak_memory_gib']:.2f} GiB ({s['memory_source']}) | "
         f"{s['step_s_median'] * 1e3:.1f} |"),
    ]
    m = r.get("moe_vs_dense")
    if m:
        sh = m["shapes"]
        lines += ["", (f"MoE layer alone vs dense FFN ({sh['tokens']} tokens, d {sh['d_model']}, {sh['experts']} "
                       f"experts x {sh['expert_ffn']} top-{sh['top_k']} + {sh['shared']} shared; dense width "
                       f"{sh['dense_ffn']}; {sh['dtype']}; dropless block {sh['block']}; fwd + bwd): "
                       f"**MoE / dense = {m['moe_over_dense']:.2f}**"),
                  "",
                  "| layer | median ms | TFLOP/s |", "|---|---|---|"]
        names = ["moe", "dense"] + sorted((n for n in m if n.startswith("moe block=")), key=lambda n: int(n[10:]))
        lines += [f"| {n} | {m[n]['median_ms']:.2f} | {m[n]['tflops']:.1f} |" for n in names]
    prof = r.get("profile")
    if prof and "by_scope" in prof:
        lines += ["", (f"Profile ({prof['source']}): {prof['op_ms_per_step']:.1f} ms of op time per step over "
                       f"{prof['steps']} steps"), "", "| named scope | pass | ms / step | share |", "|---|---|---|---|"]
        lines += [f"| {x['scope']} | {x['pass']} | {x['ms_per_step']:.2f} | {x['share']:.1%} |"
                  for x in prof["by_scope"]]
        lines += ["", "| HLO op | scope (pass) | ms / step | share |", "|---|---|---|---|"]
        lines += [f"| {x['hlo_op']} | {x['scope']} | {x['ms_per_step']:.2f} | {x['share']:.1%} |"
                  for x in prof["by_op"]]
    if r["errors"]:
        lines += ["", "Errors: " + "; ".join(f"{k}: {v}" for k, v in r["errors"].items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

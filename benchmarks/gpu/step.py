"""The `small` preset's train step on one GPU, decided in one call: tokens/s, MFU, where the time goes, HF anchor.

    bash benchmarks/gpu/run.sh                                   # on the GPU machine (installs the carried wheels)
    PYTHONPATH=. python benchmarks/gpu/step.py --out /tmp/gpu    # anywhere; without a GPU: the CPU fallback

Sections, in order, each written to result.json / report.md as soon as it is done (a timeout keeps what ran; one
that would overrun --budget-s is skipped and says so). docs/gpu.md#what-the-gpu-benchmark-reports has the details.
  hf        HF transformers' step on the HF-equivalent config and tokens, in a subprocess BEFORE JAX starts on the
            device (JAX pre-allocates its memory until its process exits): hf_anchor.py;
  peak      the bf16 matmul peak measured on this device (8192^3);
  step      the real train step (Muon + AdamW, MTP, dropless MoE, the preset's remat, packed documents) compiled
            with default XLA options, command buffers off and (where XLA takes the option) command buffers kept
            under the profiler, timed interleaved with matmul probes on random data (8192^3, the lm_head's shape);
            the compiled HLO's cuDNN attention calls checked (causal, no bias operand);
  profile   steps of the command-buffers-off executable under jax.profiler: GPU busy / idle, kernels and
            device->host copies per step, ms per model component against its FLOPs, per scope, per op (profiling.py);
  profile_default  the same of the default executable, or the step's on/off difference where XLA has no option;
  hf_equiv  our step as HF's (MTP off, AdamW, remat none, unpacked, the same tokens): the ratio to HF;
  moe       the MoE layer per implementation vs a dense FFN, checked against the loop; XLA flag sets A/B on it.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (ROOT, HERE):  # run as a script from anywhere: the package is the checkout's
    if path not in sys.path:
        sys.path.insert(0, path)

import components
import hf_anchor
import hlo_trace
import jax
import jax.numpy as jnp
import moe_section
import probes
import profiling
import report

from glm46_jax import run_config
from glm46_jax.bench import PreparedStep, git_commit
from glm46_jax.errors import InputError
from glm46_jax.monitoring import metrics

CONFIG_FILE = os.path.join(ROOT, "configs", "pretrain.py")
DATASHEET_BF16 = 989.4e12  # H100/H200 SXM dense bf16 (metrics.PEAK_FLOPS_PER_DEVICE)
CMDBUF_OFF = {"xla_gpu_enable_command_buffer": ""}
# The flags under test (docs/gpu.md#xla-flags): each set alone against the default, interleaved in one process.
FLAG_SETS = {
    "default": {},
    "command buffers off": CMDBUF_OFF,
    "Triton GEMM off": {"xla_gpu_enable_triton_gemm": False},
    "latency-hiding scheduler": {"xla_gpu_enable_latency_hiding_scheduler": True},
    "while-loop double buffering": {"xla_gpu_enable_while_loop_double_buffering": True},
}
# Seconds each section may take on the GPU (compiles of the small step ~70 s each): a section whose estimate
# would pass --budget-s is skipped.
ESTIMATE_S = {"hf": 60, "step": 170, "profile": 40, "profile_default": 30, "hf_equiv": 80, "moe": 100}


def log(msg: str) -> None:
    print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def is_oom(err: BaseException) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


# --- settings ------------------------------------------------------------------------------------------------


def defaults(platform: str) -> dict[str, Any]:
    """The GPU run (small, bf16, 8 x 4096) or the CPU fallback (tiny, fp32, 2 x 32, a few short rows)."""
    common = {"attention": "auto", "moe_impl": "auto"}  # cuDNN causal and grouped GEMMs on a GPU where they run
    if platform != "gpu":
        return {**common, "preset": "tiny", "dtype": "float32", "batch": 2, "seq_len": 32, "steps": 2, "warmup": 1,
                "profile_steps": 1, "moe_repeats": 2, "flag_rounds": 1, "matmul_size": 512,
                "matmul_dtype": "float32", "moe_block": 128, "budget_s": 1e9, "hf_steps": 2}
    return {**common, "preset": "small", "dtype": "bfloat16", "batch": 8, "seq_len": 4096, "steps": 10, "warmup": 2,
            "profile_steps": 2, "moe_repeats": 10, "flag_rounds": 5, "matmul_size": 8192, "matmul_dtype": "bfloat16",
            # The loop's rows per block: 4096 measured best of 1024/2048/4096 on the H200 (docs/gpu.md).
            "moe_block": 4096, "budget_s": 520, "hf_steps": 6}


def parse_args(argv=None, platform: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "runs", "gpu_bench"))
    for name in ("preset", "dtype", "attention", "remat", "moe-impl", "matmul-dtype"):
        p.add_argument(f"--{name}", default=None)
    for name in ("batch", "seq-len", "steps", "warmup", "profile-steps", "moe-repeats", "moe-block", "moe-group",
                 "flag-rounds", "matmul-size", "hf-steps"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=None, help="skip sections that would end past this (s)")
    p.add_argument("--no-packed", dest="packed", action="store_false",
                   help="plain random rows instead of packed documents (segment ids) in the step's batch")
    p.add_argument("--hf-python", default=os.environ.get("GPU_BENCH_HF_PYTHON", sys.executable),
                   help="the Python with torch + transformers that runs hf_anchor.py")
    p.add_argument("--top", type=int, default=25, help="rows of each profile table")
    p.add_argument("--cpu", action="store_true", help="the CPU fallback even where a GPU is visible")
    p.add_argument("--skip", default="", help="comma list of sections to skip: "
                   "hf,step,profile,profile_default,hf_equiv,moe")
    args = p.parse_args(argv)
    # Decided before JAX starts on a device (the HF anchor must run first): a GPU is there when its device node is.
    args.platform = platform or ("gpu" if not args.cpu and os.path.exists("/dev/nvidiactl") else "cpu")
    for key, value in defaults(args.platform).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def run_config_for(args, batch: int | None = None, hf_equivalent: bool = False):
    """configs/pretrain.py:<preset> with the benchmark's overrides, one device, the first phase resized.
    `hf_equivalent`: what HF transformers' step does (MTP off, AdamW on every weight, no remat)."""
    config = run_config.config_file(CONFIG_FILE, args.preset)
    config.run_dir = os.path.join(args.out, "run")  # nothing is written there: the benchmark saves no checkpoints
    config.mesh = {"data": 1, "tensor": 1, "expert": 1, "pipeline": 1}
    config.model.dtype = args.dtype
    config.model.attention_impl = args.attention
    config.model.moe_impl = args.moe_impl
    config.model.moe_capacity_factor = 0.0  # dropless, as GLM-4.5 trains
    config.model.moe_block_size = args.moe_block
    if args.moe_group:  # dropless blocks per loop step; unset: the model's default
        config.model.moe_block_group = args.moe_group
    if args.remat:
        config.model.remat = args.remat
    if hf_equivalent:
        config.loss.mtp = False
        config.optim.algorithm = "adamw"
        config.model.remat = "none"
    config.train.accum_steps = 1
    phase = config.data.phases[config.data.phase_order[0]]
    phase.update(global_batch=batch or args.batch, seq_len=args.seq_len)
    if "batch_ramp" in phase:  # the glm45 presets ramp their batch; the benchmark times one fixed batch
        del phase["batch_ramp"]
    return run_config.from_config_dict(config)


def plan(argv=None, platform: str | None = None) -> tuple[argparse.Namespace, dict[str, Any]]:
    """Every configuration the run builds, validated, without touching a device (a CPU test builds the GPU's)."""
    args = parse_args(argv, platform)
    configs = {"step": run_config_for(args), "hf_equivalent": run_config_for(args, hf_equivalent=True)}
    for cfg in configs.values():
        sizes = cfg.mesh.sizes()
        if math.prod(sizes.values()) != 1:
            raise InputError(f"the GPU benchmark runs on one device; mesh {sizes} asks for more")
    return args, configs


# --- sections ------------------------------------------------------------------------------------------------


def step_variants(platform: str, profiled_default: bool = True) -> dict[str, dict[str, Any]]:
    """The full step's option sets: default, command buffers off (profiled) and, where this XLA takes the option,
    the default with command buffers kept under the profiler (profiled too). The CPU fallback compiles one
    (XLA:CPU ignores GPU options; a second compile of the step would only cost time)."""
    if platform != "gpu":
        return {"default": {}}
    profiled = {profiling.PROFILED_DEFAULT: profiling.CMDBUF_PROFILING} if profiled_default else {}
    return {"default": {}, "command buffers off": CMDBUF_OFF, **profiled}


def moe_flag_sets(platform: str) -> dict[str, dict[str, Any]]:
    """Every flag set under test on the GPU; the CPU fallback runs the A/B machinery on two."""
    return FLAG_SETS if platform == "gpu" else {k: FLAG_SETS[k] for k in ("default", "command buffers off")}


def step_section(args, device, result, save) -> PreparedStep:
    """The default step compiled with each of `step_variants`' option sets, timed interleaved with matmul probes."""
    c = run_config_for(args).model
    calls = {f"{args.matmul_size}^3 chain": probes.matmul_probe(args.matmul_size, args.matmul_dtype, device),
             **probes.head_probes(args.batch * args.seq_len, c.hidden_size, c.vocab_size, args.matmul_dtype, device)}
    rejected = profiling.profiling_option_rejected(device) if args.platform == "gpu" else None
    if rejected:
        result["errors"]["command_buffers_during_profiling"] = rejected
    batch, times = args.batch, None
    while times is None:
        cfg = run_config_for(args, batch)
        log(f"train step: {args.preset}, {batch} x {args.seq_len} tokens{' packed' if args.packed else ''}, "
            f"{cfg.model.dtype}, {cfg.model.attention_impl} attention, remat {cfg.model.remat}, moe "
            f"{getattr(cfg.model, 'moe_impl', 'loop')} (block {cfg.model.moe_block_size})")
        step = None
        try:  # out of memory when compiling or when running: half the rows, the failure kept
            step = PreparedStep(cfg, [device], packed=args.packed,
                                variants=step_variants(args.platform, profiled_default=not rejected))
            times = step.interleave(args.steps, args.warmup, extra={n: p for n, (p, _) in calls.items()})
        except Exception as err:
            if not is_oom(err) or batch == 1:
                raise
            result["errors"].setdefault("train_step_oom", []).append(f"batch {batch}: {str(err).splitlines()[0]}")
            del step
            gc.collect()
            batch //= 2
            log(f"  out of memory; retrying with batch {batch}")
    probe_tflops = {n: f / statistics.median(times.pop(n)) / 1e12 for n, (_, f) in calls.items()}
    peak = max(probe_tflops.values()) * 1e12
    rows = {}
    for name, t in times.items():
        r = step.result(t, name)
        r.update(mfu_vs_datasheet_989=r["achieved_tflops"] * 1e12 / DATASHEET_BF16,
                 body_mfu_vs_datasheet_989=body_mfu(r, cfg),
                 mfu_vs_measured_matmul=r["achieved_tflops"] * 1e12 / peak, packed=args.packed,
                 attention_impl=cfg.model.attention_impl, moe_impl=getattr(cfg.model, "moe_impl", "loop"),
                 compiler_options=step.options[name])
        rows[name] = r
    rows["default"]["memory_stats"] = {k: v for k, v in (device.memory_stats() or {}).items()
                                       if k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")}
    result["train_step"] = rows["default"]
    result["step_variants"] = {"matmul_peak_interleaved_tflops": peak / 1e12, "matmul_probes_tflops": probe_tflops,
                               **{n: {"step_ms_median": r["step_s_median"] * 1e3, "tokens_per_s": r["tokens_per_s"],
                                      "vs_default": r["step_s_median"] / rows["default"]["step_s_median"],
                                      "compile_s": r["compile_s"], "options": r["compiler_options"]}
                                  for n, r in rows.items()}}
    s = rows["default"]
    log(f"  {s['tokens_per_s']:,.0f} tokens/s, MFU {s['mfu_vs_datasheet_989']:.1%} of 989 (body "
        f"{s['body_mfu_vs_datasheet_989']:.1%}), peak memory "
        f"{s['peak_memory_gib']:.2f} GiB; " + ", ".join(f"{n}: {r['tokens_per_s']:,.0f}" for n, r in rows.items()))
    for name, executable in step.executables.items():  # did the options take? XLA outlines command buffers
        text = executable.as_text()                       # into computations named command_buffer*
        result["step_variants"][name]["command_buffer_mentions"] = text.count("command_buffer")
    hlo = step.executables["default"].as_text()
    result["attention_hlo"] = hlo_trace.attention_calls(hlo)
    with gzip.open(os.path.join(args.out, "step_hlo.txt.gz"), "wt") as f:
        f.write(hlo)
    save()
    return step


def body_mfu(r: dict[str, Any], cfg) -> float:
    """MFU without the vocab heads' FLOPs (lm_head, and the MTP head where the step trains MTP), over the whole
    step's time: the heads are 46% of `small`'s model FLOPs and run near the peak, lifting the total MFU."""
    body = r["model_flops_per_token"] - components.head_flops_per_token(cfg.model, mtp=cfg.loss.mtp)
    return body * r["tokens_per_s"] / DATASHEET_BF16


def hf_equiv_section(args, device, result) -> dict[str, Any]:
    cfg = run_config_for(args, hf_equivalent=True)
    step = PreparedStep(cfg, [device], packed=False)
    r = step.result(step.interleave(args.steps, args.warmup)["default"])
    r["mfu_vs_datasheet_989"] = r["achieved_tflops"] * 1e12 / DATASHEET_BF16
    r["body_mfu_vs_datasheet_989"] = body_mfu(r, cfg)
    hf = result.get("hf_transformers", {})
    if "tokens_per_s" in hf:
        r["vs_hf_transformers"] = r["tokens_per_s"] / hf["tokens_per_s"]
    return r


# --- the run -------------------------------------------------------------------------------------------------


def main(argv=None) -> dict[str, Any]:
    t_start = time.perf_counter()
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    skip = {s for s in args.skip.split(",") if s}
    result: dict[str, Any] = {
        "benchmark": "gpu_step", "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "python": sys.version.split()[0], "jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
        "argv": sys.argv[1:] if argv is None else list(argv), "packed": args.packed, "errors": {}, "skipped": {},
        "xla_flags_env": os.environ.get("XLA_FLAGS", ""), "flag_sets": FLAG_SETS,
    }

    def save() -> None:
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f, indent=2, default=str)
        with open(os.path.join(args.out, "report.md"), "w") as f:
            f.write(report.markdown(result))

    def section(name: str, fn, *fargs) -> Any:
        if name in skip:
            result["skipped"][name] = "--skip"
            return None
        elapsed = time.perf_counter() - t_start
        if elapsed + ESTIMATE_S.get(name, 0) * (args.platform == "gpu") > args.budget_s:
            result["skipped"][name] = f"budget: {elapsed:.0f} s spent, ~{ESTIMATE_S[name]} s more > {args.budget_s} s"
            log(f"skipping {name}: {result['skipped'][name]}")
            return None
        log(f"section {name}")
        t0, cpu0 = time.perf_counter(), time.process_time()
        try:
            return fn(*fargs)
        except Exception as err:  # noqa: BLE001 - the other sections are still worth having
            result["errors"][name] = f"{type(err).__name__}: {str(err)[:2000]}"
            traceback.print_exc()
            return None
        finally:
            result.setdefault("section_s", {})[name] = time.perf_counter() - t0
            result.setdefault("section_cpu_s", {})[name] = time.process_time() - cpu0
            save()

    _, configs = plan(argv)  # every configuration validated before anything runs
    hf = section("hf", hf_anchor.launch, args.out, args.hf_python, args.hf_steps, args.platform,
                 configs["hf_equivalent"], ESTIMATE_S["hf"] + 60)
    if hf is not None:
        result["hf_transformers"] = hf

    device = jax.devices("cpu")[0] if args.cpu else jax.devices()[0]
    result.update(device=device.device_kind, platform=device.platform, devices_visible=jax.device_count(),
                  libraries=report.library_versions())
    if device.platform != args.platform:
        result["errors"]["platform"] = f"expected {args.platform} (from /dev/nvidiactl), JAX found {device.platform}"
    if device.platform != "gpu":
        log(f"no GPU (device {device.device_kind}): CPU fallback, preset {args.preset}, {args.dtype}. The numbers "
            "say nothing about a GPU.")
    log(f"matmul peak: {args.matmul_dtype} {args.matmul_size}^3 on {device.device_kind}")
    measured = metrics.measure_matmul_peak(args.matmul_dtype, sizes=(args.matmul_size,), repeats=10, device=device)
    result["matmul_peak"] = {"tflops": measured / 1e12, "dtype": args.matmul_dtype, "size": args.matmul_size}
    save()

    if args.attention == "cudnn":  # a checkout whose config has no "auto": probe cuDNN, else XLA's attention
        ok, why = cudnn_attention_works(device)
        args.attention = "cudnn" if ok else "xla"
        result["attention_probe"] = why

    step = section("step", step_section, args, device, result, save)
    if step is not None:
        peak = result["step_variants"]["matmul_peak_interleaved_tflops"] * 1e12
        prof = section("profile", profiling.profile_section, args, step, peak)
        if prof is not None:
            result["profile"] = prof
        prof = section("profile_default", profiling.profile_default_section, args, step, peak, result)
        if prof is not None:
            result["profile_default"] = prof
        del step
        gc.collect()  # the step's state and executables leave the device before the next section's
    r = section("hf_equiv", hf_equiv_section, args, device, result)
    if r is not None:
        result["hf_equivalent"] = r
        gc.collect()

    def moe():
        cfg = run_config_for(args)
        probe, _ = probes.matmul_probe(args.matmul_size, args.matmul_dtype, device)
        rows = result.get("train_step", {}).get("global_batch", args.batch)  # the step's, if it had to halve
        return moe_section.moe_section(cfg.model, device, rows, args.seq_len, args.moe_repeats,
                                       moe_flag_sets(device.platform),
                                       args.flag_rounds, probe)
    m = section("moe", moe)
    if m is not None:
        result["moe"] = m
    result["total_s"] = time.perf_counter() - t_start
    result["checks"] = report.checks(result)
    save()
    print(report.markdown(result), flush=True)
    log(f"wrote {args.out}/result.json, report.md in {result['total_s']:.0f} s")
    for line in report.failures(result):
        print(f"error: check failed: {line}", file=sys.stderr, flush=True)
    return result


def cudnn_attention_works(device) -> tuple[bool, str]:
    """Compile and run cuDNN's fused causal attention once (GQA layout)."""
    if device.platform != "gpu":
        return False, f"no cuDNN on {device.platform}"
    try:
        q = jnp.ones((1, 256, 4, 128), jnp.bfloat16)
        kv = jnp.ones((1, 256, 2, 128), jnp.bfloat16)
        attend = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
        jax.block_until_ready(attend(q, kv, kv))
        return True, "cuDNN fused attention compiled and ran"
    except Exception as err:  # noqa: BLE001 - any failure means: use XLA's attention and say why
        return False, f"cuDNN attention unavailable ({type(err).__name__}: {str(err).splitlines()[0][:200]})"


if __name__ == "__main__":
    sys.exit(1 if report.failures(main()) else 0)  # run.sh ends with this script: a failed check fails the call

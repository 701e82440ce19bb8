"""The profile sections of benchmarks/gpu/step.py: a few steps of one compiled executable under jax.profiler, read
back into a timeline, ms per model component against its FLOPs (model and, for attention, hardware), per named
scope and per HLO op; and the default executable's profile beside the command-buffers-off one."""

from __future__ import annotations

import gzip
import os
import shutil
import time
from typing import TYPE_CHECKING, Any

import components
import hlo_trace
import jax
import numpy as np
import report

if TYPE_CHECKING:  # annotations only: the readers' tests import this module without the training stack
    from glm46_jax.bench import PreparedStep

# XLA turns command buffers off while a profiler is active unless told otherwise: without this option a profile of
# the default executable is one of the command-buffers-off program.
CMDBUF_PROFILING = {"xla_enable_command_buffers_during_profiling": True}
PROFILED_DEFAULT = "default, profiled"


def profiling_option_rejected(device) -> str | None:
    """None when this jax / XLA compiles a trivial program with CMDBUF_PROFILING, else why not (an option the XLA
    version does not know is an INVALID_ARGUMENT "No such compile option")."""
    try:
        x = jax.device_put(np.float32(0), device)
        jax.jit(lambda x: x + 1).lower(x).compile(compiler_options=CMDBUF_PROFILING)
        return None
    except Exception as err:  # noqa: BLE001 - any refusal means: report the on/off difference instead
        return f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"


def batch_attention_pairs(step: PreparedStep) -> dict[str, Any]:
    """The step's batch as attention sees it: its documents (runs of one segment id; a row without segment ids
    is one) and the causal pairs they need, beside the MFU convention's seq^2 / 2 per row."""
    seg = step.batch.get("segment_ids") if isinstance(step.batch, dict) else None
    ids = np.asarray(jax.device_get(seg)) if seg is not None else np.zeros((step.rows, step.seq_len), np.int32)
    lengths = components.document_lengths(ids.reshape(-1, ids.shape[-1]))
    pairs, convention = components.causal_pairs(lengths), step.rows * step.seq_len ** 2 // 2
    return {"documents": len(lengths), "causal_pairs": pairs, "mfu_convention_pairs": convention,
            "hardware_over_convention": pairs / convention}


def profile_section(args, step: PreparedStep, peak: float, variant: str | None = None, tag: str = ""
                    ) -> dict[str, Any]:
    """`profile_steps` steps of one executable under jax.profiler: by default the command-buffers-off one (with
    command buffers and without CMDBUF_PROFILING, XLA puts their kernels under one unscoped event); its trace
    and its HLO are saved as trace{tag}.json.gz and profile{tag}_hlo.txt.gz."""
    trace_dir = os.path.join(args.out, "trace")
    shutil.rmtree(trace_dir, ignore_errors=True)
    variant = variant or ("command buffers off" if "command buffers off" in step.executables else "default")
    step(variant)
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    try:
        t0 = time.perf_counter()
        for _ in range(args.profile_steps):
            step(variant)
        wall = time.perf_counter() - t0
    finally:
        jax.profiler.stop_trace()
    events, processes, path = hlo_trace.trace_events(trace_dir)
    if path:  # kept even when no event names an HLO op: its kernel names are then all there is to read
        shutil.copy(path, os.path.join(args.out, f"trace{tag}.json.gz"))  # $OUT brings back 2 folders down at most
    shutil.rmtree(trace_dir, ignore_errors=True)  # the xplane protos: tens of MiB the device tool need not carry
    ops = hlo_trace.device_ops(events, processes)
    if not ops:
        return {"error": f"the trace of {variant!r} has no events naming an HLO op ({path or 'no trace file'})"}
    hlo = step.executables[variant].as_text()
    with gzip.open(os.path.join(args.out, f"profile{tag}_hlo.txt.gz"), "wt") as f:  # the op names of this trace
        f.write(hlo)
    instrs = hlo_trace.hlo_instructions(hlo)
    steps = args.profile_steps
    c = step.cfg.model
    mtp = step.cfg.loss.mtp
    ms = components.sum_by_component(ops, instrs, c.vocab_size, steps, hlo_trace.scope_of)
    flops = components.component_flops(c, step.rows, step.seq_len, mtp=mtp,
                                       ns_steps=step.cfg.optim.muon_ns_steps if "muon" in step.cfg.optim.algorithm
                                       else None)
    pairs = batch_attention_pairs(step)
    timeline = hlo_trace.timeline(hlo_trace.on_device(events, processes), steps, wall)
    op_ms = sum(o["dur_us"] for o in ops) / 1e3 / steps
    return {
        "source": f"jax.profiler trace (perfetto JSON) of the {variant!r} executable; scopes from its HLO's op_name",
        "variant": variant, "steps": steps, "op_ms_per_step": op_ms, "timeline": timeline,
        # device time of kernels no event names an HLO op for (kernels inside a command buffer may lose it)
        "unattributed_ms_per_step": timeline["busy_ms_per_step"] - op_ms if "busy_ms_per_step" in timeline else None,
        "attention_pairs": pairs,
        "components": components.table(ms, flops, peak, components.attention_hw_flops(c, pairs["causal_pairs"], mtp)),
        "by_scope": report.top(ops, instrs, steps, args.top, by="scope"),
        "by_op": report.top(ops, instrs, steps, args.top, by="op"),
    }


def profile_default_section(args, step: PreparedStep, peak: float, result) -> dict[str, Any]:
    """The default executable's profile (command buffers on, kept under the profiler), each component's ms beside
    the command-buffers-off profile's; where this XLA rejected the option, the step's on/off difference alone."""
    times = result["step_variants"]
    on_minus_off = (times["default"]["step_ms_median"] - times["command buffers off"]["step_ms_median"]
                    if "command buffers off" in times else None)
    if PROFILED_DEFAULT not in step.executables:
        rejected = result["errors"].get("command_buffers_during_profiling")
        why = ("the CPU fallback compiles one executable: the profile above is of the default one"
               if args.platform != "gpu" else f"not profiled: this XLA rejects {CMDBUF_PROFILING} ({rejected}); "
               "the profile above is of the command-buffers-off executable, the step's on/off difference is this")
        return {"note": why, "step_ms_on_minus_off": on_minus_off}
    prof = profile_section(args, step, peak, PROFILED_DEFAULT, tag="_default")
    off = {c["component"]: c["ms_per_step"] for c in result.get("profile", {}).get("components", [])}
    prof["step_ms_on_minus_off"] = on_minus_off
    if "components" in prof:
        prof["ms_on_minus_off"] = {c["component"]: c["ms_per_step"] - off.get(c["component"], 0.0)
                                   for c in prof["components"]}
    return prof

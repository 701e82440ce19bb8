"""Readers of what a profiled step leaves behind: the jax.profiler trace (Perfetto JSON) and the compiled HLO text.

Pure functions over events / text, tested on hand-written traces and HLO (tests/test_gpu_bench.py):
  * `trace_events` / `device_ops`: the trace's complete events that name an HLO op (device streams where there are
    any, else XLA:CPU's host thunks) with self times;
  * `timeline`: GPU busy (union of device intervals) vs the step's wall time, kernel and device->host copy counts;
  * `hlo_instructions`: instruction name -> opcode, custom-call target, op_name metadata, the shapes' dimensions,
    its operands and their shapes' dimensions (resolved through the instructions that define them);
  * `attention_calls`: the cuDNN fused-attention custom calls (jax/_src/cudnn/fused_attention_stablehlo.py's
    targets "__cudnn$fmha...") with their mask_type and whether they take a bias operand, in compiled HLO or in
    a lowered StableHLO module.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
from typing import Any

# Named-scope path components that say how an op was traced, not where in the model it is.
_NOISE = re.compile(r"^(while|body|cond|branch_\d+(_fun)?|closed_call|checkpoint|remat|rematted_computation|"
                    r"core_call|eval_jaxpr|shard_map|custom_vjp_call|custom_jvp_call|pjit|scan|vmap)$")
_MEMCPY = re.compile(r"^Memcpy|^Memset", re.IGNORECASE)


def trace_events(trace_dir: str) -> tuple[list[dict[str, Any]], dict[int, str], str | None]:
    """All events of the newest trace under trace_dir, the pid -> process name map, and the file's path."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)) or \
        sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    if not paths:
        return [], {}, None
    with gzip.open(paths[-1], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return events, process_names(events), paths[-1]


def process_names(events: list[dict[str, Any]]) -> dict[int, str]:
    return {e["pid"]: e.get("args", {}).get("name", "") for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}


def on_device(events: list[dict[str, Any]], processes: dict[int, str]) -> list[dict[str, Any]]:
    """Complete ("X") events on a device process ("/device:GPU:0"): kernels, memcpys, memsets."""
    return [e for e in events if e.get("ph") == "X" and "/device:" in processes.get(e.get("pid"), "")]


def device_ops(events: list[dict[str, Any]], processes: dict[int, str]) -> list[dict[str, Any]]:
    """Events naming an HLO op as {hlo_op, module, op_name, kernel, dur_us}: device streams where there are any
    (GPU), else the host's XLA:CPU thunks, each with its self time (its nested children's time subtracted)."""
    ops = [e for e in events if e.get("ph") == "X" and isinstance(e.get("args"), dict) and "hlo_op" in e["args"]]
    dev = [e for e in ops if "/device:" in processes.get(e.get("pid"), "")]
    return [{"hlo_op": e["args"]["hlo_op"], "module": e["args"].get("hlo_module", ""),
             "op_name": e["args"].get("name", ""), "kernel": e.get("name", ""), "dur_us": t}
            for e, t in self_times(dev or ops)]


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


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (overlapping streams count once)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def timeline(device_events: list[dict[str, Any]], steps: int, wall_s: float) -> dict[str, Any]:
    """Per step: device busy ms (union of every device event's interval, all streams), idle = the host-timed
    wall per step less busy, the device span (first start to last end) less busy, kernel launches (device events
    that are not memcpy/memset) and device->host copies ("MemcpyD2H", or memcpy_details naming a host
    destination)."""
    if not device_events:
        return {"source": "no device events (CPU: XLA:CPU runs ops on host threads)", "steps": steps,
                "wall_ms_per_step": 1e3 * wall_s / steps}
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device_events]
    busy = union_us(spans)
    kernels = [e for e in device_events if not _MEMCPY.match(e.get("name", ""))]
    d2h = [e for e in device_events if is_d2h(e)]
    wall_ms = 1e3 * wall_s / steps
    return {
        "source": "device events of the trace: busy = union of their intervals; wall = host-timed profiled steps",
        "steps": steps, "wall_ms_per_step": wall_ms, "busy_ms_per_step": busy / 1e3 / steps,
        "idle_ms_per_step": wall_ms - busy / 1e3 / steps,
        "span_idle_ms_per_step": (max(e for _, e in spans) - min(s for s, _ in spans) - busy) / 1e3 / steps,
        "kernels_per_step": len(kernels) / steps, "d2h_copies_per_step": len(d2h) / steps,
        "d2h_bytes_per_step": sum(_memcpy_bytes(e) for e in d2h) / steps,
    }


def is_d2h(e: dict[str, Any]) -> bool:
    details = str(e.get("args", {}).get("memcpy_details", ""))
    return e.get("name", "") == "MemcpyD2H" or ("kind_dst:host" in details and "kind_src:device" in details)


def _memcpy_bytes(e: dict[str, Any]) -> int:
    m = re.search(r"size:(\d+)", str(e.get("args", {}).get("memcpy_details", "")))
    return int(m.group(1)) if m else 0


def scope_of(op_name: str) -> tuple[str, str]:
    """("moe_layers/moe/moe_dispatch/experts", "bwd") from a jax op_name; the primitive (last part) is dropped, and
    the transformations jax wraps a scope in are unwrapped ("transpose(jvp(lm_head))" -> "lm_head"; a
    "jit(f)" names a function, not a scope, and is dropped)."""
    direction = "bwd" if "transpose(" in op_name else "fwd"
    parts = []
    for p in op_name.split("/")[:-1]:
        while (m := re.fullmatch(r"(jvp|transpose|vmap|remat|checkpoint|pjit|shard_map)\((.*)\)", p)):
            p = m.group(2)
        if re.fullmatch(r"[A-Za-z_][\w\-]*", p) and not _NOISE.match(p):
            parts.append(p)
    return "/".join(parts) or "(unscoped)", direction


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_DIMS = re.compile(r"\b(?:pred|[su](?:4|8|16|32|64)|[bf]f?\d+|f8e\w+)\[([\d,]*)\]")


def hlo_instructions(hlo_text: str) -> dict[str, dict[str, Any]]:
    """Instruction name -> {opcode, target (custom-call target or ""), op_name (metadata), dims (every dimension
    of the shapes on its line), result_dims (its result shape's), operands (the names it reads), operand_dims (the
    result dims of those operands' defining instructions), called_opcodes (the opcodes of the computation a fusion
    calls), text (the line)} over every computation of HLO text. operand_dims: an op line need not print its
    operands' shapes, so a head GEMM's vocab dimension may sit only on the line that defines its [tokens, vocab]
    operand; called_opcodes: XLA:CPU wraps some dots in fusions (ynn_fusion.N) whose own opcode is "fusion"."""
    out, opcodes, computation = {}, collections.defaultdict(set), ""
    for line in hlo_text.splitlines():
        if " = " not in line and (c := _COMPUTATION.match(line)):
            computation = c.group(1)
            continue
        m = _INSTR.match(line)
        if not m or line.lstrip().startswith(("HloModule", "ENTRY", "%fused", "}")):
            continue
        rest = m.group(2)
        i = _closing(rest, 0) + 1 if rest.startswith("(") else 0  # a tuple shape: the opcode follows it
        op = re.match(r"\s*([\w\-]+)\(" if i else r"\S+\s+([\w\-]+)\(", rest[i:])
        if not op:
            continue
        args_at = i + op.end() - 1  # the opcode's "("
        target = re.search(r'custom_call_target="([^"]+)"', line)
        name = re.search(r'op_name="([^"]*)"', line)
        body = line.split("metadata=")[0]
        opcodes[computation].add(op.group(1))
        out[m.group(1)] = {"opcode": op.group(1), "target": target.group(1) if target else "",
                           "op_name": name.group(1) if name else "", "dims": _dims(body),
                           "result_dims": _dims(rest[:args_at]),
                           "operands": _operands(rest[args_at + 1:_closing(rest, args_at)]),
                           "text": line.strip()}
    for ins in out.values():
        ins["operand_dims"] = {d for o in ins["operands"] if o in out for d in out[o]["result_dims"]}
        calls = re.search(r"\bcalls=%?([\w.\-]+)", ins["text"].split("metadata=")[0])
        ins["called_opcodes"] = opcodes.get(calls.group(1), set()) if calls else set()
    return out


def _dims(text: str) -> set[int]:
    return {int(d) for s in _DIMS.findall(text) for d in s.split(",") if d}


def _closing(text: str, start: int) -> int:
    """Index of the bracket that closes the one at text[start] (the end of text if none does)."""
    depth = 0
    for i in range(start, len(text)):
        depth += (text[i] in "([{") - (text[i] in ")]}")
        if depth == 0:
            return i
    return len(text)


def _operands(args: str) -> list[str]:
    """Operand names of an argument list, "bf16[8,4]{1,0} %a, %b" or "a, b": each top-level item's last word."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(args + ","):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            items.append(args[start:i].split()[-1].lstrip("%") if args[start:i].split() else "")
            start = i + 1
    return [x for x in items if x]


_FMHA = re.compile(r"(__cudnn\$fmha\w*)")
_MASK = re.compile(r'mask_type(?:\\22|\\"|")\s*:\s*(?:\\22|\\"|")(\w+)')


_SEGMENTS = re.compile(r'max_seg_per_batch(?:\\22|\\"|")?\s*:\s*(?:\\22|\\"|")?(\d+)')


def attention_calls(text: str) -> dict[str, Any]:
    """The cuDNN fused-attention calls in compiled HLO or StableHLO text. `ok`: at least one call, every call
    causal (mask_type CAUSAL, or PADDING_CAUSAL for packed rows; a missing mask_type is the proto default NO_MASK),
    none with a bias operand (the "...Bias..." targets: jax turns a dense mask into an additive bias, and cuDNN
    then computes every (s, t) pair), and as many forward as backward calls (more forwards: remat re-runs the
    attention forward in the backward)."""
    calls = []
    for line in text.splitlines():
        m = _FMHA.search(line)
        if not m or not ("custom_call" in line or "custom-call" in line):
            continue
        mask, segments = _MASK.search(line), _SEGMENTS.search(line)
        calls.append({"target": m.group(1), "backward": "Backward" in m.group(1), "bias": "Bias" in m.group(1),
                      "mask_type": mask.group(1) if mask else "NO_MASK (absent)",
                      "segments": int(segments.group(1)) if segments else None})
    masks = collections.Counter(c["mask_type"] for c in calls)
    forward, backward = sum(not c["backward"] for c in calls), sum(c["backward"] for c in calls)
    causal = all(c["mask_type"] in ("CAUSAL", "PADDING_CAUSAL") and not c["bias"] for c in calls)
    ok = bool(calls) and causal and forward == backward
    why = ("no cuDNN fused-attention call in the module" if not calls else
           "every cuDNN attention call is causal without a bias operand, one forward per backward" if ok else
           f"mask types {dict(masks)}, {sum(c['bias'] for c in calls)} of {len(calls)} calls take a bias operand"
           if not causal else f"{forward} forward calls for {backward} backward: remat re-runs the forward")
    return {"ok": ok, "why": why, "calls": len(calls), "forward": forward, "backward": backward,
            "with_bias": sum(c["bias"] for c in calls), "mask_types": dict(masks),
            "max_seg_per_batch": sorted({c["segments"] for c in calls if c["segments"] is not None}),
            "targets": sorted({c["target"] for c in calls})}

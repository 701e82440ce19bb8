"""Where a step's device time goes, by model component, against each component's FLOPs.

`classify` maps one profiled op (its named-scope path, its HLO instruction, its kernel name) to a component;
`component_flops` gives each component's FLOPs per step from the config by hand formulas (the model-FLOP
convention of glm46_jax/model/counting.py: 2 per multiply-add forward, twice that backward; the model-FLOP
components sum to counting.flops_per_token x tokens); `attention_hw_flops` the attention rows' hardware FLOPs from
the packed batch's documents; `table` joins them with the measured matmul peak. Pure functions, tested on
hand-written ops (tests/test_gpu_bench.py).
"""

from __future__ import annotations

import collections
import itertools
import re
from typing import Any

# In report order. "(recompute)" and Newton-Schulz are hardware FLOPs beyond the model FLOPs of MFU.
COMPONENTS = (
    "attention fwd", "attention fwd (recompute)", "attention bwd", "attention projections + rest",
    "expert GEMMs", "expert permutes", "experts other", "heads (lm_head + MTP head)", "cross-entropy",
    "MTP layer", "Newton-Schulz", "optimizer elementwise", "other GEMMs", "other elementwise")
_GEMM = re.compile(r"gemm|cublas|matmul|triton_gemm|ragged|nvjet|cutlass|xmma|wgmma|sm90_.*gemm", re.IGNORECASE)
# Pallas Mosaic-GPU kernels: jax discharges core_map into an HLO op named mpmd_map.N (custom call mosaic_gpu*).
_MOSAIC = re.compile(r"^mpmd_map|mosaic_gpu", re.IGNORECASE)
_PERMUTE = re.compile(r"gather|scatter|sort|dynamic[-_]slice|dynamic[-_]update[-_]slice|concatenate|transpose|"
                      r"copy|pad|cub", re.IGNORECASE)


def is_gemm(instr: dict[str, Any], kernel: str = "") -> bool:
    opcode, target = instr.get("opcode", ""), instr.get("target", "")
    if target.startswith("__cudnn$fmha"):
        return False
    return (opcode in ("dot", "convolution", "ragged-dot") or bool(_GEMM.search(target))
            or (opcode == "fusion" and bool(instr.get("called_opcodes", set()) & {"dot", "convolution"}))
            or bool(_GEMM.search(instr.get("name", ""))) or bool(_GEMM.search(kernel))
            or "__triton_gemm" in instr.get("text", ""))


def is_mosaic(instr: dict[str, Any], kernel: str = "") -> bool:
    """A Pallas Mosaic-GPU kernel: only the experts' grouped GEMMs are written that way (model/grouped_gemm.py), so
    it is a GEMM where it sits under the experts' scope."""
    return any(_MOSAIC.search(x) for x in (instr.get("name", ""), instr.get("target", ""), kernel))


def classify(scope: str, direction: str, instr: dict[str, Any], kernel: str, vocab: int) -> str:
    """One op's component. scope/direction: `hlo_trace.scope_of(op_name)`; instr: its `hlo_instructions` entry
    plus "name" (the HLO instruction name); kernel: the trace event's kernel name; vocab: the model's vocab size
    (a GEMM with a vocab-wide shape, its own or an operand's, is a head wherever its scope is; a non-GEMM one
    outside the optimizer a cross-entropy pass)."""
    parts = set(scope.split("/"))
    target = instr.get("target", "")
    gemm = is_gemm(instr, kernel)
    if "newton_schulz" in parts:  # training/muon.py's scope: its GEMMs and the casts between them
        return "Newton-Schulz"
    if "optimizer" in parts:  # a profile of a checkout without that scope
        return "Newton-Schulz" if gemm else "optimizer elementwise"
    if target.startswith("__cudnn$fmha") or "dot_product_attention" in instr.get("name", ""):
        if "Backward" in target or "bwd" in instr.get("name", ""):
            return "attention bwd"
        return "attention fwd (recompute)" if direction == "bwd" else "attention fwd"
    wide = vocab in instr.get("dims", ())
    if gemm and (wide or vocab in instr.get("operand_dims", ()) or "lm_head" in parts):
        return "heads (lm_head + MTP head)"
    if parts & {"loss", "mtp_loss", "lm_head"} and "aux_loss" not in parts:
        return "cross-entropy"
    if wide and not _PERMUTE.search(instr.get("opcode", "") + " " + instr.get("name", "")):
        return "cross-entropy"  # the fp32 casts and softmax passes over [tokens, vocab] around the heads
    if "mtp" in parts:
        return "MTP layer"
    if "experts" in parts:
        if gemm or is_mosaic(instr, kernel):
            return "expert GEMMs"
        primitive = instr.get("op_name", "").rsplit("/", 1)[-1]  # the jax primitive: gather, scatter-add, sort
        if _PERMUTE.search(" ".join((instr.get("opcode", ""), instr.get("name", ""), target, kernel, primitive))):
            return "expert permutes"
        return "experts other"
    if "attention" in parts:
        return "attention projections + rest"
    return "other GEMMs" if gemm else "other elementwise"


def muon_matrices(c) -> list[tuple[int, int, int]]:
    """(count, rows, cols) of the matrices Muon orthogonalises per step (training/muon.py's muon_dims: q/k/v/o
    per head, experts per expert, FFNs and eh_proj whole; router, embedding and lm_head go to AdamW)."""
    d, hd = c.hidden_size, c.head_dim
    attn = [(c.num_attention_heads, d, hd), (2 * c.num_key_value_heads, d, hd), (c.num_attention_heads, hd, d)]
    moe = attn + [(3 * c.n_routed_experts, d, c.moe_intermediate_size)]
    if c.n_shared_experts:
        moe.append((3, d, c.moe_intermediate_size * c.n_shared_experts))
    out = []
    for n, layer in ((c.num_dense_layers, attn + [(3, d, c.intermediate_size)]), (c.num_moe_layers, moe),
                     (c.num_nextn_predict_layers, moe + [(1, 2 * d, d)])):
        out += [(n * k, r, col) for k, r, col in layer if n]
    return out


def ns_flops(rows: int, cols: int, steps: int = 5) -> int:
    """Newton-Schulz on one [rows, cols] matrix, m = min, n = max: per iteration A = X X^T (2 m^2 n), A A (2 m^3),
    B X (2 m^2 n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def newton_schulz_flops(c, steps: int = 5) -> int:
    """Per optimizer step, over every Muon matrix."""
    return sum(k * ns_flops(r, col, steps) for k, r, col in muon_matrices(c))


def component_flops(c, batch: int, seq_len: int, mtp: bool = True, ns_steps: int | None = 5) -> dict[str, int]:
    """FLOPs per step of each component with a matmul count; the model-FLOP ones ("(recompute)" and
    Newton-Schulz aside) add up to counting.flops_per_token(c, seq_len) x batch x seq_len (with `mtp`)."""
    t = batch * seq_len
    d, hd, nh, nkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    layers = c.num_hidden_layers
    n_mtp = c.num_nextn_predict_layers if mtp else 0
    core_fwd = 2 * t * seq_len * nh * hd  # QK^T + PV at full length, halved by the causal mask
    proj = 2 * d * (nh * hd) + 2 * d * (nkv * hd)  # q, o + k, v weights a token multiplies
    expert = (c.num_experts_per_tok) * 3 * d * c.moe_intermediate_size
    shared = c.n_shared_experts * 3 * d * c.moe_intermediate_size
    moe_rest = shared + c.n_routed_experts * d  # shared expert + router
    # The cuDNN calls of every attention site (the MTP layer's too) are the attention rows; the MTP row is the
    # rest of its layer (eh_proj, projections, experts).
    sites = layers + n_mtp
    mtp_layer = n_mtp * 6 * t * (proj + expert + moe_rest + 2 * d * d)
    out = {
        "attention fwd": sites * core_fwd, "attention fwd (recompute)": sites * core_fwd,
        "attention bwd": 2 * sites * core_fwd, "attention projections + rest": 6 * t * proj * layers,
        "expert GEMMs": 6 * t * expert * c.num_moe_layers,
        "heads (lm_head + MTP head)": 6 * t * c.vocab_size * d * (1 + n_mtp),
        "MTP layer": mtp_layer,
        "other GEMMs": 6 * t * (c.num_dense_layers * 3 * d * c.intermediate_size + c.num_moe_layers * moe_rest),
    }
    if ns_steps:
        out["Newton-Schulz"] = newton_schulz_flops(c, ns_steps)
    return out


MODEL_FLOP_COMPONENTS = ("attention fwd", "attention bwd", "attention projections + rest", "expert GEMMs",
                         "heads (lm_head + MTP head)", "MTP layer", "other GEMMs")


def head_flops_per_token(c, mtp: bool = True) -> int:
    """Model FLOPs per token of the vocab heads (lm_head, and the MTP layer's with `mtp`): the part of MFU a body
    MFU leaves out (at vocab 151,552 and d 1,024 they are 46% of `small`'s model FLOPs)."""
    return 6 * c.vocab_size * c.hidden_size * (1 + (c.num_nextn_predict_layers if mtp else 0))


def document_lengths(segment_ids) -> list[int]:
    """Lengths of the runs of one segment id along each row of a [rows, seq] batch (its packed documents, counted
    as attention.segment_layout counts them)."""
    return [len(list(run)) for row in segment_ids for _, run in itertools.groupby(row)]


def causal_pairs(lengths) -> int:
    """(query, key) pairs causal attention within each document needs: sum of L (L + 1) / 2."""
    return sum(n * (n + 1) // 2 for n in lengths)


def attention_hw_flops(c, pairs: int, mtp: bool = True) -> dict[str, int]:
    """Hardware FLOPs of the attention rows for a batch whose documents need `pairs` causal pairs: QK^T and PV, 4 x
    head_dim per pair and head, at every attention site; twice that backward. component_flops' MFU convention
    instead counts seq^2 / 2 pairs per row whatever the documents (as Megatron and MaxText do)."""
    sites = c.num_hidden_layers + (c.num_nextn_predict_layers if mtp else 0)
    fwd = 4 * c.num_attention_heads * c.head_dim * pairs * sites
    return {"attention fwd": fwd, "attention fwd (recompute)": fwd, "attention bwd": 2 * fwd}


def table(ms: dict[str, float], flops: dict[str, int], peak_flops: float,
          hw_flops: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """One row per component: ms per step, FLOPs, achieved TFLOP/s, the hardware FLOPs and TFLOP/s where they
    differ from the model FLOPs (`hw_flops`: the attention rows), and the ideal ms at the measured matmul peak
    (None where the component has no matmul FLOPs: permutes, cross-entropy, elementwise passes)."""
    rows, hw_flops = [], hw_flops or {}
    for name in COMPONENTS:
        if name not in ms and not flops.get(name):
            continue
        t, f, hw = ms.get(name, 0.0), flops.get(name), hw_flops.get(name)
        rows.append({"component": name, "ms_per_step": t, "flops": f, "tflops": _tflops(f, t),
                     "hw_flops": hw, "hw_tflops": _tflops(hw, t),
                     "ideal_ms": 1e3 * (hw or f) / peak_flops if (hw or f) and peak_flops else None})
    return rows


def _tflops(flops: int | None, ms: float) -> float | None:
    return flops / (ms / 1e3) / 1e12 if flops and ms else None


def above_peak(rows: list[dict[str, Any]], peak_tflops: float) -> list[str]:
    """One line per row whose rate (hardware TFLOP/s where known, else model) is above the measured matmul peak:
    impossible, so its ops are misattributed or its FLOPs miscounted."""
    out = []
    for r in rows:
        rate = r.get("hw_tflops") or r.get("tflops")
        if rate and rate > peak_tflops:
            kind = "hardware" if r.get("hw_tflops") else "model"
            out.append(f"row {r['component']!r}: {rate:.1f} {kind} TFLOP/s in {r['ms_per_step']:.2f} ms is above "
                       f"the measured matmul peak {peak_tflops:.1f} TFLOP/s")
    return out


def sum_by_component(ops: list[dict[str, Any]], instrs: dict[str, dict[str, Any]], vocab: int, steps: int,
                     scope_of) -> dict[str, float]:
    """ms per step per component over the profiled ops (`hlo_trace.device_ops`), scopes from the HLO's
    op_name metadata (else the trace event's own op name)."""
    out: dict[str, float] = collections.defaultdict(float)
    for o in ops:
        instr = {**instrs.get(o["hlo_op"], {}), "name": o["hlo_op"]}
        scope, direction = scope_of(instr.get("op_name") or o.get("op_name", ""))
        out[classify(scope, direction, instr, o.get("kernel", ""), vocab)] += o["dur_us"] / 1e3 / steps
    return dict(out)

"""report.md from result.json (benchmarks/gpu/step.py writes both after every section), the profile's top tables,
the library versions the report names, and the checks whose failure fails the run."""

from __future__ import annotations

import collections
import importlib.metadata
from typing import Any

import components
import hlo_trace

GOALS = {"tokens_per_s": 85_000, "mfu": 0.35, "hf_ratio": 1.5, "moe_over_dense": 1.3, "d2h": 0}


def top(ops: list[dict[str, Any]], instrs: dict[str, dict[str, Any]], steps: int, n: int, by: str
        ) -> list[dict[str, Any]]:
    """ms per step summed by named scope + pass (`by="scope"`) or by HLO op (`by="op"`), largest first."""
    total = sum(o["dur_us"] for o in ops)
    table: dict[tuple, float] = collections.defaultdict(float)
    for o in ops:
        scope = hlo_trace.scope_of(instrs.get(o["hlo_op"], {}).get("op_name") or o.get("op_name", ""))
        table[scope if by == "scope" else (o["hlo_op"], "{} ({})".format(*scope))] += o["dur_us"]
    keys = ("scope", "pass") if by == "scope" else ("hlo_op", "scope")
    return [{keys[0]: k[0], keys[1]: k[1], "ms_per_step": v / 1e3 / steps, "share": v / total if total else 0.0}
            for k, v in sorted(table.items(), key=lambda kv: -kv[1])[:n]]


def library_versions() -> dict[str, Any]:
    """cuDNN / cuBLAS / CUDA as jax's CUDA plugin reports them, and the nvidia-* pip packages ("n/a" on CPU)."""
    out: dict[str, Any] = {}
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        cuda_versions = None
    for name in ("cudnn_get_version", "cublas_get_version", "cuda_runtime_get_version", "cuda_driver_get_version",
                 "cupti_get_version"):
        try:
            out[name.replace("_get_version", "")] = getattr(cuda_versions, name)() if cuda_versions else "n/a"
        except Exception as err:  # noqa: BLE001 - one missing query leaves the others
            out[name.replace("_get_version", "")] = f"n/a ({type(err).__name__})"
    out["nvidia_pip"] = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
                               if (d.metadata["Name"] or "").lower().startswith(("nvidia-", "jax-cuda")))
    return out


def _f(x, fmt="{:.1f}", none="—") -> str:
    return none if x is None else fmt.format(x)


def measured_peak_tflops(r: dict[str, Any]) -> float | None:
    """The best matmul rate measured in the run: the peak probe or the probes interleaved with the steps."""
    rates = [r.get("matmul_peak", {}).get("tflops"), r.get("step_variants", {}).get("matmul_peak_interleaved_tflops")]
    return max((x for x in rates if x), default=None)


def checks(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Each check {check, ok, enforced, why}: no profiled component row above the measured matmul peak (such a row
    is misattributed or miscounted). Enforced on a GPU; the CPU fallback's numbers say nothing, it only reports."""
    peak, out = measured_peak_tflops(r), []
    for key in ("profile", "profile_default"):
        if peak and "components" in (r.get(key) or {}):
            why = components.above_peak(r[key]["components"], peak)
            out.append({"check": f"{key}: no component row above the measured matmul peak ({peak:.1f} TFLOP/s)",
                        "ok": not why, "enforced": r.get("platform") == "gpu", "why": why})
    return out


def failures(r: dict[str, Any]) -> list[str]:
    """One line per enforced check that failed (step.py then exits non-zero, so run.sh's call fails)."""
    return [f"{c['check']}: {line}" for c in r.get("checks", []) if c["enforced"] and not c["ok"] for line in c["why"]]


def _components(prof: dict[str, Any], diff: dict[str, float] | None = None) -> list[str]:
    lines = ["", ("| component | ms / step | GFLOP / step | TFLOP/s | hardware TFLOP/s | ideal ms at measured peak |"
                  + (" ms on - off |" if diff else "")), "|---|---|---|---|---|---|" + ("---|" if diff else "")]
    return lines + [f"| {c['component']} | {c['ms_per_step']:.2f} | {_f(c['flops'] and c['flops'] / 1e9, '{:,.1f}')} "
                    f"| {_f(c['tflops'])} | {_f(c.get('hw_tflops'))} | {_f(c['ideal_ms'], '{:.2f}')} |"
                    + (f" {diff.get(c['component'], 0.0):+.2f} |" if diff else "") for c in prof["components"]]


def markdown(r: dict[str, Any]) -> str:
    lines = [f"## GPU train-step benchmark (`benchmarks/gpu/run.sh`), {r['date']}", "",
             (f"- device: {r.get('device', '?')} ({r.get('platform', '?')}), jax {r['jax']}, Python {r['python']}, "
             f"commit {r['commit']}"),
             f"- libraries: {r.get('libraries', {})}",
             f"- XLA_FLAGS: `{r['xla_flags_env'] or '(none)'}`"]
    if "matmul_peak" in r:
        sv = r.get("step_variants", {})
        probes = "".join(f"; {n} {v:.1f}" for n, v in sv.get("matmul_probes_tflops", {}).items())
        lines.append(f"- measured {r['matmul_peak']['dtype']} matmul peak: {r['matmul_peak']['tflops']:.1f} TFLOP/s"
                     + (f" (interleaved with the steps, random data: {sv['matmul_peak_interleaved_tflops']:.1f}"
                        f"{probes})" if sv else ""))
    rows = [("ours, default (Muon + MTP)", r.get("train_step")), ("ours, HF-equivalent", r.get("hf_equivalent"))]
    hf = r.get("hf_transformers")
    if any(v for _, v in rows) or (hf and "tokens_per_s" in hf):
        lines += ["", ("| row | tokens/s | model TFLOP/s | MFU vs 989 | body MFU (no vocab heads) | step ms | "
                       "peak memory | vs HF |"), "|---|---|---|---|---|---|---|---|"]
        for name, s in rows:
            if s:
                lines.append(f"| {name} ({s['global_batch']} x {s['seq_len']}, remat {s['remat']}) | "
                             f"{s['tokens_per_s']:,.0f} | {s['achieved_tflops']:.1f} | "
                             f"{s['mfu_vs_datasheet_989']:.1%} | {_f(s.get('body_mfu_vs_datasheet_989'), '{:.1%}')} | "
                             f"{s['step_s_median'] * 1e3:.1f} | "
                             f"{s['peak_memory_gib']:.2f} GiB | {_f(s.get('vs_hf_transformers'), '{:.2f}x')} |")
    if hf:
        if "tokens_per_s" in hf:
            lines.append(f"| HF transformers {hf['transformers']} ({hf['experts_implementation']} experts, "
                         f"{hf['attn_implementation']}, {hf['dtype']}) | {hf['tokens_per_s']:,.0f} | "
                         f"{hf['achieved_tflops']:.1f} | {hf['achieved_tflops'] / 989.4:.1%} | — | "
                         f"{hf['step_s_median'] * 1e3:.1f} | {_f(hf.get('peak_gib'), '{:.2f} GiB')} | 1.00x |")
        else:
            lines += ["", f"HF transformers: {hf.get('skipped') or hf.get('error')}"]
    sv = r.get("step_variants")
    if sv:
        lines += ["", "Full step, XLA option sets interleaved in one process:", "",
                  "| options | step ms | tokens/s | vs default | compile s | command_buffer in HLO |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {n} `{v['options']}` | {v['step_ms_median']:.1f} | {v['tokens_per_s']:,.0f} | "
                  f"{v['vs_default']:.3f} | {v['compile_s']:.0f} | {v.get('command_buffer_mentions', '—')} |"
                  for n, v in sv.items() if isinstance(v, dict) and "step_ms_median" in v]
    a = r.get("attention_hlo")
    if a:
        lines += ["", (f"Attention in the compiled step: **{'OK' if a['ok'] else 'NOT OK'}**: {a['why']} "
                      f"({a['forward']} forward, {a['backward']} backward calls; targets {a['targets']})")]
    prof = r.get("profile")
    if prof and "components" in prof:
        t = prof["timeline"]
        if "busy_ms_per_step" in t:
            lines += ["", (f"Profile ({prof['steps']} steps, command buffers off): wall {t['wall_ms_per_step']:.1f} ms"
                           f"/step, GPU busy {t['busy_ms_per_step']:.1f}, idle {t['idle_ms_per_step']:.1f} (inside "
                           f"the device span {t['span_idle_ms_per_step']:.1f}); {t['kernels_per_step']:,.0f} kernels "
                           f"and **{t['d2h_copies_per_step']:,.0f} device->host copies** per step")]
        else:
            lines += ["", f"Profile ({prof['steps']} steps): {t['source']}"]
        p = prof.get("attention_pairs")
        if p:
            lines += ["", (f"Attention: {p['documents']:,} documents need {p['causal_pairs']:,} causal pairs, "
                           f"{p['hardware_over_convention']:.1%} of the MFU convention's seq^2 / 2 per row "
                           f"({p['mfu_convention_pairs']:,}): the hardware TFLOP/s column counts those")]
        lines += _components(prof)
        lines += ["", "| named scope | pass | ms / step | share |", "|---|---|---|---|"]
        lines += [f"| {x['scope']} | {x['pass']} | {x['ms_per_step']:.2f} | {x['share']:.1%} |"
                  for x in prof["by_scope"]]
        lines += ["", "| HLO op | scope (pass) | ms / step | share |", "|---|---|---|---|"]
        lines += [f"| {x['hlo_op']} | {x['scope']} | {x['ms_per_step']:.2f} | {x['share']:.1%} |"
                  for x in prof["by_op"]]
    pd = r.get("profile_default")
    if pd:
        on_off = _f(pd.get("step_ms_on_minus_off"), "{:+.1f} ms")
        if "components" in pd:
            t = pd["timeline"]
            lines += ["", (f"Profile of the default executable ({pd['variant']!r}, command buffers on): wall "
                           f"{t['wall_ms_per_step']:.1f} ms/step, GPU busy {_f(t.get('busy_ms_per_step'))}, of it "
                           f"{_f(pd.get('unattributed_ms_per_step'))} ms in kernels no HLO op names; the step, "
                           f"on - off: {on_off}")]
            lines += _components(pd, pd.get("ms_on_minus_off"))
        else:
            lines += ["", f"Default executable: {pd.get('note') or pd.get('error')} (step, on - off: {on_off})"]
    m = r.get("moe")
    if m:
        sh = m["shapes"]
        lines += ["", (f"MoE layer alone ({sh['tokens']} tokens, d {sh['d_model']}, {sh['experts']} experts x "
                       f"{sh['expert_ffn']} top-{sh['top_k']} + {sh['shared']} shared, {sh['dtype']}, loop block "
                       f"{sh['block']} x group {sh['group']}; fwd + bwd) vs a dense FFN of width {sh['dense_ffn']}: "
                       f"{m['dense']['median_ms']:.2f} ms, {m['dense']['tflops']:.1f} TFLOP/s"), "",
                  ("| impl | ms | TFLOP/s | MoE / dense | padded rows | trips | per-trip overhead us | "
                  "max abs diff vs loop (out / grads) |"), "|---|---|---|---|---|---|---|---|"]
        for name, x in m["impls"].items():
            if "error" in x:
                lines.append(f"| {name} | error: {x['error']} | | | | | | |")
                continue
            diff = x.get("max_abs_diff_vs_loop")
            lines.append(f"| {name} | {x['median_ms']:.2f} | {x['tflops']:.1f} | **{x['moe_over_dense']:.2f}** | "
                         f"{x.get('padded_rows', '—')} | {x.get('trips', '—')} | "
                         f"{_f(x.get('per_trip_overhead_us'))} | "
                         f"{'{:.3g} / {:.3g}'.format(diff['output'], diff['grads']) if diff else 'reference'} |")
        if "flags" in m:
            lines += ["", "MoE layer (loop), XLA option sets interleaved:", "",
                      "| options | ms | vs default | compiled HLO differs from default's |", "|---|---|---|---|"]
            lines += [f"| {n} | {v['median_ms']:.3f} | {v['vs_first']:.3f} | "
                      f"{_f(v.get('hlo_differs_from_first'), '{}')} |" for n, v in m["flags"].items()]
    if r.get("checks"):
        lines += ["", "Checks:"] + [f"- {'OK' if c['ok'] else 'FAILED'}{'' if c['enforced'] else ' (not enforced)'}: "
                                    f"{c['check']}" + "".join(f"; {w}" for w in c["why"]) for c in r["checks"]]
    if r["skipped"]:
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in r["skipped"].items())]
    if r["errors"]:
        lines += ["", "Errors: " + "; ".join(f"{k}: {str(v)[:500]}" for k, v in r["errors"].items())]
    return "\n".join(lines) + "\n"

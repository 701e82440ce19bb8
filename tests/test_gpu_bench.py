"""benchmarks/gpu: the one-command GPU benchmark is complete. Its CPU fallback runs end to end through run.sh
(every section, no errors, the files the device tool brings back), its FLOP counts equal hand-counted ones, and
the profile parser's pieces give hand-computed answers on hand-written traces and HLO."""

import gzip
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
GPU = os.path.join(ROOT, "benchmarks", "gpu")


def _step_module():
    spec = importlib.util.spec_from_file_location("gpu_step", os.path.join(GPU, "step.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_run_sh_cpu_fallback_reports_every_section(tmp_path):
    out, empty = tmp_path / "out", tmp_path / "no_wheels"
    empty.mkdir()
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "GPU_BENCH_WHEELS": str(empty),
           "GPU_BENCH_SITE": str(tmp_path / "site")}
    proc = subprocess.run(["bash", os.path.join(GPU, "run.sh"), "--cpu"], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CPU fallback" in proc.stdout and "no " in proc.stdout and "whl here" in proc.stdout
    assert {"result.json", "report.md", "trace.json.gz", "log.txt"} <= set(os.listdir(out))
    r = json.loads((out / "result.json").read_text())
    assert r["errors"] == {} and r["platform"] == "cpu"

    s = r["train_step"]
    # tiny preset, fp32, XLA attention, dropless, 2 x 32 tokens (step.py's CPU defaults)
    assert (s["preset"], s["dtype"], s["global_batch"], s["seq_len"]) == ("tiny", "float32", 2, 32)
    assert s["tokens_per_s"] == pytest.approx(64 / s["step_s_median"])
    assert s["mfu_vs_datasheet_989"] == pytest.approx(s["achieved_tflops"] / 989.4)
    assert s["mfu_vs_measured_matmul"] == pytest.approx(s["achieved_tflops"] / r["matmul_peak"]["tflops"])
    assert 0 < s["mfu_vs_measured_matmul"] < 1 and s["peak_memory_gib"] > 0
    assert 5.5 < s["final_loss"] < 9  # CE ~ ln 512 + MTP + aux on random tokens

    m = r["moe_vs_dense"]
    # tiny: d 64, 8 experts x 32, top-2, 1 shared -> dense width 96. fwd FLOPs/token: 3 matmuls of 2*d*96, the
    # MoE adds the router's 2*d*8; fwd + bwd = 3 x fwd.
    assert m["shapes"]["dense_ffn"] == 96 and m["shapes"]["tokens"] == 64
    assert m["dense"]["flops_per_token"] == 3 * (3 * 2 * 64 * 96)
    assert m["moe"]["flops_per_token"] == 3 * (3 * 2 * 64 * 96 + 2 * 64 * 8)
    assert m["moe_over_dense"] == pytest.approx(m["moe"]["median_ms"] / m["dense"]["median_ms"])

    prof = r["profile"]
    scopes = {(row["scope"], row["pass"]) for row in prof["by_scope"]}
    # the model's named scopes reach the table, forward and backward
    for scope in ("moe/moe_dispatch/experts", "attention"):
        assert {(scope, "fwd"), (scope, "bwd")} <= scopes, scopes
    assert prof["op_ms_per_step"] > 0 and sum(row["share"] for row in prof["by_scope"]) <= 1 + 1e-9
    with gzip.open(out / "trace.json.gz", "rt") as f:
        assert "traceEvents" in json.load(f)
    report = (out / "report.md").read_text()
    for heading in ("MFU vs 989 TFLOP/s", "MoE / dense", "| named scope | pass |", "| HLO op |"):
        assert heading in report


def test_self_times_subtract_nested_children():
    """A while thunk (0-100 us) holding two body ops (10-30, 40-90) and a nested op in the second (50-60), plus
    a separate op on another thread: self times 100-20-50 = 30, 20, 50-10 = 40, 10 and 7."""
    step = _step_module()
    ev = lambda name, ts, dur, tid=1: {"name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}
    events = [ev("while", 0, 100), ev("a", 10, 20), ev("b", 40, 50), ev("c", 50, 10), ev("d", 5, 7, tid=2)]
    got = {e["name"]: t for e, t in step.self_times(events)}
    assert got == {"while": 30, "a": 20, "b": 40, "c": 10, "d": 7}


def test_scopes_come_from_hlo_metadata_without_tracing_noise():
    step = _step_module()
    hlo = (
        'HloModule jit_step\n'
        '  %fusion.3 = f32[4]{0} fusion(%p), kind=kLoop, calls=%f, metadata={op_name="jit(step)/jvp(jit(loss))/'
        'while/body/moe_layers/moe/moe_dispatch/experts/dot_general" source_file="x.py"}\n'
        '  ROOT %dot.7 = f32[4]{0} dot(%a, %b), metadata={op_name="jit(step)/transpose(jvp(jit(loss)))/'
        'eval_jaxpr/attention/dot_general"}\n'
        '  %copy.1 = f32[4]{0} copy(%a)\n')
    scopes = step.hlo_scopes(hlo)
    assert set(scopes) == {"fusion.3", "dot.7"}
    assert step.scope_of(scopes["fusion.3"]) == ("moe_layers/moe/moe_dispatch/experts", "fwd")
    assert step.scope_of(scopes["dot.7"]) == ("attention", "bwd")
    assert step.scope_of("")[0].startswith("(unscoped")

"""benchmarks/gpu: the one-call GPU benchmark is complete. The GPU run's own configuration builds and validates here
(the same function, platform "gpu"); its CPU fallback runs end to end through run.sh (every section, no errors,
the files the device tool brings back); the trace / HLO readers and the component classifier give hand-counted
answers on hand-written traces and HLO; the component FLOPs add up to counting.flops_per_token; the attention
check reads a real cuDNN module cross-lowered for CUDA on this CPU; the profile adds up (issue 73): Mosaic-GPU
kernels, heads found through their operands, Newton-Schulz's own scope, attention's hardware FLOPs, the peak check."""

import gzip
import importlib.util
import json
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm46_jax.bench import synthetic_batch
from glm46_jax.config import TINY, get_preset, to_hf_config
from glm46_jax.model import counting

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
GPU = os.path.join(ROOT, "benchmarks", "gpu")


def _module(name):
    if GPU not in sys.path:
        sys.path.insert(0, GPU)  # step.py imports its sibling modules by name, as it does when run as a script
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", os.path.join(GPU, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_run_configuration_builds_and_validates():
    """What `bash benchmarks/gpu/run.sh` (no flags) builds on a GPU, built here: a default that cannot run (run 1
    of 2026-11-27: attention_impl 'auto' refused) fails this test."""
    step = _module("step")
    args, configs = step.plan([], platform="gpu")
    s, h = configs["step"], configs["hf_equivalent"]
    assert (args.preset, args.batch, args.seq_len, args.packed) == ("small", 8, 4096, True)
    assert s.model.dtype == "bfloat16" and s.model.attention_impl in ("auto", "cudnn")
    assert s.model.moe_capacity_factor == 0.0 and s.model.moe_block_size == 4096
    assert s.model.moe_impl == "auto"
    assert s.mesh.sizes() == {a: 1 for a in s.mesh.sizes()} and s.train.accum_steps == 1
    phase = s.data.curriculum.phases[0]
    assert (phase.global_batch, phase.seq_len) == (8, 4096)
    assert (s.loss.mtp, s.optim.algorithm, s.model.remat) == (True, "muon_adamw", "save_matmuls")
    assert (h.loss.mtp, h.optim.algorithm, h.model.remat) == (False, "adamw", "none")
    assert h.model.replace(remat="save_matmuls") == s.model  # the same model otherwise
    hf = to_hf_config(h.model)  # what hf_anchor.py builds Glm4MoeForCausalLM from
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]) == (1024, 12, 151552)
    assert set(step.step_variants("gpu")) == {"default", "command buffers off", "default, profiled"}
    assert step.step_variants("gpu")["default, profiled"] == {"xla_enable_command_buffers_during_profiling": True}
    assert set(step.step_variants("gpu", profiled_default=False)) == {"default", "command buffers off"}
    # body MFU of run 4's default row (abd7af6: 76,187 tokens/s, 4,018,667,520 model FLOPs per token) without the
    # two heads' 6 * 151,552 * 1,024 * 2 = 1,862,270,976: 2,156,396,544 * 76,187 / 989.4e12 = 16.6%
    assert counting.flops_per_token(get_preset("small"), 4096) == 4_018_667_520
    r = {"model_flops_per_token": 4_018_667_520, "tokens_per_s": 76_187}
    assert step.body_mfu(r, s) == pytest.approx(2_156_396_544 * 76_187 / 989.4e12) == pytest.approx(0.16605, abs=1e-5)
    assert step.body_mfu(r, h) == pytest.approx((4_018_667_520 - 931_135_488) * 76_187 / 989.4e12)  # MTP off
    assert set(step.moe_flag_sets("gpu")) == set(step.FLAG_SETS) and args.budget_s + 60 < 600
    # the device tool's 10-minute call: the sections' estimates fit the budget
    assert sum(step.ESTIMATE_S.values()) <= args.budget_s


def test_packed_batch_has_the_loaders_layout():
    """Segments 1, 2, ... whose positions restart at 0; no loss on a segment's first target; targets = next input."""
    b = synthetic_batch(2, 64, 100, seed=3, packed=True, mean_document=10)
    assert set(b) == {"inputs", "targets", "segment_ids", "positions", "loss_mask"}
    for row in range(2):
        seg, pos, mask = b["segment_ids"][row], b["positions"][row], b["loss_mask"][row]
        assert seg[0] == 1 and np.all(np.diff(seg) >= 0) and seg.max() > 2
        starts = np.flatnonzero(np.diff(seg)) + 1
        assert np.all(pos[starts] == 0) and np.all(np.diff(pos)[np.diff(seg) == 0] == 1)
        assert np.all(mask[starts - 1] == 0) and mask.sum() == 64 - len(starts)
        np.testing.assert_array_equal(b["targets"][row][:-1], b["inputs"][row][1:])
    plain = synthetic_batch(2, 64, 100, seed=3)
    np.testing.assert_array_equal(plain["inputs"], b["inputs"])  # the same tokens, only the layout differs


def test_run_sh_cpu_fallback_reports_every_section(tmp_path):
    out, empty = tmp_path / "out", tmp_path / "no_wheels"
    empty.mkdir()
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "GPU_BENCH_WHEELS": str(empty),
           "GPU_BENCH_SITE": str(tmp_path / "site")}
    proc = subprocess.run(["bash", os.path.join(GPU, "run.sh"), "--cpu"], env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CPU fallback" in proc.stdout and "whl here" in proc.stdout
    assert {"result.json", "report.md", "trace.json.gz", "log.txt", "step_hlo.txt.gz",
            "profile_hlo.txt.gz"} <= set(os.listdir(out))
    r = json.loads((out / "result.json").read_text())
    assert r["errors"] == {} and r["skipped"] == {} and r["platform"] == "cpu" and r["packed"]
    assert r["libraries"]["cudnn"] == "n/a" and "xla_flags_env" in r

    s = r["train_step"]
    # tiny preset, fp32, dropless, 2 x 32 packed tokens (step.py's CPU defaults)
    assert (s["preset"], s["dtype"], s["global_batch"], s["seq_len"]) == ("tiny", "float32", 2, 32)
    assert s["tokens_per_s"] == pytest.approx(64 / s["step_s_median"])
    assert s["mfu_vs_datasheet_989"] == pytest.approx(s["achieved_tflops"] / 989.4)
    assert 0 < s["mfu_vs_measured_matmul"] and s["peak_memory_gib"] > 0
    heads = 6 * 512 * 64 * 2  # tiny's lm_head and MTP head: 6 * vocab * d each
    assert s["body_mfu_vs_datasheet_989"] == pytest.approx((s["model_flops_per_token"] - heads) * 64 /
                                                           s["step_s_median"] / 989.4e12)
    probes = r["step_variants"]["matmul_probes_tflops"]
    assert set(probes) == {"512^3 chain", "head fwd 64x64x512", "head d-hidden 64x64x512", "head d-weight 64x64x512"}
    assert r["step_variants"]["matmul_peak_interleaved_tflops"] == max(probes.values())
    assert 5.5 < s["final_loss"] < 9  # CE ~ ln 512 + MTP + aux on random tokens
    tiny = get_preset("tiny")
    e = r["hf_equivalent"]  # MTP off: the model FLOPs of a model without the MTP layer
    assert e["model_flops_per_token"] == counting.flops_per_token(tiny.replace(num_nextn_predict_layers=0), 32)
    assert s["model_flops_per_token"] == counting.flops_per_token(tiny, 32) and e["remat"] == "none"
    hf = r["hf_transformers"]
    if "skipped" in hf:  # torch absent from this venv: the only part allowed to be skipped
        assert "torch" in hf["skipped"]
    else:
        assert hf["experts_implementation"] == "grouped_mm" and (hf["batch"], hf["seq_len"]) == (2, 32)
        assert e["vs_hf_transformers"] == pytest.approx(e["tokens_per_s"] / hf["tokens_per_s"])
        counts = counting.param_counts(tiny)  # HF builds no MTP layer and keeps the correction bias as a buffer
        assert hf["params"] == counts.model_total - counts.mtp_total - tiny.num_moe_layers * tiny.n_routed_experts

    assert r["attention_hlo"]["calls"] == 0 and not r["attention_hlo"]["ok"]  # no cuDNN on a CPU

    prof = r["profile"]
    assert prof["timeline"]["wall_ms_per_step"] > 0  # no device streams on a CPU: no busy/idle split there
    rows = {c["component"]: c for c in prof["components"]}
    flops = _module("components").component_flops(tiny, 2, 32, ns_steps=5)
    for name in ("expert GEMMs", "heads (lm_head + MTP head)", "Newton-Schulz", "attention fwd"):
        assert rows[name]["flops"] == flops[name]
    for name in ("expert GEMMs", "optimizer elementwise", "Newton-Schulz", "attention projections + rest",
                 "other GEMMs", "other elementwise"):
        assert rows[name]["ms_per_step"] > 0, name  # the classifier finds the tiny step's ops
    assert sum(c["ms_per_step"] for c in prof["components"]) == pytest.approx(prof["op_ms_per_step"])
    # the step's packed rows (synthetic_batch, seed = the config's train seed 0 in configs/pretrain.py) in NumPy
    seg = synthetic_batch(2, 32, 512, seed=0, packed=True)["segment_ids"]
    lengths = np.concatenate([np.diff(np.flatnonzero(np.diff(row, prepend=-1, append=-1))) for row in seg])
    pairs = prof["attention_pairs"]
    assert (pairs["documents"], pairs["causal_pairs"]) == (len(lengths), int((lengths * (lengths + 1) // 2).sum()))
    assert pairs["mfu_convention_pairs"] == 2 * 32 * 32 // 2
    assert rows["attention fwd"]["hw_flops"] == 4 * 8 * 16 * pairs["causal_pairs"] * 4  # heads x head_dim, 4 sites
    assert r["profile_default"]["note"].startswith("the CPU fallback compiles one executable")
    assert [c["enforced"] for c in r["checks"]] == [False]  # reported on the CPU, enforced on a GPU
    scopes = {(row["scope"], row["pass"]) for row in prof["by_scope"]}
    assert any(s.endswith("experts") and p == "bwd" for s, p in scopes), scopes

    m = r["moe"]
    loop = m["impls"]["loop"]
    # tiny: d 64, 8 experts x 32, top-2, 1 shared -> dense width 96; the router's 2*d*8 on top for the MoE
    assert m["shapes"]["dense_ffn"] == 96 and m["shapes"]["tokens"] == 64
    assert m["dense"]["flops_per_token"] == 3 * (3 * 2 * 64 * 96)
    assert loop["flops_per_token"] == 3 * (3 * 2 * 64 * 96 + 2 * 64 * 8)
    assert loop["assignments"] == 64 * 2 and loop["blocks"] * 128 == loop["assignments"] + loop["padded_rows"]
    assert loop["moe_over_dense"] == pytest.approx(loop["median_ms"] / m["dense"]["median_ms"])
    for name, row in m["impls"].items():
        if name != "loop":
            assert "error" not in row, row
            assert row["max_abs_diff_vs_loop"]["output"] < 1e-4 * loop["output_max_abs"]
            assert row["max_abs_diff_vs_loop"]["grads"] < 1e-4 * loop["grad_max_abs"]
    assert {"default", "command buffers off", "matmul probe"} == set(m["flags"])
    assert m["flags"]["default"]["vs_first"] == 1.0
    with gzip.open(out / "trace.json.gz", "rt") as f:
        assert "traceEvents" in json.load(f)
    report = (out / "report.md").read_text()
    for heading in ("MFU vs 989", "HF-equivalent", "| component | ms / step |", "MoE / dense", "| named scope |",
                    "| HLO op |", "XLA option sets interleaved", "Attention in the compiled step", "body MFU",
                    "hardware TFLOP/s", "Checks:", "causal pairs"):
        assert heading in report, heading


# --- the trace and HLO readers -------------------------------------------------------------------------------


def _ev(name, ts, dur, tid=1, pid=1, **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args}


def test_timeline_counts_busy_idle_kernels_and_device_to_host_copies():
    """Two streams: kernels 0-10 and 5-15 overlap (busy 15), a D2H copy 20-21, a memset 30-31, a D2D copy 40-42:
    busy 15 + 1 + 1 + 2 = 19 us over 2 steps; span 42 -> 23 us idle inside it; 2 kernels, 1 D2H of 4 bytes.
    A host event is not a device event."""
    hlo_trace = _module("hlo_trace")
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/host:CPU"}},
              _ev("gemm", 0, 10, hlo_op="dot.1"), _ev("fusion_3", 5, 10, tid=2, hlo_op="fusion.3"),
              _ev("MemcpyD2H", 20, 1, memcpy_details="kind_src:device kind_dst:host size:4"),
              _ev("Memset 3", 30, 1), _ev("MemcpyD2D", 40, 2), _ev("host", 0, 100, pid=7)]
    dev = hlo_trace.on_device(events, hlo_trace.process_names(events))
    t = hlo_trace.timeline(dev, steps=2, wall_s=100e-6)
    assert t["busy_ms_per_step"] == pytest.approx(19e-3 / 2) and t["wall_ms_per_step"] == pytest.approx(0.05)
    assert t["idle_ms_per_step"] == pytest.approx(0.05 - 9.5e-3)
    assert t["span_idle_ms_per_step"] == pytest.approx(23e-3 / 2)
    assert (t["kernels_per_step"], t["d2h_copies_per_step"], t["d2h_bytes_per_step"]) == (1, 0.5, 2)
    assert hlo_trace.union_us([(0, 10), (2, 3), (5, 12), (20, 21)]) == 13


def test_self_times_subtract_nested_children():
    """A while thunk (0-100 us) holding two body ops (10-30, 40-90) and a nested op in the second (50-60), plus
    a separate op on another thread: self times 100-20-50 = 30, 20, 50-10 = 40, 10 and 7."""
    hlo_trace = _module("hlo_trace")
    ev = lambda name, ts, dur, tid=1: {"name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}
    events = [ev("while", 0, 100), ev("a", 10, 20), ev("b", 40, 50), ev("c", 50, 10), ev("d", 5, 7, tid=2)]
    got = {e["name"]: t for e, t in hlo_trace.self_times(events)}
    assert got == {"while": 30, "a": 20, "b": 40, "c": 10, "d": 7}


HLO = """HloModule jit_step, is_scheduled=true
%fused_computation (param_0: f32[4]) -> f32[4] {
  ROOT %x.1 = f32[4]{0} negate(%param_0)
}
ENTRY %main {
  %fusion.3 = f32[4]{0} fusion(f32[4]{0} %p), kind=kLoop, calls=%f, metadata={op_name="jit(step)/jvp(jit(loss))/while/body/moe_layers/moe/moe_dispatch/experts/scatter-add" source_file="x.py"}
  %custom-call.104 = (bf16[32768,151552]{1,0}, s8[4194304]{0}) custom-call(bf16[32768,1024]{1,0} %h, bf16[1024,151552]{1,0} %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/transpose(jvp(lm_head))/bsd"}
  %dot_product_attention_fwd.23 = (bf16[8,16,4096,128]{3,2,1,0}, f32[8,16,4096]{2,1,0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"operation_queue_id":"0","cudnn_fmha_backend_config":{"fmha_scale":0.08,"mask_type":"CAUSAL","is_flash_attention":true}}, metadata={op_name="jit(step)/jvp(moe_layers)/attention/dot_product_attention"}
  %dot_product_attention_bwd.16 = (bf16[8,16,4096,128]{3,2,1,0}) custom-call(%q, %k, %v, %bias), custom_call_target="__cudnn$fmhaScaleBiasSoftmaxBackward", backend_config={"cudnn_fmha_backend_config":{"mask_type":"NO_MASK"}}, metadata={op_name="jit(step)/transpose(jvp(moe_layers))/attention/dot_product_attention"}
  ROOT %copy.1 = f32[4]{0} copy(%a)
}
"""


def test_hlo_instructions_read_opcode_target_scope_and_dims():
    hlo_trace = _module("hlo_trace")
    ins = hlo_trace.hlo_instructions(HLO)
    assert {"fusion.3", "custom-call.104", "dot_product_attention_fwd.23", "copy.1", "x.1"} <= set(ins)
    gemm = ins["custom-call.104"]
    assert (gemm["opcode"], gemm["target"]) == ("custom-call", "__cublas$gemm")
    assert gemm["dims"] == {32768, 151552, 4194304, 1024}
    assert ins["fusion.3"]["opcode"] == "fusion" and ins["copy.1"]["op_name"] == "" and ins["x.1"]["dims"] == {4}
    assert hlo_trace.scope_of(gemm["op_name"]) == ("lm_head", "bwd")
    assert hlo_trace.scope_of(ins["fusion.3"]["op_name"]) == ("moe_layers/moe/moe_dispatch/experts", "fwd")
    assert hlo_trace.scope_of("")[0] == "(unscoped)"


def test_attention_check_on_hand_written_hlo():
    """The forward is causal without a bias; the backward takes a bias and no mask (today's dense-mask path):
    the module is not OK, and says why."""
    hlo_trace = _module("hlo_trace")
    a = hlo_trace.attention_calls(HLO)
    assert (a["calls"], a["forward"], a["backward"], a["with_bias"]) == (2, 1, 1, 1) and not a["ok"]
    assert a["mask_types"] == {"CAUSAL": 1, "NO_MASK": 1} and "bias operand" in a["why"]
    good = HLO.replace("ScaleBiasSoftmaxBackward", "SoftmaxBackward").replace('"NO_MASK"', '"PADDING_CAUSAL",'
                                                                              '"max_seg_per_batch":32')
    assert hlo_trace.attention_calls(good)["ok"] and hlo_trace.attention_calls(good)["max_seg_per_batch"] == [32]
    # a remat that re-runs the forward in the backward: two forwards for one backward
    refwd = good.replace("%copy.1", "%dot_product_attention_fwd.35 = bf16[8] custom-call(%q), custom_call_target="
                                    '"__cudnn$fmhaSoftmax", backend_config={"mask_type":"CAUSAL"}\n  ROOT %copy.1')
    assert not hlo_trace.attention_calls(refwd)["ok"] and "re-runs" in hlo_trace.attention_calls(refwd)["why"]
    no_mask = good.replace('"mask_type":"CAUSAL",', "")  # the proto default, left out of the JSON
    assert not hlo_trace.attention_calls(no_mask)["ok"]
    assert hlo_trace.attention_calls("HloModule m\n")["why"].startswith("no cuDNN")


def test_attention_check_on_a_module_cross_lowered_for_cuda(monkeypatch):
    """jax's own cuDNN lowering on this CPU (its cuDNN version / compute capability probes answered as an H100
    would): is_causal=True -> causal forward and backward calls without bias; a dense boolean mask -> the
    ScaleBias calls with NO_MASK that the check must refuse."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    hlo_trace = _module("hlo_trace")
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fa, "check_compute_capability", lambda capability: True)
    q = jax.ShapeDtypeStruct((1, 128, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)

    def lowered(**kw):
        f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw)
        g = jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
        return jax.jit(g).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()

    causal = hlo_trace.attention_calls(lowered(is_causal=True))
    assert causal["ok"] and (causal["forward"], causal["backward"]) == (1, 1), causal
    masked = hlo_trace.attention_calls(lowered(mask=jnp.tril(jnp.ones((128, 128), bool))[None, None]))
    assert not masked["ok"] and masked["with_bias"] == 2 and masked["mask_types"] == {"NO_MASK": 2}, masked


# --- components ----------------------------------------------------------------------------------------------


def test_classifier_on_hand_written_ops():
    comp = _module("components")
    v = 151552
    c = lambda scope, instr, kernel="", d="fwd": comp.classify(scope, d, instr, kernel, v)
    gemm = {"opcode": "custom-call", "target": "__cublas$gemm", "dims": {4096, 1024}}
    assert c("moe_layers/moe/moe_dispatch/experts", gemm) == "expert GEMMs"
    assert c("moe_layers/moe/moe_dispatch/experts", {"opcode": "fusion", "name": "gemm_fusion_dot.3"}) == \
        "expert GEMMs"
    assert c("moe_layers/moe/moe_dispatch/experts", {"opcode": "fusion", "name": "input_scatter_fusion.2"}) == \
        "expert permutes"
    assert c("moe_layers/moe/moe_dispatch/experts", {"opcode": "sort", "name": "sort.1"}) == "expert permutes"
    assert c("moe_layers/moe/moe_dispatch/experts", {"opcode": "fusion", "name": "loop_select_fusion"}) == \
        "experts other"
    fmha = {"opcode": "custom-call", "target": "__cudnn$fmhaSoftmax"}
    assert c("moe_layers/attention", fmha) == "attention fwd"
    assert c("moe_layers/attention", fmha, d="bwd") == "attention fwd (recompute)"
    assert c("moe_layers/attention", {**fmha, "target": "__cudnn$fmhaSoftmaxBackward"}, d="bwd") == "attention bwd"
    assert c("moe_layers/attention", gemm) == "attention projections + rest"
    head = {"opcode": "custom-call", "target": "__cublas$gemm", "dims": {32768, 1024, v}}
    assert c("(unscoped)", head, d="bwd") == c("mtp", head) == c("lm_head", gemm) == "heads (lm_head + MTP head)"
    assert c("loss", {"opcode": "fusion", "name": "loop_subtract_fusion", "dims": {32768, v}}) == "cross-entropy"
    assert c("(unscoped)", {"opcode": "fusion", "name": "wrapped_convert", "dims": {32768, v}}) == "cross-entropy"
    assert c("(unscoped)", {"opcode": "gather", "name": "gather.2", "dims": {v, 1024}}) == "other elementwise"
    assert c("mtp/moe/moe_dispatch/experts", gemm) == "MTP layer"
    assert c("optimizer", {"opcode": "dot", "dims": {512, 1024}}) == "Newton-Schulz"
    assert c("optimizer", {"opcode": "fusion", "name": "loop_add_fusion", "dims": {v, 1024}}) == \
        "optimizer elementwise"
    assert c("loss/aux_loss", {"opcode": "fusion"}) == "other elementwise"
    assert c("moe_layers/moe/shared_expert", gemm) == c("dense_layers/mlp", {"opcode": "dot"}) == "other GEMMs"
    assert c("optimizer/newton_schulz", {"opcode": "fusion", "name": "loop_convert_fusion"}) == "Newton-Schulz"
    mosaic = {"opcode": "custom-call", "name": "mpmd_map.18", "target": "mosaic_gpu_v2"}
    assert c("moe_layers/moe/moe_dispatch/experts/experts_grouped", mosaic) == "expert GEMMs"
    assert c("moe_layers/moe/moe_dispatch/experts", {"opcode": "custom-call"}, kernel="mosaic_gpu_kernel") == \
        "expert GEMMs"
    ops = [{"hlo_op": "custom-call.104", "dur_us": 3000, "kernel": "nvjet"},
           {"hlo_op": "fusion.3", "dur_us": 1000, "kernel": "input_scatter_fusion"},
           {"hlo_op": "nosuch.1", "dur_us": 500, "op_name": "jit(step)/optimizer/add", "kernel": "loop_add"}]
    hlo_trace = _module("hlo_trace")
    ms = comp.sum_by_component(ops, hlo_trace.hlo_instructions(HLO), v, 2, hlo_trace.scope_of)
    assert ms == {"heads (lm_head + MTP head)": 1.5, "expert permutes": 0.5, "optimizer elementwise": 0.25}
    rows = {r["component"]: r for r in comp.table(ms, {"heads (lm_head + MTP head)": 3e12}, 600e12)}
    assert rows["heads (lm_head + MTP head)"]["tflops"] == pytest.approx(2000)
    assert rows["heads (lm_head + MTP head)"]["ideal_ms"] == pytest.approx(5.0)
    assert rows["expert permutes"]["tflops"] is None and rows["expert permutes"]["ideal_ms"] is None


# A profiled step's ops as issue 73's reading of run 4 (abd7af6) describes them: the MTP head's backward GEMM names its
# operands without shapes, so the vocab dimension is only on the line defining its [tokens, vocab] operand; a Pallas
# Mosaic-GPU grouped GEMM is an mpmd_map custom call; Newton-Schulz has its own scope inside the optimizer's; XLA:CPU
# wraps a dot in a fusion (ynn_fusion) whose opcode is "fusion".
HLO_STEP = """HloModule jit_step, is_scheduled=true
%fused_computation.1 (param_0.1: f32[64,64], param_1.1: f32[64,128]) -> f32[64,128] {
  %param_0.1 = f32[64,64]{1,0} parameter(0)
  %param_1.1 = f32[64,128]{1,0} parameter(1)
  ROOT %dot_general.1 = f32[64,128]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp(dense_layers)/mlp/dot_general"}
}

ENTRY %main {
  %p.7 = bf16[151552,1024]{1,0} parameter(7)
  %bitcast.5 = bf16[32768,151552]{1,0} bitcast(%fusion.9)
  %custom-call.216 = (bf16[32768,1024]{1,0}, s8[4194304]{0}) custom-call(%bitcast.5, %p.7), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/transpose(jvp(mtp))/bsv,dv->bsd/dot_general"}
  %mpmd_map.18 = bf16[65536,512]{1,0} custom-call(%a, %b, %c), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(step)/transpose(jvp(moe_layers))/moe/moe_dispatch/experts/experts_grouped/mpmd_map"}
  %loop_select_fusion.3 = bf16[65536,1024]{1,0} fusion(%a), kind=kLoop, calls=%f3, metadata={op_name="jit(step)/transpose(jvp(moe_layers))/moe/moe_dispatch/experts/experts_grouped/select_n"}
  %custom-call.300 = (f32[64,1024,1024]{2,1,0}, s8[1048576]{0}) custom-call(%y.1, %y.1), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/optimizer/newton_schulz/dot_general"}
  %loop_convert_fusion.7 = bf16[64,1024,1024]{2,1,0} fusion(%custom-call.300), kind=kLoop, calls=%f7, metadata={op_name="jit(step)/optimizer/newton_schulz/convert_element_type"}
  %loop_add_fusion.2 = f32[151552,1024]{1,0} fusion(%m, %g), kind=kLoop, calls=%f2, metadata={op_name="jit(step)/optimizer/add"}
  %custom-call.50 = (bf16[32768,1024]{1,0}, s8[4194304]{0}) custom-call(%x.3, %w.3), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/jvp(moe_layers)/moe/shared_expert/dot_general"}
  %ynn_fusion.1 = f32[64,128]{1,0} fusion(%x.1, %w.1), kind=kCustom, calls=%fused_computation.1, metadata={op_name="jit(step)/jvp(dense_layers)/mlp/dot_general"}, backend_config={"fusion_config":{"kind":"__ynn_fusion"}}
  ROOT %loop_multiply_fusion.4 = bf16[8,4096,1024]{2,1,0} fusion(%x.3), kind=kLoop, calls=%f4, metadata={op_name="jit(step)/jvp(moe_layers)/mul"}
}
"""


def test_hlo_instructions_resolve_operands_through_their_defining_lines():
    hlo_trace = _module("hlo_trace")
    ins = hlo_trace.hlo_instructions(HLO_STEP)
    head = ins["custom-call.216"]
    assert head["operands"] == ["bitcast.5", "p.7"] and head["target"] == "__cublas$gemm"
    assert head["dims"] == head["result_dims"] == {32768, 1024, 4194304}  # no vocab on its own line
    assert head["operand_dims"] == {32768, 151552, 1024}
    assert ins["bitcast.5"]["operands"] == ["fusion.9"] and ins["bitcast.5"]["operand_dims"] == set()  # undefined
    assert ins["mpmd_map.18"]["operands"] == ["a", "b", "c"] and ins["mpmd_map.18"]["result_dims"] == {65536, 512}
    assert ins["loop_convert_fusion.7"]["operand_dims"] == {64, 1024, 1048576}  # a tuple result's every shape
    assert ins["ynn_fusion.1"]["called_opcodes"] == {"parameter", "dot"} and ins["ynn_fusion.1"]["operands"] == [
        "x.1", "w.1"]
    assert ins["loop_multiply_fusion.4"]["called_opcodes"] == set()  # %f4 is not in the text
    # operands printed with their shapes (the readers' first fixture): the names without the shapes
    assert hlo_trace.hlo_instructions(HLO)["custom-call.104"]["operands"] == ["h", "w"]
    assert hlo_trace.scope_of(head["op_name"]) == ("mtp", "bwd")
    assert hlo_trace.scope_of(ins["custom-call.300"]["op_name"]) == ("optimizer/newton_schulz", "fwd")


def test_profile_of_hand_written_trace_adds_up():
    """Two steps of the ops above on one GPU stream (us): head 24,000 -> 12 ms/step, mpmd_map 31,000 -> 15.5,
    select 9,000 -> 4.5, Newton-Schulz GEMM 4,000 + its convert 2,000 -> 3, AdamW add 1,000 -> 0.5, shared expert
    GEMM 3,000 + the dense MLP's fused dot 400 -> 1.7, an elementwise multiply 600 -> 0.3."""
    comp, hlo_trace = _module("components"), _module("hlo_trace")
    durations = {"custom-call.216": 24000, "mpmd_map.18": 31000, "loop_select_fusion.3": 9000,
                 "custom-call.300": 4000, "loop_convert_fusion.7": 2000, "loop_add_fusion.2": 1000,
                 "custom-call.50": 3000, "ynn_fusion.1": 400, "loop_multiply_fusion.4": 600}
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}}]
    ts = 0
    for op, dur in durations.items():
        kernel = "main_kernel" if op.startswith("mpmd") else "nvjet_sm90" if op.startswith("custom") else op
        events.append(_ev(kernel, ts, dur, hlo_op=op))
        ts += dur
    ops = hlo_trace.device_ops(events, hlo_trace.process_names(events))
    ms = comp.sum_by_component(ops, hlo_trace.hlo_instructions(HLO_STEP), 151552, 2, hlo_trace.scope_of)
    assert ms == {"heads (lm_head + MTP head)": 12.0, "expert GEMMs": 15.5, "experts other": 4.5,
                  "Newton-Schulz": 3.0, "optimizer elementwise": 0.5, "other GEMMs": pytest.approx(1.7),
                  "other elementwise": 0.3}
    # without its operands' shapes the head GEMM would be counted in the MTP layer (runs 3 and 4's error)
    head = {**hlo_trace.hlo_instructions(HLO_STEP)["custom-call.216"], "name": "custom-call.216", "operand_dims": ()}
    assert comp.classify("mtp", "bwd", head, "nvjet_sm90", 151552) == "MTP layer"
    assert "other" not in comp.COMPONENTS and comp.COMPONENTS[-2:] == ("other GEMMs", "other elementwise")


def test_attention_hardware_flops_by_hand():
    """Rows [1 1 1 2 2 3] and [1 1 1 1 1 1]: documents 3, 2, 1 and 6 need 6 + 3 + 1 + 21 = 31 causal pairs, against
    the MFU convention's 2 rows x 6^2 / 2 = 36. TINY (8 heads x 16, 3 layers + 1 MTP): 4 * 8 * 16 * 31 = 15,872
    FLOPs per site forward, x 4 sites = 63,488; the backward twice that; without MTP 3 sites = 47,616."""
    comp = _module("components")
    seg = np.array([[1, 1, 1, 2, 2, 3], [1, 1, 1, 1, 1, 1]])
    assert comp.document_lengths(seg) == [3, 2, 1, 6] and comp.causal_pairs([3, 2, 1, 6]) == 31
    hw = comp.attention_hw_flops(TINY, 31)
    assert hw == {"attention fwd": 63488, "attention fwd (recompute)": 63488, "attention bwd": 126976}
    assert comp.attention_hw_flops(TINY, 31, mtp=False)["attention fwd"] == 47616
    assert comp.head_flops_per_token(TINY) == 6 * 512 * 64 * 2 and comp.head_flops_per_token(TINY, False) == 196608


def test_report_check_fails_on_a_row_above_the_measured_peak():
    """Peak 800 TFLOP/s. heads: 61.023 TFLOP in 61.9 ms = 985.8 (run 4's row): above. attention fwd: 7.1468 model
    TFLOP in 8.78 ms is 814 TFLOP/s, but its 2.687 hardware TFLOP are 306: below (the check reads the hardware
    rate). Newton-Schulz 16.168 TFLOP in 30.19 ms = 535.5: below."""
    comp, report = _module("components"), _module("report")
    ms = {"attention fwd": 8.78, "heads (lm_head + MTP head)": 61.9, "Newton-Schulz": 30.19}
    flops = {"attention fwd": 7.1468e12, "heads (lm_head + MTP head)": 61.023e12, "Newton-Schulz": 16.168e12}
    rows = comp.table(ms, flops, 800e12, {"attention fwd": 2.687e12})
    by = {r["component"]: r for r in rows}
    assert by["attention fwd"]["tflops"] == pytest.approx(814.0, abs=0.1)
    assert by["attention fwd"]["hw_tflops"] == pytest.approx(306.0, abs=0.1)
    assert by["attention fwd"]["ideal_ms"] == pytest.approx(3.359, abs=1e-3)  # hardware FLOPs at the peak
    lines = comp.above_peak(rows, 800.0)
    assert len(lines) == 1 and "'heads (lm_head + MTP head)'" in lines[0] and "985.8 model TFLOP/s" in lines[0]
    result = {"platform": "gpu", "matmul_peak": {"tflops": 650.0, "dtype": "bfloat16"},
              "step_variants": {"matmul_peak_interleaved_tflops": 800.0}, "profile": {"components": rows},
              "profile_default": {"note": "not profiled"}}
    checks = report.checks(result)
    assert [(c["ok"], c["enforced"]) for c in checks] == [(False, True)] and "800.0 TFLOP/s" in checks[0]["check"]
    assert report.failures({**result, "checks": checks}) == [f"{checks[0]['check']}: {lines[0]}"]
    cpu = {**result, "platform": "cpu"}
    assert report.failures({**cpu, "checks": report.checks(cpu)}) == []  # the CPU fallback reports, never fails
    ok = {**result, "step_variants": {"matmul_peak_interleaved_tflops": 990.0}}
    assert report.checks(ok)[0]["ok"] and report.measured_peak_tflops(ok) == 990.0


def test_report_of_a_gpu_result_with_both_profiles():
    """report.md of a hand-written GPU result: the body MFU column, the probes, both component tables (the second
    with its on - off column), the attention pairs line and a failed check naming its row."""
    comp, report = _module("components"), _module("report")
    rows = comp.table({"attention bwd": 39.0, "heads (lm_head + MTP head)": 61.9},
                      {"attention bwd": 14.29e12, "heads (lm_head + MTP head)": 61.02e12}, 800e12,
                      {"attention bwd": 5.37e12})
    timeline = {"wall_ms_per_step": 430.0, "busy_ms_per_step": 425.0, "idle_ms_per_step": 5.0,
                "span_idle_ms_per_step": 1.0, "kernels_per_step": 4000, "d2h_copies_per_step": 1}
    step = {"global_batch": 8, "seq_len": 4096, "remat": "save_matmuls", "tokens_per_s": 76187.0,
            "achieved_tflops": 306.2, "mfu_vs_datasheet_989": 0.3095, "body_mfu_vs_datasheet_989": 0.1661,
            "step_s_median": 0.4301, "peak_memory_gib": 70.07}
    r = {"date": "d", "device": "NVIDIA H200", "platform": "gpu", "jax": "0.11.2", "python": "3.12", "commit": "c",
         "xla_flags_env": "", "skipped": {}, "errors": {}, "train_step": step,
         "matmul_peak": {"tflops": 653.6, "dtype": "bfloat16"},
         "step_variants": {"matmul_peak_interleaved_tflops": 800.0, "matmul_probes_tflops": {"8192^3 chain": 690.0,
                                                                                             "head fwd": 800.0}},
         "profile": {"steps": 2, "timeline": timeline, "components": rows, "by_scope": [], "by_op": [],
                     "attention_pairs": {"documents": 160, "causal_pairs": 25_231_360,
                                         "mfu_convention_pairs": 67_108_864, "hardware_over_convention": 0.376}},
         "profile_default": {"variant": "default, profiled", "steps": 2, "timeline": timeline, "components": rows,
                             "unattributed_ms_per_step": 2.5, "step_ms_on_minus_off": -50.6,
                             "ms_on_minus_off": {"attention bwd": -50.3}}}
    r["checks"] = report.checks(r)
    text = report.markdown(r)
    assert "| 30.9% | 16.6% | 430.1 |" in text and "8192^3 chain 690.0; head fwd 800.0" in text
    assert "160 documents need 25,231,360 causal pairs, 37.6% of the MFU convention" in text
    assert "| attention bwd | 39.00 | 14,290.0 | 366.4 | 137.7 | 6.71 | -50.30 |" in text  # 5.37e12 / 39 ms
    assert "| heads (lm_head + MTP head) | 61.90 | 61,020.0 | 985.8 | — | 76.28 | +0.00 |" in text
    assert "2.5 ms in kernels no HLO op names; the step, on - off: -50.6 ms" in text
    assert text.count("- FAILED: ") == 2 and "'heads (lm_head + MTP head)': 985.8 model TFLOP/s" in text
    assert len(report.failures(r)) == 2


def test_default_profile_beside_the_command_buffers_off_one(monkeypatch):
    """Where XLA rejected the option: the step's on/off difference alone (430.1 - 480.7 = -50.6 ms). Where it took
    it: each component's ms less the command-buffers-off profile's (attention bwd 39 - 89.3 = -50.3)."""
    profiling = _module("profiling")
    args = types.SimpleNamespace(platform="gpu")
    result = {"step_variants": {"default": {"step_ms_median": 430.1}, "command buffers off": {"step_ms_median": 480.7}},
              "errors": {"command_buffers_during_profiling": "JaxRuntimeError: No such compile option"},
              "profile": {"components": [{"component": "attention bwd", "ms_per_step": 89.3},
                                         {"component": "heads (lm_head + MTP head)", "ms_per_step": 74.4}]}}
    step = types.SimpleNamespace(executables={"default": None, "command buffers off": None})
    got = profiling.profile_default_section(args, step, 800e12, result)
    assert got["step_ms_on_minus_off"] == pytest.approx(-50.6) and "No such compile option" in got["note"]
    monkeypatch.setattr(profiling, "profile_section", lambda *a, **k: {"components": [
        {"component": "attention bwd", "ms_per_step": 39.0}, {"component": "heads (lm_head + MTP head)",
                                                              "ms_per_step": 74.4}]})
    step.executables[profiling.PROFILED_DEFAULT] = None
    got = profiling.profile_default_section(args, step, 800e12, result)
    assert got["ms_on_minus_off"] == pytest.approx({"attention bwd": -50.3, "heads (lm_head + MTP head)": 0.0})


def test_newton_schulz_has_its_own_scope():
    """muon.newton_schulz's compiled ops sit under "newton_schulz", so the profile counts them there."""
    from glm46_jax.training import muon

    comp, hlo_trace = _module("components"), _module("hlo_trace")
    x = jnp.ones((4, 8), jnp.float32)
    text = jax.jit(lambda x: muon.newton_schulz(x, steps=2)).lower(x).compile().as_text()
    named = {n: i for n, i in hlo_trace.hlo_instructions(text).items()  # a parameter's op_name is its own name
             if "/" in i["op_name"] and i["opcode"] != "parameter"}
    assert any(i["opcode"] == "dot" or "dot" in n for n, i in named.items()), named
    for name, ins in named.items():
        scope, direction = hlo_trace.scope_of(ins["op_name"])
        assert scope == "newton_schulz", (name, ins["op_name"])
        assert comp.classify(f"optimizer/{scope}", direction, {**ins, "name": name}, "", 512) == "Newton-Schulz"


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_component_flops_add_up_to_the_model_flops(preset):
    comp = _module("components")
    c = get_preset(preset)
    for mtp, model in ((True, c), (False, c.replace(num_nextn_predict_layers=0))):
        f = comp.component_flops(c, 8, 4096, mtp=mtp)
        assert sum(f[k] for k in comp.MODEL_FLOP_COMPONENTS) == counting.flops_per_token(model, 4096) * 8 * 4096


def test_component_flops_by_hand():
    """TINY (d 64, 8 experts x 32, top-2, vocab 512, 2 MoE layers of 3): expert GEMMs of 2 x 32 tokens =
    6 * 64 tokens * 2 experts * 3 * 64 * 32 FLOPs per layer x 2 layers; the heads 6 * 64 * 512 * 64 x (1 + MTP);
    Newton-Schulz on one [4, 8] matrix, 5 iterations: 5 * (4 * 16 * 8 + 2 * 64) = 3200."""
    comp = _module("components")
    c = TINY
    f = comp.component_flops(c, 2, 32)
    assert (c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok, c.num_moe_layers) == (64, 32, 2, 2)
    assert f["expert GEMMs"] == 6 * 64 * 2 * 3 * 64 * 32 * 2
    assert f["heads (lm_head + MTP head)"] == 6 * 64 * 512 * 64 * (1 + c.num_nextn_predict_layers)
    core = 2 * 64 * 32 * c.num_attention_heads * c.head_dim  # QK^T + PV over 64 tokens x 32 keys, halved (causal)
    sites = c.num_hidden_layers + c.num_nextn_predict_layers  # the MTP layer's attention counts as attention
    assert f["attention bwd"] == 2 * f["attention fwd"] == 2 * sites * core
    assert comp.ns_flops(4, 8) == comp.ns_flops(8, 4) == 3200
    assert comp.newton_schulz_flops(get_preset("small")) == pytest.approx(16.2e12, rel=0.01)  # run 3's profile


def test_loop_layout_by_hand():
    """Loads 5, 0, 130 at block 128: 1 + 0 + 2 blocks = 384 rows for 135 assignments (249 padded); group 4 -> 1 trip."""
    moe = _module("moe_section")
    assert moe.loop_layout(np.array([5, 0, 130]), 128, 4) == {"assignments": 135, "padded_rows": 249, "blocks": 3,
                                                               "trips": 1}
    assert moe.loop_layout(np.array([128] * 9), 128, 4)["trips"] == 3

"""benchmarks/gpu: the one-call GPU benchmark is complete. The GPU run's own configuration builds and validates here
(the same function, platform "gpu"); its CPU fallback runs end to end through run.sh (every section, no errors,
the files the device tool brings back); the trace / HLO readers and the component classifier give hand-counted
answers on hand-written traces and HLO; the component FLOPs add up to counting.flops_per_token; the attention
check reads a real cuDNN module cross-lowered for CUDA on this CPU."""

import gzip
import importlib.util
import json
import os
import subprocess
import sys

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
    assert set(step.step_variants("gpu")) == {"default", "command buffers off"}
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
    assert {"result.json", "report.md", "trace.json.gz", "log.txt", "step_hlo.txt.gz"} <= set(os.listdir(out))
    r = json.loads((out / "result.json").read_text())
    assert r["errors"] == {} and r["skipped"] == {} and r["platform"] == "cpu" and r["packed"]
    assert r["libraries"]["cudnn"] == "n/a" and "xla_flags_env" in r

    s = r["train_step"]
    # tiny preset, fp32, dropless, 2 x 32 packed tokens (step.py's CPU defaults)
    assert (s["preset"], s["dtype"], s["global_batch"], s["seq_len"]) == ("tiny", "float32", 2, 32)
    assert s["tokens_per_s"] == pytest.approx(64 / s["step_s_median"])
    assert s["mfu_vs_datasheet_989"] == pytest.approx(s["achieved_tflops"] / 989.4)
    assert 0 < s["mfu_vs_measured_matmul"] and s["peak_memory_gib"] > 0
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
    for name in ("expert GEMMs", "optimizer elementwise", "Newton-Schulz", "attention projections + rest"):
        assert rows[name]["ms_per_step"] > 0, name  # the classifier finds the tiny step's ops
    assert sum(c["ms_per_step"] for c in prof["components"]) == pytest.approx(prof["op_ms_per_step"])
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
                    "| HLO op |", "XLA option sets interleaved", "Attention in the compiled step"):
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
    assert c("(unscoped)", {"opcode": "gather", "name": "gather.2", "dims": {v, 1024}}) == "other"  # embedding
    assert c("mtp/moe/moe_dispatch/experts", gemm) == "MTP layer"
    assert c("optimizer", {"opcode": "dot", "dims": {512, 1024}}) == "Newton-Schulz"
    assert c("optimizer", {"opcode": "fusion", "name": "loop_add_fusion", "dims": {v, 1024}}) == \
        "optimizer elementwise"
    assert c("loss/aux_loss", {"opcode": "fusion"}) == "other"
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

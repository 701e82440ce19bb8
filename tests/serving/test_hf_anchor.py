"""The GPU benchmark's HF transformers anchor (benchmarks/gpu/hf_anchor.py) run by a real torch + transformers: the
serving venv's, as `make test` has neither. tests/test_gpu_bench.py checks the rest of the benchmark and lets only
this part skip; here it must run. The model transformers builds from our `to_hf_config` has our parameters less the
MTP layer (and the router's correction bias, which HF keeps as a buffer), its experts run grouped_mm, and its step
trains: the first loss ~ ln(vocab) on random tokens, as ours."""

from __future__ import annotations

import importlib.util
import math
import os
import sys

from glm46_jax.model import counting
from tests.conftest import ROOT

GPU = os.path.join(ROOT, "benchmarks", "gpu")


def _module(name):
    if GPU not in sys.path:
        sys.path.insert(0, GPU)  # step.py imports its siblings by name, as when it runs as a script
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", os.path.join(GPU, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_anchor_trains_our_config_in_transformers(serving_python, tmp_path):
    _, configs = _module("step").plan([], platform="cpu")
    cfg = configs["hf_equivalent"]  # what the benchmark hands the anchor: tiny, MTP off, 2 x 32 tokens on a CPU
    out = _module("hf_anchor").launch(str(tmp_path), serving_python, steps=2, platform="cpu", cfg=cfg, timeout_s=600)
    assert "error" not in out and "skipped" not in out, out
    m = cfg.model
    counts = counting.param_counts(m)
    assert out["params"] == counts.model_total - counts.mtp_total - m.num_moe_layers * m.n_routed_experts
    assert (out["experts_implementation"], out["attn_implementation"]) == ("grouped_mm", "sdpa")
    phase = cfg.data.curriculum.phases[0]
    assert (out["batch"], out["seq_len"], out["device"]) == (phase.global_batch, phase.seq_len, "cpu")
    assert out["tokens_per_s"] > 0 and out["achieved_tflops"] > 0
    assert abs(out["loss"] - math.log(m.vocab_size)) < 1.0, out["loss"]  # random init, random tokens, 3 steps

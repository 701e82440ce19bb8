"""`python -m glm46_jax.bench`: the numbers it reports are consistent with each other and with the
model's FLOP count, on a 4-device mesh with gradient accumulation."""

import importlib.util
import os

import jax
import pytest

from glm46_jax.bench import _table, bench
from glm46_jax.errors import InputError
from glm46_jax.config import get_preset
from glm46_jax.model.counting import flops_per_token
from glm46_jax.run_config import from_config_dict

CONFIG_FILE = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "pretrain.py")


def _config(**train):
    spec = importlib.util.spec_from_file_location("pretrain_config", CONFIG_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("tiny")
    config.data.phases.general.update(global_batch=8, seq_len=32)
    config.train.update(**train)
    return config


@pytest.mark.slow
def test_bench_reports_consistent_numbers():
    accum, n = 2, 4
    config = _config(accum_steps=accum)
    config.mesh = {"data": 2, "expert": 2}
    r = bench(from_config_dict(config), steps=2, warmup=1, devices=jax.devices()[:n])
    tokens = 8 * 32
    assert r["model_flops_per_token"] == flops_per_token(get_preset("tiny"), 32)
    assert r["step_s_min"] <= r["step_s_median"] <= r["step_s_max"]
    assert r["tokens_per_s"] == pytest.approx(tokens / r["step_s_median"])
    assert r["achieved_tflops"] == pytest.approx(r["model_flops_per_token"] * r["tokens_per_s"] / 1e12)
    assert r["peak_source"].startswith("measured") and 0 < r["mfu"] < 1
    assert r["mfu"] == pytest.approx(r["achieved_tflops"] / r["peak_tflops"])
    assert r["accum_steps"] == accum and r["device"] == f"{n} x cpu" and r["peak_memory_gib"] > 0
    assert 5.5 < r["final_loss"] < 9  # CE ~ln 512 + 0.3 MTP + aux on random tokens, after 3 steps
    assert "MFU" in _table(r)


def test_bench_rejects_bad_arguments():
    with pytest.raises(InputError, match="--steps=0 must be >= 1"):
        bench(from_config_dict(_config()), steps=0)

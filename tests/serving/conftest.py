"""What the serving tests share: the serving venv, and the serve-preset model trained once per session with every
export of it (float32, bf16, FP8 per-channel, FP8 block, W4A16, a PEFT LoRA adapter and its merged model).

`make test-serving` runs these (not `make test`): they need the serving venv (`make serving-venv`), named by
GLM46_SERVING_VENV. Without it they fail under CI=true and skip elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from glm46_jax.infer.eval import heldout_batches
from glm46_jax.interop import convert
from tests.conftest import ROOT, subprocess_env

SCHEMES = ("fp8_dynamic", "fp8_block", "w4a16")
# Enough pre-training that greedy continuations differ by prompt; the adapters only need to exist (vLLM's CPU build
# cannot run them yet, docs/serving.md#lora-adapters) and to change the answer.
STEPS, SFT_STEPS = 120, 5


@pytest.fixture(scope="session")
def serving_python() -> str:
    venv = os.environ.get("GLM46_SERVING_VENV", "")
    python = os.path.join(venv, "bin", "python")
    if not venv or not os.path.isfile(os.path.join(venv, ".installed")):
        why = f"no serving venv (GLM46_SERVING_VENV={venv!r}): run `make test-serving`, which builds it"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return python


def _train(args: list[str], log: str) -> None:
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-m", "glm46_jax.train", *args, "--config.mesh.data=1",
                               "--config.monitor.sinks=jsonl"], cwd=ROOT, env=subprocess_env(), stdout=out,
                              stderr=subprocess.STDOUT, timeout=1200)
    assert proc.returncode == 0, open(log).read()[-3000:]


@pytest.fixture(scope="session")
def models(tmp_path_factory, sample_corpus) -> dict[str, str]:
    """Paths: `run`, `f32`, `bf16`, one per scheme, `lora_run`, `peft`, `merged_f32`, `chats`, `heldout` (token rows
    [n, 129] of the prose and code held-out splits, whole rows of text) and `tokenizer`."""
    from data_prep import cli as data_cli

    root = str(tmp_path_factory.mktemp("serving"))
    p = {name: os.path.join(root, name) for name in ("run", "f32", "bf16", "lora_run", "peft", "merged_f32",
                                                      "chats", *SCHEMES)}
    p["tokenizer"] = os.path.join(sample_corpus, "tokenizer.json")
    _train(["--config=configs/pretrain.py:serve", f"--config.run_dir={p['run']}", f"--config.data.root={sample_corpus}",
            f"--config.train.steps={STEPS}", "--config.train.eval_every=0", "--config.checkpoint.every=1000"],
           os.path.join(root, "train.log"))
    convert.main(["ckpt-to-hf", "--run-dir", p["run"], "--out", p["f32"], "--dtype", "float32"])
    convert.main(["ckpt-to-hf", "--run-dir", p["run"], "--out", p["bf16"]])
    for scheme in SCHEMES:
        convert.main(["quantize", "--hf-dir", p["bf16"], "--out", p[scheme], "--scheme", scheme])
    assert data_cli.main(["sample-sft", "--tokenizer", p["tokenizer"], "--out", p["chats"],
                          "--conversations", "200"]) == 0
    _train(["--config=configs/sft.py:serve", f"--config.run_dir={p['lora_run']}",
            f"--config.checkpoint.init_from={p['run']}", f"--config.sft.root={p['chats']}",
            f"--config.train.steps={SFT_STEPS}", "--config.train.eval_every=0"], os.path.join(root, "sft.log"))
    convert.main(["lora-to-peft", "--run-dir", p["lora_run"], "--out", p["peft"]])
    convert.main(["ckpt-to-hf", "--run-dir", os.path.join(p["lora_run"], "merged"), "--out", p["merged_f32"],
                  "--dtype", "float32"])
    rows = []
    for domain in ("prose", "code"):
        batch = next(heldout_batches(sample_corpus, domain, 128, 64))
        whole = batch["loss_mask"].all(axis=1)
        rows.extend(np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)[whole][:8])
    rows = np.stack(rows)
    assert len(rows) >= 8, "too few whole held-out rows for a CE comparison"
    p["heldout"] = os.path.join(root, "heldout.npy")
    np.save(p["heldout"], rows.astype(np.int64))
    return p


@pytest.fixture(scope="session")
def hf_views(models, serving_python, tmp_path_factory) -> dict[str, dict[str, np.ndarray]]:
    """What transformers (and compressed-tensors' compressor) make of the bf16 export and each quantized one, on the
    held-out rows: tests/serving/hf_check.py run once in the serving venv over all four."""
    out = str(tmp_path_factory.mktemp("hf_views"))
    names = ("bf16", *SCHEMES)
    cmd = [serving_python, os.path.join(os.path.dirname(__file__), "hf_check.py"), "--tokens", models["heldout"],
           "--source", models["bf16"], "--out-dir", out]
    for name in names:
        cmd += ["--hf-dir", models[name]]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: dict(np.load(os.path.join(out, f"{os.path.basename(models[name])}.npz"))) for name in names}


def sizes(models: dict[str, str]) -> dict[str, int]:
    """Bytes of safetensors per export (what RESULTS.md reports)."""
    return {name: sum(os.path.getsize(os.path.join(models[name], f)) for f in os.listdir(models[name])
                      if f.endswith(".safetensors")) for name in ("f32", "bf16", *SCHEMES)}


def generation_stops(export: str) -> list[int]:
    with open(os.path.join(export, "generation_config.json")) as f:
        eos = json.load(f).get("eos_token_id", [])
    return eos if isinstance(eos, list) else [eos]

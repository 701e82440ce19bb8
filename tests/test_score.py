"""The scoring CLI against log-probabilities computed in NumPy from HF's own golden logits."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import FIXTURES
from glm46_jax.infer import score
from glm46_jax.errors import InputError
from test_hf_parity import without_mtp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m module args` as a user runs it (CPU only; tests never need an accelerator)."""
    return subprocess.run([sys.executable, "-m", module, *args], check=False, capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600)


def assert_one_line_error(proc: subprocess.CompletedProcess, message: str) -> None:
    """Exit code 2 and exactly one stderr line, `error: ...` containing `message`; no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr)
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]


def _np_logprobs(logits, ids):
    z = logits.astype(np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    return logp[np.arange(len(ids) - 1), ids[1:]]


@pytest.mark.parametrize("case", ["hf_full", "hf_mqa"])  # hf_mqa: one KV head (issue 27)
def test_score_matches_hf_logprobs(case, tmp_path, capsys):
    gold = np.load(os.path.join(FIXTURES, case, "golden.npz"))
    ids = gold["input_ids"][0]
    out = tmp_path / "logits.npy"
    total = score.main(["--hf-dir", os.path.join(FIXTURES, case),
                        "--tokens", ",".join(map(str, ids)), "--out", str(out)])
    want = _np_logprobs(gold["logits"][0], ids)
    assert abs(total - want.sum()) <= 1e-4 * len(want)
    printed = capsys.readouterr().out
    rows = [line.split() for line in printed.splitlines()[1:len(ids)]]
    np.testing.assert_allclose([float(r[2]) for r in rows], want, atol=1e-4)
    assert f"over {len(ids) - 1} predicted tokens" in printed
    np.testing.assert_allclose(np.load(out), gold["logits"][0], atol=1e-4)


def test_score_rejects_out_of_vocab_ids():
    with pytest.raises(InputError, match=r"out of range: \[999\]"):
        score.main(["--hf-dir", os.path.join(FIXTURES, "hf_air"), "--tokens", "1,2,999"])


def test_score_text_needs_a_tokenizer():
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        score.main(["--hf-dir", os.path.join(FIXTURES, "hf_air"), "--text", "hello"])


def test_score_dir_without_mtp_warns_once_and_matches_hf(tmp_path):
    """A directory saved by transformers (no MTP tensors) scores with the main model, saying so on one line."""
    gold = np.load(os.path.join(FIXTURES, "hf_full", "golden.npz"))
    ids = gold["input_ids"][1]
    d = without_mtp(os.path.join(FIXTURES, "hf_full"), str(tmp_path / "no_mtp"))
    proc = run_cli("glm46_jax.score", "--hf-dir", d, "--tokens", ",".join(map(str, ids)))
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "MTP" in line]
    assert len(warned) == 1 and "without the MTP layer" in warned[0], proc.stderr
    assert "Traceback" not in proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:len(ids)]]
    np.testing.assert_allclose([float(r[2]) for r in rows], _np_logprobs(gold["logits"][1], ids), atol=1e-4)


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_inputs")
    inconsistent = root / "inconsistent"
    inconsistent.mkdir()
    with open(os.path.join(FIXTURES, "hf_air", "config.json")) as f:
        config = json.load(f)
    config["num_experts_per_tok"] = 9  # of 8 experts
    (inconsistent / "config.json").write_text(json.dumps(config))
    shutil.copy(os.path.join(FIXTURES, "hf_air", "model.safetensors"), inconsistent)
    junk = root / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("not a checkpoint")
    return {"inconsistent": str(inconsistent), "junk": str(junk), "missing": str(root / "nope"),
            "air": os.path.join(FIXTURES, "hf_air")}


@pytest.mark.parametrize("args, message", [
    (["--hf-dir", "{missing}", "--tokens", "1,2"], "no HF config.json"),
    (["--checkpoint", "{junk}", "--tokens", "1,2"], "not a checkpoint"),
    (["--hf-dir", "{inconsistent}", "--tokens", "1,2"], "num_experts_per_tok"),
    (["--hf-dir", "{air}", "--tokens", "1,two"], "--tokens='1,two'"),
    (["--hf-dir", "{air}", "--tokens", "1,2", "--dtype", "float16"], "--dtype"),
    (["--hf-dir", "{air}", "--text", "hello"], "tokenizer.json"),
], ids=["missing-dir", "not-a-checkpoint", "inconsistent-config", "bad-tokens", "bad-dtype", "no-tokenizer"])
def test_score_user_errors_are_one_line_exit_2(args, message, bad_inputs):
    assert_one_line_error(run_cli("glm46_jax.score", *(a.format(**bad_inputs) for a in args)), message)

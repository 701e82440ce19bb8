"""The scoring CLI against log-probabilities computed in NumPy from HF's own golden logits."""

import os

import numpy as np
import pytest

from conftest import FIXTURES
from glm46_jax import score


def _np_logprobs(logits, ids):
    z = logits.astype(np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    return logp[np.arange(len(ids) - 1), ids[1:]]


def test_score_matches_hf_logprobs(tmp_path, capsys):
    gold = np.load(os.path.join(FIXTURES, "hf_full", "golden.npz"))
    ids = gold["input_ids"][0]
    out = tmp_path / "logits.npy"
    total = score.main(["--hf-dir", os.path.join(FIXTURES, "hf_full"),
                        "--tokens", ",".join(map(str, ids)), "--out", str(out)])
    want = _np_logprobs(gold["logits"][0], ids)
    assert abs(total - want.sum()) <= 1e-4 * len(want)
    printed = capsys.readouterr().out
    rows = [line.split() for line in printed.splitlines()[1:len(ids)]]
    np.testing.assert_allclose([float(r[2]) for r in rows], want, atol=1e-4)
    assert f"over {len(ids) - 1} predicted tokens" in printed
    np.testing.assert_allclose(np.load(out), gold["logits"][0], atol=1e-4)


def test_score_rejects_out_of_vocab_ids(capsys):
    with pytest.raises(SystemExit):
        score.main(["--hf-dir", os.path.join(FIXTURES, "hf_air"), "--tokens", "1,2,999"])
    assert "out of range: [999]" in capsys.readouterr().err


def test_score_text_needs_a_tokenizer():
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        score.main(["--hf-dir", os.path.join(FIXTURES, "hf_air"), "--text", "hello"])

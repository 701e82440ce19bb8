"""`python -m glm46_jax.eval`: held-out CE per domain over every held-out document exactly once.

References: the number of predicted tokens is data_prep's own count (tokens - documents per domain,
from metadata.json); the CE is recomputed here in float64 from the model's logits."""

import json
import os

import jax
import numpy as np
import pytest
from conftest import float64_nll

from glm46_jax.training import checkpoint
from glm46_jax.parallel import sharding
from glm46_jax.infer import eval as eval_cli
from glm46_jax.cli import InputError
from glm46_jax.config import TINY
from glm46_jax.model import init_model


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """Freshly initialised tiny weights (vocab 512, the sample corpus's tokenizer) saved as a checkpoint."""
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    _, params, buffers = init_model(TINY, mesh, seed=0)
    directory = str(tmp_path_factory.mktemp("ckpt"))
    checkpoint.save_params(os.path.join(directory, "checkpoints"), 0, params, buffers, TINY)
    return directory


def test_every_heldout_target_once_and_ce_in_float64(tiny_checkpoint, sample_corpus, tmp_path):
    out = str(tmp_path / "eval.json")
    results = eval_cli.main(["--checkpoint", tiny_checkpoint, "--corpus", sample_corpus, "--seq-len", "64",
                             "--batch", "4", "--out", out])
    with open(os.path.join(sample_corpus, "metadata.json")) as f:
        meta = json.load(f)["domains"]
    by_domain = {r["domain"]: r for r in results}
    assert sorted(by_domain) == ["all", "code", "prose"]
    for d in ("code", "prose"):  # a document of n tokens has n - 1 next-token targets, each predicted once
        assert by_domain[d]["tokens"] == meta[d]["heldout"]["tokens"] - meta[d]["heldout"]["documents"], d
    total = by_domain["code"]["tokens"] + by_domain["prose"]["tokens"]
    assert by_domain["all"]["tokens"] == total
    assert by_domain["all"]["ce"] == pytest.approx(
        (by_domain["code"]["ce"] * by_domain["code"]["tokens"] + by_domain["prose"]["ce"] * by_domain["prose"]["tokens"])
        / total)
    with open(out) as f:
        assert json.load(f) == results

    # prose recomputed: float64 log-softmax of the checkpoint's logits over the same rows.
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    _, graphdef, params, buffers = checkpoint.load_params(tiny_checkpoint, mesh)
    nll_sum, count = 0.0, 0.0
    for batch in eval_cli.heldout_batches(sample_corpus, "prose", 64, 4):
        nll = float64_nll(graphdef, params, buffers, mesh, batch)
        nll_sum += (nll * batch["loss_mask"]).sum()
        count += batch["loss_mask"].sum()
    assert by_domain["prose"]["ce"] == pytest.approx(nll_sum / count, abs=1e-5)
    assert abs(by_domain["prose"]["ce"] - np.log(512)) < 0.1  # untrained: near uniform over 512 ids


@pytest.mark.parametrize("args, message", [
    (["--domains", "wiki"], r"--domains: \['wiki'\] are not in the corpus"),
    (["--seq-len", "0"], "--seq-len=0"),
])
def test_bad_requests_are_input_errors(tiny_checkpoint, sample_corpus, args, message):
    with pytest.raises(InputError, match=message):
        eval_cli.main(["--checkpoint", tiny_checkpoint, "--corpus", sample_corpus, *args])

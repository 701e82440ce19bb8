"""`python -m glm46_jax.eval`: held-out CE per domain over every held-out document exactly once, and the forgetting
gate (--baseline / --guard).

References: the number of predicted tokens is data_prep's own count (tokens - documents per domain,
from metadata.json); the CE is recomputed here in float64 from the model's logits. The baseline's columns are
the baseline evaluated alone (a second, independent run), and the guard's thresholds are set just below and just
above the regression those runs measured."""

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from conftest import float64_nll

from glm46_jax.errors import InputError
from glm46_jax.config import TINY
from glm46_jax.infer import eval as eval_cli
from glm46_jax.interop.hf import save_hf
from glm46_jax.model import init_model
from glm46_jax.parallel import sharding
from glm46_jax.training import checkpoint


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
    results = eval_cli.evaluate(["--checkpoint", tiny_checkpoint, "--corpus", sample_corpus, "--seq-len", "64",
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
    (["--baseline", "{ckpt}", "--guard", "prose,wiki"],
     r"^--guard: \['wiki'\] not in the held-out data of .*; available: \['code', 'prose', 'all'\]$"),
    (["--baseline", "{ckpt}", "--domains", "prose", "--guard", "code"],
     r"^--guard: \['code'\] not in the --domains; available: \['prose', 'all'\]$"),
    (["--guard", "prose"], "^--guard needs --baseline"),
    (["--baseline", "{ckpt}", "--max-regression", "0.1"], "^--max-regression=0.1 needs --guard"),
    (["--baseline", "{ckpt}", "--guard", "prose", "--max-regression", "-0.1"], "^--max-regression=-0.1: must be"),
    (["--baseline", "{corpus}"], "^--baseline .*: neither a Hugging Face directory .* nor a checkpoint"),
])
def test_bad_requests_are_input_errors(tiny_checkpoint, sample_corpus, args, message):
    args = [a.format(ckpt=tiny_checkpoint, corpus=sample_corpus) for a in args]
    with pytest.raises(InputError, match=message):
        eval_cli.main(["--checkpoint", tiny_checkpoint, "--corpus", sample_corpus, *args])


# --- the forgetting gate: --baseline, --guard, --max-regression ----------------------------------------------------

EVAL_SHAPE = ["--seq-len", "64", "--batch", "4", "--domains", "prose"]  # the shapes above: one compiled forward


@pytest.fixture(scope="module")
def gate_pair(tiny_checkpoint, sample_corpus, tmp_path_factory):
    """(model, baseline), both carrying the corpus's tokenizer.json: the baseline is tiny_checkpoint's weights exported
    as a Hugging Face directory, the model a training run whose weights moved 0.05 x N(0, 1) away from them (its
    prose CE is ~2% higher: a real regression of the size the gate is for)."""
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    cfg, _, params, buffers = checkpoint.load_params(tiny_checkpoint, mesh)
    tokenizer = os.path.join(sample_corpus, "tokenizer.json")
    baseline = str(tmp_path_factory.mktemp("baseline_hf"))
    save_hf(baseline, cfg, params, buffers, dtype="float32")
    shutil.copy(tokenizer, os.path.join(baseline, "tokenizer.json"))
    rng = np.random.default_rng(1)  # NumPy noise: jax.random would compile a sampler per weight shape
    moved = jax.tree.map(lambda p: jax.device_put(np.asarray(p) + 0.05 * rng.standard_normal(p.shape, np.float32),
                                                  p.sharding), params)
    model = str(tmp_path_factory.mktemp("model_run"))
    checkpoint.save_params(os.path.join(model, "checkpoints"), 1, moved, buffers, cfg)
    shutil.copy(tokenizer, os.path.join(model, "tokenizer.json"))  # where a training run keeps it
    return model, baseline


@pytest.fixture(scope="module")
def compared(gate_pair, sample_corpus, tmp_path_factory):
    """The model against the baseline: (the returned rows, the JSON written by --out)."""
    model, baseline = gate_pair
    out = str(tmp_path_factory.mktemp("compared") / "eval.json")
    results = eval_cli.evaluate(["--checkpoint", model, "--baseline", baseline, "--corpus", sample_corpus,
                                 *EVAL_SHAPE, "--out", out])
    with open(out) as f:
        return results, json.load(f)


def test_baseline_columns_are_the_baseline_evaluated_alone(gate_pair, compared, sample_corpus):
    results, written = compared
    assert written == results
    alone = eval_cli.evaluate(["--hf-dir", gate_pair[1], "--corpus", sample_corpus, *EVAL_SHAPE])
    assert [r["domain"] for r in results] == [r["domain"] for r in alone] == ["prose", "all"]
    for r, b in zip(results, alone):
        assert r["tokens"] == b["tokens"], r["domain"]  # the same held-out targets
        assert r["baseline_ce"] == pytest.approx(b["ce"], rel=1e-12), r["domain"]
        assert r["baseline_ppl"] == pytest.approx(b["ppl"], rel=1e-12), r["domain"]
        assert r["ce_diff"] == pytest.approx(r["ce"] - b["ce"], rel=1e-12)
        assert r["ce_rel_diff"] == pytest.approx((r["ce"] - b["ce"]) / b["ce"], rel=1e-12)
        assert r["ce"] != b["ce"] and "regressed" not in r  # two different models; no --guard, no verdict


def test_guard_exits_1_past_max_regression_and_0_within(gate_pair, compared, sample_corpus, tmp_path, capsys):
    model, baseline = gate_pair
    prose = compared[0][0]
    regression = (prose["ce"] - prose["baseline_ce"]) / prose["baseline_ce"]
    assert regression > 0.005  # the moved weights really are worse on prose

    def gate(max_regression: float) -> tuple[int, dict, str]:
        out = str(tmp_path / f"gate_{max_regression}.json")
        code = eval_cli.main(["--checkpoint", model, "--baseline", baseline, "--corpus", sample_corpus, *EVAL_SHAPE,
                              "--guard", "prose", "--max-regression", str(max_regression), "--out", out])
        with open(out) as f:
            return code, json.load(f)[0], capsys.readouterr().out

    code, row, printed = gate(0.9 * regression)
    assert code == 1 and row["regressed"] and row["max_regression"] == pytest.approx(0.9 * regression)
    assert f"guard REGRESSED: prose CE {prose['baseline_ce']:.4f} -> {prose['ce']:.4f}" in printed, printed
    assert f"{regression:+.2%}; allowed +{0.9 * regression:.2%}" in printed, printed
    code, row, printed = gate(1.1 * regression)
    assert code == 0 and not row["regressed"]
    assert f"guard ok: prose CE {prose['baseline_ce']:.4f} -> {prose['ce']:.4f}" in printed, printed


def test_a_different_tokenizer_is_an_input_error_naming_both(tiny_checkpoint, sample_corpus, tmp_path):
    """Checked before either model loads: two copies of the tiny run, one with the corpus's tokenizer.json and one
    with two of its ids swapped, given as a step directory."""
    model, other = str(tmp_path / "model"), str(tmp_path / "other")
    shutil.copytree(tiny_checkpoint, model)
    shutil.copytree(tiny_checkpoint, other)
    shutil.copy(os.path.join(sample_corpus, "tokenizer.json"), os.path.join(model, "tokenizer.json"))
    with open(os.path.join(sample_corpus, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # the same pieces, another tokenization
    with open(os.path.join(other, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    step_dir = os.path.join(other, "checkpoints", "0")
    with pytest.raises(InputError, match=re.escape(f"the model's {os.path.join(model, 'tokenizer.json')} and the "
                                                   f"baseline's {os.path.join(other, 'tokenizer.json')}")):
        eval_cli.main(["--checkpoint", model, "--baseline", step_dir, "--corpus", sample_corpus, "--guard", "prose"])
    # the same tokenizer written out again (another indentation) is the same tokenizer
    with open(os.path.join(sample_corpus, "tokenizer.json")) as f, open(os.path.join(other, "tokenizer.json"), "w") as g:
        json.dump(json.load(f), g, indent=1)
    eval_cli._check_tokenizers({"checkpoint": model}, {"checkpoint": step_dir})

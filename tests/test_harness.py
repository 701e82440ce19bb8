"""The lm-evaluation-harness adapter against independent references: score's per-token log-probs (one row, one
device) for loglikelihood and the rolling windows assembled by hand, argmax by hand for is_greedy, generate() +
cutting at the stop string for generate_until, an accuracy computed by hand for a local multiple-choice task run
through lm-eval, and the one-line errors of `python -m glm46_jax.harness` for broken task files."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("lm_eval")

from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from data_prep.tokenizer import train_bpe
from glm46_jax.infer import harness
from glm46_jax.parallel import sharding
from glm46_jax.errors import InputError
from glm46_jax.config import TINY
from glm46_jax.infer.generate import generate
from glm46_jax.interop.hf import save_hf
from glm46_jax.model import abstract_model, apply, init_model
from glm46_jax.infer.load import Tokenizer as _Tokenizer
from glm46_jax.infer.score import token_logprobs

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
CFG = TINY  # 512 ids (the trained tokenizer uses at most 400 of them), eos 1, pad 0
MAX_LENGTH = 16  # short enough that texts need several rolling windows and contexts get cut from the left
REF_LEN = 48  # the reference row's fixed length (one compiled program for every text)
SENTENCES = ["The cat sat on the mat.", "A dog ran in the park.", "One two three four five six.",
             "The sun is hot and the moon is cold.", "Birds fly over the green hills.", "def add(x, y): return x + y"]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("harness_tok") / "tokenizer.json")
    train_bpe(SENTENCES * 4, 400).save(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_path):
    return _Tokenizer(tok_path)


@pytest.fixture(scope="module")
def model(mesh1):
    """(graphdef, params, buffers) on one device: random init plus noise larger than the init scale, so logits
    are far from flat (no near-ties for argmax)."""
    graphdef, params, buffers = init_model(CFG, mesh1, seed=0)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda p: jax.device_put(np.asarray(p) + 0.1 * rng.standard_normal(p.shape, np.float32),
                                                   p.sharding), params)
    return graphdef, params, buffers


@pytest.fixture(scope="module")
def lm(model, tok_path):
    """The adapter on an 8-device data-parallel mesh (8 rows per forward pass)."""
    mesh8 = sharding.make_mesh({"data": 8})
    graphdef, params, buffers = model
    _, abs_params, abs_buffers = abstract_model(CFG, mesh8)
    place = lambda a, s: jax.device_put(np.asarray(a), s.sharding)
    params8, buffers8 = jax.tree.map(place, params, abs_params), jax.tree.map(place, buffers, abs_buffers)
    return harness.GLMHarnessLM.from_model(CFG, graphdef, params8, buffers8, tok_path, mesh8, batch_size=1,
                                           max_length=MAX_LENGTH, max_gen_toks=4)


@pytest.fixture(scope="module")
def reference(model, mesh1):
    """ids -> (log p(ids[t] | ids[:t]) for t >= 1 from score.token_logprobs, argmax of the logits there): one
    row on one device. The row is right-padded to REF_LEN, which a causal model's earlier logits cannot see."""
    graphdef, params, buffers = model

    @jax.jit
    def run(params, buffers, tokens):
        logits = apply(graphdef, params, buffers, tokens, with_mtp=False).logits
        return token_logprobs(logits, tokens), jnp.argmax(logits[:, :-1], axis=-1)

    def ref(ids):
        assert 2 <= len(ids) <= REF_LEN
        row = np.zeros((1, REF_LEN), np.int32)
        row[0, :len(ids)] = ids
        with sharding.use_mesh(mesh1):
            logp, greedy = run(params, buffers, jnp.asarray(row))
        return np.asarray(logp, np.float64)[0, :len(ids) - 1], np.asarray(greedy)[0, :len(ids) - 1]
    return ref


def _harness_split(tok, context, continuation):
    """The harness's tokenization of a request: context alone, and the rest of context + continuation."""
    if not context:
        return [CFG.eos_token_id[0]], tok.encode(continuation)
    ctx, whole = tok.encode(context), tok.encode(context + continuation)
    return ctx, whole[len(ctx):]


def _ref_loglikelihood(tok, reference, context, continuation):
    ctx, cont = _harness_split(tok, context, continuation)
    seq = (ctx + cont)[-(MAX_LENGTH + 1):]
    logp, greedy = reference(seq)
    return logp[-len(cont):].sum(), bool((greedy[-len(cont):] == np.asarray(seq[-len(cont):])).all())


def _requests(kind, args):
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_loglikelihood_equals_score(lm, tok, reference):
    # 12 pairs (two batches of 8 rows): each sentence cut before its last and its second-to-last word
    pairs = [(s[:k], s[k:]) for s in SENTENCES for k in (s.rindex(" "), s[:s.rindex(" ")].rindex(" "))]
    pairs += [("", SENTENCES[1]), (" ".join(SENTENCES[:3]), " The end.")]  # empty context; cut from the left
    assert len(_harness_split(tok, *pairs[-1])[0]) > MAX_LENGTH
    got = lm.loglikelihood(_requests("loglikelihood", pairs))
    for (context, continuation), (ll, greedy) in zip(pairs, got):
        want_ll, want_greedy = _ref_loglikelihood(tok, reference, context, continuation)
        np.testing.assert_allclose(ll, want_ll, atol=1e-5, rtol=0, err_msg=repr((context, continuation)))
        assert greedy == want_greedy


def test_is_greedy_against_argmax_by_hand(lm, tok, reference):
    context = tok.encode(SENTENCES[3])[:6]
    chain = []  # the greedy continuation, one argmax at a time
    for _ in range(3):
        _, greedy = reference(context + chain + [0])
        chain.append(int(greedy[-1]))
    other = (chain[-1] + 1) % 256
    got = lm._loglikelihood_tokens([(("", ""), context, chain), (("", ""), context, chain[:-1] + [other])])
    assert [g for _, g in got] == [True, False]
    logp, _ = reference(context + chain)
    np.testing.assert_allclose(got[0][0], logp[-3:].sum(), atol=1e-5, rtol=0)


def test_loglikelihood_rolling_one_window_and_many(lm, tok, reference):
    short, long = SENTENCES[0], " ".join(SENTENCES)
    ids = tok.encode(long)
    assert len(tok.encode(short)) < MAX_LENGTH < 2 * MAX_LENGTH < len(ids)
    got = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(short,), (long,)]))

    one_window = reference([CFG.eos_token_id[0]] + tok.encode(short))[0].sum()
    # By hand: chunks of MAX_LENGTH predicted tokens; each token is predicted from at most MAX_LENGTH tokens
    # before it, the text's first from the EOS prefix; the last chunk is shorter but keeps a full context.
    ext, windows = [CFG.eos_token_id[0]] + ids, 0.0
    for start in range(0, len(ids), MAX_LENGTH):
        end = min(start + MAX_LENGTH, len(ids))
        logp, _ = reference(ext[max(0, end - MAX_LENGTH):end + 1])
        windows += logp[-(end - start):].sum()
    # fp32 log-softmax: ~1e-6 per predicted token
    np.testing.assert_allclose(got, [one_window, windows], atol=max(1e-5, 1e-6 * len(ids)), rtol=0)


def test_generate_until_equals_generate_then_cut(lm, model, tok, mesh1):
    prompts = SENTENCES[:3]
    # The harness keeps the last max_length - max_gen_toks tokens of a prompt.
    ids = [tok.encode(p)[-(MAX_LENGTH - 4):] for p in prompts]
    graphdef, params, buffers = model
    with sharding.use_mesh(mesh1):
        out = generate(graphdef, params, buffers, ids, max_new_tokens=4, stop_tokens=CFG.eos_token_id, pad_id=0)
    texts = []
    for row, n in zip(np.asarray(out.tokens), np.asarray(out.lengths)):
        texts.append(tok._decode([int(t) for t in row[:n] if t not in CFG.eos_token_id]))
    assert len(texts[0]) >= 3, texts
    until = [texts[0][1:3], "never appears"]  # cuts the first text at its second character (or earlier)
    got = lm.generate_until(_requests("generate_until", [(p, {"until": until, "max_gen_toks": 4}) for p in prompts]))
    assert len(got[0]) < len(texts[0])
    for text, g in zip(texts, got):
        assert g == text[:min((text.find(u) for u in until if u in text), default=len(text))]


MC_DOCS = [{"question": s.rsplit(" ", 1)[0], "choices": [s.rsplit(" ", 1)[1], "cat", "sky.", "tree"], "answer": 0}
           for s in SENTENCES]


def _write_task(path, name, data_file, cache_dir):
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data_file}\n  cache_dir: {cache_dir}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")


def _mc_task(tmp_path):
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    _write_task(tmp_path / "tasks", "glm_local_mc", data, tmp_path / "hf_cache")
    return tmp_path / "tasks"


def _mc_accuracy_by_hand(tok, reference):
    """The share of questions whose answer has the highest log-likelihood (lm-eval joins them with " ")."""
    return np.mean([int(np.argmax([_ref_loglikelihood(tok, reference, d["question"], " " + c)[0]
                                   for c in d["choices"]])) == d["answer"] for d in MC_DOCS])


def test_local_multiple_choice_task(lm, tok, reference, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    manager = TaskManager(include_path=str(_mc_task(tmp_path)), include_defaults=False)

    def accuracy():
        results = simple_evaluate(model=lm, tasks=["glm_local_mc"], task_manager=manager, random_seed=0)
        return results["results"]["glm_local_mc"]["acc,none"]

    first = accuracy()
    assert first == pytest.approx(_mc_accuracy_by_hand(tok, reference), abs=1e-12)
    assert accuracy() == first


def test_cli_runs_the_task_from_an_hf_dir(model, tok, tok_path, reference, tmp_path, monkeypatch):
    """python -m glm46_jax.harness (lm-eval's CLI, the model built from model_args) gets the same accuracy."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() hands lm-eval its arguments through sys.argv
    hf_dir = tmp_path / "hf"
    save_hf(str(hf_dir), CFG, model[1], model[2], dtype="float32")
    shutil.copy(tok_path, hf_dir / "tokenizer.json")
    out = tmp_path / "results"
    harness.main(["--model", "glm46_jax", "--model_args", f"hf_dir={hf_dir},max_length={MAX_LENGTH}",
                  "--tasks", "glm_local_mc", "--include_path", str(_mc_task(tmp_path)), "--output_path", str(out)])
    [path] = list(out.rglob("results_*.json"))
    acc = json.loads(path.read_text())["results"]["glm_local_mc"]["acc,none"]
    assert acc == pytest.approx(_mc_accuracy_by_hand(tok, reference), abs=1e-12)


def _run_cli(*args, cwd=ROOT):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "glm46_jax.harness", *args], cwd=cwd, env=env, check=False,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("broken", ["yaml", "data_file"])
def test_cli_broken_task_file_is_one_line_exit_2(broken, tmp_path):
    tasks = tmp_path / "tasks"
    _write_task(tasks, "glm_broken", tmp_path / "missing.jsonl", tmp_path / "hf_cache")
    if broken == "yaml":
        (tasks / "glm_broken.yaml").write_text("task: glm_broken\ndataset_path: json\n  dataset_kwargs: [open\n")
    r = _run_cli("--model", "glm46_jax", "--model_args", f"checkpoint={tmp_path / 'no_run'}", "--tasks",
                 "glm_broken", "--include_path", str(tasks))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    want = "glm_broken.yaml:3: the task YAML does not parse" if broken == "yaml" else "missing.jsonl"
    assert want in lines[0]


def test_bad_model_args_are_input_errors(tok_path):
    with pytest.raises(InputError, match="unknown.*chekpoint"):
        harness.GLMHarnessLM(chekpoint="runs/x")
    with pytest.raises(InputError, match="exactly one of checkpoint"):
        harness.GLMHarnessLM(checkpoint="a", hf_dir="b")
    with pytest.raises(InputError, match="auto"):
        harness._rows_per_batch("auto", 8)
    assert harness._rows_per_batch(1, 8) == 8 and harness._rows_per_batch(9, 8) == 16


def test_cut_at_stop_and_buckets():
    assert harness.cut_at_stop("a\n\nb.c", ["\n\n", "."]) == "a"
    assert harness.cut_at_stop("abc", ["x", ""]) == "abc"
    assert [harness.bucket(n, 100) for n in (1, 16, 17, 64, 65, 99)] == [16, 16, 32, 64, 100, 100]

"""MTP speculative decoding against independent references: plain greedy decoding token for token (on a
model whose MTP layer drafts well and on one whose drafts are all rejected), the exact target distribution
of sampling (float64 enumeration over a small vocabulary, chi-square), per-row bookkeeping with stops and
max_new_tokens, and an 8-device mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from glm46_jax.infer import generate as gen
from glm46_jax.parallel import sharding
from glm46_jax.infer import speculative as spec
from glm46_jax.errors import InputError
from glm46_jax.config import TINY
from glm46_jax.training.loss import token_nll
from glm46_jax.model import abstract_model, apply, init_model

from conftest import jitted_apply, prefix_forward

VOCAB = 16
CFG = dataclasses.replace(TINY, vocab_size=VOCAB, dtype="float32", moe_capacity_factor=0.0)
PROMPTS = [[3, 1, 4, 1, 5, 9], [2, 6], [5, 3, 5, 8], [9]]


def _chain(seed=0):
    """A deterministic next-token map: sequences follow it, so both the main model and the MTP layer can
    learn it (the MTP's target x[t+2] = f(x[t+1]))."""
    return np.random.default_rng(seed).permutation(VOCAB)


def _train(steps, seed=0):
    """The tiny model trained with optax on chain sequences, main + MTP cross-entropy."""
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    graphdef, params, buffers = init_model(CFG, mesh, seed=seed)
    f = _chain()
    rng = np.random.default_rng(seed)
    seqs = np.empty((32, 24), np.int32)
    seqs[:, 0] = rng.integers(0, VOCAB, 32)
    for t in range(1, seqs.shape[1]):
        seqs[:, t] = f[seqs[:, t - 1]]
    tokens = jnp.asarray(seqs)
    opt = optax.adam(3e-3)

    def loss(p):
        out = apply(graphdef, p, buffers, tokens)
        return token_nll(out.logits[:, :-1], tokens[:, 1:]).mean() + token_nll(out.mtp_logits[:, :-2],
                                                                                tokens[:, 2:]).mean()

    @jax.jit
    def step(p, s):
        grads = jax.grad(loss)(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    with sharding.use_mesh(mesh):
        state = opt.init(params)
        for _ in range(steps):
            params, state = step(params, state)
    return graphdef, params, buffers


@pytest.fixture(scope="module")
def trained():
    return _train(steps=150)


@pytest.fixture(scope="module")
def untrained(mesh1):
    # Random weights scaled up (logits far from uniform, no near-ties): its MTP layer's drafts are noise.
    graphdef, params, buffers = init_model(CFG, mesh1, seed=7)
    keys = iter(jax.random.split(jax.random.key(0), 200))
    params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(next(keys), p.shape, p.dtype), params)
    return graphdef, params, buffers


def _rows(out):
    return [list(np.asarray(out.tokens)[i, :n]) for i, n in enumerate(np.asarray(out.lengths))]


def _both(model, mesh, prompts, **kw):
    graphdef, params, buffers = model
    with sharding.use_mesh(mesh):
        plain = gen.generate(graphdef, params, buffers, prompts, **kw)
        fast, stats = spec.generate_speculative(graphdef, params, buffers, prompts, **kw)
    return plain, fast, stats


@pytest.mark.parametrize("which", ["trained", "untrained"])
def test_greedy_equals_plain_greedy(which, request, mesh1):
    model = request.getfixturevalue(which)
    plain, fast, stats = _both(model, mesh1, PROMPTS, max_new_tokens=12)
    assert _rows(fast) == _rows(plain)
    np.testing.assert_array_equal(np.asarray(fast.lengths), 12)
    # Greedy log-probs are the model's own softmax, as in plain decoding (fed two tokens at a time here).
    np.testing.assert_allclose(np.asarray(fast.logprobs), np.asarray(plain.logprobs), atol=2e-5)
    rate = stats.acceptance_rate
    if which == "trained":  # the MTP layer learned the chain: most drafts hold, ~2 tokens per forward
        assert rate > 0.8, rate
        assert spec.tokens_per_forward(fast, stats) > 1.6
    else:
        assert rate < 0.5, rate
    # A row's tokens = 1 (prefill) + one per verified draft + one per accepted draft, less the last step's
    # bonus token when max_new_tokens cut it off.
    extra = 1 + np.asarray(stats.drafted) + np.asarray(stats.accepted) - np.asarray(fast.lengths)
    assert set(extra.tolist()) <= {0, 1}, extra
    assert int(stats.forwards) == 1 + int(np.max(stats.drafted))


def test_stops_and_max_new_tokens_per_row(trained, mesh1):
    plain_full, _, _ = _both(trained, mesh1, PROMPTS, max_new_tokens=10)
    full = _rows(plain_full)
    stop = full[0][3]
    for n in (1, 2, 5):
        plain, fast, _ = _both(trained, mesh1, PROMPTS, max_new_tokens=n, stop_tokens=[stop], pad_id=0)
        assert _rows(fast) == _rows(plain), n
        rows = _rows(fast)
        for row, ref in enumerate(full):
            k = min(n, ref.index(stop) + 1 if stop in ref else n)
            assert rows[row] == ref[:k], (n, row)
            assert np.all(np.asarray(fast.tokens)[row, k:] == 0) and np.all(np.asarray(fast.logprobs)[row, k:] == 0)


def test_sharded_mesh_gives_same_tokens(trained, mesh1):
    mesh8 = sharding.make_mesh({"data": 2, "tensor": 2, "expert": 2})
    graphdef, params, buffers = trained
    _, abs_params, abs_buffers = abstract_model(CFG, mesh8)
    place = lambda a, s: jax.device_put(np.asarray(a), s.sharding)
    model8 = (graphdef, jax.tree.map(place, params, abs_params), jax.tree.map(place, buffers, abs_buffers))
    plain, fast1, _ = _both(trained, mesh1, PROMPTS, max_new_tokens=8)
    with sharding.use_mesh(mesh8):
        fast8, _ = spec.generate_speculative(*model8, PROMPTS[:3], max_new_tokens=8)  # 3 rows over 4 shards
    assert _rows(fast8) == _rows(fast1)[:3] == _rows(plain)[:3]


def _exact_distribution(model, mesh, prompt, n, temperature, top_k):
    """P(first n new tokens) by enumeration: the full forward's filtered softmax in float64, chained."""
    graphdef, params, buffers = model
    prefixes = np.array([prompt], np.int32)
    probs = np.ones(1)
    with sharding.use_mesh(mesh):
        fwd = jitted_apply(graphdef, with_mtp=False)
        for _ in range(n):
            logits = np.asarray(fwd(params, buffers, jnp.asarray(prefixes)).logits[:, -1], np.float64) / temperature
            kth = np.sort(logits, -1)[:, -top_k][:, None]
            logits = np.where(logits >= kth, logits, -np.inf)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            probs = (probs[:, None] * p).reshape(-1)
            prefixes = np.concatenate([np.repeat(prefixes, VOCAB, 0),
                                       np.tile(np.arange(VOCAB, dtype=np.int32), len(prefixes))[:, None]], 1)
    return probs  # index = the n tokens read as base-VOCAB digits


@pytest.mark.slow
def test_sampling_matches_the_target_distribution(mesh1):
    """Speculative sampling's first 2 tokens vs the exact distribution (and plain sampling as a control)."""
    from scipy import stats as sps

    model = _train(steps=40)  # half-trained: drafts are accepted often but not always (both paths run)
    prompt, n, rows, kw = [4, 7, 1], 2, 16384, {"temperature": 1.5, "top_k": 6}
    exact = _exact_distribution(model, mesh1, prompt, n, **kw)
    graphdef, params, buffers = model
    with sharding.use_mesh(mesh1):
        fast, st = spec.generate_speculative(graphdef, params, buffers, [prompt] * rows, max_new_tokens=n, seed=3, **kw)
        plain = gen.generate(graphdef, params, buffers, [prompt] * rows, max_new_tokens=n, seed=3, **kw)
    assert 0.2 < st.acceptance_rate < 0.95, st.acceptance_rate  # the accept and the reject/redraw paths both ran

    def pvalue(out):
        toks = np.asarray(out.tokens)
        counts = np.bincount(toks[:, 0] * VOCAB + toks[:, 1], minlength=VOCAB ** n)
        support = exact > 0
        assert counts[~support].sum() == 0  # nothing outside top-k
        expected = exact[support] * rows
        big = expected >= 5  # chi-square cells; the rest pooled into one
        obs = np.append(counts[support][big], counts[support][~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        return sps.chisquare(obs, exp).pvalue

    assert pvalue(plain) > 1e-3
    assert pvalue(fast) > 1e-3
    # The log-probs returned are the filtered target distribution's (as plain sampling reports them).
    toks = np.asarray(fast.tokens)
    first = exact.reshape(VOCAB, VOCAB).sum(1)
    np.testing.assert_allclose(np.asarray(fast.logprobs)[:, 0], np.log(first[toks[:, 0]]), atol=1e-4)


def test_verify_rule_by_hand():
    """The acceptance rule on hand-built distributions: p = (.5, .3, .2, 0), q = (.2, .2, .2, .4)."""
    p = np.log(np.array([[0.5, 0.3, 0.2, 1e-30]], np.float32))
    q = np.log(np.array([[0.2, 0.2, 0.2, 0.4]], np.float32))
    rows = 20000
    keys = jax.random.split(jax.random.key(0), rows)
    for draft, accept_p in ((0, 1.0), (3, 0.0), (2, 1.0)):
        tok, logp, ok = jax.vmap(lambda k, d=draft: spec.verify(k, jnp.asarray(p), jnp.asarray([d]), jnp.asarray(q),
                                                                 1.0, 0, 1.0))(keys)
        np.testing.assert_allclose(np.mean(np.asarray(ok)), accept_p, atol=0.01)
        if draft == 3:  # always rejected: redrawn from max(0, p - q) / sum = (.3, .1, 0, 0) / .4
            freq = np.bincount(np.asarray(tok)[:, 0], minlength=4) / rows
            np.testing.assert_allclose(freq, [0.75, 0.25, 0, 0], atol=0.015)
            np.testing.assert_allclose(np.asarray(logp)[:, 0], np.log(np.array([0.5, 0.3, 0.2, 1e-30])[np.asarray(
                tok)[:, 0]]), rtol=1e-5)
    # Greedy: accepted iff the draft is the argmax.
    tok, _, ok = spec.verify(jax.random.key(1), jnp.asarray(p), jnp.asarray([1]), jnp.asarray(q), 0.0, 0, 1.0)
    assert int(tok[0]) == 0 and not bool(ok[0])


def test_needs_an_mtp_layer(mesh1):
    cfg = dataclasses.replace(CFG, num_nextn_predict_layers=0)
    graphdef, params, buffers = init_model(cfg, mesh1)
    with sharding.use_mesh(mesh1), pytest.raises(InputError, match="MTP layer"):
        spec.generate_speculative(graphdef, params, buffers, [[1, 2]], max_new_tokens=2)


def test_cli_speculative_and_stop_strings(tmp_path):
    import os
    import subprocess
    import sys

    from conftest import FIXTURES

    from data_prep.tokenizer import train_bpe

    tok = str(tmp_path / "tokenizer.json")
    train_bpe(["def f(x): return x", "hello world"] * 20, 300).save(tok)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    base = [sys.executable, "-m", "glm46_jax.generate", "--hf-dir", os.path.join(FIXTURES, "hf_full"),
            "--max-new-tokens", "4"]
    run = lambda *a: subprocess.run([*base, *a], capture_output=True, text=True, env=env, check=False)
    ok = run("--tokens", "5,9,17", "--speculative")
    assert ok.returncode == 0, ok.stderr
    assert "drafts accepted" in ok.stdout and ok.stdout.count("tokens, log-prob") == 1
    plain = run("--tokens", "5,9,17")
    assert ok.stdout.splitlines()[-1] == plain.stdout.splitlines()[-1]  # the same tokens and log-prob
    bad = run("--tokens", "5,9,17", "--tokenizer", tok, "--stop", "no such token here")
    assert bad.returncode == 2 and bad.stderr.count("error:") == 1 and "Traceback" not in bad.stderr
    assert "--stop 'no such token here': not one token" in bad.stderr
    good = run("--tokens", "5,9,17", "--tokenizer", tok, "--stop", "<|endoftext|>")
    assert good.returncode == 0, good.stderr


def _naive_speculative(model, mesh, prompt, n):
    """Greedy speculation re-run from scratch with the training forward (no cache) at every step: the drafts
    are argmaxes of the full forward's MTP logits at the row before the last decided token. Returns the tokens
    and the (drafted, accepted) counts the cached implementation must reproduce."""
    graphdef, params, buffers = model
    with sharding.use_mesh(mesh):
        out = lambda seq: prefix_forward(graphdef, params, buffers, seq)
        seq = list(prompt) + [int(np.argmax(np.asarray(out(prompt).logits)[0, len(prompt) - 1]))]
        drafted = accepted = 0
        while len(seq) - len(prompt) < n:
            # MTP row len(seq) - 2 reads hidden[len(seq) - 2] and token len(seq) - 1 and predicts token len(seq).
            draft = int(np.argmax(np.asarray(out(seq).mtp_logits)[0, len(seq) - 2]))
            last = len(seq)  # the draft's position in the forward below
            logits = np.asarray(out(seq + [draft]).logits)[0]
            drafted += 1
            seq.append(int(np.argmax(logits[last - 1])))
            if seq[-1] == draft:
                accepted += 1
                seq.append(int(np.argmax(logits[last])))
    return seq[len(prompt):len(prompt) + n], drafted, accepted


def test_drafts_match_a_no_cache_reference(trained, mesh1):
    """Each draft is the MTP argmax of the full forward at the right row (slots, positions and the MTP cache
    line up), shown by equal tokens and equal drafted/accepted counts per row."""
    # The trained model with noise on its MTP layer only: drafts both held and rejected.
    graphdef, params, buffers = trained
    keys = iter(jax.random.split(jax.random.key(0), 500))
    noisy = lambda path, x: (x + 0.2 * jax.random.normal(next(keys), x.shape, x.dtype)
                             if "mtp" in jax.tree_util.keystr(path) else x)
    params = jax.tree_util.tree_map_with_path(noisy, params)
    model = graphdef, params, buffers
    with sharding.use_mesh(mesh1):
        out, stats = spec.generate_speculative(graphdef, params, buffers, PROMPTS, max_new_tokens=10)
    for row, prompt in enumerate(PROMPTS):
        tokens, drafted, accepted = _naive_speculative(model, mesh1, prompt, 10)
        assert _rows(out)[row] == tokens, row
        assert (int(stats.drafted[row]), int(stats.accepted[row])) == (drafted, accepted), row
    assert 0 < int(np.sum(stats.accepted)) < int(np.sum(stats.drafted))

"""Generation with a KV cache against independent references: the full no-cache forward at every step, a
naive re-run-everything greedy loop, each prompt alone vs in a padded batch, a 1-device vs 8-device mesh,
hand-computed sampling filters, and the CLI's one-line user errors."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, prefix_forward, randomize_params

from glm46_jax.infer import generate as gen
from glm46_jax.parallel import sharding
from glm46_jax.errors import InputError
from glm46_jax.config import TINY
from glm46_jax.interop.hf import load_hf
from glm46_jax.model import abstract_model, apply, init_model

CFG = dataclasses.replace(TINY, vocab_size=128, dtype="float32")
PROMPTS = [[5, 9, 17, 3, 44, 2], [7, 8], [100, 1, 2, 60], [33]]  # lengths 6, 2, 4, 1: left padding 0..5


@pytest.fixture(scope="module")
def tiny(mesh1):
    graphdef, params, buffers = init_model(CFG, mesh1, seed=7)
    return graphdef, randomize_params(params), buffers


@pytest.fixture(scope="module")
def hf_model(mesh1):
    _, graphdef, params, buffers = load_hf(os.path.join(FIXTURES, "hf_full"), mesh1, warn_missing_mtp=False)
    return graphdef, params, buffers


def _full_logits(model, mesh, seq):
    """Reference: the training forward (no cache, no left padding) over one row; logits of its last token."""
    graphdef, params, buffers = model
    with sharding.use_mesh(mesh):
        return np.asarray(prefix_forward(graphdef, params, buffers, seq, with_mtp=False).logits)[0, len(seq) - 1]


@pytest.mark.parametrize("which", ["tiny", "hf_full"])
def test_cached_logits_equal_full_forward_every_step(which, request, mesh1):
    model = request.getfixturevalue("tiny" if which == "tiny" else "hf_model")
    graphdef, params, buffers = model
    p, steps = max(map(len, PROMPTS)), 4
    start = np.array([p - len(x) for x in PROMPTS], np.int32)
    tokens = np.zeros((len(PROMPTS), p), np.int32)
    for row, x in enumerate(PROMPTS):
        tokens[row, start[row]:] = x
    seqs = [list(x) for x in PROMPTS]
    with sharding.use_mesh(mesh1):
        logits, cache = gen._prefill(graphdef, params, buffers, jnp.asarray(tokens), jnp.asarray(start),
                                     max_len=p + steps)
        step = jax.jit(lambda pr, bu, t, pos, c, i, s: (lambda o: (o.logits, o.cache))(
            apply(graphdef, pr, bu, t, pos, cache=c, index=i, start=s, with_mtp=False)))
        for i in range(steps + 1):
            logits = np.asarray(logits)
            for row, seq in enumerate(seqs):
                # 2e-5: jax 0.11's XLA:CPU (the lowest supported) rounds one logit ~2.7 to 1.03e-5 here.
                np.testing.assert_allclose(logits[row], _full_logits(model, mesh1, seq), atol=2e-5, rtol=0,
                                           err_msg=f"row {row} step {i}")
            if i == steps:
                break
            nxt = logits.argmax(-1).astype(np.int32)
            for row, seq in enumerate(seqs):
                seq.append(int(nxt[row]))
            slot = p + i
            out, cache = step(params, buffers, jnp.asarray(nxt[:, None]), jnp.asarray((slot - start)[:, None]),
                              cache, slot, jnp.asarray(start))
            logits = out[:, 0]


def _naive_greedy(model, mesh, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(_full_logits(model, mesh, seq).argmax()))
    return seq[len(prompt):]


def _gen(model, mesh, prompts, **kw):
    graphdef, params, buffers = model
    with sharding.use_mesh(mesh):
        out = gen.generate(graphdef, params, buffers, prompts, **kw)
    return [list(np.asarray(out.tokens)[i, :n]) for i, n in enumerate(np.asarray(out.lengths))], out


def test_greedy_equals_naive_loop_and_batch_equals_alone(hf_model, mesh1):
    n = 5
    batch, out = _gen(hf_model, mesh1, PROMPTS, max_new_tokens=n)
    assert out.tokens.shape == (len(PROMPTS), n)
    for row, prompt in enumerate(PROMPTS):
        assert batch[row] == _naive_greedy(hf_model, mesh1, prompt, n), f"row {row}"
        alone, _ = _gen(hf_model, mesh1, [prompt], max_new_tokens=n)
        assert alone[0] == batch[row], f"row {row}"
    # Greedy log-probs are the model's own: log_softmax of the full forward's logits.
    seq = PROMPTS[1] + batch[1][:2]
    ref = jax.nn.log_softmax(_full_logits(hf_model, mesh1, seq))[batch[1][2]]
    np.testing.assert_allclose(np.asarray(out.logprobs)[1, 2], ref, atol=1e-5)


def test_sharded_mesh_gives_same_tokens(tiny, mesh1):
    mesh8 = sharding.make_mesh({"data": 2, "tensor": 2, "expert": 2})
    graphdef, params, buffers = tiny
    _, abs_params, abs_buffers = abstract_model(CFG, mesh8)
    place = lambda a, s: jax.device_put(np.asarray(a), s.sharding)
    model8 = (graphdef, jax.tree.map(place, params, abs_params), jax.tree.map(place, buffers, abs_buffers))
    kw = {"max_new_tokens": 4, "temperature": 0.7, "top_k": 20, "seed": 3}
    one, out1 = _gen(tiny, mesh1, PROMPTS, **kw)
    eight, out8 = _gen(model8, mesh8, PROMPTS, **kw)
    assert one == eight
    np.testing.assert_allclose(np.asarray(out1.logprobs), np.asarray(out8.logprobs), atol=1e-5)
    greedy1, _ = _gen(tiny, mesh1, PROMPTS, max_new_tokens=4)
    greedy8, _ = _gen(model8, mesh8, PROMPTS, max_new_tokens=4)
    assert greedy1 == greedy8
    odd8, _ = _gen(model8, mesh8, PROMPTS[:3], max_new_tokens=4)  # 3 rows over 4 batch shards: padded
    assert odd8 == greedy1[:3]
    # The cache is laid out like k/v: batch over data x expert, kv heads over tensor.
    with sharding.use_mesh(mesh8):
        _, cache = gen._prefill(*model8, jnp.ones((4, 3), jnp.int32), jnp.zeros(4, jnp.int32), max_len=5)
    for kv in (cache.dense.k, cache.moe.v):
        assert kv.sharding.spec == jax.P(None, ("data", "expert", "pipeline"), None, "tensor", None)
    assert greedy1 == [_naive_greedy(tiny, mesh1, p, 4) for p in PROMPTS]


def test_sampling_seeded_topk1_is_greedy(hf_model, mesh1):
    kw = {"max_new_tokens": 6, "temperature": 1.5}
    a, out_a = _gen(hf_model, mesh1, PROMPTS, seed=1, **kw)
    b, _ = _gen(hf_model, mesh1, PROMPTS, seed=1, **kw)
    c, _ = _gen(hf_model, mesh1, PROMPTS, seed=2, **kw)
    assert a == b and a != c
    greedy, _ = _gen(hf_model, mesh1, PROMPTS, max_new_tokens=6)
    top1, out1 = _gen(hf_model, mesh1, PROMPTS, max_new_tokens=6, temperature=1.5, top_k=1, seed=5)
    assert top1 == greedy
    # Under the sampled (top-1) distribution every chosen token has probability 1.
    np.testing.assert_allclose(np.asarray(out1.logprobs), 0.0, atol=1e-6)
    assert np.all(np.asarray(out_a.logprobs) < 0)


def test_filter_logits_by_hand():
    probs = np.array([0.05, 0.5, 0.15, 0.3], np.float32)  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = jnp.asarray(np.log(probs)[None])
    kept = lambda **kw: set(np.flatnonzero(np.asarray(gen.filter_logits(logits, **kw))[0] > -1e30))
    assert kept(top_p=0.45) == {1}  # 0.5 alone reaches 0.45
    assert kept(top_p=0.75) == {1, 3}  # 0.5 + 0.3 = 0.8 >= 0.75; 0.5 alone does not
    assert kept(top_p=0.9) == {1, 3, 2}  # 0.95 >= 0.9
    assert kept(top_p=0.99) == {0, 1, 2, 3}
    assert kept(top_k=2) == {1, 3}
    assert kept(top_k=3, top_p=0.9) == {1, 3, 2}
    # Temperature divides the logits; the sampled distribution renormalises over the kept set.
    scaled = np.asarray(gen.filter_logits(logits, temperature=2.0))[0]
    np.testing.assert_allclose(scaled, np.log(probs) / 2, rtol=1e-6)
    tok, logp = gen.sample(jax.random.key(0), logits, temperature=1.0, top_p=0.75)
    assert int(tok[0]) in (1, 3)
    np.testing.assert_allclose(float(logp[0]), np.log(probs[int(tok[0])] / 0.8), rtol=1e-5)


def test_stop_tokens_and_max_new_tokens(hf_model, mesh1):
    greedy, _ = _gen(hf_model, mesh1, PROMPTS, max_new_tokens=6)
    stop = greedy[0][2]  # row 0's third token: row 0 stops there (or earlier, if it came sooner)
    rows, out = _gen(hf_model, mesh1, PROMPTS, max_new_tokens=6, stop_tokens=[stop], pad_id=0)
    for row, full in enumerate(greedy):
        n = full.index(stop) + 1 if stop in full else 6
        assert rows[row] == full[:n], f"row {row}"
        assert np.all(np.asarray(out.tokens)[row, n:] == 0)
        assert np.all(np.asarray(out.logprobs)[row, n:] == 0)
    assert len(rows[0]) <= 3
    short, out = _gen(hf_model, mesh1, PROMPTS, max_new_tokens=2)
    assert out.tokens.shape == (len(PROMPTS), 2) and all(r == g[:2] for r, g in zip(short, greedy))
    one, _ = _gen(hf_model, mesh1, PROMPTS, max_new_tokens=1)
    assert one == [g[:1] for g in greedy]


def test_prompt_longer_than_cache_is_input_error(hf_model, mesh1):
    with pytest.raises(InputError, match="KV cache"):
        _gen(hf_model, mesh1, [list(range(10))], max_new_tokens=4, max_len=12)
    with pytest.raises(InputError, match="max_len=3"):
        gen.main(["--hf-dir", os.path.join(FIXTURES, "hf_full"), "--tokens", "1,2,3,4", "--max-len", "3"])


def test_cli_generates_and_bad_input_is_one_line(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    d = os.path.join(FIXTURES, "hf_full")
    ok = subprocess.run([sys.executable, "-m", "glm46_jax.generate", "--hf-dir", d, "--tokens", "5,9,17",
                         "--tokens", "7", "--max-new-tokens", "3"],
                        capture_output=True, text=True, env=env, check=False)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count("tokens, log-prob") == 2
    bad = subprocess.run([sys.executable, "-m", "glm46_jax.generate", "--hf-dir", str(tmp_path / "missing"),
                          "--prompt", "hello"], capture_output=True, text=True, env=env, check=False)
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in bad.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--hf-dir", "{missing}", "--tokens", "1,2"], "missing"),
    (["--hf-dir", "{hf}", "--prompt", "hello"], "tokenizer.json"),  # no tokenizer for a text prompt
    (["--hf-dir", "{hf}", "--tokens", "1,x"], "comma-separated"),
    (["--hf-dir", "{hf}", "--tokens", "1,999"], "out of range"),
    (["--hf-dir", "{hf}", "--tokens", "1,2", "--top-p", "0"], "top_p"),
    (["--hf-dir", "{hf}", "--tokens", "1,2", "--bogus"], "bogus"),
], ids=["missing-dir", "no-tokenizer", "bad-tokens", "out-of-vocab", "bad-top-p", "bad-flag"])
def test_user_errors_are_user_errors(args, message, tmp_path):
    from glm46_jax.cli import user_errors
    paths = {"missing": str(tmp_path / "missing"), "hf": os.path.join(FIXTURES, "hf_full")}
    with pytest.raises(user_errors(), match=message):
        gen.main([a.format(**paths) for a in args])


@pytest.mark.parametrize("case", ["hf_full", "hf_air", "hf_mqa"])
def test_greedy_equals_transformers_generate(case, mesh1):
    """HF `generate` (greedy, its own KV cache, each prompt alone) saved by tests/fixtures/make_hf_fixtures.py; here
    the prompts (lengths 12, 5, 1) run as one left-padded batch. Every HF step's top-1 / top-2 logit margin is
    >= 1e-2, far above float32 noise, so exact token equality is a fair demand."""
    d = os.path.join(FIXTURES, case)
    gold = np.load(os.path.join(d, "golden.npz"))
    assert gold["gen_margins"].min() > 1e-2
    prompts = [list(row[:n]) for row, n in zip(gold["gen_prompt_ids"], gold["gen_prompt_lengths"])]
    assert sorted(map(len, prompts)) == [1, 5, 12]
    _, graphdef, params, buffers = load_hf(d, mesh1, warn_missing_mtp=False)
    n = gold["gen_tokens"].shape[1]
    rows, out = _gen((graphdef, params, buffers), mesh1, prompts, max_new_tokens=n)
    np.testing.assert_array_equal(np.asarray(out.tokens), gold["gen_tokens"])
    assert rows == gold["gen_tokens"].tolist()  # no row stopped early
    # Greedy log-probs are log_softmax of the unmodified logits, as HF's raw step logits give them.
    np.testing.assert_allclose(np.asarray(out.logprobs), gold["gen_logprobs"], atol=1e-5, rtol=0)


def test_cli_one_prompt_on_one_kv_head_is_transformers_greedy(capsys):
    """`generate --hf-dir` on the MQA fixture (issue 27) with one prompt: a batch of one row, whose decode steps
    route one token to its top-1 expert."""
    d = os.path.join(FIXTURES, "hf_mqa")
    gold = np.load(os.path.join(d, "golden.npz"))
    n = gold["gen_prompt_lengths"][1]
    prompt = ",".join(map(str, gold["gen_prompt_ids"][1, :n]))
    new = gen.main(["--hf-dir", d, "--tokens", prompt, "--max-new-tokens", str(gold["gen_tokens"].shape[1])])
    assert new == [gold["gen_tokens"][1].tolist()]
    assert capsys.readouterr().out.count("tokens, log-prob") == 1


@pytest.fixture(scope="module")
def chat_hf_dir(tiny, tmp_path_factory):
    """The tiny model as an HF directory with the chat fixture's tokenizer (GLM's chat tokens at ids 2-18)."""
    import shutil

    from glm46_jax.interop.hf import save_hf

    d = str(tmp_path_factory.mktemp("chat_hf"))
    save_hf(d, dataclasses.replace(CFG, vocab_size=512), *_padded_vocab(tiny, 512)[1:], dtype="float32")
    shutil.copy(os.path.join(FIXTURES, "chat", "hf_tokenizer", "tokenizer.json"), d)
    return d


def _padded_vocab(model, vocab):
    # CFG has 128 ids; the chat tokenizer has 330: grow the embedding and head with zeros (logits of the new ids
    # are 0, which the randomized weights' logits dominate) so token ids of the chat fixture embed.
    graphdef, params, buffers = model
    cfg = dataclasses.replace(CFG, vocab_size=vocab)
    graphdef, abs_params, _ = abstract_model(cfg, sharding.make_mesh({"data": 1}, jax.devices()[:1]))

    def grow(a, ref):
        a = np.asarray(a)
        pad = [(0, r - s) for s, r in zip(a.shape, ref.shape)]
        return jnp.asarray(np.pad(a, pad))
    return graphdef, jax.tree.map(grow, params, abs_params), buffers


def test_chat_cli_renders_the_template_and_stops_at_turn_ends(chat_hf_dir, monkeypatch):
    from tokenizers import Tokenizer

    from glm46_jax.interop import chat

    tok = Tokenizer.from_file(os.path.join(chat_hf_dir, "tokenizer.json"))
    assert sorted(chat.stop_token_ids(tok)) == [1, 5, 7]  # <|endoftext|>, <|user|>, <|observation|> here
    seen = []
    real = gen.generate

    def spy(*args, **kw):  # what main hands to generate(): the prompt ids and the stop tokens
        seen.append((args[3], sorted(kw["stop_tokens"])))
        return real(*args, **kw)
    monkeypatch.setattr(gen, "generate", spy)

    def prompt(template, **kw):
        return chat.encode_prompt(tok, [{"role": "user", "content": "hi there"}], template=template, **kw).tolist()

    base = ["--hf-dir", chat_hf_dir, "--chat", "--prompt", "hi there", "--max-new-tokens", "4"]
    out = gen.main(base)
    assert seen[-1] == ([prompt(None)], [1, 5, 7])
    assert len(out[0]) == 4 or out[0][-1] in (1, 5, 7)  # a row ends at a turn end or after 4 tokens
    gen.main([*base, "--no-thinking"])
    assert seen[-1][0] == [prompt(None, enable_thinking=False)] != [prompt(None)]
    # A directory's own template is the one used (here a deliberately different one).
    custom = "[gMASK]<sop>{% for m in messages %}<|user|>{{ m.content }}{% endfor %}<|assistant|>"
    with open(os.path.join(chat_hf_dir, "chat_template.jinja"), "w") as f:
        f.write(custom)
    try:
        gen.main(base)
    finally:
        os.remove(os.path.join(chat_hf_dir, "chat_template.jinja"))
    assert seen[-1][0] == [prompt(custom)] != [prompt(None)]
    with pytest.raises(InputError, match="--chat renders text"):
        gen.main(["--hf-dir", chat_hf_dir, "--chat", "--tokens", "1,2"])


def test_prompt_len_pads_further_without_changing_tokens(hf_model, mesh1):
    base, out = _gen(hf_model, mesh1, PROMPTS, max_new_tokens=3)
    padded, out16 = _gen(hf_model, mesh1, PROMPTS, max_new_tokens=3, prompt_len=16)  # 10 more pad slots per row
    assert padded == base
    np.testing.assert_allclose(np.asarray(out16.logprobs), np.asarray(out.logprobs), atol=1e-5)
    with pytest.raises(InputError, match="KV cache"):  # the padded length counts against max_len
        _gen(hf_model, mesh1, PROMPTS, max_new_tokens=3, prompt_len=16, max_len=17)

"""Losses against float64 NumPy references: the vocab-parallel CE and the MTP target alignment."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm46_jax import sharding
from glm46_jax.config import get_preset
from glm46_jax.loss import cross_entropy, loss_fn, mtp_labels, token_nll
from glm46_jax.model import apply, init_model


def np_nll(logits, labels):
    """float64 reference: -log softmax(logits)[label]."""
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, labels[..., None], -1)[..., 0]


def np_masked_mean(nll, mask):
    return (nll * mask).sum() / max(mask.sum(), 1)


def _random_case(b=4, s=6, v=40, seed=0):
    rng = np.random.default_rng(seed)
    logits = (3 * rng.standard_normal((b, s, v))).astype(np.float32)
    labels = rng.integers(0, v, (b, s)).astype(np.int32)
    mask = rng.random((b, s)) < 0.7
    mask[0] = False  # a fully masked row
    return logits, labels, mask


def test_cross_entropy_matches_float64_reference(mesh1):
    logits, labels, mask = _random_case()
    with sharding.use_mesh(mesh1):
        ce, tokens = jax.jit(cross_entropy)(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(mask))
        nll = jax.jit(token_nll)(jnp.asarray(logits), jnp.asarray(labels))
    np.testing.assert_allclose(float(ce), np_masked_mean(np_nll(logits, labels), mask), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nll), np_nll(logits, labels), rtol=1e-5, atol=1e-6)
    assert float(tokens) == mask.sum()
    # Outside any mesh too (scoring code calls it that way), and with nothing to average.
    ce_nomesh, _ = cross_entropy(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(mask))
    np.testing.assert_allclose(float(ce_nomesh), float(ce), rtol=1e-6)
    ce_empty, n_empty = cross_entropy(jnp.asarray(logits), jnp.asarray(labels), jnp.zeros_like(mask))
    assert float(ce_empty) == 0.0 and float(n_empty) == 0.0


def test_cross_entropy_upcasts_bf16_logits():
    logits, labels, mask = _random_case(seed=1)
    ce, _ = cross_entropy(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(labels), jnp.asarray(mask))
    assert ce.dtype == jnp.float32
    ref = np_masked_mean(np_nll(np.asarray(jnp.asarray(logits, jnp.bfloat16), np.float32), labels), mask)
    np.testing.assert_allclose(float(ce), ref, rtol=1e-5)


def test_cross_entropy_with_vocab_sharded_logits():
    """Vocab split over `tensor`, batch over (data, expert); labels arrive replicated."""
    mesh = sharding.make_mesh({"data": 2, "tensor": 2, "expert": 2})
    logits, labels, mask = _random_case(b=4, s=6, v=40, seed=2)
    with sharding.use_mesh(mesh):
        sharded = jax.device_put(jnp.asarray(logits), jax.NamedSharding(mesh, sharding.logical("batch", "seq", "vocab")))
        ce, _ = jax.jit(cross_entropy)(sharded, jnp.asarray(labels), jnp.asarray(mask))
        grad = jax.jit(jax.grad(lambda z: cross_entropy(z, jnp.asarray(labels), jnp.asarray(mask))[0]))(sharded)
    np.testing.assert_allclose(float(ce), np_masked_mean(np_nll(logits, labels), mask), rtol=1e-6)
    assert grad.sharding.spec == sharding.logical("batch", "seq", "vocab")


def test_mtp_labels_alignment():
    """Row t of the MTP logits predicts token t+2 of the underlying sequence x[0..s]."""
    x = np.arange(10, 10 + 2 * 7).reshape(2, 7)  # two sequences of s+1 = 7 tokens
    inputs, targets = x[:, :-1], x[:, 1:]
    mask = np.ones(targets.shape, bool)
    mask[1, 3] = False  # the target of position 3 (= x[1, 4]) is masked
    labels, lmask = mtp_labels(jnp.asarray(targets), jnp.asarray(mask))
    labels, lmask = np.asarray(labels), np.asarray(lmask)
    s = inputs.shape[1]
    for t in range(s - 1):
        np.testing.assert_array_equal(labels[:, t], x[:, t + 2])
    assert not lmask[:, s - 1].any()  # no token s+1 exists
    assert not lmask[1, 2] and lmask[0, 2]  # x[1, 4] masked as a main target -> masked as MTP target too
    assert lmask.sum() == 2 * (s - 1) - 1


@pytest.fixture(scope="module")
def tiny_case(mesh1):
    cfg = get_preset("tiny")
    graphdef, params, buffers = init_model(cfg, mesh1, seed=0)
    rng = np.random.default_rng(0)
    x = rng.integers(2, 258, (2, 17)).astype(np.int32)
    batch = {"inputs": jnp.asarray(x[:, :-1]), "targets": jnp.asarray(x[:, 1:]),
             "loss_mask": jnp.asarray(rng.random((2, 16)) < 0.8)}
    return cfg, graphdef, params, buffers, x, batch


def test_loss_fn_matches_hand_computed_next_token_and_mtp_ce(mesh1, tiny_case):
    cfg, graphdef, params, buffers, x, batch = tiny_case
    with sharding.use_mesh(mesh1):
        out = jax.jit(lambda p, b, t: apply(graphdef, p, b, t))(params, buffers, batch["inputs"])
        loss, metrics = jax.jit(lambda p, b, batch: loss_fn(p, b, batch, graphdef, cfg, mtp_weight=0.3))(
            params, buffers, batch)
    logits, mtp_logits = np.asarray(out.logits), np.asarray(out.mtp_logits)
    mask = np.asarray(batch["loss_mask"])
    s = x.shape[1] - 1
    ce = np_masked_mean(np_nll(logits, x[:, 1:]), mask)
    # Written out by position: MTP row t scores x[t + 2]; valid for t + 2 <= s, masked like that target.
    num = den = 0.0
    for b in range(x.shape[0]):
        for t in range(s - 1):
            if mask[b, t + 1]:
                num += np_nll(mtp_logits[b, t], x[b, t + 2])
                den += 1
    mtp_ce = num / den
    np.testing.assert_allclose(float(metrics["ce"]), ce, rtol=2e-5)
    np.testing.assert_allclose(float(metrics["mtp_ce"]), mtp_ce, rtol=2e-5)
    np.testing.assert_allclose(float(loss), ce + 0.3 * mtp_ce, rtol=2e-5)
    assert float(metrics["loss"]) == float(loss) and float(metrics["tokens"]) == mask.sum()


def test_loss_fn_without_mtp(mesh1, tiny_case):
    cfg, graphdef, params, buffers, _, batch = tiny_case
    batch = {k: v for k, v in batch.items() if k != "loss_mask"}  # no mask: every position counts
    with sharding.use_mesh(mesh1):
        loss, metrics = jax.jit(lambda p, b, batch: loss_fn(p, b, batch, graphdef, cfg, mtp_weight=0.0))(
            params, buffers, batch)
    assert "mtp_ce" not in metrics and float(loss) == float(metrics["ce"])
    assert float(metrics["tokens"]) == batch["targets"].size
    assert abs(float(loss) - np.log(cfg.vocab_size)) < 0.1  # untrained: about uniform over the vocab

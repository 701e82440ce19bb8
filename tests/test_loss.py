"""Losses against float64 NumPy references: the vocab-parallel CE and the MTP target alignment."""

import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm46_jax.parallel import sharding
from glm46_jax.training.balancing import BalanceConfig, rate_at
from glm46_jax.errors import InputError
from glm46_jax.config import get_preset
from glm46_jax.training.loss import (
    LossConfig,
    _chunks,
    batch_norms,
    cross_entropy,
    loss_fn,
    mtp_labels,
    mtp_weight_at,
    nll_and_lse,
    sequence_aux_loss,
    token_nll,
)
from glm46_jax.model import abstract_model, apply, init_model


def np_nll(logits, labels):
    """float64 reference: -log softmax(logits)[label]."""
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, labels[..., None], -1)[..., 0]


def np_nll_grad(logits, labels, g_nll, g_lse):
    """float64 d/d logits of sum(g_nll * nll + g_lse * logsumexp(logits)):
    softmax * (g_nll + g_lse) - onehot * g_nll."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    one_hot = np.eye(z.shape[-1])[labels]
    return p * (g_nll + g_lse)[..., None] - one_hot * g_nll[..., None]


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


def test_nll_and_lse_gradients_match_float64(mesh1):
    """The hand-written backward of (nll, lse) against the float64 closed form, both cotangents non-zero
    (the lse one is the z-loss's path): one device, batch-sharded logits (the gather path) and vocab-sharded
    ones (the masked-sum path), fp32 and bf16 logits (the cast's own VJP)."""
    logits, labels, _ = _random_case(b=4, s=5, v=34, seed=3)
    rng = np.random.default_rng(4)
    g_nll, g_lse = rng.standard_normal((2, 4, 5)).astype(np.float32)

    def objective(z):
        nll, lse = nll_and_lse(z, jnp.asarray(labels))
        return jnp.sum(nll * g_nll) + jnp.sum(lse * g_lse)

    ref = np_nll_grad(logits, labels, g_nll, g_lse)
    with sharding.use_mesh(mesh1):
        grad = jax.jit(jax.grad(objective))(jnp.asarray(logits))
    np.testing.assert_allclose(np.asarray(grad), ref, rtol=1e-5, atol=1e-6)
    mesh = sharding.make_mesh({"data": 2, "tensor": 2, "expert": 2})
    for spec in (jax.P(("data", "expert")), jax.P(None, None, "tensor")):
        with sharding.use_mesh(mesh):
            z = jax.device_put(jnp.asarray(logits), jax.NamedSharding(mesh, spec))
            grad = jax.jit(jax.grad(objective))(z)
        np.testing.assert_allclose(np.asarray(grad), ref, rtol=1e-5, atol=1e-6, err_msg=str(spec))
    low = jnp.asarray(logits, jnp.bfloat16)
    grad_bf16 = jax.grad(objective)(low)
    assert grad_bf16.dtype == jnp.bfloat16
    ref_bf16 = np_nll_grad(np.asarray(low, np.float32), labels, g_nll, g_lse)
    np.testing.assert_allclose(np.asarray(grad_bf16, np.float32), ref_bf16, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("axes, spec, chunk_tokens", [
    ({"data": 1}, jax.P(), 12),  # 40 positions: 5 chunks of 8
    ({"data": 1}, jax.P(), 3),  # no divisor of 10 rows leaves <= 3 positions: 10 chunks of 4
    ({"data": 2, "tensor": 2, "expert": 2}, jax.P(("data", "expert"), None, "tensor"), 3),  # vocab-parallel
    ({"data": 2, "tensor": 2, "context": 2}, jax.P("data", "context", "tensor"), 3),  # rows split over context
])
def test_chunked_nll_and_lse_match_float64(axes, spec, chunk_tokens):
    """Values and d/d logits (both cotangents non-zero) against float64 when the positions are upcast a few at a
    time, position counts not a multiple of the chunk, on one device and with the positions or the vocab sharded;
    bf16 logits give bf16 gradients (test_loss_never_holds_the_logits_in_fp32 checks that no fp32 copy exists)."""
    logits, labels, _ = _random_case(b=4, s=10, v=34, seed=5)
    g_nll, g_lse = np.random.default_rng(6).standard_normal((2, 4, 10)).astype(np.float32)
    mesh = sharding.make_mesh(axes, jax.devices()[:np.prod(list(axes.values()))])

    def objective(z):
        nll, lse = nll_and_lse(z, jnp.asarray(labels), chunk_tokens)
        return jnp.sum(nll * g_nll) + jnp.sum(lse * g_lse), (nll, lse)

    with sharding.use_mesh(mesh):
        z = jax.device_put(jnp.asarray(logits), jax.NamedSharding(mesh, spec))
        assert _chunks(z, chunk_tokens) > 1  # the chunked path, not the one-piece one
        grad, (nll, lse) = jax.jit(jax.grad(objective, has_aux=True))(z)
        low = z.astype(jnp.bfloat16)
        grad_bf16 = jax.jit(jax.grad(lambda z: objective(z)[0]))(low)
    lse_ref = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(np.asarray(nll), np_nll(logits, labels), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), lse_ref, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np_nll_grad(logits, labels, g_nll, g_lse), rtol=1e-5, atol=1e-6)
    assert grad.sharding.is_equivalent_to(z.sharding, 3) and grad_bf16.dtype == jnp.bfloat16
    ref_bf16 = np_nll_grad(np.asarray(low, np.float32), labels, g_nll, g_lse)
    np.testing.assert_allclose(np.asarray(grad_bf16, np.float32), ref_bf16, rtol=1e-2, atol=1e-2)


def test_chunks_fall_back_to_one_piece_without_a_near_divisor():
    """8192 positions split into 2 chunks of 4096; 8191 (a prime: a scorer's 8192 - 1) has no divisor near that,
    and thousands of one-position chunks would be a slow loop, so it is one piece; 8190 = 2 x 4095 splits in 2."""
    assert [_chunks(jnp.zeros((1, s, 2)), 4096) for s in (8192, 8191, 8190, 4096)] == [2, 1, 2, 1]
    assert _chunks(jnp.zeros((8, 4096, 2)), 4096) == 8  # the small preset's GPU batch: 8 chunks of 512 x 8 rows


def _avals(jaxpr):
    """Every value a jaxpr computes, its sub-jaxprs' (loop bodies, custom VJPs, jit) included."""
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _avals(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _avals(sub)


def test_loss_never_holds_the_logits_in_fp32(mesh1, tiny_case):
    """With bf16 compute (a GPU's), the loss's value_and_grad computes no fp32 array as large as [tokens, vocab]:
    the main and MTP cross-entropies upcast their logits chunk by chunk, forward and backward (traced, not run).
    The unchunked loss does hold some, so the check can fail. Chunked, the loss terms are the unchunked ones."""
    cfg, graphdef, params, buffers, _, _ = tiny_case
    x = np.random.default_rng(7).integers(2, cfg.vocab_size, (2, 41)).astype(np.int32)  # 80 > hidden_size tokens
    batch = {"inputs": jnp.asarray(x[:, :-1]), "targets": jnp.asarray(x[:, 1:])}
    tokens = batch["targets"].size
    low = dataclasses.replace(cfg, dtype="bfloat16")
    low_graphdef = abstract_model(low, mesh1)[0]  # the same fp32 parameters, bf16 compute

    def fp32_logit_sized(chunk_tokens):
        loss_cfg = LossConfig(z_weight=1e-3, ce_chunk_tokens=chunk_tokens)
        value_and_grad = jax.value_and_grad(
            lambda p: loss_fn(p, buffers, batch, low_graphdef, low, loss_cfg, 0.3)[0])
        return [a for a in _avals(jax.make_jaxpr(value_and_grad)(params).jaxpr)
                if getattr(a, "dtype", None) == jnp.float32
                and cfg.vocab_size in a.shape and np.prod(a.shape) // cfg.vocab_size >= tokens]

    def metrics(chunk_tokens):
        loss_cfg = LossConfig(z_weight=1e-3, ce_chunk_tokens=chunk_tokens)
        return jax.jit(lambda p: loss_fn(p, buffers, batch, graphdef, cfg, loss_cfg, 0.3)[1])(params)

    with sharding.use_mesh(mesh1):
        assert fp32_logit_sized(tokens), "the check finds the unchunked loss's fp32 logits"
        assert not fp32_logit_sized(12)
        chunked, whole = metrics(12), metrics(tokens)
    for key in ("ce", "mtp_ce", "z_loss", "loss"):
        np.testing.assert_allclose(float(chunked[key]), float(whole[key]), rtol=1e-6, err_msg=key)


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
        grad_fn = jax.jit(jax.grad(lambda z: cross_entropy(z, jnp.asarray(labels), jnp.asarray(mask))[0]))
        grad = grad_fn(sharded)
        compiled = [fn.lower(sharded, *args).compile().as_text() for fn, args in (
            (jax.jit(cross_entropy), (jnp.asarray(labels), jnp.asarray(mask))), (grad_fn, ()))]
    np.testing.assert_allclose(float(ce), np_masked_mean(np_nll(logits, labels), mask), rtol=1e-6)
    assert grad.sharding.spec == sharding.logical("batch", "seq", "vocab")
    np.testing.assert_allclose(np.asarray(grad), np_nll_grad(logits, labels, mask / mask.sum(), 0 * mask),
                               rtol=1e-5, atol=1e-8)
    # Vocab-parallel: no device ever holds a full 40-wide vocab row (each has its 20), and nothing is
    # all-gathered; the only collectives are the small all-reduces of the per-position sums.
    for hlo in compiled:
        assert not re.findall(r"\w+\[[\d,]*\b40\b[\d,]*\]", hlo) and "all-gather" not in hlo
        assert "all-reduce" in hlo


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
    assert not lmask[1, 3] and lmask[0, 3]  # nor may row 3 read the masked x[1, 4] as its next input
    assert lmask.sum() == 2 * (s - 1) - 2


# Two packed rows of L + 1 = 9 tokens, as the loader lays them out (segment 0 = padding):
# row 0 is two documents back to back, row 1 two documents then padding.
PACKED_SEGMENTS = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2],
                            [1, 1, 1, 2, 2, 2, 0, 0, 0]], np.int32)
PACKED_LOSS_MASK = np.array([[1, 1, 1, 0, 1, 1, 1, 1],  # no target across the 1 -> 2 boundary
                             [1, 1, 0, 1, 1, 0, 0, 0]], bool)
# MTP row t (input t, next input t + 1) predicts token t + 2: all three must lie in one document.
# Row 0, t = 3 is the last token of document 1 and t = 2 in row 1 likewise: their MTP targets are
# the second token of the next document, predicted from the previous document's context.
PACKED_MTP_MASK = np.array([[1, 1, 0, 0, 1, 1, 1, 0],
                            [1, 0, 0, 1, 0, 0, 0, 0]], bool)


def _packed_batch(seed=0):
    x = np.random.default_rng(seed).integers(2, 258, PACKED_SEGMENTS.shape).astype(np.int32)
    x = np.where(PACKED_SEGMENTS == 0, 0, x)
    positions = np.array([[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 0, 1, 2, 0, 0]], np.int32)
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:], "segment_ids": PACKED_SEGMENTS[:, :-1],
             "positions": positions, "loss_mask": PACKED_LOSS_MASK.astype(np.int32)}
    return x, batch


def test_packed_batch_fixture_is_what_the_loader_builds():
    from glm46_jax.data.loader import shift_row

    x, batch = _packed_batch()
    pos_full = np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4], [0, 1, 2, 0, 1, 2, 0, 0, 0]], np.int32)
    for row in range(2):
        got = shift_row({"tokens": x[row], "tokens_segment_ids": PACKED_SEGMENTS[row],
                         "tokens_positions": pos_full[row]}, pad_id=0)
        chex.assert_trees_all_equal(got, {key: v[row] for key, v in batch.items()})


def test_mtp_labels_stop_at_document_boundaries():
    x, batch = _packed_batch()
    labels, lmask = mtp_labels(jnp.asarray(batch["targets"]), jnp.asarray(batch["loss_mask"]).astype(bool))
    np.testing.assert_array_equal(np.asarray(lmask), PACKED_MTP_MASK)
    np.testing.assert_array_equal(np.asarray(labels)[:, :-1], x[:, 2:])
    assert float(batch_norms({k: jnp.asarray(v) for k, v in batch.items()})["mtp_tokens"]) == 7.0


@pytest.fixture(scope="module")
def tiny_case(mesh1):
    cfg = get_preset("tiny")
    graphdef, params, buffers = init_model(cfg, mesh1, seed=0)
    rng = np.random.default_rng(0)
    x = rng.integers(2, 258, (2, 17)).astype(np.int32)
    batch = {"inputs": jnp.asarray(x[:, :-1]), "targets": jnp.asarray(x[:, 1:]),
             "loss_mask": jnp.asarray(rng.random((2, 16)) < 0.8)}
    return cfg, graphdef, params, buffers, x, batch


def np_seq_aux(scores, mask, k):
    """float64 DeepSeek-V3 sequence balance loss, loop form: per row sum_i f_i P_i, summed over layers."""
    scores = np.asarray(scores, np.float64).reshape(-1, *scores.shape[-3:])  # [layers, b, s, e]
    n_layers, b, s, e = scores.shape
    out = np.zeros(b)
    for layer in range(n_layers):
        for row in range(b):
            valid = [t for t in range(s) if mask[row, t]]
            if not valid:
                continue
            f, p = np.zeros(e), np.zeros(e)
            for t in valid:
                f[np.argsort(-scores[layer, row, t], kind="stable")[:k]] += 1
                p += scores[layer, row, t] / scores[layer, row, t].sum()
            out[row] += (e / (k * len(valid)) * f) @ (p / len(valid))
    return out


def test_sequence_aux_loss_matches_numpy_and_is_one_when_uniform():
    rng = np.random.default_rng(3)
    scores = rng.random((2, 3, 5, 8)).astype(np.float32)  # 2 layers, 3 rows, 5 tokens, 8 experts
    mask = rng.random((3, 5)) < 0.7
    mask[2] = False
    got = np.asarray(sequence_aux_loss(jnp.asarray(scores), jnp.asarray(mask), 2))
    np.testing.assert_allclose(got, np_seq_aux(scores, mask, 2), rtol=1e-5)
    assert got[2] == 0.0
    # Perfectly balanced: every expert chosen equally often and equal normalised scores -> exactly 1.
    e, k = 4, 2
    balanced = np.full((1, 2, e), 0.1, np.float32)
    balanced[0, 0, :2] = balanced[0, 1, 2:] = 0.9  # token 0 picks {0, 1}, token 1 picks {2, 3}
    got = float(sequence_aux_loss(jnp.asarray(balanced), jnp.ones((1, 2), bool), k)[0])
    np.testing.assert_allclose(got, 1.0, rtol=1e-6)
    # All tokens on the same two experts: f = (2, 2, 0, 0), P = (0.45, 0.45, 0.05, 0.05) -> 1.8.
    skewed = np.tile(balanced[:, :1], (1, 2, 1))
    np.testing.assert_allclose(float(sequence_aux_loss(jnp.asarray(skewed), jnp.ones((1, 2), bool), k)[0]),
                               2 * 0.45 * 2, rtol=1e-6)


def test_loss_fn_matches_hand_computed_terms(mesh1, tiny_case):
    """ce + 0.3 mtp_ce + 1e-4 aux + 1e-3 z, every term from the model's outputs in float64."""
    cfg, graphdef, params, buffers, x, batch = tiny_case
    loss_cfg = LossConfig(aux_weight=1e-4, z_weight=1e-3)
    with sharding.use_mesh(mesh1):
        out = jax.jit(lambda p, b, t: apply(graphdef, p, b, t))(params, buffers, batch["inputs"])
        loss, metrics = jax.jit(lambda p, b, batch: loss_fn(p, b, batch, graphdef, cfg, loss_cfg, 0.3))(
            params, buffers, batch)
    logits, mtp_logits = np.asarray(out.logits, np.float64), np.asarray(out.mtp_logits)
    mask = np.asarray(batch["loss_mask"])
    s = x.shape[1] - 1
    ce = np_masked_mean(np_nll(logits, x[:, 1:]), mask)
    # Written out by position: MTP row t scores x[t + 2]; valid for t + 2 <= s where both the target
    # of t and that of t + 1 are.
    num = den = 0.0
    mtp_mask = np.zeros_like(mask)
    for b in range(x.shape[0]):
        for t in range(s - 1):
            if mask[b, t] and mask[b, t + 1]:
                num += np_nll(mtp_logits[b, t], x[b, t + 2])
                den += 1
                mtp_mask[b, t] = True
    mtp_ce = num / den
    lse = np.log(np.exp(logits).sum(-1))
    z = np_masked_mean(lse ** 2, mask)
    aux_rows = (np_seq_aux(np.asarray(out.aux["router_scores"]), mask, cfg.num_experts_per_tok)
                + np_seq_aux(np.asarray(out.aux["mtp"]["router_scores"]), mtp_mask, cfg.num_experts_per_tok))
    aux = aux_rows.sum() / mask.any(-1).sum()
    np.testing.assert_allclose(float(metrics["ce"]), ce, rtol=2e-5)
    np.testing.assert_allclose(float(metrics["mtp_ce"]), mtp_ce, rtol=2e-5)
    np.testing.assert_allclose(float(metrics["z_loss"]), z, rtol=2e-5)
    np.testing.assert_allclose(float(metrics["aux_loss"]), aux, rtol=2e-5)
    assert 2.0 < aux < 4.0  # 2 trunk MoE layers + MTP, each ~1 for a near-uniform random router
    np.testing.assert_allclose(float(loss), ce + 0.3 * mtp_ce + 1e-4 * aux + 1e-3 * z, rtol=2e-5)
    # aux_include_mtp=False: the trunk's MoE layers only.
    with sharding.use_mesh(mesh1):
        trunk_only = jax.jit(lambda p, b, batch: loss_fn(p, b, batch, graphdef, cfg, dataclasses.replace(
            loss_cfg, aux_include_mtp=False), 0.3))(params, buffers, batch)[1]
    trunk_aux = np_seq_aux(np.asarray(out.aux["router_scores"]), mask, cfg.num_experts_per_tok).sum() / mask.any(-1).sum()
    np.testing.assert_allclose(float(trunk_only["aux_loss"]), trunk_aux, rtol=2e-5)
    assert 1.0 < trunk_aux < aux - 0.5
    assert float(metrics["loss"]) == float(loss) and float(metrics["tokens"]) == mask.sum()
    assert metrics["expert_load"].shape == (cfg.num_moe_layers, cfg.n_routed_experts)
    # Each token picks k experts in each layer: the loads count the whole batch (mask-blind routing).
    assert (np.asarray(metrics["expert_load"]).sum(-1) == x[:, :-1].size * cfg.num_experts_per_tok).all()


def test_mtp_loss_on_a_packed_batch_matches_float64(mesh1, tiny_case):
    """mtp_ce over the hand-written PACKED_MTP_MASK, from the model's MTP logits in float64."""
    cfg, graphdef, params, buffers, _, _ = tiny_case
    x, batch = _packed_batch(seed=1)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    with sharding.use_mesh(mesh1):
        out = jax.jit(lambda p, b, batch: apply(graphdef, p, b, batch["inputs"], batch["positions"],
                                                batch["segment_ids"]))(params, buffers, batch)
        _, metrics = jax.jit(lambda p, b, batch: loss_fn(p, b, batch, graphdef, cfg, LossConfig(), 0.3))(
            params, buffers, batch)
    nll = np_nll(np.asarray(out.mtp_logits, np.float64)[:, :-1], x[:, 2:])  # row t scores token t + 2
    expected = (nll * PACKED_MTP_MASK[:, :-1]).sum() / PACKED_MTP_MASK.sum()
    np.testing.assert_allclose(float(metrics["mtp_ce"]), expected, rtol=2e-5)


def test_aux_loss_gradient_reaches_only_the_router(mesh1, tiny_case):
    """d(aux)/d(router) is nonzero; past the last router (its layer's experts, the head) it is exactly 0."""
    cfg, graphdef, params, buffers, _, batch = tiny_case
    only_aux = LossConfig(mtp=False, aux_weight=1.0)

    def aux_only(p):
        loss, m = loss_fn(p, buffers, batch, graphdef, cfg, only_aux, 0.0)
        return loss - m["ce"]

    with sharding.use_mesh(mesh1):
        grads = jax.jit(jax.grad(aux_only))(params)
    moe = grads["moe_layers"]["mlp"]
    assert float(jnp.abs(moe["router"][...]).max()) > 0
    assert float(jnp.abs(moe["gate_proj"][...][-1]).max()) == 0.0  # feeds no later router
    assert float(jnp.abs(moe["gate_proj"][...][0]).max()) > 0  # feeds the last layer's router
    assert float(jnp.abs(grads["lm_head"][...]).max()) == 0.0


def test_loss_fn_without_mtp(mesh1, tiny_case):
    cfg, graphdef, params, buffers, _, batch = tiny_case
    batch = {k: v for k, v in batch.items() if k != "loss_mask"}  # no mask: every position counts
    with sharding.use_mesh(mesh1):
        loss, metrics = jax.jit(lambda p, b, batch: loss_fn(p, b, batch, graphdef, cfg,
                                                            LossConfig(mtp=False, aux_weight=0.0)))(
            params, buffers, batch)
    assert "mtp_ce" not in metrics and "aux_loss" not in metrics and float(loss) == float(metrics["ce"])
    assert float(metrics["tokens"]) == batch["targets"].size
    assert abs(float(loss) - np.log(cfg.vocab_size)) < 0.1  # untrained: about uniform over the vocab


@pytest.mark.parametrize("cls, section, field, value", [
    (LossConfig, "loss", "mtp_weight", -0.3), (LossConfig, "loss", "mtp_weight_after", -0.1),
    (LossConfig, "loss", "mtp_boundary_tokens", -1.0), (LossConfig, "loss", "aux_weight", -1e-4),
    (LossConfig, "loss", "z_weight", float("nan")),
    (BalanceConfig, "balance", "rate", -1e-3), (BalanceConfig, "balance", "rate_after", -1e-3),
    (BalanceConfig, "balance", "boundary_tokens", -15e12),
])
def test_bad_loss_and_balance_values_name_the_field(cls, section, field, value):
    with pytest.raises(InputError) as err:
        cls(**{field: value})
    msg = str(err.value)
    assert msg.startswith(f"{section}.{field}={value!r}: "), msg
    assert f"; set --config.{section}.{field} " in msg, msg


def test_token_schedules_switch_at_the_boundary():
    loss_cfg = LossConfig(mtp_weight=0.3, mtp_weight_after=0.1, mtp_boundary_tokens=1000.0)
    assert [mtp_weight_at(loss_cfg, t) for t in (0, 999, 1000, 5000)] == [0.3, 0.3, 0.1, 0.1]
    assert mtp_weight_at(LossConfig(mtp=False), 0) == 0.0
    bal = BalanceConfig(rate=1e-3, rate_after=0.0, boundary_tokens=15e12)
    assert [rate_at(bal, t) for t in (0, 15 * 10**12 - 1, 15 * 10**12)] == [1e-3, 1e-3, 0.0]

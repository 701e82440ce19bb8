"""Blockwise (online-softmax) attention against the dense reference path and a float64 NumPy attention:
outputs and q/k/v gradients, packing, ragged lengths, GQA, query shards with explicit positions, the full
model on one device and on an 8-device mesh, and compiled memory that grows linearly in sequence length."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm46_jax.parallel import sharding
from glm46_jax.errors import InputError
from glm46_jax.config import TINY, ModelConfig
from glm46_jax.model import abstract_model, apply, init_model
from glm46_jax.model.attention import _xla_attention, attention_mask
from glm46_jax.model.blockwise_attention import blockwise_attention

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16  # GQA: 4 query heads per kv head


def _inputs(seed, batch, seq, packed):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, seq, HEADS, HEAD_DIM)).astype(np.float32)
    k = rng.normal(size=(batch, seq, KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.normal(size=(batch, seq, KV_HEADS, HEAD_DIM)).astype(np.float32)
    dout = rng.normal(size=q.shape).astype(np.float32)
    # Documents of random lengths, some shorter than a block, some straddling block edges.
    seg = np.sort(rng.integers(0, 5, (batch, seq)), axis=1).astype(np.int32) if packed else None
    return q, k, v, dout, seg


def _value_and_grads(attend, q, k, v, dout):
    """The output and the q/k/v gradients of <attend(q, k, v), dout>."""
    out, vjp = jax.vjp(attend, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    return (out, *vjp(jnp.asarray(dout)))


def _assert_close(actual, expected, rtol=1e-5, what=""):
    expected = np.asarray(expected)
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=rtol, atol=rtol * float(np.abs(expected).max()),
                               err_msg=what)


@pytest.mark.parametrize("seq, block_q, block_kv, packed", [
    (64, 16, 16, False), (64, 16, 16, True),  # multiples of the blocks
    (50, 16, 8, False), (50, 16, 8, True),  # not a multiple: padded inside
    (37, 64, 64, True),  # shorter than one block
])
def test_matches_dense_attention_forward_and_backward(seq, block_q, block_kv, packed):
    q, k, v, dout, seg = _inputs(0, 2, seq, packed)
    mask = attention_mask(None if seg is None else jnp.asarray(seg), seq)
    dense = jax.jit(lambda q, k, v: _xla_attention(q, k, v, mask, HEAD_DIM ** -0.5))
    blockwise = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, q_segment_ids=seg, block_q=block_q,
                                                            block_kv=block_kv))
    expected = _value_and_grads(dense, q, k, v, dout)
    actual = _value_and_grads(blockwise, q, k, v, dout)
    for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected):
        _assert_close(a, e, what=name)


def _numpy_attention(q, k, v, dout, seg, q_pos, k_pos):
    """Float64 dense attention and its q/k/v gradients, written out from the softmax Jacobian."""
    q, k, v, dout = (x.astype(np.float64) for x in (q, k, v, dout))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # query head h reads kv head h // group
    mask = (k_pos[None, :] <= q_pos[:, None])[None, None]
    if seg is not None:
        mask = mask & (seg[:, None, :, None] == seg[:, None, None, :])
    scale = q.shape[-1] ** -0.5
    s = np.where(mask, np.einsum("bshc,bthc->bhst", q, k) * scale, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhst,bthc->bshc", p, v)
    dp = np.einsum("bshc,bthc->bhst", dout, v)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.einsum("bhst,bthc->bshc", ds, k) * scale
    dk = np.einsum("bhst,bshc->bthc", ds, q) * scale
    dv = np.einsum("bhst,bshc->bthc", p, dout)
    fold = lambda x: x.reshape(*x.shape[:2], -1, group, x.shape[-1]).sum(3)  # noqa: E731
    return out, dq, fold(dk), fold(dv)


def test_matches_float64_numpy():
    q, k, v, dout, seg = _inputs(1, 2, 45, packed=True)
    pos = np.arange(45)
    expected = _numpy_attention(q, k, v, dout, seg, pos, pos)
    actual = _value_and_grads(
        lambda q, k, v: blockwise_attention(q, k, v, q_segment_ids=seg, block_q=16, block_kv=16), q, k, v, dout)
    for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected):
        _assert_close(a, e, rtol=2e-5, what=name)


def test_query_shard_against_reordered_keys():
    """What context parallelism will call: a query shard at its own positions against every key, the keys in
    any order (a load-balanced layout holds an early and a late chunk), masked by position, not by index."""
    seq, lo, hi = 48, 20, 36
    q, k, v, dout, seg = _inputs(2, 2, seq, packed=True)
    pos = np.arange(seq)
    expected = _numpy_attention(q, k, v, dout, seg, pos, pos)
    perm = np.concatenate([np.arange(24, 36), np.arange(0, 12), np.arange(36, 48), np.arange(12, 24)])

    def shard(q_shard, k_perm, v_perm):
        return blockwise_attention(q_shard, k_perm, v_perm, q_positions=jnp.arange(lo, hi), k_positions=perm,
                                   q_segment_ids=seg[:, lo:hi], k_segment_ids=seg[:, perm], block_q=8, block_kv=8)
    out, dq, dk_perm, dv_perm = _value_and_grads(shard, q[:, lo:hi], k[:, perm], v[:, perm], dout[:, lo:hi])
    shard_only = _numpy_attention(q, k, v, np.where((pos >= lo) & (pos < hi), 1.0, 0.0)[None, :, None, None] * dout,
                                  seg, pos, pos)
    _assert_close(out, expected[0][:, lo:hi], what="out")
    _assert_close(dq, expected[1][:, lo:hi], what="dq")
    # dk/dv: only this shard's queries contribute; undo the permutation before comparing.
    inverse = np.argsort(perm)
    _assert_close(np.asarray(dk_perm)[:, inverse], shard_only[2], what="dk")
    _assert_close(np.asarray(dv_perm)[:, inverse], shard_only[3], what="dv")


def test_query_that_sees_no_key_gets_zeros():
    q, k, v, _, _ = _inputs(3, 1, 8, packed=False)
    out = blockwise_attention(q, k, v, q_positions=jnp.arange(8) - 100, k_positions=jnp.arange(8), block_q=4)
    assert np.all(np.asarray(out) == 0)


def test_config_checks_block_sizes():
    assert ModelConfig(attention_impl="blockwise").attention_impl == "blockwise"
    with pytest.raises(InputError, match="model.attention_block_kv=0"):
        ModelConfig(attention_block_kv=0)


# --- the full model ------------------------------------------------------------------------------------------

CFG = dataclasses.replace(TINY, vocab_size=128, num_hidden_layers=2)  # 1 dense + 1 MoE + MTP
BLOCKWISE = dataclasses.replace(CFG, attention_impl="blockwise", attention_block_q=16, attention_block_kv=8)
SEQ = 40  # not a multiple of either block


def _model_loss(graphdef):
    def loss(params, buffers, tokens, segment_ids):
        out = apply(graphdef, params, buffers, tokens, None, segment_ids)
        return jnp.mean(out.logits ** 2) + jnp.mean(out.mtp_logits ** 2), out.logits
    return jax.value_and_grad(loss, has_aux=True)


def _model_run(cfg, mesh, params, buffers, tokens, segment_ids):
    graphdef, abs_params, abs_buffers = abstract_model(cfg, mesh)
    put = lambda tree, like: jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), tree, like)  # noqa: E731
    rows = jax.NamedSharding(mesh, sharding.logical("batch", "seq"))
    with sharding.use_mesh(mesh):
        (_, logits), grads = jax.jit(_model_loss(graphdef))(
            put(params, abs_params), put(buffers, abs_buffers), jax.device_put(tokens, rows),
            jax.device_put(segment_ids, rows))
    return logits, grads


@pytest.fixture(scope="module")
def dense_reference(mesh1):
    """The xla-attention model on one device, packed rows: the run both blockwise runs must reproduce."""
    _, params, buffers = init_model(CFG, mesh1, seed=0)
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (8, SEQ)), jnp.int32)
    segment_ids = jnp.asarray(np.sort(rng.integers(0, 3, (8, SEQ)), axis=1), jnp.int32)
    return params, buffers, tokens, segment_ids, *_model_run(CFG, mesh1, params, buffers, tokens, segment_ids)


def _assert_same_model(logits, grads, ref_logits, ref_grads):
    _assert_close(logits, ref_logits, what="logits")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads)):
        _assert_close(b, a, what=jax.tree_util.keystr(path))


def test_model_matches_dense_attention_single_device(mesh1, dense_reference):
    params, buffers, tokens, segment_ids, ref_logits, ref_grads = dense_reference
    _assert_same_model(*_model_run(BLOCKWISE, mesh1, params, buffers, tokens, segment_ids), ref_logits, ref_grads)


def test_model_matches_dense_attention_on_a_mesh(dense_reference):
    params, buffers, tokens, segment_ids, ref_logits, ref_grads = dense_reference
    mesh = sharding.make_mesh({"data": 2, "tensor": 2, "expert": 2}, cfg=BLOCKWISE, global_batch=8)
    _assert_same_model(*_model_run(BLOCKWISE, mesh, params, buffers, tokens, segment_ids), ref_logits, ref_grads)


# --- memory -------------------------------------------------------------------------------------------------

def _temp_bytes(attend, seq):
    """XLA's compiled scratch memory for <attend(q, k, v), dout> and its q/k/v gradients (compiled, not run)."""
    q = jax.ShapeDtypeStruct((1, seq, 2, HEAD_DIM), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, seq, 1, HEAD_DIM), jnp.float32)

    def fwd_bwd(q, k, v, dout):
        return _value_and_grads(attend, q, k, v, dout)
    return jax.jit(fwd_bwd).lower(q, kv, kv, q).compile().memory_analysis().temp_size_in_bytes


def test_memory_grows_linearly_with_sequence_length():
    blockwise = {s: _temp_bytes(blockwise_attention, s) for s in (1024, 4096, 16384)}
    assert blockwise[16384] / blockwise[4096] < 6, blockwise
    assert blockwise[4096] / blockwise[1024] < 6, blockwise
    # The dense path compiled at 16K too (compiling allocates nothing): [s, s] fp32 scores per head.
    dense_16k = _temp_bytes(lambda q, k, v: _xla_attention(q, k, v, attention_mask(None, 16384), HEAD_DIM ** -0.5),
                            16384)
    assert dense_16k >= 2 * 16384 ** 2 * 4  # at least one fp32 score matrix per head: the quadratic path
    assert blockwise[16384] <= dense_16k / 10, (blockwise, dense_16k)

"""Context parallelism on 8 virtual CPU devices: the load-balanced layout (hand-checked, round trip), and the
training loss, its metrics, logits and every gradient of a 2K-token packed batch sharded over context 2 and 4
(with data / tensor / expert) against the single-device model; config errors."""

import dataclasses

import jax
import numpy as np
import pytest

from glm46_jax import sharding
from glm46_jax.cli import InputError
from glm46_jax.config import TINY
from glm46_jax.data import loader
from glm46_jax.loss import LossConfig, loss_fn
from glm46_jax.model import abstract_model, apply, init_model

SEQ, ROWS = 2048, 4
# 1 dense + 1 MoE layer + MTP, dropless (capacity drops depend on token order, so only dropless is order-free).
CFG = dataclasses.replace(TINY, vocab_size=128, num_hidden_layers=2, attention_impl="blockwise",
                          attention_block_q=128, attention_block_kv=128)


# --- the layout ------------------------------------------------------------------------------------------------

def test_load_balanced_order_by_hand():
    # 16 tokens, 2 shards: chunks of 4; shard 0 holds chunks 0 and 3, shard 1 chunks 1 and 2.
    assert sharding.load_balanced_order(16, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    assert sharding.load_balanced_order(8, 4).tolist() == [0, 7, 1, 6, 2, 5, 3, 4]
    assert sharding.load_balanced_order(6, 1).tolist() == list(range(6))
    # Causal work (keys each query sees) is the same on every shard.
    order = sharding.load_balanced_order(SEQ, 4).reshape(4, -1)
    work = (order + 1).sum(1)
    assert (work == work[0]).all()
    with pytest.raises(ValueError, match="2 x 4"):
        sharding.load_balanced_order(20, 4)


def _packed_rows(rng, rows: int, seq: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Rows as the loader makes them (`shift_row`): documents of 100-700 tokens packed end to end, so they
    straddle the chunk boundaries; the last row ends in padding."""
    out = []
    for r in range(rows):
        lengths = []
        while sum(lengths) < seq + 1:
            lengths.append(int(rng.integers(100, 700)))
        segments = np.repeat(np.arange(1, len(lengths) + 1), lengths)[:seq + 1]
        positions = np.concatenate([np.arange(n) for n in lengths])[:seq + 1]
        if r == rows - 1:
            segments[-300:] = 0
        row = {"tokens": rng.integers(2, CFG.vocab_size, seq + 1), "tokens_segment_ids": segments,
               "tokens_positions": positions}
        out.append(loader.shift_row(row, pad_id))
    return {k: np.stack([r[k] for r in out]) for k in out[0]}


def test_layout_round_trip_and_mtp_fields():
    batch = _packed_rows(np.random.default_rng(0), 2, 64)
    laid = loader.to_context_layout(batch, 4)
    order = sharding.load_balanced_order(64, 4)
    for k, v in batch.items():
        np.testing.assert_array_equal(laid[k], v[:, order], err_msg=k)
        np.testing.assert_array_equal(loader.from_context_layout(laid[k], 4), v, err_msg=k)
    # The MTP fields in the original order: slot t reads input t + 1 and predicts target t + 1, valid only
    # where t and t + 1 both have a target of one document, never at the row's last slot.
    mtp = {k: loader.from_context_layout(laid[f"mtp_{k}"], 4) for k in ("inputs", "targets", "mask")}
    np.testing.assert_array_equal(mtp["inputs"][:, :-1], batch["inputs"][:, 1:])
    np.testing.assert_array_equal(mtp["targets"][:, :-1], batch["targets"][:, 1:])
    mask = batch["loss_mask"]
    np.testing.assert_array_equal(mtp["mask"][:, :-1], mask[:, :-1] * mask[:, 1:])
    assert (mtp["mask"][:, -1] == 0).all()
    assert loader.to_context_layout(batch, 1).keys() == batch.keys()  # context 1: nothing changes


# --- the model on context shards against one device ---------------------------------------------------------------

def _step(graphdef, cfg):
    loss_cfg = LossConfig(z_weight=1e-3)  # every loss term on

    def f(params, buffers, batch):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, buffers, batch, graphdef, cfg, loss_cfg, 0.3)
        out = apply(graphdef, params, buffers, batch["inputs"], batch["positions"], batch["segment_ids"],
                    next_tokens=batch.get("mtp_inputs"))
        return metrics, grads, out.logits, out.mtp_logits
    return jax.jit(f)


def _run(cfg, mesh, params, buffers, batch):
    graphdef, abs_params, abs_buffers = abstract_model(cfg, mesh)
    put = lambda tree, like: jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), tree, like)  # noqa: E731
    with sharding.use_mesh(mesh):
        metrics, grads, logits, mtp_logits = _step(graphdef, cfg)(
            put(params, abs_params), put(buffers, abs_buffers), loader.to_global(batch, mesh))
    context = dict(mesh.shape)["context"]
    return (jax.device_get(metrics), jax.device_get(grads),
            loader.from_context_layout(np.asarray(logits), context),
            loader.from_context_layout(np.asarray(mtp_logits), context))


@pytest.fixture(scope="module")
def reference(mesh1):
    _, params, buffers = init_model(CFG, mesh1, seed=0)
    keys = iter(jax.random.split(jax.random.key(1), 100))  # a non-zero correction bias: routing is biased
    buffers = jax.tree.map(lambda b: 0.05 * jax.random.normal(next(keys), b.shape), buffers)
    batch = _packed_rows(np.random.default_rng(1), ROWS, SEQ)
    return params, buffers, batch, _run(CFG, mesh1, params, buffers, batch)


def _close(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * (float(np.abs(want).max()) or 1.0), err_msg=what)


@pytest.mark.parametrize("mesh_shape", [
    {"context": 2, "data": 2, "tensor": 2},
    {"context": 4, "expert": 2},
    pytest.param({"context": 2, "expert": 2, "tensor": 2}, marks=pytest.mark.slow),
    pytest.param({"context": 4, "data": 2}, marks=pytest.mark.slow),
], ids=lambda m: ",".join(f"{k}{v}" for k, v in m.items()))
@pytest.mark.parametrize("dispatch", ["allgather", pytest.param("alltoall", marks=pytest.mark.slow)])
def test_context_shards_match_one_device(reference, mesh_shape, dispatch):
    params, buffers, batch, (want_metrics, want_grads, want_logits, want_mtp) = reference
    cfg = dataclasses.replace(CFG, moe_dispatch=dispatch)
    mesh = sharding.make_mesh(mesh_shape, cfg=cfg, global_batch=ROWS)
    metrics, grads, logits, mtp_logits = _run(cfg, mesh, params, buffers, batch)
    _close(logits, want_logits, "logits")
    _close(mtp_logits, want_mtp, "mtp logits")
    assert metrics.keys() == want_metrics.keys()
    for k, v in want_metrics.items():
        _close(metrics[k], v, k)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want_grads), jax.tree.leaves(grads)):
        _close(b, a, jax.tree_util.keystr(path))


# --- errors --------------------------------------------------------------------------------------------------

def test_context_needs_blockwise_attention():
    for impl in ("xla", "dot_product", "cudnn"):
        with pytest.raises(InputError, match=f"model.attention_impl='{impl}'.*attention_impl=blockwise"):
            sharding.validate_mesh(sharding.mesh_shape({"context": 2, "data": 4}, 8),
                                   dataclasses.replace(CFG, attention_impl=impl))
    sharding.validate_mesh(sharding.mesh_shape({"context": 2, "data": 4}, 8), CFG)


def test_sequence_must_split_into_two_chunks_per_context_shard():
    with pytest.raises(InputError, match=r"data.phases.long.seq_len=1000 is not a multiple of 2 x mesh.context = 16"):
        sharding.check_context_split(1000, 8, "data.phases.long.seq_len")
    sharding.check_context_split(1024, 8, "data.phases.long.seq_len")

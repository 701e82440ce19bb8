"""Context parallelism on 8 virtual CPU devices: the load-balanced layout (hand-checked, round trip), and the
training loss, its metrics, logits and every gradient of a packed batch of 1,584-token rows (not a power of two,
like GLM-4.6's 202,752: 2^11 x 99) sharded over context 2 and 4 (with data / tensor / expert) against the
single-device model; config errors."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import init_placed

from glm46_jax import run_config
from glm46_jax.parallel import sharding
from glm46_jax.errors import InputError
from glm46_jax.config import TINY
from glm46_jax.data import loader
from glm46_jax.training.loss import LossConfig, loss_fn
from glm46_jax.model import GenerationCache, abstract_model, apply, init_model, pipeline

# 8 chunks of 198 tokens at context 4 (4 of 396 at context 2): the 128-token attention blocks do not divide a chunk.
SEQ, ROWS = 1584, 2
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
    straddle the chunk boundaries; the first row starts with documents that end exactly on the boundaries of the
    context-4 chunks (1, 2 and 4 of the 8; 2 and 4 are context 2's) and one that ends mid-chunk; the last row ends
    in padding."""
    out = []
    chunk = seq // 8
    for r in range(rows):
        lengths = [chunk, chunk, 3 * chunk // 2, chunk // 2] if r == 0 else []
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

    def put(tree, like):  # leaf by leaf: on a pipeline mesh the abstract tree's axis metadata names differ
        placed = [jax.device_put(x, a.sharding) for x, a in zip(jax.tree.leaves(tree), jax.tree.leaves(like))]
        return jax.tree.unflatten(jax.tree.structure(like), placed)
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
    starts = np.flatnonzero(np.diff(batch["segment_ids"][0])) + 1  # where a new document begins in row 0
    assert {SEQ // 8, SEQ // 4, SEQ // 2} <= set(starts.tolist()) and SEQ * 7 // 16 in starts, starts
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


@pytest.mark.parametrize("mesh_shape, rows", [
    ({"pipeline": 2, "context": 2, "tensor": 2}, 2),
    pytest.param({"pipeline": 2, "context": 2, "expert": 2}, 4, marks=pytest.mark.slow),
], ids=lambda m: ",".join(f"{k}{v}" for k, v in m.items()) if isinstance(m, dict) else f"rows{m}")
def test_context_shards_compose_with_pipeline_stages(mesh1, mesh_shape, rows):
    """1 dense + 2 MoE layers (one per stage): inside a stage the context attention and the MoE dispatch are
    shard_maps nested in the pipeline's, with hand-written backward passes; every gradient must still match."""
    cfg = dataclasses.replace(CFG, num_hidden_layers=3)  # 2 micro-batches (one per stage)
    batch = _packed_rows(np.random.default_rng(2), rows, SEQ)
    _, params, buffers = init_model(cfg, mesh1, seed=0)
    want_metrics, want_grads, want_logits, want_mtp = _run(cfg, mesh1, params, buffers, batch)
    mesh = sharding.make_mesh(mesh_shape, cfg=cfg, global_batch=rows)
    _, params, buffers = init_placed(cfg, mesh, seed=0)  # the same weights, the MoE stack in stage slot order
    metrics, grads, logits, mtp_logits = _run(cfg, mesh, params, buffers, batch)
    _close(logits, want_logits, "logits")
    _close(mtp_logits, want_mtp, "mtp logits")
    for k, v in want_metrics.items():
        _close(metrics[k], v, k)
    placed = [jax.device_put(g, p.sharding) for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params))]
    grads = jax.device_get(pipeline.in_layer_order(jax.tree.unflatten(jax.tree.structure(grads), placed), cfg))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want_grads), jax.tree.leaves(grads)):
        _close(b, a, jax.tree_util.keystr(path))


# --- errors --------------------------------------------------------------------------------------------------

def test_context_needs_blockwise_attention():
    for impl in ("xla", "dot_product", "cudnn"):
        with pytest.raises(InputError, match=f"model.attention_impl='{impl}'.*attention_impl=blockwise"):
            sharding.validate_mesh(sharding.mesh_shape({"context": 2, "data": 4}, 8),
                                   dataclasses.replace(CFG, attention_impl=impl))
    sharding.validate_mesh(sharding.mesh_shape({"context": 2, "data": 4}, 8), CFG)


def test_generation_and_rl_refuse_a_context_mesh():
    """The KV-cache generator keeps a sequence whole: RL on a context mesh is a config error, generation there a
    clear ValueError (never a silently gathered sequence)."""
    from test_pipeline import _config_file

    rl = _config_file("grpo", "tiny")
    rl.mesh = {"data": -1, "context": 2}
    rl.model.attention_impl = "blockwise"
    with pytest.raises(InputError, match=r"mesh.context=2 with recipe grpo: .* set mesh.context=1"):
        run_config.from_config_dict(rl)
    mesh = sharding.make_mesh({"context": 2, "data": 4}, cfg=CFG)
    graphdef, params, buffers = init_placed(CFG, mesh)
    with sharding.use_mesh(mesh), pytest.raises(ValueError, match="generation keeps each sequence whole"):
        apply(graphdef, params, buffers, jnp.zeros((8, 1), jnp.int32), jnp.zeros((8, 1), jnp.int32),
              cache=GenerationCache.zeros(CFG, 8, 4), index=0, start=jnp.zeros(8, jnp.int32))


def test_sequence_must_split_into_two_chunks_per_context_shard():
    with pytest.raises(InputError, match=r"data.phases.long.seq_len=1000 is not a multiple of 2 x mesh.context = 16"):
        sharding.check_context_split(1000, 8, "data.phases.long.seq_len")
    sharding.check_context_split(1024, 8, "data.phases.long.seq_len")


# --- a long phase trains and resumes on context shards -------------------------------------------------------

def _curriculum_config(run_dir: str, corpus: str, steps: int):
    """The tiny preset on data 2 x context 4: 4 steps of 2 x 64 rows, then 3 steps of 2 x 1024 best-fit rows at
    RoPE 1e6 (documents of the sample corpus packed across every chunk boundary). Blocks of 64 tokens, so each
    context shard's two 128-token chunks span several blocks, as 4K rows do with the default 128."""
    from test_train import load_config

    config = load_config("tiny")
    config.run_dir, config.data.root = run_dir, corpus
    config.mesh = {"data": 2, "context": 4}
    config.model.update(attention_impl="blockwise", attention_block_q=64, attention_block_kv=64)
    config.data.phases.general.update(tokens=4 * 2 * 64, seq_len=64, global_batch=2)
    config.data.phases.code_long.update(tokens=3 * 2 * 1024, seq_len=1024, global_batch=2)
    config.train.update(steps=steps, log_every=1, eval_every=100, eval_batches=1)
    config.checkpoint.update(every=2, async_save=False)
    config.optim.update(warmup_steps=2, decay_steps=7)  # the same schedule for the interrupted run
    return config


@pytest.mark.slow
def test_long_phase_on_context_shards_trains_and_resumes_exactly(tmp_path, sample_corpus):
    import json

    from glm46_jax.run_config import from_config_dict
    from glm46_jax.train import train

    def losses(run_dir):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return {r["step"]: r["train/loss"] for r in map(json.loads, f) if "train/loss" in r}

    devices = jax.devices()[:8]
    whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
    state, summary = train(from_config_dict(_curriculum_config(whole, sample_corpus, 7)), devices)
    assert summary["phases"] == ["general", "code_long"] and int(state.step) == 7
    want = losses(whole)
    assert all(np.isfinite(v) for v in want.values()) and sorted(want) == list(range(1, 8))
    # The same run stopped after the short phase (a checkpoint at step 4), then resumed (resume=auto) into the long one.
    train(from_config_dict(_curriculum_config(split, sample_corpus, 4)), devices)
    resumed_state, resumed = train(from_config_dict(_curriculum_config(split, sample_corpus, 7)), devices)
    assert resumed["start_step"] == 5
    assert losses(split) == want  # bit-identical losses, the long steps included
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state.params), jax.tree.leaves(resumed_state.params)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(path))


# --- the plan tool -------------------------------------------------------------------------------------------

def test_plan_attention_memory_by_implementation_and_context():
    from glm46_jax import plan as plan_lib
    from glm46_jax.model import attention

    cfg = dataclasses.replace(TINY, remat="none", num_nextn_predict_layers=0, attention_block_q=64,
                              attention_block_kv=32)
    mesh = {"data": 1, "tensor": 2, "expert": 1, "pipeline": 1, "context": 1}
    seq, a = 1024, 4  # fp32 activations
    heads, kv = 8 // 2, 4 // 2 * 16  # local query heads, local kv heads x head_dim
    layers = cfg.num_hidden_layers

    def est(impl, context=1):
        return plan_lib.activation_estimate(dataclasses.replace(cfg, attention_impl=impl),
                                            {**mesh, "context": context}, 1, seq)

    xla, cudnn, blockwise = est("xla"), est("cudnn"), est("blockwise")
    # Per token and layer: xla holds a row of [s, s] scores (fp32 scores and softmax, probs in a) per head;
    # cudnn an fp32 log-sum-exp per head and packed-document slot; blockwise one per head plus the fp32 dK/dV
    # accumulators.
    m = attention.CUDNN_MAX_SEGMENTS
    assert xla.saved_layers - cudnn.saved_layers == seq * layers * heads * (seq * (8 + a) - 4 * m)
    assert blockwise.saved_layers - cudnn.saved_layers == seq * layers * (2 * kv * 4 - heads * 4 * (m - 1))
    assert blockwise.recompute - cudnn.recompute == heads * 64 * 32 * (8 + a)  # one score tile per head
    # Context 4: a quarter of the tokens per device, each also holding the K/V gathered from 3 other shards.
    c4 = est("blockwise", 4)
    assert c4.logits * 4 == blockwise.logits == seq * (-(-cfg.vocab_size // 2)) * (a + 8)
    assert c4.saved_layers * 4 == blockwise.saved_layers + seq * layers * 3 * 2 * kv * a


def test_plan_fits_glm45_32k_and_128k_on_2048_h100s_with_the_preset_mesh(capsys):
    from glm46_jax import plan as plan_lib

    config = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "pretrain.py")
    for seq in (32768, 131072):
        r = plan_lib.main([f"--config={config}:glm45", "--devices=2048", f"--seq-len={seq}", "--device-memory=80GB"])
        assert r.mesh == {"data": 16, "tensor": 8, "expert": 2, "pipeline": 1, "context": 8} and r.fits, r.report()
    assert "131072 / context 8 = 16384 tokens per device" in capsys.readouterr().out
    for seq in (4096, 32768, 131072):  # GLM-4.5-Air's preset mesh: every phase on 512 H100s
        r = plan_lib.main([f"--config={config}:glm45_air", "--devices=512", f"--seq-len={seq}",
                           "--device-memory=80GB"])
        assert r.mesh == {"data": 8, "tensor": 4, "expert": 2, "pipeline": 1, "context": 8} and r.fits, r.report()
    with pytest.raises(InputError, match=r"--seq-len=1000 is not a multiple of 2 x mesh.context = 16"):
        plan_lib.main([f"--config={config}:glm45", "--devices=2048", "--seq-len=1000"])

"""The GPU attention path (cuDNN flash attention, causal, packed documents through lengths + offsets) and
attention_impl="auto", proven on CPU: the documents -> (lengths, offsets) conversion against a hand-computed case and,
through a float64 NumPy attention that reads them as jax's cuDNN API documents them, against today's mask; the model's
cuDNN call path (jax's cuDNN API swapped for a plain-jnp reading of the same documented semantics) against the xla
mask path; "auto" per platform; and the program lowered for CUDA: causal, no bias operand, no attention forward re-run
by the remat policies."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo as cudnn_api

from glm46_jax.errors import InputError
from glm46_jax.config import TINY, ModelConfig
from glm46_jax.model import abstract_model, apply, attention, init_model
from glm46_jax.model.attention import (CUDNN_MAX_SEGMENTS, _xla_attention, attention_mask, resolved_attention_impl,
                                       segment_layout, self_attention_mask)
from glm46_jax.model.blockwise_attention import blockwise_attention
from glm46_jax.model.transformer import _REMAT_POLICIES
from glm46_jax.parallel import sharding

CFG = dataclasses.replace(TINY, vocab_size=128)


def test_segment_layout_by_hand():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 0, 0, 0],  # two documents, then padding (its own run)
                       [5, 5, 5, 5, 5, 5, 5, 5],  # one document
                       [1, 2, 3, 4, 5, 6, 7, 8]], jnp.int32)  # more documents than the layout holds (4)
    lengths, offsets, count = segment_layout(seg, 4)
    np.testing.assert_array_equal(lengths, [[3, 2, 3, -1], [8, -1, -1, -1], [1, 1, 1, 1]])
    np.testing.assert_array_equal(offsets, [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1], [0, 1, 2, 3, -1]])
    np.testing.assert_array_equal(count, [3, 1, 8])


def _np_cudnn_packed_attention(q, k, v, lengths, offsets, scale):
    """Float64 attention as jax's cuDNN API documents its packed layout: document j of row b is the rows
    [offsets[b, j], offsets[b, j] + lengths[b, j]) (-1: none), a causal sequence of its own; GQA as HF."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    k, v = (np.repeat(x, q.shape[2] // k.shape[2], axis=2) for x in (k, v))
    out = np.full(q.shape, np.nan)  # a row no document covers stays NaN
    for b in range(q.shape[0]):
        for length, start in zip(lengths[b], offsets[b]):
            if length < 0:
                continue
            rows = slice(start, start + length)
            s = np.einsum("shc,thc->hst", q[b, rows], k[b, rows]) * scale
            s = np.where(np.tril(np.ones((length, length), bool)), s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, rows] = np.einsum("hst,thc->shc", p / p.sum(-1, keepdims=True), v[b, rows])
    return out


def _packed_rows(rng, batch, seq):
    """Rows of documents with random lengths (some one token long), padding (id 0) at the end of some."""
    rows = []
    for _ in range(batch):
        ids = np.sort(rng.integers(1, 6, seq))
        ids[seq - rng.integers(0, 4):] = 0
        rows.append(ids)
    return np.stack(rows).astype(np.int32)


def test_packed_layout_reads_as_todays_mask():
    rng = np.random.default_rng(0)
    b, s, h, kv, c = 3, 24, 4, 2, 8
    q, k, v = (rng.normal(size=(b, s, n, c)).astype(np.float32) for n in (h, kv, kv))
    seg = _packed_rows(rng, b, s)
    lengths, offsets, count = map(np.asarray, segment_layout(jnp.asarray(seg), CUDNN_MAX_SEGMENTS))
    assert (count <= CUDNN_MAX_SEGMENTS).all() and (np.where(lengths > 0, lengths, 0).sum(1) == s).all()
    expected = _xla_attention(q, k, v, attention_mask(jnp.asarray(seg), s), c ** -0.5)
    np.testing.assert_allclose(_np_cudnn_packed_attention(q, k, v, lengths, offsets, c ** -0.5), expected,
                               rtol=1e-5, atol=1e-5)


def _jnp_cudnn_api(query, key, value, bias=None, mask=None, q_seqlen=None, kv_seqlen=None, q_offsets=None,
                   kv_offsets=None, *, scale, mask_type, **unused):
    """jax's cuDNN `dot_product_attention` as its docstring defines it, in plain jnp (runs on CPU): causal
    (mask_type CAUSAL), or causal within each packed document given by lengths + offsets (PADDING_CAUSAL)."""
    assert bias is None and mask is None and unused.get("dropout_rate", 0.0) == 0.0
    t = query.shape[1]
    pos = jnp.arange(t)
    allowed = (pos[None, :] <= pos[:, None])[None]
    if q_offsets is None:
        assert mask_type == cudnn_api.MaskType.CAUSAL and q_seqlen is None
    else:
        assert mask_type == cudnn_api.MaskType.PADDING_CAUSAL
        assert q_seqlen is kv_seqlen and q_offsets is kv_offsets
        start, length = q_offsets[:, None, :-1], q_seqlen[:, None, :]
        member = (start <= pos[None, :, None]) & (pos[None, :, None] < start + length) & (length >= 0)  # [b, t, m]
        allowed = allowed & (jnp.einsum("bim,bjm->bij", member.astype(jnp.int32), member.astype(jnp.int32)) > 0)
    layout = jax.typeof(query).sharding
    spread = not layout.mesh.empty and not layout.mesh.manual_axes  # outside a shard_map: gather, for the repeat
    if spread:
        query, key, value, allowed = (jax.sharding.reshard(x, jax.P()) for x in (query, key, value, allowed))
    group = query.shape[2] // key.shape[2]
    key, value = (jnp.repeat(x, group, axis=2) for x in (key, value))
    scores = jnp.einsum("bqhc,bkhc->bhqk", query, key).astype(jnp.float32) * scale
    probs = jax.nn.softmax(jnp.where(allowed[:, None], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhqk,bkhc->bqhc", probs.astype(value.dtype), value)
    return jax.sharding.reshard(out, layout) if spread else out


def test_model_cudnn_path_matches_the_mask_path(monkeypatch, mesh1):
    """Packed rows (through the shard_map'd packed call, also on a data x tensor mesh) and whole rows."""
    monkeypatch.setattr(cudnn_api, "dot_product_attention", _jnp_cudnn_api)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 16)), jnp.int32)
    segments = jnp.asarray(np.stack([[1] * 5 + [2] * 7 + [0] * 4, [3] * 16]), jnp.int32)
    cfg = CFG.replace(num_hidden_layers=2, num_nextn_predict_layers=0)  # a dense and an MoE layer: compiles fast
    _, params, buffers = init_model(cfg, mesh1, seed=4)

    def run(impl, mesh, seg):
        graphdef, p, b = abstract_model(cfg.replace(attention_impl=impl), mesh)
        p, b = jax.device_put((params, buffers), jax.tree.map(lambda x: x.sharding, (p, b)))
        with sharding.use_mesh(mesh):
            return jax.jit(lambda p, b, t, s: apply(graphdef, p, b, t, None, s))(p, b, tokens, seg)

    mesh4 = sharding.make_mesh({"data": 2, "tensor": 2}, jax.devices()[:4])
    for seg in (segments, None):
        ref = run("xla", mesh1, seg)
        for mesh in (mesh1, mesh4):
            out = run("cudnn", mesh, seg)
            np.testing.assert_allclose(out.logits, ref.logits, atol=1e-4)  # the HF parity tests' tolerance


def test_auto_resolves_per_platform(monkeypatch):
    auto = ModelConfig(attention_impl="auto", dtype="bfloat16")
    for hopper in (False, True):
        monkeypatch.setattr(cudnn_api, "check_compute_capability", lambda _, hopper=hopper: hopper)
        assert resolved_attention_impl(auto, platform="gpu", context=1) == "cudnn"
        assert resolved_attention_impl(auto, platform="gpu", context=1, packed=True) == ("cudnn" if hopper
                                                                                         else "blockwise")
        for other in ({"dtype": "float32"}, {"head_dim": 12}, {"head_dim": 512}):
            assert resolved_attention_impl(auto.replace(**other), platform="gpu", context=1) == "blockwise"
        assert resolved_attention_impl(auto, platform="gpu", context=2) == "blockwise"
        for platform in ("cpu", "tpu"):
            assert resolved_attention_impl(auto, platform=platform, context=1) == "blockwise"
    assert resolved_attention_impl(auto.replace(attention_impl="xla"), platform="gpu") == "xla"
    # The CPU here: auto runs blockwise, for training (a SequenceMask) and generation (xla with the cache mask).
    assert isinstance(self_attention_mask(auto, None, 8), attention.SequenceMask)
    sharding.validate_mesh({"data": 2, "context": 2}, CFG.replace(attention_impl="auto"))
    with pytest.raises(InputError, match="attention_impl"):
        ModelConfig(attention_impl="flash")


def test_auto_falls_back_to_blockwise_where_cudnn_refuses(monkeypatch, mesh1):
    """On a "GPU" whose cuDNN jax cannot find (its own check raises, as it does on this CPU), auto traces and runs
    the blockwise path: the same logits as attention_impl="blockwise"; an explicit "cudnn" raises."""
    monkeypatch.setattr(attention, "_platform", lambda: "gpu")
    monkeypatch.setattr(cudnn_api, "check_compute_capability", lambda _: True)
    cfg = CFG.replace(num_hidden_layers=2, num_nextn_predict_layers=0, dtype="bfloat16")
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, CFG.vocab_size, (2, 8)), jnp.int32)
    segments = jnp.asarray([[1] * 3 + [2] * 5, [1] * 8], jnp.int32)
    _, params, buffers = init_model(cfg, mesh1, seed=1)
    logits = {}
    for impl in ("auto", "blockwise", "cudnn"):
        graphdef = abstract_model(cfg.replace(attention_impl=impl), mesh1)[0]
        with sharding.use_mesh(mesh1):
            fn = jax.jit(lambda p, b, t, s, graphdef=graphdef: apply(graphdef, p, b, t, None, s).logits)
            if impl == "cudnn":
                with pytest.raises(RuntimeError, match="cuDNN"):
                    fn(params, buffers, tokens, segments)
            else:
                logits[impl] = fn(params, buffers, tokens, segments)
    np.testing.assert_array_equal(logits["auto"], logits["blockwise"])


def test_auto_runs_on_cpu_and_generates(mesh1):
    from glm46_jax.model.transformer import GenerationCache
    graphdef, params, buffers = init_model(CFG.replace(attention_impl="auto"), mesh1, seed=2)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, (1, 6)), jnp.int32)
    with sharding.use_mesh(mesh1):
        whole = jax.jit(lambda p, b, t: apply(graphdef, p, b, t).logits)(params, buffers, tokens)
        cache = GenerationCache.zeros(CFG, 1, 8)
        step = jax.jit(lambda p, b, t, c: apply(graphdef, p, b, t, jnp.arange(6)[None], cache=c, index=0,
                                               start=jnp.zeros((1,), jnp.int32), with_mtp=False).logits)
        cached = step(params, buffers, tokens, cache)
    np.testing.assert_allclose(cached, whole, atol=1e-5)


def test_a_row_of_too_many_documents_turns_nan(monkeypatch):
    """cuDNN's packed layout holds CUDNN_MAX_SEGMENTS documents per row: a row with more gets a NaN output (never
    silently wrong attention), the other rows their exact one."""
    monkeypatch.setattr(cudnn_api, "dot_product_attention", _jnp_cudnn_api)
    s = CUDNN_MAX_SEGMENTS + 8
    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=(2, s, n, 8)).astype(np.float32) for n in (4, 2, 2))
    seg = np.stack([np.arange(s), np.repeat([1, 2], s // 2)]).astype(np.int32)  # s documents; 2 documents
    out = np.asarray(jax.jit(attention.cudnn_attention, static_argnums=4)(q, k, v, jnp.asarray(seg), 8 ** -0.5))
    assert np.isnan(out[0]).all()
    lengths, offsets, _ = map(np.asarray, segment_layout(jnp.asarray(seg[1:]), CUDNN_MAX_SEGMENTS))
    np.testing.assert_allclose(out[1:], _np_cudnn_packed_attention(q[1:], k[1:], v[1:], lengths, offsets, 8 ** -0.5),
                               rtol=1e-5, atol=1e-5)


def test_host_check_refuses_rows_of_too_many_documents(monkeypatch):
    """Before a batch reaches a GPU whose attention resolves to cudnn, a row of more than CUDNN_MAX_SEGMENTS documents
    is an InputError naming the fix (on the device it would turn NaN); exactly the limit passes, and nothing is
    refused where the attention is blockwise (a CPU, or a context split)."""
    monkeypatch.setattr(cudnn_api, "check_compute_capability", lambda _: True)
    auto = dataclasses.replace(CFG, dtype="bfloat16", attention_impl="auto")
    s = 4 * CUDNN_MAX_SEGMENTS
    at_limit = np.repeat(np.arange(CUDNN_MAX_SEGMENTS), 4)[None]  # 32 runs of 4
    over = np.concatenate([at_limit[:, :-1], [[0]]], axis=1)  # the last token a 33rd run (an id recurring is a run)
    attention.check_documents_fit(auto, np.concatenate([at_limit, at_limit]), platform="gpu", context=1)
    with pytest.raises(InputError, match=f"packs {CUDNN_MAX_SEGMENTS + 1} documents.*attention_impl=blockwise"):
        attention.check_documents_fit(auto, np.stack([at_limit, over])[:, 0].reshape(1, 2, s), platform="gpu",
                                      context=1)
    attention.check_documents_fit(auto, over, platform="cpu", context=1)
    attention.check_documents_fit(auto, over, platform="gpu", context=2)


def _fmha_calls(remat: str, packed: bool, monkeypatch, mesh_shape=None) -> list[tuple[str, str]]:
    """(custom-call target, backend config) of every cuDNN attention call in the tiny model's loss gradient,
    lowered for CUDA on this CPU machine with attention_impl="auto" as it resolves on a Hopper GPU."""
    monkeypatch.setattr(attention, "_platform", lambda: "gpu")
    monkeypatch.setattr(cudnn_api, "check_compute_capability", lambda _: True)
    monkeypatch.setattr(cudnn_api, "check_cudnn_version", lambda: 91000)  # no cuDNN library here to ask
    cfg = CFG.replace(dtype="bfloat16", attention_impl="auto", remat=remat)
    mesh_shape = mesh_shape or {"data": 1}
    mesh = sharding.make_mesh(mesh_shape, jax.devices()[:int(np.prod(list(mesh_shape.values())))])
    graphdef, params, buffers = abstract_model(cfg, mesh)
    rows = jax.ShapeDtypeStruct((2, 16), jnp.int32)

    def loss(p, b, tokens, segments):
        out = apply(graphdef, p, b, tokens, None, segments if packed else None)
        return out.logits.astype(jnp.float32).mean() + out.mtp_logits.astype(jnp.float32).mean()
    with sharding.use_mesh(mesh):
        text = jax.jit(jax.grad(loss)).trace(params, buffers, rows, rows).lower(lowering_platforms=("cuda",)).as_text()
    return re.findall(r'custom_call @(__cudnn\$fmha\w+)\(.*?backend_config = "(.*?)"', text)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("remat, mesh_shape", [("none", None), ("full", None), ("save_matmuls", None),
                                               ("save_matmuls", {"data": 2, "tensor": 2})])
def test_lowered_for_cuda_causal_no_bias_no_forward_rerun(monkeypatch, remat, mesh_shape, packed):
    calls = _fmha_calls(remat, packed, monkeypatch, mesh_shape)
    targets = [target for target, _ in calls]
    # One forward and one backward per attention site: the dense stack, the MoE stack (each a scan body) and MTP.
    assert targets.count("__cudnn$fmhaSoftmax") == targets.count("__cudnn$fmhaSoftmaxBackward") == 3, targets
    for _, config in calls:
        config = config.replace("\\22", '"')
        assert re.search(r'"mask_type": "(\w+)"', config)[1] == ("PADDING_CAUSAL" if packed else "CAUSAL")
        assert re.search(r'"max_seg_per_batch": (\d+)', config)[1] == str(CUDNN_MAX_SEGMENTS if packed else 1)


def test_remat_keeps_the_blockwise_attention_forward():
    """The blockwise forward (a fori_loop over key blocks, a while loop in the jaxpr) runs once under every remat
    policy: its backward is the only other one; a policy that saves nothing runs the forward twice."""
    q, k = jnp.ones((2, 32, 4, 8)), jnp.ones((2, 32, 2, 8))

    def layer(q, k, v):
        return jnp.sin(blockwise_attention(jnp.cos(q), k, v, block_q=8, block_kv=8)).sum()

    def loops(policy):
        f = jax.checkpoint(layer, policy=policy, prevent_cse=False)
        return str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, k, k)).count("while[")
    assert loops(None) == 3
    assert loops(_REMAT_POLICIES["full"]) == loops(_REMAT_POLICIES["save_matmuls"]) == 2


def test_activation_estimate_counts_the_kept_attention_output():
    from glm46_jax.model.activations import activation_estimate
    mesh = {"data": 1, "tensor": 1, "expert": 1, "pipeline": 1, "context": 1}
    cfg = CFG.replace(attention_impl="blockwise", num_nextn_predict_layers=0)
    a, heads, q = 4, cfg.num_attention_heads, cfg.num_attention_heads * cfg.head_dim
    full = activation_estimate(cfg, mesh, 1, 64, "full")
    # Per token and layer: the layer input, and the attention output and fp32 log-sum-exp the policy keeps.
    assert full.saved_layers == 64 * cfg.num_hidden_layers * (a * cfg.hidden_size + a * q + heads * 4)
    assert activation_estimate(cfg.replace(attention_impl="xla"), mesh, 1, 64, "full").saved_layers == (
        64 * cfg.num_hidden_layers * a * cfg.hidden_size)  # the xla path's attention is recomputed


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="runs jax's real cuDNN call: a GPU run's check")
@pytest.mark.parametrize("packed", [False, True])
def test_real_cudnn_on_gpu_matches_the_mask_path(packed):
    """On a GPU (Hopper for packed rows): the real cuDNN call's output and q/k/v gradients against today's mask path
    in fp32 from the same bf16 inputs, at bf16 tolerances."""
    rng = np.random.default_rng(5)
    b, s, c = 2, 256, 64
    q, k, v, dout = (jnp.asarray(rng.normal(size=(b, s, n, c)), jnp.bfloat16) for n in (4, 2, 2, 4))
    seg = jnp.asarray(_packed_rows(rng, b, s)) if packed else None
    scale = c ** -0.5

    def grads(attend, *args):
        out, vjp = jax.vjp(attend, *args)
        return (out, *vjp(dout.astype(out.dtype)))
    got = jax.jit(lambda q, k, v: grads(lambda q, k, v: attention.cudnn_attention(q, k, v, seg, scale), q, k, v))(
        q, k, v)
    mask = attention_mask(seg, s)
    want = jax.jit(lambda q, k, v: grads(lambda q, k, v: _xla_attention(q, k, v, mask, scale), q, k, v))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        w = np.asarray(w)
        np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=3e-2 * np.abs(w).max(), err_msg=name)

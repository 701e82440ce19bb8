"""Activation memory per device, estimated from the config and mesh (`plan`'s activations row): a formula for what
the backward pass keeps, not a compiled program's buffer assignment (attention's share: docs/long_context.md#memory).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from glm46_jax.config import ModelConfig
from glm46_jax.model.attention import CUDNN_MAX_SEGMENTS, resolved_attention_impl
from glm46_jax.model.experts import dropless_impl


@dataclasses.dataclass(frozen=True)
class ActivationEstimate:
    """Activation bytes per device (`activation_estimate`); `total` is their sum."""
    saved_layers: int  # kept for the backward of every scanned layer (by remat policy)
    recompute: int  # one scanned layer rebuilt for its backward (remat full / save_matmuls)
    mtp: int  # the MTP layer (remat like the trunk), its inputs, the embedding output, final norm
    logits: int  # main + MTP logits with their fp32 copy and gradient
    moe_buffers_per_layer: int  # routed-expert dispatch + grouped-matmul buffers of one MoE layer
    pipeline: int = 0  # a stage's micro-batch buffers (inputs, loop-back, outputs) and per-token router statistics

    @property
    def total(self) -> int:
        return self.saved_layers + self.recompute + self.mtp + self.logits + self.pipeline


def _moe_buffers_per_token(cfg: ModelConfig, mesh: Mapping[str, int], a: int) -> float:
    """Routed-expert bytes per local token in one MoE layer (model/moe.py, model/experts.py).

    With a capacity factor cf > 0 the grouped matmul pads every local expert to C = ceil(cf * tokens * k / E)
    rows, k * cf per local token; per row the gathered input, gate, up and silu*up, the output, and their
    gradients in the backward: (3 H + 6 Im / tensor) * a. Dropless (cf = 0,
    docs/sharding.md#dropless-grouped-experts) runs block by block and adds each block into the tokens'
    fp32 output and input gradient (8 H per token it computes on: the expert group's with allgather, the
    receive buffer's expert * min(k, E / expert) slots per local token with alltoall).
    Exchange buffers: allgather gathers the expert group's tokens (expert * H in the compute dtype,
    plus the fp32 partial outputs); alltoall sends, receives and returns its slots (2 copies in the
    compute dtype, 2 in fp32).
    """
    h, k, e, ep = cfg.hidden_size, cfg.num_experts_per_tok, cfg.n_routed_experts, mesh["expert"]
    fm = -(-cfg.moe_intermediate_size // mesh["tensor"])
    cf = cfg.moe_capacity_factor
    allgather = cfg.moe_dispatch == "allgather"
    if cf > 0:
        routed = k * cf * (3 * h + 6 * fm) * a
    else:
        routed = (ep if allgather else ep * min(k, e // ep)) * 8 * h
    if allgather:
        exchange = ep * h * (a + 4) if ep > 1 else 0
    else:
        exchange = (k * cf if cf > 0 else ep * min(k, e // ep)) * h * (2 * a + 8)
    return routed + exchange


def _grouped_rows_per_token(cfg: ModelConfig, mesh: Mapping[str, int]) -> int:
    """Rows of the grouped experts' GEMMs per local token: every assignment the dispatch hands this shard, routed
    here or not (allgather: the expert group's tokens x k; alltoall: the receive buffer's slots)."""
    k, e, ep = cfg.num_experts_per_tok, cfg.n_routed_experts, mesh["expert"]
    return ep * k if cfg.moe_dispatch == "allgather" else ep * min(k, e // ep)


def activation_estimate(cfg: ModelConfig, mesh_sizes: Mapping[str, int], micro_batch: int, seq_len: int,
                        remat: str | None = None) -> ActivationEstimate:
    """Activation bytes per device for `micro_batch` sequences of `seq_len` tokens on each batch shard, each
    sequence split over the `context` axis (C): a device holds micro_batch * seq_len / C tokens.

    An estimate that leans high. Per local token, with a = bytes of cfg.dtype, tp = tensor axis,
    q = ceil(nh/tp)*hd, kv = ceil(nkv/tp)*hd, f = ceil(I/tp), fs = ceil(Im*n_shared/tp), a layer holds
      attention  a * (2H norm + 3*(q + 2 kv) projections/bias/qk-norm/rope + q + H out), plus by
                 `attention_impl` (docs/long_context.md#memory):
                   xla, dot_product  [s, s] scores of ceil(nh/tp) heads: fp32 scores, fp32 softmax and
                                     probs in a, (8 + a) bytes per key
                   cudnn             an fp32 log-sum-exp per head and packed-document slot (flash attention;
                                     its packed layout keeps [rows * CUDNN_MAX_SEGMENTS, heads, s])
                   blockwise         an fp32 log-sum-exp per head, the fp32 dK/dV accumulators of the
                                     backward (2 kv * 4), and with C > 1 the K/V gathered from the other
                                     shards, (C - 1) * 2 kv * a; plus per row, not per token, one score tile
                                     [block_q, block_kv] per head, (8 + a) bytes each
      dense FFN  a * (2H norm + 3f + H)
      MoE        a * (2H norm + 3 fs + H shared + H routed) + fp32 router logits/scores (8E)
                 + fp32 combine (4H) + the routed buffers of `_moe_buffers_per_token`
    Saved per scanned layer, by remat policy:
      none          all of it
      save_matmuls  layer input + outputs of matmuls without batch dims (q/k/v, o_proj, dense and
                    shared FFN gate/up/down, fp32 router logits); routed experts and attention recompute,
                    but for the grouped experts' gate/up (below) and the MTP layer's routed output (a H)
      full          the layer input (a * H) only
    and with both, for cudnn and blockwise, the attention output and its log-sum-exp (a * q + the
    log-sum-exps above): the policies keep them, so the backward never re-runs the attention forward.
    "auto" is counted as what it resolves to on the platform this runs on. The grouped dropless experts
    (moe_impl, resolved likewise) hold their gate and up, 2 f_moe a per row of their GEMMs,
    `_grouped_rows_per_token` rows per token, and keep them with none and save_matmuls
    (docs/performance.md#dropless-experts).
    plus, with save_matmuls / full, one layer rebuilt for its backward. The MTP layer follows the
    same policy as the trunk (saved like one more MoE layer; its rebuild is the trunk's MoE rebuild);
    its inputs take 7 a H more, the embedding output and final norm 2 a H.
    Logits: (1 + MTP) * ceil(V/tp) * (a + 4 fp32 copy + 4 fp32 gradient). The terms are summed
    although the logits, the MTP layer and the rebuilt layer peak at different moments; that
    stands in for gradients in flight, which are not counted separately.
    Checked against XLA's buffer assignment (CPU, 8 devices, a 6-layer GLM-shaped model; every
    remat policy, both dispatches, dropless and cf 1.25, seq 1024 and 4096): 1.05-1.8x XLA's temp
    bytes, never below. Not counted: XLA workspace, collectives' buffers, fragmentation.
    """
    remat = cfg.remat if remat is None else remat
    if remat not in ("none", "full", "save_matmuls"):
        raise ValueError(f"remat={remat!r}: expected none | full | save_matmuls")
    tp = mesh_sizes["tensor"]
    a = np.dtype(cfg.dtype).itemsize
    h, e = cfg.hidden_size, cfg.n_routed_experts
    heads = -(-cfg.num_attention_heads // tp)
    q, kv = heads * cfg.head_dim, -(-cfg.num_key_value_heads // tp) * cfg.head_dim
    f = -(-cfg.intermediate_size // tp)
    fs = -(-cfg.shared_intermediate_size // tp)
    routed = _moe_buffers_per_token(cfg, mesh_sizes, a)
    context = mesh_sizes.get("context", 1)
    tokens = micro_batch * seq_len / context
    rows = _grouped_rows_per_token(cfg, mesh_sizes)
    fm = -(-cfg.moe_intermediate_size // tp)
    grouped = cfg.moe_capacity_factor <= 0 and dropless_impl(cfg.moe_impl, cfg.dtype, h, fm,
                                                             int(tokens * rows)) == "grouped"
    kept_experts = 2 * rows * fm * a if grouped else 0  # the grouped experts' gate and up

    impl = resolved_attention_impl(cfg, context=context, packed=True)
    lse = {"cudnn": heads * 4 * CUDNN_MAX_SEGMENTS, "blockwise": heads * 4}.get(impl, 0)
    if impl == "cudnn":
        scores = lse
    elif impl == "blockwise":
        scores = lse + 2 * kv * 4 + (context - 1) * 2 * kv * a
    else:
        scores = heads * seq_len * (8 + a)
    attn = a * (2 * h + 3 * (q + 2 * kv) + q + h) + scores
    kept_attn = a * q + lse if lse else 0  # the attention output and log-sum-exp the remat policies keep
    dense = a * (2 * h + 3 * f + h)
    moe = a * (2 * h + 3 * fs + 2 * h) + 8 * e + 4 * h + routed + kept_experts
    kept_mtp = 0
    if remat == "none":
        saved_dense, saved_moe = attn + dense, attn + moe
    elif remat == "save_matmuls":
        saved_attn = a * (h + q + 2 * kv + h) + kept_attn
        saved_dense, saved_moe = saved_attn + a * (2 * f + h), saved_attn + a * (2 * fs + h) + 4 * e + kept_experts
        kept_mtp = a * h  # the MTP layer's routed output: its final norm's backward reads it
    else:
        saved_dense = saved_moe = a * h + kept_attn
    n_dense, n_moe, n_mtp = cfg.num_dense_layers, cfg.num_moe_layers, cfg.num_nextn_predict_layers
    # Pipeline stages (docs/pipeline.md#memory-and-traffic): a stage keeps, for each of its R M + S - 1
    # iterations, its c layers' residuals of one micro-batch (S / M of the tokens around the trunk, which is
    # data-parallel over `pipeline` outside it), plus the micro-batch buffers and per-token router statistics.
    moe_tokens, rebuilt_moe, stage_buffers = float(n_moe), 1.0, 0.0
    stages = mesh_sizes.get("pipeline", 1)
    if stages > 1 and n_moe:
        s_, r_ = stages, cfg.pipeline_repeats
        m_ = cfg.pipeline_microbatches or stages
        c_ = -(-n_moe // (s_ * r_))
        moe_tokens, rebuilt_moe = c_ * (r_ * m_ + s_ - 1) * s_ / m_, s_ / m_
        stage_buffers = s_ * (3 * a * h + r_ * c_ * 4 * (e + cfg.num_experts_per_tok))
    rebuilt = [attn + dense] * bool(n_dense) + [(attn + moe) * rebuilt_moe] * bool(n_moe)
    per_token = ActivationEstimate(
        saved_layers=n_dense * saved_dense + moe_tokens * saved_moe,
        recompute=0 if remat == "none" else max(rebuilt, default=0),
        mtp=n_mtp * (saved_moe + kept_mtp + 7 * a * h) + 2 * a * h,
        logits=(1 + n_mtp) * -(-cfg.vocab_size // tp) * (a + 8),
        moe_buffers_per_layer=routed, pipeline=stage_buffers)
    out = ActivationEstimate(*(math.ceil(tokens * v) for v in dataclasses.astuple(per_token)))
    if impl == "blockwise":  # the tile of the layer being computed
        tile = micro_batch * heads * min(cfg.attention_block_q, seq_len) * min(cfg.attention_block_kv, seq_len)
        out = dataclasses.replace(out, recompute=out.recompute + tile * (8 + a))
    return out

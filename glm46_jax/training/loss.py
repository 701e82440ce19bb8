"""Training losses: vocab-parallel cross-entropy, MTP, sequence balance aux loss, z-loss.

    loss = ce + mtp_weight * mtp_ce + aux_weight * seq_aux + z_weight * z

Every term is a *sum over this batch divided by a normaliser* (`Norms`) that the caller may fix
for the whole global batch: gradient accumulation then sums micro-batch losses and gets exactly
the gradient of one big batch (token means weighted by tokens, sequence means by sequences).

The vocab axis of the logits may be tensor-sharded. A gather of the label logit
(`take_along_axis`, optax's integer-label CE) along a sharded axis is ambiguous under Explicit
sharding, so there the label logit is picked with a one-hot mask laid out like the logits: every
shard selects from its own slice of the vocabulary and the sum over vocab becomes one small
all-reduce. With the vocab unsharded it is a gather. The backward is hand-written (`nll_and_lse`), and both
passes run over the positions a chunk at a time (`LossConfig.ce_chunk_tokens`), upcasting only that chunk to fp32:
the bf16 logits of a GPU step are never copied whole to fp32
(docs/performance.md#cross-entropy-without-the-full-logits).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from glm46_jax.errors import check_range
from glm46_jax.config import ModelConfig
from glm46_jax.data.loader import mtp_labels
from glm46_jax.model import apply

# A batch is a dict of [b, s] int arrays: "inputs", "targets" and optionally "loss_mask", "positions",
# "segment_ids". A batch laid out for a context axis > 1 (`loader.to_context_layout`) also brings the MTP
# layer's inputs and labels, derived in the row's original order: "mtp_inputs", "mtp_targets", "mtp_mask".
# Every term below is a sum over positions, so it does not depend on the order of a row's slots.
Batch = dict[str, Array]


def _laid_out_like(x: Array, ref: Array) -> Array:
    """`x` resharded to `ref`'s layout (a no-op outside a mesh): labels and masks often arrive
    replicated or on another layout than the logits, and Explicit mode does not guess."""
    layout = jax.typeof(ref).sharding
    return x if layout.mesh.empty else jax.sharding.reshard(x, layout)


# Positions per chunk of the cross-entropy, per device (`LossConfig.ce_chunk_tokens`): each chunk's fp32 logits and
# softmax are its own temporaries, so nothing [tokens, vocab]-sized is ever fp32. At or under it there is no loop.
CHUNK_TOKENS = 4096


def token_nll(logits: Float[Array, "b s v"], labels: Int[Array, "b s"],
              chunk_tokens: int = CHUNK_TOKENS) -> Float[Array, "b s"]:
    """-log softmax(logits)[label] per position, in fp32, without gathering along vocab."""
    return nll_and_lse(logits, labels, chunk_tokens)[0]


def nll_and_lse(logits: Float[Array, "*b v"], labels: Int[Array, "*b"], chunk_tokens: int = CHUNK_TOKENS
                ) -> tuple[Float[Array, "*b"], Float[Array, "*b"]]:
    """(-log softmax(logits)[label], logsumexp(logits)) per position, in fp32 (the z-loss reads the lse).

    The logits keep their dtype (bf16 on a GPU): at most `chunk_tokens` positions per device are upcast at a time,
    forward and backward, and d logits come back in the logits' dtype."""
    return _nll_lse(logits, labels, _chunks(logits, chunk_tokens))


def _spec(x) -> tuple[jax.sharding.NamedSharding, tuple]:
    layout = jax.typeof(x).sharding
    return layout, tuple(layout.spec) + (None,) * (x.ndim - len(layout.spec))


def _shards(layout, entry) -> int:
    """How many devices split an axis laid out as `entry` of a PartitionSpec."""
    axes = entry if isinstance(entry, tuple) else (entry,) if entry else ()
    return math.prod(layout.mesh.shape[a] for a in axes)


def _labels_like(logits, labels):
    """`labels` on the logits' (batch, seq) layout, and whether the logits' vocab axis is split over devices."""
    layout, spec = _spec(logits)
    if layout.mesh.empty:
        return labels, False
    return jax.sharding.reshard(labels, layout.update(spec=jax.P(*spec[:-1]))), _shards(layout, spec[-1]) > 1


def _vocab_replicated(logits):
    """`logits` with the vocab axis typed unsharded: a no-op on the data when its mesh axes have size 1, and
    what lets `take_along_axis` type its gather in Explicit mode."""
    layout, spec = _spec(logits)
    if layout.mesh.empty:
        return logits
    return jax.sharding.reshard(logits, layout.update(spec=jax.P(*spec[:-1], None)))


def _is_label(logits, labels):
    """Boolean [.., vocab] mask of each position's label, laid out like the logits (each vocab shard compares
    its own slice, so nothing is gathered along vocab)."""
    labels, _ = _labels_like(logits, labels)
    return jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.bool_, out_sharding=jax.typeof(logits).sharding)


def _label_logit(logits, labels):
    labels, vocab_sharded = _labels_like(logits, labels)
    if vocab_sharded:  # a gather along a sharded axis is ambiguous in Explicit mode: a masked sum per shard
        return jnp.sum(jnp.where(_is_label(logits, labels), logits, 0.0), axis=-1)
    # XLA:CPU materialises the masked [b, s, vocab] select before reducing it; a gather reads b*s values.
    return jnp.take_along_axis(_vocab_replicated(logits), labels[..., None], axis=-1)[..., 0]


def _chunks(logits, chunk_tokens: int) -> int:
    """Into how many chunks the positions axis (the one before vocab) splits: the fewest that divide its length on
    each device and leave at most `chunk_tokens` positions per device in a chunk. A length with no such divisor
    near the ideal count (a prime, e.g. a scorer's 8191 = 8192 - 1 positions) is one chunk: a loop of thousands of
    one-position chunks would cost more than the fp32 copy it saves."""
    if logits.ndim < 2:
        return 1
    layout, spec = _spec(logits)
    local = [d if layout.mesh.empty else d // _shards(layout, p) for d, p in zip(logits.shape[:-1], spec[:-1])]
    rows, per_row = local[-1], math.prod(local[:-1])
    n = next((n for n in range(1, rows + 1) if rows % n == 0 and rows // n * per_row <= chunk_tokens), max(rows, 1))
    return n if n <= 4 * math.ceil(rows * per_row / chunk_tokens) else 1


# Chunk k holds positions k, k + n, k + 2n, ... of the axis: splitting it as [s / n, n] keeps its device layout on the
# major part (each device's chunk is its own slice, no collective), and indexing k along the unsharded n reads rows
# whole. Every position is computed alone, so the chunking changes no value.
def _split(x, n: int, axis: int):
    return x.reshape(*x.shape[:axis], x.shape[axis] // n, n, *x.shape[axis + 1:])


def _merge(x, axis: int):
    return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2:])


def _at(x, k, axis: int):
    return jax.lax.dynamic_index_in_dim(x, k, axis, keepdims=False)


def _chunk_fwd(logits, labels):
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - _label_logit(logits, labels), lse


def _chunk_bwd(logits, labels, lse, g_nll, g_lse):
    softmax = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
    return softmax * (g_nll + g_lse)[..., None] - jnp.where(_is_label(logits, labels), g_nll[..., None], 0.0)


# A custom VJP: autodiff of lse - sum(logits * one_hot) keeps a float one-hot [b, s, vocab] as a residual and
# leaves d logits as an elementwise expression that XLA:CPU fuses into each consumer of the lm_head's backward,
# recomputing exp in each, once in the transposed layout the weight gradient's dot reads (a strided pass: a large
# share of a CPU step for no FLOPs, docs/performance.md#cross-entropy-backward). Here the backward is the closed form
#   d logits = softmax * (g_nll + g_lse) - one_hot * g_nll
# computed once (unchunked, an optimization barrier stops XLA from duplicating it into both consumers; a plain
# transposed copy is far cheaper than a transposed exp; chunked, each chunk's only consumer is its write into d
# logits), and the residuals are the logits as given (alive anyway), the labels and the [b, s] lse. Equal to
# autodiff up to float rounding; the lm_head + loss forward and backward take a third less.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _nll_lse(logits, labels, chunks: int):
    return _nll_lse_fwd(logits, labels, chunks)[0]


def _nll_lse_fwd(logits, labels, chunks: int):
    labels, _ = _labels_like(logits, labels)
    if chunks == 1:
        nll, lse = _chunk_fwd(logits, labels)
    else:
        z, y = _split(logits, chunks, logits.ndim - 2), _split(labels, chunks, labels.ndim - 1)

        def chunk(k, out):
            return tuple(jax.lax.dynamic_update_index_in_dim(o, part, k, y.ndim - 1)
                         for o, part in zip(out, _chunk_fwd(_at(z, k, z.ndim - 2), _at(y, k, y.ndim - 1))))
        zeros = jnp.zeros_like(y, jnp.float32)
        nll, lse = (_merge(o, y.ndim - 2) for o in jax.lax.fori_loop(0, chunks, chunk, (zeros, zeros)))
    return (nll, lse), (logits, labels, lse)


def _nll_lse_bwd(chunks: int, res, cotangents):
    logits, labels, lse = res
    g_nll, g_lse = (_laid_out_like(g, lse) for g in cotangents)
    if chunks == 1:
        d_logits = jax.lax.optimization_barrier(_chunk_bwd(logits, labels, lse, g_nll, g_lse))
        return d_logits.astype(logits.dtype), None
    z = _split(logits, chunks, logits.ndim - 2)
    rows = [_split(x, chunks, x.ndim - 1) for x in (labels, lse, g_nll, g_lse)]

    def chunk(k, d_z):
        part = _chunk_bwd(_at(z, k, z.ndim - 2), *(_at(r, k, r.ndim - 1) for r in rows))
        return jax.lax.dynamic_update_index_in_dim(d_z, part.astype(d_z.dtype), k, z.ndim - 2)
    return _merge(jax.lax.fori_loop(0, chunks, chunk, jnp.zeros_like(z)), z.ndim - 3), None


_nll_lse.defvjp(_nll_lse_fwd, _nll_lse_bwd)


def cross_entropy(logits: Float[Array, "b s v"], labels: Int[Array, "b s"],
                  mask: Array) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """Mean token cross-entropy (nats) over `mask`, in fp32; returns (mean, number of tokens)."""
    nll = token_nll(logits, labels)
    mask = _laid_out_like(mask, nll).astype(jnp.float32)
    tokens = mask.sum()
    return jnp.sum(nll * mask) / jnp.maximum(tokens, 1.0), tokens


def sequence_aux_loss(scores: Float[Array, "*l b s e"], mask: Array, k: int) -> Float[Array, "b"]:
    """DeepSeek-V3 sequence-level balance loss per row, summed over layers, unweighted
    (docs/training.md#sequence-level-aux-loss).

    Per row (sequence) and MoE layer, over its T valid tokens:
      f_i = E / (k T) * #{t : i in TopK(s_t)}    top-k of the *unbiased* sigmoid scores (Megatron's
                                                 compute_routing_scores_for_aux_loss), no gradient
      P_i = 1/T * sum_t s_it / sum_j s_jt        scores normalised over all experts
      L   = sum_i f_i P_i                        = 1 when routing is uniform
    The "aux_loss" metric of `loss_fn` is this, averaged over rows (so ~ the number of layers).
    `scores` may carry leading layer axes; rows without valid tokens give 0.
    """
    scores = scores.astype(jnp.float32)
    e = scores.shape[-1]
    layout = jax.typeof(scores).sharding
    if not layout.mesh.empty:  # the mask on the scores' (batch, seq) layout
        mask = jax.sharding.reshard(mask, layout.update(spec=jax.P(*layout.spec[-3:-1])))
    m = jnp.broadcast_to(mask.astype(jnp.float32), scores.shape[:-1])[..., None]
    valid = jnp.maximum(m.sum(-2), 1.0)  # [*l, b, 1]
    _, top = jax.lax.top_k(jax.lax.stop_gradient(scores), k)
    chosen = jnp.sum(jax.nn.one_hot(top, e, dtype=jnp.float32), axis=-2)  # [*l, b, s, e]
    f = e / (k * valid) * jnp.sum(chosen * m, axis=-2)
    p = jnp.sum(scores / jnp.sum(scores, -1, keepdims=True) * m, axis=-2) / valid
    per_layer = jnp.sum(f * p, axis=-1)  # [*l, b]
    return per_layer.reshape(-1, per_layer.shape[-1]).sum(0)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Static loss settings; the token-scheduled MTP weight arrives per step as a traced scalar."""
    mtp: bool = True  # train the MTP layer
    mtp_weight: float = 0.3  # lambda for the first `mtp_boundary_tokens` tokens (GLM-4.5: 15T) ...
    mtp_weight_after: float = 0.1  # ... and after them
    mtp_boundary_tokens: float = 15e12
    aux_weight: float = 1e-4  # sequence balance loss alpha (GLM-4.5 report; Megatron-Bridge uses 1e-3)
    aux_include_mtp: bool = True  # MTP router in the aux loss (unconfirmed: docs/training.md#unconfirmed-details)
    z_weight: float = 0.0  # z-loss on the output logits (PaLM: 1e-4); GLM reports none
    ce_chunk_tokens: int = CHUNK_TOKENS  # positions per device whose logits the cross-entropies upcast at a time

    def __post_init__(self):
        for f in ("mtp_weight", "mtp_weight_after", "aux_weight", "z_weight"):
            check_range("loss", self, f, ge=0, meaning="a loss weight; 0 turns the term off")
        check_range("loss", self, "ce_chunk_tokens", ge=1,
                    meaning="positions per device per cross-entropy chunk")
        check_range("loss", self, "mtp_boundary_tokens", ge=0, meaning="tokens before mtp_weight_after applies")


def mtp_weight_at(cfg: LossConfig, tokens_seen: int) -> float:
    """lambda for a step that starts after `tokens_seen` tokens (host-side: exact Python ints)."""
    if not cfg.mtp:
        return 0.0
    return cfg.mtp_weight if tokens_seen < cfg.mtp_boundary_tokens else cfg.mtp_weight_after


Norms = dict[str, Array]  # "tokens", "mtp_tokens", "sequences": the global batch's counts


def batch_norms(batch: Batch) -> Norms:
    """The normalisers of `batch`: valid next-token targets, valid MTP targets, rows with a target."""
    mask = _mask(batch)
    return {"tokens": mask.sum().astype(jnp.float32),
            "mtp_tokens": _mtp_labels(batch, mask)[1].sum().astype(jnp.float32),
            "sequences": mask.any(-1).sum().astype(jnp.float32)}


def _mtp_labels(batch: Batch, mask: Array) -> tuple[Array, Array]:
    if "mtp_targets" in batch:  # laid out for the context axis: shifted in the original order by the loader
        return batch["mtp_targets"], batch["mtp_mask"].astype(bool)
    return mtp_labels(batch["targets"], mask)


def _mask(batch: Batch) -> Array:
    targets = batch["targets"]
    return batch["loss_mask"].astype(bool) if "loss_mask" in batch else jnp.ones(targets.shape, bool)


def loss_fn(params: nnx.State, buffers: nnx.State, batch: Batch, graphdef: nnx.GraphDef, cfg: ModelConfig,
            loss_cfg: LossConfig = LossConfig(), mtp_weight: float | Array = 0.3,
            norms: Norms | None = None) -> tuple[Float[Array, ""], dict[str, Any]]:
    """The training objective of one (micro-)batch; returns (loss, metrics).

    Metrics: the loss terms (each already divided by `norms`, so they add up over micro-batches),
    "tokens", and router statistics: "expert_load" [moe layers, E] (global top-k counts) and
    "dropped_frac" [moe layers], with the MTP layer's under "mtp_expert_load" / "mtp_dropped_frac".
    `norms` defaults to this batch's own (`batch_norms`). The mask comes from the batch, never
    from `pad_token_id`: GLM's pad id is its eos id (151329), and masking it would stop the model
    from learning where documents end.
    """
    inputs, targets = batch["inputs"], batch["targets"]
    mask = _mask(batch)
    norms = batch_norms(batch) if norms is None else norms
    use_mtp = loss_cfg.mtp and cfg.num_nextn_predict_layers > 0
    out = apply(graphdef, params, buffers, inputs, batch.get("positions"), batch.get("segment_ids"),
                with_mtp=use_mtp, next_tokens=batch.get("mtp_inputs"))

    def masked_sum(x, m):
        return jnp.sum(x * _laid_out_like(m, x).astype(jnp.float32))

    # Named for profiles: the loss terms' ops (and their backward) show up under loss/..., apart
    # from the model's forward.
    with jax.named_scope("loss"):
        nll, lse = nll_and_lse(out.logits, targets, loss_cfg.ce_chunk_tokens)
        ce = masked_sum(nll, mask) / jnp.maximum(norms["tokens"], 1.0)
        loss = ce
        metrics: dict[str, Any] = {"ce": ce, "tokens": mask.sum().astype(jnp.float32)}
        if loss_cfg.z_weight > 0:
            z = masked_sum(jnp.square(lse), mask) / jnp.maximum(norms["tokens"], 1.0)
            loss, metrics["z_loss"] = loss + loss_cfg.z_weight * z, z

        moe = "router_scores" in out.aux
        aux_rows = jnp.zeros(targets.shape[:1], jnp.float32)
        if moe:
            with jax.named_scope("aux_loss"):
                aux_rows += sequence_aux_loss(out.aux["router_scores"], mask, cfg.num_experts_per_tok)
            metrics["expert_load"], metrics["dropped_frac"] = out.aux["expert_load"], out.aux["dropped_frac"]
        if use_mtp:
            with jax.named_scope("mtp_loss"):
                mtp_targets, mtp_mask = _mtp_labels(batch, mask)
                mtp_ce = (masked_sum(token_nll(out.mtp_logits, mtp_targets, loss_cfg.ce_chunk_tokens), mtp_mask)
                          / jnp.maximum(norms["mtp_tokens"], 1.0))
                loss = loss + mtp_weight * mtp_ce
            metrics["mtp_ce"] = mtp_ce
            mtp_aux = out.aux["mtp"]
            if loss_cfg.aux_include_mtp:
                with jax.named_scope("aux_loss"):
                    aux_rows += sequence_aux_loss(mtp_aux["router_scores"], mtp_mask, cfg.num_experts_per_tok)
            metrics["mtp_expert_load"], metrics["mtp_dropped_frac"] = mtp_aux["expert_load"], mtp_aux["dropped_frac"]
        if (moe or (use_mtp and loss_cfg.aux_include_mtp)) and loss_cfg.aux_weight > 0:
            with jax.named_scope("aux_loss"):
                aux = jnp.sum(aux_rows) / jnp.maximum(norms["sequences"], 1.0)
                loss, metrics["aux_loss"] = loss + loss_cfg.aux_weight * aux, aux
    metrics["loss"] = loss
    return loss, metrics

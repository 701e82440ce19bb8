"""Training losses: vocab-parallel cross-entropy, next-token + MTP objective.

The vocab axis of the logits is tensor-sharded. A gather of the label logit
(`take_along_axis`, optax's integer-label CE) is ambiguous under Explicit sharding, so the
label logit is picked with a one-hot laid out like the logits: every shard multiplies its own
slice of the vocabulary and the sum over vocab becomes one small all-reduce.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from glm46_jax.config import ModelConfig
from glm46_jax.model import apply

# A batch is a dict of [b, s] int arrays: "inputs", "targets" and optionally "loss_mask".
Batch = dict[str, Array]


def _laid_out_like(x: Array, ref: Array) -> Array:
    """`x` resharded to `ref`'s layout (a no-op outside a mesh): labels and masks often arrive
    replicated or on another layout than the logits, and Explicit mode does not guess."""
    layout = jax.typeof(ref).sharding
    return x if layout.mesh.empty else jax.sharding.reshard(x, layout)


def token_nll(logits: Float[Array, "b s v"], labels: Int[Array, "b s"]) -> Float[Array, "b s"]:
    """-log softmax(logits)[label] per position, in fp32, without gathering along vocab."""
    logits = logits.astype(jnp.float32)
    layout = jax.typeof(logits).sharding
    if not layout.mesh.empty:
        labels = jax.sharding.reshard(labels, layout.update(spec=jax.P(*layout.spec[:-1])))
    one_hot = jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.float32, out_sharding=layout)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(logits * one_hot, axis=-1)


def cross_entropy(logits: Float[Array, "b s v"], labels: Int[Array, "b s"],
                  mask: Array) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """Mean token cross-entropy (nats) over `mask`, in fp32; returns (mean, number of tokens)."""
    nll = token_nll(logits, labels)
    mask = _laid_out_like(mask, nll).astype(jnp.float32)
    tokens = mask.sum()
    return jnp.sum(nll * mask) / jnp.maximum(tokens, 1.0), tokens


def mtp_labels(targets: Int[Array, "b s"], mask: Array) -> tuple[Int[Array, "b s"], Array]:
    """Labels for the MTP logits: row t predicts the token after targets[t], i.e. targets[t + 1].

    The batch carries targets = inputs shifted by one, so only the last row has no MTP target
    (from the inputs alone it would be the last two). `roll` wraps, so that row is masked out.
    """
    s = targets.shape[1]
    has_target = jnp.arange(s) < s - 1
    return jnp.roll(targets, -1, axis=1), jnp.roll(mask, -1, axis=1) & has_target[None, :]


def loss_fn(params: nnx.State, buffers: nnx.State, batch: Batch, graphdef: nnx.GraphDef, cfg: ModelConfig,
            *, mtp_weight: float = 0.3) -> tuple[Float[Array, ""], dict[str, Array]]:
    """ce(next token) + mtp_weight * ce(token after next); returns (loss, metrics).

    The mask comes from the batch, never from `pad_token_id`: GLM's pad id is its eos id
    (151329), and masking it would stop the model from learning where documents end.
    """
    inputs, targets = batch["inputs"], batch["targets"]
    mask = batch["loss_mask"].astype(bool) if "loss_mask" in batch else jnp.ones(targets.shape, bool)
    use_mtp = mtp_weight > 0 and cfg.num_nextn_predict_layers > 0
    out = apply(graphdef, params, buffers, inputs, with_mtp=use_mtp)
    ce, tokens = cross_entropy(out.logits, targets, mask)
    loss = ce
    metrics = {"ce": ce, "tokens": tokens}
    if use_mtp:
        mtp_ce, _ = cross_entropy(out.mtp_logits, *mtp_labels(targets, mask))
        loss = loss + mtp_weight * mtp_ce
        metrics["mtp_ce"] = mtp_ce
    metrics["loss"] = loss
    return loss, metrics

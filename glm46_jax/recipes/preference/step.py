"""The jitted steps of the preference recipes: a reward model's Bradley-Terry step and DPO's (IPO, SimPO) step, on
packed pair batches (docs/preferences.md#the-batch).

    step = make_pair_step(reward_objective(graphdef, pref), tx, "reward", lr_schedule=schedule)
    step = make_pair_step(dpo_objective(graphdef, pref, Reference("model", plain)), tx, "policy")
    state, metrics = step(state, batch, controls, frozen)      # train_step.TrainState, donated

A batch is `glm46_jax.data.preference_loader`'s: [rows, seq] inputs/targets/positions/segment_ids/loss_mask, pair
slot k of a row holding its chosen reply in segment 2k+1 and its rejected one in 2k+2, and [rows, K] chosen_end,
rejected_end (the position of each reply's last token), pair_mask and margin. Every loss and metric is a sum over
the batch's pairs divided by the whole batch's pair count (`pair_count`), so gradient accumulation gives exactly
the one-batch gradient.

Neither step adds the MoE auxiliary loss or moves the loss-free balancing biases: the biases stay as the starting
model left them, and the reference (DPO) routes with its own router (docs/preferences.md#moe-routing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Float, Int

from glm46_jax.model import apply, lora
from glm46_jax.parallel import sharding
from glm46_jax.recipes.preference import objective
from glm46_jax.recipes.preference.config import PreferenceConfig
from glm46_jax.training.loss import nll_and_lse
from glm46_jax.training.schedule import Schedule
from glm46_jax.training.step import LossFn, make_step, whole_models

Batch = dict[str, Array]


def pair_count(batch: Batch) -> dict[str, Array]:
    """The whole batch's pairs (every micro-batch's loss divides by it)."""
    return {"pairs": jnp.maximum(batch["pair_mask"].astype(jnp.float32).sum(), 1.0)}


def at_positions(values: Float[Array, "b s"], positions: Int[Array, "b k"]) -> Float[Array, "b k"]:
    """values[b, positions[b, k]], as a one-hot contraction (no gather along a possibly sharded axis)."""
    one_hot = jax.nn.one_hot(positions, values.shape[1], dtype=values.dtype)
    return jnp.einsum("bs,bks->bk", values, one_hot, out_sharding=sharding.logical("batch", None))


def reply_logps(logp: Float[Array, "b s"], batch: Batch) -> tuple[Float[Array, "b k"], ...]:
    """(chosen sum, rejected sum, chosen tokens, rejected tokens) [b, K] of the per-target log-probs over each
    reply's trained tokens (loss_mask), by segment: slot k's chosen is segment 2k+1, its rejected 2k+2."""
    k = batch["pair_mask"].shape[-1]
    slots = (batch["segment_ids"][..., None] == jnp.arange(1, 2 * k + 1)).astype(jnp.float32)  # [b, s, 2K]
    mask = batch["loss_mask"].astype(jnp.float32)
    out = sharding.logical("batch", None)  # the sums over a row's positions: explicit, the seq axis may be split
    sums = jnp.einsum("bs,bsj->bj", logp * mask, slots, out_sharding=out)
    counts = jnp.einsum("bs,bsj->bj", mask, slots, out_sharding=out)
    return sums[:, 0::2], sums[:, 1::2], counts[:, 0::2], counts[:, 1::2]


def token_logps(params: nnx.State, buffers: nnx.State, graphdef: nnx.GraphDef, batch: Batch) -> Float[Array, "b s"]:
    """log p(targets[t] | inputs[:t + 1]) per position, fp32, each model with its own router."""
    out = apply(graphdef, params, buffers, batch["inputs"], batch["positions"], batch["segment_ids"], with_mtp=False)
    return -nll_and_lse(out.logits, batch["targets"])[0]  # upcast a chunk at a time inside


def _masked_sums(values: dict[str, Array], mask: Array, pairs: Array) -> dict[str, Array]:
    return {name: jnp.sum(v * mask) / pairs for name, v in values.items()}


def reply_scores(params: nnx.State, buffers: nnx.State, batch: Batch, graphdef: nnx.GraphDef
                 ) -> tuple[Float[Array, "b k"], Float[Array, "b k"]]:
    """(chosen, rejected) [b, K]: the score head read at each reply's last token."""
    out = apply(graphdef, params, buffers, batch["inputs"], batch["positions"], batch["segment_ids"], with_mtp=False,
                with_logits=False)
    scores = out.scores[..., 0]
    return at_positions(scores, batch["chosen_end"]), at_positions(scores, batch["rejected_end"])


def reward_loss(params: nnx.State, buffers: nnx.State, batch: Batch, pairs: Array, graphdef: nnx.GraphDef,
                use_margin: bool, center: float = 0.0) -> tuple[Array, dict[str, Array]]:
    """The Bradley-Terry loss of the score head read at each reply's last token, and its metrics."""
    chosen, rejected = reply_scores(params, buffers, batch, graphdef)
    mask = batch["pair_mask"].astype(jnp.float32)
    margin = batch["margin"].astype(jnp.float32) if use_margin else 0.0
    losses, _ = objective.bradley_terry_loss(chosen, rejected, margin, center=center)
    metrics = _masked_sums({"loss": losses, "chosen": chosen, "rejected": rejected, "margin": chosen - rejected,
                            "accuracy": (chosen > rejected).astype(jnp.float32)}, mask, pairs)
    metrics["pairs"] = mask.sum()
    return metrics["loss"], metrics


@dataclasses.dataclass(frozen=True)
class Reference:
    """Where DPO's reference log-probs come from: `source` = the name of a frozen model among the step's params
    (its graph `graphdef`), or "base": the policy's LoRA base with the adapters off, run through the plain graph
    `graphdef`. SimPO has none (a `Reference` of None)."""
    source: str
    graphdef: nnx.GraphDef | None = None


def dpo_loss(params: dict[str, nnx.State], buffers: dict[str, nnx.State], batch: Batch, pairs: Array,
             graphdef: nnx.GraphDef, pref: PreferenceConfig, reference: Reference | None, name: str = "policy"
             ) -> tuple[Array, dict[str, Array]]:
    """DPO / IPO / SimPO of the policy `params[name]` and its metrics: implicit rewards (chosen, rejected), their
    margin and accuracy, the replies' log-probs, and `len_norm_accuracy` (pairs whose chosen reply has the higher
    mean token log-prob under the policy)."""
    chosen, rejected, n_c, n_r = reply_logps(token_logps(params[name], buffers[name], graphdef, batch), batch)
    mask = batch["pair_mask"].astype(jnp.float32)
    avg_c, avg_r = chosen / jnp.maximum(n_c, 1.0), rejected / jnp.maximum(n_r, 1.0)
    if pref.loss_type == "simpo":
        losses, _ = objective.simpo_loss(avg_c, avg_r, beta=pref.beta, gamma=pref.gamma,
                                         label_smoothing=pref.label_smoothing)
        reward_c, reward_r = pref.beta * avg_c, pref.beta * avg_r
    else:
        ref_c, ref_r = reference_logps(params, buffers, batch, reference, name)
        if pref.loss_type == "ipo":  # IPO on the replies' mean token log-probs, as TRL computes it
            pol_c, pol_r, ref_c, ref_r = avg_c, avg_r, ref_c / jnp.maximum(n_c, 1.0), ref_r / jnp.maximum(n_r, 1.0)
        else:
            pol_c, pol_r = chosen, rejected
        losses, _ = objective.dpo_loss(pol_c, pol_r, ref_c, ref_r, beta=pref.beta, loss_type=pref.loss_type,
                                       label_smoothing=pref.label_smoothing)
        reward_c, reward_r = pref.beta * (pol_c - ref_c), pref.beta * (pol_r - ref_r)
    metrics = _masked_sums({
        "loss": losses, "chosen": reward_c, "rejected": reward_r, "margin": reward_c - reward_r,
        "accuracy": (reward_c > reward_r).astype(jnp.float32), "logp_chosen": chosen, "logp_rejected": rejected,
        "len_norm_accuracy": (avg_c > avg_r).astype(jnp.float32)}, mask, pairs)
    metrics["pairs"] = mask.sum()
    return metrics["loss"], metrics


def reference_logps(params: dict[str, nnx.State], buffers: dict[str, nnx.State], batch: Batch,
                    reference: Reference, name: str) -> tuple[Float[Array, "b k"], Float[Array, "b k"]]:
    """(chosen, rejected) summed reference log-probs [b, K], never differentiated."""
    if reference.source == "base":
        _, base = lora.partition(params[name])
        logp = token_logps(base, buffers[name], reference.graphdef, batch)
    else:
        logp = token_logps(params[reference.source], buffers[reference.source], reference.graphdef, batch)
    chosen, rejected, _, _ = reply_logps(jax.lax.stop_gradient(logp), batch)
    return chosen, rejected


def reward_objective(graphdef: nnx.GraphDef, pref: PreferenceConfig, name: str = "reward") -> LossFn:
    """`reward_loss` as a `training.step.LossFn` of the model `name`."""

    def loss(params, buffers, batch, ctx):
        return reward_loss(params[name], buffers[name], batch, ctx["pairs"], graphdef, pref.use_margin,
                           pref.center_rewards)
    return loss


def dpo_objective(graphdef: nnx.GraphDef, pref: PreferenceConfig, reference: Reference | None,
                  name: str = "policy") -> LossFn:
    """`dpo_loss` as a `training.step.LossFn` of the policy `name` (a frozen reference model comes by its name)."""

    def loss(params, buffers, batch, ctx):
        return dpo_loss(params, buffers, batch, ctx["pairs"], graphdef, pref, reference, name)
    return loss


def make_pair_step(loss: LossFn, tx: optax.GradientTransformation, name: str, *, accum_steps: int = 1,
                   lr_schedule: Schedule | None = None) -> Callable:
    """step(state, batch, controls[, frozen]) -> (state, metrics): `loss` in the one update step, normalised by the
    whole batch's pair count."""
    return make_step(loss, {name: tx}, name, accum_steps=accum_steps, batch_stats=pair_count, lr_schedule=lr_schedule)


def make_reward_scores(graphdef: nnx.GraphDef, name: str = "reward") -> Callable:
    """scores(state, batch[, frozen]) -> (chosen, rejected, pair_mask) [b, K] of the reward model `name`."""

    def scores(state, batch, frozen=None):
        params, buffers = whole_models({name: state.params}, {name: state.buffers}, frozen)
        return (*reply_scores(params[name], buffers[name], batch, graphdef), batch["pair_mask"])

    return jax.jit(scores)


def make_pair_eval(loss: LossFn, name: str) -> Callable:
    """eval(state, batch, controls[, frozen]) -> the loss's metrics on a held-out batch, no gradients."""

    def evaluate(state, batch, ctrl, frozen=None):
        params, buffers = whole_models({name: state.params}, {name: state.buffers}, frozen)
        return loss(params, buffers, batch, pair_count(batch))[1]

    return jax.jit(evaluate)

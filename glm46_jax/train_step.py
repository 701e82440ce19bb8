"""The train state and the pure, jitted training step.

    state = init_state(params, buffers, tx)
    step = make_train_step(graphdef, tx, cfg, StepConfig(accum_steps=4), lr_schedule=schedule)
    state, metrics = step(state, batch, controls)      # state donated

One step: gradients of `loss_fn` summed over `accum_steps` micro-batches (`lax.scan`), the optax
update (skipped when the gradient is not finite: `optax.apply_if_finite` inside
`optim.build_optimizer`), then the loss-free balancing bias step from the global batch's expert
loads. `controls` carries the token-scheduled scalars (`mtp_weight`, `bias_rate`) and the loss-spike
threshold (`max_loss`), chosen by the host, which counts tokens exactly in Python ints (float32 or
int32 on the device could not at 15T tokens).

Everything the step touches is a pytree (nnx.State, optax state); the NNX module only exists
inside `loss_fn`, rebuilt from the graphdef on every trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jaxtyping import Array, Int

from glm46_jax import balancing
from glm46_jax.config import ModelConfig
from glm46_jax.loss import Batch, LossConfig, batch_norms, loss_fn
from glm46_jax.model import pipeline

Controls = dict[str, Array]  # "mtp_weight", "bias_rate": float32 scalars chosen by the host per step


@struct.dataclass
class TrainState:
    step: Int[Array, ""]  # steps attempted (skipped non-finite steps included)
    params: nnx.State  # nnx.Param leaves: differentiated and optimised
    buffers: nnx.State  # e_score_correction_bias per MoE layer: moved only by loss-free balancing
    opt_state: optax.OptState


@dataclasses.dataclass(frozen=True)
class StepConfig:
    loss: LossConfig = LossConfig()
    balance_mtp: bool = True  # the MTP router's bias takes part in loss-free balancing
    accum_steps: int = 1  # micro-batches per step; the batch then has a leading [accum_steps] axis


def controls(mtp_weight: float, bias_rate: float, max_loss: float = float("inf")) -> Controls:
    """`max_loss`: a step whose loss exceeds it is a loss spike and is skipped like a non-finite one."""
    return {"mtp_weight": jnp.float32(mtp_weight), "bias_rate": jnp.float32(bias_rate),
            "max_loss": jnp.float32(max_loss)}


def init_state(params: nnx.State, buffers: nnx.State, tx: optax.GradientTransformation) -> TrainState:
    """Optimizer state created under jit with each moment sharded like its parameter.

    Call inside `sharding.use_mesh(mesh)`. Explicit-mode shardings propagate through `tx.init`
    (zeros_like), so the moments inherit the parameter layouts without out_shardings.
    """

    @jax.jit
    def init(params):
        return tx.init(params)

    return TrainState(step=jnp.zeros((), jnp.int32), params=params, buffers=buffers, opt_state=init(params))


def _finite_state(opt_state) -> optax.ApplyIfFiniteState | None:
    return opt_state if isinstance(opt_state, optax.ApplyIfFiniteState) else None


class Bound:
    """`fn(state, batch, controls, frozen)` called as `fn(state, batch, controls)`, with `.lower(...).compile()`
    (what the trainer compiles ahead of time) still working: the frozen weights are a jit argument, neither
    closed over (they would be baked into the program as constants) nor donated."""

    def __init__(self, fn: Callable, frozen: nnx.State):
        self.fn, self.frozen = fn, frozen

    def __call__(self, state, *rest):
        return self.fn(state, *rest, self.frozen)

    def lower(self, state, *rest) -> Bound:
        return Bound(self.fn.lower(state, *rest, self.frozen), self.frozen)

    def compile(self) -> Bound:
        return Bound(self.fn.compile(), self.frozen)


def with_frozen(params: nnx.State, frozen: nnx.State | None) -> nnx.State:
    """The model's whole parameter state: the trained leaves and, when some are frozen, those too."""
    return params if frozen is None else nnx.merge_state(params, frozen)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, cfg: ModelConfig,
                    step_cfg: StepConfig = StepConfig(), *,
                    lr_schedule: optax.Schedule | None = None, frozen: nnx.State | None = None
                    ) -> Callable[[TrainState, Batch, Controls], tuple[TrainState, dict]]:
    """step(state, batch, controls) -> (state, metrics), jitted once with the state donated.

    Trace and call it inside `sharding.use_mesh(mesh)`. With accum_steps = A > 1 every batch
    array is [A, b, s]; the loss terms are normalised by the whole batch's token / sequence
    counts, so the summed gradient equals one [A*b, s] batch's. Metrics are scalars.

    `frozen`: parameters of the model that are not trained (a LoRA run's base weights). The state's
    params are then only the trained leaves (gradients, optimizer state and checkpoints cover just them),
    and the returned step is `Bound` to the frozen weights.
    """
    grad_fn = jax.value_and_grad(lambda p, fz, *a: loss_fn(with_frozen(p, fz), *a), has_aux=True)
    accum = step_cfg.accum_steps
    if accum < 1:
        raise ValueError(f"accum_steps={accum}: must be >= 1")

    def grads_and_metrics(params, frozen, buffers, batch, mtp_weight):
        norms = batch_norms(batch)  # of the whole batch, all micro-batches
        run = lambda mb: grad_fn(params, frozen, buffers, mb, graphdef, cfg, step_cfg.loss, mtp_weight, norms)
        if accum == 1:
            (_, metrics), grads = run(batch)
            return grads, metrics

        def body(total, micro_batch):
            (_, metrics), grads = run(micro_batch)
            return jax.tree.map(jnp.add, total, (grads, metrics)), None

        first = jax.tree.map(lambda x: x[0], batch)
        shapes = jax.eval_shape(run, first)
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, out_sharding=x.sharding), (shapes[1], shapes[0][1]))
        (grads, metrics), _ = jax.lax.scan(body, zeros, batch)
        for key in ("dropped_frac", "mtp_dropped_frac"):  # fractions average, everything else adds up
            if key in metrics:
                metrics[key] = metrics[key] / accum
        return grads, metrics

    def step(state: TrainState, batch: Batch, ctrl: Controls, frozen: nnx.State | None = None
             ) -> tuple[TrainState, dict[str, Any]]:
        grads, metrics = grads_and_metrics(state.params, frozen, state.buffers, batch, ctrl["mtp_weight"])
        # A loss spike poisons the gradient, so `apply_if_finite` skips and counts it like a NaN. A NaN/Inf
        # loss is one too: its gradient may still be finite (e.g. a non-finite term cut off by stop_gradient).
        spike = (metrics["loss"] > ctrl.get("max_loss", jnp.inf)) | ~jnp.isfinite(metrics["loss"])
        grad_norm = optax.tree.norm(grads)
        grads = jax.tree.map(lambda g: jnp.where(spike, jnp.nan, g), grads)
        before = _finite_state(state.opt_state)
        with jax.named_scope("optimizer"):  # clip, Muon/AdamW, the non-finite skip and the apply, in profiles
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        after = _finite_state(opt_state)
        applied = after.notfinite_count == 0 if after is not None else jnp.bool_(True)

        # Balancing uses this step's loads; a skipped step moves nothing.
        rate = jnp.where(applied, ctrl["bias_rate"], 0.0)
        loads = {**metrics, "expert_load": pipeline.in_stored_order(metrics["expert_load"], cfg)} \
            if "expert_load" in metrics else metrics
        buffers = balancing.update_buffers(state.buffers, loads, rate, include_mtp=step_cfg.balance_mtp)

        n_params = sum(x.size for x in jax.tree.leaves(params))
        out = {k: v for k, v in metrics.items() if jnp.ndim(v) == 0}
        out.update(balancing.describe_loads(metrics))
        bias_stats = balancing.bias_stats(pipeline.layer_ordered(buffers, cfg))  # identity slots left out
        out.update({f"bias_{k}": v for k, v in bias_stats.items()})
        out.update(ppl=jnp.exp(metrics["ce"]), grad_norm=grad_norm, spike=spike.astype(jnp.int32),
                   update_rms=optax.tree.norm(updates) / jnp.sqrt(n_params),
                   mtp_weight=ctrl["mtp_weight"], bias_rate=rate)
        if after is not None:
            out.update(skipped=1 - applied.astype(jnp.int32), nonfinite_in_a_row=after.notfinite_count,
                       nonfinite_total=after.total_notfinite)
        if lr_schedule is not None:  # the lr of this update: optax counts applied updates only
            applied_before = state.step - (before.total_notfinite if before is not None else 0)
            out["lr"] = jnp.asarray(lr_schedule(applied_before), jnp.float32)
        new_state = state.replace(step=state.step + 1, params=params, buffers=buffers, opt_state=opt_state)
        return new_state, out

    jitted = jax.jit(step, donate_argnums=(0,))
    return jitted if frozen is None else Bound(jitted, frozen)


def make_eval_step(graphdef: nnx.GraphDef, cfg: ModelConfig, loss_cfg: LossConfig = LossConfig(), *,
                   frozen: nnx.State | None = None) -> Callable[[TrainState, Batch, Controls], dict[str, Array]]:
    """eval(state, batch, controls) -> loss metrics and perplexity, no gradients (inside `use_mesh`);
    `frozen` as in `make_train_step`."""

    def evaluate(state: TrainState, batch: Batch, ctrl: Controls, frozen: nnx.State | None = None
                 ) -> dict[str, Array]:
        metrics = loss_fn(with_frozen(state.params, frozen), state.buffers, batch, graphdef, cfg, loss_cfg,
                          ctrl["mtp_weight"])[1]
        out = {k: v for k, v in metrics.items() if jnp.ndim(v) == 0}
        return {**out, "ppl": jnp.exp(metrics["ce"])}

    jitted = jax.jit(evaluate)
    return jitted if frozen is None else Bound(jitted, frozen)

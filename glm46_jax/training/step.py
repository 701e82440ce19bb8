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
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jaxtyping import Array, Int

from glm46_jax.config import ModelConfig
from glm46_jax.model import pipeline
from glm46_jax.training import balancing, offload, streamed
from glm46_jax.training.loss import Batch, LossConfig, batch_norms, loss_fn
from glm46_jax.training.schedule import Schedule

# "mtp_weight", "bias_rate", "max_loss": float32 scalars chosen by the host per step; "lr": each trained model's
# schedule numbers by name (`Schedule.inputs()`), optional
Controls = dict[str, Any]


@struct.dataclass
class ModelState:
    """One trained model: its weights and its own optimizer's state."""
    params: nnx.State  # nnx.Param leaves: differentiated and optimised
    buffers: nnx.State  # e_score_correction_bias per MoE layer: moved only by loss-free balancing
    opt_state: optax.OptState


@struct.dataclass
class TrainState:
    """The recipe's trained models: the first one's fields inline (what every single-model run and every
    checkpoint written before multi-model runs has), further ones by name in `others` (e.g. PPO's critic)."""
    step: Int[Array, ""]  # steps attempted (skipped non-finite steps included)
    params: nnx.State
    buffers: nnx.State
    opt_state: optax.OptState
    others: dict[str, ModelState] = struct.field(default_factory=dict)

    def models(self, main: str) -> dict[str, ModelState]:
        """Every trained model by name, the first one named `main`."""
        return {main: ModelState(self.params, self.buffers, self.opt_state), **self.others}

    def with_models(self, main: str, models: Mapping[str, ModelState]) -> TrainState:
        first = models[main]
        return self.replace(params=first.params, buffers=first.buffers, opt_state=first.opt_state,
                            others={k: v for k, v in models.items() if k != main})


@struct.dataclass
class FrozenModel:
    """Weights a step reads but does not train (a jit argument: neither baked into the program nor donated).
    For a trained model: its frozen part (a LoRA run's base weights), `buffers` None. For a model that is not
    trained at all (a frozen reference): all of its weights."""
    params: nnx.State
    buffers: nnx.State | None = None


Frozen = Mapping[str, FrozenModel] | None  # by model name
# loss(params, buffers, batch, context) -> (loss, metrics): params / buffers by model name, each model's whole
# weights (trained and frozen parts together); context = the controls and the whole batch's `batch_stats`.
LossFn = Callable[[dict[str, nnx.State], dict[str, nnx.State], Batch, dict[str, Array]], tuple[Array, dict]]


@dataclasses.dataclass(frozen=True)
class StepConfig:
    loss: LossConfig = LossConfig()
    balance_mtp: bool = True  # the MTP router's bias takes part in loss-free balancing
    accum_steps: int = 1  # micro-batches per step; the batch then has a leading [accum_steps] axis


def controls(mtp_weight: float, bias_rate: float, max_loss: float = float("inf")) -> Controls:
    """`max_loss`: a step whose loss exceeds it is a loss spike and is skipped like a non-finite one."""
    return {"mtp_weight": jnp.float32(mtp_weight), "bias_rate": jnp.float32(bias_rate),
            "max_loss": jnp.float32(max_loss)}


def init_opt_state(params: nnx.State, tx: optax.GradientTransformation) -> optax.OptState:
    """`tx`'s state created under jit with each moment sharded like its parameter.

    Call inside `sharding.use_mesh(mesh)`. Explicit-mode shardings propagate through `tx.init`
    (zeros_like), so the moments inherit the parameter layouts without out_shardings.
    """
    return jax.jit(tx.init)(params)


def init_state(params: nnx.State, buffers: nnx.State, tx: optax.GradientTransformation) -> TrainState:
    """A one-model train state (inside `sharding.use_mesh(mesh)`)."""
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, buffers=buffers,
                      opt_state=init_opt_state(params, tx))


def _finite_state(opt_state) -> optax.ApplyIfFiniteState | None:
    return opt_state if isinstance(opt_state, optax.ApplyIfFiniteState) else None


def _norm(updates: Any, squares: list[Array]) -> Array:
    """The global norm of every model's updates: `updates`' whole trees and the streamed models' summed squares."""
    if not squares:
        return optax.tree.norm(updates)
    return jnp.sqrt(jnp.square(optax.tree.norm(updates)) + sum(squares))


def with_frozen(params: nnx.State, frozen: nnx.State | None) -> nnx.State:
    """The model's whole parameter state: the trained leaves and, when some are frozen, those too."""
    return params if frozen is None else nnx.merge_state(params, frozen)


def whole_models(params: Mapping[str, nnx.State], buffers: Mapping[str, nnx.State], frozen: Frozen
                 ) -> tuple[dict[str, nnx.State], dict[str, nnx.State]]:
    """(params, buffers) of every model by name: the trained ones with their frozen parts, then the frozen ones."""
    frozen = frozen or {}
    whole_p = {n: with_frozen(p, frozen[n].params if n in frozen else None) for n, p in params.items()}
    whole_b = dict(buffers)
    for n, f in frozen.items():
        if n not in params:
            whole_p[n], whole_b[n] = f.params, f.buffers
    return whole_p, whole_b


def make_step(loss: LossFn, txs: Mapping[str, optax.GradientTransformation], main: str, *, accum_steps: int = 1,
              batch_stats: Callable[[Batch], dict[str, Array]] | None = None,
              after_update: Callable | None = None, lr_schedule: Schedule | None = None,
              compute_dtypes: Mapping[str, Any] | None = None) -> Callable:
    """The one update step every recipe's loss plugs into: step(state, batch, controls, frozen) -> (state, metrics),
    jitted with the state donated; trace and call it inside `sharding.use_mesh(mesh)`. State leaves that arrive in
    host memory (`offload.place`) are computed with on the device and returned to host memory; host-resident
    weights come to the forward as `offload.compute_copy` in the model's `compute_dtypes[name]` (absent: as stored).

    Gradients of `loss` w.r.t. every trained model (`txs`: each model's own optimizer; `main` is the state's first
    model) summed over `accum_steps` micro-batches (`lax.scan`; every batch array is then [A, b, ...] and the loss
    normalises by `batch_stats` of the whole batch, so the summed gradient equals one [A*b, ...] batch's). Then the
    update tail: a loss spike (loss > controls["max_loss"]) or a non-finite loss poisons the gradients, so each
    optimizer's `apply_if_finite` skips the update and counts it; the lr metric counts applied updates only.
    `after_update(buffers, metrics, controls, applied) -> (buffers, extra metrics)` moves the main model's buffers
    (loss-free balancing); without it they stay. Metrics are the loss's scalars plus the tail's.
    """
    if accum_steps < 1:
        raise ValueError(f"accum_steps={accum_steps}: must be >= 1")
    compute_dtypes = dict(compute_dtypes or {})
    streams = {n for n, tx in txs.items() if isinstance(tx, streamed.LayerStreamed)}
    grad_fn = jax.value_and_grad(lambda p, fz, b, mb, ctx: loss(*whole_models(p, b, fz), mb, ctx), has_aux=True)

    def grads_and_metrics(params, frozen, buffers, batch, ctx):
        run = lambda mb: grad_fn(params, frozen, buffers, mb, ctx)  # noqa: E731
        if accum_steps == 1:
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
                metrics[key] = metrics[key] / accum_steps
        return grads, metrics

    def step(state: TrainState, batch: Batch, ctrl: Controls, frozen: Frozen = None
             ) -> tuple[TrainState, dict[str, Any]]:
        stored = {n: m.params for n, m in state.models(main).items()}  # the masters, where they live between steps
        # On the device: the optimizer state, and the weights as the forward reads them (training/offload.py)
        # streamed: the update reads the state where it is stored, a layer at a time (training/streamed.py)
        models = {n: ModelState(offload.compute_copy(m.params, compute_dtypes.get(n)), m.buffers,
                                m.opt_state if n in streams else offload.fetch(m.opt_state))
                  for n, m in state.models(main).items()}
        params = {n: m.params for n, m in models.items()}
        buffers = {n: m.buffers for n, m in models.items()}
        ctx = {**ctrl, **(batch_stats(batch) if batch_stats is not None else {})}  # of the whole batch
        raw, metrics = grads_and_metrics(params, frozen, buffers, batch, ctx)
        grads = {n: offload.like_masters(g, stored[n]) for n, g in raw.items()}
        # A loss spike poisons the gradient, so `apply_if_finite` skips and counts it like a NaN. A NaN/Inf
        # loss is one too: its gradient may still be finite (e.g. a non-finite term cut off by stop_gradient).
        spike = (metrics["loss"] > ctrl.get("max_loss", jnp.inf)) | ~jnp.isfinite(metrics["loss"])
        grad_norm = optax.tree.norm(grads)
        grads = jax.tree.map(lambda g: jnp.where(spike, jnp.nan, g), grads)
        before = _finite_state(state.models(main)[main].opt_state)  # where it is stored: only its count is read
        lr_inputs = ctrl.get("lr", {})
        new, all_updates, update_squares = {}, {}, []
        with jax.named_scope("optimizer"):  # clip, Muon/AdamW, the non-finite skip and the apply, in profiles
            for name, m in models.items():
                # The lr schedule's numbers, when the controls carry them (the recipes' do), are inputs of the
                # program, not constants in it (training/schedule.py).
                extra = {"lr_inputs": lr_inputs[name]} if name in lr_inputs else {}
                if name in streams:
                    p, opt_state, sq = streamed.apply(txs[name], raw[name], spike, m.opt_state, stored[name], extra)
                    new[name] = ModelState(p, m.buffers, opt_state)
                    update_squares.append(sq)
                    continue
                tx = optax.with_extra_args_support(txs[name])
                master = offload.masters(m.params, stored[name])
                updates, opt_state = tx.update(grads[name], m.opt_state, master, **extra)
                new[name] = ModelState(optax.apply_updates(master, updates), m.buffers, opt_state)
                all_updates[name] = updates
        after = _finite_state(new[main].opt_state)
        applied = after.notfinite_count == 0 if after is not None else jnp.bool_(True)

        out = {k: v for k, v in metrics.items() if jnp.ndim(v) == 0}
        if after_update is not None:  # a skipped step moves nothing
            buffers, extra = after_update(new[main].buffers, metrics, ctrl, applied)
            new[main] = new[main].replace(buffers=buffers)
            out.update(extra)
        n_params = sum(x.size for m in new.values() for x in jax.tree.leaves(m.params))
        out.update(grad_norm=grad_norm, spike=spike.astype(jnp.int32),
                   update_rms=_norm(all_updates, update_squares) / jnp.sqrt(n_params))
        if after is not None:
            out.update(skipped=1 - applied.astype(jnp.int32), nonfinite_in_a_row=after.notfinite_count,
                       nonfinite_total=after.total_notfinite)
        else:
            out["nonfinite_in_a_row"] = jnp.int32(0)  # the trainer reads it every step
        if lr_schedule is not None:  # the lr of this update: optax counts applied updates only
            applied_before = state.step - (offload.fetch(before.total_notfinite) if before is not None else 0)
            out["lr"] = jnp.asarray(lr_schedule.at(applied_before, lr_inputs.get(main)), jnp.float32)
        new_state = state.with_models(main, new).replace(step=state.step + 1)
        return offload.store_like(new_state, state), out  # host-offloaded leaves go back to host memory

    return jax.jit(step, donate_argnums=(0,))


# The language-model steps are cached per (graphdef, optimizer, configs): the optimizer of one OptimConfig is one
# object per process (training/optim.py), so a second run in a process (a resume, the next seed, a notebook's
# next call) gets the jitted function it already traced and compiled for the same shapes and mesh.
@functools.cache
def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, cfg: ModelConfig,
                    step_cfg: StepConfig = StepConfig(), *, lr_schedule: Schedule | None = None,
                    name: str = "model") -> Callable[[TrainState, Batch, Controls, Frozen], tuple[TrainState, dict]]:
    """The language-model step (pre-training, mid-training, SFT): `loss.loss_fn` (CE, MTP, aux) in `make_step`,
    then the loss-free balancing bias step from the global batch's expert loads.

    Called as step(state, batch, controls) or, with frozen weights (a LoRA run's base), step(state, batch,
    controls, {name: FrozenModel(base)}): the state's params are then only the trained leaves (gradients, the
    optimizer state and the checkpoints cover just them). Metrics are scalars.
    """

    def lm_loss(params, buffers, batch, ctx):
        return loss_fn(params[name], buffers[name], batch, graphdef, cfg, step_cfg.loss, ctx["mtp_weight"],
                       {k: ctx[k] for k in _NORMS})

    def balance(buffers, metrics, ctrl, applied):
        # Balancing uses this step's loads; a skipped step moves nothing.
        rate = jnp.where(applied, ctrl["bias_rate"], 0.0)
        loads = {**metrics, "expert_load": pipeline.in_slot_order(metrics["expert_load"], cfg)} \
            if "expert_load" in metrics else metrics
        buffers = balancing.update_buffers(buffers, loads, rate, include_mtp=step_cfg.balance_mtp)
        extra = dict(balancing.describe_loads(metrics))
        bias_stats = balancing.bias_stats(pipeline.in_layer_order(buffers, cfg))  # identity slots left out
        extra.update({f"bias_{k}": v for k, v in bias_stats.items()})
        extra.update(ppl=jnp.exp(metrics["ce"]), mtp_weight=ctrl["mtp_weight"], bias_rate=rate)
        return buffers, extra

    return make_step(lm_loss, {name: tx}, name, accum_steps=step_cfg.accum_steps, batch_stats=batch_norms,
                     after_update=balance, lr_schedule=lr_schedule, compute_dtypes={name: jnp.dtype(cfg.dtype)})


_NORMS = ("tokens", "mtp_tokens", "sequences")  # batch_norms' keys


@functools.cache
def make_eval_step(graphdef: nnx.GraphDef, cfg: ModelConfig, loss_cfg: LossConfig = LossConfig(), *,
                   name: str = "model") -> Callable[[TrainState, Batch, Controls, Frozen], dict[str, Array]]:
    """eval(state, batch, controls[, frozen]) -> loss metrics and perplexity, no gradients (inside `use_mesh`);
    `frozen` as in `make_train_step`."""

    def evaluate(state: TrainState, batch: Batch, ctrl: Controls, frozen: Frozen = None) -> dict[str, Array]:
        weights = offload.compute_copy(state.params, jnp.dtype(cfg.dtype))  # host-resident masters: their copy
        params, buffers = whole_models({name: weights}, {name: state.buffers}, frozen)
        metrics = loss_fn(params[name], buffers[name], batch, graphdef, cfg, loss_cfg, ctrl["mtp_weight"])[1]
        out = {k: v for k, v in metrics.items() if jnp.ndim(v) == 0}
        return {**out, "ppl": jnp.exp(metrics["ce"])}

    return jax.jit(evaluate)

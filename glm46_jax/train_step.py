"""The train state and the pure, jitted training step.

    state = init_state(params, buffers, tx)
    step = make_train_step(graphdef, tx, cfg, lr_schedule=schedule)
    state, metrics = step(state, batch)            # params/opt_state donated

Everything the step touches is a pytree (nnx.State, optax state); the NNX module only exists
inside `loss_fn`, rebuilt from the graphdef on every trace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jaxtyping import Array, Int

from glm46_jax.config import ModelConfig
from glm46_jax.loss import Batch, loss_fn


@struct.dataclass
class TrainState:
    step: Int[Array, ""]
    params: nnx.State  # nnx.Param leaves: differentiated and optimised
    buffers: nnx.State  # e_score_correction_bias: carried along, not trained (balancing comes later)
    opt_state: optax.OptState


def init_state(params: nnx.State, buffers: nnx.State, tx: optax.GradientTransformation) -> TrainState:
    """Optimizer state created under jit with each moment sharded like its parameter.

    Call inside `sharding.use_mesh(mesh)`. Explicit-mode shardings propagate through `tx.init`
    (zeros_like), so the moments inherit the parameter layouts without out_shardings.
    """

    @jax.jit
    def init(params):
        return tx.init(params)

    return TrainState(step=jnp.zeros((), jnp.int32), params=params, buffers=buffers, opt_state=init(params))


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, cfg: ModelConfig, *,
                    mtp_weight: float = 0.3,
                    lr_schedule: optax.Schedule | None = None) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """step(state, batch) -> (state, metrics), jitted once with the state donated.

    Trace and call it inside `sharding.use_mesh(mesh)`. Metrics are scalars: loss, ce, mtp_ce,
    tokens, grad_norm (before clipping), update_norm and lr.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        (_, metrics), grads = grad_fn(state.params, state.buffers, batch, graphdef, cfg, mtp_weight=mtp_weight)
        # Muon's X @ X.T runs under auto_axes inside tx (optim.sharded_update, STYLE B2); every
        # moment keeps its parameter's layout.
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**metrics, "grad_norm": optax.tree.norm(grads), "update_norm": optax.tree.norm(updates)}
        if lr_schedule is not None:
            metrics["lr"] = jnp.asarray(lr_schedule(state.step), jnp.float32)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return jax.jit(step, donate_argnums=(0,))


def make_eval_step(graphdef: nnx.GraphDef, cfg: ModelConfig, *,
                   mtp_weight: float = 0.3) -> Callable[[TrainState, Batch], dict[str, Array]]:
    """eval(state, batch) -> the loss metrics, no gradients (call inside `sharding.use_mesh`)."""

    def evaluate(state: TrainState, batch: Batch) -> dict[str, Array]:
        return loss_fn(state.params, state.buffers, batch, graphdef, cfg, mtp_weight=mtp_weight)[1]

    return jax.jit(evaluate)

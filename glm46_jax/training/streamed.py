"""The optimizer update streamed one layer at a time, for a state offloaded to host memory
(docs/training.md#host-offload).

    tx = build_optimizer(OptimConfig(offload="optimizer"), params)[0]   # a LayerStreamed
    params, opt_state, sq = streamed.apply(tx, grads, spike, opt_state, params, extra)   # inside the jitted step

The whole-tree update (`tx.update`) brings every leaf's state and master weights to the device, and a leaf of a layer
stack holds every layer (GLM-4.5-Air's routed-expert gate stack is a third of the model: the plan's numbers are in
docs/training.md#host-offload). `apply` runs the same update in pieces: the leaves outside the layer stacks in one
call, then each stack one layer at a time in a `lax.fori_loop` whose carry is the stored (host) state and masters:
a layer's slice is copied to the device, updated, and written back. So the device holds one layer's update at a time.

Every number is the whole-tree update's: the non-finite skip (`optax.apply_if_finite`) and the global-norm clip are
decided on the whole gradient before any piece runs, the pieces see the same scalar state (step counts), and the
transforms that care where a slice sits (layer-wise lr decay) get its place as the `layer_slice` extra argument
(training/optim.py). A stack whose layer axis is sharded (the pipeline's MoE stack) is updated whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from glm46_jax.model.paths import LAYER_STACKS, path_names
from glm46_jax.training import offload


class LayerStreamed(NamedTuple):
    """A built optimizer (optim.build_optimizer with optim.offload set) whose update the train step streams.

    `init` and `update` are the whole-tree optimizer's (optax's interface; checkpoints see the same state).
    `inner` is that optimizer without its global-norm clip and non-finite skip, which `apply` does itself."""
    init: Callable
    update: Callable
    inner: optax.GradientTransformationExtraArgs
    clip: float
    sharded: bool  # run `inner` under auto_axes, as optim.sharded_update
    max_consecutive_errors: int | None  # optax.apply_if_finite's; None: no skip (the state is the chain's)


def _masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def _stack_of(names: list[str]) -> str | None:
    return next((n for n in names if n in LAYER_STACKS), None)


def _layer_axis_sharded(x: jax.Array) -> bool:
    spec = getattr(jax.typeof(x).sharding, "spec", None)
    return bool(spec) and spec[0] is not None


class _Leaves:
    """One tree flattened (MaskedNodes kept as leaves), each leaf with the layer stack it belongs to (None: none)
    and whether it is a parameter's (its path ends in a parameter's path) or a scalar of the state (a step count)."""

    def __init__(self, tree: Any, param_paths: set[tuple[str, ...]] | None = None):
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_masked)
        self.leaves = [x for _, x in flat]
        self.names = [tuple(path_names(p)) for p, _ in flat]
        self.stack = [_stack_of(list(n)) for n in self.names]
        self.per_param = [param_paths is None or any(n[k:] in param_paths for k in range(len(n)))
                          for n in self.names]

    def tree(self, leaves: list) -> Any:
        return self.treedef.unflatten(leaves)

    def flat(self, tree: Any) -> list:
        return jax.tree_util.tree_flatten(tree, is_leaf=_masked)[0]


def apply(tx: LayerStreamed, grads: Any, spike: jax.Array, state: Any, stored: Any, extra: dict[str, Any]
          ) -> tuple[Any, Any, jax.Array]:
    """Inside jit: (new params, new optimizer state, sum of the squared updates) for one model, equal to
    `apply_updates(masters, tx.update(poisoned grads, state, masters))`.

    grads: the gradients as the forward made them (a host-mastered leaf's in the compute dtype; each piece is cast
    to its master's dtype); spike: poison them (NaN) so the update is skipped and counted, as the step does for a
    loss spike; state and stored: the optimizer state and the master weights where they live between steps (host or
    device); the results live there too. extra: the update's extra arguments (the schedule's `lr_inputs`)."""
    weights = _Leaves(stored)
    grad_leaves = weights.flat(grads)
    dtypes = [p.dtype for p in weights.leaves]

    def prepared(g, dtype):  # the step's cast to the master's dtype and its spike poison, as one expression
        g = g if g.dtype == dtype else g.astype(dtype)
        return jnp.where(spike, jnp.nan, g)

    # read by reductions only: fused, not stored
    whole = [prepared(g, d) for g, d in zip(grad_leaves, dtypes, strict=True)]
    finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in whole]))
    g_norm = optax.tree.norm(whole)
    clipped = lambda t: jax.lax.select(jnp.squeeze(g_norm < tx.clip), t, (t / g_norm.astype(t.dtype)) * tx.clip)

    skip = tx.max_consecutive_errors is not None
    chain_state = state.inner_state if skip else state
    clip_state, inner_state = chain_state
    if skip:
        count = jnp.where(finite, jnp.zeros([], jnp.int32), optax.safe_increment(state.notfinite_count))
        ok = jnp.logical_or(finite, count > tx.max_consecutive_errors)
    else:
        ok = jnp.bool_(True)
    opt = _Leaves(inner_state, set(weights.names))

    streamed = {s for s in LAYER_STACKS
                if any(st == s for st in weights.stack) and
                not any(_layer_axis_sharded(x) for x, st in zip(weights.leaves, weights.stack, strict=True) if st == s)}
    sizes = {s: next(x.shape[0] for x, st in zip(weights.leaves, weights.stack, strict=True) if st == s)
             for s in LAYER_STACKS if s in weights.stack}

    def update(g_tree, s_tree, p_tree, stack=None, start=None):
        """inner.update on one piece under the non-finite skip; a slice of `stack` from layer `start` (traced)."""
        where = {"sizes": sizes} if stack is None else {"sizes": sizes, "stack": stack}  # layer_slice's static part

        def inner(g, s, p, start, extra):
            return tx.inner.update(g, s, p, **extra, layer_slice=where if start is None else {**where, "start": start})

        def do(_):
            if not tx.sharded or jax.sharding.get_abstract_mesh().empty:
                return inner(g_tree, s_tree, p_tree, start, extra)
            shardings = lambda t: jax.tree.map(lambda x: jax.typeof(x).sharding, t)
            run = jax.sharding.auto_axes(inner, out_sharding=(shardings(g_tree), shardings(s_tree)))
            return run(g_tree, s_tree, p_tree, start, extra)

        return jax.lax.cond(ok, do, lambda _: (optax.tree.zeros_like(g_tree), s_tree), None)

    def squares(u_leaves):
        return sum((jnp.sum(jnp.square(u)) for u in u_leaves if not _masked(u)), jnp.float32(0))

    # The leaves outside the streamed stacks, in one call.
    p_rest = [offload.fetch(x) if st not in streamed else optax.MaskedNode()
              for x, st in zip(weights.leaves, weights.stack, strict=True)]
    g_rest = [clipped(prepared(g, d)) if st not in streamed else optax.MaskedNode()
              for g, d, st in zip(grad_leaves, dtypes, weights.stack, strict=True)]
    s_rest = [x if _masked(x) else offload.fetch(x) if st not in streamed else optax.MaskedNode()
              for x, st in zip(opt.leaves, opt.stack, strict=True)]
    u, new_inner = update(weights.tree(g_rest), opt.tree(s_rest), weights.tree(p_rest))
    u = weights.flat(u)
    new_p = [x if _masked(du) else optax.apply_updates(x, du) for x, du in zip(p_rest, u, strict=True)]
    new_s = opt.flat(new_inner)
    sq = squares(u)

    for s in sorted(streamed):
        p_idx = [k for k, st in enumerate(weights.stack) if st == s]
        s_idx = [k for k, st in enumerate(opt.stack) if st == s and not _masked(opt.leaves[k])]

        def body(i, carry, s=s, p_idx=p_idx, s_idx=s_idx):
            params, states, sq = carry
            take = lambda x: offload.fetch(jax.lax.dynamic_slice_in_dim(x, i, 1, 0))
            g = [optax.MaskedNode()] * len(weights.leaves)
            p = [optax.MaskedNode()] * len(weights.leaves)
            for k, x in zip(p_idx, params, strict=True):
                g[k] = clipped(prepared(jax.lax.dynamic_slice_in_dim(grad_leaves[k], i, 1, 0), dtypes[k]))
                p[k] = take(x)
            # the state's scalars (step counts) as they came in; every other stack's leaves masked out
            piece_state = [x if _masked(x) else optax.MaskedNode() if opt.per_param[k] or opt.stack[k]
                           else offload.fetch(x) for k, x in enumerate(opt.leaves)]
            for k, x in zip(s_idx, states, strict=True):
                piece_state[k] = take(x)
            u, out = update(weights.tree(g), opt.tree(piece_state), weights.tree(p), stack=s, start=i)
            u, out = weights.flat(u), opt.flat(out)
            put = lambda whole, piece: jax.lax.dynamic_update_slice_in_dim(
                whole, offload.store_like(piece, whole), i, 0)
            params = [put(x, optax.apply_updates(p[k], u[k])) for k, x in zip(p_idx, params, strict=True)]
            states = [put(x, out[k]) for k, x in zip(s_idx, states, strict=True)]
            return params, states, sq + squares(u)

        params, states, sq = jax.lax.fori_loop(0, sizes[s], body, ([weights.leaves[k] for k in p_idx],
                                                                     [opt.leaves[k] for k in s_idx], sq))
        for k, x in zip(p_idx, params, strict=True):
            new_p[k] = x
        for k, x in zip(s_idx, states, strict=True):
            new_s[k] = x

    new_chain = (clip_state, opt.tree(new_s))
    if skip:
        new_chain = optax.ApplyIfFiniteState(
            notfinite_count=count, last_finite=finite,
            total_notfinite=jnp.where(finite, state.total_notfinite, optax.safe_increment(state.total_notfinite)),
            inner_state=new_chain)
    return weights.tree(new_p), new_chain, sq


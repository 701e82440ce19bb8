"""The policy's log-probs of sampled completions, as both RL updates and the KL reference compute them: the model on
the rollout's rows (rollout.trajectory_rows) with the sampler's routing replayed, at the sampler's temperature
(docs/rl.md#the-update).

    logp, entropy, differs = completion_logprobs(params, buffers, graphdef, batch, temperature=1.0)
    ref_logp = reference_logprobs(graphdef, temperature, routing_replay)(reference, frozen_base, buffers, batch)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from glm46_jax.model import apply
from glm46_jax.training.loss import nll_and_lse
from glm46_jax.training.step import with_frozen


def completion_logprobs(params: nnx.State, buffers: nnx.State, graphdef: nnx.GraphDef, batch: dict[str, Array],
                        temperature: float = 1.0, routing_replay: bool = True
                        ) -> tuple[Float[Array, "b t"], Float[Array, "b t"], Float[Array, "b s"] | None]:
    """(log p(inputs[:, t+1] | inputs[:, :t+1]) [b, s-1], the policy's entropy there [b, s-1], and with replay the
    per-position share of MoE layers whose own choice differs from the replayed one [b, s]), fp32."""
    expert_ids = None
    if routing_replay and "expert_ids" in batch:
        expert_ids = jnp.transpose(batch["expert_ids"], (2, 0, 1, 3))  # [layers, b, s, k], scanned per layer
    out = apply(graphdef, params, buffers, batch["inputs"], with_mtp=False, expert_ids=expert_ids)
    logits = out.logits[:, :-1].astype(jnp.float32) / temperature
    nll, lse = nll_and_lse(logits, batch["inputs"][:, 1:])  # no gather along the (sharded) vocab
    entropy = lse - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
    differs = out.aux["replay_differs"].mean(axis=0) if expert_ids is not None else None
    return -nll, entropy, differs


def like(x: Array, ref: Array) -> Array:
    # Batch arrays arrive in the loader's layout; Explicit sharding mode wants operands laid out alike.
    layout = jax.typeof(ref).sharding
    return x if layout.mesh.empty else jax.sharding.reshard(x, layout)


@functools.cache  # one jitted function per (graphdef, settings): the next run in a process reuses it
def reference_logprobs(graphdef: nnx.GraphDef, temperature: float, routing_replay: bool) -> Callable:
    """jit(reference params, frozen base or None, buffers, batch) -> the reference policy's completion log-probs."""
    return jax.jit(lambda p, fz, b, batch: completion_logprobs(with_frozen(p, fz), b, graphdef, batch, temperature,
                                                              routing_replay)[0])

"""Local routed-expert compute: the grouped SwiGLU matmul every dispatch strategy ends in.

Sort-by-expert + capacity-padded batched einsum. `jax.lax.ragged_dot` alone would be simpler,
but XLA lowers it to a dense product over every group on CPU and (by default) on NVIDIA GPUs:
about 90x slower on this CPU for 64 experts (STYLE.md). Capacity C = tokens gives exact
dropless routing (top-k experts are distinct, so no expert can receive more than every token once).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from glm46_jax.config import ModelConfig


def expert_capacity(num_tokens: int, cfg: ModelConfig) -> int:
    if cfg.moe_capacity_factor <= 0:
        return num_tokens  # dropless
    per_expert = num_tokens * cfg.num_experts_per_tok / cfg.n_routed_experts
    return max(1, min(num_tokens, math.ceil(cfg.moe_capacity_factor * per_expert)))


def grouped_experts(x: Float[Array, "n d"], idx: Int[Array, "n k"], weights: Float[Array, "n k"],
                    w_gate_edf: Array, w_up_edf: Array, w_down_efd: Array, capacity: int,
                    expert_offset: Array | int = 0) -> tuple[Float[Array, "n d"], Int[Array, ""]]:
    """Sum_j weights[:, j] * Expert_{idx[:, j]}(x) over the experts held here; returns (y, dropped count).

    The weights hold experts [expert_offset, expert_offset + E_local); assignments to other experts
    contribute nothing here (another shard computes them) and are not drops. Assignments are
    sorted by expert (stable, so earlier tokens win when an expert is full), gathered into an
    [E_local, C, d] buffer, run through one batched SwiGLU einsum, and gathered back. Everything
    is a gather, so the backward pass is scatter-adds XLA handles well.
    """
    n, k = idx.shape
    e = w_gate_edf.shape[0]
    dt = x.dtype
    local_e = idx.reshape(-1) - expert_offset
    is_local = (local_e >= 0) & (local_e < e)
    flat_e = jnp.where(is_local, local_e, e)  # other shards' assignments sort last, into bucket e
    order = jnp.argsort(flat_e, stable=True)  # assignment ids grouped by expert
    counts = jnp.bincount(flat_e, length=e + 1)[:e]
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(capacity)
    slot_valid = slot[None, :] < counts[:, None]  # [E, C]
    slot_assign = order[jnp.minimum(starts[:, None] + slot[None, :], n * k - 1)]
    x_ecd = jnp.where(slot_valid[..., None], x[slot_assign // k], 0).astype(dt)

    gate = jnp.einsum("ecd,edf->ecf", x_ecd, w_gate_edf.astype(dt))
    up = jnp.einsum("ecd,edf->ecf", x_ecd, w_up_edf.astype(dt))
    y_ecd = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, w_down_efd.astype(dt))

    # Where each assignment landed: its rank among the assignments of its expert.
    position = jnp.zeros(n * k, jnp.int32).at[order].set(jnp.arange(n * k, dtype=jnp.int32))
    rank = position - starts[jnp.minimum(flat_e, e - 1)]
    kept = is_local & (rank < capacity)
    y_a = jnp.where(kept[:, None], y_ecd[jnp.minimum(flat_e, e - 1), jnp.clip(rank, 0, capacity - 1)], 0)
    # HF combines in fp32 (bf16 expert output x fp32 weight) and casts once at the end.
    y = jnp.einsum("nkd,nk->nd", y_a.reshape(n, k, -1).astype(jnp.float32), weights.astype(jnp.float32))
    return y.astype(dt), jnp.sum(is_local & ~kept)

"""Causal attention in blocks with an online softmax: memory linear in sequence length, no [s, t] array
(docs/long_context.md#blockwise-attention).

Query i may see key j iff `k_positions[j] <= q_positions[i]` and, when segment ids are given,
`q_segment_ids[b, i] == k_segment_ids[b, j]` (documents packed in one row never see each other).
Masking is by explicit positions, not by block index, so a query shard can attend over gathered keys
whose positions differ from its own (context parallelism: pass the shard's query positions and the
gathered keys' positions; a plain `kv_offset` is `q_positions = kv_offset + arange(s)`).
Key blocks whose first position is after a query block's last one are never visited.

The backward is a `jax.custom_vjp` that keeps only q, k, v, the output and the per-row log-sum-exp,
and recomputes each block's scores from them (docs/long_context.md#the-backward-pass).
"""

from __future__ import annotations

import functools

import einops
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

F32 = jnp.float32
# Position given to padding: padded keys come after every query, padded queries before every key.
_PAD_KEY = jnp.iinfo(jnp.int32).max
_PAD_QUERY = jnp.iinfo(jnp.int32).min


def blockwise_attention(q: Float[Array, "b s h c"], k: Float[Array, "b t k c"], v: Float[Array, "b t k c"], *,
                        q_positions: Int[Array, "s"] | None = None, k_positions: Int[Array, "t"] | None = None,
                        q_segment_ids: Int[Array, "b s"] | None = None,
                        k_segment_ids: Int[Array, "b t"] | None = None, scale: float | None = None,
                        block_q: int = 128, block_kv: int = 128) -> Float[Array, "b s h c"]:
    """softmax(q k^T * scale, masked causally by position and by segment) v, one block pair at a time.

    GQA: query head h reads kv head h // (h_total / kv_heads), as HF's repeat_kv. Positions are one
    vector per call (every row's i-th token has the same position); they default to arange when s == t.
    Segment ids default to one document per row; `k_segment_ids` defaults to `q_segment_ids` when
    s == t. `scale` defaults to 1/sqrt(head_dim). Lengths need not be multiples of the block sizes
    (padded inside, masked, sliced off). A query that sees no key at all gets a zero output.
    Batch and head axes may be sharded: every op is batched over them.
    """
    s, t = q.shape[1], k.shape[1]
    if q_positions is None or k_positions is None:
        if s != t:
            raise ValueError(f"blockwise_attention: {s} queries against {t} keys need explicit q/k positions")
        q_positions = jnp.arange(s, dtype=jnp.int32) if q_positions is None else q_positions
        k_positions = jnp.arange(t, dtype=jnp.int32) if k_positions is None else k_positions
    if k_segment_ids is None and q_segment_ids is not None:
        if s != t:
            raise ValueError("blockwise_attention: pass k_segment_ids when queries and keys differ in length")
        k_segment_ids = q_segment_ids
    if (q_segment_ids is None) != (k_segment_ids is None):
        raise ValueError("blockwise_attention: give segment ids for both queries and keys, or neither")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    bq, bk = min(block_q, s), min(block_kv, t)  # short sequences: one block, no padding

    # Two reshapes: splitting a sharded and an unsharded axis in one is not supported under Explicit sharding.
    q = einops.rearrange(q, "b s (k g) c -> b s k g c", k=k.shape[2])
    # Heads before positions: each block product is then a plain matmul batched over (b, kv head).
    qb = einops.rearrange(_pad(q, bq, 0), "b (n q) k g c -> n b k g q c", q=bq)
    kb = einops.rearrange(_pad(k, bk, 0), "b (n t) k c -> n b k t c", t=bk)
    vb = einops.rearrange(_pad(v, bk, 0), "b (n t) k c -> n b k t c", t=bk)
    qpos = _pad(jnp.asarray(q_positions, jnp.int32)[None], bq, _PAD_QUERY)[0].reshape(-1, bq)
    kpos = _pad(jnp.asarray(k_positions, jnp.int32)[None], bk, _PAD_KEY)[0].reshape(-1, bk)
    qseg = kseg = None
    if q_segment_ids is not None:
        qseg = einops.rearrange(_pad(q_segment_ids, bq, 0), "b (n q) -> n b q", q=bq)
        kseg = einops.rearrange(_pad(k_segment_ids, bk, 0), "b (n t) -> n b t", t=bk)

    out = _attention(qb, kb, vb, qpos, kpos, qseg, kseg, scale)
    out = einops.rearrange(out, "n b k g q c -> b (n q) k g c")[:, :s]
    return einops.rearrange(out, "b s k g c -> b s (k g) c")


def _pad(x, block: int, fill):
    """Pads axis 1 up to a multiple of `block`."""
    extra = -x.shape[1] % block
    if not extra:
        return x
    return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)


def _schedule(qpos, kpos):
    """Per query block, the key blocks it needs (first `count[i]` entries of `order[i]`): those whose
    earliest key is not after the block's latest query. Any order of positions works; with sorted
    positions this is the causal triangle."""
    needed = kpos.min(1)[None, :] <= qpos.max(1)[:, None]  # [nq, nk]
    order = jnp.argsort(jnp.where(needed, 0, 1), axis=1, stable=True).astype(jnp.int32)
    return order, needed.sum(1, dtype=jnp.int32)


def _scores(q, k, qpos, kpos, qseg, kseg, scale):
    """Block scores [b, k, g, q, t] in fp32 and their mask (broadcastable to them)."""
    s = jnp.einsum("bkgqc,bktc->bkgqt", q, k, preferred_element_type=F32) * scale
    mask = (kpos[None, :] <= qpos[:, None])[None]  # [1, q, t]
    if qseg is not None:
        mask = mask & (qseg[:, :, None] == kseg[:, None, :])
    return s, mask[:, None, None]


def _take(x, j):
    return jax.lax.dynamic_index_in_dim(x, j, keepdims=False)


def _forward(qb, kb, vb, qpos, kpos, qseg, kseg, scale):
    order, count = _schedule(qpos, kpos)

    def query_block(_, xs):
        q, qp, qs, blocks, n_blocks = xs

        def key_block(n, carry):
            m, total, acc = carry  # running max, running sum of exp(s - m), running sum of exp(s - m) v
            j = blocks[n]
            s, mask = _scores(q, _take(kb, j), qp, _take(kpos, j), qs, None if qs is None else _take(kseg, j), scale)
            s = jnp.where(mask, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            m_ref = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # no key seen yet: exp(-inf - 0) = 0, not NaN
            p = jnp.exp(s - m_ref[..., None])
            rescale = jnp.exp(m - m_ref)
            pv = jnp.einsum("bkgqt,bktc->bkgqc", p.astype(vb.dtype), _take(vb, j), preferred_element_type=F32)
            return m_new, total * rescale + p.sum(-1), acc * rescale[..., None] + pv

        start = (jnp.full_like(q[..., 0], -jnp.inf, F32), jnp.zeros_like(q[..., 0], F32), jnp.zeros_like(q, F32))
        m, total, acc = jax.lax.fori_loop(0, n_blocks, key_block, start)
        seen = total > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, total, 1.0)[..., None], 0.0).astype(q.dtype)
        # A row that saw nothing gets +inf: exp(s - lse) = 0 for it in the backward.
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), jnp.inf)
        return None, (out, lse)

    _, (out, lse) = jax.lax.scan(query_block, None, (qb, qpos, qseg, order, count))
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(qb, kb, vb, qpos, kpos, qseg, kseg, scale):
    return _forward(qb, kb, vb, qpos, kpos, qseg, kseg, scale)[0]


def _attention_fwd(qb, kb, vb, qpos, kpos, qseg, kseg, scale):
    out, lse = _forward(qb, kb, vb, qpos, kpos, qseg, kseg, scale)
    # Named for the remat policies, which keep them: the backward then never re-runs this forward.
    out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")
    return out, (qb, kb, vb, qpos, kpos, qseg, kseg, out, lse)


def _attention_bwd(scale, residuals, dout):
    qb, kb, vb, qpos, kpos, qseg, kseg, out, lse = residuals
    order, count = _schedule(qpos, kpos)
    dt = qb.dtype

    def query_block(carry, xs):
        q, do, o, lse_q, qp, qs, blocks, n_blocks = xs
        # rowsum(dO * O) = sum_t p_t dp_t: the softmax Jacobian's correction term, once per row.
        delta = jnp.sum(do.astype(F32) * o.astype(F32), axis=-1)

        def key_block(n, carry):
            dq, dk, dv = carry
            j = blocks[n]
            k, v = _take(kb, j), _take(vb, j)
            s, mask = _scores(q, k, qp, _take(kpos, j), qs, None if qs is None else _take(kseg, j), scale)
            p = jnp.where(mask, jnp.exp(s - lse_q[..., None]), 0.0)
            dp = jnp.einsum("bkgqc,bktc->bkgqt", do, v, preferred_element_type=F32)
            ds = (p * (dp - delta[..., None])).astype(dt)
            dq = dq + jnp.einsum("bkgqt,bktc->bkgqc", ds, k, preferred_element_type=F32) * scale
            dk_j = jnp.einsum("bkgqt,bkgqc->bktc", ds, q, preferred_element_type=F32) * scale
            dv_j = jnp.einsum("bkgqt,bkgqc->bktc", p.astype(dt), do, preferred_element_type=F32)
            dk = jax.lax.dynamic_update_index_in_dim(dk, _take(dk, j) + dk_j, j, 0)
            dv = jax.lax.dynamic_update_index_in_dim(dv, _take(dv, j) + dv_j, j, 0)
            return dq, dk, dv

        dq, dk, dv = jax.lax.fori_loop(0, n_blocks, key_block, (jnp.zeros_like(q, F32), *carry))
        return (dk, dv), dq.astype(dt)

    start = (jnp.zeros_like(kb, F32), jnp.zeros_like(vb, F32))
    (dk, dv), dq = jax.lax.scan(query_block, start, (qb, dout, out, lse, qpos, qseg, order, count))
    return dq, dk.astype(kb.dtype), dv.astype(vb.dtype), None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)

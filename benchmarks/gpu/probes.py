"""Matmul probes for the measured peak, timed in the same rounds as the steps they sit beside (benchmarks/gpu/step.py):
the best of a square chain and the lm_head's three GEMMs, all on random data."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def _random(shape, dtype, device, seed: int, scale: float = 1.0):
    x = jax.random.normal(jax.random.key(seed), shape, dtype)  # in `dtype`: a [tokens, vocab] fp32 one is 20 GB
    return jax.device_put(x * jnp.asarray(scale, dtype), device)


def matmul_probe(size: int, dtype: str, device, chain: int = 8):
    """`chain` size^3 matmuls in one jitted call on `device` and their FLOPs, timed in the same rounds as the
    variants beside it (a chain: the host's launch and wait are a small part of the call). Random data, as a step's
    GEMMs see (an all-constant matrix measured 690 TFLOP/s on the H200, cuBLAS ~790 on random data), of variance
    1 / size, so x @ a keeps x's scale however long the chain."""
    a = _random((size, size), dtype, device, seed=size, scale=size ** -0.5)
    f = jax.jit(lambda a: jax.lax.fori_loop(0, chain, lambda _, x: x @ a, a))
    jax.block_until_ready(f(a))
    return (lambda: jax.block_until_ready(f(a))), chain * 2 * size ** 3


def head_probes(tokens: int, hidden: int, vocab: int, dtype: str, device) -> dict[str, tuple[Any, int]]:
    """The lm_head's three GEMMs on random data, each (call, FLOPs): logits = h W, dh = dlogits W^T and
    dW = h^T dlogits. The step's head GEMMs ran faster than the square probe (~820 TFLOP/s against 690 on the
    H200), so the peak is the best of all of them."""
    h, w = _random((tokens, hidden), dtype, device, 1), _random((hidden, vocab), dtype, device, 2, hidden ** -0.5)
    g = _random((tokens, vocab), dtype, device, 3, vocab ** -0.5)
    out = {}
    for name, spec, a, b in (("fwd", "td,dv->tv", h, w), ("d-hidden", "tv,dv->td", g, w),
                             ("d-weight", "td,tv->dv", h, g)):
        f = jax.jit(lambda a, b, spec=spec: jnp.einsum(spec, a, b))
        jax.block_until_ready(f(a, b))
        out[f"head {name} {tokens}x{hidden}x{vocab}"] = ((lambda f=f, a=a, b=b: jax.block_until_ready(f(a, b))),
                                                         2 * tokens * hidden * vocab)
    return out

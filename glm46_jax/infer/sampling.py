"""What every decoder shares (plain and speculative generation, RL rollouts): the result type, sampling from
logits, the layouts of sampling state and model inputs, and checking and padding a batch of prompts."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Float, Int

from glm46_jax.errors import InputError
from glm46_jax.parallel import sharding


@struct.dataclass
class Generation:
    """tokens[b, :lengths[b]] are row b's new tokens (a stop token, when one ended the row, included);
    later slots hold `pad_id` with log-prob 0.

    With `generate(record_routing=True)`, routing[b, slot, l, :] are the experts MoE layer l chose for the token
    at KV-cache slot `slot` of row b: the left-padded prompt (slots [0, P)), then new tokens 0 .. n-2 (the last
    new token is never fed back). Routing replay trains on these (docs/rl.md#routing-replay)."""
    tokens: Int[Array, "b n"]
    logprobs: Float[Array, "b n"]
    lengths: Int[Array, "b"]
    routing: Int[Array, "b slots l k"] | None = None


def filter_logits(logits: Float[Array, "b v"], temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> Float[Array, "b v"]:
    """The logits of the distribution sampled from: divided by the temperature, then everything outside
    the top-k and outside the top-p nucleus set to -inf (fp32). top_k=0 / top_p=1 turn those off.

    The nucleus is the smallest set of most likely tokens whose probability mass is >= top_p (after
    temperature and top-k, as in HF's warper order); the most likely token is always kept.
    """
    logits = logits.astype(jnp.float32) / temperature
    neg = jnp.finfo(jnp.float32).min
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, neg)
    if top_p < 1.0:
        desc = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(desc, axis=-1)
        # A token is kept while the mass *before* it is still short of top_p: that is the smallest prefix
        # reaching top_p. Its last kept logit is the threshold (ties at the threshold are kept too).
        keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p
        threshold = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits >= threshold, logits, neg)
    return logits


def sample(key: Array, logits: Float[Array, "b v"], temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0) -> tuple[Int[Array, "b"], Float[Array, "b"]]:
    """One token per row and its log-probability.

    temperature > 0: a draw from `filter_logits(...)`, and the log-prob is under that same filtered,
    tempered distribution (the one actually sampled from). temperature == 0 (greedy): the argmax, and
    the log-prob is under the model's unmodified softmax (the point mass greedy samples from would say 0).
    """
    logits = logits.astype(jnp.float32)
    if temperature == 0.0:
        tok = jnp.argmax(logits, axis=-1)
        dist = logits
    else:
        dist = filter_logits(logits, temperature, top_k, top_p)
        tok = jax.random.categorical(key, dist, axis=-1)
    logp = jnp.take_along_axis(jax.nn.log_softmax(dist, axis=-1), tok[:, None], axis=-1)[:, 0]
    return tok.astype(jnp.int32), logp


def replicated(x):
    # Sampling state is tiny ([b] / [b, vocab]); one replicated copy keeps sort/top-k/argmax off sharded axes.
    return jax.sharding.reshard(x, jax.P())


def as_rows(x):
    # Model inputs in the activation layout: batch over data x expert, as in training.
    return jax.sharding.reshard(x, sharding.logical("batch", *([None] * (x.ndim - 1))))


def check_request(prompts: Sequence[Sequence[int]], max_new_tokens: int, max_len: int | None, temperature: float,
                  top_k: int, top_p: float, extra_slots: int = 0, prompt_len: int | None = None) -> int:
    """The KV cache slots a request needs; a request that cannot run is an InputError."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InputError("generate: every prompt needs at least one token")
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens={max_new_tokens}: must be >= 1")
    p = max(max(len(x) for x in prompts), prompt_len or 0)
    # Every prompt token and every new token but the last is fed to the model (+ the drafts' extra slots).
    need = p + max_new_tokens - 1 + extra_slots
    if max_len is not None and need > max_len:
        raise InputError(f"the longest prompt ({p} tokens) + --max-new-tokens={max_new_tokens} needs a {need}-slot "
                         f"KV cache, longer than max_len={max_len} (--max-len; default the model's "
                         "max_position_embeddings); "
                         "shorten the prompt or generate fewer tokens")
    if temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0:
        raise InputError(f"sampling: temperature={temperature} must be >= 0, top_k={top_k} >= 0, "
                         f"top_p={top_p} in (0, 1]")
    return need


def pad_batch(prompts: Sequence[Sequence[int]], pad_id: int,
              prompt_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [rows, P], start [rows]): the prompts left-padded to the longest (or to `prompt_len` if that is
    longer), and the batch filled up to a
    multiple of the current mesh's batch shards (data x expert) with 1-token dummy rows (rows never interact,
    so they change nothing; callers drop their results)."""
    n = len(prompts)
    mesh = jax.sharding.get_abstract_mesh()
    shards = 1 if mesh.empty else math.prod(mesh.shape[a] for a in sharding.mesh_axes("batch") if a in mesh.shape)
    prompts = list(prompts) + [[pad_id]] * (-n % shards)
    p = max(max(len(x) for x in prompts), prompt_len or 0)
    start = np.array([p - len(x) for x in prompts], np.int32)
    tokens = np.full((len(prompts), p), pad_id, np.int32)
    for row, (x, s) in enumerate(zip(prompts, start)):
        tokens[row, s:] = x
    return tokens, start

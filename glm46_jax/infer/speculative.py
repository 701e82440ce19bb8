"""Speculative decoding with the MTP layer as the drafter (docs/generation.md#mtp-speculative-decoding).

Every step feeds the main model two tokens per row, the last decided token and the MTP layer's draft of
the token after it, at cache slots [n, n + 2). One forward verifies the draft (the logits at slot n) and
predicts one token more (the logits at slot n + 1), so a step emits 2 tokens when the draft is accepted
and 1 when it is not. The MTP layer then runs on the same two rows (the main model's hidden states and
the tokens just decided) and drafts the next step's token, keeping its own one-layer KV cache.

Greedy: the draft is accepted iff it is the main model's argmax, so the output is plain greedy decoding's.
Sampling: the draft d ~ q (the MTP's distribution, filtered like the target) is accepted with probability
min(1, p(d) / q(d)), else a token is drawn from max(0, p - q) renormalised; the emitted tokens are then
distributed exactly as plain sampling from p (Leviathan et al. 2023, Chen et al. 2023).

Rows accept different numbers of tokens, so every row keeps its own cache slot `n` (per-row cache writes),
unlike plain decoding's one slot for the batch. A rejected draft's k/v stay in slot n + 1 until the next
step overwrites them; the attention mask never reaches past the slot being computed.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jaxtyping import Array, Float, Int

from glm46_jax.errors import InputError
from glm46_jax.infer.sampling import Generation, as_rows, check_request, filter_logits, pad_batch, replicated, sample
from glm46_jax.model import GenerationCache, apply


@struct.dataclass
class DraftStats:
    """Per row: drafts verified and accepted; `forwards` counts main-model passes (prefill included)."""
    drafted: Int[Array, "b"]
    accepted: Int[Array, "b"]
    forwards: Int[Array, ""]

    @property
    def acceptance_rate(self) -> float:
        return float(np.sum(self.accepted)) / max(1, int(np.sum(self.drafted)))


def _draft(key, logits, temperature, top_k, top_p):
    """(draft token, the filtered logits it was drawn from): q of the acceptance rule."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits[:, :1]  # q unused when greedy
    q = filter_logits(logits, temperature, top_k, top_p)
    return jax.random.categorical(key, q, axis=-1).astype(jnp.int32), q


def verify(key: Array, logits: Float[Array, "b v"], draft: Int[Array, "b"], q_logits: Float[Array, "b v"],
           temperature: float, top_k: int, top_p: float
           ) -> tuple[Int[Array, "b"], Float[Array, "b"], Array]:
    """(token, its log-prob, accepted) for the slot the draft was made for.

    Greedy: the main model's argmax; accepted iff it equals the draft. Sampling: the standard rejection rule
    (accept with min(1, p/q), else draw from the residual max(0, p - q)), whose token is distributed as p.
    Log-probs are as in `generate.sample`: under the distribution sampled from (greedy: the model's softmax).
    """
    if temperature == 0.0:
        tok, logp = sample(key, logits, 0.0)
        return tok, logp, tok == draft
    key_u, key_r = jax.random.split(key)
    logp = jax.nn.log_softmax(filter_logits(logits, temperature, top_k, top_p), axis=-1)
    logq = jax.nn.log_softmax(q_logits, axis=-1)
    at = lambda lp, t: jnp.take_along_axis(lp, t[:, None], axis=-1)[:, 0]  # noqa: E731
    accepted = jnp.log(jax.random.uniform(key_u, draft.shape)) < at(logp, draft) - at(logq, draft)
    residual = jnp.maximum(jnp.exp(logp) - jnp.exp(logq), 0.0)
    # An all-zero residual means p == q, where every draft is accepted; fall back to p to stay finite.
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, jnp.exp(logp))
    redraw = jax.random.categorical(key_r, jnp.where(residual > 0, jnp.log(residual), -jnp.inf), axis=-1)
    tok = jnp.where(accepted, draft, redraw).astype(jnp.int32)
    return tok, at(logp, tok), accepted


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "temperature", "top_k", "top_p"))
def _prefill(graphdef: nnx.GraphDef, params, buffers, tokens: Int[Array, "b p"], start: Int[Array, "b"], key: Array,
             *, max_len: int, temperature: float, top_k: int, top_p: float):
    with jax.named_scope("prefill"):
        b, p = tokens.shape
        cfg = nnx.merge(graphdef, params, buffers).cfg
        cache = GenerationCache.zeros(cfg, b, max_len, mtp=True)
        positions = as_rows(jnp.maximum(jnp.arange(p, dtype=jnp.int32)[None] - start[:, None], 0))
        at = dict(positions=positions, index=0, start=as_rows(start))
        out = apply(graphdef, params, buffers, as_rows(tokens), cache=cache, with_mtp=False, **at)
        first, first_logp = sample(jax.random.fold_in(key, 0), replicated(out.logits[:, -1]), temperature, top_k,
                                   top_p)
        # MTP row t reads hidden[t] and token t + 1; the last row's next token is the one just sampled.
        next_tokens = jnp.concatenate([tokens[:, 1:], first[:, None]], axis=1)
        drafted = apply(graphdef, params, buffers, None, cache=out.cache, hidden=out.hidden,
                        next_tokens=as_rows(next_tokens), **at)
        draft, q = _draft(jax.random.fold_in(key, 1), replicated(drafted.mtp_logits[:, -1]), temperature, top_k,
                          top_p)
        return first, first_logp, draft, q, drafted.cache


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k", "top_p"),
                   donate_argnames=("cache",))
def _decode(graphdef: nnx.GraphDef, params, buffers, cache: GenerationCache, first, first_logp, draft, q,
            start: Int[Array, "b"], key: Array, stop: Int[Array, "n_stop"], pad_id: Int[Array, ""], *,
            max_new_tokens: int, temperature: float, top_k: int, top_p: float
            ) -> tuple[Generation, DraftStats, GenerationCache]:
    # The cache is donated and returned, as in plain decoding: the while loop updates it in place.
    with jax.named_scope("speculative_decode"):
        b, n_max = first.shape[0], max_new_tokens
        put = jax.vmap(lambda row, new, at: jax.lax.dynamic_update_slice(row, new, (at,)))  # per-row offsets
        # Two spare columns: a row that is done still writes (ignored) pairs at its length.
        out = jnp.full((b, n_max + 2), pad_id, jnp.int32).at[:, 0].set(first)
        out_logp = jnp.zeros((b, n_max + 2), jnp.float32).at[:, 0].set(first_logp)
        done = jnp.isin(first, stop) | (n_max <= 1)
        slot = jnp.full((b,), cache.max_len - n_max, jnp.int32)  # the first new token's slot: the prompt ends before
        zeros = jnp.zeros((b,), jnp.int32)
        state = (jnp.int32(1), cache, slot, first, draft, q, jnp.ones((b,), jnp.int32), done, out, out_logp, zeros,
                 zeros)

        def body(state):
            step, cache, slot, last, draft, q, length, done, out, out_logp, drafted, accepted = state
            keys = jax.random.split(jax.random.fold_in(key, step), 3)
            pair = jnp.stack([last, draft], axis=1)
            positions = (slot - start)[:, None] + jnp.arange(2, dtype=jnp.int32)
            at = dict(positions=as_rows(positions), index=slot, start=as_rows(start))
            main = apply(graphdef, params, buffers, as_rows(pair), cache=cache, with_mtp=False, **at)
            logits = replicated(main.logits)
            tok0, logp0, ok = verify(keys[0], logits[:, 0], draft, q, temperature, top_k, top_p)
            tok1, logp1 = sample(keys[1], logits[:, 1], temperature, top_k, top_p)
            # How many tokens this row emits: 2 with an accepted draft, 1 without, none once done; never past
            # a stop token or max_new_tokens.
            count = jnp.where(ok & ~jnp.isin(tok0, stop), 2, 1)
            count = jnp.where(done, 0, jnp.minimum(count, n_max - length))
            emitted = jnp.stack([tok0, tok1], axis=1)
            out = put(out, emitted, length)
            out_logp = put(out_logp, jnp.stack([logp0, logp1], axis=1), length)
            hit = jnp.isin(tok0, stop) | ((count == 2) & jnp.isin(tok1, stop))
            # The MTP rows at slots n, n + 1 read the hidden states just computed and the tokens after them:
            # tok0 is the token at n + 1 whether or not the draft was accepted; tok1 matters only if it was.
            mtp = apply(graphdef, params, buffers, None, cache=main.cache, hidden=main.hidden,
                        next_tokens=as_rows(emitted), **at)
            cache, mtp_logits = mtp.cache, replicated(mtp.mtp_logits)
            next_draft, next_q = _draft(keys[2], jnp.where((count == 2)[:, None], mtp_logits[:, 1], mtp_logits[:, 0]),
                                        temperature, top_k, top_p)
            live = ~done
            return (step + 1, cache, slot + count, jnp.where(count == 2, tok1, tok0), next_draft, next_q,
                    length + count, done | hit | (length + count >= n_max), out, out_logp,
                    drafted + live, accepted + (live & ok))

        def cond(state):
            return ~jnp.all(state[7])

        step, cache, _, _, _, _, length, _, out, out_logp, drafted, accepted = jax.lax.while_loop(cond, body, state)
        valid = jnp.arange(n_max)[None] < length[:, None]
        gen = Generation(tokens=jnp.where(valid, out[:, :n_max], pad_id),
                         logprobs=jnp.where(valid, out_logp[:, :n_max], 0.0), lengths=length)
        return gen, DraftStats(drafted=drafted, accepted=accepted, forwards=step), cache


def generate_speculative(graphdef: nnx.GraphDef, params: nnx.State, buffers: nnx.State,
                         prompts: Sequence[Sequence[int]], *, max_new_tokens: int, max_len: int | None = None,
                         temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, stop_tokens: Sequence[int] = (),
                         seed: int = 0, pad_id: int = 0, prompt_len: int | None = None
                         ) -> tuple[Generation, DraftStats]:
    """`generate.generate` with the MTP layer drafting one token per step; same arguments and output.

    Greedy output equals plain greedy decoding token for token; sampled output has plain sampling's
    distribution (not its exact draws: the random stream is used differently). Needs a model with an MTP
    layer (num_nextn_predict_layers = 1). Also returns the drafts verified and accepted per row.
    """
    cfg = nnx.merge(graphdef, params, buffers).cfg
    if not cfg.num_nextn_predict_layers:
        raise InputError("speculative decoding needs the model's MTP layer (num_nextn_predict_layers = 0 here, "
                         "or it was not in the loaded directory); drop --speculative")
    # Each step writes the two slots after the last decided token: one slot more than plain decoding.
    need = check_request(prompts, max_new_tokens, max_len, temperature, top_k, top_p, extra_slots=1,
                         prompt_len=prompt_len)
    n = len(prompts)
    tokens, start = pad_batch(prompts, pad_id, prompt_len)
    key = jax.random.key(seed)
    kw = {"temperature": float(temperature), "top_k": int(top_k), "top_p": float(top_p)}
    first, first_logp, draft, q, cache = _prefill(graphdef, params, buffers, jnp.asarray(tokens), jnp.asarray(start),
                                                  key, max_len=need, **kw)
    out, stats, _ = _decode(graphdef, params, buffers, cache, first, first_logp, draft, q, jnp.asarray(start), key,
                         jnp.asarray(list(stop_tokens) or [-1], jnp.int32), jnp.int32(pad_id),
                         max_new_tokens=max_new_tokens, **kw)
    if len(tokens) > n:
        out = jax.tree.map(lambda x: x[:n], out)
        stats = stats.replace(drafted=stats.drafted[:n], accepted=stats.accepted[:n])
    return out, stats


def tokens_per_forward(gen: Generation, stats: DraftStats) -> float:
    """New tokens per main-model forward pass that a row took part in (its prefill and its verify passes),
    over all rows: plain decoding gives exactly 1. A batch runs until its slowest row is done
    (`stats.forwards` passes), so its wall-clock gain is bounded by that row's."""
    return float(np.sum(np.asarray(gen.lengths))) / float(np.sum(1 + np.asarray(stats.drafted)))

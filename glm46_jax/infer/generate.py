"""Autoregressive generation with a KV cache: a jitted prefill, then a `lax.while_loop` decode.

    python -m glm46_jax.generate --hf-dir DIR --prompt "def f(x):" --max-new-tokens 32
    python -m glm46_jax.generate --checkpoint runs/tiny --tokens 5,6,7 --temperature 0.8 --top-p 0.9 --seed 1
    python -m glm46_jax.generate --checkpoint runs/tiny --prompt "def f(x):" --speculative
    python -m glm46_jax.generate --hf-dir DIR --chat --prompt "What is 2 + 2?" --no-thinking
    python -m glm46_jax.generate --hf-dir DIR --messages chat.json   # [{"role": "user", "content": ...}, ...]

Prompts of different lengths share one batch, **left-padded**: every row's last prompt token sits in
the same cache slot, so each decode step writes one slot index for the whole batch (a single
dynamic_update_slice), while RoPE positions stay per row (a row's own token index) and the pad slots
before a row's first token are masked out of every attention. Only the main model runs, unless
`--speculative` lets the MTP layer draft tokens (glm46_jax/infer/speculative.py: same greedy output, fewer passes).

Text prompts need a tokenizer, found as `python -m glm46_jax.score` finds it (`--tokenizer`, else
`<hf-dir>/tokenizer.json`, else the run's tokenizer). Generation stops per row at a stop token
(`--stop-token`, default the config's `eos_token_id`) or after `--max-new-tokens`.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from glm46_jax import cli
from glm46_jax.errors import InputError
from glm46_jax.interop import chat
from glm46_jax.infer.load import Tokenizer, add_model_args, load_model

# Generation, sample, filter_logits, check_request and pad_batch are part of this module's API too.
from glm46_jax.infer.sampling import (Generation, as_rows, check_request, filter_logits, pad_batch,  # noqa: F401
                                      replicated, sample)
from glm46_jax.infer.speculative import generate_speculative, tokens_per_forward
from glm46_jax.model import GenerationCache, apply
from glm46_jax.parallel import sharding

# --- prefill and decode -----------------------------------------------------------------------

def _routing_rows(routing: Int[Array, "l b s k"] | None) -> Int[Array, "b s l k"] | None:
    # Batch-first (rows are what callers slice), and replicated like the other sampling outputs.
    return None if routing is None else replicated(jnp.transpose(routing, (1, 2, 0, 3)))


def _prefill_routed_impl(graphdef: nnx.GraphDef, params, buffers, tokens: Int[Array, "b p"], start: Int[Array, "b"],
                         max_len: int) -> tuple[Float[Array, "b v"], GenerationCache, Int[Array, "b p l k"] | None]:
    with jax.named_scope("prefill"):
        b, p = tokens.shape
        cfg = nnx.merge(graphdef, params, buffers).cfg
        cache = GenerationCache.zeros(cfg, b, max_len)
        # RoPE position = slot - start: each row counts from its own first token; pad slots clip to 0.
        positions = jnp.maximum(jnp.arange(p, dtype=jnp.int32)[None] - start[:, None], 0)
        out = apply(graphdef, params, buffers, as_rows(tokens), as_rows(positions), cache=cache, start=as_rows(start),
                    with_mtp=False)
        return replicated(out.logits[:, -1]), out.cache, _routing_rows(out.routing)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len"))
def _prefill(graphdef: nnx.GraphDef, params, buffers, tokens: Int[Array, "b p"], start: Int[Array, "b"],
             max_len: int) -> tuple[Float[Array, "b v"], GenerationCache]:
    return _prefill_routed_impl(graphdef, params, buffers, tokens, start, max_len)[:2]


# The prefill that also returns the prompt's routing [b, p, moe layers, k] (None without MoE layers).
_prefill_routed = jax.jit(_prefill_routed_impl, static_argnames=("graphdef", "max_len"))


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k", "top_p",
                                             "record_routing"),
                   donate_argnames=("cache",))
def _decode(graphdef: nnx.GraphDef, params, buffers, cache: GenerationCache, last_logits: Float[Array, "b v"],
            start: Int[Array, "b"], key: Array, stop: Int[Array, "n_stop"], pad_id: Int[Array, ""],
            prompt_routing: Int[Array, "b p l k"] | None = None, *,
            max_new_tokens: int, temperature: float, top_k: int, top_p: float, record_routing: bool = False
            ) -> tuple[Generation, GenerationCache]:
    # The cache is donated and returned: input, while-loop carry and output share one buffer, so each step's
    # dynamic_update_slice writes one slot in place and the filled cache stays usable by the caller.
    with jax.named_scope("decode"):
        b = last_logits.shape[0]
        draw = functools.partial(sample, temperature=temperature, top_k=top_k, top_p=top_p)

        def pick(step, logits, done):
            tok, logp = draw(jax.random.fold_in(key, step), logits)
            hit = jnp.isin(tok, stop)
            return jnp.where(done, pad_id, tok), jnp.where(done, 0.0, logp), done | hit

        tok, logp, done = pick(0, last_logits, jnp.zeros((b,), bool))
        out = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(tok)
        out_logp = jnp.zeros((b, max_new_tokens), jnp.float32).at[:, 0].set(logp)
        first_slot = _first_slot(cache, max_new_tokens)
        # Routing of the fed-back tokens, one slot each (at least one, so the loop body traces for n = 1).
        routes = None
        if record_routing and prompt_routing is not None:
            routes = jnp.zeros((b, max(max_new_tokens - 1, 1), *prompt_routing.shape[2:]), jnp.int32)
        state = (jnp.int32(1), cache, tok, done, jnp.ones((b,), jnp.int32), out, out_logp, routes)

        def cond(state):
            step, _, _, done, *_ = state
            return (step < max_new_tokens) & ~jnp.all(done)

        def body(state):
            step, cache, tok, done, lengths, out, out_logp, routes = state
            slot = first_slot + step - 1  # where the previous token's k/v go
            positions = (slot - start)[:, None]
            step_out = apply(graphdef, params, buffers, as_rows(tok[:, None]), as_rows(positions), cache=cache,
                             index=slot, start=as_rows(start), with_mtp=False)
            cache = step_out.cache
            new, logp, now_done = pick(step, replicated(step_out.logits[:, 0]), done)
            lengths = lengths + (~done).astype(jnp.int32)
            out = jax.lax.dynamic_update_slice(out, new[:, None], (0, step))
            out_logp = jax.lax.dynamic_update_slice(out_logp, logp[:, None], (0, step))
            if routes is not None:
                routes = jax.lax.dynamic_update_slice(routes, _routing_rows(step_out.routing), (0, step - 1, 0, 0))
            return step + 1, cache, new, now_done, lengths, out, out_logp, routes

        _, cache, _, _, lengths, out, out_logp, routes = jax.lax.while_loop(cond, body, state)
        routing = None
        if routes is not None:
            routing = jnp.concatenate([prompt_routing, routes[:, :max_new_tokens - 1]], axis=1)
        return Generation(tokens=out, logprobs=out_logp, lengths=lengths, routing=routing), cache


def _first_slot(cache: GenerationCache, max_new_tokens: int) -> int:
    # The cache holds the padded prompt (slots [0, P)) and the max_new_tokens - 1 tokens fed back after it;
    # generate() sizes it so the first fed-back token lands at slot P.
    return cache.max_len - (max_new_tokens - 1)


def generate(graphdef: nnx.GraphDef, params: nnx.State, buffers: nnx.State, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, max_len: int | None = None, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, stop_tokens: Sequence[int] = (), seed: int = 0, pad_id: int = 0,
             prompt_len: int | None = None, record_routing: bool = False) -> Generation:
    """Generate up to `max_new_tokens` after each prompt (a batch of token-id lists of any lengths).

    Runs under whatever mesh is current (`sharding.use_mesh(mesh)`), the batch split over its data x expert
    axes (padded with dummy rows to a multiple of their size). The KV cache gets exactly the slots needed
    (longest prompt + max_new_tokens - 1); `max_len` is the most the caller allows (e.g. the model's
    max_position_embeddings): a prompt that does not fit together with the new tokens is an InputError.

    Sampling: greedy when temperature == 0, else temperature / top-k / top-p with `jax.random.key(seed)`
    (one key per step, folded in from the seed); see `sample` for which distribution the returned log-probs
    are under. A row is done after a stop token (kept in its output) or max_new_tokens; the decode loop
    ends when every row is done. `prompt_len` pads the prompts to at least that many slots, so callers that
    bucket prompt lengths reuse one compiled prefill per bucket. `record_routing`: also the experts every MoE
    layer chose for every fed token (`Generation.routing`). The model's MoE should be dropless
    (moe_capacity_factor <= 0): with a capacity, rows of one batch (and pad tokens) compete for expert slots.
    """
    need = check_request(prompts, max_new_tokens, max_len, temperature, top_k, top_p, prompt_len=prompt_len)
    n = len(prompts)
    tokens, start = pad_batch(prompts, pad_id, prompt_len)
    prefill = _prefill_routed if record_routing else _prefill
    last_logits, cache, *prompt_routing = prefill(graphdef, params, buffers, jnp.asarray(tokens), jnp.asarray(start),
                                                  max_len=need)
    prompt_routing = prompt_routing[0] if prompt_routing else None
    out, _ = _decode(graphdef, params, buffers, cache, last_logits, jnp.asarray(start), jax.random.key(seed),
                     jnp.asarray(list(stop_tokens) or [-1], jnp.int32), jnp.int32(pad_id), prompt_routing,
                     max_new_tokens=max_new_tokens, temperature=float(temperature), top_k=int(top_k),
                     top_p=float(top_p), record_routing=record_routing)
    return jax.tree.map(lambda x: x[:n], out) if len(tokens) > n else out


# --- command line ---------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m glm46_jax.generate", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    inp = p.add_mutually_exclusive_group(required=True)
    inp.add_argument("--prompt", action="append", help="prompt text (repeatable: one batch row each)")
    inp.add_argument("--tokens", action="append", help="comma-separated prompt token ids (repeatable)")
    inp.add_argument("--messages", action="append",
                     help="a chat as a JSON file: a list of messages or {messages, tools} (repeatable; implies --chat)")
    p.add_argument("--chat", action="store_true",
                   help="render each --prompt as a user turn in the chat format (the HF dir's chat template when it "
                        "has one, else GLM-4.5/4.6's) and also stop at <|user|> / <|observation|>")
    p.add_argument("--no-thinking", action="store_true", help="chat: answer without a thinking block")
    p.add_argument("--tokenizer", help="a tokenizer.json path (default: as python -m glm46_jax.score)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-len", type=int, help="KV cache limit (default: the model's max_position_embeddings)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-token", type=int, action="append", help="stop token id (repeatable; default: eos_token_id)")
    p.add_argument("--stop", action="append", help="stop string that is one token of the tokenizer, e.g. '<|user|>' "
                   "(repeatable; added to the stop tokens)")
    p.add_argument("--speculative", action="store_true",
                   help="MTP speculative decoding (same greedy output; prints the acceptance rate)")
    return p


def _stop_ids(strings: list[str], tokenizer: Tokenizer) -> list[int]:
    ids = []
    for text in strings:
        enc = tokenizer.encode(text)
        if len(enc) != 1:
            raise InputError(f"--stop {text!r}: not one token of {tokenizer.spec} (it encodes to {len(enc)} ids); "
                             "a stop string must be a single (special) token such as <|user|>, or use --stop-token ID")
        ids.append(enc[0])
    return ids


def main(argv: list[str] | None = None) -> list[list[int]]:
    """Prints each prompt's completion; returns the new token ids per prompt."""

    args = _parser().parse_args(argv)
    prompts = None
    if args.tokens is not None:  # checked before the (slow) load
        try:
            prompts = [[int(t) for t in row.split(",") if t.strip()] for row in args.tokens]
        except ValueError:
            raise InputError(f"--tokens={args.tokens!r}: expected comma-separated integers") from None
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens={args.max_new_tokens}: must be >= 1")
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    chat_mode = args.chat or args.messages is not None
    if args.chat and args.tokens is not None:
        raise InputError("--chat renders text in the chat format: give it --prompt TEXT or --messages FILE, "
                         "not --tokens")
    conversations = [chat.load_conversation(path) for path in args.messages or ()]  # checked before the load
    cfg, graphdef, params, buffers, tok_spec = load_model(mesh, hf_dir=args.hf_dir, checkpoint=args.checkpoint,
                                                          dtype=args.dtype, tokenizer=args.tokenizer)
    if cfg.moe_capacity_factor > 0:  # generation needs rows that cannot crowd each other out of experts
        from glm46_jax.model import abstract_model
        cfg = cfg.replace(moe_capacity_factor=0.0)
        graphdef, _, _ = abstract_model(cfg, mesh)
    tokenizer = None
    if args.prompt is not None or args.stop or chat_mode:
        tokenizer = Tokenizer(tok_spec)
    if chat_mode:
        if args.prompt is not None:
            conversations = [chat.Conversation([{"role": "user", "content": text}], None) for text in args.prompt]
        template = chat.load_template(args.hf_dir) if args.hf_dir else None
        prompts = [chat.encode_prompt(tokenizer.tokenizer, c.messages, template=template, tools=c.tools,
                                      enable_thinking=not args.no_thinking).tolist() for c in conversations]
    elif args.prompt is not None:
        prompts = [tokenizer.encode(text) for text in args.prompt]
    for i, row in enumerate(prompts):
        bad = [t for t in row if not 0 <= t < cfg.vocab_size]
        if bad or not row:
            raise InputError(f"prompt {i}: need >= 1 token id in [0, {cfg.vocab_size}); got {len(row)} ids, "
                             f"out of range: {bad[:5]}")
    max_len = args.max_len or cfg.max_position_embeddings
    stop = args.stop_token if args.stop_token is not None else list(cfg.eos_token_id or ())
    stop = stop + _stop_ids(args.stop or [], tokenizer)
    if chat_mode:  # a turn ends where the next one (user or tool output) would begin
        stop = sorted(set(stop) | set(chat.stop_token_ids(tokenizer.tokenizer)))
    kw = {"max_new_tokens": args.max_new_tokens, "max_len": max_len, "temperature": args.temperature,
          "top_k": args.top_k, "top_p": args.top_p, "stop_tokens": stop, "seed": args.seed,
          "pad_id": cfg.pad_token_id or 0}
    with sharding.use_mesh(mesh):
        if args.speculative:
            out, stats = generate_speculative(graphdef, params, buffers, prompts, **kw)
            print(f"MTP speculation: {stats.acceptance_rate:.1%} of {int(np.sum(stats.drafted))} drafts accepted, "
                  f"{tokens_per_forward(out, stats):.2f} tokens per forward pass")
        else:
            out = generate(graphdef, params, buffers, prompts, **kw)
        tokens, logprobs, lengths = (np.asarray(a) for a in (out.tokens, out.logprobs, out.lengths))
    completions = []
    for i, n in enumerate(lengths):
        new = [int(t) for t in tokens[i, :n]]
        completions.append(new)
        text = repr(tokenizer._decode(new)) if tokenizer else ""
        print(f"[{i}] {len(new)} tokens, log-prob {logprobs[i, :n].sum():.4f}: {new} {text}".rstrip())
    return completions


"""Score token sequences: per-token log-probabilities and the total log-likelihood (perplexity's basis).

    python -m glm46_jax.score --hf-dir DIR --tokens 1,2,3
    python -m glm46_jax.score --checkpoint runs/tiny --text "def f(x):" --out logits.npy

`--text` needs a tokenizer: `<hf-dir>/tokenizer.json`, or for a checkpoint the corpus tokenizer that
training copied into its run dir (`checkpoint.tokenizer_path`), or any `tokenizer.json` given with `--tokenizer`.
Scoring uses the main model only, so a directory saved by transformers (no MTP layer) scores too, with a warning.
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from glm46_jax import cli
from glm46_jax.errors import InputError
from glm46_jax.infer.load import Tokenizer, add_model_args, load_model
from glm46_jax.model import apply
from glm46_jax.parallel import sharding
from glm46_jax.training.loss import token_nll


def _parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m glm46_jax.score", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    inp = p.add_mutually_exclusive_group(required=True)
    inp.add_argument("--tokens", help="comma-separated token ids, e.g. 1,2,3")
    inp.add_argument("--text", help="text to tokenize and score")
    p.add_argument("--tokenizer", help="a tokenizer.json path (default: see above)")
    p.add_argument("--out", help="save the logits [tokens, vocab] (float32) to this .npy file")
    return p


def token_logprobs(logits: Float[Array, "b s v"], tokens: Int[Array, "b s"]) -> Float[Array, "b s-1"]:
    """log p(tokens[:, t] | tokens[:, :t]) for t >= 1, computed in fp32."""
    return -token_nll(logits[:, :-1], tokens[:, 1:])


def main(argv: list[str] | None = None) -> float:
    """Prints the table; returns the total log-likelihood."""
    args = _parser().parse_args(argv)
    if args.tokens is not None:  # checked before the (slow) load
        try:
            ids = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise InputError(f"--tokens={args.tokens!r}: expected comma-separated integers") from None
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    cfg, graphdef, params, buffers, tok_spec = load_model(mesh, hf_dir=args.hf_dir, checkpoint=args.checkpoint,
                                                          dtype=args.dtype, tokenizer=args.tokenizer)
    tokenizer = None
    if args.text is not None:
        tokenizer = Tokenizer(tok_spec)
        ids = tokenizer.encode(args.text)
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad or len(ids) < 2:
        raise InputError(f"need >= 2 token ids in [0, {cfg.vocab_size}); got {len(ids)} ids, out of range: {bad[:5]}")

    tokens = jnp.asarray([ids], jnp.int32)
    with sharding.use_mesh(mesh):
        logits = jax.jit(lambda p, b, t: apply(graphdef, p, b, t, with_mtp=False).logits)(params, buffers, tokens)
        logp = np.asarray(token_logprobs(logits, tokens))[0]
    print(f"{'pos':>5} {'token':>8}  {'logprob':>10}  piece")
    for pos, (token, lp) in enumerate(zip(ids[1:], logp), start=1):
        piece = repr(tokenizer.piece(token)) if tokenizer else ""
        print(f"{pos:>5} {token:>8}  {lp:>10.4f}  {piece}")
    total = float(logp.sum())
    print(f"total log-likelihood {total:.4f} over {len(logp)} predicted tokens; "
          f"mean {total / len(logp):.4f}; perplexity {math.exp(-total / len(logp)):.3f}")
    if args.out:
        np.save(args.out, np.asarray(logits[0], np.float32))
        print(f"logits {tuple(logits.shape[1:])} saved to {args.out}")
    return total


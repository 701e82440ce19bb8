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
import os

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from glm46_jax import cli
from glm46_jax.cli import InputError
from glm46_jax.model import apply
from glm46_jax.parallel import sharding
from glm46_jax.training.loss import token_nll


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--hf-dir | --checkpoint (one of them) and --dtype: what `load_model` reads (score, eval, generate)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-dir", help="Hugging Face GLM-4.5/4.6 directory (config.json + safetensors)")
    src.add_argument("--checkpoint", help="a training run directory or one of its checkpoints")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")


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


class _Tokenizer:
    def __init__(self, spec: str):
        self.spec = spec
        if not os.path.exists(spec):
            raise FileNotFoundError(f"{spec}: tokenizer.json not found (pass --tokenizer PATH)")
        from tokenizers import Tokenizer
        try:
            tok = Tokenizer.from_file(spec)
        except Exception as e:  # any parse failure means: not a tokenizer.json
            raise InputError(f"{spec}: not a readable tokenizer.json ({e})") from e
        self.tokenizer = tok  # the tokenizers.Tokenizer itself (what glm46_jax.infer.chat encodes with)
        self._encode = lambda text: tok.encode(text, add_special_tokens=False).ids
        self._decode = lambda ids: tok.decode(list(ids), skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._encode(text)]

    def piece(self, token: int) -> str:
        return self._decode([token])


def load_model(args: argparse.Namespace, mesh: jax.sharding.Mesh):
    """(cfg, graphdef, params, buffers, tokenizer path) from `--hf-dir` or `--checkpoint` (and `--dtype`,
    `--tokenizer` if the command has them): score's and eval's shared loading."""
    runtime = {"dtype": args.dtype}
    if args.hf_dir:
        from glm46_jax.interop.hf import load_hf
        cfg, graphdef, params, buffers = load_hf(args.hf_dir, mesh, **runtime)
        default_tok = os.path.join(args.hf_dir, "tokenizer.json")
    else:
        from glm46_jax.training.checkpoint import latest_checkpoint, load_params, tokenizer_path
        cfg, graphdef, params, buffers = load_params(args.checkpoint, mesh, **runtime)
        step_dir = latest_checkpoint(args.checkpoint)
        default_tok = tokenizer_path(step_dir) or os.path.join(step_dir, "tokenizer.json")
    return cfg, graphdef, params, buffers, getattr(args, "tokenizer", None) or default_tok


def main(argv: list[str] | None = None) -> float:
    """Prints the table; returns the total log-likelihood."""
    args = _parser().parse_args(argv)
    if args.tokens is not None:  # checked before the (slow) load
        try:
            ids = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise InputError(f"--tokens={args.tokens!r}: expected comma-separated integers") from None
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    cfg, graphdef, params, buffers, tok_spec = load_model(args, mesh)
    tokenizer = None
    if args.text is not None:
        tokenizer = _Tokenizer(tok_spec)
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


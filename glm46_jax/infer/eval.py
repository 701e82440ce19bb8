"""Held-out perplexity per domain of a corpus: every held-out document of each domain, exactly once.

    python -m glm46_jax.eval --checkpoint runs/midtrain_tiny --corpus data/sample
    python -m glm46_jax.eval --hf-dir path/to/GLM-4.6 --corpus data/corpus --domains code,web --seq-len 4096

Prints one row per domain (documents, predicted tokens, CE in nats/token, perplexity) and the
token-weighted total, e.g. the domain and the general data side by side after mid-training
(`configs/midtrain.py`); `--out` also writes them as JSON. Training logs the same quantity on a few
batches as eval/<domain>/ce (`train.eval_per_domain`); this reads the whole split.

Documents are best-fit packed into rows of `--seq-len` tokens, so none is cut short; a document
longer than a row is split into pieces that overlap by one token, so each of its next-token targets is
predicted exactly once (a document of n tokens gives n - 1 predictions, each conditioned on at most
a row of context).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from glm46_jax import cli
from glm46_jax.cli import InputError
from glm46_jax.data import loader
from glm46_jax.infer.load import add_model_args, load_model
from glm46_jax.model import apply
from glm46_jax.parallel import sharding
from glm46_jax.training.loss import token_nll

Batch = dict[str, np.ndarray]


def _parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m glm46_jax.eval", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--corpus", required=True, help="a corpus written by data_prep (metadata.json + heldout shards)")
    p.add_argument("--domains", help="comma-separated domains (default: every domain with held-out data)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row (default 256)")
    p.add_argument("--batch", type=int, default=8, help="rows per forward pass (default 8)")
    p.add_argument("--out", help="also write the results as JSON here")
    return p


def heldout_batches(root: str, domain: str, seq_len: int, rows: int) -> Iterator[Batch]:
    """The domain's whole held-out split as [rows, seq_len] batches; the last is padded with empty rows
    (loss_mask 0), so every batch has one shape and compiles once."""
    cfg = loader.LoaderConfig(root=root, split="heldout", num_epochs=1, process_index=0, process_count=1)
    pad_id = int(loader.read_metadata(root)["tokenizer"]["pad_id"])
    packed = loader.pack_documents(loader.domain_documents(cfg, domain), seq_len + 1, "best_fit", pad_id,
                                   cfg.pack_bins, cfg.seed)
    for batch in packed.map(functools.partial(loader.shift_row, pad_id=pad_id)).batch(rows, drop_remainder=False):
        yield loader.pad_rows(batch, rows, pad_id)


def _nll_sums(graphdef, params, buffers, batch: dict[str, Array]) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """(sum of the masked next-token NLL, number of masked targets) of one batch, in fp32."""
    logits = apply(graphdef, params, buffers, batch["inputs"], batch["positions"], batch["segment_ids"],
                   with_mtp=False).logits
    mask = batch["loss_mask"].astype(jnp.float32)
    return jnp.sum(token_nll(logits, batch["targets"]) * mask), jnp.sum(mask)


def domain_perplexity(graphdef, params, buffers, mesh: jax.sharding.Mesh, root: str, domain: str, seq_len: int,
                      rows: int) -> dict[str, Any]:
    """{"domain", "tokens" (predicted), "ce", "ppl"} over the domain's whole held-out split."""
    step = jax.jit(functools.partial(_nll_sums, graphdef))
    total, count = 0.0, 0.0
    with sharding.use_mesh(mesh):
        for batch in heldout_batches(root, domain, seq_len, rows):
            nll, n = step(params, buffers, loader.to_global(batch, mesh))
            total, count = total + float(nll), count + float(n)  # summed on the host in float64
    ce = total / count if count else float("nan")
    return {"domain": domain, "tokens": int(count), "ce": ce, "ppl": math.exp(ce) if count else float("nan")}


def _domains(root: str, requested: str | None) -> list[str]:
    known = loader.known_domains(root)
    if requested:
        names = [d.strip() for d in requested.split(",") if d.strip()]
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise InputError(f"--domains: {unknown} are not in the corpus at {root}; it has {known}")
        missing = [d for d in names if not loader.has_split(root, d, "heldout")]
        if missing:
            raise InputError(f"--domains: {missing} have no held-out data in {root}")
        return names
    names = [d for d in known if loader.has_split(root, d, "heldout")]
    if not names:
        raise InputError(f"{root}: no domain has held-out data (data_prep --heldout-fraction)")
    return names


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Prints the table; returns one result per domain, then the token-weighted total."""
    args = _parser().parse_args(argv)
    if args.seq_len < 1 or args.batch < 1:
        raise InputError(f"--seq-len={args.seq_len} and --batch={args.batch} must be >= 1")
    domains = _domains(args.corpus, args.domains)  # checked before the (slow) model load
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    cfg, graphdef, params, buffers, _ = load_model(mesh, hf_dir=args.hf_dir, checkpoint=args.checkpoint,
                                                   dtype=args.dtype)
    vocab = int(loader.read_metadata(args.corpus)["tokenizer"]["vocab_size"])
    if vocab > cfg.vocab_size:
        raise InputError(f"{args.corpus}: its tokenizer has {vocab} ids, more than the model's vocab_size="
                         f"{cfg.vocab_size}; evaluate on a corpus tokenized for this model")
    results = [domain_perplexity(graphdef, params, buffers, mesh, args.corpus, d, args.seq_len, args.batch)
               for d in domains]
    tokens = sum(r["tokens"] for r in results)
    ce = sum(r["ce"] * r["tokens"] for r in results) / tokens if tokens else float("nan")
    results.append({"domain": "all", "tokens": tokens, "ce": ce, "ppl": math.exp(ce) if tokens else float("nan")})
    print(f"{'domain':<16} {'tokens':>12} {'CE':>8} {'ppl':>10}")
    for r in results:
        print(f"{r['domain']:<16} {r['tokens']:>12,} {r['ce']:>8.4f} {r['ppl']:>10.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return results


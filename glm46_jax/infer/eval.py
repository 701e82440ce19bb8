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

Forgetting gate: `--baseline DIR` (a run, a checkpoint or an HF directory) scores a second model on the same
held-out batches and adds its CE and the difference (model - baseline, in nats and relative) to every row;
`--guard code,web --max-regression 0.02` then exits 1 when a guarded domain's CE rose by more than 2% of the
baseline's, naming the domain and by how much:

    python -m glm46_jax.eval --checkpoint runs/midtrain_tiny --baseline runs/tiny --corpus data/sample \\
        --guard prose --max-regression 0.02

Long-context retrieval: `--passkey CASES.jsonl` (instead of --corpus) scores synthetic passkey cases and prints
the accuracy per (context length, needle depth) cell (glm46_jax/infer/passkey.py):

    python -m glm46_jax.eval --checkpoint runs/tiny --passkey data/passkey/cases.jsonl --out passkey.json
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from glm46_jax import cli
from glm46_jax.errors import InputError
from glm46_jax.data import loader
from glm46_jax.infer import passkey
from glm46_jax.infer.load import add_model_args, load_model
from glm46_jax.model import apply
from glm46_jax.parallel import sharding
from glm46_jax.training.loss import token_nll

Batch = dict[str, np.ndarray]
DEFAULT_MAX_REGRESSION = 0.02  # --max-regression: a guarded domain's CE may rise by 2% of the baseline's
DEFAULT_SEQ_LEN = 256


def _parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m glm46_jax.eval", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--corpus", help="a corpus written by data_prep (metadata.json + heldout shards)")
    what.add_argument("--passkey", metavar="CASES.jsonl", help="passkey retrieval accuracy per (length, depth) cell "
                                                               "on cases written by `python -m data_prep passkey`")
    p.add_argument("--domains", help="comma-separated domains (default: every domain with held-out data)")
    p.add_argument("--seq-len", type=int, help=f"tokens per row (default {DEFAULT_SEQ_LEN})")
    p.add_argument("--batch", type=int, default=8, help="rows per forward pass (default 8)")
    p.add_argument("--out", help="also write the results as JSON here")
    gate = p.add_argument_group("forgetting gate")
    gate.add_argument("--baseline", help="a second model scored on the same batches: a training run directory, one "
                                         "of its checkpoints, or a Hugging Face directory")
    gate.add_argument("--guard", help="comma-separated domains (or 'all') whose CE may not rise above the "
                                      "baseline's by more than --max-regression (exit 1 if one does); needs --baseline")
    gate.add_argument("--max-regression", type=float, help=f"largest allowed (CE - baseline CE) / baseline CE of a "
                                                           f"guarded domain (default {DEFAULT_MAX_REGRESSION})")
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


@functools.partial(jax.jit, static_argnums=0)  # one compile per architecture, shared by both models and every domain
def _nll_sums(graphdef, params, buffers, batch: dict[str, Array]) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """(sum of the masked next-token NLL, number of masked targets) of one batch, in fp32."""
    logits = apply(graphdef, params, buffers, batch["inputs"], batch["positions"], batch["segment_ids"],
                   with_mtp=False).logits
    mask = batch["loss_mask"].astype(jnp.float32)
    return jnp.sum(token_nll(logits, batch["targets"]) * mask), jnp.sum(mask)


def domain_perplexity(graphdef, params, buffers, mesh: jax.sharding.Mesh, root: str, domain: str, seq_len: int,
                      rows: int, digest: Any = None) -> dict[str, Any]:
    """{"domain", "tokens" (predicted), "ce", "ppl"} over the domain's whole held-out split. `digest` (a hashlib
    object), when given, is fed every batch's arrays: two models compared are shown to have read the same batches."""
    total, count = 0.0, 0.0
    with sharding.use_mesh(mesh):
        for batch in heldout_batches(root, domain, seq_len, rows):
            if digest is not None:
                for key in sorted(batch):
                    digest.update(np.ascontiguousarray(batch[key]).tobytes())
            nll, n = _nll_sums(graphdef, params, buffers, loader.to_global(batch, mesh))
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


def _guarded(requested: str | None, domains: list[str], root: str) -> list[str]:
    """The --guard domains, each one evaluated ('all' is the token-weighted total)."""
    if requested is None:
        return []
    names = [d.strip() for d in requested.split(",") if d.strip()]
    if not names:
        raise InputError(f"--guard={requested!r}: name at least one domain; available: {domains + ['all']}")
    available = set(domains) | {"all"}
    unknown = [d for d in names if d not in available]
    if unknown:
        where = f"held-out data of {root}" if set(unknown) - set(loader.known_domains(root)) else "--domains"
        raise InputError(f"--guard: {unknown} not in the {where}; available: {domains + ['all']}")
    return list(dict.fromkeys(names))


def _is_hf_dir(path: str) -> bool:
    """config.json + safetensors at the top (a run dir has a config.json too, but its weights are under
    checkpoints/)."""
    return (os.path.isfile(os.path.join(path, "config.json"))
            and not os.path.isfile(os.path.join(path, "meta", "metadata"))
            and (os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
                 or any(f.endswith(".safetensors") for f in os.listdir(path))))


def _baseline_source(path: str) -> dict[str, str]:
    """`load_model`'s keyword for --baseline: {"hf_dir": path} or {"checkpoint": path}."""
    if not os.path.isdir(path):
        raise InputError(f"--baseline {path}: not a directory; give a training run, one of its checkpoints or a "
                         "Hugging Face directory (config.json + *.safetensors)")
    if _is_hf_dir(path):
        return {"hf_dir": path}
    from glm46_jax.training.checkpoint import latest_checkpoint
    try:
        latest_checkpoint(path)
    except FileNotFoundError as e:
        raise InputError(f"--baseline {path}: neither a Hugging Face directory (config.json + *.safetensors) nor a "
                         f"checkpoint ({e})") from e
    return {"checkpoint": path}


def _tokenizer_file(source: dict[str, str | None]) -> str | None:
    """The tokenizer.json that `load_model` would find for this model (None: it carries none)."""
    if source.get("hf_dir"):
        path = os.path.join(source["hf_dir"], "tokenizer.json")
        return path if os.path.isfile(path) else None
    from glm46_jax.training.checkpoint import latest_checkpoint, tokenizer_path
    return tokenizer_path(latest_checkpoint(source["checkpoint"]))


def _same_tokenizer(a: str, b: str) -> bool:
    """Same bytes, or the same JSON (one file re-indented or with its keys reordered is the same tokenizer)."""
    with open(a, "rb") as fa, open(b, "rb") as fb:
        da, db = fa.read(), fb.read()
    if da == db:
        return True
    try:
        return json.loads(da) == json.loads(db)
    except ValueError:
        return False


def _check_tokenizers(model: dict[str, str | None], baseline: dict[str, str | None]) -> None:
    """InputError when the model and the baseline carry different tokenizer.json files: their CEs on one
    tokenization would not measure the same thing. A side that carries none cannot be compared (a note)."""
    tok_model, tok_base = _tokenizer_file(model), _tokenizer_file(baseline)
    if tok_model and tok_base:
        if not _same_tokenizer(tok_model, tok_base):
            raise InputError(f"--baseline: the tokenizers differ: the model's {tok_model} and the baseline's "
                             f"{tok_base}; compare models that share a tokenizer")
        return
    missing = " and ".join(w for w, t in (("the model", tok_model), ("the baseline", tok_base)) if not t)
    print(f"note: tokenizers not compared: no tokenizer.json found for {missing}", file=sys.stderr)


def _score(mesh: jax.sharding.Mesh, source: dict[str, str | None], flag: str, args: argparse.Namespace,
           domains: list[str], digests: dict[str, Any]) -> list[dict[str, Any]]:
    """One model's rows: each domain, then the token-weighted total. The model is freed on return."""
    cfg, graphdef, params, buffers, _ = load_model(mesh, hf_dir=source.get("hf_dir"),
                                                   checkpoint=source.get("checkpoint"), dtype=args.dtype)
    vocab = int(loader.read_metadata(args.corpus)["tokenizer"]["vocab_size"])
    if vocab > cfg.vocab_size:
        raise InputError(f"{args.corpus}: its tokenizer has {vocab} ids, more than the vocab_size={cfg.vocab_size} "
                         f"of {flag} {source.get('hf_dir') or source.get('checkpoint')}; evaluate on a corpus "
                         "tokenized for this model")
    results = [domain_perplexity(graphdef, params, buffers, mesh, args.corpus, d, args.seq_len, args.batch,
                                 digests.setdefault(d, hashlib.sha256()))
               for d in domains]
    tokens = sum(r["tokens"] for r in results)
    ce = sum(r["ce"] * r["tokens"] for r in results) / tokens if tokens else float("nan")
    results.append({"domain": "all", "tokens": tokens, "ce": ce, "ppl": math.exp(ce) if tokens else float("nan")})
    return results


def _relative(ce: float, base: float) -> float:
    return (ce - base) / base if base else (0.0 if ce == base else math.copysign(math.inf, ce - base))


def _print_table(results: list[dict[str, Any]], baseline: bool) -> None:
    head = f"{'domain':<16} {'tokens':>12} {'CE':>8} {'ppl':>10}"
    print(head + (f" {'base CE':>8} {'base ppl':>10} {'CE diff':>8} {'rel diff':>9}" if baseline else ""))
    for r in results:
        row = f"{r['domain']:<16} {r['tokens']:>12,} {r['ce']:>8.4f} {r['ppl']:>10.3f}"
        if baseline:
            row += (f" {r['baseline_ce']:>8.4f} {r['baseline_ppl']:>10.3f} {r['ce_diff']:>+8.4f}"
                    f" {r['ce_rel_diff']:>+9.2%}")
        print(row)


def evaluate(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Prints the table (and the guard's verdict); returns one result per domain, then the token-weighted total.

    With --baseline each row also has baseline_ce, baseline_ppl, ce_diff (CE - baseline CE, nats/token) and
    ce_rel_diff (ce_diff / baseline CE); with --guard each guarded row has max_regression and regressed (bool).
    With --passkey instead of --corpus: one result per (length, depth) cell (glm46_jax/infer/passkey.py)."""
    args = _parser().parse_args(argv)
    if args.passkey:
        return passkey.evaluate(args)
    args.seq_len = DEFAULT_SEQ_LEN if args.seq_len is None else args.seq_len
    if args.seq_len < 1 or args.batch < 1:
        raise InputError(f"--seq-len={args.seq_len} and --batch={args.batch} must be >= 1")
    if args.guard is not None and not args.baseline:
        raise InputError("--guard needs --baseline: the CE of a guarded domain is compared with the baseline's")
    if args.max_regression is not None and args.guard is None:
        raise InputError(f"--max-regression={args.max_regression} needs --guard (the domains it applies to)")
    max_regression = DEFAULT_MAX_REGRESSION if args.max_regression is None else args.max_regression
    if not (math.isfinite(max_regression) and max_regression >= 0):
        raise InputError(f"--max-regression={args.max_regression}: must be a finite number >= 0 (0.02 = 2%)")
    # everything the user gave is checked before the (slow) model loads
    domains = _domains(args.corpus, args.domains)
    guard = _guarded(args.guard, domains, args.corpus)
    model = {"hf_dir": args.hf_dir, "checkpoint": args.checkpoint}
    baseline = _baseline_source(args.baseline) if args.baseline else None
    if baseline:
        _check_tokenizers(model, baseline)

    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    digests: dict[str, Any] = {}
    results = _score(mesh, model, "--hf-dir" if args.hf_dir else "--checkpoint", args, domains, digests)
    if baseline:
        seen = {d: h.hexdigest() for d, h in digests.items()}
        digests = {}
        base = _score(mesh, baseline, "--baseline", args, domains, digests)
        if seen != {d: h.hexdigest() for d, h in digests.items()}:  # the packing is seeded: a bug if it happens
            raise RuntimeError("the baseline was scored on other held-out batches than the model")
        for r, b in zip(results, base, strict=True):
            r.update(baseline_ce=b["ce"], baseline_ppl=b["ppl"], ce_diff=r["ce"] - b["ce"],
                     ce_rel_diff=_relative(r["ce"], b["ce"]))
    _print_table(results, bool(baseline))

    by_domain = {r["domain"]: r for r in results}
    for d in guard:
        r = by_domain[d]
        # a CE that could not be measured (no predicted tokens) is not a pass
        r.update(max_regression=max_regression, regressed=not r["ce_rel_diff"] <= max_regression)
        verdict = "REGRESSED" if r["regressed"] else "ok"
        print(f"guard {verdict}: {d} CE {r['baseline_ce']:.4f} -> {r['ce']:.4f} ({r['ce_diff']:+.4f} nats/token, "
              f"{r['ce_rel_diff']:+.2%}; allowed +{max_regression:.2%})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return results


def main(argv: list[str] | None = None) -> int:
    """The command line: `evaluate`, then exit code 1 when a guarded domain regressed past --max-regression."""
    results = evaluate(argv)
    failed = [r["domain"] for r in results if r.get("regressed")]
    if failed:
        print(f"forgetting gate failed: CE of {', '.join(failed)} rose more than allowed over the baseline",
              file=sys.stderr)
        return 1
    return 0

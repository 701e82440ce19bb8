"""Passkey retrieval accuracy per (context length, needle depth) cell: `python -m glm46_jax.eval --passkey`.

    python -m data_prep passkey --tokenizer data/sample/tokenizer.json --out data/passkey --lengths 256,512,1024
    python -m glm46_jax.eval --checkpoint runs/tiny --passkey data/passkey/cases.jsonl --out passkey.json

A case (data_prep/passkey.py) is a prompt of `length` tokens with a key hidden at `depth`, and the key's answer
tokens. It counts as retrieved when the model's argmax at every answer position, teacher-forced on the prompt and
the answer's earlier tokens, is the answer's token there. That is exactly whether greedy decoding of len(answer)
tokens would produce the answer (each greedy step sees the same prefix as long as every earlier step was right), at
the cost of one forward pass per case instead of one per answer token. Prints a table, rows = lengths, columns =
depths, each cell "accuracy (n)"; `--out` writes the cells as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from glm46_jax.config import ModelConfig
from glm46_jax.data import loader
from glm46_jax.errors import InputError, json_lines
from glm46_jax.infer.load import load_model
from glm46_jax.model import abstract_model, apply
from glm46_jax.parallel import sharding

ROW_MULTIPLE = 16  # rows are padded to a multiple of this: one compiled forward per few lengths, not per length


@dataclasses.dataclass(frozen=True)
class Case:
    length: int
    depth: float
    prompt: tuple[int, ...]
    answer: tuple[int, ...]
    tokenizer_sha256: str | None = None

    @property
    def tokens(self) -> int:
        """Tokens the model reads: the prompt and every answer token but the last."""
        return len(self.prompt) + len(self.answer) - 1


def _ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)


def parse_case(row: dict[str, Any], where: str) -> Case:
    """One case (a line of a cases file, as an object); InputError naming `where` (file:line) and what is wrong."""
    missing = [k for k in ("length", "depth", "prompt", "answer") if k not in row]
    if missing:
        raise InputError(f"{where}: the case has no {', '.join(missing)}")
    if not _ids(row["prompt"]) or not _ids(row["answer"]) or not row["answer"]:
        raise InputError(f"{where}: prompt and answer must be lists of token ids (>= 0), the answer not empty")
    depth, length = row["depth"], row["length"]
    if not (isinstance(depth, (int, float)) and not isinstance(depth, bool) and 0 <= depth <= 1):
        raise InputError(f"{where}: depth={depth!r} must be a number in [0, 1]")
    if length != len(row["prompt"]):
        raise InputError(f"{where}: length={length!r} but the prompt has {len(row['prompt'])} tokens")
    return Case(length, float(depth), tuple(row["prompt"]), tuple(row["answer"]), row.get("tokenizer_sha256"))


def read_cases(path: str) -> list[Case]:
    """Every case of a cases file (JSON lines, written by `python -m data_prep passkey`; blank lines skipped);
    InputError on the first bad line."""
    if not os.path.isfile(path):
        raise InputError(f"--passkey {path}: no such file; write one with `python -m data_prep passkey`")
    cases = [parse_case(row, where) for where, row in json_lines(path, "--passkey")]
    if not cases:
        raise InputError(f"--passkey {path}: no cases in the file")
    return cases


def check_fits(cases: Sequence[Case], vocab_size: int, max_positions: int, source: str) -> None:
    """InputError when a case has a token id the model does not have or more tokens than its positions."""
    longest = max(cases, key=lambda c: c.tokens)
    if longest.tokens > max_positions:
        raise InputError(f"a case of length {longest.length} needs {longest.tokens} positions (prompt + answer - 1), "
                         f"more than the max_position_embeddings={max_positions} of {source}; drop the longer "
                         "lengths from the cases")
    top = max(max(c.prompt + c.answer) for c in cases)
    if top >= vocab_size:
        raise InputError(f"a case has token id {top}, not below the vocab_size={vocab_size} of {source}; make the "
                         "cases with the model's tokenizer")


def check_tokenizer(cases: Sequence[Case], tokenizer_file: str | None) -> None:
    """InputError when the cases were tokenized with another tokenizer.json than the model's (by the sha256 of its
    bytes); a note when the model carries none, or the cases record none, and nothing can be compared."""
    recorded = {c.tokenizer_sha256 for c in cases} - {None}
    if not recorded or tokenizer_file is None or not os.path.isfile(tokenizer_file):
        print("note: tokenizers not compared: the model carries no tokenizer.json or the cases record no "
              "tokenizer_sha256", file=sys.stderr)
        return
    with open(tokenizer_file, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    if recorded != {sha}:
        raise InputError(f"the cases were tokenized with another tokenizer than the model's {tokenizer_file} (sha256 "
                         f"{min(recorded)[:12]}... vs {sha[:12]}...); regenerate them with `python -m data_prep "
                         "passkey --tokenizer` that file")


def answer_rows(cases: Sequence[Case], width: int, pad_id: int) -> dict[str, np.ndarray]:
    """[len(cases), width] inputs (prompt + answer[:-1], right-padded), next-token targets and the answer mask."""
    batch = {k: np.full((len(cases), width), pad_id if k != "answer_mask" else 0, np.int32)
             for k in ("inputs", "targets", "answer_mask")}
    for i, c in enumerate(cases):
        seq = c.prompt + c.answer
        batch["inputs"][i, :len(seq) - 1] = seq[:-1]
        batch["targets"][i, :len(seq) - 1] = seq[1:]
        batch["answer_mask"][i, len(c.prompt) - 1:len(seq) - 1] = 1
    return batch


def batches(cases: Sequence[Case], rows: int, pad_id: int, max_positions: int
            ) -> Iterator[tuple[list[int], dict[str, np.ndarray]]]:
    """(case indices, batch) in order of length, `rows` cases each: padded to a multiple of ROW_MULTIPLE tokens
    (attention is causal, so the padding after a row never reaches its answer) and filled up to `rows` with empty
    rows, so a grid compiles one forward per few lengths. The MoE must be dropless (capacity 0): padding and rows
    then never compete for expert slots."""
    order = sorted(range(len(cases)), key=lambda i: cases[i].tokens)
    for start in range(0, len(order), rows):
        idx = order[start:start + rows]
        width = min(-(-max(cases[i].tokens for i in idx) // ROW_MULTIPLE) * ROW_MULTIPLE, max_positions)
        batch = answer_rows([cases[i] for i in idx], width, pad_id)
        short = rows - len(idx)
        yield idx, {k: np.pad(v, ((0, short), (0, 0)), constant_values=pad_id if k != "answer_mask" else 0)
                    for k, v in batch.items()}


@functools.partial(jax.jit, static_argnums=0)  # one compile per architecture and row shape
def _answer_hits(graphdef, params, buffers, batch: dict[str, Array]) -> tuple[Int[Array, "b"], Int[Array, "b"]]:
    """(answer positions whose argmax is the answer token, answer positions) per row; only these leave the device."""
    logits = apply(graphdef, params, buffers, batch["inputs"], with_mtp=False).logits
    mask = batch["answer_mask"]
    hits = (jnp.argmax(logits, axis=-1) == batch["targets"]) & (mask > 0)
    return jnp.sum(hits, axis=-1), jnp.sum(mask, axis=-1)


def retrieved(cfg: ModelConfig, graphdef, params, buffers, mesh: jax.sharding.Mesh, cases: Sequence[Case],
              rows: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """(exact match per case: every answer token is the argmax, correct answer tokens per case), `rows` cases per
    forward pass."""
    if cfg.moe_capacity_factor > 0:  # rows of a batch (and padding) must not crowd each other out of experts
        cfg = cfg.replace(moe_capacity_factor=0.0)
        graphdef, _, _ = abstract_model(cfg, mesh)
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    exact, correct = np.zeros(len(cases), bool), np.zeros(len(cases), np.int64)
    with sharding.use_mesh(mesh):
        for idx, batch in batches(cases, rows, pad_id, cfg.max_position_embeddings):
            hits, n = jax.device_get(_answer_hits(graphdef, params, buffers, loader.to_global(batch, mesh)))
            exact[idx], correct[idx] = (hits == n)[:len(idx)], hits[:len(idx)]
    return exact, correct


def cells(cases: Sequence[Case], exact: np.ndarray, correct: np.ndarray) -> list[dict[str, Any]]:
    """One row per (length, depth) cell, sorted: n, retrieved, accuracy (exact match) and token_accuracy."""
    groups: dict[tuple[int, float], list[int]] = {}
    for i, c in enumerate(cases):
        groups.setdefault((c.length, c.depth), []).append(i)
    out = []
    for (length, depth), idx in sorted(groups.items()):
        answer_tokens = sum(len(cases[i].answer) for i in idx)
        out.append({"length": length, "depth": depth, "n": len(idx), "retrieved": int(exact[idx].sum()),
                    "accuracy": float(exact[idx].mean()), "token_accuracy": float(correct[idx].sum() / answer_tokens)})
    return out


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Lengths down, depths across, each cell "accuracy (n)"; an empty cell is "-"."""
    depths = sorted({r["depth"] for r in rows})
    lengths = sorted({r["length"] for r in rows})
    at = {(r["length"], r["depth"]): r for r in rows}
    lines = [f"{'length/depth':<14}" + "".join(f"{d:>14g}" for d in depths)]
    for length in lengths:
        line = f"{length:<14}"
        for d in depths:
            r = at.get((length, d))
            line += f"{'-':>14}" if r is None else f"{r['accuracy']:>9.2f} ({r['n']})".rjust(14)
        lines.append(line)
    return "\n".join(lines)


def evaluate(args: argparse.Namespace) -> list[dict[str, Any]]:
    """`python -m glm46_jax.eval --passkey FILE`: prints the table, writes --out; returns the cells."""
    for flag in ("domains", "seq_len", "baseline", "guard", "max_regression"):
        if getattr(args, flag) is not None:
            raise InputError(f"--{flag.replace('_', '-')} applies to --corpus, not to --passkey")
    if args.batch < 1:
        raise InputError(f"--batch={args.batch} must be >= 1")
    cases = read_cases(args.passkey)  # checked before the (slow) model load
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    cfg, graphdef, params, buffers, tok = load_model(mesh, hf_dir=args.hf_dir, checkpoint=args.checkpoint,
                                                     dtype=args.dtype)
    source = f"--hf-dir {args.hf_dir}" if args.hf_dir else f"--checkpoint {args.checkpoint}"
    check_fits(cases, cfg.vocab_size, cfg.max_position_embeddings, source)
    check_tokenizer(cases, tok)
    exact, correct = retrieved(cfg, graphdef, params, buffers, mesh, cases, args.batch)
    result = cells(cases, exact, correct)
    print(f"passkey retrieval (exact match of the answer tokens), {len(cases)} cases of {args.passkey}")
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result

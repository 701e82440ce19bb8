"""`python -m data_prep passkey`: synthetic passkey retrieval cases, generated offline. A random key hidden in filler
text at a chosen depth of a context of a chosen length, then the question that asks for it (Mohtashami & Jaggi 2023,
"Landmark Attention"); `python -m glm46_jax.eval --passkey` scores a model on them (docs/evaluation.md).

    python -m data_prep passkey --tokenizer data/sample/tokenizer.json --out data/passkey \\
        --lengths 256,512,1024,2048 --depths 0,0.25,0.5,0.75,1 --cases 20 [--train-cases 4000 --train-lengths 256]

writes into --out:
  cases.jsonl   --cases per (length, depth) cell of the grid, cells in grid order
  train.jsonl   with --train-cases N: N cases for training, each at one of --train-lengths (uniformly) and a depth
                uniform in [0, 1], with keys that no case of cases.jsonl has
One case per line: {"length", "depth", "key", "needle_at", "prompt": [ids], "answer": [ids], "tokenizer_sha256"}.

A case's prompt is exactly `length` tokens: F filler tokens with the needle's tokens inserted after the first
round(depth * F) of them, then the question's tokens; `needle_at` is that insertion point. The filler, the needle,
the question and the answer are tokenized separately and joined as ids, so the length and the needle's place are
exact (joined as text, a BPE could merge across the seams), at the price of a needle that may split a filler word.
The answer is the tokens of " KEY", as they would follow the question's "The pass key is". The filler is a fixed
text repeated (default) or a text file's tokens, read cyclically from a seeded offset per case. Everything is drawn
from `random.Random(seed)`, so a seed and the same arguments give the same bytes. `tokenizer_sha256` is the sha256
of the tokenizer.json's bytes (what metadata.json records for a corpus): the eval refuses cases made with another
tokenizer than the model's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet

from data_prep import tokenizer
from glm46_jax import atomic
from glm46_jax.errors import InputError

# The filler, needle and question of the original passkey test: the filler says nothing about the key.
# Each piece starts with a space and ends without one, so pieces join as the text would read.
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
ANSWER = " {key}"
CASES_FILE, TRAIN_FILE = "cases.jsonl", "train.jsonl"

Encode = Callable[[str], list[int]]


def make_case(encode: Encode, filler: Sequence[int], length: int, depth: float, key: str, offset: int
              ) -> dict[str, object]:
    """One case of exactly `length` prompt tokens: filler from `filler[offset:]` (cyclic), the needle after
    round(depth * F) of its F tokens, then the question."""
    needle, question = encode(NEEDLE.format(key=key)), encode(QUESTION)
    fill = length - len(needle) - len(question)
    if fill < 0:
        raise InputError(f"length {length}: shorter than the needle and the question ({len(needle) + len(question)} "
                         "tokens); use longer --lengths")
    at = math.floor(depth * fill + 0.5)  # round half up: depth 0.5 of 5 tokens is 3, not Python's banker's 2
    ids = [filler[(offset + i) % len(filler)] for i in range(fill)]
    return {"length": length, "depth": depth, "key": key, "needle_at": at,
            "prompt": ids[:at] + needle + ids[at:] + question, "answer": encode(ANSWER.format(key=key))}


def _key(rng: random.Random, digits: int, taken: AbstractSet[str]) -> str:
    while (key := "".join(rng.choice("0123456789") for _ in range(digits))) in taken:
        pass
    return key


def grid_cases(encode: Encode, filler: Sequence[int], lengths: Sequence[int], depths: Sequence[float], per_cell: int,
               seed: int, digits: int = 5) -> list[dict[str, object]]:
    """`per_cell` cases of every (length, depth) cell, lengths outer; keys and filler offsets drawn with `seed`."""
    rng = random.Random(seed)
    return [make_case(encode, filler, length, depth, _key(rng, digits, frozenset()), rng.randrange(len(filler)))
            for length in lengths for depth in depths for _ in range(per_cell)]


def train_cases(encode: Encode, filler: Sequence[int], lengths: Sequence[int], count: int, seed: int,
                digits: int = 5, exclude: AbstractSet[str] = frozenset()) -> list[dict[str, object]]:
    """`count` cases at lengths drawn from `lengths`, depths uniform in [0, 1], keys not in `exclude`."""
    rng = random.Random(seed + 1)  # another stream than the grid's: same seed, different keys
    if not lengths:
        raise InputError("training cases need at least one length (--train-lengths)")
    if 10 ** digits - len(exclude) < 1:
        raise InputError(f"--key-digits {digits}: every key is in the grid; use more digits")
    return [make_case(encode, filler, rng.choice(lengths), rng.random(), _key(rng, digits, exclude),
                      rng.randrange(len(filler))) for _ in range(count)]


def filler_tokens(encode: Encode, text: str | None = None) -> list[int]:
    """The filler's tokens, read cyclically by the cases: `text`'s, or FILLER's."""
    ids = encode(FILLER if text is None else text)
    if not ids:
        raise InputError("the filler text has no tokens")
    return ids


def _jsonl(cases: list[dict[str, object]], sha: str) -> str:
    return "".join(json.dumps({**c, "tokenizer_sha256": sha}) + "\n" for c in cases)


def write(out: str, tokenizer_path: str, lengths: Sequence[int], depths: Sequence[float], per_cell: int,
          seed: int = 0, digits: int = 5, train_lengths: Sequence[int] = (), train_count: int = 0,
          filler_path: str | None = None) -> dict[str, int]:
    """cases.jsonl (and train.jsonl with `train_count`) under `out`; returns how many cases each holds."""
    info = tokenizer.load(tokenizer_path)
    tok = tokenizer.encoder(info)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    text = None
    if filler_path is not None:
        with open(filler_path, encoding="utf-8") as f:
            text = f.read()
    filler = filler_tokens(encode, text)
    files = {CASES_FILE: grid_cases(encode, filler, lengths, depths, per_cell, seed, digits)}
    if train_count:
        files[TRAIN_FILE] = train_cases(encode, filler, train_lengths, train_count, seed, digits,
                                        {c["key"] for c in files[CASES_FILE]})
    os.makedirs(out, exist_ok=True)  # only once every case is made: a mistake writes nothing
    for name, cases in files.items():
        atomic.write_text(os.path.join(out, name), _jsonl(cases, info.sha256))
    return {name.removesuffix(".jsonl"): len(cases) for name, cases in files.items()}


# --- the command line (data_prep/cli.py registers it) -----------------------------------------------------

def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated token counts, e.g. 256,512") from err
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected one or more token counts >= 1")
    return values


def _depths(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated depths in [0, 1]") from err
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected one or more depths in [0, 1]")
    return values


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("passkey")
    g.add_argument("--tokenizer", required=True, metavar="tokenizer.json", help="the model's tokenizer")
    g.add_argument("--lengths", type=_ints, default=[256, 512, 1024],
                   help="prompt tokens of the grid's rows (default 256,512,1024)")
    g.add_argument("--depths", type=_depths, default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="needle depths of the grid's columns, 0 = the first token, 1 = just before the question "
                        "(default 0,0.25,0.5,0.75,1)")
    g.add_argument("--cases", type=int, default=20, help="cases per (length, depth) cell (default 20)")
    g.add_argument("--key-digits", type=int, default=5, help="digits of the pass key (default 5)")
    g.add_argument("--filler", metavar="FILE.txt", help="filler text (default: the fixed sentences of the original "
                                                        "test, repeated)")
    g.add_argument("--train-cases", type=int, default=0, help="also write this many training cases (train.jsonl)")
    g.add_argument("--train-lengths", type=_ints, help="prompt tokens of the training cases (default: --lengths)")
    g.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> None:
    for name in ("cases", "key_digits"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.train_cases < 0:
        raise InputError(f"--train-cases {args.train_cases}: must be >= 0")
    if not os.path.isfile(args.tokenizer):
        raise InputError(f"--tokenizer {args.tokenizer}: no such file; pass the model's tokenizer.json")
    if args.filler is not None and not os.path.isfile(args.filler):
        raise InputError(f"--filler {args.filler}: no such file")
    counts = write(args.out, args.tokenizer, args.lengths, args.depths, args.cases, args.seed, args.key_digits,
                   args.train_lengths or args.lengths, args.train_cases, args.filler)
    cells = len(args.lengths) * len(args.depths)
    print(f"{counts['cases']} cases ({cells} cells x {args.cases}) -> {os.path.join(args.out, CASES_FILE)}")
    if "train" in counts:
        print(f"{counts['train']} training cases -> {os.path.join(args.out, TRAIN_FILE)}")

"""A built-in, offline, byte-level corpus: the docstrings of a fixed list of stdlib modules.

A stop-gap so training runs end to end on any machine without network or prepared data. The
real pipeline (Grain over ArrayRecord, mixtures, packing, per-host sharding, checkpointable
iterators) arrives in a later issue and replaces this module; nothing here is meant to scale.

* Text: every docstring (module, class, function) of `STDLIB_MODULES`, read from the running
  interpreter's stdlib sources with `ast` (nothing is imported). The list is fixed and sorted,
  so the corpus is deterministic for a given Python version (it differs slightly across versions).
* Split: the docstrings of every `holdout_every`-th module form the held-out set, so eval text
  comes from modules the model never trained on.
* Tokens: 0 = pad, 1 = eos, 2..257 = the UTF-8 bytes; documents are concatenated with an eos
  after each one (GPT-2 style, no cross-document attention mask: fine for a smoke corpus).
* Batches: next-token windows of `seq_len + 1` tokens cut from the flat stream, split into
  `inputs` / `targets`. Training batch `i` depends only on `(seed, i)`, so a run is reproducible
  and could resume at any step without iterator state.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import sysconfig
from collections.abc import Iterator, Sequence

import numpy as np
from jaxtyping import Int

PAD_ID = 0
EOS_ID = 1
BYTE_OFFSET = 2  # byte b has id b + 2
VOCAB_SIZE = 256 + BYTE_OFFSET  # the smallest model vocab that can hold every id

# Modules with plenty of prose in their docstrings. Dotted names map to stdlib paths
# (`a.b` -> a/b.py or a/b/__init__.py); a module missing from this Python version is skipped.
STDLIB_MODULES: tuple[str, ...] = tuple(sorted((
    "_pydatetime", "_pydecimal", "argparse", "ast", "asyncio.base_events", "asyncio.events", "asyncio.locks",
    "asyncio.queues", "asyncio.streams", "asyncio.tasks", "base64", "bisect", "calendar", "cmd", "codecs",
    "collections", "concurrent.futures._base", "configparser", "contextlib", "copy", "csv", "dataclasses",
    "difflib", "email.message", "email.utils", "enum", "fileinput", "fnmatch", "fractions", "ftplib",
    "functools", "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "html", "http.client", "http.cookiejar",
    "imaplib", "inspect", "ipaddress", "json", "json.decoder", "json.encoder", "logging", "logging.handlers",
    "mailbox", "mimetypes", "multiprocessing.pool", "netrc", "numbers", "operator", "optparse", "os", "pathlib",
    "pickle", "pkgutil", "platform", "plistlib", "poplib", "pprint", "pydoc", "queue", "random", "re",
    "reprlib", "sched", "secrets", "selectors", "shlex", "shutil", "smtplib", "socket", "socketserver",
    "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "trace", "traceback", "turtle", "typing", "unittest.case", "unittest.mock", "urllib.parse",
    "urllib.request", "uuid", "warnings", "wave", "weakref", "zipfile", "zoneinfo._zoneinfo",
)))

Batch = dict[str, np.ndarray]  # {"inputs": int32 [b, s], "targets": int32 [b, s]}


# --- tokenizer --------------------------------------------------------------------------------

def encode(text: str) -> Int[np.ndarray, " n"]:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + BYTE_OFFSET


def decode(ids: Sequence[int] | np.ndarray) -> str:
    """Bytes back to text; eos becomes a newline, pad is dropped, broken UTF-8 is replaced."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    out = bytearray()
    for i in ids:
        if i >= BYTE_OFFSET:
            out.append(int(i) - BYTE_OFFSET)
        elif i == EOS_ID:
            out += b"\n"
    return out.decode("utf-8", errors="replace")


# --- corpus -----------------------------------------------------------------------------------

def _module_path(stdlib: str, name: str) -> str | None:
    base = os.path.join(stdlib, *name.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def module_docstrings(path: str, min_chars: int = 40) -> list[str]:
    """Docstrings of a source file in source order (module, then classes/functions depth-first)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    docs: list[str] = []

    def visit(node: ast.AST):
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc) >= min_chars:
            docs.append(doc)
        for child in getattr(node, "body", ()):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child)

    visit(tree)
    return docs


def _stream(docs: list[str]) -> Int[np.ndarray, " n"]:
    parts = []
    for doc in docs:
        parts += [encode(doc), np.array([EOS_ID], np.int32)]
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


@dataclasses.dataclass(frozen=True)
class ByteCorpus:
    train: Int[np.ndarray, " n"]  # flat token stream, documents separated by eos
    heldout: Int[np.ndarray, " m"]
    train_modules: tuple[str, ...]
    heldout_modules: tuple[str, ...]


def stdlib_docstrings(modules: Sequence[str] = STDLIB_MODULES, holdout_every: int = 10) -> ByteCorpus:
    """The corpus: docstrings of `modules`; every `holdout_every`-th found module is held out."""
    stdlib = sysconfig.get_paths()["stdlib"]
    found = [(m, p) for m in sorted(modules) if (p := _module_path(stdlib, m)) is not None]
    if not found:
        raise FileNotFoundError(f"none of the {len(modules)} corpus modules exist under {stdlib}")
    heldout = [m for i, (m, _) in enumerate(found) if i % holdout_every == holdout_every - 1]
    train_docs: list[str] = []
    heldout_docs: list[str] = []
    for m, path in found:
        (heldout_docs if m in heldout else train_docs).extend(module_docstrings(path))
    train_mods = tuple(m for m, _ in found if m not in heldout)
    return ByteCorpus(_stream(train_docs), _stream(heldout_docs), train_mods, tuple(heldout))


# --- batches ----------------------------------------------------------------------------------

def _windows(stream: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    w = stream[starts[:, None] + np.arange(seq_len + 1)]
    return {"inputs": w[:, :-1], "targets": w[:, 1:]}


def train_batch(stream: Int[np.ndarray, " n"], step: int, batch_size: int, seq_len: int, seed: int) -> Batch:
    """Batch `step`: `batch_size` windows at offsets drawn from a generator seeded by (seed, step)."""
    if len(stream) <= seq_len + 1:
        raise ValueError(f"stream of {len(stream)} tokens is too short for seq_len={seq_len}")
    rng = np.random.default_rng((seed, step))
    starts = rng.integers(0, len(stream) - seq_len, size=batch_size)
    return _windows(stream, starts, seq_len)


def train_batches(stream: Int[np.ndarray, " n"], batch_size: int, seq_len: int, seed: int,
                  start_step: int = 0) -> Iterator[Batch]:
    step = start_step
    while True:
        yield train_batch(stream, step, batch_size, seq_len, seed)
        step += 1


def eval_batches(stream: Int[np.ndarray, " n"], batch_size: int, seq_len: int, num_batches: int) -> list[Batch]:
    """Fixed eval set: consecutive non-overlapping windows from the start (wrapping if the text is short)."""
    n_windows = len(stream) // (seq_len + 1)
    if n_windows == 0:
        raise ValueError(f"held-out stream of {len(stream)} tokens is too short for seq_len={seq_len}")
    index = np.arange(num_batches * batch_size) % n_windows
    starts = (index * (seq_len + 1)).reshape(num_batches, batch_size)
    return [_windows(stream, s, seq_len) for s in starts]

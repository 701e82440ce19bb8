"""The embedded default corpus: two domains cut from the running Python's standard library, offline.

* `code`:  the stdlib `.py` files, one document per file.
* `prose`: docstrings (module, class, function; read with `ast`, nothing is imported, as in
  the byte-level corpus of the first prototype did) of at least `MIN_DOCSTRING_CHARS`, the reference topics that
  ship as `pydoc_data/topics.py` (the text of `help("with")` etc.), and `*.txt`/`*.rst` files.

Test suites, `site-packages` and caches are left out. When a domain has more than `max_docs`
candidates, a fixed hash of each document's origin picks which ones (spread over the whole library,
not just the modules that sort first); the picked documents keep sorted path order. The two domains
are written as JSON lines under `<out>/_source/` and then go through the ordinary pipeline, so the
sample exercises the same readers, rules and writers as real data.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sysconfig
from typing import Any

from glm46_jax import atomic

SOURCE_DIR = "_source"  # '_' cannot start a domain name, so this never collides with <out>/<domain>
MIN_DOCSTRING_CHARS = 100
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
TEXT_SUFFIXES = (".txt", ".rst")

Record = dict[str, str]  # {"text": ..., "origin": "relative/path.py:line"}


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str, suffixes: tuple[str, ...]) -> list[str]:
    """Relative paths of the library's files with these suffixes, sorted, without test suites."""
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS and not d.startswith("."))
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in sorted(files) if f.endswith(suffixes)]
    return sorted(out)


def _read(root: str, rel: str) -> str | None:
    try:
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None


def docstrings(source: str, rel: str) -> list[Record]:
    """Every docstring of at least MIN_DOCSTRING_CHARS, module first, then classes/functions depth-first."""
    try:
        tree = ast.parse(source, filename=rel)
    except (SyntaxError, ValueError):
        return []
    out: list[Record] = []

    def visit(node: ast.AST) -> None:
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc) >= MIN_DOCSTRING_CHARS:
            out.append({"text": doc, "origin": f"{rel}:{getattr(node, 'lineno', 1)}"})
        for child in getattr(node, "body", ()):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child)

    visit(tree)
    return out


def pydoc_topics(source: str, rel: str) -> list[Record]:
    """The `topics = {...}` dict literal of pydoc_data/topics.py, one document per topic."""
    for node in ast.parse(source, filename=rel).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
            return [{"text": text, "origin": f"{rel}:{name}"} for name, text in sorted(topics.items())]
    return []


def pick(records: list[Record], max_docs: int) -> list[Record]:
    """At most `max_docs` records chosen by a fixed hash of their origin, in their original order."""
    if len(records) <= max_docs:
        return records
    rank = sorted(range(len(records)), key=lambda i: hashlib.blake2b(records[i]["origin"].encode()).digest())
    return [records[i] for i in sorted(rank[:max_docs])]


def build_sources(out: str, max_docs: int) -> tuple[tuple[tuple[str, str], ...], dict[str, Any]]:
    """Writes `<out>/_source/{code,prose}.jsonl`; returns (pipeline inputs, counts of what was found)."""
    root = stdlib_root()
    code, prose, unreadable = [], [], []
    for rel in stdlib_files(root, (".py",)):
        source = _read(root, rel)
        if source is None:
            unreadable.append(rel)
            continue
        code.append({"text": source, "origin": rel})
        topics = pydoc_topics(source, rel) if rel == os.path.join("pydoc_data", "topics.py") else []
        prose += topics or docstrings(source, rel)
    for rel in stdlib_files(root, TEXT_SUFFIXES):
        if (text := _read(root, rel)) is None:
            unreadable.append(rel)
        else:
            prose.append({"text": text, "origin": rel})
    found = {"stdlib": root, "code_candidates": len(code), "prose_candidates": len(prose), "unreadable": unreadable}
    inputs = []
    for domain, records in (("code", code), ("prose", prose)):
        path = os.path.join(out, SOURCE_DIR, f"{domain}.jsonl")
        atomic.write_lines(path, (json.dumps(r, ensure_ascii=False) for r in pick(records, max_docs)))
        inputs.append((domain, path))
    return tuple(inputs), found

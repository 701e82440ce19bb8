"""The records that flow between stages, and the on-disk "document set" that lets each stage run alone.

A document set is a directory holding `<domain>.jsonl` (one `{"text", "source"}` object per line, in
pipeline order) and `stats.json` (the domain order, the malformed-input reports and every stage's
statistics so far). `ingest` writes one; `clean`, `filter` and `dedup` read one and write the next;
`train-tokenizer` and `write` read one. `pipeline` keeps the same lists in memory instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

from glm46_jax import atomic
from glm46_jax.cli import InputError

STATS_FILE = "stats.json"


@dataclasses.dataclass(frozen=True, slots=True)
class Document:
    domain: str
    source: str  # "file:line" (or "file:row N", "tfds:name@split:index"): where the text came from
    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class Malformed:
    """An input unit that could not become a document; reported, never raised."""

    file: str
    line: int  # 1-based; 1 for problems that concern a whole file (e.g. an empty file)
    kind: str  # "invalid_json" | "missing_field" | "invalid_utf8" | "empty_file" | "blank_line" | ...
    message: str

    @property
    def location(self) -> str:
        return f"{self.file}:{self.line}"

    def to_json(self) -> dict[str, Any]:
        return {"location": self.location, "kind": self.kind, "message": self.message}


def text_digest(text: str) -> bytes:
    """16-byte content hash; used for the heldout split and for shard fingerprints."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def by_domain(docs: list[Document]) -> dict[str, list[Document]]:
    out: dict[str, list[Document]] = {}
    for d in docs:
        out.setdefault(d.domain, []).append(d)
    return out


# --- document sets on disk -----------------------------------------------------------------------

def save_docset(path: str, docs: list[Document], domains: list[str], stats: dict[str, Any]) -> None:
    """Writes every domain file and then `stats.json` (last, so its presence means the set is complete)."""
    os.makedirs(path, exist_ok=True)
    grouped = by_domain(docs)
    for domain in domains:
        rows = (json.dumps({"text": d.text, "source": d.source}, ensure_ascii=False) for d in grouped.get(domain, []))
        atomic.write_lines(os.path.join(path, f"{domain}.jsonl"), rows)
    atomic.write_json(os.path.join(path, STATS_FILE), {**stats, "domains": domains})


def load_docset(path: str) -> tuple[list[Document], list[str], dict[str, Any]]:
    """(documents in pipeline order, domain order, stats) of a set written by `save_docset`."""
    stats_path = os.path.join(path, STATS_FILE)
    if not os.path.isfile(stats_path):
        raise FileNotFoundError(f"{path} is not a document set (no {STATS_FILE}); create one with `ingest`")
    remake = "re-create the set with `ingest` and the stages after it"
    try:
        with open(stats_path, encoding="utf-8") as f:
            stats = json.load(f)
        domains = stats.pop("domains")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise InputError(f"{stats_path}: not the stats of a document set ({type(err).__name__}: {err}); "
                         f"{remake}") from err
    docs: list[Document] = []
    for domain in domains:
        domain_path = os.path.join(path, f"{domain}.jsonl")
        with open(domain_path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                docs.append(_docset_row(line, domain, f"{domain_path}:{lineno}", remake))
    return docs, domains, stats


def _docset_row(line: str, domain: str, where: str, remake: str) -> Document:
    """Unlike raw inputs, a document set is our own output: a bad line means the set was edited or
    damaged, and skipping it would silently change every later stage, so it stops the command."""
    try:
        row = json.loads(line)
        if isinstance(row, dict) and isinstance(row.get("text"), str) and isinstance(row.get("source"), str):
            return Document(domain, row["source"], row["text"])
        problem = 'expected {"text": str, "source": str}'
    except json.JSONDecodeError as err:
        problem = f"invalid JSON: {err.msg} at column {err.colno}"
    raise InputError(f"{where}: {problem}; {remake}")

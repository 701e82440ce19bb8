"""What the readers yield: documents, and reports of input that could not become one."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any


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

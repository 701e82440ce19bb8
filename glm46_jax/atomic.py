"""Crash-safe file writes: write a temporary sibling, fsync it, `os.replace` it over the final name.

A reader (or a resumed run) therefore sees either the old file or the complete new one, never a torn
write. Temporary names start with `.` and end in `.tmp` so that globs like `shard-*.array_record` never
match a half-written file.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any


def temp_path(path: str) -> str:
    """The temporary sibling of `path`; the pid keeps two concurrent runs from sharing one."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{os.getpid()}.tmp")


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: str, path: str) -> None:
    """Make the finished `tmp` durable and give it its final name (atomic on POSIX)."""
    fsync_path(tmp)
    os.replace(tmp, path)
    # The rename itself lives in the directory entry, which needs its own fsync to survive a power cut.
    fsync_path(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yields a temporary path to write; on success it replaces `path`, on error it is removed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = temp_path(path)
    try:
        yield tmp
        commit(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_bytes(path: str, data: bytes) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str, obj: Any) -> None:
    # sort_keys + fixed indent: the same content always gives the same bytes (resume compares outputs).
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def write_lines(path: str, lines: Iterator[str]) -> None:
    """Streams `lines` (each without its newline) to `path` atomically."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for line in lines:
            f.write(line)
            f.write("\n")

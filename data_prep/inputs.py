"""Input specs (`--input DOMAIN=PATH|GLOB|DIR|tfds:NAME[@SPLIT]`) and the readers for each format.

Readers never raise on bad content: a malformed JSON line, a missing/non-string text field, invalid
UTF-8 or an empty file becomes a `Malformed` report naming `file:line`, and the reader goes on with the
next line. Only problems with the *request* itself (a path that matches nothing, an unknown TFDS name,
a missing optional dependency) raise, before any work starts.

Formats by file suffix: `.jsonl`/`.ndjson`/`.json` -> JSON lines, `.parquet`/`.pq` -> Parquet, anything
else -> plain text (one document per file, or per line with `text_lines`). Line numbers are 1-based;
for Parquet rows and TFDS examples the "line" is the 1-based row/example number.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import fsspec

from data_prep.documents import Document, Malformed

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
TFDS_PREFIX = "tfds:"
_DOMAIN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # it becomes a directory name
_INSTALL_HINT = "install the data extras: pip install 'glm46_jax[data]'"

ReadItem = Document | Malformed  # readers yield both, in file order


@dataclasses.dataclass(frozen=True)
class ReaderOptions:
    text_field: str = "text"  # JSONL key and TFDS feature holding the document text
    parquet_column: str | None = None  # None: same as text_field
    text_lines: bool = False  # plain-text files: one document per line instead of per file
    tfds_data_dir: str | None = None


@dataclasses.dataclass(frozen=True)
class ReadTask:
    """One unit of reading work (a file or a TFDS split), handed to a worker process."""

    domain: str
    kind: str  # "jsonl" | "text" | "parquet" | "tfds"
    path: str  # a file path, or "NAME@SPLIT" for tfds


def parse_input(arg: str) -> tuple[str, str]:
    """`DOMAIN=SPEC` -> (domain, spec), with a usable error for the command line."""
    domain, sep, spec = arg.partition("=")
    if not sep or not spec:
        raise ValueError(f"--input {arg!r}: expected DOMAIN=PATH, DOMAIN=GLOB or DOMAIN=tfds:NAME[@SPLIT]")
    if not _DOMAIN_RE.match(domain):
        raise ValueError(f"--input {arg!r}: domain {domain!r} must start with a letter or digit and use only "
                         "letters, digits, '_', '.' and '-'")
    return domain, spec


def _kind(path: str) -> str:
    lower = path.lower()
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def _files_under(directory: str) -> list[str]:
    out = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [os.path.join(root, f) for f in sorted(files) if not f.startswith(".")]
    return out


def _remote_matches(spec: str) -> list[str]:
    """As `_matches`, for an fsspec URL (s3://..., gs://...): the same rules through the URL's filesystem."""
    fs, path = fsspec.core.url_to_fs(spec)
    protocol = spec.split("://", 1)[0]
    found = sorted(fs.glob(path)) if glob.has_magic(path) else ([path] if fs.exists(path) else [])
    out = []
    for match in found:
        if fs.isdir(match):
            out += [f for f in sorted(fs.find(match))
                    if not any(part.startswith(".") for part in f[len(match):].split("/"))]
        else:
            out.append(match)
    return [f"{protocol}://{f}" for f in out]


def _matches(spec: str) -> list[str]:
    """Files named by a path, directory (all files below it, hidden ones skipped) or glob, sorted."""
    if "://" in spec:
        return _remote_matches(spec)
    matches = sorted(glob.glob(spec, recursive=True))
    return [path for m in matches for path in (_files_under(m) if os.path.isdir(m) else [m])]


def expand_inputs(inputs: list[tuple[str, str]], options: ReaderOptions) -> list[ReadTask]:
    """Every (domain, spec) as read tasks, in command-line order then sorted path order (deterministic)."""
    tasks: list[ReadTask] = []
    seen: set[tuple[str, str]] = set()
    for domain, spec in inputs:
        if spec.startswith(TFDS_PREFIX):
            name, _, split = spec[len(TFDS_PREFIX):].partition("@")
            path = f"{name}@{split or 'train'}"
            open_tfds(path, options.tfds_data_dir)  # fail now, not in a worker, if it does not exist
            tasks.append(ReadTask(domain, "tfds", path))
            continue
        files = _matches(spec)
        if not files:
            raise FileNotFoundError(f"--input {domain}={spec}: no file, directory or glob match "
                                    f"(or only empty directories)")
        for path in files:
            if (domain, path) not in seen:  # a file matched by two specs of one domain is read once
                seen.add((domain, path))
                tasks.append(ReadTask(domain, _kind(path), path))
    return tasks


def read_task(task: ReadTask, options: ReaderOptions) -> Iterator[ReadItem]:
    """The task's documents and malformed-input reports, streamed in file order."""
    readers = {"jsonl": read_jsonl, "text": read_text, "parquet": read_parquet, "tfds": read_tfds}
    return readers[task.kind](task.path, task.domain, options)


# --- readers ---------------------------------------------------------------------------------------

def _utf8_error(path: str, data: bytes, first_line: int, err: UnicodeDecodeError) -> Malformed:
    line = first_line + data.count(b"\n", 0, err.start)
    return Malformed(path, line, "invalid_utf8", f"invalid UTF-8 byte 0x{data[err.start]:02x}: {err.reason}")


def _read_bytes(path: str) -> bytes:
    with fsspec.open(path, "rb") as f:
        data = f.read()
    return data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark is not text


def _empty(path: str) -> Malformed:
    return Malformed(path, 1, "empty_file", "file is empty (or only whitespace)")


def _jsonl_line(raw: bytes, path: str, lineno: int, domain: str, field: str) -> Document | Malformed:
    raw = raw.rstrip(b"\r\n")
    if not raw.strip():
        return Malformed(path, lineno, "blank_line", "blank line in a JSON-lines file")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        return _utf8_error(path, raw, lineno, err)
    except json.JSONDecodeError as err:
        return Malformed(path, lineno, "invalid_json", f"{err.msg} at column {err.colno}")
    if not isinstance(obj, dict) or field not in obj:
        return Malformed(path, lineno, "missing_field", f"no {field!r} field in a JSON {type(obj).__name__}")
    if not isinstance(obj[field], str):
        return Malformed(path, lineno, "wrong_type", f"{field!r} is a {type(obj[field]).__name__}, not a string")
    return Document(domain, f"{path}:{lineno}", obj[field])


def read_jsonl(path: str, domain: str, options: ReaderOptions) -> Iterator[ReadItem]:
    """Streams the file line by line (a JSONL file may be far larger than one document)."""
    held: list[Malformed] = []  # reports before the first document: an all-blank file is one report
    any_doc = False
    with fsspec.open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark is not JSON
            item = _jsonl_line(raw, path, lineno, domain, options.text_field)
            if not any_doc and isinstance(item, Malformed):
                held.append(item)
                continue
            if not any_doc:
                any_doc = True
                yield from held
            yield item
    if not any_doc:
        yield from ([_empty(path)] if all(b.kind == "blank_line" for b in held) else held)


def read_text(path: str, domain: str, options: ReaderOptions) -> Iterator[ReadItem]:
    if not options.text_lines:  # one document per file: the file is the unit
        data = _read_bytes(path)
        if not data.strip():
            yield _empty(path)
            return
        try:
            yield Document(domain, f"{path}:1", data.decode("utf-8"))
        except UnicodeDecodeError as err:
            yield _utf8_error(path, data, 1, err)
        return
    any_text = False
    with fsspec.open(path, "rb") as f:
        # Blank lines become empty documents, which `clean` drops and counts as "empty".
        for lineno, raw in enumerate(f, 1):
            raw = raw.rstrip(b"\r\n")
            if lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            any_text = any_text or bool(raw.strip())
            try:
                yield Document(domain, f"{path}:{lineno}", raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                yield _utf8_error(path, raw, lineno, err)
    if not any_text:
        yield _empty(path)


def _value_to_text(value: Any, file: str, line: int, field: str) -> str | Malformed:
    if value is None:
        return Malformed(file, line, "missing_field", f"{field!r} is null")
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as err:
            return _utf8_error(file, bytes(value), line, err)
    if isinstance(value, str):
        return value
    return Malformed(file, line, "wrong_type", f"{field!r} is a {type(value).__name__}, not text")


def read_parquet(path: str, domain: str, options: ReaderOptions) -> Iterator[ReadItem]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(f"reading Parquet ({path}) needs pyarrow; {_INSTALL_HINT}") from err
    column = options.parquet_column or options.text_field
    with fsspec.open(path, "rb") as f:
        try:
            parquet = pq.ParquetFile(f)
        except Exception as err:  # pyarrow raises several types for a corrupt or non-Parquet file
            yield Malformed(path, 1, "unreadable_parquet", f"{type(err).__name__}: {err}")
            return
        if column not in parquet.schema_arrow.names:
            yield Malformed(path, 1, "missing_field", f"no column {column!r}; columns: {parquet.schema_arrow.names}")
            return
        if parquet.metadata.num_rows == 0:
            yield _empty(path)
            return
        row = 0
        for batch in parquet.iter_batches(columns=[column], batch_size=4096):
            for value in batch.column(0).to_pylist():
                row += 1
                text = _value_to_text(value, path, row, column)
                yield text if isinstance(text, Malformed) else Document(domain, f"{path}:{row}", text)


def open_tfds(name_split: str, data_dir: str | None):
    """`tfds.data_source` for "NAME@SPLIT": random access over ArrayRecord files, no TensorFlow import."""
    try:
        import tensorflow_datasets as tfds
    except ImportError as err:
        raise ImportError(f"reading TFDS dataset {name_split!r} needs tensorflow-datasets; {_INSTALL_HINT}") from err
    name, _, split = name_split.partition("@")
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir)
    except Exception as err:  # DatasetNotFoundError, unknown split, wrong file format, ...
        where = f"--input tfds:{name_split} (data_dir={data_dir})"
        raise FileNotFoundError(f"{where}: {type(err).__name__}: {err}") from err


def read_tfds(name_split: str, domain: str, options: ReaderOptions) -> Iterator[ReadItem]:
    source = open_tfds(name_split, options.tfds_data_dir)
    file, field = f"tfds:{name_split}", options.text_field
    if len(source) == 0:
        yield _empty(file)
        return
    for i in range(len(source)):
        example = source[i]
        if field not in example:  # the same for every example: report once, for the whole split
            message = f"no feature {field!r} (features: {sorted(example)}); none of {len(source)} examples read"
            yield Malformed(file, 1, "missing_field", message)
            return
        text = _value_to_text(example[field], file, i + 1, field)
        yield text if isinstance(text, Malformed) else Document(domain, f"{file}:{i + 1}", text)

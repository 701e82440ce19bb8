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
    size: int = 0  # bytes (set by `measured`): where the file lies on the task axis (slices.py)
    row_groups: tuple[int, ...] = ()  # Parquet: rows of each row group (the units it is split by)


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


def measured(task: ReadTask) -> ReadTask:
    """The task with its size and, for Parquet, its row groups (from the footer; none if it is unreadable)."""
    if task.kind == "tfds":
        return task
    size = fsspec.core.url_to_fs(task.path)[0].info(task.path).get("size") or 0
    groups: tuple[int, ...] = ()
    if task.kind == "parquet":
        try:
            import pyarrow.parquet as pq

            with fsspec.open(task.path, "rb") as f:
                meta = pq.ParquetFile(f).metadata
            groups = tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups))
        except Exception:  # noqa: BLE001  (ImportError, any corrupt file: one unit; the reader reports it)
            groups = ()
    return dataclasses.replace(task, size=int(size), row_groups=groups)


def read_task(task: ReadTask, options: ReaderOptions) -> Iterator[ReadItem]:
    """The whole file's documents and malformed-input reports, streamed in file order (with its `empty_file` report:
    see `read_piece` and `is_blank`)."""
    nonblank = 0
    for item in read_piece(task, options):
        nonblank += not is_blank(item, task, options)
        yield item
    if not nonblank:
        yield empty_file(label(task))


def read_piece(task: ReadTask, options: ReaderOptions, start: int = 0, end: int | None = None) -> Iterator[ReadItem]:
    """Documents and reports of the lines (JSONL, `text_lines`) whose first byte is in [start, end), the row groups
    [start, end) (Parquet) or the whole file (others: start 0), in file order. Line numbers count from the piece's
    first line (the file's lines when start is 0). A file with nothing but blank units gets one `empty_file` report,
    which only the caller that sees every piece can decide (`is_blank`)."""
    if task.kind == "tfds":
        return read_tfds(task.path, task.domain, options)
    if task.kind == "parquet":
        return read_parquet(task.path, task.domain, options, start, end)
    if task.kind == "jsonl":
        return read_jsonl(task.path, task.domain, options, start, end)
    return read_text(task.path, task.domain, options, start, end)


def is_blank(item: ReadItem, task: ReadTask, options: ReaderOptions) -> bool:
    """A unit that does not keep its file from being an empty file: a blank JSONL line, a blank text line."""
    if isinstance(item, Malformed):
        return item.kind == "blank_line"
    return task.kind == "text" and options.text_lines and not item.text.strip()


def label(task: ReadTask) -> str:
    """The file name reports give (a TFDS split's: tfds:NAME@SPLIT)."""
    return f"{TFDS_PREFIX}{task.path}" if task.kind == "tfds" else task.path


def empty_file(path: str) -> Malformed:
    return Malformed(path, 1, "empty_file", "file is empty (or only whitespace)")


# --- readers ---------------------------------------------------------------------------------------

def _utf8_error(path: str, data: bytes, first_line: int, err: UnicodeDecodeError) -> Malformed:
    line = first_line + data.count(b"\n", 0, err.start)
    return Malformed(path, line, "invalid_utf8", f"invalid UTF-8 byte 0x{data[err.start]:02x}: {err.reason}")


def _read_bytes(path: str) -> bytes:
    with fsspec.open(path, "rb") as f:
        data = f.read()
    return data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark is not text


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


def _lines(path: str, start: int, end: int | None) -> Iterator[bytes]:
    """The lines whose first byte lies in [start, end), streamed (a file may be far larger than memory)."""
    with fsspec.open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # the end of the line that began before `start` (just b"\n" if one begins at it)
        position = f.tell()
        for raw in f:
            if end is not None and position >= end:
                return
            position += len(raw)
            yield raw.removeprefix(b"\xef\xbb\xbf") if position == len(raw) else raw  # a BOM is not text


def read_jsonl(path: str, domain: str, options: ReaderOptions, start: int = 0,
               end: int | None = None) -> Iterator[ReadItem]:
    for lineno, raw in enumerate(_lines(path, start, end), 1):
        yield _jsonl_line(raw, path, lineno, domain, options.text_field)


def read_text(path: str, domain: str, options: ReaderOptions, start: int = 0,
              end: int | None = None) -> Iterator[ReadItem]:
    if not options.text_lines:  # one document per file: the file is the unit
        data = _read_bytes(path)
        if not data.strip():
            return
        try:
            yield Document(domain, f"{path}:1", data.decode("utf-8"))
        except UnicodeDecodeError as err:
            yield _utf8_error(path, data, 1, err)
        return
    # Blank lines become empty documents, which `clean` drops and counts as "empty".
    for lineno, raw in enumerate(_lines(path, start, end), 1):
        raw = raw.rstrip(b"\r\n")
        try:
            yield Document(domain, f"{path}:{lineno}", raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            yield _utf8_error(path, raw, lineno, err)


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


def read_parquet(path: str, domain: str, options: ReaderOptions, start: int = 0,
                 end: int | None = None) -> Iterator[ReadItem]:
    """Row groups [start, end); the file-level problems (unreadable, no such column) are the first piece's."""
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(f"reading Parquet ({path}) needs pyarrow; {_INSTALL_HINT}") from err
    column = options.parquet_column or options.text_field
    with fsspec.open(path, "rb") as f:
        try:
            parquet = pq.ParquetFile(f)
        except Exception as err:  # pyarrow raises several types for a corrupt or non-Parquet file
            if start == 0:
                yield Malformed(path, 1, "unreadable_parquet", f"{type(err).__name__}: {err}")
            return
        if column not in parquet.schema_arrow.names:
            if start == 0:
                yield Malformed(path, 1, "missing_field", f"no column {column!r}; columns: {parquet.schema_arrow.names}")
            return
        groups = range(start, parquet.num_row_groups if end is None else end)
        if not groups:
            return
        row = 0
        for batch in parquet.iter_batches(columns=[column], batch_size=4096, row_groups=groups):
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
    for i in range(len(source)):
        example = source[i]
        if field not in example:  # the same for every example: report once, for the whole split
            message = f"no feature {field!r} (features: {sorted(example)}); none of {len(source)} examples read"
            yield Malformed(file, 1, "missing_field", message)
            return
        text = _value_to_text(example[field], file, i + 1, field)
        yield text if isinstance(text, Malformed) else Document(domain, f"{file}:{i + 1}", text)

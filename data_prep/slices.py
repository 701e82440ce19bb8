"""Which part of the input each task reads: contiguous slices of all input files laid end to end, by bytes.

The files (in input order) occupy consecutive byte ranges of one axis of `total` bytes; task r of T owns the
positions [total * r // T, total * (r + 1) // T) (the last task also what lies beyond, should a file have grown).
A unit of input belongs to the task owning its first byte:

* JSON lines and plain text with `--text-lines`: each line (so one big file spreads over many tasks; a task seeks to
  its first byte and starts at the next line start);
* Parquet: each row group, placed at the file's offset plus its share of the file by rows;
* anything else (a whole text file, a TFDS split, an unreadable Parquet file): the file, at its first byte.

Owner is monotone in position and position in (input file, line), so ordering documents by (task, position in the
task) orders them by (input file, line) for any task count: the survivor rule of dedup and the shard order follow.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

from data_prep.inputs import ReaderOptions, ReadTask

TFDS_WEIGHT = 1  # a TFDS split has no byte size; one nominal byte places it on the axis


@dataclasses.dataclass(frozen=True)
class Piece:
    """The part of input file `file` one task reads: bytes [start, end) (line-split formats), row groups
    [start, end) (Parquet) or the whole file (start 0, end None); `end` None: to the end of the file."""

    file: int
    start: int = 0
    end: int | None = None

    @property
    def first(self) -> bool:
        """Holds the file's beginning: its file-level reports and its count in `ingest.files` are this task's."""
        return self.start == 0


def weight(task: ReadTask) -> int:
    return TFDS_WEIGHT if task.kind == "tfds" else task.size


def splits_by_line(task: ReadTask, reader: ReaderOptions) -> bool:
    return task.kind == "jsonl" or (task.kind == "text" and reader.text_lines)


def task_pieces(files: Sequence[ReadTask], reader: ReaderOptions, rank: int, world_size: int) -> list[Piece]:
    """The pieces task `rank` of `world_size` reads, in input order."""
    weights = [weight(f) for f in files]
    total = sum(weights)
    bounds = [total * r // world_size for r in range(world_size + 1)]
    lo, hi = bounds[rank], (bounds[rank + 1] if rank + 1 < world_size else float("inf"))

    def owner(position: int) -> int:
        return bisect.bisect_right(bounds, position, 0, world_size) - 1

    pieces, offset = [], 0
    for i, (task, w) in enumerate(zip(files, weights, strict=True)):
        if splits_by_line(task, reader) and w > 0:
            start, end = max(lo - offset, 0), min(hi - offset, w)
            if start < end:
                pieces.append(Piece(i, start, None if end >= w else int(end)))
        elif task.kind == "parquet" and task.row_groups:
            rows, before = sum(task.row_groups), 0
            mine = []
            for g, n in enumerate(task.row_groups):
                if owner(offset + w * before // max(rows, 1)) == rank:
                    mine.append(g)
                before += n
            if mine:
                pieces.append(Piece(i, mine[0], mine[-1] + 1))
        elif owner(offset) == rank:
            pieces.append(Piece(i))
        offset += w
    return pieces

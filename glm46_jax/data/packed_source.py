"""What the packed-sample loaders share: SFT samples (glm46_jax.data.sft_loader) and preference pairs
(glm46_jax.data.preference_loader) are both `python -m data_prep` datasets of token records, read as

    records (memory-mapped) -> shuffle(seed) -> repeat(num_epochs) -> [p::n] -> iter -> packing -> rows -> batches

Here: the config fields both loaders take (`SourceConfig`), the memory-mapped record source (`RecordSource`), this
process's records of a split (`split_records`) and the batching of rows with a padded last batch (`padded_batches`).
Each loader keeps what differs: its record, its packing, its row and its metadata kind.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import grain
import numpy as np

from glm46_jax.data import loader
from glm46_jax.errors import InputError


@dataclasses.dataclass(frozen=True)
class SourceConfig:
    root: str
    split: str = "train"
    seed: int = 0
    shuffle: bool = True  # a new order every epoch (Grain's shuffle reseeds per epoch of the repeat)
    num_epochs: int | None = None  # None = repeat forever (training); 1 = one pass (evaluation)
    pack_bins: int = 64  # rows packed at once: more bins, less padding, more memory
    process_index: int | None = None  # None = jax.process_index()
    process_count: int | None = None  # None = jax.process_count()

    def __post_init__(self):
        name = type(self).__name__
        if self.split not in loader.SPLITS:
            raise InputError(f"{name}.split={self.split!r}: must be one of {loader.SPLITS}")
        if self.pack_bins < 1 or (self.num_epochs is not None and self.num_epochs < 1):
            raise InputError(f"{name}: pack_bins and num_epochs must be >= 1")

    @property
    def processes(self) -> tuple[int, int]:
        """(index, count) of this process among the data-loading processes."""
        return loader.process_slot(self.process_index, self.process_count, type(self).__name__)


class RecordSource(grain.sources.RandomAccessDataSource):
    """The records of one split, from `<root>/<split>/<name>.npy` for each of `arrays`: memory-mapped on first use,
    so the source pickles small (mp_prefetch workers map the files themselves). A subclass says how many records
    there are (`count`) and what record `index` is (`record`)."""
    arrays: ClassVar[tuple[str, ...]] = ("tokens", "assistant_mask", "offsets")
    noun: ClassVar[str] = "records"  # what a record is called in messages: "samples", "pairs"

    def __init__(self, root: str, split: str):
        self.root, self.split = root, split
        self._arrays: dict[str, np.ndarray] | None = None
        self._len = self.count()

    def open(self, name: str) -> np.ndarray:
        return np.load(os.path.join(self.root, self.split, f"{name}.npy"), mmap_mode="r")

    def count(self) -> int:
        raise NotImplementedError

    def record(self, a: dict[str, np.ndarray], index: int) -> dict[str, Any]:
        raise NotImplementedError

    def tokens(self, a: dict[str, np.ndarray], lo: int, hi: int) -> dict[str, np.ndarray]:
        """Tokens [lo, hi) and their assistant mask, int32."""
        return {"tokens": np.asarray(a["tokens"][lo:hi], np.int32),
                "assistant_mask": np.asarray(a["assistant_mask"][lo:hi], np.int32)}

    def __getstate__(self):
        return {**self.__dict__, "_arrays": None}

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self._arrays is None:
            self._arrays = {name: self.open(name) for name in self.arrays}
        return self.record(self._arrays, index)


def split_records(source: RecordSource, cfg: SourceConfig) -> grain.IterDataset:
    """This process's records of the split, shuffled per epoch, repeated `num_epochs` times (None: forever)."""
    if not len(source):
        raise InputError(f"{cfg.root}: the {cfg.split} split has no {source.noun} (see metadata.json's splits)")
    ds = grain.MapDataset.source(source)
    if cfg.shuffle:
        ds = ds.shuffle(seed=cfg.seed)
    ds = ds.repeat(cfg.num_epochs)
    index, count = cfg.processes
    # Shuffle before slicing: one global order per epoch, so the processes' records are disjoint. Read in line, no
    # prefetch threads: a record is a memory-mapped slice, and Grain's default 500-deep prefetch scans its whole
    # buffer on every next() (0.1 s of a 2-core host's step, docs/performance.md#grain-prefetch-on-small-records).
    return ds[index::count].to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))


@dataclasses.dataclass(frozen=True)
class _PadBatch(grain.transforms.Map):
    """The short last batch of a finite pass, filled with empty rows (pad tokens, segment 0, no loss; zeros in any
    further field), so every batch has one shape and compiles once."""
    rows: int
    pad_id: int

    def map(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return loader.pad_rows(batch, self.rows, self.pad_id)


def padded_batches(rows: grain.IterDataset, cfg: SourceConfig, global_batch: int, pad_id: int) -> grain.IterDataset:
    """This process's share (global_batch / process_count rows) of each batch. A finite pass ends with a padded
    short batch instead of dropping the rest, so one pass sees every record exactly once."""
    local = loader.local_rows(global_batch, cfg.processes[1])
    return rows.batch(local, drop_remainder=False).map(_PadBatch(local, pad_id))

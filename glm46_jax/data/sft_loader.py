"""Grain pipeline over an SFT dataset (`python -m data_prep sft`): samples -> packed rows -> trainer batches.

Input: `<root>/metadata.json` ("kind": "sft") and `<root>/<split>/{tokens,assistant_mask,offsets}.npy`, sample i
being tokens[offsets[i]:offsets[i + 1]] with its assistant mask (docs/sft.md#the-dataset-on-disk).

    cfg = SFTLoaderConfig(root="data/sample_sft", seed=0)
    it = iter(sft_batches(cfg, seq_len=512, global_batch=16))
    batch = next(it)                              # inputs, targets, segment_ids, positions, loss_mask
    state = iterator_state.to_json(it)            # into the checkpoint; iterator_state.restore(it, state) resumes

Pipeline: samples (memory-mapped) -> shuffle(seed) -> repeat(num_epochs) -> [p::n] -> iter -> best-/first-fit
packing into rows of seq_len + 1 tokens, the assistant mask packed beside the tokens -> shift -> batch.

The batch is the pretraining loader's dict (glm46_jax/data/loader.py), all int32 [rows, seq_len], except that
loss_mask is the assistant mask shifted onto the targets: targets[j] = tokens[j + 1] is trained iff tokens[j + 1]
is assistant output and tokens[j], tokens[j + 1] are in the same sample (docs/sft.md#packed-rows).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Literal

import grain
import numpy as np
from jaxtyping import Int

from glm46_jax.errors import InputError
from glm46_jax.data import loader

SFTPackMode = Literal["best_fit", "first_fit"]
SFT_PACK_MODES: tuple[str, ...] = ("best_fit", "first_fit")
Batch = loader.Batch  # inputs, targets, segment_ids, positions, loss_mask: int32 [rows, seq_len]


@dataclasses.dataclass(frozen=True)
class SFTLoaderConfig:
    root: str
    split: str = "train"
    seed: int = 0
    shuffle: bool = True  # a new order every epoch (Grain's shuffle reseeds per epoch of the repeat)
    num_epochs: int | None = None  # None = repeat forever (training); 1 = one pass (evaluation)
    pack: SFTPackMode = "best_fit"
    pack_bins: int = 64  # rows packed at once: more bins, less padding, more memory
    num_workers: int = 0  # mp_prefetch worker processes; 0 = read in this process
    process_index: int | None = None  # None = jax.process_index()
    process_count: int | None = None  # None = jax.process_count()

    def __post_init__(self):
        if self.split not in loader.SPLITS:
            raise InputError(f"SFTLoaderConfig.split={self.split!r}: must be one of {loader.SPLITS}")
        if self.pack not in SFT_PACK_MODES:
            raise InputError(f"SFTLoaderConfig.pack={self.pack!r}: must be one of {SFT_PACK_MODES}")
        if self.pack_bins < 1 or self.num_workers < 0 or (self.num_epochs is not None and self.num_epochs < 1):
            raise InputError("SFTLoaderConfig: pack_bins and num_epochs must be >= 1, num_workers >= 0")

    @property
    def processes(self) -> tuple[int, int]:
        """(index, count) of this process among the data-loading processes."""
        return loader.process_slot(self.process_index, self.process_count, "SFTLoaderConfig")


def read_sft_metadata(root: str) -> dict[str, Any]:
    return loader.read_dataset_metadata(root, "sft", "an SFT dataset")


class SampleSource(grain.sources.RandomAccessDataSource):
    """The samples of one split as {"tokens", "assistant_mask"} int32 [n]; arrays memory-mapped on first use,
    so the source pickles small (mp_prefetch workers map the files themselves)."""

    def __init__(self, root: str, split: str):
        self.root, self.split = root, split
        self._arrays: dict[str, np.ndarray] | None = None
        self._len = len(self._offsets()) - 1

    def _offsets(self) -> np.ndarray:
        return np.load(os.path.join(self.root, self.split, "offsets.npy"), mmap_mode="r")

    def _load(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            self._arrays = {name: np.load(os.path.join(self.root, self.split, f"{name}.npy"), mmap_mode="r")
                            for name in ("tokens", "assistant_mask", "offsets")}
        return self._arrays

    def __getstate__(self):
        return {**self.__dict__, "_arrays": None}

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        a = self._load()
        lo, hi = int(a["offsets"][index]), int(a["offsets"][index + 1])
        return {"tokens": np.asarray(a["tokens"][lo:hi], np.int32),
                "assistant_mask": np.asarray(a["assistant_mask"][lo:hi], np.int32)}


def split_samples(cfg: SFTLoaderConfig) -> grain.IterDataset:
    """This process's samples of the split, shuffled per epoch, repeated `num_epochs` times (None: forever)."""
    source = SampleSource(cfg.root, cfg.split)
    if not len(source):
        raise InputError(f"{cfg.root}: the {cfg.split} split has no samples (see metadata.json's splits)")
    ds = grain.MapDataset.source(source)
    if cfg.shuffle:
        ds = ds.shuffle(seed=cfg.seed)
    ds = ds.repeat(cfg.num_epochs)
    index, count = cfg.processes
    # Shuffle before slicing: one global order per epoch, so the processes' samples are disjoint.
    return ds[index::count].to_iter_dataset()


def pack_samples(samples: grain.IterDataset, row_len: int, pad_id: int, mode: SFTPackMode = "best_fit",
                 pack_bins: int = 64, seed: int = 0) -> grain.IterDataset:
    """Rows of `row_len` tokens; the assistant mask travels with the tokens as a packed meta feature (padded with
    0), so it stays aligned with Grain's `tokens_segment_ids` / `tokens_positions`. A sample never spans rows."""
    pack = {"best_fit": grain.experimental.BestFitPackIterDataset,
            "first_fit": grain.experimental.FirstFitPackIterDataset}[mode]
    return pack(samples, length_struct={"tokens": row_len, "assistant_mask": row_len}, num_packing_bins=pack_bins,
                seed=seed, padding_struct={"tokens": pad_id, "assistant_mask": 0}, meta_features=("assistant_mask",))


def shift_sft_row(row: Mapping[str, np.ndarray], pad_id: int) -> dict[str, Int[np.ndarray, " seq"]]:
    """A packed row of L + 1 tokens -> the trainer's five int32 [L] fields (`loader.shift_row`), the loss mask
    narrowed to targets that are assistant output."""
    out = loader.shift_row(row, pad_id)
    out["loss_mask"] = out["loss_mask"] * (np.asarray(row["assistant_mask"])[1:] != 0).astype(np.int32)
    return out


@dataclasses.dataclass(frozen=True)
class _ShiftRow(grain.transforms.Map):
    pad_id: int

    def map(self, row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return shift_sft_row(row, self.pad_id)


@dataclasses.dataclass(frozen=True)
class _PadBatch(grain.transforms.Map):
    """The short last batch of a finite pass, filled with empty rows (pad tokens, segment 0, no loss), so every
    batch has one shape and compiles once."""
    rows: int
    pad_id: int

    def map(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return loader.pad_rows(batch, self.rows, self.pad_id)


def sft_batches(cfg: SFTLoaderConfig, seq_len: int, global_batch: int) -> grain.IterDataset:
    """This process's share (global_batch / process_count rows) of each [rows, seq_len] batch.

    With num_epochs set, the pass ends with a padded short batch instead of dropping the rest, so one pass trains
    (or evaluates) every assistant token exactly once."""
    meta = read_sft_metadata(cfg.root)
    longest = int(meta["splits"][cfg.split]["max_sample_tokens"])
    if longest > seq_len + 1:
        raise InputError(f"{cfg.root}: {cfg.split} samples have up to {longest} tokens; a row of seq_len={seq_len} "
                         f"holds {seq_len + 1} (one sample never spans rows): raise seq_len or re-run data_prep sft "
                         f"with --max-len {seq_len + 1}")
    rows = loader.local_rows(global_batch, cfg.processes[1])
    pad_id = int(meta["tokenizer"]["pad_id"])
    packed = pack_samples(split_samples(cfg), seq_len + 1, pad_id, cfg.pack, cfg.pack_bins, cfg.seed)
    ds = packed.map(_ShiftRow(pad_id)).batch(rows, drop_remainder=False).map(_PadBatch(rows, pad_id))
    if cfg.num_workers:
        from absl import flags  # mp_prefetch reads absl flags, which nobody parsed outside an absl app
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.num_workers))
    return ds


def assistant_tokens(root: str, split: str) -> int:
    """Trained (assistant) tokens in one pass over the split, from metadata.json."""
    return int(read_sft_metadata(root)["splits"][split]["assistant_tokens"])

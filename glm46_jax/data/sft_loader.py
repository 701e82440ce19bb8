"""Grain pipeline over an SFT dataset (`python -m data_prep sft`): samples -> packed rows -> trainer batches.

Input: `<root>/metadata.json` ("kind": "sft") and `<root>/<split>/{tokens,assistant_mask,offsets}.npy`, sample i
being tokens[offsets[i]:offsets[i + 1]] with its assistant mask (docs/sft.md#the-dataset-on-disk).

    cfg = SFTLoaderConfig(root="data/sample_sft", seed=0)
    it = iter(sft_batches(cfg, seq_len=512, global_batch=16))
    batch = next(it)                              # inputs, targets, segment_ids, positions, loss_mask
    state = iterator_state.to_json(it)            # into the checkpoint; iterator_state.restore(it, state) resumes

Pipeline: samples (memory-mapped) -> shuffle(seed) -> repeat(num_epochs) -> [p::n] -> iter -> best-/first-fit
packing into rows of seq_len + 1 tokens, the assistant mask packed beside the tokens -> shift -> batch. The config,
source, split and batching are the preference loader's too (glm46_jax.data.packed_source); here: the sample, its
packing and its row.

The batch is the pretraining loader's dict (glm46_jax/data/loader.py), all int32 [rows, seq_len], except that
loss_mask is the assistant mask shifted onto the targets: targets[j] = tokens[j + 1] is trained iff tokens[j + 1]
is assistant output and tokens[j], tokens[j + 1] are in the same sample (docs/sft.md#packed-rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import grain
import numpy as np
from jaxtyping import Int

from glm46_jax.data import loader, packed_source
from glm46_jax.errors import InputError

SFTPackMode = Literal["best_fit", "first_fit"]
SFT_PACK_MODES: tuple[str, ...] = ("best_fit", "first_fit")
Batch = loader.Batch  # inputs, targets, segment_ids, positions, loss_mask: int32 [rows, seq_len]


@dataclasses.dataclass(frozen=True)
class SFTLoaderConfig(packed_source.SourceConfig):
    pack: SFTPackMode = "best_fit"
    num_workers: int = 0  # mp_prefetch worker processes; 0 = read in this process

    def __post_init__(self):
        super().__post_init__()
        if self.pack not in SFT_PACK_MODES:
            raise InputError(f"SFTLoaderConfig.pack={self.pack!r}: must be one of {SFT_PACK_MODES}")
        if self.num_workers < 0:
            raise InputError("SFTLoaderConfig: num_workers must be >= 0")


def read_sft_metadata(root: str) -> dict[str, Any]:
    return loader.read_dataset_metadata(root, "sft", "an SFT dataset")


class SampleSource(packed_source.RecordSource):
    """The samples of one split as {"tokens", "assistant_mask"} int32 [n], sample i being offsets[i]:offsets[i + 1]."""
    noun = "samples"

    def count(self) -> int:
        return len(self.open("offsets")) - 1

    def record(self, a: dict[str, np.ndarray], index: int) -> dict[str, np.ndarray]:
        return self.tokens(a, int(a["offsets"][index]), int(a["offsets"][index + 1]))


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
    pad_id = int(meta["tokenizer"]["pad_id"])
    samples = packed_source.split_records(SampleSource(cfg.root, cfg.split), cfg)
    packed = pack_samples(samples, seq_len + 1, pad_id, cfg.pack, cfg.pack_bins, cfg.seed)
    ds = packed_source.padded_batches(packed.map(_ShiftRow(pad_id)), cfg, global_batch, pad_id)
    if cfg.num_workers:
        from absl import flags  # mp_prefetch reads absl flags, which nobody parsed outside an absl app
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.num_workers))
    return ds


def assistant_tokens(root: str, split: str) -> int:
    """Trained (assistant) tokens in one pass over the split, from metadata.json."""
    return int(read_sft_metadata(root)["splits"][split]["assistant_tokens"])

"""Grain pipeline over a preference dataset (`python -m data_prep preferences`): pairs -> packed rows -> batches.

Input: `<root>/metadata.json` ("kind": "preferences") and `<root>/<split>/{tokens,assistant_mask,offsets,margin}.npy`,
sequence 2i being pair i's chosen reply and 2i + 1 its rejected one (docs/preferences.md#the-dataset-on-disk).

    cfg = PreferenceLoaderConfig(root="data/sample_preferences", pairs_per_row=4)
    it = iter(preference_batches(cfg, seq_len=1024, global_batch=8))
    batch = next(it)                              # docs/preferences.md#the-batch
    state = iterator_state.to_json(it)            # into the checkpoint; iterator_state.restore(it, state) resumes

Pipeline: pairs (memory-mapped; one pair = one element whose tokens are chosen ++ rejected) -> shuffle(seed) ->
repeat(num_epochs) -> [p::n] -> iter -> Grain's best-fit packing into rows of exactly seq_len tokens, at most
pairs_per_row pairs a row (a pair never spans rows, its two sequences are always in the same row) -> the row's
fields -> batch. The config, source, split and batching are the SFT loader's too (glm46_jax.data.packed_source);
here: the pair, its packing and its row.

The batch, per row (all int32 except margin):
  inputs, targets, positions, segment_ids, loss_mask  [rows, seq_len]  slot k's chosen is segment 2k + 1, its
      rejected 2k + 2, padding 0; positions restart per sequence; targets[j] = inputs[j + 1] within a sequence, else
      the pad id; loss_mask[j] = 1 iff targets[j] is a reply token of the same sequence. No seq_len + 1 shift: the
      last token of every sequence is an input (its target is padding), so a reward head can read its hidden state.
  chosen_end, rejected_end  [rows, pairs_per_row]  the position in the row of slot k's last reply token (its
      end-of-turn token), 0 for an empty slot
  pair_mask  [rows, pairs_per_row]  1 where slot k holds a pair
  margin  float32 [rows, pairs_per_row]  the pair's margin, 0 for an empty slot
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import grain
import numpy as np

from glm46_jax.data import loader, packed_source
from glm46_jax.errors import InputError

Batch = dict[str, np.ndarray]
SEQUENCE_FIELDS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")  # int32 [rows, seq_len]
PAIR_FIELDS = ("chosen_end", "rejected_end", "pair_mask", "margin")  # [rows, pairs_per_row]; margin float32
CHOSEN, REJECTED = 1, 2  # the packed "side" feature; 0 = padding


@dataclasses.dataclass(frozen=True)
class PreferenceLoaderConfig(packed_source.SourceConfig):
    pairs_per_row: int = 4  # most pairs packed into one row (the width of the per-pair fields)

    def __post_init__(self):
        super().__post_init__()
        if self.pairs_per_row < 1:
            raise InputError("PreferenceLoaderConfig: pairs_per_row must be >= 1")


def read_preference_metadata(root: str) -> dict[str, Any]:
    return loader.read_dataset_metadata(root, "preferences", "a preference dataset")


class PairSource(packed_source.RecordSource):
    """The pairs of one split, each {"tokens", "assistant_mask", "side"}: int32 [len(chosen) + len(rejected)], side
    1 on the chosen tokens and 2 on the rejected ones, and "margin": a float32 scalar."""
    arrays = ("tokens", "assistant_mask", "offsets", "margin")
    noun = "pairs"

    def count(self) -> int:
        return len(self.open("margin"))

    def record(self, a: dict[str, np.ndarray], index: int) -> dict[str, Any]:
        lo, mid, hi = (int(x) for x in a["offsets"][2 * index:2 * index + 3])
        side = np.full(hi - lo, REJECTED, np.int32)
        side[:mid - lo] = CHOSEN
        return {**self.tokens(a, lo, hi), "side": side, "margin": np.float32(a["margin"][index])}


def pack_pairs(pairs: grain.IterDataset, seq_len: int, pairs_per_row: int, pad_id: int, pack_bins: int = 64,
               seed: int = 0) -> grain.IterDataset:
    """Rows of seq_len tokens holding whole pairs: Grain numbers the pairs of a row 1, 2, ... in row order
    (`tokens_segment_ids`); the mask and side travel as packed meta features, the margins as the row's list."""
    return grain.experimental.BestFitPackIterDataset(
        pairs, length_struct={"tokens": seq_len, "assistant_mask": seq_len, "side": seq_len},
        num_packing_bins=pack_bins, seed=seed, meta_features=("assistant_mask", "side", "margin"),
        padding_struct={"tokens": pad_id, "assistant_mask": 0, "side": 0}, max_sequences_per_bin=pairs_per_row)


def preference_row(row: Mapping[str, Any], pad_id: int, pairs_per_row: int) -> dict[str, np.ndarray]:
    """A packed row -> the batch fields of the module docstring (one row, no batch axis)."""
    pair = np.asarray(row["tokens_segment_ids"], np.int32)
    side = np.asarray(row["side"], np.int32)
    mask = np.asarray(row["assistant_mask"]) != 0
    n = len(pair)
    segment_ids = np.where(pair > 0, 2 * pair - 2 + side, 0).astype(np.int32)
    inputs = np.where(segment_ids > 0, np.asarray(row["tokens"]), pad_id).astype(np.int32)
    index = np.arange(n)
    starts = np.concatenate([[True], segment_ids[1:] != segment_ids[:-1]])
    positions = np.where(segment_ids > 0, index - np.maximum.accumulate(np.where(starts, index, 0)), 0)
    same = np.concatenate([(segment_ids[1:] == segment_ids[:-1]) & (segment_ids[:-1] != 0), [False]])
    targets = np.where(same, np.concatenate([inputs[1:], [pad_id]]), pad_id).astype(np.int32)
    loss_mask = same & np.concatenate([mask[1:], [False]])
    margins = list(row["margin"])
    count = int(pair.max(initial=0))
    if count > pairs_per_row or len(margins) != count:
        raise AssertionError(f"a packed row holds {count} pairs and {len(margins)} margins (at most {pairs_per_row})")
    ends = np.zeros((2, pairs_per_row), np.int32)
    for k in range(count):
        for s in (CHOSEN, REJECTED):
            reply = np.flatnonzero((segment_ids == 2 * k + s) & mask)
            ends[s - 1, k] = reply[-1]
    out = {"inputs": inputs, "targets": targets, "positions": positions.astype(np.int32), "segment_ids": segment_ids,
           "loss_mask": loss_mask.astype(np.int32), "chosen_end": ends[0], "rejected_end": ends[1],
           "pair_mask": (np.arange(pairs_per_row) < count).astype(np.int32),
           "margin": np.zeros(pairs_per_row, np.float32)}
    out["margin"][:count] = margins
    return out


@dataclasses.dataclass(frozen=True)
class _Row(grain.transforms.Map):
    pad_id: int
    pairs_per_row: int

    def map(self, row: dict[str, Any]) -> dict[str, np.ndarray]:
        return preference_row(row, self.pad_id, self.pairs_per_row)


def preference_batches(cfg: PreferenceLoaderConfig, seq_len: int, global_batch: int) -> grain.IterDataset:
    """This process's share (global_batch / process_count rows) of each batch (docs/preferences.md#the-batch).

    With num_epochs set, the pass ends with a padded short batch instead of dropping the rest, so one pass sees
    every pair exactly once."""
    meta = read_preference_metadata(cfg.root)
    split = meta["splits"][cfg.split]
    if not int(split["pairs"]):
        raise InputError(f"{cfg.root}: the {cfg.split} split has no pairs (see metadata.json's splits)")
    longest = int(split["max_pair_tokens"])
    if longest > seq_len:
        raise InputError(f"{cfg.root}: the longest {cfg.split} pair is {longest} tokens (chosen + rejected, which "
                         f"share a row) > seq_len={seq_len}: set seq_len >= {longest}, or re-run "
                         f"`python -m data_prep preferences` with --max-len {seq_len} to skip the longer pairs")
    pad_id = int(meta["tokenizer"]["pad_id"])
    pairs = packed_source.split_records(PairSource(cfg.root, cfg.split), cfg)
    packed = pack_pairs(pairs, seq_len, cfg.pairs_per_row, pad_id, cfg.pack_bins, cfg.seed)
    return packed_source.padded_batches(packed.map(_Row(pad_id, cfg.pairs_per_row)), cfg, global_batch, pad_id)


def split_pair_count(root: str, split: str) -> int:
    """Pairs in one pass over the split, from metadata.json."""
    return int(read_preference_metadata(root)["splits"][split]["pairs"])

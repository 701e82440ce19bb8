"""Grain pipelines over the prepared ArrayRecord corpus: domains -> mixture -> packed rows -> batches.

Input (written by data_prep): `<root>/<domain>/<split>/*.array_record`, one document per record
as little-endian int32 token ids ending in eos, and `<root>/metadata.json` with the tokenizer's
ids and per-domain document/token counts.

Pipeline per phase (all of it Grain; checkpoint it with `iterator_state.to_json`):
    per domain: ArrayRecordDataSource -> decode -> shuffle(domain seed) -> repeat -> [p::n] -> iter
    IterDataset.mix(domain -> weight) -> pack rows of seq_len + 1 -> shift -> batch(global / n)

Row fields, all int32 [b, L] (`shift_row` derives them from a packed row of L + 1 tokens):
  inputs = tokens[:-1], targets = tokens[1:];
  segment_ids: 0 on padding, 1, 2, ... for the documents (or document pieces) of the row, in order;
  positions:  0, 1, ... restarting at every segment, so a document split across rows restarts at 0;
  loss_mask:  1 where the target is a real token of the same segment as the input. No loss on
              padding, and none on the first token of a segment: it would be predicted from the
              previous document, which the attention mask hides.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import zlib
from collections.abc import Mapping
from typing import Any, Literal

import grain
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jaxtyping import Array, Int

from glm46_jax.errors import InputError
from glm46_jax.parallel import sharding

PackMode = Literal["concat", "best_fit"]
PACK_MODES: tuple[str, ...] = ("concat", "best_fit")
SPLITS: tuple[str, ...] = ("train", "heldout")
Batch = dict[str, np.ndarray]  # inputs, targets, segment_ids, positions, loss_mask: int32 [rows, seq_len]


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    """Where the corpus is and how to read it; everything a phase does not decide."""
    root: str
    split: str = "train"
    seed: int = 0
    read_threads: int = 8  # ReadOptions.num_threads per domain
    prefetch_documents: int = 256  # ReadOptions.prefetch_buffer_size per domain
    num_workers: int = 0  # mp_prefetch worker processes; 0 = read in this process
    pack_bins: int = 64  # best_fit: rows packed together (more bins, less padding, more memory)
    # "tokens": mixture weights are shares of tokens (converted to document shares with the
    # domains' mean document length, since Grain mixes documents); "documents": used as given.
    weight_unit: Literal["tokens", "documents"] = "tokens"
    num_epochs: int | None = None  # None = every domain repeats forever (training)
    process_index: int | None = None  # None = jax.process_index()
    process_count: int | None = None  # None = jax.process_count()

    def __post_init__(self):
        if self.split not in SPLITS:
            raise ValueError(f"LoaderConfig.split={self.split!r}: must be one of {SPLITS}")
        if self.weight_unit not in ("tokens", "documents"):
            raise ValueError(f"LoaderConfig.weight_unit={self.weight_unit!r}: must be 'tokens' or 'documents'")
        if self.num_workers < 0 or self.pack_bins < 1 or self.read_threads < 1:
            raise ValueError("LoaderConfig: num_workers must be >= 0, pack_bins and read_threads >= 1")

    @property
    def processes(self) -> tuple[int, int]:
        """(index, count) of this process among the data-loading processes."""
        return process_slot(self.process_index, self.process_count, "LoaderConfig")


def process_slot(index: int | None, count: int | None, owner: str) -> tuple[int, int]:
    """(index, count) of this process among the data-loading processes; None = JAX's own."""
    count = jax.process_count() if count is None else count
    index = jax.process_index() if index is None else index
    if not 0 <= index < count:
        raise InputError(f"{owner}: process_index={index} must be in [0, process_count={count})")
    return index, count


# --- corpus layout ---------------------------------------------------------------------------

def read_dataset_metadata(root: str, kind: str, what: str) -> dict[str, Any]:
    """`root`/metadata.json of a dataset that `python -m data_prep <kind>` wrote (its "kind" field); a missing,
    unparsable or foreign file is one InputError naming the path and the command that writes one (`what`: e.g. "an
    SFT dataset")."""
    path = os.path.join(root, "metadata.json")
    command = f"`python -m data_prep {kind}`"
    if not os.path.isfile(path):
        raise InputError(f"{path} not found: point the loader at {what} written by {command}")
    with open(path, encoding="utf-8") as f:
        try:
            meta = json.load(f)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); re-run {command}") from None
    if not isinstance(meta, dict) or meta.get("kind") != kind:
        raise InputError(f"{path}: not {what} (no \"kind\": \"{kind}\"); write one with {command}")
    return meta


def read_metadata(root: str) -> dict[str, Any]:
    path = os.path.join(root, "metadata.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: point the loader at a corpus written by data_prep")
    with open(path) as f:
        meta = json.load(f)
    missing = [k for k in ("vocab_size", "eos_id", "pad_id") if k not in meta.get("tokenizer", {})]
    if missing:
        raise InputError(f"{path}: tokenizer.{missing} missing; data_prep must record the tokenizer's ids")
    tok = meta["tokenizer"]
    if tok["pad_id"] is None:  # corpora written before data_prep fell back to EOS for a tokenizer without a pad
        tok["pad_id"] = tok["eos_id"]
    return meta


def known_domains(root: str) -> list[str]:
    """Domains named in metadata.json, else the directories holding `<split>/` shard folders
    (data_prep keeps other things, e.g. `_source/`, next to them)."""
    listed = set(read_metadata(root).get("domains", {}))
    if listed:
        return sorted(listed)
    return sorted(d for d in os.listdir(root)
                  if any(os.path.isdir(os.path.join(root, d, split)) for split in SPLITS))


def shard_paths(root: str, domain: str, split: str) -> list[str]:
    """The domain's ArrayRecord shards, sorted (the order fixes record indices, hence shuffles)."""
    pattern = os.path.join(root, domain, split, "*.array_record")
    paths = sorted(glob.glob(pattern))
    if not paths:
        raise FileNotFoundError(f"domain {domain!r} has no {split} shards: {pattern} matched nothing; "
                                f"run data_prep for it or drop it from the mixture")
    return paths


def has_split(root: str, domain: str, split: str) -> bool:
    """Whether the corpus holds any `split` data for `domain`: the token count data_prep recorded in
    metadata.json when there is one (a domain too small for a held-out split records 0), else whether
    it has shards."""
    record = read_metadata(root).get("domains", {}).get(domain, {}).get(split)
    if isinstance(record, Mapping) and "tokens" in record:
        return int(record["tokens"]) > 0
    return bool(glob.glob(os.path.join(root, domain, split, "*.array_record")))


def domain_seed(seed: int, domain: str) -> int:
    """A per-domain shuffle seed: fixed by (seed, name), independent of which other domains exist."""
    return int(np.random.SeedSequence([seed, zlib.crc32(domain.encode())]).generate_state(1)[0])


@dataclasses.dataclass(frozen=True)
class _DecodeDocument(grain.transforms.Map):
    # A class, not a lambda: mp_prefetch pickles the pipeline into its workers.
    domain: str
    vocab_size: int
    eos_id: int

    def map(self, record: bytes) -> dict[str, np.ndarray]:
        if len(record) % 4 or not record:
            raise InputError(f"domain {self.domain!r}: a record of {len(record)} bytes is not a non-empty "
                             "int32 token array; re-run data_prep")
        tokens = np.frombuffer(record, "<i4").astype(np.int32)
        if tokens[-1] != self.eos_id or tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise InputError(f"domain {self.domain!r}: a document does not end in eos_id={self.eos_id} or has "
                             f"ids outside [0, {self.vocab_size}); the corpus and metadata.json disagree")
        return {"tokens": tokens}


def domain_documents(cfg: LoaderConfig, domain: str) -> grain.IterDataset:
    """This process's documents of one domain, shuffled, as {"tokens": int32 [n]}."""
    meta = read_metadata(cfg.root)["tokenizer"]
    source = grain.sources.ArrayRecordDataSource(shard_paths(cfg.root, domain, cfg.split))
    decode = _DecodeDocument(domain, int(meta["vocab_size"]), int(meta["eos_id"]))
    ds = grain.MapDataset.source(source).map(decode).shuffle(seed=domain_seed(cfg.seed, domain))
    ds = ds.repeat(cfg.num_epochs)
    index, count = cfg.processes
    # Shuffle before slicing: one global permutation, so the processes' documents are disjoint.
    ds = ds[index::count]
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.read_threads,
                                                prefetch_buffer_size=cfg.prefetch_documents))


# --- mixture ---------------------------------------------------------------------------------

def _mean_document_length(cfg: LoaderConfig, domain: str) -> float:
    stats = read_metadata(cfg.root).get("domains", {}).get(domain, {}).get(cfg.split, {})
    if stats.get("documents") and stats.get("tokens"):
        return stats["tokens"] / stats["documents"]
    # metadata.json lacks the counts: estimate from the first records (lengths only, no decode).
    source = grain.sources.ArrayRecordDataSource(shard_paths(cfg.root, domain, cfg.split))
    sample = [len(source[i]) // 4 for i in range(min(len(source), 1024))]
    return float(np.mean(sample)) if sample else 1.0


def document_weights(cfg: LoaderConfig, weights: Mapping[str, float]) -> dict[str, float]:
    """Validated weights for `IterDataset.mix` (a document-count ratio); zero-weight domains dropped."""
    known = known_domains(cfg.root)
    unknown = sorted(set(weights) - set(known))
    if unknown:
        raise InputError(f"mixture weights name unknown domains {unknown}; the corpus at {cfg.root} has {known}")
    if any(not np.isfinite(w) or w < 0 for w in weights.values()):
        raise InputError(f"mixture weights {dict(weights)} must be finite and >= 0")
    kept = {d: float(w) for d, w in sorted(weights.items()) if w > 0}
    if not kept:
        raise InputError(f"mixture weights {dict(weights)}: at least one domain needs a positive weight")
    if cfg.weight_unit == "tokens":
        kept = {d: w / _mean_document_length(cfg, d) for d, w in kept.items()}
    return kept


def mixed_documents(cfg: LoaderConfig, weights: Mapping[str, float]) -> grain.IterDataset:
    """Documents of all domains with a positive weight, interleaved by Grain in the weights' ratio."""
    doc_weights = document_weights(cfg, weights)
    # A mapping (not a list) so a checkpoint restores each domain's position by name.
    return grain.IterDataset.mix({d: domain_documents(cfg, d) for d in doc_weights}, doc_weights)


# --- packing ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _SplitLongDocuments(grain.experimental.FlatMapTransform):
    """Cuts a document longer than a row into row-sized pieces that overlap by one token.

    Piece i is tokens[i*(R-1) : i*(R-1) + R]: every next-token target of the document is a target
    in exactly one piece, nothing is truncated. Each piece is packed (and position-numbered) as
    its own segment. Documents that fit a row pass through whole.
    """
    row_len: int
    max_fan_out: int = 1 << 30  # unused by FlatMapIterDataset, required by the interface

    def flat_map(self, element: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        tokens, step = element["tokens"], self.row_len - 1
        if len(tokens) <= self.row_len:
            return [element]
        return [{"tokens": tokens[s:s + self.row_len]} for s in range(0, len(tokens) - 1, step)]


def pack_documents(documents: grain.IterDataset, row_len: int, mode: PackMode, pad_id: int,
                   pack_bins: int = 64, seed: int = 0) -> grain.IterDataset:
    """Rows of `row_len` tokens with Grain's `tokens_segment_ids` / `tokens_positions`.

    concat:   concatenate-then-split: no padding; a document crossing a row end continues in the
              next row as a new segment (positions restart at 0).
    best_fit: best-fit bin packing over `pack_bins` rows, padded with `pad_id`; a document never
              spans rows unless it is longer than a row (then see `_SplitLongDocuments`).
    """
    if mode == "concat":
        return grain.experimental.ConcatThenSplitIterDataset(documents, length_struct={"tokens": row_len})
    if mode == "best_fit":
        pieces = grain.experimental.FlatMapIterDataset(documents, _SplitLongDocuments(row_len))
        return grain.experimental.BestFitPackIterDataset(
            pieces, length_struct={"tokens": row_len}, num_packing_bins=pack_bins, seed=seed,
            padding_struct={"tokens": pad_id})
    raise ValueError(f"pack mode {mode!r}: must be one of {PACK_MODES}")


@dataclasses.dataclass(frozen=True)
class _ShiftRow(grain.transforms.Map):
    pad_id: int

    def map(self, row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return shift_row(row, self.pad_id)


def shift_row(row: Mapping[str, np.ndarray], pad_id: int) -> dict[str, np.ndarray]:
    """A packed row of L + 1 tokens -> the five int32 [L] fields of the module docstring."""
    segments = row["tokens_segment_ids"].astype(np.int32)
    # Concat-then-split zero-fills its (end-of-data) padding: use the pad id everywhere.
    tokens = np.where(segments == 0, pad_id, row["tokens"]).astype(np.int32)
    same_document = (segments[1:] == segments[:-1]) & (segments[:-1] != 0)
    return {"inputs": tokens[:-1], "targets": tokens[1:], "segment_ids": segments[:-1],
            "positions": row["tokens_positions"][:-1].astype(np.int32),
            "loss_mask": same_document.astype(np.int32)}


def pad_rows(batch: Mapping[str, np.ndarray], rows: int, pad_id: int) -> dict[str, np.ndarray]:
    """A short batch filled up to `rows` with empty rows (pad tokens, segment 0, no loss): the last batch of a
    finite pass keeps the shape every other batch has, so it compiles once."""
    short = rows - len(batch["inputs"])
    if not short:
        return dict(batch)
    return {k: np.pad(v, ((0, short), (0, 0)), constant_values=pad_id if k in ("inputs", "targets") else 0)
            for k, v in batch.items()}


# --- batches ---------------------------------------------------------------------------------

def local_rows(global_batch: int, process_count: int) -> int:
    if global_batch < 1 or global_batch % process_count:
        raise ValueError(f"global batch {global_batch} must be a positive multiple of the {process_count} "
                         "data-loading processes")
    return global_batch // process_count


def training_batches(cfg: LoaderConfig, weights: Mapping[str, float], seq_len: int, global_batch: int,
                     pack: PackMode = "concat") -> grain.IterDataset:
    """This process's share (global_batch / process_count rows) of each batch of `seq_len` tokens."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    if pack not in PACK_MODES:
        raise ValueError(f"pack mode {pack!r}: must be one of {PACK_MODES}")
    rows = local_rows(global_batch, cfg.processes[1])
    pad_id = int(read_metadata(cfg.root)["tokenizer"]["pad_id"])
    packed = pack_documents(mixed_documents(cfg, weights), seq_len + 1, pack, pad_id, cfg.pack_bins, cfg.seed)
    ds = packed.map(_ShiftRow(pad_id)).batch(rows, drop_remainder=True)
    if cfg.num_workers:
        _absl_flags_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.num_workers))
    return ds


def _absl_flags_parsed():
    # mp_prefetch reads absl flags; outside an absl app nobody parsed them (UnparsedFlagAccessError).
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def mtp_labels(targets: Int[Array, "*b s"], mask: Array) -> tuple[Int[Array, "*b s"], Array]:
    """Labels for the MTP logits: row t predicts the token after targets[t], i.e. targets[t + 1].

    The batch carries targets = inputs shifted by one, so only the last row has no MTP target
    (from the inputs alone it would be the last two). `roll` wraps, so that row is masked out.

    Row t is valid only where mask[t] and mask[t + 1] both are: the MTP layer reads input t and
    input t + 1 to predict token t + 2, and all three must be real tokens of one document. mask[t + 1]
    alone would train the last token of a packed document to predict the next document's second
    token. No separate segment_ids check is needed: the loader's loss_mask is 1 only where a target
    is in its input's segment, so mask[t] & mask[t + 1] already means seg[t] == seg[t+1] == seg[t+2].
    """
    xp = np if isinstance(targets, np.ndarray) else jnp  # the loader derives them on the host (context layout)
    if xp is jnp:  # a roll along the row needs it whole (the seq axis is context-sharded, even at size 1)
        targets, mask = sharding.whole_along(targets, -1), sharding.whole_along(jnp.asarray(mask), -1)
    s = targets.shape[-1]
    has_target = xp.arange(s) < s - 1  # leading axes (micro-batches) broadcast
    return xp.roll(targets, -1, axis=-1), mask & xp.roll(mask, -1, axis=-1) & has_target


def to_context_layout(batch: Mapping[str, np.ndarray], context: int) -> dict[str, np.ndarray]:
    """Rows laid out for a sequence split over `context` shards (docs/long_context.md#load-balance): every
    [rows, seq] field permuted by `sharding.load_balanced_order`, plus the MTP layer's inputs and labels
    ("mtp_inputs", "mtp_targets", "mtp_mask"), derived first in the row's original order since they shift
    along it. `from_context_layout` undoes the permutation. context = 1: the batch as it is.
    """
    if context == 1:
        return dict(batch)
    inputs = np.asarray(batch["inputs"])
    mask = np.asarray(batch["loss_mask"]).astype(bool) if "loss_mask" in batch else np.ones(inputs.shape, bool)
    mtp_targets, mtp_mask = mtp_labels(np.asarray(batch["targets"]), mask)
    fields = {**batch, "mtp_inputs": np.roll(inputs, -1, axis=-1), "mtp_targets": mtp_targets,
              "mtp_mask": mtp_mask.astype(np.int32)}
    order = sharding.load_balanced_order(inputs.shape[-1], context)
    return {k: np.asarray(v)[..., order] for k, v in fields.items()}


def from_context_layout(x: np.ndarray | jax.Array, context: int, axis: int = 1) -> np.ndarray | jax.Array:
    """The original row order of `x` (e.g. logits) whose `axis` is in the layout of `to_context_layout`."""
    return x.take(np.argsort(sharding.load_balanced_order(x.shape[axis], context)), axis=axis)


def to_global(batch: Mapping[str, np.ndarray], mesh: jax.sharding.Mesh, *, accum_steps: int = 1,
              global_rows: bool = False) -> dict[str, jax.Array]:
    """This process's rows -> global arrays sharded over the mesh's batch axes (and `context`: the rows are
    then laid out by `to_context_layout`).

    `accum_steps` > 1: [accum, rows / accum, seq], the micro-batch axis unsharded (the train step
    scans over it). `global_rows`: every process holds the whole batch (data.process_split="rows")
    and each device takes its slice of it. The one host->device copy of a training loop, so it is
    allowed explicitly: the loop runs under a transfer guard.
    """
    layout = NamedSharding(mesh, sharding.logical(*((None,) if accum_steps > 1 else ()), "batch", "seq"))
    out = {}
    batch = to_context_layout(batch, dict(mesh.shape).get("context", 1))
    with jax.transfer_guard_host_to_device("allow"):
        for k, v in batch.items():
            v = np.asarray(v)
            if accum_steps > 1:
                v = v.reshape(accum_steps, v.shape[0] // accum_steps, *v.shape[1:])
            if global_rows:
                out[k] = jax.make_array_from_callback(v.shape, layout, lambda index, v=v: v[index])
            else:
                out[k] = jax.make_array_from_process_local_data(layout, v)
    return out

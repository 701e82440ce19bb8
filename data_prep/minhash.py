"""MinHash shingles and LSH parameters; signatures, bands and candidates are datatrove's (data_prep/README.md).

* shingles: lower-cased word n-grams (`\\w+` words, default n=5) or character n-grams, each hashed to
  32 bits (CRC-32 of words/code points, combined by a polynomial over the window), in one vectorised pass;
  a text shorter than one n-gram is one shingle of what it has;
* datatrove's `MinhashDedupSignature` turns them into `bands x rows` minima of universal hashes, and
  `MinhashDedupBuckets` pairs documents equal on a whole band: the candidates;
* bands/rows are picked here so that a pair *at* the threshold is a candidate with probability >= 0.99, with the
  fewest candidates below it; `dedup.VerifyAndCluster` then keeps a candidate only if its estimated Jaccard
  (fraction of equal signature entries) reaches the threshold.
"""

from __future__ import annotations

import dataclasses
import re
import zlib

import numpy as np
from datatrove.pipeline.dedup.minhash import MinhashConfig
from datatrove.utils.hashing import HashConfig

from glm46_jax.errors import InputError

_WORD = re.compile(r"\w+")
_POLY = np.uint64(0x100000001B3)  # FNV-64 prime: odd, so the window polynomial mixes every position
_MIX = np.uint64(0x9E3779B97F4A7C15)  # golden-ratio multiplier; its high 32 bits are the shingle hash
_SHIFT = np.uint64(32)


@dataclasses.dataclass(frozen=True)
class MinHashConfig:
    num_perm: int = 128
    threshold: float = 0.85  # Jaccard similarity at or above which two documents are near-duplicates
    shingle: str = "word"  # "word" | "char"
    ngram: int = 5
    seed: int = 0

    def __post_init__(self):
        if self.shingle not in ("word", "char"):
            raise InputError(f"--shingle must be 'word' or 'char', got {self.shingle!r}")
        # ngram 0 would hash every document to the same single shingle: all of them "near-duplicates".
        if self.ngram < 1 or self.num_perm < 1:
            raise InputError(f"--ngram {self.ngram} and --num-perm {self.num_perm} must both be >= 1")
        if not 0.0 < self.threshold <= 1.0:
            raise InputError(f"--threshold {self.threshold} must be a Jaccard similarity in (0, 1]")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def datatrove_config(cfg: MinHashConfig) -> MinhashConfig:
    """Our bands x rows (chosen for recall at the threshold) as datatrove's buckets x hashes per bucket, with 32-bit
    hashes (half the disk of 64-bit; a spurious collision of a whole 8-row band is ~2^-256)."""
    bands, rows = lsh_params(cfg.threshold, cfg.num_perm)
    return MinhashConfig(n_grams=cfg.ngram, num_buckets=bands, hashes_per_bucket=rows, seed=cfg.seed,
                         hash_config=HashConfig(precision=32, hash_fc="sha1"))


def shingle_hashes(text: str, shingle: str = "word", ngram: int = 5) -> np.ndarray:
    """Sorted unique 32-bit hashes (as uint64) of the text's shingles; a text shorter than one
    shingle is a single shingle of what it has, and an empty text has none."""
    text = text.lower()
    if shingle == "word":
        ids = np.array([zlib.crc32(w.encode("utf-8")) for w in _WORD.findall(text)], np.uint64)
    else:
        ids = np.frombuffer(text.encode("utf-32-le"), np.uint32).astype(np.uint64)
    if ids.size == 0:
        return ids
    n = min(ngram, ids.size)
    windows = ids.size - n + 1
    h = np.zeros(windows, np.uint64)
    for j in range(n):  # uint64 arithmetic wraps modulo 2^64, which is what a hash wants
        h = h * _POLY + ids[j:j + windows]
    return np.unique((h * _MIX) >> _SHIFT)


def candidate_probability(similarity: np.ndarray | float, bands: int, rows: int) -> np.ndarray | float:
    """P(a pair with this Jaccard similarity shares at least one band): the LSH S-curve."""
    return 1.0 - (1.0 - np.asarray(similarity, np.float64) ** rows) ** bands


def lsh_params(threshold: float, num_perm: int, min_recall: float = 0.99) -> tuple[int, int]:
    """(bands, rows): among splits whose S-curve gives recall >= min_recall at `threshold`, the one
    with the least false-positive area below it (fewest candidates to verify)."""
    grid = np.linspace(0.0, threshold, 512)
    best = None
    for bands in range(1, num_perm + 1):
        rows = num_perm // bands
        if candidate_probability(threshold, bands, rows) < min_recall:
            continue
        fp_area = float(np.trapezoid(candidate_probability(grid, bands, rows), grid))
        if best is None or fp_area < best[0]:
            best = (fp_area, bands, rows)
    if best is None:
        raise ValueError(f"no band split of {num_perm} permutations reaches recall {min_recall} at {threshold}")
    return best[1], best[2]

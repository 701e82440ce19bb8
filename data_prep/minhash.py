"""MinHash signatures and LSH banding in vectorised NumPy.

Hand-written instead of adding `datasketch`: datasketch hashes one document at a time through Python
objects and keeps its LSH index in dicts, while here a whole corpus is an `[N, num_perm]` uint64 array
and banding is one `np.unique` per band. The maths is the same (Broder 1997; Leskovec et al., *Mining
of Massive Datasets*, ch. 3):

* shingles: lower-cased word n-grams (`\\w+` words, default n=5) or character n-grams, each hashed to
  32 bits (CRC-32 of words/code points, combined by a polynomial over the window);
* permutation i is the multiply-add-shift hash h_i(x) = ((a_i x + b_i) mod 2^64) >> 32 with random
  64-bit a_i, b_i from a fixed seed: strongly universal for 32-bit keys (Dietzfelbinger 1996), and
  uint64 wrap-around *is* the mod 2^64. (The textbook (a x + b) mod p with small a, x barely wraps,
  so it is close to monotone in x and the "permutations" are correlated: it misses near-duplicates.)
  The signature is the column-wise minimum;
* banding: `bands` x `rows` <= num_perm. Pairs that agree on all rows of any band are candidates;
  a candidate becomes a duplicate only if its estimated Jaccard (fraction of equal signature entries)
  reaches the threshold. Bands/rows are picked so that a pair *at* the threshold is a candidate with
  probability >= 0.99, with the fewest candidates below it; the verification then sets the cut-off.
"""

from __future__ import annotations

import dataclasses
import re
import zlib

import numpy as np

from glm46_jax.cli import InputError

EMPTY = np.iinfo(np.uint64).max  # signature entry of a document with no shingles (never a real minimum)
_WORD = re.compile(r"\w+")
_POLY = np.uint64(0x100000001B3)  # FNV-64 prime: odd, so the window polynomial mixes every position
_MIX = np.uint64(0x9E3779B97F4A7C15)  # golden-ratio multiplier; its high 32 bits are the shingle hash
_SHIFT = np.uint64(32)
_CHUNK = 4096  # shingles per step: bounds the [chunk, num_perm] temporary to 4 MiB


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


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, np.iinfo(np.uint64).max, size=(2, num_perm), dtype=np.uint64, endpoint=True)
    return a, b


def signature(hashes: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """MinHash signature [num_perm] of one document's shingle hashes (all EMPTY if it has none)."""
    sig = np.full(a.shape, EMPTY, np.uint64)
    for start in range(0, hashes.size, _CHUNK):
        x = hashes[start:start + _CHUNK, None]
        np.minimum(sig, ((x * a + b) >> _SHIFT).min(axis=0), out=sig)
    return sig


def signatures(texts: list[str], cfg: MinHashConfig) -> np.ndarray:
    """[len(texts), num_perm] uint64 signatures."""
    a, b = permutations(cfg.num_perm, cfg.seed)
    out = np.empty((len(texts), cfg.num_perm), np.uint64)
    for i, text in enumerate(texts):
        out[i] = signature(shingle_hashes(text, cfg.shingle, cfg.ngram), a, b)
    return out


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


def _candidate_pairs(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """[E, 2] unique (first, other) index pairs sharing a band bucket; `first` is the bucket's lowest index."""
    pairs = []
    has_shingles = sigs[:, 0] != EMPTY
    index = np.flatnonzero(has_shingles)
    if index.size < 2:  # no pair exists, and the bucket-start arithmetic below needs a first member
        return np.zeros((0, 2), np.int64)
    for band in range(bands):
        keys = np.ascontiguousarray(sigs[index, band * rows:(band + 1) * rows])
        _, bucket = np.unique(keys, axis=0, return_inverse=True)
        order = np.argsort(bucket, kind="stable")  # stable: members stay in document order
        sorted_bucket = bucket[order]
        starts = np.flatnonzero(np.r_[True, sorted_bucket[1:] != sorted_bucket[:-1]])
        first = np.repeat(order[starts], np.diff(np.r_[starts, order.size]))
        other = order
        keep = first != other
        pairs.append(np.stack([index[first[keep]], index[other[keep]]], axis=1))
    if not pairs:
        return np.zeros((0, 2), np.int64)
    return np.unique(np.concatenate(pairs), axis=0)


def cluster_roots(sigs: np.ndarray, threshold: float, bands: int, rows: int) -> np.ndarray:
    """root[i] = the lowest index of document i's near-duplicate cluster (i itself if it has none).

    Clusters are the connected components of verified candidate pairs, so the kept document (the root)
    is always the first of its cluster in input order, whatever order the pairs were found in."""
    pairs = _candidate_pairs(sigs, bands, rows)
    if len(pairs):
        similarity = (sigs[pairs[:, 0]] == sigs[pairs[:, 1]]).mean(axis=1)
        pairs = pairs[similarity >= threshold]
    parent = np.arange(len(sigs))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in pairs.tolist():  # union-find; the smaller root wins, so roots are cluster minima
        ri, rj = find(i), find(j)
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)
    return np.array([find(i) for i in range(len(sigs))], np.int64)

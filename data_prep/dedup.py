"""Global deduplication: exact (hash of whitespace-normalised text), then MinHash-LSH near-duplicates.

Runs over every document of the run at once, across files and domains, in pipeline order; the first
document of each cluster is kept, so the result depends only on the input order, never on worker
count or timing. Signatures are computed in worker processes (`parallel.map_chunks`); the banding
and clustering are single vectorised passes in the parent.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from data_prep import minhash, parallel
from data_prep.documents import Document


def exact_key(text: str) -> bytes:
    """Texts equal up to whitespace layout share a key (case is kept: it matters in code)."""
    return hashlib.blake2b(" ".join(text.split()).encode("utf-8"), digest_size=16).digest()


def deduplicate(docs: list[Document], cfg: minhash.MinHashConfig,
                workers: int = 1) -> tuple[list[Document], dict[str, Any]]:
    """(kept documents, stats). Stats: global counts plus per-domain removals, and the LSH parameters."""
    first_of: dict[bytes, int] = {}
    exact_root = np.empty(len(docs), np.int64)
    for i, doc in enumerate(docs):
        exact_root[i] = first_of.setdefault(exact_key(doc.text), i)
    unique = np.flatnonzero(exact_root == np.arange(len(docs)))

    bands, rows = minhash.lsh_params(cfg.threshold, cfg.num_perm)
    chunks = parallel.map_chunks(minhash.signatures, [docs[i].text for i in unique], workers,
                                 desc="minhash", extra=(cfg,))
    sigs = np.concatenate(chunks) if chunks else np.zeros((0, cfg.num_perm), np.uint64)
    near_root = unique[minhash.cluster_roots(sigs, cfg.threshold, bands, rows)]  # positions -> doc indices

    is_exact_dup = exact_root != np.arange(len(docs))
    is_near_dup = np.zeros(len(docs), bool)
    is_near_dup[unique] = near_root != unique
    exact_sizes = np.bincount(exact_root, minlength=len(docs))
    near_sizes = np.bincount(near_root, minlength=len(docs))

    per_domain: dict[str, dict[str, int]] = {}
    for i, doc in enumerate(docs):
        counts = per_domain.setdefault(doc.domain, {"documents": 0, "exact_duplicates": 0,
                                                    "near_duplicates": 0, "kept": 0})
        counts["documents"] += 1
        counts["exact_duplicates"] += int(is_exact_dup[i])
        counts["near_duplicates"] += int(is_near_dup[i])
        counts["kept"] += int(not (is_exact_dup[i] or is_near_dup[i]))
    kept = [doc for i, doc in enumerate(docs) if not (is_exact_dup[i] or is_near_dup[i])]
    stats = {
        "documents": len(docs),
        "exact_duplicate_clusters": int((exact_sizes > 1).sum()),
        "exact_duplicates_removed": int(is_exact_dup.sum()),
        "near_duplicate_clusters": int((near_sizes > 1).sum()),
        "near_duplicates_removed": int(is_near_dup.sum()),
        "removed": len(docs) - len(kept),
        "kept": len(kept),
        "lsh": {"num_perm": cfg.num_perm, "bands": bands, "rows": rows, "threshold": cfg.threshold,
                "shingle": cfg.shingle, "ngram": cfg.ngram, "seed": cfg.seed},
        "per_domain": per_domain,
    }
    return kept, stats

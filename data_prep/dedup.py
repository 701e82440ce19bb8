"""Deduplication after datatrove's MinHash buckets: verify each candidate against our threshold, then cluster.

datatrove's `MinhashDedupBuckets` writes, per bucket (band), the documents whose band of the signature is equal, as
chains of pairs. A band collision is only a candidate: at 15 bands x 8 rows a pair with Jaccard 0.5 collides in some
band ~6 % of the time (minhash.candidate_probability), so datatrove's own clustering would merge it. This block
(one task) instead

1. rebuilds each bucket's groups from the chains (consecutive pairs share a member);
2. unites members with the same exact key (BLAKE2b of the whitespace-normalised text): exact duplicates;
3. unites the remaining members whose estimated Jaccard (the fraction of equal entries of the two full signatures,
   read back from every bucket's signature file) reaches `--threshold`: near duplicates;
4. keeps the smallest member of each connected component, i.e. the document with the smallest (input file, line)
   (tasks own contiguous file ranges, so node = (task, position) orders like (file, line)); datatrove's cluster
   block keeps the root of a union-by-size, which depends on the order pairs arrive in;
5. writes `remove/<rank>.remove` in datatrove's format (sorted little-endian uint32 positions), which datatrove's
   `MinhashDedupFilter` applies in the tokenize stage, and `dedup.json` with the counts.

Memory holds the candidate documents (their signatures, keys, domains: ~500 bytes each) and the union-find over
them, plus one task's index at a time; not the corpus's documents nor their signatures.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from datatrove.data import DocumentsPipeline
from datatrove.io import get_datafolder
from datatrove.pipeline.base import PipelineStep

from data_prep import minhash
from data_prep.work import load_array, save_json

_SIG_CHUNK = 1 << 16  # signature records read at a time
_FULL_PAIRWISE = 512  # exact-unique members of one bucket group compared all-pairs up to this; beyond, to roots only


def exact_key(text: str) -> bytes:
    """Texts equal up to whitespace layout share a key (case is kept: it matters in code)."""
    return hashlib.blake2b(" ".join(text.split()).encode("utf-8"), digest_size=16).digest()


def bucket_groups(pairs: np.ndarray) -> list[np.ndarray]:
    """The groups of equal band values in one `.dups` file: rows (rank1, doc1, rank2, doc2) written as chains
    a-b, b-c, ... per group; nodes are encoded as rank << 32 | doc."""
    a = (pairs[:, 0].astype(np.uint64) << np.uint64(32)) | pairs[:, 1]
    b = (pairs[:, 2].astype(np.uint64) << np.uint64(32)) | pairs[:, 3]
    starts = np.flatnonzero(np.r_[True, a[1:] != b[:-1]])
    return [np.r_[a[lo], b[lo:hi]] for lo, hi in zip(starts, np.r_[starts[1:], len(a)], strict=True)]


class UnionFind:
    """Over positions 0..n-1; the smaller root wins, so every root is its component's minimum."""

    def __init__(self, n: int):
        self.parent = np.arange(n)

    def find(self, i: int) -> int:
        parent = self.parent
        root = i
        while parent[root] != root:
            root = parent[root]
        while parent[i] != root:
            parent[i], i = root, parent[i]
        return int(root)

    def union(self, i: int, j: int) -> None:
        ri, rj = self.find(i), self.find(j)
        if ri != rj:
            self.parent[max(ri, rj)] = min(ri, rj)

    def roots(self) -> np.ndarray:
        return np.array([self.find(i) for i in range(len(self.parent))], np.int64)


class VerifyAndCluster(PipelineStep):
    name, type = "verify candidates and cluster", "🫂 - DEDUP"

    def __init__(self, work: str, cfg: minhash.MinHashConfig, tasks: int, domains: list[str]):
        super().__init__()
        self.work, self.cfg, self.tasks, self.domains = work, cfg, tasks, domains

    def _groups(self, folder) -> list[np.ndarray]:
        groups = []
        for path in sorted(folder.list_files("buckets", glob_pattern="*.dups")):
            with folder.open(path, "rb") as f:
                pairs = np.frombuffer(f.read(), "<u4").reshape(-1, 4)
            if len(pairs):
                groups += bucket_groups(pairs)
        return groups

    def _node_data(self, folder, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(signature [n, bands*rows], exact key [n], domain [n]) of each candidate node, one task's files at a time."""
        dt = minhash.datatrove_config(self.cfg)
        rows = dt.hashes_per_bucket
        sigs = np.zeros((len(nodes), dt.num_buckets * rows), np.uint32)
        keys = np.zeros(len(nodes), "V16")
        domains = np.zeros(len(nodes), np.int64)
        record = np.dtype([("h", "<u4", (rows,)), ("doc", "<u4")])
        ranks = (nodes >> np.uint64(32)).astype(np.int64)
        docs = (nodes & np.uint64(0xFFFFFFFF)).astype(np.int64)
        for rank in np.unique(ranks).tolist():
            mine = np.flatnonzero(ranks == rank)
            index = load_array(folder, f"index/{rank:05d}.npy")
            keys[mine], domains[mine] = index["key"][docs[mine]], index["domain"][docs[mine]]
            node = np.full(len(index), -1, np.int64)  # the task's documents -> candidate node (-1: not one)
            node[docs[mine]] = mine
            del index
            for bucket in range(dt.num_buckets):  # the candidates' rows only, never the task's full signatures
                with folder.open(f"sigs/bucket_{bucket:03d}/{rank:05d}.minhash.sig", "rb") as f:
                    while chunk := f.read(record.itemsize * _SIG_CHUNK):
                        recs = np.frombuffer(chunk, record)
                        at = node[recs["doc"]]
                        sigs[at[at >= 0], bucket * rows:(bucket + 1) * rows] = recs["h"][at >= 0]
        return sigs, keys, domains

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> None:
        folder = get_datafolder(self.work)
        groups = self._groups(folder)
        nodes = np.unique(np.concatenate(groups)) if groups else np.zeros(0, np.uint64)
        sigs, keys, domains = self._node_data(folder, nodes)
        exact, every = UnionFind(len(nodes)), UnionFind(len(nodes))
        checked = rejected = 0
        for group in groups:
            members = np.searchsorted(nodes, np.sort(group))
            _, first, inverse = np.unique(keys[members], return_index=True, return_inverse=True)
            for m, k in zip(members.tolist(), inverse.tolist(), strict=True):  # same exact key: one cluster
                exact.union(members[first[k]], m)
                every.union(members[first[k]], m)
            reps = np.sort(members[first])
            compared = []  # members each new one is compared with (all earlier ones, or the roots in huge groups)
            for m in reps.tolist():
                if compared:
                    others = np.array(compared)
                    similar = (sigs[others] == sigs[m]).mean(axis=1) >= self.cfg.threshold
                    checked += len(others)
                    rejected += int((~similar).sum())
                    for o in others[similar].tolist():
                        every.union(o, m)
                    if similar.any() and len(reps) > _FULL_PAIRWISE:
                        continue
                compared.append(m)
        self._save(folder, nodes, domains, exact.roots(), every.roots(), checked, rejected)

    def _save(self, folder, nodes, domains, exact_root, root, checked: int, rejected: int) -> None:
        positions = np.arange(len(nodes))
        removed, is_exact = root != positions, exact_root != positions
        near = removed & ~is_exact
        for rank in range(self.tasks):
            mine = removed & ((nodes >> np.uint64(32)) == rank)
            docs = np.sort((nodes[mine] & np.uint64(0xFFFFFFFF)).astype("<u4"))
            with folder.open(f"remove/{rank:06d}.remove", "wb") as f:
                f.write(docs.tobytes())
        unique = np.flatnonzero(~is_exact)  # near clusters are counted over exact-unique documents, as before
        near_sizes = np.bincount(root[unique], minlength=len(nodes))
        per_domain: dict[str, dict[str, int]] = {}
        for d, name in enumerate(self.domains):
            per_domain[name] = {"exact_duplicates": int((is_exact & (domains == d)).sum()),
                                "near_duplicates": int((near & (domains == d)).sum())}
        stats: dict[str, Any] = {
            "exact_duplicate_clusters": int((np.bincount(exact_root, minlength=len(nodes)) > 1).sum()),
            "exact_duplicates_removed": int(is_exact.sum()),
            "near_duplicate_clusters": int((near_sizes > 1).sum()),
            "near_duplicates_removed": int(near.sum()),
            "candidate_comparisons": checked, "candidates_below_threshold": rejected,
            "per_domain": per_domain,
        }
        save_json(folder, "dedup.json", stats)

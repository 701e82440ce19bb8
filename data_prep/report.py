"""Statistics bookkeeping and the human-readable run summary.

Stage statistics are nested dicts of counts; worker results are summed with `add_counts`. The summary
is printed from `metadata.json`'s content, so what a user reads is exactly what the file records.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from data_prep.documents import Malformed

SHOWN_REPORTS = 20  # malformed-input locations printed to the terminal (all of them are in metadata.json)


def add_counts(total: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """Adds the (nested) integer counts of `part` into `total`, in place; returns `total`."""
    for key, value in part.items():
        if isinstance(value, dict):
            add_counts(total.setdefault(key, {}), value)
        else:
            total[key] = total.get(key, 0) + value
    return total


def malformed_section(reports: Iterable[Malformed], max_reports: int) -> dict[str, Any]:
    """{count, by_kind, reports: first `max_reports` as {location, kind, message}, reports_left_out}."""
    reports = list(reports)
    return {
        "count": len(reports),
        "by_kind": dict(sorted(Counter(r.kind for r in reports).items())),
        "reports": [r.to_json() for r in reports[:max_reports]],
        "reports_left_out": max(0, len(reports) - max_reports),
    }


def malformed_lines(section: dict[str, Any]) -> list[str]:
    if not section["count"]:
        return ["malformed inputs: none"]
    kinds = ", ".join(f"{k} {n}" for k, n in section["by_kind"].items())
    lines = [f"malformed inputs: {section['count']} ({kinds}), skipped; all are listed in metadata.json:"]
    lines += [f"    {r['location']}: {r['kind']}: {r['message']}" for r in section["reports"][:SHOWN_REPORTS]]
    if section["count"] > SHOWN_REPORTS:
        lines.append(f"    ... and {section['count'] - SHOWN_REPORTS} more")
    return lines


def _fmt(n: int) -> str:
    return f"{n:,}"


def summary_lines(meta: dict[str, Any]) -> list[str]:
    lines = []
    for domain, info in meta["domains"].items():
        train, heldout = info["train"], info["heldout"]
        lines.append(f"[{domain}] train: {_fmt(train['documents'])} docs, {_fmt(train['tokens'])} tokens, "
                     f"{len(train['shards'])} shards | heldout: {_fmt(heldout['documents'])} docs, "
                     f"{_fmt(heldout['tokens'])} tokens, {len(heldout['shards'])} shards")
        clean, quality, dedup = info.get("clean", {}), info.get("filter", {}), info.get("dedup", {})
        drops = ", ".join(f"{rule} {n}" for rule, n in quality.get("removed", {}).items() if n) or "none"
        lines.append(f"    read {_fmt(info.get('ingest', {}).get('documents', 0))} | empty after clean "
                     f"{clean.get('empty', 0)} | quality drops: {drops} | duplicates: exact "
                     f"{dedup.get('exact_duplicates', 0)}, near {dedup.get('near_duplicates', 0)}")
    d = meta.get("dedup", {})
    if d:
        lsh = d["lsh"]
        lines.append(f"dedup: {d['exact_duplicate_clusters']} exact clusters ({d['exact_duplicates_removed']} "
                     f"removed), {d['near_duplicate_clusters']} near-duplicate clusters "
                     f"({d['near_duplicates_removed']} removed); LSH {lsh['bands']} bands x {lsh['rows']} rows of "
                     f"{lsh['num_perm']} permutations, threshold {lsh['threshold']}")
    tok = meta["tokenizer"]
    lines.append(f"tokenizer: {tok['source']} vocab {tok['vocab_size']}, eos {tok['eos_token']!r}={tok['eos_id']}")
    lines += malformed_lines(meta.get("malformed", {"count": 0}))
    if meta.get("stale_shards"):
        lines.append(f"warning: {len(meta['stale_shards'])} shard file(s) not in this run's plan (left by a "
                     f"differently configured run; not listed in metadata.json): {meta['stale_shards'][:5]}")
    return lines

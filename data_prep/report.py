"""Statistics bookkeeping and the human-readable run summary and warnings.

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


def dropped_counts(entry: dict[str, Any]) -> dict[str, int]:
    """{reason: documents} that one domain's stages removed (nonzero only), in pipeline order; `entry`
    holds the domain's per-stage counts as metadata.json lists them."""
    dedup = entry.get("dedup", {})
    drops = {"empty after clean": entry.get("clean", {}).get("empty", 0), **entry.get("filter", {}).get("removed", {}),
             "exact duplicates": dedup.get("exact_duplicates", 0), "near duplicates": dedup.get("near_duplicates", 0)}
    return {reason: n for reason, n in drops.items() if n}


def empty_domain_reason(domain: str, entry: dict[str, Any]) -> str:
    """Why a domain has no documents left: nothing was read, or which stage removed how many."""
    ingest = entry.get("ingest", {})
    if not ingest.get("documents"):
        return f"domain {domain!r}: no documents were read ({ingest.get('malformed', 0)} malformed)"
    drops = ", ".join(f"{reason} {n}" for reason, n in dropped_counts(entry).items())
    return f"domain {domain!r}: all {ingest['documents']} documents were dropped" + (f" ({drops})" if drops else "")


def warning_lines(meta: dict[str, Any]) -> list[str]:
    """What the user should know about a finished dataset: domains without documents or without one
    of the splits (the training loader reads the same counts from metadata.json), and stale shards."""
    fraction = meta.get("config", {}).get("write", {}).get("heldout_fraction", 0.0)
    lines = []
    for domain, info in meta["domains"].items():
        train, heldout = info["train"]["documents"], info["heldout"]["documents"]
        if info.get("empty"):
            lines.append(f"warning: {empty_domain_reason(domain, info)}; it gets no shards")
        elif heldout == 0 and fraction > 0:  # a fraction of 0 asked for no heldout split: nothing is missing
            lines.append(f"warning: domain {domain!r}: none of its {train} documents fell in the heldout split "
                         f"(heldout_fraction {fraction}); it has no heldout data")
        elif train == 0:
            lines.append(f"warning: domain {domain!r}: all {heldout} of its documents fell in the heldout split "
                         f"(heldout_fraction {fraction}); it has no train data")
    if meta.get("stale_shards"):
        lines.append(f"warning: {len(meta['stale_shards'])} shard file(s) not in this run's plan (left by a "
                     f"differently configured run; not listed in metadata.json): {meta['stale_shards'][:5]}")
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
    return lines

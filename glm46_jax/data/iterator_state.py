"""Grain iterator state as JSON, and carrying domain positions across a pipeline rebuild.

`to_json` / `restore` wrap `get_state` / `set_state` so a checkpoint can be plain
JSON (what Grain's own Orbax handler writes as well) and still restore exactly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import grain


def to_json(iterator: grain.DatasetIterator) -> dict[str, Any]:
    """The iterator's position as plain JSON types (what goes into a checkpoint)."""
    return json.loads(json.dumps(iterator.get_state()))


def restore(iterator: grain.DatasetIterator, state: Mapping[str, Any]) -> None:
    """Inverse of `to_json`; the next batch is the one that followed the saved position."""
    iterator.set_state(_json_state_fixups(state))


def _json_state_fixups(state: Any) -> Any:
    # ConcatThenSplit compares its `remainder_slices` with the tuple (-1, -1): after a JSON round
    # trip they are lists, "no remainder" reads as a remainder of zero tokens, and a document is
    # silently dropped on restore (grain 0.2.18; its own Orbax handler round-trips through JSON too).
    if isinstance(state, Mapping):
        return {k: ({f: tuple(s) for f, s in v.items()} if k == "remainder_slices" else _json_state_fixups(v))
                for k, v in state.items()}
    if isinstance(state, list):
        return [_json_state_fixups(v) for v in state]
    return state


def _mixture_nodes(state: Any) -> list[dict[str, Any]]:
    """The states of the pipeline's mix iterators ({"parents": {domain: ...}, "index", "stop"})."""
    if not isinstance(state, Mapping):
        return [n for v in state for n in _mixture_nodes(v)] if isinstance(state, list) else []
    if {"parents", "index", "stop"} <= state.keys() and isinstance(state["parents"], Mapping):
        return [state]  # type: ignore[list-item]
    return [n for k in sorted(state) for n in _mixture_nodes(state[k])]


def carry_domain_positions(previous: Mapping[str, Any], fresh: Mapping[str, Any]) -> dict[str, Any]:
    """`fresh` (a new phase's initial state) with each shared domain resumed where `previous` was.

    A phase switch rebuilds the pipeline (new weights, row length or packing); without this every
    domain would restart its shuffled order and repeat the documents the last phase trained on.
    Documents in the old packer's buffer (at most a few rows' worth) may be read again.
    """
    fresh = json.loads(json.dumps(_json_state_fixups(fresh)))
    old_nodes, new_nodes = _mixture_nodes(_json_state_fixups(previous)), _mixture_nodes(fresh)
    if len(old_nodes) != len(new_nodes):
        raise ValueError(f"cannot carry domain positions: {len(old_nodes)} mixtures in the previous state, "
                         f"{len(new_nodes)} in the new one (was num_workers changed?)")
    for old, new in zip(old_nodes, new_nodes, strict=True):
        for domain in new["parents"].keys() & old["parents"].keys():
            new["parents"][domain] = old["parents"][domain]
    return fresh

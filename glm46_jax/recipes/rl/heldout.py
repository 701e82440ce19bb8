"""<run_dir>/heldout.json: an RL run's greedy held-out outcome before and after, per problem, and the gain those
outcomes measure with its paired standard error (docs/rl.md#measuring-a-gain).

    g = heldout.gain([heldout.read(run) for run in seed_runs])   # the seeds' runs from one starting policy
    g.mean > 2 * g.se                                              # the acceptance tests' claim

Every run is scored on the same held-out problems, so a gain is measured per problem: d_i is problem i's pass at
the end minus at the start, averaged over the runs, and the gain's standard error is sd(d) / sqrt(n). A problem that
passes (or fails) at both ends adds nothing to it. The binomial error of the start, sqrt(p (1 - p) / n), which the
acceptance tests compared the gain with before, is the error of one accuracy, not of a difference of two measured on
the same problems: larger whenever the two ends agree on most problems, and blind to how many problems changed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from glm46_jax.errors import InputError


def record(start_accuracy: float | None, start_passed: np.ndarray | None, end: Mapping[str, float],
           end_passed: np.ndarray, *, steps: int, rollouts: int) -> dict[str, Any]:
    """heldout.json's contents. start_*: None when the run resumed from a checkpoint (its start was not scored)."""
    return {"start_accuracy": start_accuracy, "end": dict(end), "steps": steps, "rollouts": rollouts,
            "problems": int(len(end_passed)),
            "start_passed": None if start_passed is None else [int(x) for x in start_passed],
            "end_passed": [int(x) for x in end_passed]}


def read(run_dir: str) -> dict[str, Any]:
    path = os.path.join(run_dir, "heldout.json")
    if not os.path.isfile(path):
        raise InputError(f"{path}: not found; the RL run writes it when it finishes")
    with open(path) as f:
        return json.load(f)


class Gain(NamedTuple):
    mean: float  # mean over the problems of the end's pass minus the start's, averaged over the runs
    se: float  # its standard error over the problems, paired
    per_run: tuple[tuple[float, float], ...]  # each run's (gain, paired standard error)
    problems: int


def _paired(d: np.ndarray) -> tuple[float, float]:
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0


def gain(records: Sequence[Mapping[str, Any]]) -> Gain:
    """The held-out gain of one or more runs (seeds) scored on the same problems, with its paired standard error."""
    if not records:
        raise ValueError("gain: no runs")
    diffs = []
    for r in records:
        if r.get("start_passed") is None or r.get("end_passed") is None:
            raise ValueError("gain: a heldout.json without per-problem outcomes (a resumed run's start is not "
                             "scored; or one written before they were recorded)")
        start, end = np.asarray(r["start_passed"], np.float64), np.asarray(r["end_passed"], np.float64)
        if start.shape != end.shape or (diffs and start.shape != diffs[0].shape):
            raise ValueError(f"gain: runs scored on different numbers of problems ({start.shape}, {end.shape})")
        diffs.append(end - start)
    mean, se = _paired(np.mean(diffs, axis=0))
    return Gain(mean, se, tuple(_paired(d) for d in diffs), len(diffs[0]))

"""How well a reward model's scores order labelled pairs: the share it orders like the labeller (agreement) and, per
bucket of its score margin, that share against what a calibrated Bradley-Terry model would get (calibration)
(docs/preferences.md#calibration).

    agreement(chosen_scores, rejected_scores)      # 0.74
    calibration(chosen_scores, rejected_scores)    # [{"margin_lo", "margin_hi", "pairs", "accuracy", "predicted"}]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# |score margin| buckets of the calibration table: a Bradley-Terry model says P(chosen) = sigmoid(margin).
MARGIN_EDGES = (0.0, 0.5, 1.0, 2.0, 4.0)


def agreement(chosen: np.ndarray, rejected: np.ndarray) -> float:
    """The share of pairs whose chosen reply scores higher (a tie counts half): the reward model agreeing with the
    labeller."""
    chosen, rejected = np.asarray(chosen, np.float64), np.asarray(rejected, np.float64)
    return float(np.mean((chosen > rejected) + 0.5 * (chosen == rejected))) if len(chosen) else float("nan")


def calibration(chosen: np.ndarray, rejected: np.ndarray, edges: Sequence[float] = MARGIN_EDGES
                ) -> list[dict[str, float | None]]:
    """Per bucket of |score margin| (the last one open: margin_hi None): its pairs, the share the reward model orders
    like the labeller, and the share a calibrated Bradley-Terry model would (mean sigmoid(|margin|))."""
    margin = np.asarray(chosen, np.float64) - np.asarray(rejected, np.float64)
    size = np.abs(margin)
    table = []
    for lo, hi in zip(edges, [*edges[1:], np.inf]):
        inside = (size >= lo) & (size < hi)
        n = int(inside.sum())
        table.append({"margin_lo": float(lo), "margin_hi": None if hi == np.inf else float(hi), "pairs": n,
                      "accuracy": float(np.mean(margin[inside] > 0)) if n else float("nan"),
                      "predicted": float(np.mean(1 / (1 + np.exp(-size[inside])))) if n else float("nan")})
    return table

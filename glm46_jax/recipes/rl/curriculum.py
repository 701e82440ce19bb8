"""The prompt pool: difficulty buckets by measured pass rate, and a loader that moves to harder buckets as the
policy's pass rate rises (GLM-4.5's difficulty curriculum, docs/rl.md#curriculum).

    pool = PromptPool(num_prompts, difficulty, CurriculumConfig(buckets=3, advance_at=0.8), seed=0)
    ids = pool.draw(8)                       # prompt indices from the current level's bucket
    pool.record(ids, pass_rates)             # each prompt's measured pass rate (its group's mean pass)
    json_state = pool.state(); pool.restore(json_state)    # bit-identical continuation

A prompt's bucket is where its measured pass rate puts it (bucket = floor((1 - pass_rate) * buckets): solved
prompts in bucket 0, unsolved ones in the last), or, before it was ever sampled, its prior `difficulty` from the
prompts file (clipped to the buckets). The loader draws from bucket `level` (the nearest non-empty bucket when
that one is empty), and `level` rises by one when the running pass rate (an EMA over draws at this level) reaches
`advance_at`. All randomness is the pool's own NumPy generator, saved with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class CurriculumConfig:
    buckets: int = 1  # 1 = no curriculum: uniform draws from the whole pool
    advance_at: float = 0.8  # move to the next bucket when the level's running pass rate reaches this
    ema: float = 0.7  # weight of the previous running pass rate per recorded batch


class PromptPool:
    def __init__(self, num_prompts: int, difficulty: Sequence[int], cfg: CurriculumConfig, seed: int):
        self.cfg = cfg
        self.prior = np.clip(np.asarray(difficulty, np.int64), 0, cfg.buckets - 1)
        self.passes = np.zeros(num_prompts, np.int64)  # sampled completions that passed
        self.attempts = np.zeros(num_prompts, np.int64)
        self.level = 0
        self.running: float | None = None  # EMA pass rate at the current level
        self.draws = 0
        self.rng = np.random.default_rng(seed)

    def buckets(self) -> np.ndarray:
        """Each prompt's bucket now."""
        measured = self.attempts > 0
        rate = np.where(measured, self.passes / np.maximum(self.attempts, 1), 0.0)
        by_rate = np.minimum(np.floor((1.0 - rate) * self.cfg.buckets).astype(np.int64), self.cfg.buckets - 1)
        return np.where(measured, by_rate, self.prior)

    def draw(self, count: int) -> np.ndarray:
        """`count` distinct prompt indices (with repeats only when the bucket is smaller) from the current level."""
        bucket = self.buckets()
        sizes = np.bincount(bucket, minlength=self.cfg.buckets)
        order = sorted(range(self.cfg.buckets), key=lambda b: (abs(b - self.level), -b))  # prefer harder on ties
        chosen = next(b for b in order if sizes[b] > 0)
        members = np.flatnonzero(bucket == chosen)
        self.draws += 1
        return self.rng.choice(members, size=count, replace=count > len(members))

    def record(self, ids: Sequence[int], pass_rates: Sequence[float], samples_each: int) -> None:
        """Measured pass rates of the drawn prompts (their groups' mean pass over `samples_each` samples)."""
        ids = np.asarray(ids)
        rates = np.asarray(pass_rates, np.float64)
        np.add.at(self.passes, ids, np.rint(rates * samples_each).astype(np.int64))
        np.add.at(self.attempts, ids, samples_each)
        mean = float(rates.mean())
        self.running = mean if self.running is None else self.cfg.ema * self.running + (1 - self.cfg.ema) * mean
        if self.running >= self.cfg.advance_at and self.level < self.cfg.buckets - 1:
            self.level += 1
            self.running = None  # a new level starts measuring afresh

    def state(self) -> dict[str, Any]:
        """JSON-able: everything `draw` and `record` depend on."""
        return {"passes": self.passes.tolist(), "attempts": self.attempts.tolist(), "level": self.level,
                "running": self.running, "draws": self.draws, "rng": self.rng.bit_generator.state}

    def restore(self, state: dict[str, Any]) -> None:
        self.passes = np.asarray(state["passes"], np.int64)
        self.attempts = np.asarray(state["attempts"], np.int64)
        self.level, self.running, self.draws = int(state["level"]), state["running"], int(state["draws"])
        self.rng.bit_generator.state = state["rng"]

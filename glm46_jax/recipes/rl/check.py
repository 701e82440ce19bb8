"""The reward model's held-out check during RL (`rl.labeller`): at every evaluation the policy samples the check prompts
afresh, and the reward model's verdicts are compared with the labeller's (docs/rl.md#the-reward-model-check).

    check = RewardCheck.start(run_dir, sample, labeller, scorer, items, prompt_ids, samples=4, seed=0)
    metrics = check(sample)      # {"check_win_rate", "check_proxy_win_rate", "check_gap", "check_agreement", ...}

`sample(prompt_ids, group_size, seed)` is the recipe's sampler with the current policy. The starting policy's samples
of the same prompts are the baseline, drawn once and kept in <run_dir>/rl_check_start.json (a resumed run reads them
back). Per check:

  check_win_rate        the labeller's verdict, fresh sample i of a prompt against the starting policy's sample i:
                        the share won (no preference counts half): the gold measure of progress
  check_proxy_win_rate  the reward model's verdict on the same pairs (score higher wins, equal counts half)
  check_gap             proxy minus gold: how far the reward model overrates the policy's progress
  check_agreement       the reward model's pair accuracy on the fresh samples' own labelled pairs (on-policy)
  check_proxy_score     the fresh samples' mean reward-model score (the proxy reward itself)

When check_gap exceeds rl.check_max_gap the proxy and the check have diverged: the recipe asks the trainer to stop,
and with checkpoint.keep_best (best_metric "eval/check_win_rate", best_mode "max") the run ends on its best check.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from glm46_jax import atomic
from glm46_jax.recipes.preference.agreement import agreement
from glm46_jax.recipes.rl import policy_pairs
from glm46_jax.recipes.rl.labellers import Labeller
from glm46_jax.recipes.rl.reward_model import EnsembleScorer, ModelScorer, scored_rows
from glm46_jax.recipes.rl.rollout import Rollout

START_FILE = "rl_check_start.json"
# (prompt token ids, group size, seed) -> (the rollout, its completion texts)
Sampler = Callable[[Sequence[Sequence[int]], int, int], tuple[Rollout, list[str]]]


def _half_wins(labels: Sequence[float | None]) -> float:
    return float(np.mean([0.5 if x is None else x for x in labels]))


@dataclasses.dataclass
class RewardCheck:
    labeller: Labeller
    scorer: ModelScorer | EnsembleScorer
    items: list[Mapping[str, Any]]  # the check prompts' lines
    prompt_ids: list[list[int]]
    samples: int  # per prompt
    seed: int
    start_texts: list[str]  # the starting policy's samples, row r of prompt r // samples
    start_scores: np.ndarray  # the reward model's scores of them
    checks: int = 0
    last: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def start(cls, run_dir: str, sample: Sampler, labeller: Labeller, scorer: ModelScorer | EnsembleScorer,
              items: Sequence[Mapping[str, Any]], prompt_ids: Sequence[Sequence[int]], *, samples: int, seed: int
              ) -> RewardCheck:
        """The check, with the starting policy's samples: drawn now with `sample` (a fresh run), or read back
        from the run dir (a resumed one, whose policy is no longer the starting one)."""
        path = os.path.join(run_dir, START_FILE)
        if os.path.exists(path):
            with open(path) as f:
                saved = json.load(f)
            texts, rows = saved["texts"], saved["rows"]
        else:
            rollout, texts = sample(prompt_ids, samples, seed)
            rows = scored_rows(rollout)
            if jax.process_index() == 0:
                atomic.write_json(path, {"texts": texts, "rows": rows})
        return cls(labeller, scorer, list(items), [list(p) for p in prompt_ids], samples, seed, texts,
                   scorer.score_rows(rows))

    def __call__(self, sample: Sampler) -> dict[str, float]:
        self.checks += 1
        rollout, texts = sample(self.prompt_ids, self.samples, self.seed + 7919 * self.checks)
        scores = self.scorer.score_rows(scored_rows(rollout))
        per_row = [self.items[r // self.samples] for r in range(len(texts))]
        gold = [self.labeller(a, b, item) for a, b, item in zip(texts, self.start_texts, per_row)]
        complete = np.ones(len(texts), bool)  # an unfinished sample is still the policy's: it is judged too
        own = policy_pairs.label_groups(texts, complete, self.items, self.samples, self.labeller,
                                        per_prompt=self.samples * self.samples, seed=self.seed)
        agree = agreement(scores[[p.chosen for p in own.pairs]], scores[[p.rejected for p in own.pairs]])
        win, proxy_win = _half_wins(gold), agreement(scores, self.start_scores)  # the RM's share of the same pairs
        self.last = {"check_win_rate": win, "check_proxy_win_rate": proxy_win, "check_gap": proxy_win - win,
                     "check_agreement": agree, "check_pairs": float(len(own.pairs)),
                     "check_proxy_score": float(scores.mean())}
        return self.last

"""The rollout worker (rl.rollouts_ahead = K > 0): a thread that samples rollout r + K while the trainer updates on
rollout r, with the policy as it was when rollout r was taken (docs/rl.md#rollouts-ahead).

    worker = RolloutsAhead(recipe.sample_rollout, ahead=1, snapshot=recipe._snapshot, rollouts=20)
    sampled = worker.take(index, state)     # rollout `index`; first queues the ones up to index + K
    worker.close()

Rollout r is therefore sampled by the policy after max(0, r - K) rollouts: at most K rollouts (K x updates per
rollout optimizer steps) old. One thread, rollouts in order, so the prompt pool's draws are those of a synchronous
run. The worker reads a copy of the weights (the step donates the state's buffers), so K + 1 copies of the policy
exist at most. The trainer corrects for the lag (rl.base.RLRecipe.reweigh, rl.objective.truncated_importance).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any


class RolloutsAhead:
    def __init__(self, sample: Callable[..., Any], ahead: int, snapshot: Callable[[Any], tuple[Any, Any]],
                 rollouts: int):
        """`sample(index, params, buffers, version)` samples one rollout; `snapshot(state)` copies the policy;
        rollouts from `rollouts` on are never queued (the run ends before them)."""
        self.sample, self.ahead, self.snapshot, self.rollouts = sample, ahead, snapshot, rollouts
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")
        self.futures: dict[int, concurrent.futures.Future] = {}

    def take(self, index: int, state: Any) -> Any:
        """Rollout `index`, once sampled; queues rollouts up to index + K with the policy in `state` (trained on
        `index` rollouts) first, so the worker goes on while the trainer uses this one."""
        missing = [r for r in range(index, min(index + self.ahead + 1, max(self.rollouts, index + 1)))
                   if r not in self.futures]
        if missing:
            params, buffers = self.snapshot(state)  # one copy serves every rollout queued now
            for r in missing:
                self.futures[r] = self.executor.submit(self.sample, r, params, buffers, index)
        return self.futures.pop(index).result()

    def close(self) -> None:
        """Drops the rollouts not taken (a resumed run samples them again) and waits for the worker to stop."""
        for f in self.futures.values():
            f.cancel()
        self.futures = {}
        self.executor.shutdown(wait=True)

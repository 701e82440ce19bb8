"""What GRPO and PPO share as recipes of the generic trainer: `RLRecipe`, the loop rollouts -> rewards -> advantages
-> several clipped updates around the two seams each recipe fills, its step (`steps_for`) and its advantages
(`with_advantages`) (docs/rl.md#the-grpo-recipe).

    recipe, state = GRPO.build(run_cfg)   # (or PPO.build) mesh, policy weights, LoRA, optimizer
    recipe.start(state, data_state)              # the prompt pool (and where a resumed run left it)
    state, summary = trainer.fit(recipe, state, ...)

One trainer step is one optimizer step on one minibatch. When the minibatches of the last rollout are used up,
`next_input` samples the next rollout with the *current* policy (the state the trainer passes it: the weights
the last step returned): `prompts_per_step` prompts from the pool (curriculum), `group_size` samples each with the
project's generator (log-probs, and the experts every token went through for routing replay), rewards, and with
dynamic sampling the groups whose rewards all agree are dropped and refilled from the pool. The recipe's
`with_advantages` adds what its step needs to the kept rows, which are split into `minibatches`, each used `epochs`
times. Held-out `eval/accuracy` is greedy exact-match (pass rate) on the held-out prompts.

Checkpoints hold the policy, the optimizer, the pool (its pass-rate statistics, curriculum level and RNG) and the
rollout count (`data_state`; a recipe adds its own), so a run resumed at a rollout boundary continues
bit-identically; checkpoint.every must be a multiple of the updates per rollout. A run stopped mid-rollout
(preemption) resumes with the next rollout.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from tokenizers import Tokenizer

from glm46_jax import atomic
from glm46_jax.parallel import sharding
from glm46_jax.recipes.base import RecipeBase
from glm46_jax.recipes.rl import heldout, labellers, objective
from glm46_jax.recipes.rl.ahead import RolloutsAhead
from glm46_jax.recipes.rl.check import RewardCheck
from glm46_jax.recipes.rl.config import RLConfig
from glm46_jax.recipes.rl.curriculum import CurriculumConfig, PromptPool
from glm46_jax.recipes.rl.environments import Environment
from glm46_jax.recipes.rl.episodes import episode_stats, run_episodes
from glm46_jax.recipes.rl.logprobs import reference_logprobs
from glm46_jax.recipes.rl.policy_pairs import completion_texts
from glm46_jax.recipes.rl.prompts import tokenizer_path
from glm46_jax.recipes.rl.reward_model import EnsembleScorer, ModelScorer
from glm46_jax.recipes.rl.rewards import Rewards
from glm46_jax.recipes.rl.rollout import (
    Rollout,
    Round,
    SampledRollout,
    Sampling,
    sample_groups,
    trajectory,
    trajectory_rows,
)
from glm46_jax.training.step import TrainState, with_frozen
from glm46_jax.training.trainer import Segment, StepInput


@dataclasses.dataclass(frozen=True)
class RolloutSegment(Segment):
    """The run's one segment, with the latest rollout's metrics (`stats`), logged with the steps trained on it."""
    stats: tuple[tuple[str, float], ...] = dataclasses.field(default=(), compare=False)


def device_batch(batch: Mapping[str, np.ndarray], mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
    """Rollout rows as global arrays on the mesh, split along the batch axes."""
    # Every process holds the whole rollout (the sampler's outputs are replicated); each device takes its rows.
    out = {}
    with jax.transfer_guard_host_to_device("allow"):
        for k, v in batch.items():
            layout = jax.NamedSharding(mesh, sharding.logical("batch", *([None] * (v.ndim - 1))))
            out[k] = jax.make_array_from_callback(v.shape, layout, lambda index, v=v: v[index])
    return out


@dataclasses.dataclass
class RLRecipe(RecipeBase):
    """The shared half of the RL recipes (`trainer.Recipe`); a recipe brings `steps_for`, `with_advantages` and
    `dynamic_sampling`, and may add to `controls`, `data_state` / `restore_data_state` and `extra_meta`."""
    reference: nnx.State | None  # kl_coef > 0: the starting policy's trained weights
    tok: Tokenizer
    items: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    heldout_items: list[dict[str, Any]]
    heldout_ids: list[list[int]]
    rewards: Rewards
    stop_tokens: tuple[int, ...]
    heldout_rewards: Rewards | None = None  # held-out accuracy's; None = `rewards`
    environment: Environment | None = None  # rl.environment: episodes with tools instead of single completions
    scorer: ModelScorer | EnsembleScorer | None = None  # the reward model(s), when `rewards` names it
    pool: PromptPool | None = None
    pending: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    stats: tuple[tuple[str, float], ...] = ()
    rollouts_done: int = 0
    tokens_seen: int = 0
    start_accuracy: float | None = None
    start_passed: np.ndarray | None = None  # which held-out prompts the starting policy passed
    check: RewardCheck | None = None  # rl.labeller: the reward model's check at every evaluation
    ahead: RolloutsAhead | None = None  # rl.rollouts_ahead > 0: the rollout worker
    pool_snapshot: dict[str, Any] | None = None  # rl.rollouts_ahead > 0: the pool after the last rollout taken

    # --- the seams: what each recipe brings ----------------------------------------------------

    @property
    def dynamic_sampling(self) -> bool:
        """Whether groups whose rewards all agree are dropped and refilled from the pool."""
        raise NotImplementedError

    def steps_for(self, segment: Segment) -> Any:
        raise NotImplementedError

    def with_advantages(self, state: TrainState, batch: dict[str, np.ndarray], rewards: np.ndarray
                        ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The rollout's training rows with what the recipe's step needs beyond them (at least "advantages"), and
        statistics of that for the log."""
        raise NotImplementedError

    # --- shared --------------------------------------------------------------------------------

    @property
    def rl(self) -> RLConfig:
        return self.cfg.rl

    @property
    def global_rows(self) -> bool:
        return True  # every process holds the whole rollout

    @property
    def seq_len(self) -> int:
        return self.rl.max_prompt_len + self.rl.max_new_tokens

    def sampling(self, temperature: float) -> Sampling:
        pad = self.cfg.model.pad_token_id or 0
        return Sampling(max_new_tokens=self.rl.max_new_tokens, temperature=temperature, stop_tokens=self.stop_tokens,
                        pad_id=pad, prompt_len=self.rl.max_prompt_len,
                        record_routing=self.rl.routing_replay and temperature > 0)

    def segment(self) -> RolloutSegment:
        return RolloutSegment(f"{self.cfg.recipe}_{self.rl.method}", self.seq_len, self.stats)

    def current_segment(self) -> RolloutSegment:
        return self.segment()

    def _policy_base(self) -> nnx.State | None:
        """The policy's frozen weights (a LoRA run's base), None when it trains in full."""
        frozen = (self.frozen or {}).get("policy")
        return frozen.params if frozen is not None else None

    def whole_params(self, params: nnx.State) -> nnx.State:
        """The policy's whole parameters: the trained ones and, with LoRA, the frozen base."""
        return with_frozen(params, self._policy_base())

    def tokenizer_source(self) -> str:
        return tokenizer_path(self.cfg)

    def describe(self, segment: RolloutSegment) -> dict[str, float]:
        return dict(segment.stats)

    def extra_meta(self) -> dict[str, Any]:
        return {"rl_method": self.rl.method, "rollouts": self.rollouts_done}

    def start(self, state: TrainState, data_state: Any | None = None) -> None:
        rl = self.rl
        difficulty = [int(it.get("difficulty", 0)) for it in self.items]
        self.pool = PromptPool(len(self.items), difficulty, CurriculumConfig(
            rl.curriculum_buckets, rl.curriculum_advance_at, rl.curriculum_ema), seed=self.cfg.train.seed)
        self.pending, self.stats = [], ()
        if data_state is not None:
            self.restore_data_state(data_state)
        elif state is not None:
            metrics, self.start_passed = self.held_out(state)
            self.start_accuracy = metrics["accuracy"]
            logging.info("held-out accuracy of the starting policy: %.3f", self.start_accuracy)
        if rl.labeller and state is not None:
            n = min(rl.check_prompts, len(self.items))
            self.check = RewardCheck.start(self.cfg.run_dir, self._check_sampler(state), labellers.resolve(rl.labeller),
                                           self.scorer, self.items[:n], self.prompt_ids[:n], samples=rl.check_samples,
                                           seed=self.cfg.train.seed)

    def data_state(self) -> dict[str, Any]:
        """What a checkpoint holds of where the run is (JSON-able): the pool (as the last rollout taken for training
        left it: a resumed run samples the rollouts that were in flight again), the rollout count, the tokens seen."""
        pool = self.pool_snapshot if self.pool_snapshot is not None else self.pool.state()
        return {"pool": pool, "rollouts": self.rollouts_done, "tokens_seen": self.tokens_seen,
                "pending": len(self.pending)}

    def restore_data_state(self, data_state: Mapping[str, Any]) -> None:
        self.pool.restore(data_state["pool"])
        self.rollouts_done = int(data_state["rollouts"])
        self.tokens_seen = int(data_state["tokens_seen"])
        if data_state.get("pending"):
            logging.warning("the checkpoint was saved mid-rollout; its %d remaining minibatch(es) are skipped and "
                            "training goes on with a new rollout", data_state["pending"])

    def controls(self, max_loss: float) -> dict[str, jax.Array]:
        """The scalars the step reads."""
        return {"max_loss": jnp.float32(max_loss), "lr": self.lr_inputs}

    def next_input(self, state: TrainState, max_loss: float) -> StepInput:
        with jax.transfer_guard("allow"):
            if not self.pending:
                self.next_rollout(state)
            local = self.pending.pop(0)
            batch = device_batch(local, self.mesh)
            if self.reference is not None and "ref_logprobs" not in batch:
                batch["ref_logprobs"] = self.ref_logprobs(state.buffers, batch)
            controls = self.controls(max_loss)
        self.tokens_seen += int(local["inputs"].size)
        return StepInput(self.segment(), batch, controls, self.tokens_seen, self.data_state())

    @property
    def heldout_count(self) -> int:
        """How many held-out prompts `evaluate` scores (the first ones of `rl.heldout`): train.eval_batches
        chunks of `rl.eval_batch`."""
        return min(len(self.heldout_ids), self.cfg.train.eval_batches * self.rl.eval_batch)

    def evaluate(self, state: TrainState, segment: Segment, controls: Any) -> dict[str, float]:
        """Greedy generation is a prefill and a decode loop, not one program: eval/accuracy, eval/reward,
        eval/response_len of `held_out`."""
        metrics = self.held_out(state)[0]
        if self.check is not None:
            metrics.update(self.check(self._check_sampler(state)))
        return {f"eval/{k}": v for k, v in metrics.items()}

    def stop_reason(self) -> str | None:
        """The reward model's check diverged at the last evaluation: its win rate over the starting policy exceeds
        the labeller's by more than rl.check_max_gap."""
        last = self.check.last if self.check is not None else {}
        if last and last["check_gap"] > self.rl.check_max_gap:
            return (f"the reward model's check diverged: it says the policy beats the starting one on "
                    f"{last['check_proxy_win_rate']:.3f} of the check samples, the labeller "
                    f"{last['check_win_rate']:.3f} "
                    f"(gap {last['check_gap']:.3f} > rl.check_max_gap={self.rl.check_max_gap})")
        return None

    def _check_sampler(self, state: TrainState):
        """The check's sampler (`check.Sampler`): the policy in `state` at the rollouts' temperature."""
        sampling = dataclasses.replace(self.sampling(self.rl.temperature), record_routing=False)

        def sample(prompt_ids, group_size, seed):
            with jax.transfer_guard("allow"), sharding.use_mesh(self.mesh):
                rollout = sample_groups(self.main.graphdef, self.whole_params(state.params), state.buffers, prompt_ids,
                                        group_size, sampling, seed)
            return rollout, self.completions(rollout)
        return sample

    def finish(self, state: TrainState, step: int, run_dir: str, tokens_seen: int) -> str | None:
        """Writes <run_dir>/heldout.json (held-out accuracy before and after); LoRA: also the merged weights."""
        after, passed = self.held_out(state)
        if jax.process_index() == 0:
            atomic.write_json(os.path.join(run_dir, "heldout.json"), heldout.record(
                self.start_accuracy, self.start_passed, after, passed, steps=step, rollouts=self.rollouts_done))
        logging.info("held-out accuracy %s -> %.3f", "n/a" if self.start_accuracy is None else
                     f"{self.start_accuracy:.3f}", after["accuracy"])
        return super().finish(state, step, run_dir, tokens_seen)

    def close(self) -> None:
        self.pending = []
        if self.ahead is not None:
            self.ahead.close()
            self.ahead = None

    # --- rollouts --------------------------------------------------------------------------

    def completions(self, rollout: Rollout) -> list[str]:
        return completion_texts(self.tok, rollout, self.stop_tokens)

    def score(self, rollout: Rollout, items: Sequence[Mapping[str, Any]], rewards: Rewards | None = None
              ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(weighted total [n], each reward [n]) of a rollout: the text rewards and, if named, the reward model's."""
        rewards = rewards or self.rewards
        model_scores = self.scorer(rollout) if rewards.uses_model else None
        return rewards.score(self.completions(rollout), items, model_scores)

    def sample_round(self, params: nnx.State, buffers: nnx.State, ids: Sequence[int], group_size: int,
                     sampling: Sampling, seed: int, heldout: bool = False) -> Round:
        """`group_size` samples (completions, or with rl.environment whole episodes) of prompts `ids` of the
        training (or held-out) prompts in one batch, scored."""
        prompts, items = (self.heldout_ids, self.heldout_items) if heldout else (self.prompt_ids, self.items)
        rows = [i for i in ids for _ in range(group_size)]
        row_items = [items[i] for i in rows]
        if self.environment is None:
            with sharding.use_mesh(self.mesh):
                rollout = sample_groups(self.main.graphdef, params, buffers, [prompts[i] for i in ids], group_size,
                                        sampling, seed)
            total, parts = self.score(rollout, row_items, self.heldout_rewards if heldout else None)
            return Round([trajectory(rollout, r) for r in range(len(rows))], total, parts, rollout.lengths,
                         rollout.seconds)
        with sharding.use_mesh(self.mesh):
            episodes, seconds = run_episodes(self.main.graphdef, params, buffers, self.environment, self.tok,
                                             row_items, [prompts[i] for i in rows], sampling,
                                             max_turns=self.rl.max_turns, max_len=self.seq_len, seed=seed)
        total = np.asarray([e.reward for e in episodes], np.float32)
        return Round([e.trajectory for e in episodes], total, {"environment": total},
                     np.asarray([e.trajectory.new_tokens for e in episodes]), seconds, episodes)

    def sample_rollout(self, index: int, params: nnx.State, buffers: nnx.State, version: int) -> SampledRollout:
        """Rollout `index` sampled with `params` (the policy after `version` rollouts) and scored: prompts drawn
        from the pool (refilled with dynamic sampling), their pass rates recorded. The pool is the only recipe state
        it touches, so the rollout worker may run it ahead of training (rl/ahead.py)."""
        rl, g = self.rl, self.rl.group_size
        sampling = self.sampling(rl.temperature)
        groups, sampled, seconds, new_tokens = [], [], 0.0, 0
        rounds = 1 + (rl.max_refill_rounds if self.dynamic_sampling else 0)
        t0 = time.perf_counter()
        for round_index in range(rounds):
            ids = self.pool.draw(rl.prompts_per_step)
            seed = (self.cfg.train.seed * 1_000_003 + index) * 101 + round_index
            sampled_round = self.sample_round(params, buffers, ids, g, sampling, seed)
            seconds += sampled_round.seconds
            new_tokens += int(sampled_round.new_tokens.sum())
            total = sampled_round.total
            passed = (total >= rl.pass_threshold).astype(np.float32)
            self.pool.record(ids, passed.reshape(-1, g).mean(axis=1), g)
            for j in range(len(ids)):
                rows = np.arange(j * g, (j + 1) * g)
                groups.append((sampled_round, rows, total[rows], bool(total[rows].max() > total[rows].min())))
            sampled.append((total, passed, sampled_round))
            if not self.dynamic_sampling or sum(inf for *_, inf in groups) >= rl.prompts_per_step:
                break
        # Informative groups first (in sampling order); short of them, all-agreeing ones keep the batch's shape.
        kept = sorted(groups, key=lambda x: not x[3])[:rl.prompts_per_step]
        stats = self._rollout_stats(index, sampled, kept, len(groups), seconds, new_tokens, time.perf_counter() - t0,
                                    len(sampled))
        return SampledRollout([r.trajectories[i] for r, idx, _, _ in kept for i in idx],
                              np.concatenate([rw for _, _, rw, _ in kept]), stats, version,
                              self.pool.state() if self.rl.rollouts_ahead else None)

    def _rollout_stats(self, index, sampled, kept, num_groups, sample_s, new_tokens, rollout_s, rounds):
        total = np.concatenate([t for t, *_ in sampled])
        passed = np.concatenate([p for _, p, _ in sampled])
        lengths = np.concatenate([r.new_tokens for *_, r in sampled])
        group_std = total.reshape(-1, self.rl.group_size).std(axis=1)
        stats = {"reward_mean": float(total.mean()), "reward_std": float(total.std()),
                 "group_reward_std": float(group_std.mean()), "pass_at_1": float(passed.mean()),
                 "response_len": float(lengths.mean()), "kept_groups_frac": sum(k[3] for k in kept) / len(kept),
                 "informative_groups_frac": float(np.mean(group_std > 0)), "rollout_rounds": float(rounds),
                 "sampled_groups": float(num_groups), "rollout_s": rollout_s, "sampling_s": sample_s,
                 "sampling_tokens_per_s": new_tokens / max(sample_s, 1e-9),
                 "curriculum_level": float(self.pool.level), "rollouts": float(index + 1)}
        if self.environment is None:
            for name in self.rewards.names:
                stats[f"reward/{name}"] = float(np.concatenate([r.parts[name] for *_, r in sampled]).mean())
        else:
            stats.update(episode_stats([e for *_, r in sampled for e in r.episodes]))
        return tuple(stats.items())

    def next_rollout(self, state: TrainState) -> None:
        """The next rollout (sampled now with the policy in `state`, or taken from the rollout worker), its rows'
        advantages, and its minibatches queued."""
        rl = self.rl
        t0 = time.perf_counter()
        if rl.rollouts_ahead:
            sampled = self.worker().take(self.rollouts_done, state)
            self.pool_snapshot = sampled.pool_after
        else:
            sampled = self.sample_rollout(self.rollouts_done, self.whole_params(state.params), state.buffers,
                                          self.rollouts_done)
        waited = {"rollout_wait_s": time.perf_counter() - t0}  # all of the sampling, or what the worker did not hide
        batch = trajectory_rows(sampled.trajectories, self.seq_len, self.sampling(rl.temperature).pad_id,
                                self.cfg.model.num_experts_per_tok)
        off_policy = {}
        if rl.rollouts_ahead:
            batch, off_policy = self.reweigh(state, batch, self.rollouts_done - sampled.version)
        batch, extra_stats = self.with_advantages(state, batch, sampled.rewards)
        order = np.random.default_rng([self.cfg.train.seed, self.rollouts_done]).permutation(len(batch["inputs"]))
        chunks = np.array_split(order, rl.minibatches)
        self.pending = [{k: v[c] for k, v in batch.items()} for _ in range(rl.epochs) for c in chunks]
        self.rollouts_done += 1
        self.stats = sampled.stats + tuple(waited.items()) + tuple(off_policy.items()) + tuple(extra_stats.items())

    def worker(self) -> RolloutsAhead:
        if self.ahead is None:
            rollouts = -(-self.cfg.total_steps // self.rl.updates_per_rollout)
            self.ahead = RolloutsAhead(self.sample_rollout, self.rl.rollouts_ahead, self._snapshot, rollouts)
        return self.ahead

    def _snapshot(self, state: TrainState) -> tuple[nnx.State, nnx.State]:
        """The policy's whole weights and buffers as copies the rollout worker may read while the step (which
        donates the state) goes on."""
        with jax.transfer_guard("allow"), sharding.use_mesh(self.mesh):
            params, buffers = jax.tree.map(jnp.copy, (state.params, state.buffers))
        return self.whole_params(params), buffers

    def reweigh(self, state: TrainState, batch: dict[str, np.ndarray], staleness: int
                ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """A rollout sampled by an older policy: the clipped ratio is taken against the current policy's log-probs
        (recomputed here), and each token weighted by the truncated importance ratio to the sampler's."""
        with jax.transfer_guard("allow"), sharding.use_mesh(self.mesh):
            fn = reference_logprobs(self.main.graphdef, self.rl.temperature, self.rl.routing_replay)
            current = np.asarray(jax.device_get(fn(state.params, self._policy_base(), state.buffers,
                                                   device_batch(batch, self.mesh))), np.float32)
        mask = batch["completion_mask"]
        weights, stats = objective.truncated_importance(current, batch["old_logprobs"], mask, self.rl.importance_cap)
        batch = {**batch, "old_logprobs": current * mask, "is_weights": weights}
        return batch, {"staleness": float(staleness), **stats}

    def ref_logprobs(self, buffers: nnx.State, batch: dict[str, jax.Array]) -> jax.Array:
        """The KL reference's log-probs of a batch's completions (rl.kl_coef > 0)."""
        fn = reference_logprobs(self.main.graphdef, self.rl.temperature, self.rl.routing_replay)
        with sharding.use_mesh(self.mesh):
            return fn(self.reference, self._policy_base(), buffers, batch)

    # --- held-out accuracy -------------------------------------------------------------------

    def heldout_metrics(self, state: TrainState, ids: np.ndarray) -> tuple[dict[str, float], np.ndarray]:
        """Greedy completions (or episodes) of held-out prompts `ids`: accuracy (pass rate), mean reward, response
        length (the tokens the model wrote); and which prompts passed (bool, one per id)."""
        with jax.transfer_guard("allow"):
            params = self.whole_params(state.params)
            held = self.sample_round(params, state.buffers, ids, 1, self.sampling(0.0), seed=0, heldout=True)
        passed = np.asarray(held.total >= self.rl.pass_threshold)
        out = {"accuracy": float(np.mean(passed)), "reward": float(held.total.mean()),
               "response_len": float(held.new_tokens.mean())}
        if held.episodes is not None:
            out.update(episode_stats(held.episodes))
        return out, passed

    def held_out(self, state: TrainState) -> tuple[dict[str, float], np.ndarray]:
        """`heldout_metrics` over the first `heldout_count` held-out prompts in chunks of `rl.eval_batch`, averaged
        per prompt, and whether each prompt passed (heldout.json keeps both ends': `recipes.rl.heldout`)."""
        n, size = self.heldout_count, self.rl.eval_batch
        results = [(len(ids), *self.heldout_metrics(state, ids))
                   for ids in (np.arange(i, min(i + size, n)) for i in range(0, n, size))]
        n = sum(size for size, _, _ in results)
        metrics = {k: sum(size * r[k] for size, r, _ in results) / n for k in results[0][1]}
        return metrics, np.concatenate([passed for _, _, passed in results])

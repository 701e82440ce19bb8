"""Rollouts: G samples per prompt from the project's sampler (log-probs and, for routing replay, the experts
chosen for every token kept), their rewards, and the training rows built from them (docs/rl.md#rollouts).

    rollout = sample_groups(graphdef, params, buffers, prompts, group_size=8, sampling=..., seed=3)
    rows = training_rows(rollout, np.arange(16), seq_len=40, pad_id=0)   # numpy batch for the GRPO step

A training row is the prompt then the completion (right-padded to `seq_len`), so its positions 0..s-1 are the
sampler's RoPE positions; the sampler's cache slot of row position t is `start + t` (its left padding).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jaxtyping import Float, Int

from glm46_jax.infer.generate import generate


@dataclasses.dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0
    stop_tokens: tuple[int, ...] = ()
    pad_id: int = 0
    prompt_len: int | None = None  # pad prompts to this many slots (one compiled prefill)
    record_routing: bool = False


@dataclasses.dataclass
class Rollout:
    """Host copies of one sampling call: row i is sample i % G of prompt i // G."""
    prompts: list[list[int]]  # per row
    tokens: Int[np.ndarray, "n m"]
    logprobs: Float[np.ndarray, "n m"]
    lengths: Int[np.ndarray, " n"]
    routing: Int[np.ndarray, "n slots l k"] | None
    prompt_slots: int  # P: the padded prompt length the sampler used
    seconds: float  # wall time of the sampling call (device work included)

    def completion(self, row: int) -> list[int]:
        return self.tokens[row, :self.lengths[row]].tolist()


def sample_groups(graphdef: nnx.GraphDef, params: nnx.State, buffers: nnx.State, prompts: Sequence[Sequence[int]],
                  group_size: int, sampling: Sampling, seed: int) -> Rollout:
    """`group_size` samples of each prompt in one batch (under the current mesh)."""
    rows = [list(p) for p in prompts for _ in range(group_size)]
    t0 = time.perf_counter()
    gen = generate(graphdef, params, buffers, rows, max_new_tokens=sampling.max_new_tokens,
                   temperature=sampling.temperature, stop_tokens=sampling.stop_tokens, seed=seed,
                   pad_id=sampling.pad_id, prompt_len=sampling.prompt_len, record_routing=sampling.record_routing)
    with jax.transfer_guard_device_to_host("allow"):
        tokens, logprobs, lengths, routing = jax.device_get((gen.tokens, gen.logprobs, gen.lengths, gen.routing))
    slots = max(max(map(len, rows)), sampling.prompt_len or 0)
    return Rollout(rows, np.asarray(tokens), np.asarray(logprobs), np.asarray(lengths),
                   None if routing is None else np.asarray(routing), slots, time.perf_counter() - t0)


def strip_stop(tokens: Sequence[int], stop_tokens: Sequence[int]) -> list[int]:
    """The completion without its final stop token (what a reward reads)."""
    tokens = list(tokens)
    return tokens[:-1] if tokens and tokens[-1] in stop_tokens else tokens


@dataclasses.dataclass
class Trajectory:
    """One training row's tokens as sampled: a prompt and a completion, or a whole multi-turn episode (prompt, model
    turns, tool turns; rl/episodes.py). Only the tokens the model wrote are trained on."""
    tokens: list[int]
    generated: np.ndarray  # bool [len]: the model sampled this token
    logprobs: np.ndarray  # float32 [len]: the sampler's log-prob of it (0 where not generated)
    routing: np.ndarray | None  # int32 [fed, l, k]: experts used at each position the sampler fed (all but the last)

    @property
    def new_tokens(self) -> int:
        return int(self.generated.sum())


def trajectory(rollout: Rollout, row: int) -> Trajectory:
    """Row `row` of a single-turn rollout as a Trajectory: its prompt, then its completion."""
    prompt, n = rollout.prompts[row], int(rollout.lengths[row])
    p = len(prompt)
    generated = np.zeros(p + n, bool)
    generated[p:] = True
    logprobs = np.zeros(p + n, np.float32)
    logprobs[p:] = rollout.logprobs[row, :n]
    routing = None
    if rollout.routing is not None:
        start = rollout.prompt_slots - p
        routing = rollout.routing[row, start:start + p + n - 1]
    return Trajectory(prompt + rollout.tokens[row, :n].tolist(), generated, logprobs, routing)


def training_rows(rollout: Rollout, rows: Sequence[int], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """`trajectory_rows` of rows `rows` of a single-turn rollout."""
    return trajectory_rows([trajectory(rollout, r) for r in rows], seq_len, pad_id, num_experts_per_tok(rollout))


def num_experts_per_tok(rollout: Rollout) -> int | None:
    return None if rollout.routing is None else rollout.routing.shape[-1]


def trajectory_rows(trajectories: Sequence[Trajectory], seq_len: int, pad_id: int,
                    experts_per_tok: int | None) -> dict[str, np.ndarray]:
    """The GRPO step's arrays for `trajectories` (advantages are added by the caller):

    inputs [b, s]               the trajectory's tokens, then pad_id
    completion_mask [b, s-1]    1 where label position t predicts a token the model generated (inputs[t + 1]):
                                a prompt's and a tool turn's tokens carry no loss, KL or value target
    old_logprobs [b, s-1]       the sampler's log-prob of that token (0 elsewhere)
    expert_ids [b, s, l, k]     (routing replay, `experts_per_tok` = k) the experts the sampler used at each fed
                                position; positions it never fed (the last token, padding) hold expert ids 0..k-1,
                                which only influence outputs nothing is trained on (attention is causal)
    replay_mask [b, s]          1 at the fed positions of generated tokens (where routing mismatch is measured)
    """
    b = len(trajectories)
    inputs = np.full((b, seq_len), pad_id, np.int32)
    mask = np.zeros((b, seq_len - 1), np.float32)
    old = np.zeros((b, seq_len - 1), np.float32)
    replay_mask = np.zeros((b, seq_len), np.float32)
    expert_ids = None
    for out, t in enumerate(trajectories):
        n = len(t.tokens)
        if n > seq_len:
            raise ValueError(f"trajectory {out}: {n} tokens > seq_len {seq_len}")
        inputs[out, :n] = t.tokens
        mask[out, :n - 1] = t.generated[1:]
        old[out, :n - 1] = t.logprobs[1:]
        replay_mask[out, :n - 1] = t.generated[:n - 1]  # the last token is never fed
        if t.routing is not None:
            if expert_ids is None:
                expert_ids = np.broadcast_to(np.arange(experts_per_tok, dtype=np.int32),
                                             (b, seq_len, t.routing.shape[1], experts_per_tok)).copy()
            expert_ids[out, :len(t.routing)] = t.routing
    batch = {"inputs": inputs, "completion_mask": mask, "old_logprobs": old, "replay_mask": replay_mask}
    if expert_ids is not None:
        batch["expert_ids"] = expert_ids
    return batch


@dataclasses.dataclass
class Round:
    """One sampling call, scored: row i is sample i % G of prompt i // G."""
    trajectories: list[Trajectory]
    total: np.ndarray  # [n] the weighted reward
    parts: dict[str, np.ndarray]  # [n] each reward by name
    new_tokens: np.ndarray  # [n] the tokens the model wrote
    seconds: float  # wall time of the sampling (device work included)
    episodes: list[Any] | None = None  # rl.environment: the rows' rl/episodes.Episode records


@dataclasses.dataclass
class SampledRollout:
    """A rollout's kept rows as sampled and scored, and their statistics."""
    trajectories: list[Trajectory]
    rewards: np.ndarray  # [rows]
    stats: tuple[tuple[str, float], ...]
    version: int  # rollouts the sampling policy had been trained on
    pool_after: dict[str, Any] | None  # the prompt pool's state after its draws (rollouts sampled ahead)

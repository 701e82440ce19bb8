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


def training_rows(rollout: Rollout, rows: Sequence[int], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """The GRPO step's arrays for `rows` of the rollout (advantages are added by the caller):

    inputs [b, s]               prompt + completion, then pad_id
    completion_mask [b, s-1]    1 where label position t predicts a completion token (inputs[t + 1])
    old_logprobs [b, s-1]       the sampler's log-prob of that token (0 elsewhere)
    expert_ids [b, s, l, k]     (routing replay) the experts the sampler used at each fed position; positions it
                                never fed (the last completion token, padding) hold expert ids 0..k-1, which only
                                influence outputs nothing is trained on (attention is causal)
    replay_mask [b, s]          1 at the fed completion positions (where routing mismatch is measured)
    """
    b = len(rows)
    inputs = np.full((b, seq_len), pad_id, np.int32)
    mask = np.zeros((b, seq_len - 1), np.float32)
    old = np.zeros((b, seq_len - 1), np.float32)
    replay_mask = np.zeros((b, seq_len), np.float32)
    routing = rollout.routing
    if routing is not None:
        k = routing.shape[-1]
        expert_ids = np.broadcast_to(np.arange(k, dtype=np.int32), (b, seq_len, routing.shape[2], k)).copy()
    for out, row in enumerate(rows):
        prompt, n = rollout.prompts[row], int(rollout.lengths[row])
        p = len(prompt)
        if p + n > seq_len:
            raise ValueError(f"row {row}: prompt {p} + completion {n} tokens > seq_len {seq_len}")
        inputs[out, :p] = prompt
        inputs[out, p:p + n] = rollout.tokens[row, :n]
        mask[out, p - 1:p - 1 + n] = 1.0
        old[out, p - 1:p - 1 + n] = rollout.logprobs[row, :n]
        fed = p + n - 1  # the prompt and every completion token but the last went through the model
        replay_mask[out, p:fed] = 1.0
        if routing is not None:
            start = rollout.prompt_slots - p
            expert_ids[out, :fed] = routing[row, start:start + fed]
    batch = {"inputs": inputs, "completion_mask": mask, "old_logprobs": old, "replay_mask": replay_mask}
    if routing is not None:
        batch["expert_ids"] = expert_ids
    return batch

"""A reward model as an RL reward (`rl.rewards=("reward_model",)`, `rl.reward_model=<dir>`): rollouts scored from
their token ids in one batch on the run's mesh, read at each row's last token (docs/preferences.md#as-an-rl-reward).

    scorer = ModelScorer.load(rl.reward_model, mesh, policy_tokenizer="runs/x/tokenizer.json", pad_id=0, row_len=40)
    scores = scorer(rollout)            # np.float32 [rows]: prompt + completion (its stop token included)

The directory is a `reward` run (or one of its checkpoints) or its ckpt-to-hf export (glm46_jax.interop.reward); its
tokenizer must be the policy's, or the ids would mean different text to the two models.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm46_jax.errors import InputError
from glm46_jax.interop.reward import load_reward_model
from glm46_jax.model import apply
from glm46_jax.parallel import sharding
from glm46_jax.recipes.rl.rollout import Rollout


def reward_model_tokenizer(path: str) -> str | None:
    """The tokenizer.json a reward-model directory carries (an export's own, or its run's)."""
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return os.path.join(path, "tokenizer.json")
    from glm46_jax.training import checkpoint
    try:
        return checkpoint.tokenizer_path(checkpoint.latest_checkpoint(path))
    except FileNotFoundError:
        return None


def check_same_tokenizer(reward_dir: str, policy_tokenizer: str) -> None:
    found = reward_model_tokenizer(reward_dir)
    if found is None:
        raise InputError(f"rl.reward_model={reward_dir}: no tokenizer.json with it; export the reward run with its "
                         "tokenizer (convert ckpt-to-hf) so the policy's token ids can be checked against it")
    with open(found, "rb") as a, open(policy_tokenizer, "rb") as b:
        if a.read() != b.read():
            raise InputError(f"rl.reward_model={reward_dir}: its tokenizer ({found}) differs from the policy's "
                             f"({policy_tokenizer}); train the reward model on data tokenized like the policy's")


@dataclasses.dataclass
class ModelScorer:
    graphdef: nnx.GraphDef
    params: nnx.State
    buffers: nnx.State
    mesh: jax.sharding.Mesh
    pad_id: int
    row_len: int = 0  # rows are padded to at least this many tokens (one compiled program for every rollout)

    @classmethod
    def load(cls, path: str, mesh: jax.sharding.Mesh, *, policy_tokenizer: str, pad_id: int, row_len: int = 0
             ) -> ModelScorer:
        check_same_tokenizer(path, policy_tokenizer)
        cfg, graphdef, params, buffers = load_reward_model(path, mesh)
        if cfg.score_head != 1:
            raise InputError(f"rl.reward_model={path}: its score head has {cfg.score_head} outputs; a reward is one")
        return cls(graphdef, params, buffers, mesh, pad_id, row_len)

    @functools.cached_property
    def _score(self):
        def score(params, buffers, inputs, last):
            out = apply(self.graphdef, params, buffers, inputs, with_mtp=False, with_logits=False)
            one_hot = jax.nn.one_hot(last, inputs.shape[1], dtype=jnp.float32)
            return jnp.einsum("bs,bs->b", out.scores[..., 0], one_hot, out_sharding=sharding.logical("batch"))
        return jax.jit(score)

    def score_rows(self, rows: list[list[int]]) -> np.ndarray:
        """Each token row's reward at its last token; rows right-padded into one batch whose size the mesh's batch
        shards divide."""
        shards = self.mesh.shape["data"] * self.mesh.shape["expert"]
        n = len(rows)
        b = -(-n // shards) * shards
        inputs = np.full((b, max(self.row_len, *map(len, rows))), self.pad_id, np.int32)
        last = np.zeros((b,), np.int32)
        for i, r in enumerate(rows):
            inputs[i, :len(r)] = r
            last[i] = len(r) - 1
        with jax.transfer_guard("allow"), sharding.use_mesh(self.mesh):
            put = [jax.make_array_from_callback(x.shape, jax.NamedSharding(self.mesh, sharding.logical(
                "batch", *([None] * (x.ndim - 1)))), lambda index, x=x: x[index]) for x in (inputs, last)]
            scores = jax.device_get(self._score(self.params, self.buffers, *put))
        return np.asarray(scores, np.float32)[:n]

    def __call__(self, rollout: Rollout) -> np.ndarray:
        return self.score_rows(scored_rows(rollout))


@dataclasses.dataclass
class EnsembleScorer:
    """k reward models (e.g. trained with k seeds) as one conservative reward: per row, the mean of their scores
    minus `penalty` x their standard deviation, so a sample the members disagree on earns less
    (docs/preferences.md#an-ensemble)."""
    members: list[ModelScorer]
    penalty: float

    def score_rows(self, rows: list[list[int]]) -> np.ndarray:
        scores = np.stack([m.score_rows(rows) for m in self.members]).astype(np.float64)
        return (scores.mean(axis=0) - self.penalty * scores.std(axis=0)).astype(np.float32)

    def __call__(self, rollout: Rollout) -> np.ndarray:
        return self.score_rows(scored_rows(rollout))


def scored_rows(rollout: Rollout) -> list[list[int]]:
    """Prompt + completion (its stop token included) per row: what a reward model scores."""
    return [list(rollout.prompts[i]) + rollout.completion(i) for i in range(len(rollout.prompts))]

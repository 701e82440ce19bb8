"""`python -m glm46_jax.rlhf --config=configs/rlhf.py:tiny [--config.rounds=2]`: RLHF in rounds (`RLHFConfig`).

Round r (docs/preferences.md#rounds):
  1. pairs         `python -m data_prep policy-preferences` on the policy round r - 1 ended on (round 1: the SFT
                   start), labelled by `ppo.rl.labeller`                                   -> <out>/round<r>/pairs
  2. reward model  the reward config from its own `checkpoint.init_from` on every round's pairs so far (round 1: its
                   pairs; later rounds: all rounds' pair files through `data_prep preferences`)
                                                                                     -> <out>/round<r>/reward
                   with `reward_models` = k > 1, k of them, member i with train.seed and data.seed + i: an ensemble
                   (docs/preferences.md#an-ensemble)                         -> <out>/round<r>/reward_<i>, i >= 1
  3. PPO           the PPO config from that policy against that reward model (or ensemble) -> <out>/round<r>/ppo
and prints what `make rlhf` prints: each reward model's held-out pair accuracy, PPO's held-out exact match before and
after and the reward model's check over the steps (check_curve.png in the PPO run).

A stage whose output is complete is skipped and an interrupted training stage resumes from its checkpoint, so a
stopped pipeline is re-run with the same command. The data stages run as `python -m data_prep` subprocesses (the
package never imports data_prep); the training stages run in this process, as `python -m glm46_jax.train` would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from glm46_jax.errors import InputError, check_at_least
from glm46_jax.run_config import RunConfig
from glm46_jax.run_config import from_config_dict as from_run_config


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How each round samples and pairs (`data_prep policy-preferences`' flags of the same names)."""
    samples: int = 16  # completions per prompt
    pairs_per_prompt: int = 3
    max_prompts: int = 0  # the first N prompts of ppo.rl.prompts (0 = all)
    heldout_fraction: float = 0.05  # of the prompts, by content hash (the same prompts every round)
    batch_prompts: int = 256  # prompts per sampling call
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self):
        check_at_least("sampling", self, 2, "samples")
        check_at_least("sampling", self, 1, "pairs_per_prompt", "batch_prompts")
        check_at_least("sampling", self, 0, "max_prompts")


@dataclasses.dataclass(frozen=True)
class RLHFConfig:
    """configs/rlhf.py read once: the rounds, where they go, the sampling, and the two stages' run configs (checked
    here, before anything is sampled)."""
    rounds: int
    out: str
    reward_models: int  # per round: the ensemble's members, PPO's rl.reward_model and rl.reward_ensemble
    sampling: SamplingConfig
    reward: RunConfig
    ppo: RunConfig


def from_config_dict(c: Any) -> RLHFConfig:
    cfg = RLHFConfig(rounds=c.rounds, out=c.out, reward_models=c.reward_models,
                     sampling=SamplingConfig(**c.sampling.to_dict()),
                     reward=from_run_config(c.reward), ppo=from_run_config(c.ppo))
    check(cfg)
    return cfg


def round_dir(out: str, r: int) -> str:
    return os.path.join(out, f"round{r}")


def complete(run_dir: str) -> bool:
    """A training run that finished (status.json says so)."""
    path = os.path.join(run_dir, "status.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return json.load(f).get("state") == "complete"


def check(c: RLHFConfig) -> None:
    for name in ("rounds", "reward_models"):
        if getattr(c, name) < 1:
            raise InputError(f"{name}={getattr(c, name)}: must be >= 1; set --config.{name}")
    if c.reward.recipe != "reward" or c.ppo.recipe != "ppo":
        raise InputError(f"reward and ppo must be a reward and a PPO config (got recipes {c.reward.recipe!r} and "
                         f"{c.ppo.recipe!r}): configs/reward.py and configs/ppo.py presets")
    if not c.ppo.rl.labeller:
        raise InputError("ppo.rl.labeller is empty: the rounds label their pairs with it (e.g. exact_answer, "
                         "file:labels.jsonl, module:function; glm46_jax/recipes/rl/labellers.py)")
    if "reward_model" not in tuple(c.ppo.rl.rewards):
        raise InputError(f"ppo.rl.rewards={tuple(c.ppo.rl.rewards)}: the rounds train PPO against their reward "
                         "model; add 'reward_model'")
    if not c.ppo.checkpoint.init_from or not c.reward.checkpoint.init_from:
        raise InputError("ppo.checkpoint.init_from and reward.checkpoint.init_from: set both (the SFT policy)")


def _data_prep(args: Sequence[str]) -> None:
    """One `python -m data_prep` command; its own error line is the user's (exit 2 passes through)."""
    cmd = [sys.executable, "-m", "data_prep", *args]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, check=False)
    if done.returncode:
        raise InputError(f"`python -m data_prep {args[0]}` failed (exit {done.returncode}; its message is above)")


def pairs_args(c: RLHFConfig, policy: str, out: str) -> list[str]:
    p, rl = c.sampling, c.ppo.rl
    return ["policy-preferences", "--checkpoint", policy, "--prompts", rl.prompts, "--labeller", rl.labeller,
            "--samples", str(p.samples), "--pairs-per-prompt", str(p.pairs_per_prompt),
            "--max-prompts", str(p.max_prompts), "--max-prompt-len", str(rl.max_prompt_len),
            "--max-new-tokens", str(rl.max_new_tokens), "--temperature", str(p.temperature),
            "--batch-prompts", str(p.batch_prompts), "--seed", str(p.seed),
            "--heldout-fraction", str(p.heldout_fraction), "--max-len", str(c.reward.preference.seq_len),
            *([] if rl.chat else ["--raw"]), "--out", out]


def reward_data(c: RLHFConfig, r: int) -> str:
    """The reward model's data for round r: round 1's pairs as written, later rounds every round's pairs together."""
    out = c.out
    if r == 1:
        return os.path.join(round_dir(out, 1), "pairs")
    merged = os.path.join(round_dir(out, r), "reward_pairs")
    if not os.path.isfile(os.path.join(merged, "metadata.json")):
        inputs = [a for k in range(1, r + 1)
                  for a in ("--input", os.path.join(round_dir(out, k), "pairs", "_source", "pairs.jsonl"))]
        _data_prep(["preferences", *inputs, "--tokenizer", os.path.join(round_dir(out, 1), "pairs", "tokenizer.json"),
                    "--heldout-fraction", str(c.sampling.heldout_fraction),
                    "--max-len", str(c.reward.preference.seq_len), "--out", merged])
    return merged


def _train(stage: Any, run_dir: str, devices: Sequence[Any] | None, **fields: Any) -> None:
    """The stage's config file values (a ConfigDict) with `fields` set, trained as `python -m glm46_jax.train`."""
    from glm46_jax import train

    if complete(run_dir):
        print(f"{run_dir}: complete, kept", file=sys.stderr)
        return
    stage = stage.copy_and_resolve_references()
    with stage.unlocked():
        stage.run_dir = run_dir
        for dotted, value in fields.items():
            section, name = dotted.split(".")
            stage[section][name] = value
    train.train(from_run_config(stage), devices)


def run(config: Any, devices: Sequence[Any] | None = None) -> list[dict[str, Any]]:
    """All rounds of a configs/rlhf.py ConfigDict; returns each round's directories: "pairs", "reward" (the first
    reward model), "reward_ensemble" (the other members, a list) and "ppo"."""
    c = from_config_dict(config)
    done = []
    for r in range(1, c.rounds + 1):
        d = round_dir(c.out, r)
        policy = c.ppo.checkpoint.init_from if r == 1 else done[-1]["ppo"]
        pairs = os.path.join(d, "pairs")
        if not os.path.isfile(os.path.join(pairs, "metadata.json")):
            _data_prep(pairs_args(c, policy, pairs))
        members = [os.path.join(d, "reward" if i == 0 else f"reward_{i}") for i in range(c.reward_models)]
        for i, member in enumerate(members):
            _train(config.reward, member, devices, **{"preference.root": reward_data(c, r),
                                                      "train.seed": c.reward.train.seed + i,
                                                      "data.seed": c.reward.data.seed + i})
        ppo = os.path.join(d, "ppo")
        _train(config.ppo, ppo, devices, **{"checkpoint.init_from": policy, "rl.reward_model": members[0],
                                            "rl.reward_ensemble": tuple(members[1:])})
        done.append({"pairs": pairs, "reward": members[0], "reward_ensemble": members[1:], "ppo": ppo})
    return done


def main(argv: Sequence[str]) -> None:
    from absl import flags

    from glm46_jax.recipes.rl import check_curve

    del argv
    c = flags.FLAGS.config
    for r, stages in enumerate(run(c), 1):
        print(f"== round {r} of {c.rounds}: {stages['ppo']}")
        print("\n".join(check_curve.summary_lines(stages["ppo"], [stages["reward"], *stages["reward_ensemble"]])))
        if check_curve.check_records(stages["ppo"]):
            print(f"-> {check_curve.plot(stages['ppo'])}")


if __name__ == "__main__":
    from ml_collections import config_flags

    from glm46_jax import cli

    config_flags.DEFINE_config_file("config", None, "RLHF rounds config file, e.g. configs/rlhf.py:tiny.",
                                    lock_config=True)
    cli.run_absl(main)

"""RLHF rounds as one config: `get_config("<preset>")` for tiny | glm46.

    make rlhf                                                                   # tiny, one round
    python -m glm46_jax.rlhf --config=configs/rlhf.py:tiny --config.rounds=2
    python -m glm46_jax.rlhf --config=configs/rlhf.py:tiny --config.reward.train.steps=800

Each round samples the policy (round 1: the SFT start, `ppo.checkpoint.init_from`) on the PPO prompts, labels pairs
of its completions (`sampling`), trains the reward model (`reward`: configs/reward.py's preset, from
`reward.checkpoint.init_from` every round; `reward_models` of them with seeds 0, 1, ...: an ensemble) on every
round's pairs so far, then runs PPO (`ppo`: configs/ppo.py's preset) from that policy against it; the next round
samples the policy PPO ended on (docs/preferences.md#rounds).
Every field of `reward` and `ppo` is their own config file's; the rounds set only their run dirs, the reward
model's data and init, and PPO's start and reward model. Sampling reads `ppo.rl`'s prompt file, prompt length and
completion length, the labeller is `ppo.rl.labeller`, and the pairs' longest allowed length is
`reward.preference.seq_len`, so each setting has one place.
"""

import os

import ml_collections

from glm46_jax.errors import InputError
from glm46_jax.run_config import config_file

_HERE = os.path.dirname(os.path.abspath(__file__))
_PRESETS = {
    # make rlhf: 16 samples of each of the 7,000 training prompts of data/rlhf_addition, up to 3 labelled pairs of
    # each (14,147 pairs from the SFT start), and two reward models on them (seeds 0 and 1): PPO scores with their
    # ensemble, because two reward models of one config and the same pairs, equally accurate on held-out pairs (0.990),
    # led PPO up (+6 to +8 standard errors) and nowhere (0 to +0.6) (docs/preferences.md#the-cpu-demos).
    "tiny": dict(reward_models=2, sampling=dict(samples=16, pairs_per_prompt=3, max_prompts=0, heldout_fraction=0.05,
                                                batch_prompts=256)),
    "glm46": dict(reward_models=1, sampling=dict(samples=8, pairs_per_prompt=2, max_prompts=0, heldout_fraction=0.05,
                                                 batch_prompts=64)),
}


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    if preset not in _PRESETS:
        raise InputError(f"unknown preset {preset!r}; choose one of {sorted(_PRESETS)}")
    c = ml_collections.ConfigDict()
    c.rounds = 1
    c.reward_models = _PRESETS[preset]["reward_models"]  # per round; 2 or more: PPO scores with their ensemble
    c.out = f"runs/rlhf_{preset}"  # <out>/round<r>/{pairs,reward_pairs,reward,reward_<i>,ppo}
    c.sampling = dict(_PRESETS[preset]["sampling"], temperature=1.0, seed=0)  # glm46_jax.rlhf.SamplingConfig
    c.reward = config_file(os.path.join(_HERE, "reward.py"), preset)
    c.ppo = config_file(os.path.join(_HERE, "ppo.py"), preset)
    return c

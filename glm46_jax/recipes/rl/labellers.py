"""Labellers: who says which of two completions of one prompt is better, for on-policy preference pairs and the
reward model's check during RL (docs/preferences.md#on-policy-pairs).

    label = resolve("exact_answer")          # a checker: the completion with the higher reward wins
    label("319", "318", {"prompt": "312+7", "answer": "319"})   # 1.0: the first is better
    label = resolve("file:labels.jsonl")     # human labels: {"prompt", "a", "b", "preferred": "a" | "b" | "tie"}

A labeller is `label(a: str, b: str, item: dict) -> float | None`: 1.0 when `a` is better, 0.0 when `b` is, None
when it has no preference (a tie, or a pair it has no label for). A name is a reward of recipes/rl/rewards.py
("exact_answer", "code_tests", ..., or "module:reward" prefixed "reward:"), "file:<path>", or "module:function"
for any importable labeller.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from glm46_jax.errors import InputError
from glm46_jax.recipes.rl import rewards as rl_rewards

Labeller = Callable[[str, str, Mapping[str, Any]], "float | None"]
_PREFERRED = {"a": 1.0, "b": 0.0, "tie": None}


@dataclasses.dataclass(frozen=True)
class FromReward:
    """A checker as a labeller: the completion with the higher reward is better; equal rewards are no preference."""
    reward: rl_rewards.RewardFn

    def __call__(self, a: str, b: str, item: Mapping[str, Any]) -> float | None:
        ra, rb = self.reward(a, item), self.reward(b, item)
        return None if ra == rb else float(ra > rb)


@dataclasses.dataclass(frozen=True)
class FileLabels:
    """Labels given in a JSONL file (e.g. by people): one line per (prompt, a, b); asked about (prompt, b, a) it
    answers the mirror label, about a pair it has no line for None."""
    path: str
    labels: Mapping[tuple[str, str, str], float | None]

    @classmethod
    def read(cls, path: str) -> FileLabels:
        labels: dict[tuple[str, str, str], float | None] = {}
        try:
            f = open(path)
        except OSError as e:
            raise InputError(f"labeller file:{path}: cannot read it ({e.strerror})") from e
        with f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    key = (str(row["prompt"]), str(row["a"]), str(row["b"]))
                    labels[key] = _PREFERRED[row["preferred"]]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise InputError(f"{path}:{number}: expected {{\"prompt\", \"a\", \"b\", \"preferred\": \"a\" | "
                                     f"\"b\" | \"tie\"}} ({type(e).__name__}: {e})") from e
        return cls(path, labels)

    def __call__(self, a: str, b: str, item: Mapping[str, Any]) -> float | None:
        prompt = str(item["prompt"])
        if (prompt, a, b) in self.labels:
            return self.labels[(prompt, a, b)]
        mirror = self.labels.get((prompt, b, a))
        return None if mirror is None else 1.0 - mirror


def resolve(name: str) -> Labeller:
    """The labeller a name stands for; an unknown one is an InputError naming the choices."""
    if name.startswith("file:"):
        return FileLabels.read(name.removeprefix("file:"))
    if name in rl_rewards.BUILTIN:
        return FromReward(rl_rewards.BUILTIN[name])
    if name.startswith("reward:"):
        return FromReward(rl_rewards.resolve(name.removeprefix("reward:")))
    if ":" not in name:
        raise InputError(f"labeller {name!r}: give a checker ({sorted(rl_rewards.BUILTIN)} or 'reward:module:fn'), "
                         "'file:<labels.jsonl>' or 'module:function'")
    return rl_rewards.import_callable(name, "labeller")

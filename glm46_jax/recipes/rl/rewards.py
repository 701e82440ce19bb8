"""Verifiable rewards: callables `reward(completion: str, item: dict) -> float`, named in the config.

    rewards = Rewards.from_names(("exact_answer", "think_answer_format"), (1.0, 0.1))
    total, parts = rewards.score(completions, items)    # [n] weighted sums, {name: [n]}

`item` is the prompt's line of the prompts file (docs/rl.md#prompt-files): "answer" for `exact_answer`,
"tests" (Python asserts) for `code_tests`. A name is a built-in below or "package.module:function" for
any importable callable with the same signature.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from glm46_jax.errors import InputError
from glm46_jax.recipes.rl import sandbox

RewardFn = Callable[[str, Mapping[str, Any]], float]

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_FORMAT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
_CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)


def _number(text: str) -> Fraction | None:
    try:
        return Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        return None


def final_answer(completion: str) -> str | None:
    """The text of the last <answer>...</answer> if there is one, else the last number in the completion."""
    tagged = _ANSWER.findall(completion)
    if tagged:
        return tagged[-1].strip()
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def exact_answer(completion: str, item: Mapping[str, Any]) -> float:
    """1.0 when the final answer equals item["answer"] as a number (exact rationals: "0.5" == "1/2"), else 0.0."""
    got, want = final_answer(completion), _number(str(item["answer"]))
    return float(got is not None and want is not None and _number(got) == want)


def think_answer_format(completion: str, item: Mapping[str, Any]) -> float:
    """1.0 when the completion is exactly a <think>...</think> block then an <answer>...</answer> block."""
    del item
    return float(_FORMAT.fullmatch(completion) is not None)


def program_text(completion: str) -> str:
    """The code of the last ```python block, or the whole completion when it has none."""
    blocks = _CODE_BLOCK.findall(completion)
    return blocks[-1] if blocks else completion


def code_tests(completion: str, item: Mapping[str, Any], *, timeout_s: float = 5.0, memory_mb: int = 512) -> float:
    """1.0 when the completion's program followed by item["tests"] exits cleanly in the sandbox within its
    time and memory limits (`sandbox.run_python`), else 0.0."""
    program = program_text(completion) + "\n\n" + str(item["tests"]) + "\n"
    return float(sandbox.run_python(program, timeout_s=timeout_s, memory_mb=memory_mb).passed)


BUILTIN: dict[str, RewardFn] = {"exact_answer": exact_answer, "think_answer_format": think_answer_format,
                                "code_tests": code_tests}


# Scored from token ids by a reward model on the mesh (rl.reward_model; glm46_jax.recipes.rl.reward_model), not by
# a function of the completion's text: `Rewards.score` takes its values as `model_scores`.
MODEL_REWARD = "reward_model"


def resolve(name: str, *, code_timeout_s: float = 5.0, code_memory_mb: int = 512) -> RewardFn | None:
    """A built-in by name or "module:function" (None for MODEL_REWARD); an unknown name is an InputError naming
    the choices."""
    if name == MODEL_REWARD:
        return None
    if name == "code_tests":
        return functools.partial(code_tests, timeout_s=code_timeout_s, memory_mb=code_memory_mb)
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise InputError(f"rl.rewards: {name!r} is neither a built-in ({sorted(BUILTIN)} or {MODEL_REWARD!r}) nor "
                         "'module:function'")
    return import_callable(name, "rl.rewards")


def import_callable(name: str, where: str) -> Any:
    """The callable "package.module:function" names (a reward, a labeller); `where` names the setting in errors."""
    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise InputError(f"{where}: cannot import {name!r} ({e}); give 'package.module:function'") from e
    if not callable(fn):
        raise InputError(f"{where}: {name!r} is not callable")
    return fn


@dataclasses.dataclass(frozen=True)
class Rewards:
    names: tuple[str, ...]
    weights: tuple[float, ...]
    fns: tuple[RewardFn | None, ...]  # None: MODEL_REWARD

    @classmethod
    def from_names(cls, names: Sequence[str], weights: Sequence[float], **limits: Any) -> Rewards:
        if len(names) != len(weights) or not names:
            raise InputError(f"rl.rewards={tuple(names)} and rl.reward_weights={tuple(weights)} must be non-empty "
                             "and of the same length")
        return cls(tuple(names), tuple(float(w) for w in weights), tuple(resolve(n, **limits) for n in names))

    @property
    def uses_model(self) -> bool:
        return MODEL_REWARD in self.names

    def score(self, completions: Sequence[str], items: Sequence[Mapping[str, Any]],
              model_scores: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(weighted total [n], each reward [n] by name), float32; `model_scores` [n]: the reward model's."""
        if self.uses_model and model_scores is None:
            raise ValueError(f"{MODEL_REWARD} is among the rewards but no model scores were given")
        parts = {name: np.asarray(model_scores if fn is None else [fn(c, it) for c, it in zip(completions, items)],
                                  np.float32) for name, fn in zip(self.names, self.fns)}
        total = sum(w * parts[n] for n, w in zip(self.names, self.weights))
        return np.asarray(total, np.float32), parts

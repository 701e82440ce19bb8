"""On-policy preference pairs: samples of each prompt from the policy itself (the RL recipes' sampler,
recipes/rl/rollout.py), pairs of different completions labelled by a labeller (labellers.py); how well a reward
model's scores agree with them is recipes/preference/agreement.py (docs/preferences.md#on-policy-pairs).

    rollout = sample_groups(graphdef, params, buffers, prompt_ids, group_size=4, sampling=sampling, seed=0)
    texts = completion_texts(tok, rollout, stop_tokens)
    found = label_groups(texts, finished(rollout, stop_tokens), items, 4, resolve("exact_answer"), per_prompt=2,
                         seed=0)
    found.pairs                         # [Pair(prompt, chosen_row, rejected_row)], rows of the rollout
    pair_lines(found.pairs, texts, items)   # the `data_prep preferences` input lines

`data_prep policy-preferences` writes such pairs as a preference dataset; the RL recipes' reward-model check
(recipes/rl/check.py) labels fresh ones during training.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from glm46_jax.parallel import sharding
from glm46_jax.recipes.rl.labellers import Labeller
from glm46_jax.recipes.rl.rollout import Rollout, Sampling, sample_groups, strip_stop

class Pair(NamedTuple):
    prompt: int  # index into the prompts (items) sampled
    chosen: int  # rollout row of the better completion
    rejected: int


@dataclasses.dataclass
class Labelled:
    pairs: list[Pair]
    asked: int = 0  # pairs of different finished completions put to the labeller
    no_preference: int = 0  # of them, those it had no preference on (ties, unlabelled)
    unfinished: int = 0  # completions left out: cut at max_new_tokens (the reward model would score them unended)
    single: int = 0  # prompts whose finished completions were all the same text (no pair to ask about)


def completion_texts(tok: Tokenizer, rollout: Rollout, stop_tokens: Sequence[int]) -> list[str]:
    """Each row's completion as text, its stop token dropped (what rewards and labellers read)."""
    return [tok.decode(strip_stop(rollout.completion(i), stop_tokens), skip_special_tokens=False)
            for i in range(len(rollout.prompts))]


def finished(rollout: Rollout, stop_tokens: Sequence[int]) -> np.ndarray:
    """[rows] bool: the completion ended with a stop token (not cut at max_new_tokens)."""
    stops = set(stop_tokens)
    return np.array([n > 0 and int(rollout.tokens[i, n - 1]) in stops for i, n in enumerate(rollout.lengths)])


def label_groups(texts: Sequence[str], complete: np.ndarray, items: Sequence[Mapping[str, Any]], group_size: int,
                 labeller: Labeller, per_prompt: int, seed: int) -> Labelled:
    """Up to `per_prompt` labelled pairs per prompt from its `group_size` rows (row r is a sample of prompt
    r // group_size, `items` per prompt): pairs of different finished completions, asked in a seeded random order."""
    rng = random.Random(seed)
    out = Labelled([])
    for p, item in enumerate(items):
        rows = range(p * group_size, (p + 1) * group_size)
        out.unfinished += sum(not complete[r] for r in rows)
        distinct = sorted({texts[r]: r for r in reversed(rows) if complete[r]}.values())  # each text's first row
        candidates = list(itertools.combinations(distinct, 2))
        out.single += not candidates
        rng.shuffle(candidates)
        found = 0
        for a, b in candidates:
            if found == per_prompt:
                break
            out.asked += 1
            label = labeller(texts[a], texts[b], item)
            if label is None or label == 0.5:
                out.no_preference += 1
                continue
            out.pairs.append(Pair(p, a, b) if label > 0.5 else Pair(p, b, a))
            found += 1
    return out


def sample_pairs(graphdef: nnx.GraphDef, params: nnx.State, buffers: nnx.State, mesh: jax.sharding.Mesh,
                 tok: Tokenizer, items: Sequence[Mapping[str, Any]], prompt_ids: Sequence[Sequence[int]],
                 labeller: Labeller, *, group_size: int, per_prompt: int, sampling: Sampling, batch_prompts: int,
                 seed: int, chat: bool = True) -> tuple[list[dict[str, Any]], Labelled]:
    """`pair_lines` of `label_groups` over every prompt, sampled `batch_prompts` prompts at a time; and the counts."""
    lines, total = [], Labelled([])
    for start in range(0, len(items), batch_prompts):
        chunk = slice(start, start + batch_prompts)
        with sharding.use_mesh(mesh):
            rollout = sample_groups(graphdef, params, buffers, prompt_ids[chunk], group_size, sampling, seed + start)
        texts = completion_texts(tok, rollout, sampling.stop_tokens)
        found = label_groups(texts, finished(rollout, sampling.stop_tokens), items[chunk], group_size, labeller,
                             per_prompt, seed + start)
        lines += pair_lines(found.pairs, texts, items[chunk], chat)
        for f in ("asked", "no_preference", "unfinished", "single"):
            setattr(total, f, getattr(total, f) + getattr(found, f))
        total.pairs += [Pair(start + p.prompt, start * group_size + p.chosen, start * group_size + p.rejected)
                        for p in found.pairs]
    return lines, total


def pair_lines(pairs: Sequence[Pair], texts: Sequence[str], items: Sequence[Mapping[str, Any]],
               chat: bool = True) -> list[dict[str, Any]]:
    """The pairs as `data_prep preferences` input lines: the prompt as a user turn (thinking off, as the RL recipes
    render it) or as raw text, and the two replies."""
    lines = []
    for p in pairs:
        prompt = str(items[p.prompt]["prompt"])
        if chat:
            lines.append({"messages": [{"role": "user", "content": prompt}], "enable_thinking": False,
                          "chosen": {"role": "assistant", "content": texts[p.chosen]},
                          "rejected": {"role": "assistant", "content": texts[p.rejected]}})
        else:
            lines.append({"prompt": prompt, "chosen": texts[p.chosen], "rejected": texts[p.rejected]})
    return lines

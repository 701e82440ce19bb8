"""What every RL recipe reads before it samples: the prompts files, their tokens, the tokenizer, the stop tokens and
the rewards (docs/rl.md#prompt-files).

    fields = rl_inputs(run_cfg)        # tok, items, prompt_ids, heldout_items, heldout_ids, rewards, ...: RLRecipe's
    items = read_prompts("data/rl_addition/prompts_train.jsonl")      # [{"prompt": ..., "answer": ...}, ...]
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer

from glm46_jax.errors import InputError, json_lines
from glm46_jax.interop import chat
from glm46_jax.interop.reward import check_reward_dir
from glm46_jax.recipes.rl import environments
from glm46_jax.recipes.rl.config import RLConfig
from glm46_jax.recipes.rl.environments import Environment
from glm46_jax.recipes.rl.episodes import first_prompt
from glm46_jax.recipes.rl.reward_model import check_same_tokenizer
from glm46_jax.recipes.rl.rewards import Rewards
from glm46_jax.run_config import RunConfig
from glm46_jax.training import checkpoint


def read_prompts(path: str) -> list[dict[str, Any]]:
    """The prompts file (JSONL, docs/rl.md#prompt-files); a bad line is an InputError naming file:line."""
    if not os.path.exists(path):
        raise InputError(f"{path}: no such prompts file (set --config.rl.prompts / --config.rl.heldout; "
                         "`python -m data_prep.rl_tasks` writes the demo's)")
    items = []
    for where, item in json_lines(path, "prompts file"):
        if not isinstance(item.get("prompt"), str):
            raise InputError(f"{where}: expected an object with a string 'prompt'")
        items.append(item)
    if not items:
        raise InputError(f"{path}: no prompts")
    return items


def encode_prompts(tok: Tokenizer, items: Sequence[Mapping[str, Any]], rl: RLConfig, where: str,
                   env: Environment | None = None) -> list[list[int]]:
    """Each item's first tokens: its prompt as a user turn (rl.chat) or raw text, or an episode's opening (`env`)."""
    out = []
    for i, item in enumerate(items):
        if env is not None:
            ids = first_prompt(tok, env, item, list_tools=rl.list_tools)
        elif rl.chat:
            ids = chat.encode_prompt(tok, [{"role": "user", "content": item["prompt"]}], enable_thinking=False)
        else:
            ids = tok.encode(item["prompt"], add_special_tokens=False).ids
        if not 0 < len(ids) <= rl.max_prompt_len:
            raise InputError(f"{where}: prompt {i} is {len(ids)} tokens; rl.max_prompt_len={rl.max_prompt_len} "
                             "(raise it, or shorten the prompt)")
        out.append([int(t) for t in ids])
    return out


def tokenizer_path(cfg: RunConfig) -> str:
    """rl.tokenizer, else the tokenizer.json of checkpoint.init_from's run."""
    if cfg.rl.tokenizer:
        return cfg.rl.tokenizer
    found = checkpoint.tokenizer_path(checkpoint.latest_checkpoint(cfg.checkpoint.init_from)) \
        if cfg.checkpoint.init_from else None
    if not found:
        raise InputError("rl.tokenizer is empty and checkpoint.init_from has no tokenizer.json in its run dir; "
                         "set --config.rl.tokenizer")
    return found


def rl_inputs(cfg: RunConfig) -> dict[str, Any]:
    """The prompts, their tokens, the stop tokens and the rewards: the `base.RLRecipe` fields every RL recipe reads."""
    rl = cfg.rl
    if "reward_model" in rl.rewards + rl.heldout_rewards:  # before anything is built: a wrong path fails at once
        for path in (rl.reward_model, *rl.reward_ensemble):
            check_reward_dir(path)
            check_same_tokenizer(path, tokenizer_path(cfg))
    tok = Tokenizer.from_file(tokenizer_path(cfg))
    items, heldout = read_prompts(rl.prompts), read_prompts(rl.heldout)
    limits = dict(code_timeout_s=rl.code_timeout_s, code_memory_mb=rl.code_memory_mb)
    env = environments.resolve(rl.environment, store=rl.environment_store or None, **limits) \
        if rl.environment else None
    heldout_rewards = None
    if rl.heldout_rewards:
        heldout_rewards = Rewards.from_names(rl.heldout_rewards, (1.0,) * len(rl.heldout_rewards), **limits)
    return dict(tok=tok, items=items, prompt_ids=encode_prompts(tok, items, rl, rl.prompts, env),
                heldout_items=heldout, heldout_ids=encode_prompts(tok, heldout, rl, rl.heldout, env), environment=env,
                rewards=Rewards.from_names(rl.rewards, rl.reward_weights, **limits),
                stop_tokens=tuple(chat.stop_token_ids(tok)) if rl.chat else tuple(cfg.model.eos_token_id),
                heldout_rewards=heldout_rewards)

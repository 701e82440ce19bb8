"""Multi-turn tool-use episodes: the model writes a turn, the environment answers its tool calls, and so on until
the model answers or the episode's budget ends (docs/rl.md#agentic-rl).

    prompt = first_prompt(tok, env, item, list_tools=True)
    episodes, seconds = run_episodes(graphdef, params, buffers, env, tok, items, prompts, sampling, max_turns=4,
                                     max_len=256, seed=0)
    rows = trajectory_rows([e.trajectory for e in episodes], 256, pad_id, k)     # rollout.py

A turn is one `generate` call over every episode still running (finished ones are stood in for by a copy of a running
one, so every turn runs the same compiled prefill and decode: the context padded to `max_len - max_new_tokens`
slots). A turn the model ends with <|observation|> (GLM's end of a tool-calling turn) is parsed for tool calls; the
environment's answers, rendered as GLM's tool turn (`chat.tool_turn`, which also opens the next assistant turn),
are appended as tokens the model did not write: they carry no loss, no KL and no value target. A turn ending any
other way (<|user|>, <|endoftext|>, or its token budget) is the final answer, which the environment rewards. A
tool-calling turn that is the episode's `max_turns`-th, or whose tool turn would leave no room for another turn
within `max_len`, ends the episode unanswered: reward 0.

Each turn re-reads its whole context (no KV cache kept across turns). For routing replay a position keeps the
experts of the call that fed it first: a prompt's and a tool turn's tokens the next turn's prefill, a generated
token its own turn's decode (the next prefill computes the same tokens again, for the later turn's log-probs).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from glm46_jax.infer.generate import generate
from glm46_jax.interop import chat
from glm46_jax.recipes.rl.environments import Environment, observations, parse_tool_calls
from glm46_jax.recipes.rl.rollout import Sampling, Trajectory, strip_stop

ENDINGS = ("answer", "turns", "length")  # how an episode ended: the model answered, or a budget ran out
NO_CALL = "error: the turn ended with <|observation|> but calls no tool; call one, or answer"


@dataclasses.dataclass
class Episode:
    trajectory: Trajectory
    reward: float
    turns: int  # model turns
    tool_calls: int
    tool_errors: int  # observations that are errors (a malformed call, an unknown tool, a failing program, ...)
    observations: int  # the tool answers shown (one per call, or one error for a turn without a valid call)
    ended: str  # one of ENDINGS
    answer: str  # the final turn's text, its stop token dropped ("" when a budget ended the episode)


def first_prompt(tok: Tokenizer, env: Environment, item: Mapping[str, Any], *, list_tools: bool,
                 enable_thinking: bool = False) -> list[int]:
    """The episode's opening tokens: the environment's first turns and the assistant's turn opening. `list_tools`:
    its system turn and the tools' schemas as GLM's template lists them; else the user turn alone (a model that was
    taught the tools by fine-tuning, with shorter rows)."""
    messages, tools = env.start(item)
    if not list_tools:
        messages, tools = [m for m in messages if m["role"] != "system"], None
    return chat.encode_prompt(tok, messages, tools=tools, enable_thinking=enable_thinking).tolist()


@dataclasses.dataclass
class _Running:
    """One episode's growing record."""
    tokens: list[int]
    generated: list[bool]
    logprobs: list[float]
    routing: list[np.ndarray]  # chunks [m, l, k] of experts, for positions 0 .. fed - 1
    fed: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    observations: int = 0
    ended: str = ""
    answer: str = ""
    reward: float = 0.0

    def add(self, ids: Sequence[int], generated: bool, logprobs: Sequence[float] | None = None) -> None:
        self.tokens += [int(t) for t in ids]
        self.generated += [generated] * len(ids)
        self.logprobs += [float(x) for x in logprobs] if logprobs is not None else [0.0] * len(ids)

    def episode(self) -> Episode:
        routing = np.concatenate(self.routing) if self.routing else None
        trajectory = Trajectory(self.tokens, np.asarray(self.generated, bool), np.asarray(self.logprobs, np.float32),
                                routing)
        return Episode(trajectory, self.reward, self.turns, self.tool_calls, self.tool_errors, self.observations,
                       self.ended, self.answer)


def run_episodes(graphdef: nnx.GraphDef, params: nnx.State, buffers: nnx.State, env: Environment, tok: Tokenizer,
                 items: Sequence[Mapping[str, Any]], prompts: Sequence[Sequence[int]], sampling: Sampling, *,
                 max_turns: int, max_len: int, seed: int, enable_thinking: bool = False
                 ) -> tuple[list[Episode], float]:
    """One episode per (item, prompt) under the current mesh, and the wall time; see the module docstring.
    The Sampling's max_new_tokens is each turn's token budget; its stop tokens must hold <|observation|>."""
    observation = tok.token_to_id(chat.OBSERVATION)
    if observation not in sampling.stop_tokens:
        raise ValueError("agentic sampling needs <|observation|> among the stop tokens")
    context = max_len - sampling.max_new_tokens  # the most a turn may read: the prefill's slots
    if max(map(len, prompts)) > context:
        raise ValueError(f"a first prompt of {max(map(len, prompts))} tokens leaves no turn within {max_len} tokens")
    run = [_Running([], [], [], []) for _ in prompts]
    for r, p in zip(run, prompts):
        r.add(p, False)
    t0 = time.perf_counter()
    for turn in range(max_turns):
        active = [i for i, r in enumerate(run) if not r.ended]
        if not active:
            break
        # Finished rows are replaced by copies of a running one: one batch shape, one compiled program per turn.
        rows = [run[i].tokens for i in active] + [run[active[0]].tokens] * (len(run) - len(active))
        gen = generate(graphdef, params, buffers, rows, max_new_tokens=sampling.max_new_tokens,
                       temperature=sampling.temperature, stop_tokens=sampling.stop_tokens, seed=seed * 1009 + turn,
                       pad_id=sampling.pad_id, prompt_len=context, record_routing=sampling.record_routing)
        with jax.transfer_guard_device_to_host("allow"):
            tokens, logprobs, lengths, routing = jax.device_get((gen.tokens, gen.logprobs, gen.lengths, gen.routing))
        for j, i in enumerate(active):
            r, item, n = run[i], items[i], int(lengths[j])
            new = [int(t) for t in tokens[j, :n]]
            if routing is not None:  # slots: the context left-padded to `context`, then new tokens 0 .. n-2
                start = context - len(r.tokens)
                r.routing += [routing[j, start + r.fed:context], routing[j, context:context + n - 1]]
                r.fed = len(r.tokens) + n - 1
            r.add(new, True, logprobs[j, :n])
            r.turns += 1
            if not new or new[-1] != observation:  # the final answer
                r.answer = tok.decode(strip_stop(new, sampling.stop_tokens), skip_special_tokens=False)
                r.ended, r.reward = "answer", float(env.reward(r.answer, item))
                continue
            calls, error = parse_tool_calls(tok.decode(new[:-1], skip_special_tokens=False))
            results = observations(env, calls, NO_CALL if not calls and error is None else error, item)
            r.tool_calls += len(calls)
            r.tool_errors += sum(x.startswith("error:") for x in results)
            r.observations += len(results)
            ids = chat.encode_tool_turn(tok, results, enable_thinking=enable_thinking).tolist()
            if turn + 1 == max_turns:
                r.ended = "turns"
            elif len(r.tokens) + len(ids) > context:
                r.ended = "length"
            else:
                r.add(ids, False)
    for r in run:
        r.ended = r.ended or "turns"
    return [r.episode() for r in run], time.perf_counter() - t0


def episode_stats(episodes: Sequence[Episode]) -> dict[str, float]:
    """Means over episodes: model turns, tool calls, the share of tool answers that were errors, and how the
    episodes ended."""
    calls = sum(e.tool_calls for e in episodes)
    stats = {"turns": float(np.mean([e.turns for e in episodes])),
             "tool_calls": calls / len(episodes),
             "tool_error_frac": sum(e.tool_errors for e in episodes) / max(sum(e.observations for e in episodes), 1)}
    stats.update({f"ended_{how}": float(np.mean([e.ended == how for e in episodes])) for how in ENDINGS})
    return stats

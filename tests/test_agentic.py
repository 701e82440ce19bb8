"""Agentic RL (recipes/rl/episodes.py, ahead.py, objective.truncated_importance): multi-turn episodes against a
scripted sampler, checked against the whole conversation as GLM's chat format renders it; budgets; tool failures as
observations; the truncated importance weights by hand; a run sampling one rollout ahead killed -9 mid-episode and
resumed (docs/rl.md#agentic-rl)."""

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import assert_heldout_gain, subprocess_env
from optimized_code import optimized

from glm46_jax.infer.sampling import Generation
from glm46_jax.interop import chat
from glm46_jax.recipes.rl import environments as envs
from glm46_jax.recipes.rl import heldout
from glm46_jax.recipes.rl import episodes as ep
from glm46_jax.recipes.rl import objective
from glm46_jax.recipes.rl.rollout import Sampling, trajectory_rows

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
K = 2  # experts per token in the scripted routing


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tokenizers import Tokenizer

    from data_prep import agent_tasks
    out = str(tmp_path_factory.mktemp("agent_data"))
    agent_tasks.write(out, seed=0, heldout=4, sft=4, train=8)
    return Tokenizer.from_file(os.path.join(out, "tokenizer.json"))


def call_turn(expression: str, tool: str = "calculate", key: str = "expression") -> str:
    return f"\n<tool_call>{tool}\n<arg_key>{key}</arg_key>\n<arg_value>{expression}</arg_value>\n</tool_call>"


class Scripted:
    """Stands in for `generate`: each episode (told apart by its prompt) writes its scripted turns in order, the
    turn chosen by how many assistant turns its context holds. Log-probs count down per token; the routing at a
    prompt slot is 1000 x call + the position it feeds, at a decode slot 1000 x call + 500 + the new token's index,
    so the test can tell which call fed each position."""

    def __init__(self, tok, scripts: dict[str, list[tuple[str, str]]]):
        self.tok, self.calls = tok, 0
        self.scripts = {tuple(self.prompt(tok, p)): turns for p, turns in scripts.items()}
        self.assistant = tok.token_to_id(chat.ASSISTANT)
        self.logprob = -0.001

    @staticmethod
    def prompt(tok, text):
        return chat.encode_prompt(tok, [{"role": "user", "content": text}], enable_thinking=False).tolist()

    def __call__(self, graphdef, params, buffers, rows, *, max_new_tokens, prompt_len, record_routing, **_):
        call, self.calls = self.calls, self.calls + 1
        b, p = len(rows), max(prompt_len, max(map(len, rows)))
        tokens = np.zeros((b, max_new_tokens), np.int32)
        logprobs = np.zeros((b, max_new_tokens), np.float32)
        lengths = np.zeros(b, np.int32)
        routing = np.zeros((b, p + max_new_tokens - 1, 1, K), np.int32)
        for j, row in enumerate(rows):
            script = next(v for prompt, v in self.scripts.items() if tuple(row[:len(prompt)]) == prompt)
            text, stop = script[row.count(self.assistant) - 1]
            ids = self.tok.encode(text, add_special_tokens=False).ids + ([self.tok.token_to_id(stop)] if stop else [])
            ids = ids[:max_new_tokens]
            tokens[j, :len(ids)], lengths[j] = ids, len(ids)
            for i in range(len(ids)):
                logprobs[j, i], self.logprob = self.logprob, self.logprob - 0.001
            start = p - len(row)
            routing[j, start:p] = 1000 * call + np.arange(len(row))[:, None, None]
            routing[j, p:] = 1000 * call + 500 + np.arange(max_new_tokens - 1)[:, None, None]
        return Generation(tokens, logprobs, lengths, routing if record_routing else None)


def run(tok, monkeypatch, scripts, env=None, max_turns=4, max_len=120, turn_tokens=40, items=None):
    fake = Scripted(tok, scripts)
    monkeypatch.setattr(ep, "generate", fake)
    prompts = [Scripted.prompt(tok, p) for p in scripts]
    items = items or [{"prompt": p, "answer": str(eval(p))} for p in scripts]  # the scripts' prompts: products
    sampling = Sampling(max_new_tokens=turn_tokens, temperature=1.0, stop_tokens=tuple(chat.stop_token_ids(tok)),
                        record_routing=True)
    episodes, _ = ep.run_episodes(None, None, None, env or envs.resolve("calculator"), tok, items, prompts, sampling,
                                  max_turns=max_turns, max_len=max_len, seed=0)
    return episodes, fake


def test_tool_turns_carry_no_loss_against_the_rendered_conversation(tok, monkeypatch):
    """A scripted episode (call the calculator, then answer from its reply) is token for token the whole
    conversation as the chat format renders it; the loss mask covers exactly the model's two turns (decoded
    labels), not the prompt or the tool turn; the old log-probs are the sampler's in order; each position replays
    the experts of the call that fed it first."""
    episodes, fake = run(tok, monkeypatch, {"4821*73": [(call_turn("4821*73"), chat.OBSERVATION),
                                                        ("\n351933", chat.USER)]})
    (e,) = episodes
    assert (e.reward, e.turns, e.tool_calls, e.tool_errors, e.observations, e.ended, e.answer) == (
        1.0, 2, 1, 0, 1, "answer", "\n351933")
    conversation = [{"role": "user", "content": "4821*73"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"function": {"name": "calculate", "arguments": {"expression": "4821*73"}}}]},
                    {"role": "tool", "content": "351933"}, {"role": "assistant", "content": "351933"}]
    whole = chat.encode(tok, conversation, enable_thinking=False, close_final_turn=True).ids.tolist()
    assert e.trajectory.tokens == whole
    n = len(whole)
    rows = trajectory_rows([e.trajectory], n + 3, 0, K)
    labels, mask = rows["inputs"][0, 1:], rows["completion_mask"][0]
    decode = lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=False)
    first = whole.index(tok.token_to_id(chat.OBSERVATION))
    turn1 = decode(labels[:first][mask[:first] == 1])
    turn2 = decode(labels[first:][mask[first:] == 1])
    assert turn1 == call_turn("4821*73") + chat.OBSERVATION and turn2 == "\n351933" + chat.USER
    prompt = Scripted.prompt(tok, "4821*73")
    tool_turn = decode(labels[first:][(mask[first:] == 0) & (np.arange(first, n + 2) < n - 1)])
    assert tool_turn == "\n<tool_response>\n351933\n</tool_response><|assistant|>\n<think></think>"
    assert mask[:len(prompt) - 1].sum() == 0 and mask[n - 1:].sum() == 0  # the prompt and the padding
    generated = int(mask.sum())
    np.testing.assert_allclose(rows["old_logprobs"][0][mask == 1], -0.001 * np.arange(1, generated + 1), rtol=1e-6)
    # Routing: the prompt from call 0's prefill, turn 1 from call 0's decode (its last token, <|observation|>, was
    # never fed back), then call 1's prefill from that token through the tool turn, then call 1's decode.
    t1 = len(tok.encode(call_turn("4821*73"), add_special_tokens=False).ids) + 1
    obs_end = len(prompt) + t1 + len(chat.encode_tool_turn(tok, ["351933"], enable_thinking=False))
    want = np.concatenate([np.arange(len(prompt)), 500 + np.arange(t1 - 1),
                           1000 + np.arange(len(prompt) + t1 - 1, obs_end), 1500 + np.arange(n - 1 - obs_end)])
    np.testing.assert_array_equal(rows["expert_ids"][0, :n - 1, 0, 0], want)
    np.testing.assert_array_equal(rows["replay_mask"][0, :n], e.trajectory.generated & (np.arange(n) < n - 1))
    assert fake.calls == 2


def test_budgets_end_an_episode_unanswered(tok, monkeypatch):
    """A model that keeps calling tools: at max_turns the episode ends ("turns", reward 0); a tool turn that would
    leave no room for another turn within max_len ends it too ("length"). Every turn's context fits the prefill."""
    again = (call_turn("1*2"), chat.OBSERVATION)
    episodes, _ = run(tok, monkeypatch, {"12*3": [again] * 5}, max_turns=3, max_len=160)
    (e,) = episodes
    assert (e.turns, e.tool_calls, e.ended, e.reward) == (3, 3, "turns", 0.0)
    assert len(e.trajectory.tokens) <= 160
    episodes, _ = run(tok, monkeypatch, {"12*3": [again] * 5}, max_turns=8, max_len=120)
    (e,) = episodes
    assert (e.turns, e.ended, e.reward) == (2, "length", 0.0) and len(e.trajectory.tokens) <= 120


def test_tool_failures_are_observations(tok, monkeypatch):
    """Malformed markup, a turn ending in <|observation|> without a call, an unknown tool, a program that times out
    and one that exceeds its memory: each is an "error:" tool turn the episode goes on from; the model's answer
    after it is still rewarded."""
    env = envs.resolve("python", code_timeout_s=1.0, code_memory_mb=64)
    answer = ("\n6", chat.USER)
    scripts = {
        "1*6": [("\n<tool_call>python\n<arg_key>code</arg_key>\n<arg_value>print(1)</arg_value>", chat.OBSERVATION),
                answer],
        "2*3": [("\nLet me think.", chat.OBSERVATION), answer],
        "3*2": [(call_turn("3*2", tool="calculate"), chat.OBSERVATION), answer],
        "6*1": [(call_turn("while True: pass", tool="python", key="code"), chat.OBSERVATION), answer],
        "2*3*1": [(call_turn("x = bytearray(2**29)", tool="python", key="code"), chat.OBSERVATION), answer],
    }
    episodes, _ = run(tok, monkeypatch, scripts, env=env, max_len=240, turn_tokens=64)
    says = ["not closed", "calls no tool", "no tool 'calculate'", "did not finish", "MemoryError"]
    for e, words in zip(episodes, says, strict=True):
        text = tok.decode(e.trajectory.tokens, skip_special_tokens=False)
        response = text.split("<tool_response>\n")[1].split("\n</tool_response>")[0]
        assert response.startswith("error:") and words in response, (words, response)
        assert (e.ended, e.reward, e.tool_errors, e.observations) == ("answer", 1.0, 1, 1)


def test_truncated_importance_by_hand():
    """The weights min(pi / pi_behaviour, cap) and the clipped share, against float64 NumPy on a recorded batch; the
    weighted clipped loss against the hand formula."""
    rng = np.random.default_rng(0)
    behaviour = rng.normal(-1.0, 0.3, (4, 6)).astype(np.float32)
    logp = (behaviour + rng.normal(0.0, 0.6, (4, 6))).astype(np.float32)
    mask = (rng.random((4, 6)) < 0.7).astype(np.float32)
    weights, stats = objective.truncated_importance(logp, behaviour, mask, cap=1.5)
    ratio = np.exp(logp.astype(np.float64) - behaviour)
    want = np.minimum(ratio, 1.5) * mask
    np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-6)
    assert stats["is_clipped_frac"] == pytest.approx(((ratio > 1.5) * mask).sum() / mask.sum(), rel=1e-6)
    assert 0 < stats["is_clipped_frac"] < 1  # the batch exercises both sides of the cap
    assert stats["is_weight_mean"] == pytest.approx(want.sum() / mask.sum(), rel=1e-6)
    new = (logp + rng.normal(0.0, 0.2, logp.shape)).astype(np.float32)
    adv = rng.normal(size=4).astype(np.float32)
    loss, _ = objective.policy_loss(new, logp, adv, mask, clip_low=0.2, clip_high=0.28, weights=weights)
    r = np.exp(new.astype(np.float64) - logp)
    per = -np.minimum(r * adv[:, None], np.clip(r, 0.8, 1.28) * adv[:, None]) * want
    assert float(loss) == pytest.approx((per * mask).sum() / mask.sum(), rel=1e-5)


def kill_at_reward(completion, item):
    """An environment's reward that SIGKILLs its process at the Nth call (AGENT_KILL_AT), counting in a file."""
    path = os.environ.get("AGENT_KILL_COUNT")
    if path:
        n = 1
        if os.path.exists(path):
            with open(path) as f:
                n += int(f.read())
        with open(path, "w") as f:
            f.write(str(n))
        if n == int(os.environ["AGENT_KILL_AT"]):
            os.kill(os.getpid(), signal.SIGKILL)
    return envs.rewards.exact_answer(completion, item)


def killable():
    """The calculator environment, rewarded by `kill_at_reward`."""
    base = envs.resolve("calculator")
    return envs.ToolEnvironment("killable", base.tools, reward_fn=kill_at_reward)


@pytest.mark.slow
def test_kill_9_mid_episode_then_resume_loses_no_step(tmp_path):
    """A run sampling one rollout ahead (rl.rollouts_ahead=1) killed -9 inside an episode (scoring rollout 3 in the
    rollout worker, while the trainer trains on rollout 2; the 4 held-out episodes at the start and 4 per rollout
    come first) and resumed: it restarts from its last checkpoint and trains every later step once, to the planned
    step 8."""
    from data_prep import agent_tasks
    data = str(tmp_path / "data")
    agent_tasks.write(data, seed=0, heldout=8, sft=4, train=64)
    run_dir = str(tmp_path / "run")
    args = [sys.executable, "-m", "glm46_jax.train", "--config=configs/grpo.py:agent", f"--config.run_dir={run_dir}",
            "--config.checkpoint.init_from=", "--config.checkpoint.every=2", "--config.checkpoint.async_save=False",
            "--config.train.steps=8", "--config.train.log_every=1", "--config.monitor.sinks=jsonl",
            f"--config.rl.prompts={data}/prompts_train.jsonl", f"--config.rl.heldout={data}/prompts_heldout.jsonl",
            f"--config.rl.tokenizer={data}/tokenizer.json", f"--config.rl.environment={__name__}:killable",
            "--config.rl.group_size=2", "--config.rl.prompts_per_step=2", "--config.rl.max_new_tokens=8",
            "--config.rl.max_prompt_len=32", "--config.rl.rollouts_ahead=1", "--config.rl.eval_batch=4",
            "--config.rl.dynamic_sampling=False"]
    env = subprocess_env(PYTHONPATH=os.path.dirname(__file__) + os.pathsep + ROOT,
                         AGENT_KILL_COUNT=str(tmp_path / "count"), AGENT_KILL_AT=str(4 + 3 * 4 + 2))
    first = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    saved = sorted(int(d) for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.isdigit())
    assert saved and saved[-1] < 8
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        before = [r["step"] for r in map(json.loads, f) if "train/loss" in r]
    assert before[:saved[-1]] == list(range(1, saved[-1] + 1))
    env.pop("AGENT_KILL_COUNT")
    second = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert second.returncode == 0, second.stderr[-2000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [r["step"] for r in map(json.loads, f) if "train/loss" in r]
    assert steps[len(before):] == list(range(saved[-1] + 1, 9))
    with open(os.path.join(run_dir, "status.json")) as f:
        status = json.load(f)
    assert status["step"] == 8, status


@pytest.mark.slow
def test_agentic_grpo_raises_heldout_success_across_seeds(tmp_path_factory):
    """make agent's stages: the tool-only task, SFT on its 400 traces (configs/sft.py:agent_calc, here from random
    weights for 200 steps: make agent fine-tunes make train's model, a pretraining CI has no time for), then agentic
    GRPO with the calculator (configs/grpo.py:agent), 3 RL seeds: greedy held-out success on all 500 held-out problems
    rises by more than 2 paired standard errors of the gain on average, and no seed loses more than one of its own
    (`conftest.assert_heldout_gain`; docs/rl.md#measuring-a-gain). Without tools the same SFT model solves none (rl.environment=none; measured, not run
    here)."""
    from data_prep import agent_tasks
    from data_prep import cli as data_cli
    from glm46_jax import run_config, train
    from glm46_jax.run_config import config_file

    root = tmp_path_factory.mktemp("agent_demo")
    data = str(root / "data")
    agent_tasks.write(data)
    assert data_cli.main(["sft", "--input", os.path.join(data, "sft_chats.jsonl"), "--tokenizer",
                          os.path.join(data, "tokenizer.json"), "--out", os.path.join(data, "sft"),
                          "--heldout-fraction", "0.05", "--max-len", "96"]) == 0

    def config(name, preset, **fields):
        c = config_file(os.path.join(ROOT, "configs", name), preset)
        with c.unlocked():
            c.monitor.sinks = "jsonl"
            c.checkpoint.async_save = False
            for k, v in fields.items():
                if isinstance(v, dict):
                    c[k].update(v)
                else:
                    c[k] = v
        return c

    runs = []
    with optimized():  # the RL runs execute their programs far more than they compile them
        sft = config("sft.py", "agent_calc", run_dir=str(root / "sft"), sft={"root": os.path.join(data, "sft")},
                     checkpoint={"init_from": ""}, train={"steps": 200})
        train.train(run_config.from_config_dict(sft), jax.devices()[:1])
        for seed in range(3):
            c = config("grpo.py", "agent", run_dir=str(root / f"grpo_{seed}"), train={"seed": seed, "eval_batches": 2},
                       checkpoint={"init_from": str(root / "sft")},
                       rl={"prompts": os.path.join(data, "prompts_train.jsonl"),
                           "heldout": os.path.join(data, "prompts_heldout.jsonl"), "eval_batch": 250})
            train.train(run_config.from_config_dict(c), jax.devices()[:1])
            r = heldout.read(c.run_dir)
            assert r["problems"] == 500 and r["rollouts"] == 30
            runs.append(r)
    assert_heldout_gain(runs)


@pytest.mark.parametrize("fields, says", [
    ({"chat": False}, "rl.environment='calculator': runs episodes in the chat format"),
    ({"rewards": ("think_answer_format",)}, "the environment rewards each episode"),
    ({"environment_store": "docs.jsonl"}, "is the lookup environment's document store"),
    ({"importance_cap": 0.5}, "rl.importance_cap=0.5"),
    ({"rollouts_ahead": -1}, "rl.rollouts_ahead=-1"),
])
def test_agentic_settings_that_cannot_run_are_one_line(fields, says):
    from glm46_jax.errors import InputError
    from glm46_jax.recipes.rl.config import RLConfig

    with pytest.raises(InputError) as e:
        RLConfig(environment="calculator", **fields)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def length_reward(completion, item):
    """A reward a random policy's samples differ in."""
    del item
    return float(len(completion))


def test_synchronous_rollouts_are_grpo_as_it_was(tmp_path, mesh1):
    """rl.rollouts_ahead=0 on single-turn data feeds the step exactly GRPO's batches as they were built before
    episodes and the rollout worker existed: the pool's draw, the sampler's rows, a prompt + completion row laid out
    by hand (the completion mask, the sampler's log-probs, the replayed experts), all-agreeing groups last, group
    advantages by NumPy and the seeded minibatch order: every array of both minibatches equal bit for bit (the
    advantages to float32 rounding)."""
    from data_prep import rl_tasks
    from glm46_jax import run_config
    from glm46_jax.parallel import sharding
    from glm46_jax.recipes.rl.curriculum import CurriculumConfig, PromptPool
    from glm46_jax.recipes.rl.grpo.recipe import GRPO
    from glm46_jax.recipes.rl.rollout import sample_groups
    from glm46_jax.run_config import config_file

    data = str(tmp_path / "data")
    rl_tasks.write(data, seed=0, heldout=8, sft=0)
    c = config_file(os.path.join(ROOT, "configs", "grpo.py"), "tiny")
    with c.unlocked():
        c.run_dir = str(tmp_path / "run")
        c.checkpoint.update(init_from="", every=2)
        c.train.update(steps=2, eval_batches=1)
        c.rl.update(prompts=os.path.join(data, "prompts_train.jsonl"), heldout=os.path.join(data, "prompts_heldout.jsonl"),
                    tokenizer=os.path.join(data, "tokenizer.json"), group_size=4, prompts_per_step=4, minibatches=2,
                    max_new_tokens=4, eval_batch=8, dynamic_sampling=False, rewards=[f"{__name__}:length_reward"],
                    reward_weights=[1.0])
    cfg = run_config.from_config_dict(c)
    recipe, state = GRPO.build(cfg, jax.devices()[:1])
    recipe.start(state)
    got = [jax.device_get(recipe.next_input(state, np.inf).batch) for _ in range(2)]

    rl, g = cfg.rl, cfg.rl.group_size
    difficulty = [int(it["difficulty"]) for it in recipe.items]
    pool = PromptPool(len(difficulty), difficulty, CurriculumConfig(1, rl.curriculum_advance_at, rl.curriculum_ema),
                      seed=0)
    ids = pool.draw(rl.prompts_per_step)
    sampling = Sampling(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature,
                        stop_tokens=tuple(chat.stop_token_ids(recipe.tok)), prompt_len=rl.max_prompt_len,
                        record_routing=True)
    with sharding.use_mesh(recipe.mesh):
        rollout = sample_groups(recipe.main.graphdef, state.params, state.buffers, [recipe.prompt_ids[i] for i in ids],
                                g, sampling, seed=0)
    n, s, k = len(ids) * g, rl.max_prompt_len + rl.max_new_tokens, cfg.model.num_experts_per_tok
    want = {"inputs": np.zeros((n, s), np.int32), "completion_mask": np.zeros((n, s - 1), np.float32),
            "old_logprobs": np.zeros((n, s - 1), np.float32), "replay_mask": np.zeros((n, s), np.float32),
            "expert_ids": np.broadcast_to(np.arange(k, dtype=np.int32), (n, s, rollout.routing.shape[2], k)).copy()}
    reward = np.zeros(n)
    for row in range(n):
        prompt, length = rollout.prompts[row], int(rollout.lengths[row])
        p = len(prompt)
        completion = rollout.tokens[row, :length]
        want["inputs"][row, :p + length] = prompt + completion.tolist()
        want["completion_mask"][row, p - 1:p + length - 1] = 1
        want["old_logprobs"][row, p - 1:p + length - 1] = rollout.logprobs[row, :length]
        want["replay_mask"][row, p:p + length - 1] = 1
        want["expert_ids"][row, :p + length - 1] = rollout.routing[row, rl.max_prompt_len - p:][:p + length - 1]
        stop = length and completion[-1] in sampling.stop_tokens
        reward[row] = len(recipe.tok.decode(completion[:length - 1] if stop else completion, skip_special_tokens=False))
    groups = reward.reshape(-1, g)
    want["advantages"] = ((groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + rl.adv_eps)
                          ).reshape(-1).astype(np.float32)
    # Groups whose rewards all agree go last (in sampling order), as GRPO has always laid out a rollout.
    informative = np.ptp(groups, axis=1) > 0
    kept = np.concatenate([np.arange(j * g, (j + 1) * g)
                           for j in sorted(range(len(ids)), key=lambda j: not informative[j])])
    want = {key: value[kept] for key, value in want.items()}
    order = np.array_split(np.random.default_rng([cfg.train.seed, 0]).permutation(n), rl.minibatches)
    for batch, rows in zip(got, order, strict=True):
        assert set(batch) == set(want)
        for key, value in want.items():
            if key == "advantages":  # float64 NumPy here, float32 in the recipe: to rounding
                np.testing.assert_allclose(np.asarray(batch[key]), value[rows], rtol=1e-6, err_msg=key)
            else:
                np.testing.assert_array_equal(np.asarray(batch[key]), value[rows], err_msg=key)
    assert np.ptp(reward) > 0  # the advantages are not all zero


def test_the_first_prompt_lists_the_tools_or_leaves_them_to_fine_tuning(tok):
    """rl.list_tools: the environment's system turn and its tools' schemas as GLM's template lists them (the same
    text chat.render writes for those messages and tools); off: the user turn alone."""
    env = envs.resolve("calculator")
    item = {"prompt": "12*34", "answer": "408"}
    listed = ep.first_prompt(tok, env, item, list_tools=True)
    messages, tools = env.start(item)
    text = tok.decode(listed, skip_special_tokens=False)
    assert text == chat.render(messages, tools=tools, add_generation_prompt=True, enable_thinking=False)
    assert '"name": "calculate"' in text and env.system in text
    bare = tok.decode(ep.first_prompt(tok, env, item, list_tools=False), skip_special_tokens=False)
    assert bare == "[gMASK]<sop><|user|>\n12*34/nothink<|assistant|>\n<think></think>"

"""A reward model (our GLM with a score head) against torch: the HF export layout of glm46_jax/interop/reward.py loads
and gives transformers' rewards (tests/fixtures/hf_reward, make_reward_fixtures.py), wherever a row sits in a batch;
the preference step reads the packed batch's hand-computed end positions and sums hand-built reply masks; a reward
checkpoint round-trips through ckpt-to-hf; bad directories are one-line InputErrors naming the path."""

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, ROOT, subprocess_env
from flax import nnx
from safetensors.numpy import load_file, save_file

from glm46_jax.errors import InputError
from glm46_jax.interop import convert
from glm46_jax.interop.hf import load_hf
from glm46_jax.interop.reward import load_reward_model
from glm46_jax.model import abstract_model, apply
from glm46_jax.parallel import sharding
from glm46_jax.recipes.rl.reward_model import ModelScorer
from glm46_jax.recipes.models import with_score_head
from glm46_jax.recipes.preference.step import at_positions, pair_count, reply_logps, reward_loss, token_logps
from glm46_jax.training import checkpoint

FIX = os.path.join(FIXTURES, "hf_reward")
GOLD = dict(np.load(os.path.join(FIX, "golden.npz")))
ROWS = [ids[:n].tolist() for ids, n in zip(GOLD["input_ids"], GOLD["lengths"])]  # lengths 9, 5, 1, 12, 3
TOL = {"rtol": 1e-5, "atol": 1e-5}
B, W = 5, 20  # every forward in this file is [B, W]: one compiled program


def _assert_one_line(err: pytest.ExceptionInfo, *needles: str) -> None:
    message = str(err.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, buffers, tokens, positions, segment_ids):
    """(logits, scores [b, s]) of a training-style forward (explicit positions and segment ids)."""
    out = apply(graphdef, params, buffers, tokens, positions, segment_ids, with_mtp=False)
    return out.logits, out.scores[..., 0]


def _run(mesh, fn, *args):
    with sharding.use_mesh(mesh):
        return jax.tree.map(np.asarray, fn(*args))


def _right_padded(pad=0):
    """The golden rows right-padded to [B, W]; positions 0..W-1, one segment (a plain forward)."""
    tokens = np.full((B, W), pad, np.int32)
    for i, row in enumerate(ROWS):
        tokens[i, :len(row)] = row
    return tokens, np.broadcast_to(np.arange(W, dtype=np.int32), (B, W)), np.ones((B, W), np.int32)


def _golden_scores(mesh, graphdef, params, buffers):
    _, scores = _run(mesh, _forward, graphdef, params, buffers, *_right_padded())
    return scores[np.arange(B), GOLD["lengths"] - 1]


@pytest.fixture(scope="module")
def reward1(mesh1):
    return load_reward_model(FIX, mesh1)


# --- (a) the HF export against torch's documented snippet ------------------------------------------------------------

def test_hf_export_scores_equal_torch(reward1, mesh1):
    """Each row's score at its last token is torch's `model.model(ids).last_hidden_state[:, -1] @ w.T` (the rows
    right-padded into one batch; no padding in torch) and the float64 NumPy reference's."""
    cfg, graphdef, params, buffers = reward1
    assert cfg.score_head == 1
    w = load_file(os.path.join(FIX, "score.safetensors"))["score.weight"]
    np.testing.assert_array_equal(np.asarray(params["score"].get_value()), w.T)  # [hidden, 1], as the file holds
    got = _golden_scores(mesh1, graphdef, params, buffers)
    np.testing.assert_allclose(got, GOLD["rewards"], **TOL)
    np.testing.assert_allclose(got, GOLD["rewards_f64"], **TOL)
    assert np.ptp(GOLD["rewards"]) > 1  # rewards of order 1 that differ: a wrong row or position shows


# --- (b) ModelScorer: right padding in a batch the mesh splits -------------------------------------------------------

def test_scorer_batches_equal_torch():
    """ModelScorer on a mesh of 2 batch shards: 4 rows (the shards divide them), then the fifth row with two of the
    first four, reordered, with another pad id (3 rows: padded to 4); row_len 16 > the longest row. Each row's reward
    is its own torch golden: neither its neighbours nor the padding change it."""
    mesh = sharding.make_mesh({"data": 2}, jax.devices()[:2])
    _, graphdef, params, buffers = load_reward_model(FIX, mesh)
    got = ModelScorer(graphdef, params, buffers, mesh, pad_id=0, row_len=16).score_rows(ROWS[:4])
    np.testing.assert_allclose(got, GOLD["rewards"][:4], **TOL)
    got = ModelScorer(graphdef, params, buffers, mesh, pad_id=7, row_len=16).score_rows([ROWS[4], ROWS[2], ROWS[0]])
    assert got.shape == (3,) and got.dtype == np.float32
    np.testing.assert_allclose(got, GOLD["rewards"][[4, 2, 0]], **TOL)


# --- (c) left padding and at_positions -------------------------------------------------------------------------------

def test_left_padding_needs_positions_and_segments(reward1, mesh1):
    """ModelScorer right-pads: under causal attention (and dropless MoE routing) a token never sees the padding after
    it, so a row's last real token is exact with the default positions 0..s-1. A left-padded row is exact only with
    positions restarting at its first real token and segment ids that keep it from attending to the padding; with
    the defaults its reward moves."""
    _, graphdef, params, buffers = reward1
    pad = W - GOLD["lengths"]
    real = np.arange(W)[None] >= pad[:, None]
    tokens = np.full((B, W), 7, np.int32)
    for i, row in enumerate(ROWS):
        tokens[i, pad[i]:] = row
    positions = np.where(real, np.arange(W)[None] - pad[:, None], 0).astype(np.int32)
    _, scores = _run(mesh1, _forward, graphdef, params, buffers, tokens, positions, real.astype(np.int32))
    np.testing.assert_allclose(scores[:, -1], GOLD["rewards"], **TOL)
    _, plain = _run(mesh1, _forward, graphdef, params, buffers, tokens, *_right_padded()[1:])
    assert np.all(np.abs(plain[:, -1] - GOLD["rewards"]) > 1e-3)


def test_at_positions_reads_the_given_tokens(mesh1):
    """Hand-built rows: a left-padded one (pads 0, reply 5 6 7), a right-padded one (5 6 7, pads) and a packed one."""
    values = np.array([[0, 0, 0, 5, 6, 7],
                       [5, 6, 7, 0, 0, 0],
                       [1, 2, 3, 4, 5, 6]], np.float32)
    positions = np.array([[5, 3], [2, 0], [2, 5]], np.int32)  # last and first reply token; two ends of a packed row
    with sharding.use_mesh(mesh1):
        got = np.asarray(jax.jit(at_positions)(jnp.asarray(values), jnp.asarray(positions)))
    np.testing.assert_array_equal(got, [[7, 5], [7, 5], [3, 6]])


# --- (d) the preference step on a hand-built packed batch ------------------------------------------------------------

# B rows of W tokens, K = 2 pair slots a row (docs/preferences.md#the-batch), made of the golden rows g0..g4:
#   row 0: pair 0 = (g0 [0, 9), g1 [9, 14)), pair 1 = (g2 [14, 15), g4 [15, 18)), padding [18, 20)
#   row 1: pair 0 = (g3 [0, 12), g4 [12, 15)), padding [15, 20), slot 1 empty
#   rows 2-4: padding only
# A sequence: (row, slot, side 0 chosen / 1 rejected, golden row, start, prompt tokens); its reply is the rest (g2
# has none, an empty reply). Its segment is 2 slot + side + 1.
SEQS = [(0, 0, 0, 0, 0, 4), (0, 0, 1, 1, 9, 2), (0, 1, 0, 2, 14, 1), (0, 1, 1, 4, 15, 1),
        (1, 0, 0, 3, 0, 5), (1, 0, 1, 4, 12, 2)]
CHOSEN_END = [[8, 14], [11, 0], [0, 0], [0, 0], [0, 0]]
REJECTED_END = [[13, 17], [14, 0], [0, 0], [0, 0], [0, 0]]
PAIR_MASK = [[1, 1], [1, 0], [0, 0], [0, 0], [0, 0]]
MARGIN = [[0.5, 1.0], [0.25, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
PAIRS = [(0, 1), (2, 4), (3, 4)]  # (chosen, rejected) golden rows, in the order the mask lists the pairs


def _packed_batch(pad=0):
    b = {k: np.zeros((B, W), np.int32) for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}
    b["inputs"][:] = b["targets"][:] = pad
    for row, slot, side, g, start, prompt in SEQS:
        n = len(ROWS[g])
        span = slice(start, start + n)
        b["inputs"][row, span] = ROWS[g]
        b["targets"][row, start:start + n - 1] = ROWS[g][1:]
        b["positions"][row, span] = np.arange(n)
        b["segment_ids"][row, span] = 2 * slot + side + 1
        b["loss_mask"][row, start + prompt - 1:start + n - 1] = 1  # targets that are reply tokens
    b.update(chosen_end=np.array(CHOSEN_END, np.int32), rejected_end=np.array(REJECTED_END, np.int32),
             pair_mask=np.array(PAIR_MASK, np.int32), margin=np.array(MARGIN, np.float32))
    return b


@pytest.fixture(scope="module")
def packed(reward1, mesh1):
    """The packed batch, the plain forward's (logits, scores) on it, and the preference step's reward_loss metrics and
    reply_logps (one compiled program)."""
    _, graphdef, params, buffers = reward1
    batch = _packed_batch()
    logits, scores = _run(mesh1, _forward, graphdef, params, buffers, batch["inputs"], batch["positions"],
                          batch["segment_ids"])

    @jax.jit
    def step(params, buffers, batch):
        _, metrics = reward_loss(params, buffers, batch, pair_count(batch)["pairs"], graphdef, True)
        return metrics, reply_logps(token_logps(params, buffers, graphdef, batch), batch)
    metrics, logps = _run(mesh1, step, params, buffers, {k: jnp.asarray(v) for k, v in batch.items()})
    return {"batch": batch, "logits": logits, "scores": scores, "metrics": metrics, "logps": logps}


def test_reward_loss_reads_the_end_positions(packed):
    """The packed rows' scores at the hand-computed ends are the golden (unpacked, torch) rewards; reward_loss's
    chosen / rejected / loss / accuracy are their means over the 3 pairs (loss in float64 from the goldens)."""
    segments = packed["batch"]["segment_ids"]
    assert segments[0].tolist() == [1] * 9 + [2] * 5 + [3] + [4] * 3 + [0] * 2
    assert segments[1].tolist() == [1] * 12 + [2] * 3 + [0] * 5 and not segments[2:].any()
    ends = {"chosen": [(0, 8), (0, 14), (1, 11)], "rejected": [(0, 13), (0, 17), (1, 14)]}
    for side, col in (("chosen", 0), ("rejected", 1)):
        got = [packed["scores"][r, t] for r, t in ends[side]]
        np.testing.assert_allclose(got, GOLD["rewards"][[p[col] for p in PAIRS]], **TOL)
    metrics = packed["metrics"]
    c, r = (GOLD["rewards_f64"][[p[i] for p in PAIRS]] for i in (0, 1))
    m = np.array([0.5, 1.0, 0.25])
    assert metrics["pairs"] == 3
    np.testing.assert_allclose(metrics["chosen"], c.mean(), **TOL)
    np.testing.assert_allclose(metrics["rejected"], r.mean(), **TOL)
    np.testing.assert_allclose(metrics["margin"], (c - r).mean(), **TOL)
    np.testing.assert_allclose(metrics["loss"], np.mean(np.log1p(np.exp(-(c - r - m)))), **TOL)
    np.testing.assert_allclose(metrics["accuracy"], np.mean(c > r), **TOL)


def test_reply_logps_sum_hand_built_masks(packed):
    """reply_logps' sums and counts are float64 log_softmax of the forward's logits at the next token, summed over
    each reply's targets (written as index ranges, not from the batch's masks)."""
    z = packed["logits"].astype(np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    want = np.zeros((2, B, 2))  # [chosen / rejected, row, slot]
    count = np.zeros((2, B, 2))
    for row, slot, side, g, start, prompt in SEQS:
        ids = ROWS[g]
        for j in range(prompt - 1, len(ids) - 1):  # position start + j predicts reply token ids[j + 1]
            want[side, row, slot] += logp[row, start + j, ids[j + 1]]
            count[side, row, slot] += 1
    assert count.sum() == (9 - 4) + (5 - 2) + 0 + (3 - 1) + (12 - 5) + (3 - 2)
    chosen, rejected, n_chosen, n_rejected = packed["logps"]
    np.testing.assert_allclose(chosen, want[0], **TOL)
    np.testing.assert_allclose(rejected, want[1], **TOL)
    np.testing.assert_array_equal(n_chosen, count[0])
    np.testing.assert_array_equal(n_rejected, count[1])


# --- (e) a reward checkpoint through ckpt-to-hf ----------------------------------------------------------------------

def _word_tokenizer(path):
    """A tokenizer.json of a few words (hf_full embeds only 128 ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(
        ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"])}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(path)


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory, mesh1):
    """A reward run: hf_full's random weights plus the fixture's score head, saved with save_params (score_head=1)
    beside a tokenizer.json, and its float32 ckpt-to-hf export; and a plain LM run (the same weights, no head)."""
    root = tmp_path_factory.mktemp("reward")
    cfg, _, params, buffers = load_hf(os.path.join(FIXTURES, "hf_full"), mesh1, dtype="float32")
    cfg = cfg.replace(score_head=1)
    spec = abstract_model(cfg, mesh1)[1]["score"]
    head = load_file(os.path.join(FIX, "score.safetensors"))["score.weight"].T.copy()
    score = spec.replace(jax.device_put(head, spec.get_value().sharding))
    params = nnx.from_flat_state([*nnx.to_flat_state(params), (("score",), score)])
    run, plain = str(root / "run"), str(root / "plain")
    checkpoint.save_params(os.path.join(run, "checkpoints"), 1, params, buffers, cfg)
    _word_tokenizer(os.path.join(run, "tokenizer.json"))
    lm = nnx.from_flat_state([(p, v) for p, v in nnx.to_flat_state(params) if p[0] != "score"])
    checkpoint.save_params(os.path.join(plain, "checkpoints"), 1, lm, buffers, cfg.replace(score_head=0))
    export = convert.ckpt_to_hf(run, str(root / "export"), dtype="float32")
    want = _golden_scores(mesh1, abstract_model(cfg, mesh1)[0], params, buffers)
    return {"run": run, "plain": plain, "export": export, "head": head, "want": want}


def test_export_holds_the_head_and_loads_back(reward_run, mesh1):
    """The export is hf_full's layout plus score.safetensors and reward_model.json; loaded back it scores as the
    checkpoint's weights did, which are torch's rewards."""
    export = reward_run["export"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "score.safetensors",
            "reward_model.json"} <= set(os.listdir(export))
    with open(os.path.join(export, "reward_model.json")) as f:
        assert json.load(f) == {"score_head": 1, "read_at": "last_token"}
    w = load_file(os.path.join(export, "score.safetensors"))
    assert list(w) == ["score.weight"] and w["score.weight"].dtype == np.float32
    np.testing.assert_array_equal(w["score.weight"], reward_run["head"].T)
    np.testing.assert_allclose(reward_run["want"], GOLD["rewards"], **TOL)
    cfg, graphdef, params, buffers = load_reward_model(export, mesh1)
    assert cfg.score_head == 1
    np.testing.assert_array_equal(_golden_scores(mesh1, graphdef, params, buffers), reward_run["want"])


def test_reward_checkpoint_loads_and_scores(reward_run, mesh1):
    """load_reward_model on the run itself, and ModelScorer.load on the run and on its export (same tokenizer)."""
    cfg, graphdef, params, buffers = load_reward_model(reward_run["run"], mesh1)
    assert cfg.score_head == 1
    np.testing.assert_array_equal(_golden_scores(mesh1, graphdef, params, buffers), reward_run["want"])
    tok = os.path.join(reward_run["run"], "tokenizer.json")
    for path in (reward_run["run"], reward_run["export"]):
        scorer = ModelScorer.load(path, mesh1, policy_tokenizer=tok, pad_id=0, row_len=W)
        np.testing.assert_allclose(scorer.score_rows(ROWS), GOLD["rewards"], **TOL)


def test_with_score_head_adds_and_drops_the_head(mesh1):
    """models.with_score_head: a checkpoint without a head gets a fresh normal(0, initializer_range) one (seeded), one
    with a head loses it for a model without; every other weight is the same array."""
    cfg, _, params, _ = load_hf(os.path.join(FIXTURES, "hf_full"), mesh1, dtype="float32")
    head_cfg = cfg.replace(score_head=2)
    a = with_score_head(params, head_cfg, mesh1, 0, "hf_full")
    w = np.asarray(a["score"].get_value())
    assert w.shape == (cfg.hidden_size, 2) and w.dtype == np.float32
    assert 0.5 * cfg.initializer_range < w.std() < 2 * cfg.initializer_range and abs(w.mean()) < cfg.initializer_range
    np.testing.assert_array_equal(np.asarray(with_score_head(params, head_cfg, mesh1, 0, "x")["score"].get_value()), w)
    assert not np.array_equal(np.asarray(with_score_head(params, head_cfg, mesh1, 1, "x")["score"].get_value()), w)
    dropped = with_score_head(a, cfg, mesh1, 0, "x")
    assert dict(nnx.to_flat_state(dropped)).keys() == dict(nnx.to_flat_state(params)).keys()
    for (path, v), (_, u) in zip(nnx.to_flat_state(dropped), nnx.to_flat_state(params), strict=True):
        assert v.get_value() is u.get_value(), path


# --- (f) bad input ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case, message", [
    ("hf_lm", "not a reward model"),
    ("empty", "not a reward model"),
    ("missing", "no such reward-model directory"),
    ("lm_checkpoint", "without a score head"),
    ("bad_head", "score.safetensors"),
])
def test_not_a_reward_model_is_one_line(case, message, reward_run, tmp_path, mesh1):
    path = {"hf_lm": os.path.join(FIXTURES, "hf_full"), "empty": str(tmp_path), "missing": str(tmp_path / "nope"),
            "lm_checkpoint": reward_run["plain"], "bad_head": str(tmp_path / "bad")}[case]
    if case == "bad_head":  # an export whose head has the wrong width
        os.makedirs(path)
        for name in ("config.json", "model.safetensors"):
            os.link(os.path.join(FIX, name), os.path.join(path, name))
        save_file({"score.weight": np.zeros((1, 5), np.float32)}, os.path.join(path, "score.safetensors"))
    with pytest.raises(InputError) as err:
        load_reward_model(path, mesh1)
    _assert_one_line(err, path, message)


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory):
    """The RL demo's data (data_prep.rl_tasks): prompts and the policy's tokenizer.json."""
    from data_prep import rl_tasks
    d = str(tmp_path_factory.mktemp("rl_data"))
    rl_tasks.write(d, seed=0, heldout=8, sft=0)
    return d


def test_scorer_checks_the_tokenizer(rl_data, reward_run, mesh1):
    """Before any weights load: a reward dir without a tokenizer.json, or with one unlike the policy's."""
    tok = os.path.join(rl_data, "tokenizer.json")
    with pytest.raises(InputError) as err:
        ModelScorer.load(FIX, mesh1, policy_tokenizer=tok, pad_id=0)
    _assert_one_line(err, FIX, "no tokenizer.json")
    with pytest.raises(InputError) as err:
        ModelScorer.load(reward_run["export"], mesh1, policy_tokenizer=tok, pad_id=0)
    _assert_one_line(err, reward_run["export"], "differs from the policy's")


def test_grpo_with_a_non_reward_dir_in_process(rl_data, tmp_path, mesh1):
    """recipe.model_scorer (what GRPO's build calls) on a directory with the policy's tokenizer but no model."""
    from glm46_jax import run_config
    from glm46_jax.recipes.rl.build import model_scorer

    c = run_config.config_file(os.path.join(ROOT, "configs", "grpo.py"), "tiny")
    with c.unlocked():
        c.run_dir = str(tmp_path / "run")
        c.checkpoint.init_from = ""
        c.rl.update(prompts=os.path.join(rl_data, "prompts_train.jsonl"),
                    heldout=os.path.join(rl_data, "prompts_heldout.jsonl"),
                    tokenizer=os.path.join(rl_data, "tokenizer.json"), rewards=["reward_model"], reward_weights=[1.0],
                    reward_model=rl_data)
    with pytest.raises(InputError) as err:
        model_scorer(run_config.from_config_dict(c), mesh1)
    _assert_one_line(err, rl_data, "not a reward model")


def test_grpo_cli_with_a_non_reward_dir_exits_2(rl_data, tmp_path):
    """`python -m glm46_jax.train --config=configs/grpo.py:tiny` with rl.rewards=("reward_model",) (the form
    reward_model.py documents) and rl.reward_model=<the RL data dir>: exit 2 and one stderr line naming the directory,
    so the check comes before the policy is built (whose log lines would precede it)."""
    d = rl_data
    flags = [f"--config.run_dir={tmp_path / 'run'}", "--config.checkpoint.init_from=",
             f"--config.rl.prompts={d}/prompts_train.jsonl", f"--config.rl.heldout={d}/prompts_heldout.jsonl",
             f"--config.rl.tokenizer={d}/tokenizer.json", "--config.rl.rewards=('reward_model',)",
             "--config.rl.reward_weights=(1.0,)", f"--config.rl.reward_model={d}"]
    proc = subprocess.run([sys.executable, "-m", "glm46_jax.train", "--config=configs/grpo.py:tiny", *flags],
                          capture_output=True, text=True, cwd=ROOT, env=subprocess_env(1), timeout=300, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-2000:])
    assert lines[0].startswith("error: ") and d in lines[0] and "not a reward model" in lines[0], lines[0]

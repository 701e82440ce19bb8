"""On-policy preference pairs and the reward model's check (issue 52): labellers against hand-worked verdicts, pairs
from hand-built sample groups, agreement and calibration against float64 NumPy by hand, the token rows a reward model
trains on against the rows PPO scores, and the RL check's win rates on a scripted policy and reward model."""

import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer

from glm46_jax.errors import InputError
from glm46_jax.interop import chat
from glm46_jax.recipes.preference import agreement
from glm46_jax.recipes.rl import labellers, policy_pairs
from glm46_jax.recipes.rl.check import START_FILE, RewardCheck
from glm46_jax.recipes.rl.rollout import Rollout

ITEM = {"prompt": "312+7", "answer": "319"}


def prefer_shorter(a: str, b: str, item) -> float | None:
    """A plugged-in labeller ("test_policy_pairs:prefer_shorter")."""
    return None if len(a) == len(b) else float(len(a) < len(b))


def test_a_checker_prefers_the_higher_reward_and_has_no_preference_on_equal_ones():
    label = labellers.resolve("exact_answer")
    assert label("319", "318", ITEM) == 1.0 and label("the sum is 318", "319", ITEM) == 0.0
    assert label("318", "320", ITEM) is None  # both wrong
    assert label("<answer>319</answer>", "319", ITEM) is None  # both right
    same = labellers.resolve("reward:glm46_jax.recipes.rl.rewards:exact_answer")
    assert same("319", "1", ITEM) == 1.0


def test_a_file_of_labels_answers_its_pairs_their_mirrors_and_nothing_else(tmp_path):
    path = tmp_path / "labels.jsonl"
    rows = [{"prompt": "312+7", "a": "319", "b": "318", "preferred": "a"},
            {"prompt": "312+7", "a": "317", "b": "316", "preferred": "tie"},
            {"prompt": "1+1", "a": "3", "b": "2", "preferred": "b"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    label = labellers.resolve(f"file:{path}")
    assert label("319", "318", ITEM) == 1.0 and label("318", "319", ITEM) == 0.0
    assert label("2", "3", {"prompt": "1+1"}) == 1.0
    assert label("317", "316", ITEM) is None and label("319", "300", ITEM) is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"prompt": "x", "a": "1", "b": "2", "preferred": "c"}))
    with pytest.raises(InputError, match=r"bad.jsonl:2: expected"):
        labellers.resolve(f"file:{bad}")
    with pytest.raises(InputError, match=r"labeller file:.*missing.jsonl: cannot read it"):
        labellers.resolve(f"file:{tmp_path / 'missing.jsonl'}")


def test_labeller_names():
    assert labellers.resolve("test_policy_pairs:prefer_shorter")("12", "123", ITEM) == 1.0
    with pytest.raises(InputError, match="labeller 'exact': give a checker"):
        labellers.resolve("exact")
    with pytest.raises(InputError, match="labeller: cannot import .no_such_module:fn."):
        labellers.resolve("no_such_module:fn")


def test_pairs_from_sample_groups_by_hand():
    # prompt 0: a right answer, a wrong one, the right one again, one cut short; prompt 1: one text four times;
    # prompt 2: one right and two different wrong answers (which the checker cannot order).
    texts = ["319", "318", "319", "31", "7", "7", "7", "7", "5", "6", "9", "8"]
    complete = np.array([1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1], bool)
    items = [ITEM, {"prompt": "3+4", "answer": "7"}, {"prompt": "2+3", "answer": "5"}]
    label = labellers.resolve("exact_answer")
    found = policy_pairs.label_groups(texts, complete, items, 4, label, per_prompt=6, seed=0)
    assert sorted(found.pairs) == [(0, 0, 1), (2, 8, 9), (2, 8, 10), (2, 8, 11)]
    # prompt 0: rows 0 and 1 (row 2 repeats row 0's text, row 3 is cut); prompt 2: six pairs, three wrong-wrong
    assert (found.asked, found.no_preference, found.unfinished, found.single) == (7, 3, 1, 1)
    one = policy_pairs.label_groups(texts, complete, items, 4, label, per_prompt=1, seed=0)
    assert [p.prompt for p in one.pairs] == [0, 2] and one.pairs[1].chosen == 8
    lines = policy_pairs.pair_lines(found.pairs[:1], texts, items)
    assert lines == [{"messages": [{"role": "user", "content": "312+7"}], "enable_thinking": False,
                      "chosen": {"role": "assistant", "content": "319"},
                      "rejected": {"role": "assistant", "content": "318"}}]


def test_agreement_and_calibration_by_hand():
    chosen, rejected = np.array([2.0, 0.1, 1.0, -3.0, 0.7]), np.array([0.0, 0.3, 1.0, 0.0, 0.0])
    # margins 2, -0.2, 0 (a tie: half), -3, 0.7
    assert agreement.agreement(chosen, rejected) == pytest.approx((1 + 0 + 0.5 + 0 + 1) / 5)
    table = agreement.calibration(chosen, rejected)
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    assert [(r["margin_lo"], r["pairs"]) for r in table] == [(0.0, 2), (0.5, 1), (1.0, 0), (2.0, 2), (4.0, 0)]
    assert table[0]["accuracy"] == 0.0 and table[0]["predicted"] == pytest.approx((sig(0.2) + sig(0.0)) / 2)
    assert table[1]["accuracy"] == 1.0 and table[3]["accuracy"] == 0.5
    assert table[3]["predicted"] == pytest.approx((sig(2.0) + sig(3.0)) / 2)
    assert np.isnan(table[2]["accuracy"]) and np.isnan(table[4]["predicted"])


@pytest.fixture(scope="module")
def addition_tokenizer(tmp_path_factory) -> Tokenizer:
    from data_prep import rl_tasks

    out = tmp_path_factory.mktemp("rl_addition")
    rl_tasks.write(str(out), max_a=20, heldout=20, sft=20)
    return Tokenizer.from_file(str(out / "tokenizer.json"))


def _rollout(tok: Tokenizer, prompt: str, completions: list[str]) -> Rollout:
    """Rows as the sampler returns them: the chat prompt's ids, each completion's ids then the <|user|> stop."""
    ids = chat.encode_prompt(tok, [{"role": "user", "content": prompt}], enable_thinking=False).tolist()
    stop = tok.token_to_id("<|user|>")
    rows = [tok.encode(c, add_special_tokens=False).ids + [stop] for c in completions]
    tokens = np.zeros((len(rows), 8), np.int32)  # max_new_tokens 8
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    return Rollout([ids] * len(rows), tokens, np.zeros(tokens.shape, np.float32), np.array(list(map(len, rows))),
                   None, len(ids), 0.0)


def test_a_reward_model_trains_on_the_token_rows_ppo_scores(addition_tokenizer):
    """A pair line of sampled completions, tokenized by `data_prep preferences`, gives each reply's row as exactly
    the sampler's prompt + completion + stop token: the row PPO's reward model scores (recipes/rl/reward_model.py)."""
    from data_prep import preferences

    tok = addition_tokenizer
    stops = chat.stop_token_ids(tok)
    rollout = _rollout(tok, "12+7", ["\n19", "\n18"])
    texts = policy_pairs.completion_texts(tok, rollout, stops)
    assert texts == ["\n19", "\n18"] and policy_pairs.finished(rollout, stops).all()
    line = policy_pairs.pair_lines([policy_pairs.Pair(0, 0, 1)], texts, [{"prompt": "12+7"}])[0]
    encoded = preferences.encode_pair(tok, preferences.parse_line(json.dumps(line), "x:1"), max_len=128)
    for seq, row in ((encoded.chosen, 0), (encoded.rejected, 1)):
        assert seq.ids.tolist() == rollout.prompts[row] + rollout.completion(row)
        assert seq.assistant_mask[-len(rollout.completion(row)):].all()  # the reply and its end token are trained


class _Scorer:
    """A reward model that scores a row by its last digit before the stop token (a stand-in for ModelScorer)."""
    def __init__(self, tok):
        self.tok = tok

    def score_rows(self, rows):
        texts = [self.tok.decode(r[:-1], skip_special_tokens=False) for r in rows]
        return np.array([float(t[-1]) if t[-1].isdigit() else -1.0 for t in texts], np.float32)


def test_the_reward_model_check_by_hand(addition_tokenizer, tmp_path):
    """Two check prompts (12+7, 3+4), two samples each: the starting policy answers 19, 18 | 5, 9, a later one
    17, 19 | 7, 8; the reward model is a scorer that prefers a higher last digit. Every value worked out by hand."""
    tok = addition_tokenizer
    stops = chat.stop_token_ids(tok)
    items = [{"prompt": "12+7", "answer": "19"}, {"prompt": "3+4", "answer": "7"}]
    answers = {0: ["\n19", "\n18", "\n5", "\n9"], 1: ["\n17", "\n19", "\n7", "\n8"]}
    calls = []

    def sampler_at(version):
        def sample(prompt_ids, group_size, seed):
            calls.append((version, seed))
            rows = [_rollout(tok, items[p]["prompt"], answers[version][2 * p:2 * p + 2]) for p in range(2)]
            merged = Rollout([r for x in rows for r in x.prompts], np.concatenate([x.tokens for x in rows]),
                             np.concatenate([x.logprobs for x in rows]), np.concatenate([x.lengths for x in rows]),
                             None, rows[0].prompt_slots, 0.0)
            return merged, policy_pairs.completion_texts(tok, merged, stops)
        return sample

    prompt_ids = [[0], [0]]  # unused by the scripted sampler
    label = labellers.resolve("exact_answer")
    check = RewardCheck.start(str(tmp_path), sampler_at(0), label, _Scorer(tok), items, prompt_ids, samples=2, seed=3)
    assert calls == [(0, 3)] and os.path.exists(tmp_path / START_FILE)
    got = check(sampler_at(1))
    # Pair by pair, later vs start: 17 vs 19 (loss), 19 vs 18 (win), 7 vs 5 (win), 8 vs 9 (both wrong: tie).
    assert got["check_win_rate"] == pytest.approx((0 + 1 + 1 + 0.5) / 4)
    # The scorer (last digit): 7 < 9, 9 > 8, 7 > 5, 8 < 9.
    assert got["check_proxy_win_rate"] == pytest.approx(2 / 4)
    assert got["check_gap"] == pytest.approx(0.5 - 0.625)
    # The later samples' own pairs: (19 > 17) by the labeller, the scorer agrees; (7 > 8), the scorer disagrees.
    assert got["check_pairs"] == 2 and got["check_agreement"] == pytest.approx(0.5)
    assert got["check_proxy_score"] == pytest.approx((7 + 9 + 7 + 8) / 4)
    # A resumed run reads the starting samples back instead of sampling its (no longer starting) policy.
    again = RewardCheck.start(str(tmp_path), sampler_at(1), label, _Scorer(tok), items, prompt_ids, samples=2, seed=3)
    assert calls == [(0, 3), (1, 3 + 7919)] and again.start_texts == check.start_texts
    np.testing.assert_array_equal(again.start_scores, check.start_scores)


class _Fixed:
    def __init__(self, scores):
        self.scores = np.asarray(scores, np.float32)

    def score_rows(self, rows):
        return self.scores[:len(rows)]


def test_an_ensemble_scores_mean_minus_penalty_times_std():
    """Three members' scores of two rows: row 0 (1, 2, 3): mean 2, population std sqrt(2/3); row 1 (5, 5, 5): 5, 0.
    With penalty 0.5 the first row loses half its spread, the agreed one nothing; penalty 0 is the plain mean."""
    from glm46_jax.recipes.rl.reward_model import EnsembleScorer

    members = [_Fixed([1.0, 5.0]), _Fixed([2.0, 5.0]), _Fixed([3.0, 5.0])]
    got = EnsembleScorer(members, penalty=0.5).score_rows([[1], [2]])
    np.testing.assert_allclose(got, [2.0 - 0.5 * np.sqrt(2.0 / 3.0), 5.0], rtol=1e-6)
    np.testing.assert_allclose(EnsembleScorer(members, penalty=0.0).score_rows([[1], [2]]), [2.0, 5.0])


def test_the_check_curve_reads_a_run(tmp_path, capsys):
    """check_curve on a hand-written run dir: the accuracy line with its standard errors (0.25 of 500: se 0.0194; with
    per-problem outcomes, the gain's paired one), the stop, the table's rows in step order (the later record of a step wins) and the PNG."""
    from glm46_jax.recipes.rl import check_curve

    run = tmp_path / "ppo"
    run.mkdir()
    check = {"eval/accuracy": 0.25, "eval/check_win_rate": 0.5, "eval/check_proxy_win_rate": 0.5,
             "eval/check_agreement": 0.9}
    records = [{"step": 10, "train/loss": 1.0}, {"step": 20, **check}, {"step": 10, **check},
               {"step": 20, **check, "eval/check_proxy_win_rate": 0.8}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "heldout.json").write_text(json.dumps({"start_accuracy": 0.25, "end": {"accuracy": 0.3}, "problems": 500}))
    (run / "status.json").write_text(json.dumps({"step": 20, "reason": "the check diverged", "rolled_back_to": 10}))
    assert check_curve.main([str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("held-out exact-match accuracy on 500 problems (greedy): 0.250 +- 0.019 before -> 0.300 after "
                      "(+0.050, +2.6 standard errors of the start)")
    assert out[1] == "stopped at step 20: the check diverged; ended on step 10"
    assert [line.split()[0] for line in out[3:5]] == ["10", "20"] and "0.800" in out[4]
    assert (run / "check_curve.png").stat().st_size > 1000
    # with per-problem outcomes, the gain's paired error: d = (0, 1, 1, 0), sd 0.5774 / sqrt(4) = 0.2887
    (run / "heldout.json").write_text(json.dumps({"start_accuracy": 0.5, "end": {"accuracy": 1.0}, "problems": 4,
                                                  "start_passed": [1, 0, 0, 1], "end_passed": [1, 1, 1, 1]}))
    assert check_curve.summary_lines(str(run))[0] == (
        "held-out exact-match accuracy on 4 problems (greedy): 0.500 +- 0.250 before -> 1.000 after "
        "(+0.500 +- 0.289 paired, +1.7 standard errors)")
    with pytest.raises(InputError, match="heldout.json: not found"):
        check_curve.summary_lines(str(tmp_path))

"""The preference recipes and PPO as runs of the training driver (docs/preferences.md, docs/rl.md#ppo):

- a reward model learns a separable synthetic preference set (replies that end vs. replies that ramble) to >= 0.9
  held-out pair accuracy, from a random init;
- DPO raises the share of held-out pairs whose chosen reply has the higher mean token log-prob by a stated margin
  over the starting model's, and its implicit-reward accuracy;
- a DPO run and a PPO run killed with SIGKILL after a checkpoint and resumed end bit-identical to uninterrupted runs
  (every array of the checkpoint: policy, critic, both optimizers; the data state: loader position, prompt pool and
  its RNG, score statistics);
- bad input (a preference line without `rejected`, chosen == rejected, a reward-model directory that is not one)
  stops the driver with one line and exit 2.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import subprocess_env

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
# A small random-init model: the runs below test the recipes, not the tiny preset's capacity.
MODEL = ["--config.model.num_hidden_layers=2", "--config.model.hidden_size=32", "--config.model.num_attention_heads=4",
         "--config.model.num_key_value_heads=2", "--config.model.num_nextn_predict_layers=0",
         "--config.model.scan_unroll=2", "--config.mesh.data=1", "--config.checkpoint.init_from=",
         "--config.monitor.sinks=jsonl", "--config.checkpoint.async_save=False"]


def _pairs_jsonl(path: str, n: int, seed: int = 0) -> None:
    """Addition prompts; chosen: the sum; rejected: the sum, then the same again several times (a reply that
    rambles instead of ending)."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = int(rng.integers(0, 100)), int(rng.integers(0, 10))
            answer = str(a + b)
            ramble = " ".join([answer] * int(rng.integers(3, 6)))
            f.write(json.dumps({"prompt": f"{a}+{b}", "chosen": answer, "rejected": ramble}) + "\n")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The addition task's tokenizer and prompts (data_prep.rl_tasks) and a preference set on it."""
    from data_prep import cli as data_cli
    from data_prep import rl_tasks

    root = str(tmp_path_factory.mktemp("pref"))
    rl_tasks.write(root, seed=0, heldout=32, sft=0)
    _pairs_jsonl(os.path.join(root, "pairs.jsonl"), 400)
    assert data_cli.main(["preferences", "--input", os.path.join(root, "pairs.jsonl"), "--tokenizer",
                          os.path.join(root, "tokenizer.json"), "--out", os.path.join(root, "prefs"),
                          "--heldout-fraction", "0.15"]) == 0
    return root


def _pref_flags(data: str, run_dir: str, steps: int, every: int = 100) -> list[str]:
    return [*MODEL, f"--config.run_dir={run_dir}", f"--config.preference.root={os.path.join(data, 'prefs')}",
            "--config.preference.seq_len=128", "--config.preference.global_batch=8", "--config.preference.pairs_per_row=2",
            "--config.preference.method=full", f"--config.train.steps={steps}", "--config.train.log_every=1",
            "--config.train.eval_every=0", "--config.train.eval_batches=4", f"--config.checkpoint.every={every}",
            "--config.checkpoint.keep=0", "--config.optim.warmup_steps=0", f"--config.optim.decay_steps={steps}"]


def _train(recipe: str, flags: list[str], preset: str = "tiny"):
    """The run in this process (the same config the CLI builds from the flags)."""
    from conftest import apply_flags

    from glm46_jax import run_config, train
    c = run_config.config_file(os.path.join(ROOT, "configs", f"{recipe}.py"), preset)
    booleans = [f for f in flags if f.endswith(("=True", "=False"))]  # bool("False") is True: set these by hand
    apply_flags(c, [f for f in flags if f not in booleans])
    for flag in booleans:
        path, value = flag.removeprefix("--config.").split("=")
        section, name = path.split(".")
        c[section][name] = value == "True"
    return train.train(run_config.from_config_dict(c), jax.devices()[:1])


def _heldout(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "heldout.json")) as f:
        return json.load(f)


def _heldout_pairs(data: str) -> int:
    with open(os.path.join(data, "prefs", "metadata.json")) as f:
        return json.load(f)["splits"]["heldout"]["pairs"]


def test_reward_model_separates_pairs(data, tmp_path, capsys):
    run = str(tmp_path / "reward")
    _train("reward", _pref_flags(data, run, 20) + ["--config.optim.lr=3e-3", "--config.optim.end_lr=3e-4"])
    # the summary reports the Bradley-Terry loss (a reward model has no next-token CE to print)
    summary = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("start loss"))
    assert "(the recipe's loss;" in summary and "nan" not in summary, summary
    r = _heldout(run)
    # Measured: 0.5 -> 1.0 on the 55 held-out pairs (a random head orders about half of them).
    assert r["end"]["pairs"] == _heldout_pairs(data)
    assert r["end"]["accuracy"] >= 0.9, r
    assert r["end"]["margin"] > r["start"]["margin"]
    # Calibration: every held-out pair in one |margin| bucket, and the buckets' right orders are the eval's accuracy
    # (scored by a separate program from the eval's loss).
    table = r["calibration"]
    assert sum(b["pairs"] for b in table) == r["end"]["pairs"]
    right = sum(b["pairs"] * b["accuracy"] for b in table if b["pairs"])
    assert right / r["end"]["pairs"] == pytest.approx(r["end"]["accuracy"], abs=1e-6)


# --- runs, and kill -9 then resume --------------------------------------------------------------------------------

def _checkpoint(run_dir: str, step: int) -> tuple[dict[str, np.ndarray], dict]:
    """Every array of a checkpoint (model, optimizer, other models) and its data state, read without a target."""
    step_dir = os.path.join(run_dir, "checkpoints", str(step))
    arrays = {}
    for item in ("model", "optimizer", "others"):
        if os.path.isdir(os.path.join(step_dir, item)):
            tree = ocp.PyTreeCheckpointer().restore(os.path.join(step_dir, item))
            arrays.update({item + jax.tree_util.keystr(k): np.asarray(v)
                           for k, v in jax.tree_util.tree_leaves_with_path(tree)})
    with open(os.path.join(step_dir, "data", "metadata")) as f:
        return arrays, json.load(f)


def _process(recipe: str, preset: str, flags: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "glm46_jax.train", f"--config=configs/{recipe}.py:{preset}", *flags]
    return subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _kill_after(proc: subprocess.Popen, run_dir: str, step: int, timeout: float = 600) -> None:
    marker = os.path.join(run_dir, "checkpoints", str(step), "data", "metadata")
    t0 = time.time()
    while not os.path.exists(marker):
        assert proc.poll() is None, f"the run ended before its step-{step} checkpoint: {proc.communicate()[0][-3000:]}"
        assert time.time() - t0 < timeout, f"no step-{step} checkpoint after {timeout} s"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    return out


def _straight(recipe: str, preset: str, flags_for, tmp_path) -> str:
    """An uninterrupted CLI run (its programs land in the test run's compile cache, which the next runs read)."""
    run = str(tmp_path / "straight")
    _finish(_process(recipe, preset, flags_for(run)))
    return run


def _assert_resumes_exactly(recipe: str, preset: str, flags_for, straight: str, steps: int, every: int,
                            tmp_path) -> None:
    """A CLI run of `flags_for(dir)` SIGKILLed once its step-`every` checkpoint exists, then run again, ends with
    the checkpoint of the uninterrupted CLI run `straight`: every array and the data state."""
    killed = str(tmp_path / "killed")
    proc = _process(recipe, preset, flags_for(killed))
    _kill_after(proc, killed, every)
    out = _finish(_process(recipe, preset, flags_for(killed)))
    assert f"of {steps}" in out and "steps 1-" not in out, out[-2000:]  # it resumed, it did not start over
    want, want_data = _checkpoint(straight, steps)
    got, got_data = _checkpoint(killed, steps)
    assert sorted(got) == sorted(want)
    for name, x in want.items():
        np.testing.assert_array_equal(got[name], x, err_msg=name)
    assert got_data == want_data
    # The run trained (resuming an unchanged model would compare equal trivially).
    first, _ = _checkpoint(straight, every)
    assert any(not np.array_equal(first[k], want[k]) for k in want if k.startswith("model"))


def test_dpo_prefers_chosen_replies_and_resumes_exactly(data, tmp_path):
    """8 steps of DPO (sigmoid) from a random init: the held-out pairs' length-normalised preference rises; a copy
    of the run killed after its step-4 checkpoint and resumed ends bit-identical."""
    def flags(run):
        return _pref_flags(data, run, 8, every=4) + ["--config.optim.lr=3e-3", "--config.optim.end_lr=3e-4"]
    straight = _straight("dpo", "tiny", flags, tmp_path)
    r = _heldout(straight)
    start, end = r["start"], r["end"]
    # The reference is the starting model: every implicit reward starts at 0 (accuracy 0: no pair strictly above).
    assert start["accuracy"] == 0.0 and abs(start["margin"]) < 1e-6, start
    # Measured: len_norm_accuracy 0.45 -> 1.0 on the 55 held-out pairs; implicit-reward accuracy 1.0.
    assert end["pairs"] == _heldout_pairs(data)
    assert end["len_norm_accuracy"] >= start["len_norm_accuracy"] + 0.3, r
    assert end["accuracy"] >= 0.9 and end["margin"] > 0, r
    _assert_resumes_exactly("dpo", "tiny", flags, straight, 8, 4, tmp_path)


def _ppo_flags(data: str, run_dir: str, steps: int, every: int, extra: tuple[str, ...] = ()) -> list[str]:
    return [*MODEL, f"--config.run_dir={run_dir}", f"--config.rl.prompts={os.path.join(data, 'prompts_train.jsonl')}",
            f"--config.rl.heldout={os.path.join(data, 'prompts_heldout.jsonl')}",
            f"--config.rl.tokenizer={os.path.join(data, 'tokenizer.json')}", "--config.rl.group_size=2",
            "--config.rl.prompts_per_step=4", "--config.rl.minibatches=2", "--config.rl.max_new_tokens=4",
            "--config.rl.eval_batch=8", "--config.rl.kl_coef=0.05", "--config.ppo.critic_init=",
            "--config.ppo.normalize_rewards=True", f"--config.train.steps={steps}",
            "--config.train.log_every=1", "--config.train.eval_every=0", "--config.train.eval_batches=1",
            f"--config.checkpoint.every={every}", "--config.checkpoint.keep=0", "--config.optim.warmup_steps=0",
            f"--config.optim.decay_steps={steps}", *extra]


def test_ppo_resumes_exactly(data, tmp_path):
    """configs/ppo.py:addition (the exact-answer reward, a critic from the random policy, the k1 KL in the reward
    with the adaptive KL coefficient, running score normalisation, one rollout of critic warm-up): policy, critic,
    both optimizers, the prompt pool and its RNG, the score statistics and the KL coefficient all continue
    bit-identically after a SIGKILL at the end of the warm-up. The warm-up's two updates reached the critic only:
    the policy's Adam moments are still exactly zero. The coefficient follows the controller's rule from the KL each
    rollout measured (a horizon of one rollout's 8 samples: up to 20% a rollout)."""
    target = 0.05

    def flags(run):
        return _ppo_flags(data, run, 6, 2, ("--config.ppo.critic_warmup=1", f"--config.ppo.kl_target={target}",
                                            "--config.ppo.kl_horizon=8"))
    straight = _straight("ppo", "addition", flags, tmp_path)
    with open(os.path.join(straight, "metrics.jsonl")) as f:
        per_rollout = {int(r["train/rollouts"]): (r["train/kl_coef"], r["train/kl_per_completion"])
                       for r in map(json.loads, f) if "train/kl_coef" in r}
    assert sorted(per_rollout) == [1, 2, 3] and per_rollout[1][0] == pytest.approx(0.05, rel=1e-7), per_rollout
    for r in (1, 2):  # beta_{r+1} = beta_r (1 + clip(KL_r / target - 1, +-0.2) x 8 / 8)
        beta, kl = per_rollout[r]
        want = beta * (1 + min(max(kl / target - 1, -0.2), 0.2))
        assert per_rollout[r + 1][0] == pytest.approx(want, rel=1e-6), (r, per_rollout)
    assert abs(per_rollout[1][1]) < 1e-3 and per_rollout[2][0] == pytest.approx(0.04, rel=1e-6)  # no KL yet: -20%
    warm, _ = _checkpoint(straight, 2)
    policy_mu = [x for k, x in warm.items() if k.startswith("optimizer") and "['mu']" in k]
    critic_mu = [x for k, x in warm.items() if k.startswith("others['critic']['opt_state']") and "['mu']" in k]
    assert policy_mu and critic_mu
    assert all(not x.any() for x in policy_mu)
    assert sum(float(np.abs(x).sum()) for x in critic_mu) > 0
    _assert_resumes_exactly("ppo", "addition", flags, straight, 6, 2, tmp_path)
    end, _ = _checkpoint(straight, 6)  # after the warm-up the policy trains
    assert any(x.any() for k, x in end.items() if k.startswith("optimizer") and "['mu']" in k)


# --- bad input ---------------------------------------------------------------------------------------------------

def _cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True,
                          timeout=300, check=False)


def _one_line_exit_2(result: subprocess.CompletedProcess, *needles: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert len(lines) == 1 and all(n in lines[0] for n in needles), result.stderr[-2000:]


@pytest.mark.parametrize("line, reason", [
    ({"prompt": "1+2", "chosen": "3"}, "no 'rejected'"),
    ({"prompt": "1+2", "chosen": "3", "rejected": "3"}, "the same reply"),
])
def test_bad_preference_line_exits_2(data, tmp_path, line, reason):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(line) + "\n")
    result = _cli(["-m", "data_prep", "preferences", "--input", str(bad), "--tokenizer",
                   os.path.join(data, "tokenizer.json"), "--out", str(tmp_path / "out")])
    _one_line_exit_2(result, f"{bad}:1", reason)


def test_bad_lines_among_good_ones_are_reported_and_skipped(data, tmp_path):
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join(json.dumps(x) for x in (
        {"prompt": "1+2", "chosen": "3", "rejected": "4"}, {"prompt": "1+3", "chosen": "4"},
        {"prompt": "1+4", "chosen": "5", "rejected": "5"}, {"prompt": "1+5", "chosen": "6", "rejected": "7"})) + "\n")
    result = _cli(["-m", "data_prep", "preferences", "--input", str(mixed), "--tokenizer",
                   os.path.join(data, "tokenizer.json"), "--out", str(tmp_path / "out"), "--heldout-fraction", "0"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"{mixed}:2" in result.stderr and f"{mixed}:3" in result.stderr and "the same reply" in result.stderr
    with open(tmp_path / "out" / "metadata.json") as f:
        assert json.load(f)["splits"]["train"]["pairs"] == 2


def test_not_a_reward_model_exits_2(data, tmp_path):
    empty = tmp_path / "not_a_reward_model"
    empty.mkdir()
    flags = _ppo_flags(data, str(tmp_path / "run"), 2, 2, (f"--config.rl.reward_model={empty}",))
    result = _cli(["-m", "glm46_jax.train", "--config=configs/ppo.py:tiny", *flags])
    _one_line_exit_2(result, str(empty))

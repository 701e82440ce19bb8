"""The preference losses against float64 NumPy written from the papers' formulas (DPO eq. 7 with cDPO's label
smoothing, IPO eq. 17, SimPO eq. 6, Bradley-Terry), values and gradients w.r.t. the log-probs; then against TRL's
own loss code (tests/fixtures/trl_preference.json, made by tests/fixtures/make_trl_fixtures.py with trl 1.16.0):
DPOTrainer's "sigmoid" and "ipo", CPOTrainer's conservative sigmoid (cDPO) and "simpo", values and gradients of the
batch mean, float64 JAX to ~1e-12 and float32 JAX to rtol 1e-5."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm46_jax.recipes.preference import objective


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def _inputs(seed: int = 0, n: int = 6):
    rng = np.random.default_rng(seed)
    return [rng.normal(-40.0, 8.0, n) for _ in range(4)]


def _numeric_grad(f, xs, i, eps=1e-6):
    grad = np.zeros_like(xs[i])
    for k in range(xs[i].size):
        up, down = [x.copy() for x in xs], [x.copy() for x in xs]
        up[i][k] += eps
        down[i][k] -= eps
        grad[k] = (f(*up).sum() - f(*down).sum()) / (2 * eps)
    return grad


@pytest.mark.parametrize("loss_type,smoothing", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0)])
def test_dpo_and_ipo_match_numpy(loss_type, smoothing):
    beta = 0.1
    xs = _inputs()

    def reference(c, r, rc, rr):
        h = (c - r) - (rc - rr)
        if loss_type == "ipo":
            return (h - 1 / (2 * beta)) ** 2
        return -(1 - smoothing) * _log_sigmoid(beta * h) - smoothing * _log_sigmoid(-beta * h)

    with jax.enable_x64():
        args = [jnp.asarray(x, jnp.float64) for x in xs]
        losses, stats = objective.dpo_loss(*args, beta=beta, loss_type=loss_type, label_smoothing=smoothing)
        np.testing.assert_allclose(np.asarray(losses), reference(*xs), rtol=1e-12)
        for i in range(4):
            grad = jax.grad(lambda *a: objective.dpo_loss(*a, beta=beta, loss_type=loss_type,
                                                          label_smoothing=smoothing)[0].sum(), argnums=i)(*args)
            np.testing.assert_allclose(np.asarray(grad), _numeric_grad(reference, xs, i), rtol=1e-6, atol=1e-9)
    chosen_reward, rejected_reward = beta * (xs[0] - xs[2]), beta * (xs[1] - xs[3])
    assert float(stats["margin"]) == pytest.approx((chosen_reward - rejected_reward).mean(), rel=1e-9)
    assert float(stats["accuracy"]) == pytest.approx((chosen_reward > rejected_reward).mean())
    with pytest.raises(ValueError, match="DPO loss type"):
        objective.dpo_loss(*args, beta=beta, loss_type="hinge")


def test_simpo_and_bradley_terry_match_numpy():
    beta, gamma, smoothing = 2.0, 0.5, 0.05
    avg_c, avg_r, s_c, s_r = (x / 20.0 for x in _inputs(1))
    margin = np.linspace(0.0, 1.0, avg_c.size)
    with jax.enable_x64():
        losses, stats = objective.simpo_loss(jnp.asarray(avg_c), jnp.asarray(avg_r), beta=beta, gamma=gamma,
                                             label_smoothing=smoothing)
        z = beta * (avg_c - avg_r) - gamma
        np.testing.assert_allclose(np.asarray(losses),
                                   -(1 - smoothing) * _log_sigmoid(z) - smoothing * _log_sigmoid(-z), rtol=1e-12)
        assert float(stats["chosen"]) == pytest.approx(beta * avg_c.mean(), rel=1e-12)
        bt, bt_stats = objective.bradley_terry_loss(jnp.asarray(s_c), jnp.asarray(s_r), jnp.asarray(margin))
        np.testing.assert_allclose(np.asarray(bt), -_log_sigmoid(s_c - s_r - margin), rtol=1e-12)
        assert float(bt_stats["accuracy"]) == pytest.approx((s_c > s_r).mean())
        # TRL's RewardTrainer with center_rewards_coefficient c: loss.mean() + c * mean((r_c + r_r) ** 2)
        centered, _ = objective.bradley_terry_loss(jnp.asarray(s_c), jnp.asarray(s_r), jnp.asarray(margin), center=0.01)
        trl = np.mean(-_log_sigmoid(s_c - s_r - margin)) + 0.01 * np.mean((s_c + s_r) ** 2)
        assert float(np.mean(np.asarray(centered))) == pytest.approx(trl, rel=1e-12)


# ------------------------------------------------------------------------------------------ TRL golden values
# What TRL 1.16 does (tests/fixtures/README.md#trl-preference-losses): DPO sums the completion's per-token log-probs;
# its "ipo" divides each log-ratio pi - ref by that completion's token count (completion_mask.sum(1)), so our
# dpo_loss gets per-token means there; its "sigmoid" ignores label_smoothing, and cDPO is CPOTrainer's conservative
# sigmoid on the log-ratios; SimPO is CPOTrainer.cpo_loss on masked per-token means. Each fixture case names the
# dpo_loss / simpo_loss arguments ("ours") that must reproduce it.

TRL_FIXTURE = Path(__file__).parent / "fixtures" / "trl_preference.json"
TRL_CASES = ("dpo_sigmoid", "dpo_sigmoid_trl_ls0.1", "dpo_ipo", "cdpo_ls0.1", "dpo_sigmoid_tokens", "dpo_ipo_tokens",
             "simpo", "simpo_ls0.1", "simpo_tokens")
SEQ_KEYS = ("chosen", "rejected", "ref_chosen", "ref_rejected")


@pytest.fixture(scope="module")
def trl_golden():
    return json.loads(TRL_FIXTURE.read_text())


def _trl_problem(doc, name):
    """(mean-loss function of JAX arrays, the names of its arguments, their float64 values, per-pair function or
    None) for one fixture case."""
    case, inputs = doc["cases"][name], doc["inputs"]
    ours = case["ours"]
    if name.startswith("simpo_tokens"):
        labels = np.asarray(case["labels"])[:, 1:]  # CPOTrainer's padded [chosen; rejected] labels, shifted
        keep = labels != -100
        n = labels.shape[0] // 2

        def mean_loss(logits):
            logps = jax.nn.log_softmax(logits[:, :-1], axis=-1)
            token = jnp.take_along_axis(logps, np.where(keep, labels, 0)[..., None], axis=-1)[..., 0]
            avg = (token * keep).sum(1) / keep.sum(1)
            return objective.simpo_loss(avg[:n], avg[n:], **ours)[0].mean()
        return mean_loss, ("logits",), [inputs["simpo_tokens"]["logits"]], None
    if name.startswith("simpo"):
        keys = ("avg_chosen", "avg_rejected")
        per_pair = lambda c, r: objective.simpo_loss(c, r, **ours)[0]
        return (lambda *a: per_pair(*a).mean()), keys, [inputs["simpo_pairs"][k] for k in keys], per_pair
    if name.endswith("_tokens"):
        tokens = inputs["dpo_tokens"]
        completion = np.asarray(tokens["completion_mask"])
        shifted = completion[:, 1:]  # the mask on next-token log-probs [2B, T-1]
        count = completion.sum(1) if ours["loss_type"] == "ipo" else 1.0  # TRL: completion_mask.sum(1)
        n = completion.shape[0] // 2

        def mean_loss(policy, ref):
            pi, rf = (policy * shifted).sum(1) / count, (ref * shifted).sum(1) / count
            return objective.dpo_loss(pi[:n], pi[n:], rf[:n], rf[n:], **ours)[0].mean()
        keys = ("policy_token_logps", "ref_token_logps")
        return mean_loss, keys, [tokens[k] for k in keys], None
    per_pair = lambda *a: objective.dpo_loss(*a, **ours)[0]
    return (lambda *a: per_pair(*a).mean()), SEQ_KEYS, [inputs["dpo_pairs"][k] for k in SEQ_KEYS], per_pair


def _close(actual, golden, rtol, floor, what):
    """rtol, plus an absolute floor at `floor` times the array's largest magnitude (float32 flushes exp(-250) to 0;
    float64 runs with floor 0, so even the saturated tails, e.g. a loss of 2.7e-109, agree to rtol)."""
    golden = np.asarray(golden, np.float64)
    atol = floor * float(np.max(np.abs(golden)))
    np.testing.assert_allclose(np.asarray(actual, np.float64), golden, rtol=rtol, atol=atol, err_msg=what)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", TRL_CASES)
def test_losses_and_grads_match_trl(trl_golden, name, dtype):
    """Our per-pair losses, their mean, and d(mean)/d(inputs) against TRL's (torch float64, autograd)."""
    case = trl_golden["cases"][name]
    mean_loss, keys, values, per_pair = _trl_problem(trl_golden, name)
    rtol, floor = (1e-12, 0.0) if dtype == "float64" else (1e-5, 1e-6)  # measured: 9e-16 and 3.3e-7 at worst
    with jax.enable_x64(dtype == "float64"):
        args = [jnp.asarray(np.asarray(v), dtype) for v in values]
        np.testing.assert_array_equal(np.asarray(args[0], np.float64), np.asarray(values[0]))  # exact in float32
        loss, grads = jax.value_and_grad(mean_loss, argnums=tuple(range(len(args))))(*args)
        assert loss.dtype == jnp.dtype(dtype)
        _close(loss, case["loss"], rtol, floor, f"{name} mean loss")
        for key, grad in zip(keys, grads):
            _close(grad, case["grads"][key], rtol, floor, f"{name} d loss / d {key}")
        if per_pair is not None:
            _close(per_pair(*args), case["losses"], rtol, floor, f"{name} per-pair losses")


def test_trl_fixture_pins_the_normalisation(trl_golden):
    """The token cases really exercise TRL's sum (DPO sigmoid) vs per-token mean (IPO, SimPO): the completions have
    different lengths, IPO's golden is not reproduced from sums, and SimPO's averages are the masked means."""
    doc = trl_golden
    assert doc["versions"]["trl"] == "1.16.0"
    assert doc["cases"]["dpo_sigmoid_trl_ls0.1"]["loss"] == doc["cases"]["dpo_sigmoid"]["loss"]  # smoothing ignored
    completion = np.asarray(doc["inputs"]["dpo_tokens"]["completion_mask"])
    assert len(set(completion.sum(1))) > 3
    tokens = doc["inputs"]["dpo_tokens"]
    sums = [(np.asarray(tokens[k]) * completion[:, 1:]).sum(1) for k in ("policy_token_logps", "ref_token_logps")]
    n = completion.shape[0] // 2
    with jax.enable_x64():
        unnormalised = objective.dpo_loss(sums[0][:n], sums[0][n:], sums[1][:n], sums[1][n:], beta=0.1,
                                          loss_type="ipo")[0].mean()
    assert abs(float(unnormalised) - doc["cases"]["dpo_ipo_tokens"]["loss"]) > 1.0
    case = doc["cases"]["simpo_tokens"]
    logits = np.asarray(doc["inputs"]["simpo_tokens"]["logits"])[:, :-1]
    labels = np.asarray(case["labels"])[:, 1:]
    keep = labels != -100
    logps = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    token = np.take_along_axis(logps, np.where(keep, labels, 0)[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose((token * keep).sum(1) / keep.sum(1), case["avg_logps"], rtol=1e-12)

"""The PPO objective against float64 NumPy references written as plain loops: per-token reward placement, GAE over
masked runs at different offsets (early ends, padding, a one-token completion, an empty row, a gap), TRL's masked
whitening (unbiased variance), the clipped value loss on both sides of the clip, the KL estimators, score
normalisation, and the host-side running moments against np.mean / np.var of everything seen."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm46_jax.recipes.rl.objective import kl_k3
from glm46_jax.recipes.rl.ppo import objective

T = 10
# (start, length) of each row's completion run: a prompt of start + 1 tokens, then length completion tokens, padding
RUNS = [(2, 7), (0, 10), (5, 1), (1, 3), (0, 0), (6, 4)]


def _mask(runs=RUNS, t=T):
    mask = np.zeros((len(runs), t))
    for row, (start, n) in enumerate(runs):
        mask[row, start:start + n] = 1.0
    return mask


def _np_gae(rewards, values, mask, gamma, lam):
    """Textbook GAE over the row's masked positions in order (the episode), V = 0 after the last one."""
    adv = np.zeros_like(rewards)
    for row in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[row, t] > 0]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(steps):
            delta = rewards[row, t] + gamma * next_value - values[row, t]
            adv[row, t] = delta + gamma * lam * next_adv
            next_value, next_adv = values[row, t], adv[row, t]
    return adv, (adv + values) * mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (1.0, 0.95)])
def test_gae_matches_numpy_loop(gamma, lam):
    rng = np.random.default_rng(0)
    mask = _mask()
    # rewards and values are nonzero everywhere: whatever sits outside the mask must not leak in
    rewards, values = rng.normal(size=mask.shape), rng.normal(size=mask.shape)
    want_adv, want_ret = _np_gae(rewards, values, mask, gamma, lam)
    with jax.enable_x64():
        adv, ret = jax.jit(objective.gae)(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma, lam)
        np.testing.assert_allclose(np.asarray(adv), want_adv, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(ret), want_ret, rtol=1e-12, atol=1e-12)
    assert np.all(np.asarray(adv)[mask == 0] == 0) and np.all(np.asarray(ret)[mask == 0] == 0)
    adv32, _ = objective.gae(jnp.asarray(rewards, jnp.float32), jnp.asarray(values, jnp.bfloat16),
                             jnp.asarray(mask, jnp.float32), gamma, lam)
    assert adv32.dtype == jnp.float32
    if gamma == 1.0 and lam == 1.0:  # Monte Carlo: the rewards still to come minus the value
        to_go = np.cumsum((rewards * mask)[:, ::-1], axis=1)[:, ::-1]
        np.testing.assert_allclose(want_adv, (to_go - values) * mask, atol=1e-12)


def test_gae_hand_made_trajectory():
    # one row: prompt of 3 tokens (mask from 2), completion of 3, then 2 pads; the score 1 arrives at the last token
    mask = np.array([[0, 0, 1, 1, 1, 0, 0]], float)
    rewards = np.array([[9, 9, 0, 0, 1, 9, 9]], float)
    values = np.array([[9, 9, 0.5, 0.25, 0.75, 9, 9]], float)
    gamma, lam = 0.5, 0.5
    d4 = 1 - 0.75
    d3 = 0 + gamma * 0.75 - 0.25
    d2 = 0 + gamma * 0.25 - 0.5
    a4, a3 = d4, d3 + gamma * lam * d4
    a2 = d2 + gamma * lam * a3
    adv, ret = objective.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), [[0, 0, a2, a3, a4, 0, 0]], atol=1e-6)
    np.testing.assert_allclose(np.asarray(ret), [[0, 0, a2 + 0.5, a3 + 0.25, a4 + 0.75, 0, 0]], atol=1e-6)


def test_gae_single_token_and_gap():
    # a one-token completion: A = r - V; a gap (unmasked tokens between two turns) is skipped, not an episode end
    mask = np.array([[0, 0, 0, 1, 0], [1, 1, 0, 0, 1]], float)
    rewards = np.array([[5, 5, 5, 2, 5], [0.5, 0, 7, 7, 1]], float)
    values = np.array([[3, 3, 3, 0.5, 3], [0.1, 0.2, 9, 9, 0.3]], float)
    with jax.enable_x64():
        adv, _ = objective.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), 0.9, 0.8)
    want, _ = _np_gae(rewards, values, mask, 0.9, 0.8)
    np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-12)
    assert float(adv[0, 3]) == pytest.approx(2 - 0.5)
    assert float(adv[1, 1]) == pytest.approx(0 + 0.9 * 0.3 - 0.2 + 0.9 * 0.8 * (1 - 0.3))


def test_token_rewards_placement_with_kl():
    rng = np.random.default_rng(1)
    mask = _mask()
    score = rng.normal(size=len(RUNS))
    kl = rng.normal(size=mask.shape)
    coef = 0.05
    want = np.zeros_like(mask)
    for row, (start, n) in enumerate(RUNS):
        for t in range(start, start + n):
            want[row, t] = -coef * kl[row, t]
        if n:
            want[row, start + n - 1] += score[row]
    with jax.enable_x64():
        got = jax.jit(objective.token_rewards)(jnp.asarray(score), jnp.asarray(mask), jnp.asarray(kl), coef)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-15)
        plain = objective.token_rewards(jnp.asarray(score), jnp.asarray(mask))
    last = {row: start + n - 1 for row, (start, n) in enumerate(RUNS) if n}
    for row in range(len(RUNS)):
        expect = np.zeros(T)
        if row in last:
            expect[last[row]] = score[row]
        np.testing.assert_array_equal(np.asarray(plain)[row], expect)


def _np_whiten(x, mask, shift_mean=True):
    vals = x[mask > 0]
    mean, var = vals.mean(), vals.var(ddof=1)
    out = (x - mean) / np.sqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out * mask


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_numpy(shift_mean):
    rng = np.random.default_rng(2)
    mask = _mask()
    x = rng.normal(3.0, 2.0, mask.shape)
    with jax.enable_x64():
        got = jax.jit(objective.whiten, static_argnames="shift_mean")(jnp.asarray(x), jnp.asarray(mask),
                                                                      shift_mean=shift_mean)
        np.testing.assert_allclose(np.asarray(got), _np_whiten(x, mask, shift_mean), rtol=1e-12, atol=1e-12)
    if shift_mean:
        vals = np.asarray(got)[mask > 0]
        assert vals.mean() == pytest.approx(0.0, abs=1e-9) and vals.std(ddof=1) == pytest.approx(1.0, rel=1e-6)
    one = np.zeros_like(mask)
    one[0, 3] = 1.0  # a single masked entry: TRL divides by zero here, this gives 0
    assert np.all(np.asarray(objective.whiten(jnp.asarray(x), jnp.asarray(one))) == 0)


def _np_value_loss(v, old, ret, mask, clip):
    total, clipped_count, n = 0.0, 0, 0
    for i in range(v.shape[0]):
        for t in range(v.shape[1]):
            if mask[i, t] == 0:
                continue
            unclipped = (v[i, t] - ret[i, t]) ** 2
            vc = min(max(v[i, t], old[i, t] - clip), old[i, t] + clip)
            clipped = (vc - ret[i, t]) ** 2
            total += max(unclipped, clipped)
            clipped_count += clipped > unclipped
            n += 1
    return 0.5 * total / n, clipped_count / n


def test_value_loss_clip_on_both_sides():
    clip = 0.2
    # old, new, return: above the clip and return beyond it (clipped term active), below likewise, inside the clip,
    # outside the clip but moving toward the return (unclipped term active), and a masked-out outlier
    old = np.array([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    new = np.array([[1.0, -1.0, 0.1, 1.0, -1.0, 50.0]])
    ret = np.array([[2.0, -2.0, 0.5, 0.5, -0.5, 0.0]])
    mask = np.array([[1, 1, 1, 1, 1, 0]], float)
    loss, stats = objective.value_loss(jnp.asarray(new), jnp.asarray(old), jnp.asarray(ret), jnp.asarray(mask), clip)
    want = 0.5 * np.mean([(0.2 - 2) ** 2, (-0.2 + 2) ** 2, 0.4 ** 2, 0.5 ** 2, 0.5 ** 2])
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert float(stats["vf_clipfrac"]) == pytest.approx(2 / 5)

    rng = np.random.default_rng(3)
    mask = _mask()
    old, new, ret = (rng.normal(size=mask.shape) for _ in range(3))
    want_loss, want_frac = _np_value_loss(new, old, ret, mask, clip)
    assert 0 < want_frac < 1
    with jax.enable_x64():
        loss, stats = jax.jit(objective.value_loss)(jnp.asarray(new), jnp.asarray(old), jnp.asarray(ret),
                                                    jnp.asarray(mask), clip)
        assert float(loss) == pytest.approx(want_loss, rel=1e-12)
        assert float(stats["vf_clipfrac"]) == pytest.approx(want_frac, rel=1e-12)


def test_kl_penalty_kinds():
    rng = np.random.default_rng(4)
    logp, ref = rng.normal(-2, 1, (3, 5)), rng.normal(-2, 1, (3, 5))
    d = logp - ref
    with jax.enable_x64():
        args = jnp.asarray(logp), jnp.asarray(ref)
        np.testing.assert_allclose(np.asarray(objective.kl_penalty(*args, "k1")), d, rtol=1e-12)
        np.testing.assert_allclose(np.asarray(objective.kl_penalty(*args, "k3")), np.exp(-d) + d - 1, rtol=1e-12)
        np.testing.assert_array_equal(np.asarray(objective.kl_penalty(*args, "k3")), np.asarray(kl_k3(*args)))
        np.testing.assert_allclose(np.asarray(objective.kl_penalty(*args, "abs")), np.abs(d), rtol=1e-12)
        np.testing.assert_allclose(np.asarray(objective.kl_penalty(*args, "mse")), 0.5 * d ** 2, rtol=1e-12)
    with pytest.raises(ValueError, match="KL estimator"):
        objective.kl_penalty(*args, "full")


def test_normalize_scores():
    score = np.array([-10.0, -1.0, 0.0, 2.0, 30.0])
    with jax.enable_x64():
        got = objective.normalize_scores(jnp.asarray(score), 1.0, 2.0)
        np.testing.assert_allclose(np.asarray(got), (score - 1.0) / (2.0 + 1e-8), rtol=1e-12)
        clipped = jax.jit(objective.normalize_scores)(jnp.asarray(score), 1.0, 2.0, 3.0)
        np.testing.assert_allclose(np.asarray(clipped), np.clip((score - 1.0) / (2.0 + 1e-8), -3, 3), rtol=1e-12)


def test_running_moments_match_numpy_and_resume_bit_identically():
    rng = np.random.default_rng(5)
    batches = [rng.normal(4.0, 3.0, 7), rng.normal(-1.0, 0.5, (2, 3)), np.array([12.0]), np.zeros(0),
               rng.normal(0.0, 10.0, 33).astype(np.float32)]
    moments, seen = objective.RunningMoments(), []
    for batch in batches:
        moments = moments.update(batch)
        seen.append(np.asarray(batch, np.float64).reshape(-1))
        if not sum(s.size for s in seen):
            continue
        everything = np.concatenate(seen)
        assert moments.count == everything.size
        assert moments.mean == pytest.approx(everything.mean(), rel=1e-12, abs=1e-12)
        assert moments.var == pytest.approx(everything.var(), rel=1e-12)
        assert moments.std == pytest.approx(everything.std(), rel=1e-12)

    resumed = objective.RunningMoments()
    for i, batch in enumerate(batches):
        if i == 2:  # checkpoint and restore through JSON mid-run
            resumed = objective.RunningMoments.from_dict(json.loads(json.dumps(resumed.to_dict())))
        resumed = resumed.update(batch)
    assert resumed == moments
    assert all(type(v) in (int, float) for v in moments.to_dict().values())


def test_adaptive_kl_coefficient_by_hand():
    """Ziegler et al.'s controller (TRL's AdaptiveKLController.update): e_t = clip(KL / target - 1, -0.2, 0.2),
    beta <- beta (1 + e_t n / horizon); numbers worked out by hand."""
    # KL at the target: unchanged
    assert objective.adaptive_kl_coef(0.05, kl=6.0, target=6.0, samples=256, horizon=10_000) == 0.05
    # 10% above: e = 0.1, n / horizon = 0.0256 -> 0.05 * 1.00256
    assert objective.adaptive_kl_coef(0.05, kl=6.6, target=6.0, samples=256, horizon=10_000) == pytest.approx(
        0.050128, rel=1e-12)
    # far above and far below: the error is clipped to +-0.2; a horizon of one rollout moves by 20% per rollout
    assert objective.adaptive_kl_coef(0.1, kl=60.0, target=6.0, samples=8, horizon=8) == pytest.approx(0.12, rel=1e-12)
    assert objective.adaptive_kl_coef(0.1, kl=0.0, target=6.0, samples=8, horizon=8) == pytest.approx(0.08, rel=1e-12)
    # 5% below with n / horizon = 0.5: 0.2 * (1 - 0.025)
    assert objective.adaptive_kl_coef(0.2, kl=1.9, target=2.0, samples=50, horizon=100) == pytest.approx(
        0.195, rel=1e-12)

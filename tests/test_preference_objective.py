"""The preference losses against float64 NumPy written from the papers' formulas (DPO eq. 7 with cDPO's label
smoothing, IPO eq. 17, SimPO eq. 6, Bradley-Terry), values and gradients w.r.t. the log-probs. TRL's golden values
(issue 32) are still to come from the fixtures' torch venv."""

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

"""The PPO objective for language-model RL as pure functions over token rows, plus host-side score statistics.

    rewards = token_rewards(score, mask, kl=kl_penalty(logp, ref_logp, "k1"), kl_coef=0.05)   # [b, t]
    adv, returns = gae(rewards, values, mask, gamma=1.0, lam=0.95)                             # [b, t] each
    adv = whiten(adv, mask)
    loss, stats = value_loss(new_values, values, returns, mask, clip=0.2)
    kl_coef = adaptive_kl_coef(kl_coef, kl=2.3, target=6.0, samples=512, horizon=10_000)      # after each rollout

A row is prompt + completion; `mask` [b, t] is 1 at the positions that predict a completion token (one contiguous run
per row, starting after the prompt, ending before the padding; rollout.trajectory_rows), or in an agentic episode
the positions of the model's turns (the tool turns between them unmasked). The policy's action at position
t is its completion token, so the rollout of a row is its masked positions in order, and the episode ends after the
last one.
  token_rewards  r_t = -kl_coef * kl_t on masked positions, plus the sequence score at the row's last masked position
                 (the "KL in the reward" scheme of Ziegler et al. 2019 / TRL, with kl = logp - ref_logp: k1)
  gae            delta_t = r_t + gamma V_next - V_t,  A_t = delta_t + gamma lam A_next, over masked positions only;
                 after the last masked position V_next = A_next = 0. Unmasked positions get A = 0 and are skipped
                 (not reset): a gap inside a row (e.g. tool output between turns) is transparent, as in verl.
                 returns = A + V on masked positions (0 elsewhere), the critic's target.
  whiten         (x - mean) / sqrt(var + eps) over the masked entries of the whole batch, with the unbiased
                 (Bessel-corrected, n / (n - 1)) variance, as TRL's masked_whiten / masked_var (trl/core.py)
  value_loss     0.5 * masked mean of max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)  (TRL, PPO2)
The scores themselves can be normalised by running statistics first: RunningMoments (host, NumPy) keeps count, mean
and population variance over every score seen, and normalize_scores((s - mean) / (std + eps), clipped).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from glm46_jax.recipes.rl.objective import kl_k3

KL_KINDS = ("k1", "k3", "abs", "mse")


def _float(x: Array) -> Array:
    """At least float32 (bf16 log-probs and values are promoted; float64 stays float64 under x64)."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def kl_penalty(logp: Float[Array, "b t"], ref_logp: Float[Array, "b t"], kind: str = "k1") -> Float[Array, "b t"]:
    """Per-token KL(policy || reference) estimate on the policy's own samples, d = logp - ref_logp:
    k1 d (unbiased, can be negative), k3 exp(-d) + d - 1 (rl.objective.kl_k3), abs |d|, mse d^2 / 2 (k2)."""
    if kind not in KL_KINDS:
        raise ValueError(f"KL estimator {kind!r}: one of {KL_KINDS}")
    if kind == "k3":
        return kl_k3(logp, ref_logp)
    d = _float(logp) - _float(ref_logp)
    return d if kind == "k1" else jnp.abs(d) if kind == "abs" else 0.5 * d * d


def token_rewards(score: Float[Array, "b"], mask: Float[Array, "b t"], kl: Float[Array, "b t"] | None = None,
                  kl_coef: float = 0.0) -> Float[Array, "b t"]:
    """Per-token rewards: `score` at each row's last masked position, minus kl_coef * kl on every masked position.
    A row with an empty mask gets no reward at all."""
    mask = _float(mask)
    t = mask.shape[1]
    last = t - 1 - jnp.argmax(mask[:, ::-1] > 0, axis=1)  # the last masked position (t - 1 - first from the end)
    has = mask.max(axis=1) > 0
    at_last = jax.nn.one_hot(last, t, dtype=mask.dtype) * has[:, None]
    rewards = at_last * _float(score)[:, None]
    if kl is not None:
        rewards = rewards - kl_coef * _float(kl) * mask
    return rewards


def gae(rewards: Float[Array, "b t"], values: Float[Array, "b t"], mask: Float[Array, "b t"], gamma: float,
        lam: float) -> tuple[Float[Array, "b t"], Float[Array, "b t"]]:
    """Generalised advantage estimation (Schulman et al. 2016) over each row's masked positions, one reversed scan
    over t; returns (advantages, returns), both 0 outside the mask. See the module docstring."""
    rewards, values, mask = _float(rewards), _float(values), _float(mask)
    dtype = jnp.result_type(rewards, values)
    rewards, values, mask = rewards.astype(dtype), values.astype(dtype), mask.astype(dtype)

    def step(carry, xs):
        next_value, next_adv = carry
        r, v, m = xs
        adv = r + gamma * next_value - v + gamma * lam * next_adv
        on = m > 0
        # an unmasked position passes the carry through untouched (padding after the run, the prompt before it)
        return (jnp.where(on, v, next_value), jnp.where(on, adv, next_adv)), jnp.where(on, adv, 0.0)

    zeros = jnp.zeros(rewards.shape[0], dtype)
    _, adv = jax.lax.scan(step, (zeros, zeros), (rewards.T, values.T, mask.T), reverse=True)
    adv = adv.T
    return adv, (adv + values) * mask


def _masked_mean(x: Array, mask: Array) -> Array:
    return jnp.sum(x * mask) / jnp.maximum(mask.sum(), 1.0)


def whiten(x: Float[Array, "b t"], mask: Float[Array, "b t"], shift_mean: bool = True,
           eps: float = 1e-8) -> Float[Array, "b t"]:
    """Masked whitening over the whole batch, TRL's masked_whiten: (x - mean) * rsqrt(var + eps) with the unbiased
    variance (sum of squares / (n - 1)); shift_mean=False adds the mean back (scale only, as TRL whitens rewards).
    Unlike TRL, positions outside the mask come out 0, and n <= 1 gives var 0 instead of TRL's division by zero."""
    x, mask = _float(x), _float(mask)
    n = mask.sum()
    mean = _masked_mean(x, mask)
    var = _masked_mean((x - mean) ** 2, mask) * (n / jnp.maximum(n - 1.0, 1.0))
    out = (x - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def value_loss(values: Float[Array, "b t"], old_values: Float[Array, "b t"], returns: Float[Array, "b t"],
               mask: Float[Array, "b t"], clip: float) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The clipped critic loss 0.5 * masked mean of max((V - R)^2, (V_clipped - R)^2), with V_clipped the new
    value kept within `clip` of the rollout's; vf_clipfrac is the share of masked tokens where the clipped term is
    the larger (its gradient is cut off)."""
    values, old_values, returns, mask = _float(values), _float(old_values), _float(returns), _float(mask)
    unclipped = (values - returns) ** 2
    clipped = (jnp.clip(values, old_values - clip, old_values + clip) - returns) ** 2
    loss = 0.5 * _masked_mean(jnp.maximum(unclipped, clipped), mask)
    return loss, {"vf_clipfrac": _masked_mean((clipped > unclipped).astype(mask.dtype), mask)}


def normalize_scores(score: Float[Array, "b"], mean: float, std: float, clip: float | None = None,
                     eps: float = 1e-8) -> Float[Array, "b"]:
    """(score - mean) / (std + eps), then clipped to [-clip, clip] when `clip` is given (mean and std from
    RunningMoments; pass mean 0 and std 1 to clip raw scores only)."""
    out = (_float(score) - mean) / (std + eps)
    return out if clip is None else jnp.clip(out, -clip, clip)


@dataclasses.dataclass(frozen=True)
class RunningMoments:
    """Count, mean and population variance of every score seen so far, on the host in float64. Its state is three
    plain Python numbers (to_dict / from_dict), so a resumed run continues bit-identically."""

    count: int = 0
    mean: float = 0.0
    var: float = 0.0

    @property
    def std(self) -> float:
        return float(np.sqrt(self.var))

    def update(self, batch) -> RunningMoments:
        """These moments merged with those of `batch` (any shape; all of it counts), by Chan et al.'s parallel
        update: M2 = M2_a + M2_b + delta^2 n_a n_b / n, with M2 = var * count."""
        x = np.asarray(batch, np.float64).reshape(-1)
        n_b = x.size
        if n_b == 0:
            return self
        mean_b, var_b = float(x.mean()), float(x.var())
        n = self.count + n_b
        delta = mean_b - self.mean
        mean = self.mean + delta * n_b / n
        m2 = self.var * self.count + var_b * n_b + delta * delta * self.count * n_b / n
        return RunningMoments(count=int(n), mean=float(mean), var=float(m2 / n))

    def to_dict(self) -> dict[str, float | int]:
        return {"count": self.count, "mean": self.mean, "var": self.var}

    @classmethod
    def from_dict(cls, d: dict) -> RunningMoments:
        return cls(count=int(d["count"]), mean=float(d["mean"]), var=float(d["var"]))


def adaptive_kl_coef(coef: float, kl: float, target: float, samples: int, horizon: int) -> float:
    """The next KL coefficient of the adaptive controller (Ziegler et al. 2019, InstructGPT; TRL's
    `AdaptiveKLController`): coef x (1 + clip(kl / target - 1, -0.2, 0.2) x samples / horizon), where `kl` is the
    measured KL per completion (the k1 log-ratio summed over its tokens, averaged over the rollout's `samples`
    completions). Above the target the penalty grows, below it shrinks, by at most 20% per horizon of samples."""
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return float(coef * (1.0 + error * samples / horizon))

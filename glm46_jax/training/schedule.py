"""The lr schedule as a formula whose numbers are step inputs, and the optax transform that applies it.

    schedule = Schedule("warmup_cosine", lr=2.5e-4, end_lr=2.5e-5, warmup=2000, total=100_000)
    schedule(count)                          # an optax schedule: the numbers are constants of the program
    schedule.at(count, schedule.inputs())    # the same value (within a few float32 ulps), the numbers passed in

Why inputs: a schedule's numbers compiled into the train step made every (lr, end_lr, warmup, length) a new program,
so runs that differ only there (an lr sweep, a longer run, a resume with another length) compiled the same step
again. The step (training/step.py) passes `inputs()` to the optimizer's update as `lr_inputs`; only the
schedule's kind (and its number of cosine cycles) shapes the program. The values are optax's schedules'
(`optax.warmup_cosine_decay_schedule`, `join_schedules`, `linear_schedule`, `sgdr_schedule`; tests/test_optim.py),
written here because optax's take their step counts as Python ints.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("warmup_cosine", "wsd", "cosine_restarts", "constant")  # the kinds


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Warmup 0 -> lr over `warmup` steps, then per `kind` (optim.make_schedule's docstring):
    warmup_cosine    cosine lr -> end_lr ending at `total` (at least warmup + 1), flat after;
    wsd              lr until total - wsd_decay, then linear to end_lr over wsd_decay steps, flat after;
    cosine_restarts  `restarts` equal cycles of total // restarts steps, each a warmup_cosine (later ones warm up
                     from end_lr);
    constant         lr after the warmup."""
    kind: str
    lr: float
    end_lr: float = 0.0
    warmup: int = 0
    total: int = 1
    wsd_decay: int = 1
    restarts: int = 1  # shapes the program (one branch per cycle): not an input

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule kind {self.kind!r}: expected one of {SCHEDULES}")

    def inputs(self) -> dict[str, jax.Array]:
        """The numbers a jitted step takes (float32 scalars); the kind and `restarts` stay in the program."""
        return {k: jnp.float32(v) for k, v in self.numbers().items()}

    def numbers(self) -> dict[str, float]:
        """The formula's numbers, worked out in Python floats where optax's schedules work them out (with them as
        constants the values are optax's to the last bit)."""
        w, total = self.warmup, self.total
        cycle = total // self.restarts if self.kind == "cosine_restarts" else max(total, w + 1)
        alpha = 0.0 if self.lr == 0.0 else self.end_lr / self.lr
        return {"lr": self.lr, "end_lr": self.end_lr, "warmup": w, "decay": cycle - w, "cycle": cycle,
                "alpha": alpha, "one_minus_alpha": 1 - alpha, "lr_minus_end": self.lr - self.end_lr,
                "wsd_start": total - self.wsd_decay, "wsd_decay": self.wsd_decay}

    def __call__(self, count) -> jax.Array:
        return self.at(count)

    def at(self, count, inputs: dict[str, jax.Array] | None = None) -> jax.Array:
        """The lr after `count` applied updates, the numbers from `inputs` (None: this schedule's own, as constants)."""
        x = self.numbers() if inputs is None else inputs
        c = jnp.asarray(count, jnp.float32)
        warm = jnp.where(c < x["warmup"], _linear(c, -x["lr"], x["lr"], x["warmup"]), x["lr"])
        if self.kind == "constant":
            return warm
        if self.kind == "wsd":
            return jnp.where(c < x["wsd_start"], warm,
                             _linear(c - x["wsd_start"], x["lr_minus_end"], x["end_lr"], x["wsd_decay"]))
        out = _warm_cosine(c, x, -x["lr"])
        for i in range(1, self.restarts if self.kind == "cosine_restarts" else 1):  # later cycles start at end_lr
            out = jnp.where(c < i * x["cycle"], out, _warm_cosine(c - i * x["cycle"], x, -x["lr_minus_end"]))
        return out


def _linear(c, span, end, steps):
    """optax.linear_schedule(end - span, end, steps) at c (optax computes its init - end as `span`); steps <= 0: the
    callers' `where` never reads it."""
    frac = 1 - jnp.clip(c, 0, steps) / jnp.maximum(steps, 1)
    return span * frac + end


def _warm_cosine(c, x, span):
    """optax.warmup_cosine_decay_schedule (its join of a linear warmup and a cosine decay) at c; `span` = the
    warmup's start - lr."""
    decay = 0.5 * (1 + jnp.cos(jnp.pi * jnp.minimum(c - x["warmup"], x["decay"]) / x["decay"]))
    cosine = x["lr"] * (x["one_minus_alpha"] * decay + x["alpha"])
    return jnp.where(c < x["warmup"], _linear(c, span, x["lr"], x["warmup"]), cosine)


def scale_by_schedule(schedule: Schedule) -> optax.GradientTransformationExtraArgs:
    """`optax.scale_by_learning_rate(schedule)` (the same state: the count of applied updates), the schedule's
    numbers taken from the update's `lr_inputs` extra argument when given (`Schedule.inputs()`)."""
    inner = optax.scale_by_learning_rate(schedule)

    def update(updates, state, params=None, *, lr_inputs=None, **extra):
        del params, extra
        step_size = -1 * schedule.at(state.count, lr_inputs)
        updates = jax.tree.map(lambda g: jnp.array(step_size, dtype=g.dtype) * g, updates)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(inner.init, update)

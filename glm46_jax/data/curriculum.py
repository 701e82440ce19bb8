"""Training phases by token budget (pre-training -> mid-training ...) and the batch iterator over them.

A phase fixes the sequence length, batch size (optionally ramped), domain mixture, RoPE theta and
packing mode. Phases follow each other by cumulative token budget: with ends E_k = sum of the
budgets of phases 0..k, a step that starts with `tokens_seen` is in the first phase k with
tokens_seen < E_k. So the last batch of a phase may overshoot its budget by less than one batch,
and the next phase starts at the first step with tokens_seen >= E_k. A step consumes
rows x seq_len tokens, counted in exact Python ints.

Batch-size ramp (`BatchRamp`): over the first `ramp_tokens` tokens of its phase the batch grows
linearly from `start_rows` to the phase's `global_batch`, rounded down to a multiple of
`increment`:  rows(t) = start_rows + increment * min(n, (t * n) // ramp_tokens),
n = (global_batch - start_rows) // increment, t = tokens into the phase. Every size is a multiple
of `increment`, so the loader batches `increment` rows at a time and a step concatenates
rows / increment of them; `increment` must divide among the data-loading processes (and should be
a multiple of the mesh's batch-sharding size, which the trainer checks).

`CurriculumIterator` state (JSON-able, see `get_state`):
    {"phase_index": k, "phase_name": str, "tokens_seen": int, "step": int, "data": grain state | None}
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from glm46_jax.errors import InputError
from glm46_jax.data import iterator_state, loader
from glm46_jax.data.loader import Batch, LoaderConfig, PackMode


@dataclasses.dataclass(frozen=True)
class BatchRamp:
    start_rows: int  # global rows of the phase's first step
    ramp_tokens: int  # tokens into the phase at which the full batch is reached
    increment: int  # rows; every batch size of the phase is a multiple of it


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    tokens: int  # token budget
    seq_len: int
    global_batch: int  # rows (after the ramp, if any)
    mixture: Mapping[str, float]  # domain -> weight (a share of tokens; need not sum to 1; 0 = unused)
    rope_theta: float
    pack: PackMode = "concat"  # "concat" (pre-training) | "best_fit" (mid-training: documents kept whole)
    batch_ramp: BatchRamp | None = None

    def __post_init__(self):
        def bad(field: str, why: str):
            raise InputError(f"data.phases.{self.name}.{field}={getattr(self, field)!r}: {why}; set "
                             f"--config.data.phases.{self.name}.{field}")

        if self.tokens < 1:
            bad("tokens", "must be a positive token budget")
        if self.seq_len < 1:
            bad("seq_len", "must be >= 1")
        if self.global_batch < 1:
            bad("global_batch", "must be >= 1 row")
        if self.pack not in loader.PACK_MODES:
            bad("pack", f"must be one of {loader.PACK_MODES}")
        if not self.mixture or not any(w > 0 for w in self.mixture.values()):
            bad("mixture", "needs at least one domain with a positive weight")
        if self.rope_theta <= 0:
            bad("rope_theta", "must be positive")
        r = self.batch_ramp
        if r is not None and not (0 < r.increment and 0 < r.start_rows < self.global_batch and r.ramp_tokens > 0
                                  and r.start_rows % r.increment == 0 and self.global_batch % r.increment == 0):
            bad("batch_ramp", f"needs 0 < start_rows < global_batch={self.global_batch}, ramp_tokens > 0, and "
                "start_rows and global_batch multiples of increment")

    @property
    def rows_unit(self) -> int:
        """The loader's batch (global rows): every step's batch is a multiple of it."""
        return self.global_batch if self.batch_ramp is None else self.batch_ramp.increment

    def rows_at(self, tokens_into_phase: int) -> int:
        """Global batch rows of a step that starts `tokens_into_phase` tokens after the phase began."""
        r = self.batch_ramp
        if r is None:
            return self.global_batch
        n = (self.global_batch - r.start_rows) // r.increment
        return r.start_rows + r.increment * min(n, (max(tokens_into_phase, 0) * n) // r.ramp_tokens)


@dataclasses.dataclass(frozen=True)
class Curriculum:
    phases: tuple[Phase, ...]

    def __post_init__(self):
        object.__setattr__(self, "phases", tuple(self.phases))
        if not self.phases:
            raise InputError("data.phases is empty: a run needs at least one curriculum phase")
        names = [p.name for p in self.phases]
        if len(set(names)) != len(names):
            raise InputError(f"data.phases: names {names} must be unique (they identify checkpoints)")
        for prev, nxt in itertools.pairwise(self.phases):
            # The last step of `prev` overshoots its end by < one batch; a shorter phase could be skipped.
            if nxt.tokens < prev.global_batch * prev.seq_len:
                raise InputError(f"data.phases.{nxt.name}.tokens={nxt.tokens}: less than one batch of the "
                                 f"previous phase ({prev.global_batch * prev.seq_len} tokens); raise it")

    @property
    def ends(self) -> tuple[int, ...]:
        """Cumulative token budgets: phase k covers steps starting in [ends[k-1], ends[k])."""
        return tuple(itertools.accumulate(p.tokens for p in self.phases))

    @property
    def total_tokens(self) -> int:
        return self.ends[-1]

    def phase_at(self, tokens_seen: int) -> int:
        """Index of the phase a step starting after `tokens_seen` tokens belongs to."""
        if not 0 <= tokens_seen < self.total_tokens:
            raise ValueError(f"tokens_seen={tokens_seen} is outside the curriculum's [0, {self.total_tokens})")
        return bisect.bisect_right(self.ends, tokens_seen)

    def phase_start(self, index: int) -> int:
        return self.ends[index - 1] if index else 0


class CurriculumIterator:
    """Yields (phase, batch) until the curriculum's token budget is spent; checkpointable exactly.

    `batch` is this process's rows of the step (see `loader.training_batches`); turn it into global
    arrays with `loader.to_global`. On a phase switch the pipeline is rebuilt for the new phase and
    every domain continues where the last phase left it (`iterator_state.carry_domain_positions`).
    """

    def __init__(self, curriculum: Curriculum, cfg: LoaderConfig, state: Mapping[str, Any] | None = None):
        self.curriculum, self.cfg = curriculum, cfg
        self.process_count = cfg.processes[1]
        for p in curriculum.phases:
            if p.rows_unit % self.process_count:
                raise InputError(f"data.phases.{p.name}: batches grow in units of {p.rows_unit} rows, which does not "
                                 f"split over {self.process_count} data-loading processes")
        self.phase_index, self.tokens_seen, self.step = 0, 0, 0
        self._data: grain.DatasetIterator | None = None
        if state is not None:
            self.set_state(state)

    @property
    def phase(self) -> Phase:
        return self.curriculum.phases[self.phase_index]

    def __iter__(self) -> CurriculumIterator:
        return self

    def __next__(self) -> tuple[Phase, Batch]:
        if self.tokens_seen >= self.curriculum.total_tokens:
            raise StopIteration
        index = self.curriculum.phase_at(self.tokens_seen)
        if self._data is None or index != self.phase_index:
            self._enter(index)
        phase = self.phase
        rows = phase.rows_at(self.tokens_seen - self.curriculum.phase_start(index))
        parts = [next(self._data) for _ in range(rows // phase.rows_unit)]
        batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]} if len(parts) > 1 else parts[0]
        self.tokens_seen += rows * phase.seq_len
        self.step += 1
        return phase, batch

    def _pipeline(self, phase: Phase) -> grain.DatasetIterator:
        ds = loader.training_batches(self.cfg, phase.mixture, phase.seq_len, phase.rows_unit, phase.pack)
        return iter(ds)

    def _enter(self, index: int) -> None:
        fresh = self._pipeline(self.curriculum.phases[index])
        if self._data is not None:
            # A pure function of the old iterator's state, so a run resumed just before the switch
            # (holding that same state) rebuilds exactly the same pipeline position.
            carried = iterator_state.carry_domain_positions(iterator_state.to_json(self._data),
                                                            iterator_state.to_json(fresh))
            iterator_state.restore(fresh, carried)
            self.close()
        self._data, self.phase_index = fresh, index

    def get_state(self) -> dict[str, Any]:
        return {"phase_index": self.phase_index, "phase_name": self.phase.name, "tokens_seen": self.tokens_seen,
                "step": self.step, "data": None if self._data is None else iterator_state.to_json(self._data)}

    def set_state(self, state: Mapping[str, Any]) -> None:
        index = int(state["phase_index"])
        if not 0 <= index < len(self.curriculum.phases) or self.curriculum.phases[index].name != state["phase_name"]:
            raise InputError(f"checkpointed data state is in phase {index} {state['phase_name']!r}, which this "
                             f"curriculum ({[p.name for p in self.curriculum.phases]}) does not have at that index")
        self.close()
        self.phase_index, self.tokens_seen, self.step = index, int(state["tokens_seen"]), int(state["step"])
        self._data = None
        if state.get("data") is not None:
            self._data = self._pipeline(self.phase)
            iterator_state.restore(self._data, state["data"])

    def close(self) -> None:
        """Stops the current pipeline's worker processes (if any)."""
        if self._data is not None and hasattr(self._data, "close"):
            self._data.close()


def num_steps(curriculum: Curriculum) -> int:
    """Steps that spend the whole budget (the batch ramp makes it more than tokens / batch)."""
    tokens, steps = 0, 0
    for index, phase in enumerate(curriculum.phases):
        start, end = curriculum.phase_start(index), curriculum.ends[index]
        if phase.batch_ramp is None:  # closed form: the common case, and fast for 15T-token phases
            n = -(-(end - max(tokens, start)) // (phase.global_batch * phase.seq_len)) if tokens < end else 0
            tokens, steps = tokens + n * phase.global_batch * phase.seq_len, steps + n
            continue
        while tokens < end:
            tokens += phase.rows_at(tokens - start) * phase.seq_len
            steps += 1
    return steps


def from_config(phases: Mapping[str, Mapping[str, Any]], order: Sequence[str]) -> Curriculum:
    """A Curriculum from the config's `data.phases` (name -> fields of `Phase`) in `order`.

    Token counts may be floats in the config (15e12 does not fit the int32 flag parser); they are
    rounded to exact ints here.
    """
    if sorted(order) != sorted(phases):
        raise InputError(f"data.phase_order={list(order)} must name each phase of data.phases "
                         f"({sorted(phases)}) exactly once")
    out = []
    for name in order:
        fields = dict(phases[name])
        ramp = fields.pop("batch_ramp", None)
        if ramp:
            ramp = BatchRamp(**{k: int(v) for k, v in dict(ramp).items()})
        out.append(Phase(name=name, tokens=int(fields.pop("tokens")), mixture=dict(fields.pop("mixture")),
                         batch_ramp=ramp or None, **fields))
    return Curriculum(tuple(out))

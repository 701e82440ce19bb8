"""Where the trainer's metric records go: one `Sink` interface, four sinks, one `MetricWriter` over them.

The trainer calls `MetricWriter.write(step, scalars, phase)` once per logged step (and once per evaluation); the
writer turns the values into Python floats and hands the same record to every sink the config names
(`monitor.sinks`, built by `monitor.open_writer`):
  * `JsonlSink`: run_dir/metrics.jsonl, one JSON line per record (non-finite values are null);
  * `TensorBoardSink`: run_dir/tensorboard/ event files (tensorboardX);
  * `WandbSink`: a Weights & Biases run (offline by default: run_dir/wandb/, `wandb sync` uploads it);
  * `exporter.PrometheusSink`: the process's /metrics endpoint (glm46_jax/monitoring/exporter.py).
Every sink flushes on write, so a run can be watched while it goes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol, Self


class Sink(Protocol):
    def write(self, step: int, scalars: Mapping[str, float], phase: str) -> None: ...  # values are Python floats
    def close(self) -> None: ...  # flush and release; a second call does nothing


def _json_float(value: float) -> float | None:
    # Standard JSON has no NaN/Infinity (Python's own "NaN" output breaks strict readers): use null.
    return value if math.isfinite(value) else None


class JsonlSink:
    """`run_dir/metrics.jsonl`: `{"step": step, **scalars}` per record. Truncated when opened (one fresh log per
    run, even when `run_dir` is reused) unless `append=True` (a resumed run continues its log)."""

    def __init__(self, run_dir: str, *, append: bool = False):
        os.makedirs(run_dir, exist_ok=True)
        # Not a with-block: the file stays open across writes and is closed in close().
        self._file = open(os.path.join(run_dir, "metrics.jsonl"), "a" if append else "w")  # noqa: SIM115

    def write(self, step: int, scalars: Mapping[str, float], phase: str) -> None:
        del phase  # the JSONL's phase is eval/phase_index, a scalar the trainer writes
        if self._file is None:
            return
        record = {"step": int(step), **{name: _json_float(v) for name, v in scalars.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardSink:
    """TensorBoard event files in `run_dir/tensorboard/`; non-finite values are kept as they are."""

    def __init__(self, run_dir: str):
        # Imported here: tensorboardX pulls in protobuf, which importing this module should not pay for.
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def write(self, step: int, scalars: Mapping[str, float], phase: str) -> None:
        del phase
        if self._writer is None:
            return
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, int(step))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbSink:
    """A Weights & Biases run in `run_dir/wandb/`. The run id is derived from the run dir, so a resumed run
    continues the same W&B run. mode "offline" (the default) needs no account or network: `wandb sync
    run_dir/wandb/offline-run-*` uploads it later. Non-finite values are logged as they are."""

    def __init__(self, run_dir: str, *, project: str, name: str, mode: str, config: Mapping[str, Any] | None = None):
        import wandb  # optional: only a run that names the sink needs it

        run_id = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]
        self._run = wandb.init(project=project, name=name, id=run_id, dir=run_dir, mode=mode, resume="allow",
                               config=dict(config or {}), settings=wandb.Settings(console="off", quiet=True))

    def write(self, step: int, scalars: Mapping[str, float], phase: str) -> None:
        if self._run is not None:
            self._run.log({**scalars, "phase": phase} if phase else dict(scalars), step=int(step))

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class MetricWriter:
    """Every record to every sink: `write(step, scalars, phase)` takes Python, NumPy or 0-d JAX numbers."""

    def __init__(self, sinks: Sequence[Sink]):
        self.sinks = list(sinks)

    def write(self, step: int, scalars: Mapping[str, Any], phase: str = "") -> None:
        values = {name: float(value) for name, value in scalars.items()}
        for sink in self.sinks:
            sink.write(step, values, phase)

    def close(self) -> None:
        """Close every sink (the Prometheus one first lingers, so the last record is scraped)."""
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

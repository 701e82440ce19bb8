"""Injected faults for the tests of the hang watchdog and the straggler report: a step that blocks, a slow process.

Read once from the environment variable GLM46_FAULTS (comma-separated key=value), so a test can inject a fault
into a real launch (`launch/local_multiprocess.sh`, `sbatch launch/slurm_pretrain.sbatch`) without a config
field a user could set by mistake:

    hang_at_step=N      the main thread blocks forever right before step N's dispatch
    hang_process=P      only process P hangs (default: every process)
    hang_once=PATH      hang only if PATH does not exist, and create it (a requeued rerun then completes)
    slow_process=P      process P sleeps slow_s seconds before every step (a straggler)
    slow_s=S
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

from glm46_jax.errors import InputError

ENV = "GLM46_FAULTS"


@dataclasses.dataclass(frozen=True)
class Faults:
    hang_at_step: int = 0
    hang_process: int = -1  # -1 = every process
    hang_once: str = ""
    slow_process: int = -1
    slow_s: float = 0.0

    def before_step(self, step: int, process: int) -> None:
        """Called by the trainer right before it dispatches `step`."""
        if self.slow_s and process == self.slow_process:
            time.sleep(self.slow_s)
        if step != self.hang_at_step or self.hang_process not in (-1, process):
            return
        if self.hang_once:
            if os.path.exists(self.hang_once):
                return
            open(self.hang_once, "w").close()
        threading.Event().wait()  # forever: only the watchdog (or a signal) ends the process now


def from_env(environ: dict[str, str] | None = None) -> Faults:
    """The faults GLM46_FAULTS asks for; none when it is unset."""
    text = (os.environ if environ is None else environ).get(ENV, "")
    fields = {f.name: f.type for f in dataclasses.fields(Faults)}
    values = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise InputError(f"{ENV}={text!r}: {item!r} is not key=value with a key in {', '.join(fields)}")
        kind = {"int": int, "float": float, "str": str}[fields[key]]
        try:
            values[key] = kind(value)
        except ValueError:
            raise InputError(f"{ENV}={text!r}: {key} must be a {fields[key]}, not {value!r}") from None
    return Faults(**values)

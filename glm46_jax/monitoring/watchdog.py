"""The hang watchdog: a run whose steps stop completing says so, with every thread's stack, and exits.

A run stuck in a collective (a dead link, a process that hangs) otherwise waits until the job's time limit. A
daemon thread checks how long ago the last step completed; past `max(factor x median step time, floor)` it
  * writes run_dir/status.json {"state": "hung", "step", "phase", "process", ...} (the Slurm launcher requeues
    such a run a bounded number of times: launch/slurm_pretrain.sbatch). Any process that fires writes it: the
    first to exit makes srun end the others, which may then die in a failed collective before their own
    watchdog fires;
  * writes every thread's Python stack (faulthandler) to stderr and to run_dir/hang/process_<i>.txt,
  * with `exit` ends the process with EXIT_CODE after `exit_grace_s`: the main thread may be blocked where no
    exception reaches it, and the grace lets the other processes' watchdogs (which fire within a poll or two:
    they stopped seeing steps at the same time) dump their stacks before srun ends them.
Compiling is not a hang: while `paused` (the trainer wraps each compile in it) the clock does not run, and it
restarts when the pause ends. Median, not mean: one slow step (an evaluation, a save) does not move it.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

from absl import logging

from glm46_jax import atomic

EXIT_CODE = 3  # "hung": what launch/slurm_pretrain.sbatch reads from status.json, not from this code


class Watchdog:
    """Call `step_done(step)` after each step, wrap compiles in `paused(...)`, `phase(...)` names what the loop
    does next (for the report). `close()` stops the thread."""

    def __init__(self, run_dir: str, *, factor: float, floor_s: float, exit: bool, process: int,
                 total_steps: int, poll_s: float | None = None, window: int = 50,
                 clock: Callable[[], float] = time.monotonic):
        self.run_dir, self.factor, self.floor_s, self.exit = run_dir, factor, floor_s, exit
        self.process, self.total_steps, self.clock = process, total_steps, clock
        self.poll_s = poll_s or min(5.0, max(0.1, floor_s / 10))
        self.exit_grace_s = max(5.0, 3 * self.poll_s)
        self._intervals: collections.deque[float] = collections.deque(maxlen=window)
        self._lock = threading.Lock()
        self._last: float | None = None  # when the clock (re)started; None = not armed yet
        self._last_was_step = False  # the interval since _last is a plain step's (not after a pause)
        self._paused = 0
        self._step, self._phase = 0, "starting"
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="glm46-watchdog", daemon=True)
        self._thread.start()

    def step_done(self, step: int) -> None:
        now = self.clock()
        with self._lock:
            if self._last is not None and self._last_was_step:
                self._intervals.append(now - self._last)
            self._last, self._last_was_step, self._step, self._phase = now, True, step, "step"
            self.fired = False

    def phase(self, name: str) -> None:
        with self._lock:
            self._phase = name

    @contextlib.contextmanager
    def paused(self, name: str) -> Iterator[None]:
        with self._lock:
            self._paused += 1
            before, self._phase = self._phase, name
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                self._last, self._last_was_step, self._phase = self.clock(), False, before

    def deadline_s(self) -> float:
        with self._lock:
            median = sorted(self._intervals)[len(self._intervals) // 2] if self._intervals else 0.0
        return max(self.factor * median, self.floor_s)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                armed = self._last is not None and not self._paused and not self.fired
                waited = self.clock() - self._last if armed else 0.0
            if armed and waited > (deadline := self.deadline_s()):
                self._fire(waited, deadline)

    def _fire(self, waited: float, deadline: float) -> None:
        with self._lock:
            step, phase = self._step, self._phase
        reason = (f"no step completed for {waited:.0f} s (deadline {deadline:.0f} s = max({self.factor:g} x median "
                  f"step time, {self.floor_s:g} s)) after step {step}, while in phase {phase!r}")
        atomic.write_json(os.path.join(self.run_dir, "status.json"), {
            "state": "hung", "step": step, "phase": phase, "process": self.process, "waited_s": round(waited, 1),
            "deadline_s": round(deadline, 1), "total_steps": self.total_steps, "reason": reason})
        logging.error("process %d: the run looks hung: %s; every thread's stack follows", self.process, reason)
        print(f"process {self.process}: hung: {reason}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os.makedirs(os.path.join(self.run_dir, "hang"), exist_ok=True)
        with open(os.path.join(self.run_dir, "hang", f"process_{self.process}.txt"), "w") as f:
            f.write(f"process {self.process}: {reason}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        self.fired = True  # after the report: who waits for it finds it complete
        if self.exit:
            time.sleep(self.exit_grace_s)
            sys.stderr.flush()
            os._exit(EXIT_CODE)  # the main thread is stuck where no exception reaches it

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

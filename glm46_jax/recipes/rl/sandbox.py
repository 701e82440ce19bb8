"""Run a short, untrusted Python program in a subprocess: a time limit, a memory limit, its own temporary
directory, no network, no writes outside that directory (docs/rl.md#code-execution-reward).

    result = run_python("assert sorted([2, 1]) == [1, 2]", timeout_s=2.0, memory_mb=256)
    result.passed   # exit status 0 within the time limit

Layers, each stopping what the one before lets through:
  * the process runs in a fresh temporary directory (its cwd and $HOME), with an empty environment, `python -I -B`
    (no user site, no PYTHON* variables, no bytecode writes), in a new session so the whole process group is
    killed at the time limit;
  * rlimits set before the program runs: address space (`memory_mb`), CPU seconds, file size, no core dumps;
  * `unshare -rn` (a user + network namespace with no interfaces) where the kernel allows it, so nothing can
    connect anywhere;
  * an audit hook installed before the program runs refuses sockets, subprocesses, ctypes, and any file
    write, rename, removal or directory change outside the temporary directory.
This guards against the mistakes of sampled programs (runaway loops, stray writes, memory blow-ups); it is not
a security boundary against a determined attacker (run RL on code in a container or VM for that).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# Run first in the child (rlimits set there rather than in a preexec_fn, which is unsafe to run in a forked
# copy of a multithreaded process like JAX's). Python's audit hooks cannot be removed once added.
_PRELUDE = r'''
import os as _os, resource as _resource, sys as _sys
for _limit, _value in ((_resource.RLIMIT_AS, {memory}), (_resource.RLIMIT_CPU, {cpu}),
                       (_resource.RLIMIT_FSIZE, 16 * 1024 * 1024), (_resource.RLIMIT_CORE, 0)):
    _resource.setrlimit(_limit, (_value, _value))
del _limit, _value, _resource
_ROOT = _os.path.realpath(_os.getcwd())
_WRITE_FLAGS = _os.O_WRONLY | _os.O_RDWR | _os.O_CREAT | _os.O_APPEND | _os.O_TRUNC

def _inside(path):
    if isinstance(path, int):
        return True
    full = _os.path.realpath(_os.fsdecode(path))
    return full == _ROOT or full.startswith(_ROOT + _os.sep)

def _guard(event, args):
    if event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
        if writing and path is not None and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory")
    elif event in ("os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
                   "os.chdir", "shutil.rmtree", "os.symlink", "os.link", "os.rename", "os.replace"):
        paths = args[:2] if event in ("os.symlink", "os.link", "os.rename", "os.replace") else args[:1]
        if not all(_inside(p) for p in paths if isinstance(p, (str, bytes, _os.PathLike, int))):
            raise PermissionError(f"sandbox: {event} outside the sandbox directory")
    elif event.startswith(("socket.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "ctypes.")) or \
            event in ("os.system", "os.fork", "os.forkpty", "os.kill", "os.killpg", "pty.spawn"):
        raise PermissionError(f"sandbox: {event} is not allowed")

_sys.addaudithook(_guard)
del _guard
'''


@dataclasses.dataclass(frozen=True)
class Result:
    returncode: int | None  # None: killed at the time limit
    timed_out: bool
    stdout: str
    stderr: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@functools.cache
def _network_namespace() -> list[str]:
    """`unshare -rn --` when this kernel lets an unprivileged user make a network namespace, else nothing."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    try:
        ok = subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return [unshare, "-rn", "--"] if ok else []


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output: int = 10_000) -> Result:
    """Run `code` (a whole program) as described in the module docstring; never raises for what the program does."""
    with tempfile.TemporaryDirectory(prefix="glm46_sandbox_") as root:
        with open(os.path.join(root, "main.py"), "w") as f:
            limits = {"{memory}": str(memory_mb * 1024 * 1024), "{cpu}": str(int(timeout_s) + 1)}
            prelude = functools.reduce(lambda text, kv: text.replace(*kv), limits.items(), _PRELUDE)
            f.write(prelude + "\n" + code)
        cmd = [*_network_namespace(), sys.executable, "-I", "-B", "main.py"]
        env = {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8"}
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole session: children too
            out, err = proc.communicate()
            timed_out = True
        seconds = time.perf_counter() - t0
    decode = lambda b: b[:max_output].decode("utf-8", "replace")  # noqa: E731
    return Result(None if timed_out else proc.returncode, timed_out, decode(out), decode(err), seconds)

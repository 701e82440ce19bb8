"""A real Prometheus server for the monitoring tests (`from promserver import ...`): started on a free localhost
port with its own data directory, scraping static targets or a file_sd directory every second, and stopped with
no process left behind. Also the dashboard's queries with Grafana's variables filled in, and the missing-binary
rule the monitoring tests share (fail in CI, skip elsewhere)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
MONITORING = os.path.join(ROOT, "launch", "monitoring")
DASHBOARD = os.path.join(MONITORING, "grafana", "glm46_training.json")
ALERTS = os.path.join(MONITORING, "alerts.yml")
ALERT_NAMES = {"TrainingStalled", "LossSpike", "NonFiniteSteps", "DeviceMemoryHigh", "StragglerProcess",
               "ExpertCollapse", "CheckpointStale", "EvalRegression"}
HISTOGRAMS = {"training_step_seconds", "checkpoint_save_seconds"}  # the exporter's; series _bucket, _sum, _count
INSTALL = "apt-get install prometheus prometheus-alertmanager"

# What Grafana puts in for the dashboard's variables when every run and process is selected: `$run` and
# `$process` are regex matches (`=~`), and the only range window the dashboard uses is `$__rate_interval`
# (Grafana makes it at least 4 scrape intervals; 1m covers a run scraped every second).
DASHBOARD_VARIABLES = {"run": ".*", "process": ".*", "__rate_interval": "1m"}


def require(*binaries: str) -> dict[str, str]:
    """The path of each binary; a missing one fails the test in CI (.ci/run sets CI=true and installs them) and
    skips it elsewhere."""
    paths = {name: shutil.which(name) for name in binaries}
    missing = [name for name, path in paths.items() if path is None]
    if missing:
        why = f"{', '.join(missing)} not found: {INSTALL}"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return paths


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dashboard_queries(path: str = DASHBOARD, variables: dict[str, str] = DASHBOARD_VARIABLES
                      ) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query target of the dashboard (rows' nested panels included), with
    `$name` and `${name}` replaced by `variables[name]`."""
    with open(path) as f:
        dashboard = json.load(f)
    out = []

    def walk(panels):
        for panel in panels:
            walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                expr = target["expr"]
                for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):  # longest first
                    expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
                out.append((panel["title"], expr))

    walk(dashboard["panels"])
    return out


class Prometheus:
    """A running server: `url`, and the HTTP API's answers as Python values (api/v1 `data`)."""

    def __init__(self, url: str, proc: subprocess.Popen, log_path: str):
        self.url, self.proc, self.log_path = url, proc, log_path

    def api(self, path: str, **params) -> object:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:  # a bad query: 400 with the parser's message
            body = json.load(e)
        if body.get("status") != "success":
            raise ValueError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, time: float | None = None) -> list[dict]:
        """An instant query: the result list (vector or matrix elements: metric + value or values)."""
        return self.api("query", query=expr, time=time)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def targets(self) -> dict:
        return self.api("targets")

    def rules(self) -> list[dict]:
        return self.api("rules")["groups"]

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_for_scrape(self, timeout: float = 30.0, healthy: int = 1) -> list[dict]:
        """Until `healthy` targets were scraped successfully (the first scrape comes ~5 s after start: target
        discovery updates in batches of 5 s); returns the active targets."""
        deadline = time.monotonic() + timeout
        while True:
            active = self.targets()["activeTargets"]
            if sum(t["health"] == "up" for t in active) >= healthy:
                return active
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {healthy} healthy targets after {timeout} s: {active}")
            time.sleep(0.5)


def config(targets: Sequence[str] = (), sd_dir: str | None = None, rule_files: Sequence[str] = (),
           interval: str = "1s") -> dict:
    """Prometheus's configuration: job glm46 scraping `targets` (host:port) and/or the file_sd files
    `sd_dir`/*.json every `interval`, honor_labels as in launch/monitoring/prometheus.yml."""
    job: dict = {"job_name": "glm46", "honor_labels": True, "scrape_interval": interval,
                 "scrape_timeout": interval}
    if targets:
        job["static_configs"] = [{"targets": list(targets)}]
    if sd_dir is not None:
        job["file_sd_configs"] = [{"files": [os.path.join(os.path.abspath(sd_dir), "*.json")],
                                   "refresh_interval": "1s"}]
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [os.path.abspath(p) for p in rule_files], "scrape_configs": [job]}


@contextlib.contextmanager
def prometheus(targets: Sequence[str] = (), sd_dir: str | None = None, rule_files: Sequence[str] = (),
               interval: str = "1s", ready_timeout: float = 30.0) -> Iterator[Prometheus]:
    """A `prometheus` process on 127.0.0.1:<free port> with its config and TSDB in a temporary directory,
    ready (/-/ready) when this yields; terminated (killed after 10 s) and its directory removed after."""
    binary = require("prometheus")["prometheus"]
    tmp = tempfile.mkdtemp(prefix="glm46_prometheus_")
    cfg_path, log_path = os.path.join(tmp, "prometheus.yml"), os.path.join(tmp, "prometheus.log")
    with open(cfg_path, "w") as f:
        json.dump(config(targets, sd_dir, rule_files, interval), f)  # JSON is YAML
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([binary, f"--config.file={cfg_path}", f"--storage.tsdb.path={tmp}/data",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp)
    server = Prometheus(url, proc, log_path)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {proc.returncode}:\n{server.log()}")
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus not ready after {ready_timeout} s:\n{server.log()}")
            time.sleep(0.1)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)

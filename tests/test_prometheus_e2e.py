"""A real Prometheus scrapes a real tiny run: one training CLI run (40 tiny-preset steps, logging every step,
evaluating and saving every 10) serves its metrics while a `prometheus` binary scrapes it every second with
the committed alert rules loaded. The scraped values are the run's metrics.jsonl values, every dashboard panel has
data, the exporter's families are its METRIC_NAMES, and `promtool check metrics` accepts its exposition. Needs
Debian's prometheus package (CI installs it; without it: fail in CI, skip elsewhere).

The same run also writes a W&B offline run (read back from W&B's own run file), a profiler trace of steps 3-5,
and runs the hang watchdog with a floor far below its compile time (it must not fire)."""

import glob
import gzip
import json
import math
import os
import re
import struct
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import ROOT, subprocess_env
from promserver import ALERT_NAMES, ALERTS, HISTOGRAMS, dashboard_queries, free_port, prometheus, require

from glm46_jax.monitoring.exporter import METRIC_NAMES

STEPS, EVERY = 40, 10
WATCHDOG_FLOOR_S = 5  # the first compile takes longer: a watchdog not paused while compiling would fire
RUN = "e2e"


def _flags(run_dir: str, corpus: str, port: int) -> list[str]:
    # 40 steps of 8 x 64 tokens, all in the first phase (train.steps ends the run before its budget is spent): a
    # second phase would cost a second compile of the step and the eval, which is most of this file's time.
    # One process, so the straggler ratio is 1 (its exchange still runs and is exported).
    return [f"--config.run_dir={run_dir}", f"--config.data.root={corpus}", "--config.mesh.data=1",
            "--config.data.phases.general.tokens=40960", "--config.data.phases.general.seq_len=64",
            "--config.data.phases.general.global_batch=8", f"--config.train.steps={STEPS}",
            "--config.train.log_every=1", f"--config.train.eval_every={EVERY}", "--config.train.eval_batches=1",
            f"--config.checkpoint.every={EVERY}", "--config.optim.warmup_steps=2",
            "--config.monitor.sinks=jsonl,prometheus,wandb", f"--config.monitor.run_name={RUN}",
            f"--config.monitor.watchdog_floor_s={WATCHDOG_FLOOR_S}", "--config.train.profile_steps=3:5",
            f"--config.monitor.prometheus_port={port}", "--config.monitor.prometheus_linger_s=5",
            f"--config.monitor.straggler_every={EVERY}"]


def _fetch(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return r.read().decode()
    except OSError:
        return None


@pytest.fixture(scope="module")
def scraped(tmp_path_factory, sample_corpus):
    """The finished run: (Prometheus, run dir, start and end unix times, the exporter's last /metrics text)."""
    require("prometheus", "promtool")
    run_dir = str(tmp_path_factory.mktemp("run"))
    port = free_port()
    # A step takes 0.1-0.7 s on a 2-core box; the fault hook adds 0.25 s to each, so 1 s scrapes see many of the
    # 40 losses however fast the machine is (10 s more in all).
    # Its own empty compile cache: the watchdog test below needs a first compile longer than the watchdog's floor,
    # which a cache kept from an earlier run (`.ci/run`'s machine-level one) would answer in seconds.
    env = subprocess_env(1, GLM46_FAULTS="slow_process=0,slow_s=0.25",
                         JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("cold_xla_cache")))
    cmd = [sys.executable, "-m", "glm46_jax.train", "--config=configs/pretrain.py:tiny",
           *_flags(run_dir, sample_corpus, port)]
    # Discovered the way launch/slurm_pretrain.sbatch lists a job's tasks (launch/prometheus_targets.sh).
    sd_dir = tmp_path_factory.mktemp("targets")
    with open(sd_dir / "1234.json", "w") as f:
        json.dump([{"targets": [f"127.0.0.1:{port}"], "labels": {"job": "glm46", "slurm_job_id": "1234"}}], f)
    with prometheus(sd_dir=str(sd_dir), rule_files=[ALERTS]) as prom:
        start = time.time()
        with open(os.path.join(run_dir, "train.log"), "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        last_text = None  # the exporter's last answer: while it lingers after the run, the final values
        try:
            while proc.poll() is None and time.time() - start < 600:
                last_text = _fetch(port) or last_text
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        end = time.time()
        with open(os.path.join(run_dir, "train.log")) as f:
            assert proc.returncode == 0, f.read()[-3000:]
        yield prom, run_dir, start, end, last_text


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _raw(prom, expr: str, end: float) -> list[tuple[dict, list[tuple[float, float]]]]:
    """Every sample Prometheus stored for `expr` over the last 10 minutes: (labels, [(time, value)]) per series."""
    return [(r["metric"], [(float(t), float(v)) for t, v in r["values"]]) for r in prom.query(f"{expr}[10m]", end)]


def test_the_run_is_scraped_to_its_last_step(scraped):
    prom, _, _, end, _ = scraped
    steps = _raw(prom, "training_steps_total", end)
    assert len(steps) == 1 and steps[0][0]["run"] == RUN and steps[0][0]["process"] == "0"
    # The exporter's run/process labels, and the targets file's job and slurm_job_id (honor_labels: true).
    assert steps[0][0]["job"] == "glm46" and steps[0][0]["slurm_job_id"] == "1234"
    assert max(v for _, v in steps[0][1]) == STEPS
    # The run ended with a checkpoint of its last step: what TrainingStalled takes for a finished run.
    assert max(v for _, v in _raw(prom, "checkpoint_last_step", end)[0][1]) == STEPS


def test_scraped_losses_are_the_logged_losses(scraped):
    """Every scraped training_loss is one of metrics.jsonl's train/loss values (float32 values, so exact up to the
    text round trip), labelled with the run's phase, and the last one scraped is the final step's."""
    prom, run_dir, _, end, _ = scraped
    logged = {r["step"]: r["train/loss"] for r in _records(run_dir) if "train/loss" in r}
    assert sorted(logged) == list(range(1, STEPS + 1))
    series = _raw(prom, "training_loss", end)
    assert [s["phase"] for s, _ in series] == ["general"]
    samples = sorted((t, v) for _, values in series for t, v in values)
    for _, value in samples:
        assert any(math.isclose(value, x, rel_tol=1e-6) for x in logged.values()), (value, logged)
    assert math.isclose(samples[-1][1], logged[STEPS], rel_tol=1e-6)
    assert len({v for _, v in samples}) >= 8, f"1 s scrapes saw only {len({v for _, v in samples})} of {STEPS} steps"


def test_every_dashboard_panel_has_data(scraped):
    prom, _, start, end, _ = scraped
    empty = []
    for title, expr in dashboard_queries():
        result = prom.query_range(expr, start, end, step=1)
        if not any(math.isfinite(float(v)) for r in result for _, v in r["values"]):
            empty.append((title, expr))
    assert not empty, empty


def test_exported_families_are_the_exporters_names(scraped):
    """The exposition has exactly METRIC_NAMES (this run has every conditional one: MoE, evals, saves, the
    straggler exchange, MFU from step 2), and `promtool check metrics` finds nothing to report."""
    *_, text = scraped
    assert text is not None, "the exporter never answered"
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    assert families == set(METRIC_NAMES), (families ^ set(METRIC_NAMES))
    kinds = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE ")}
    assert {name for name, kind in kinds.items() if kind == "histogram"} == HISTOGRAMS
    out = subprocess.run(["promtool", "check", "metrics"], check=False, input=text, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr


def test_alert_rules_evaluate_on_the_runs_data(scraped):
    """The committed rules ran every second on real series without an evaluation error, and a healthy run fires
    none of them (some may be pending: the tiny model's expert load is uneven, but not for 30 minutes)."""
    prom, _, _, end, _ = scraped
    rules = [r for group in prom.rules() for r in group["rules"]]
    assert {r["name"] for r in rules} == ALERT_NAMES
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    assert prom.query('ALERTS{alertstate="firing"}[10m]', end) == []


def _wandb_history(run_dir: str) -> dict[int, dict]:
    """The history rows of the W&B offline run file, read without wandb's reader (wandb 0.2x has none in Python):
    W&B's LevelDB-style log of 32 KiB blocks holding length-prefixed `wandb.proto` Record messages."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pending, rows = 32768, 7, b"", {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                # a key W&B splits at its "/" comes as nested_key
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                rows.setdefault(row["_step"], {}).update(row)
    return rows


def test_the_wandb_offline_run_holds_the_logged_keys(scraped):
    _, run_dir, *_ = scraped
    rows = _wandb_history(run_dir)
    records = _records(run_dir)
    assert sorted(rows) == list(range(1, STEPS + 1))
    for r in records:
        row = rows[r["step"]]
        for key, value in r.items():
            if key != "step" and value is not None:
                assert math.isclose(row[key], value, rel_tol=1e-6), (r["step"], key, row.get(key), value)
    assert {row["phase"] for row in rows.values()} == {"general"}
    assert [s for s in sorted(rows) if "eval/ce" in rows[s]] == list(range(EVERY, STEPS + 1, EVERY))


def test_the_profile_holds_steps_3_to_5(scraped):
    _, run_dir, *_ = scraped
    (trace,) = glob.glob(os.path.join(run_dir, "profile", "plugins", "profile", "*", "perfetto_trace.json.gz"))
    assert glob.glob(os.path.join(os.path.dirname(trace), "*.xplane.pb"))  # what TensorBoard's profile plugin reads
    with gzip.open(trace) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    steps = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train_step")
    assert steps == [3, 4, 5]


def test_the_watchdog_did_not_fire_while_compiling(scraped):
    _, run_dir, *_ = scraped
    with open(os.path.join(run_dir, "train.log")) as f:
        compile_s = float(re.search(r"compile ([\d.]+) s", f.read()).group(1))
    assert compile_s > WATCHDOG_FLOOR_S  # else this run would not show it
    with open(os.path.join(run_dir, "status.json")) as f:
        assert json.load(f)["state"] == "complete"
    assert not os.path.exists(os.path.join(run_dir, "hang"))

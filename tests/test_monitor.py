"""The monitoring parts on their own: the watchdog's timing and report, the exporter's scrape (checked by the real
`promtool check metrics` where it is installed, see test_monitoring_rules.py for its absence), injected faults,
the monitor config's refusals, host memory. Whole runs: test_prometheus_e2e.py (a real Prometheus scrapes a run,
the W&B offline run, the profiler window), test_multiprocess.py (the straggler), test_slurm.py (a hung job
requeued)."""

import json
import os
import re
import threading
import time
import urllib.request

import jax
import pytest

from glm46_jax.errors import InputError
from glm46_jax.monitoring import exporter, monitor, watchdog
from glm46_jax.monitoring import fault_injection


def _blocked_here(event: threading.Event) -> None:
    event.wait()  # what the watchdog's stack dump must show: this function, in this file


def test_the_watchdog_reports_a_hang_within_its_deadline_and_not_while_paused(tmp_path):
    run_dir = str(tmp_path)
    dog = watchdog.Watchdog(run_dir, factor=4, floor_s=0.5, exit=False, process=0, total_steps=9, poll_s=0.02)
    try:
        with dog.paused("compiling general"):  # twice the floor, and no report: compiling is not a hang
            time.sleep(1.0)
        assert not dog.fired
        for step in range(1, 6):  # steps of 0.05 s: the deadline is the floor, 0.5 s (4 x 0.05 < 0.5)
            time.sleep(0.05)
            dog.step_done(step)
        assert dog.deadline_s() == 0.5
        dog.phase("eval")
        release = threading.Event()
        blocked = threading.Thread(target=_blocked_here, args=(release,), name="blocked-step")
        blocked.start()
        hung_at = time.monotonic()
        while not dog.fired and time.monotonic() - hung_at < 5:
            time.sleep(0.01)
        took = time.monotonic() - hung_at
        release.set()
        blocked.join()
    finally:
        dog.close()
    assert dog.fired and 0.5 <= took < 0.5 + 1.5, took  # the slack: a loaded 2-core CI machine's thread scheduling
    with open(os.path.join(run_dir, "status.json")) as f:
        status = json.load(f)
    assert (status["state"], status["step"], status["phase"], status["total_steps"]) == ("hung", 5, "eval", 9)
    assert status["process"] == 0
    assert status["deadline_s"] == 0.5 and status["waited_s"] >= 0.5
    with open(os.path.join(run_dir, "hang", "process_0.txt")) as f:
        dump = f.read()
    assert "no step completed for" in dump and "_blocked_here" in dump and "test_monitor.py" in dump


def test_the_watchdog_deadline_follows_the_median_step_time(tmp_path):
    now = [100.0]  # a hand-driven clock: the deadline is arithmetic on the step intervals, not on sleeps
    dog = watchdog.Watchdog(str(tmp_path), factor=3, floor_s=0.01, exit=False, process=1, total_steps=9,
                            poll_s=10, clock=lambda: now[0])
    try:
        dog.step_done(1)
        for step, gap in enumerate((0.02, 0.02, 0.3, 0.02, 0.03), start=2):  # one slow step (an eval) among five
            now[0] += gap
            dog.step_done(step)
        assert dog.deadline_s() == pytest.approx(3 * 0.02)  # 3 x the median (the slow one does not move it)
        with dog.paused("compiling"):
            now[0] += 50.0
        now[0] += 0.5
        dog.step_done(7)  # the interval after a pause is not a step time
        assert dog.deadline_s() == pytest.approx(3 * 0.02)
        now[0] += 0.04
        dog.step_done(8)
        assert dog.deadline_s() == pytest.approx(3 * 0.03)  # intervals 0.02 0.02 0.03 0.04 0.3: median 0.03
    finally:
        dog.close()
    assert not os.path.exists(tmp_path / "status.json")  # it never fired


def test_faults_from_the_environment():
    f = fault_injection.from_env({"GLM46_FAULTS": "hang_at_step=4, hang_process=1,slow_process=0,slow_s=0.25"})
    assert (f.hang_at_step, f.hang_process, f.slow_process, f.slow_s) == (4, 1, 0, 0.25)
    assert fault_injection.from_env({}) == fault_injection.Faults()
    with pytest.raises(InputError, match=r"GLM46_FAULTS=.*'hang=4' is not key=value with a key in hang_at_step"):
        fault_injection.from_env({"GLM46_FAULTS": "hang=4"})
    with pytest.raises(InputError, match="slow_s must be a float, not 'x'"):
        fault_injection.from_env({"GLM46_FAULTS": "slow_s=x"})
    start = time.monotonic()
    fault_injection.Faults(slow_process=1, slow_s=0.2).before_step(3, process=0)  # another process: no sleep
    assert time.monotonic() - start < 0.1


def test_hang_once_hangs_the_first_run_only(tmp_path):
    marker = str(tmp_path / "hung_once")
    f = fault_injection.Faults(hang_at_step=2, hang_once=marker)
    f.before_step(1, 0)
    t = threading.Thread(target=f.before_step, args=(2, 0), daemon=True)  # blocks forever: a daemon thread
    t.start()
    t.join(0.3)
    assert t.is_alive() and os.path.exists(marker)
    f.before_step(2, 0)  # the rerun: the marker exists, so no hang


@pytest.mark.parametrize(("override", "message"), [
    (dict(sinks="jsonl,statsd"), r"monitor.sinks='jsonl,statsd': unknown sink\(s\) \['statsd'\]; name some of"),
    (dict(wandb_mode="cloud"), r"monitor.wandb_mode='cloud': must be one of \('offline', 'online', 'disabled'\)"),
    (dict(prometheus_port=70000), r"monitor.prometheus_port=70000: is not a TCP port"),
    (dict(watchdog_floor_s=-1), r"monitor.watchdog_floor_s=-1"),
])
def test_monitor_config_refuses_bad_values(override, message):
    with pytest.raises(InputError, match=message):
        monitor.MonitorConfig(**override)


def test_profile_steps_must_be_a_range():
    assert monitor.parse_steps("3:5") == (3, 5)
    for bad in ("5:3", "0:2", "3", "a:b"):
        with pytest.raises(InputError, match=f"train.profile_steps='{bad}': must be START:END"):
            monitor.parse_steps(bad)


def test_host_memory_on_cpu():
    m = monitor.memory_scalars(jax.devices("cpu")[:1])
    assert set(m) == {"memory/host/in_use_bytes", "memory/host/peak_bytes", "memory/host/limit_bytes"}
    assert 0 < m["memory/host/in_use_bytes"] <= m["memory/host/peak_bytes"] < m["memory/host/limit_bytes"]
    with open("/proc/meminfo") as f:  # the kernel's own figure, in kB
        total_kb = int(re.search(r"MemTotal:\s+(\d+) kB", f.read()).group(1))
    assert abs(m["memory/host/limit_bytes"] - total_kb * 1024) < 2 ** 20


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_the_exporter_serves_the_last_record_and_replaces_a_finished_phase():
    sink = exporter.PrometheusSink(port=0, run="r1", process=2, balance=False)
    try:
        sink.write(4, {"train/loss": 3.5, "train/ce": 3.0, "train/step_s": 0.2, "train/nonfinite_total": 1.0,
                       "train/load_cv/moe_layer_00": 0.5}, "general")
        sink.write(4, {"eval/ce": 3.25, "eval/code/ce": 2.5}, "general")
        sink.write(6, {"train/loss": 2.75, "train/step_s": 0.3}, "code_long")
        got = _samples(_scrape(sink.port))
    finally:
        sink.close()
    labels = 'process="2",run="r1"'
    assert got[f"training_steps_total{{{labels}}}"] == 6
    assert got[f"training_skipped_steps_total{{{labels}}}"] == 1
    assert got[f'training_loss{{phase="code_long",{labels}}}'] == 2.75
    assert not any(k.startswith("training_loss") and "general" in k for k in got)  # the old phase's series ended
    assert not any(k.startswith("training_ce") for k in got)  # code_long's record had no CE
    assert got[f'eval_ce{{domain="all",phase="general",{labels}}}'] == 3.25
    assert got[f'eval_ce{{domain="code",phase="general",{labels}}}'] == 2.5
    assert not any(k.startswith("expert_load") for k in got)  # balance=False: another process exports them
    assert got[f"training_step_seconds_count{{{labels}}}"] == 2
    assert got[f"training_step_seconds_sum{{{labels}}}"] == pytest.approx(0.5)
    assert got[f'training_step_seconds_bucket{{le="0.25",{labels}}}'] == 1
    names = {k.split("{")[0].removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for k in got}
    assert names <= set(exporter.METRIC_NAMES), names - set(exporter.METRIC_NAMES)


def test_a_taken_prometheus_port_is_one_clear_line(tmp_path):
    sink = exporter.PrometheusSink(port=0, run="r", process=0)
    try:
        cfg = monitor.MonitorConfig(sinks="prometheus", prometheus_port=sink.port, prometheus_linger_s=0)
        with pytest.raises(InputError, match=rf"monitor.prometheus_port={sink.port}: process 0 cannot serve on port "
                                             rf"{sink.port} \(Address already in use\); choose a free base port"):
            monitor.open_writer(cfg, str(tmp_path), append=False)
    finally:
        sink.close()


def test_the_exporter_lingers_after_close_so_the_last_step_is_scraped():
    sink = exporter.PrometheusSink(port=0, run="r", process=0, steps_done=7, linger_s=1.0)
    assert 'training_steps_total{process="0",run="r"} 7.0' in _scrape(sink.port)  # resumed after step 7
    sink.write(9, {"train/loss": 1.5}, "general")
    closer = threading.Thread(target=sink.close)
    start = time.monotonic()
    closer.start()
    time.sleep(0.3)
    assert 'training_steps_total{process="0",run="r"} 9.0' in _scrape(sink.port)  # still served while lingering
    closer.join()
    assert time.monotonic() - start >= 1.0
    with pytest.raises(OSError):
        _scrape(sink.port)

"""launch/monitoring/: Prometheus's config and alert rules pass promtool (the rules' own unit tests included),
Alertmanager's config passes amtool, the rules and the dashboard use only metrics the exporter exports, and a
real Prometheus loads the rules and accepts every dashboard query. The binaries come from Debian's prometheus and
prometheus-alertmanager packages (.ci/run installs them); without them these tests fail in CI and skip elsewhere."""

import os
import re
import subprocess
import time

import pytest
import yaml
from promserver import ALERT_NAMES, ALERTS, DASHBOARD, HISTOGRAMS, MONITORING, dashboard_queries, prometheus, require

from glm46_jax.monitoring.exporter import METRIC_NAMES

PROMETHEUS_YML = os.path.join(MONITORING, "prometheus.yml")
ALERTS_TEST = os.path.join(MONITORING, "alerts_test.yml")
ALERTMANAGER_YML = os.path.join(MONITORING, "alertmanager.yml")
PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
                "group_right", "inf", "nan", "atan2"}


def _run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60, cwd=MONITORING)
    assert out.returncode == 0, f"{' '.join(cmd)} exited with {out.returncode}:\n{out.stdout}{out.stderr}"
    return out.stdout + out.stderr


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label matchers, ranges, grouping
    clauses, function calls, keywords and numbers are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = re.findall(r"(?<![\w.:])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()", expr)
    return {n for n in names if n.lower() not in PROMQL_WORDS}


def _exported(name: str) -> bool:
    base, _, suffix = name.rpartition("_")
    return name in METRIC_NAMES or (base in HISTOGRAMS and suffix in ("bucket", "sum", "count"))


def _alert_rules() -> list[dict]:
    with open(ALERTS) as f:
        return [rule for group in yaml.safe_load(f)["groups"] for rule in group["rules"]]


def test_metric_name_parser():
    assert metric_names('max by (run, phase) (training_loss{run=~"$run"}) > 1.25 * avg_over_time(x[1h] offset 5m)'
                        ) == {"training_loss", "x"}
    assert metric_names('label_replace(a > 1.5e9, "process", "$1", "s", "(.*)") and on (run) b unless c'
                        ) == {"a", "b", "c"}
    assert metric_names('sum by (le) (increase(h_bucket{p=~".*"}[1m])) / time()') == {"h_bucket"}


def test_prometheus_config_and_rules_pass_promtool():
    require("promtool")
    out = _run(["promtool", "check", "config", PROMETHEUS_YML])
    assert "SUCCESS: 1 rule files found" in out, out
    out = _run(["promtool", "check", "rules", "--lint=all", "--lint-fatal", ALERTS])
    assert "SUCCESS" in out, out


def test_alertmanager_config_passes_amtool():
    require("amtool")
    out = _run(["amtool", "check-config", ALERTMANAGER_YML])
    assert "SUCCESS" in out and "2 receivers" in out, out


def test_alert_rules_unit_tests():
    """promtool runs alerts_test.yml; every alert has a group in which it fires (labels and annotations
    checked) and one in which it must stay silent, so deleting either fails here."""
    require("promtool")
    assert {rule["alert"] for rule in _alert_rules()} == ALERT_NAMES
    with open(ALERTS_TEST) as f:
        tests = yaml.safe_load(f)
    assert tests["rule_files"] == ["alerts.yml"]
    fires, silent = set(), set()
    for group in tests["tests"]:
        alert, kind = re.match(r"(\w+) (fires|silent):", group["name"]).groups()
        checks = [t for t in group["alert_rule_test"] if t["alertname"] == alert]
        assert checks and {t["alertname"] for t in group["alert_rule_test"]} == {alert}, group["name"]
        if kind == "fires":
            assert any(t["exp_alerts"] for t in checks), group["name"]
            assert all(a["exp_annotations"]["summary"] and a["exp_annotations"]["description"]
                       for t in checks for a in t["exp_alerts"]), group["name"]
            fires.add(alert)
        else:
            assert all(t["exp_alerts"] == [] for t in checks), group["name"]
            silent.add(alert)
    assert fires == silent == ALERT_NAMES, (fires, silent)
    out = _run(["promtool", "test", "rules", ALERTS_TEST])
    assert "SUCCESS" in out and "FAILED" not in out, out


def test_rules_have_severity_and_annotations():
    for rule in _alert_rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description"}, rule["alert"]
        assert all("$labels.run" in text for text in rule["annotations"].values()), rule["alert"]


def test_rules_and_dashboard_use_exported_metrics_only():
    assert HISTOGRAMS <= set(METRIC_NAMES)
    used = {f"alerts.yml {rule['alert']}": metric_names(rule["expr"]) for rule in _alert_rules()}
    with open(ALERTS_TEST) as f:
        series = [s["series"] for group in yaml.safe_load(f)["tests"] for s in group["input_series"]]
    used["alerts_test.yml"] = {s.split("{")[0] for s in series}
    for title, expr in dashboard_queries():
        used.setdefault(f"dashboard {title}", set()).update(metric_names(expr))
    unknown = {where: sorted(n for n in names if not _exported(n)) for where, names in used.items()}
    assert not any(unknown.values()), {k: v for k, v in unknown.items() if v}
    # And the dashboard shows every metric the exporter has.
    shown = set().union(*(names for where, names in used.items() if where.startswith("dashboard")))
    shown |= {n.rpartition("_")[0] for n in shown if n.rpartition("_")[0] in HISTOGRAMS}
    assert set(METRIC_NAMES) <= shown, sorted(set(METRIC_NAMES) - shown)


def test_dashboard_variables_and_windows():
    """Every query filters on the run, and the only range window is $__rate_interval (which Grafana sizes to the
    scrape interval), so the panels work on a short run scraped every second as on a long one."""
    import json

    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    assert dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["run"]["query"] == "label_values(training_steps_total, run)"
    assert variables["run"]["allValue"] == variables["process"]["allValue"] == ".*"
    raw = dashboard_queries(variables={})
    assert len(raw) >= 20
    for title, expr in raw:
        assert 'run=~"$run"' in expr, title
        assert set(re.findall(r"\[([^\]]*)\]", expr)) <= {"$__rate_interval"}, (title, expr)


@pytest.fixture(scope="module")
def server():
    with prometheus(rule_files=[ALERTS]) as prom:
        yield prom


def test_prometheus_loads_the_rules(server):
    """The committed alerts.yml in a real Prometheus: all eight alerts load and evaluate without error (on an
    empty database: a type error such as a many-to-many match shows only with data, which alerts_test.yml has)."""
    deadline = time.monotonic() + 20
    while True:
        rules = [r for group in server.rules() for r in group["rules"]]
        if not any(r["lastEvaluation"].startswith("0001-") for r in rules) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {r["name"] for r in rules if r["type"] == "alerting"} == ALERT_NAMES
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r["health"], r.get("lastError")) for r in rules]


def test_prometheus_accepts_every_dashboard_query(server):
    for title, expr in dashboard_queries():
        server.query(expr)  # a parse or type error raises, with Prometheus's message

"""The Prometheus sink: each process serves its training metrics on http://HOST:(port + process index)/metrics.

`PrometheusSink` is a `sinks.Sink`: the trainer hands it the same record per logged step that metrics.jsonl gets,
and it keeps the latest values for Prometheus to scrape (prometheus_client, in a registry of its own so nothing
else in the process leaks into the scrape). Names follow Prometheus' conventions (base units, `_total` counters,
`_seconds` / `_bytes` suffixes); every series has the labels `run` and `process`, the per-step gauges `phase`
(the curriculum phase or recipe segment; a new phase replaces the old one's series). What each name means, and
the alert rules and dashboard built on them: docs/monitoring.md and launch/monitoring/.

Values change once per logged step (`train.log_every`), so a scrape interval shorter than that only repeats them.
After the run the exporter keeps serving for `linger_s`, so the last step is scraped before the process exits.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator, Mapping

import prometheus_client
from absl import logging
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# No `<histogram>_created` gauges: they only say when the process started, and no dashboard or rule reads them.
prometheus_client.disable_created_metrics()

# Step and save times span milliseconds (a tiny model on CPU) to minutes (a 355B step on a slow fabric).
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 600)

# Per-step gauges (labels run, process, phase): the trainer's scalar -> (metric, help).
_STEP_GAUGES = {
    "train/loss": ("training_loss", "Total loss of the last logged step (CE + MTP + aux, or the recipe's loss)."),
    "train/ce": ("training_ce", "Next-token cross-entropy of the last logged step, nats per token."),
    "train/lr": ("training_lr", "Learning rate of the last logged update."),
    "train/grad_norm": ("training_grad_norm", "Global gradient norm of the last logged step, before clipping."),
    "train/tokens_per_s": ("training_tokens_per_second", "Global tokens per second over the last log interval."),
    "train/mfu": ("training_mfu", "Model FLOPs utilisation over the last log interval (0..1)."),
}
# The names this module exports (histograms add _bucket, _sum and _count). Some appear only when their figure
# exists: training_ce without next-token CE (reward, DPO), training_mfu from step 2, eval_ce after an eval,
# expert_load_* for a MoE model and on process 0, training_straggler_ratio after the first exchange,
# checkpoint_* after the first save.
METRIC_NAMES = (
    "training_steps_total", "training_skipped_steps_total", *(name for name, _ in _STEP_GAUGES.values()),
    "training_step_seconds", "training_last_step_timestamp_seconds", "training_data_wait_seconds",
    "training_straggler_ratio", "checkpoint_save_seconds", "checkpoint_last_save_timestamp_seconds",
    "checkpoint_last_step", "eval_ce", "expert_load_cv", "expert_load_max_min", "device_memory_in_use_bytes",
    "device_memory_peak_bytes", "device_memory_limit_bytes",
)
_LAYER = re.compile(r"train/load_(cv|max_min)/moe_layer_(\d+)$")
_MEMORY = re.compile(r"memory/([^/]+)/(in_use|peak|limit)_bytes$")
_EVAL_CE = re.compile(r"eval/(?:(.+)/)?ce$")


class PrometheusSink:
    """Serves the latest record on `port` (0: a free port, `self.port` says which) with labels run, process.
    `steps_done`: where training_steps_total starts (a resumed run's checkpoint step). `balance=False` leaves out the per-layer expert balance (every process computes the same figures: process 0
    exports them)."""

    def __init__(self, *, port: int, run: str, process: int, steps_done: int = 0, linger_s: float = 0.0,
                 balance: bool = True):
        self.labels = {"run": run, "process": str(process)}
        self.linger_s, self.balance = linger_s, balance
        self._lock = threading.Lock()
        self._phase = ""
        self._steps, self._skipped = float(steps_done), 0.0  # a resumed run counts on from its checkpoint
        self._gauges: dict[str, float] = {}  # metric name -> value, of the current phase
        self._process: dict[str, float] = {}  # label-less (run, process only) gauges
        self._straggler: tuple[str, float] | None = None  # (slowest process, ratio)
        self._eval: dict[str, float] = {}  # domain -> CE of the last evaluation
        self._eval_phase = ""
        self._layers: dict[tuple[str, str], float] = {}  # (metric, layer) -> value
        self._memory: dict[tuple[str, str], float] = {}  # (metric, device) -> value
        self.registry = CollectorRegistry(auto_describe=False)
        names = list(self.labels)
        self._step_seconds = Histogram("training_step_seconds", "Mean step time of each log interval.", names,
                                       buckets=STEP_BUCKETS, registry=self.registry).labels(**self.labels)
        self._save_seconds = Histogram("checkpoint_save_seconds", "Seconds the training loop blocked per "
                                       "checkpoint save (the write itself is asynchronous).", names,
                                       buckets=STEP_BUCKETS, registry=self.registry).labels(**self.labels)
        self.registry.register(self)
        self._server, self._thread = start_http_server(port, addr="0.0.0.0", registry=self.registry)
        self.port = self._server.server_port
        logging.info("prometheus exporter: http://%s:%d/metrics", socket.gethostname(), self.port)

    def write(self, step: int, scalars: Mapping[str, float], phase: str) -> None:
        with self._lock:
            if "train/loss" in scalars:
                self._train(step, scalars, phase)
            evals = {m.group(1) or "all": v for k, v in scalars.items() if (m := _EVAL_CE.match(k))}
            if evals:
                self._eval, self._eval_phase = evals, phase
            if "checkpoint/save_s" in scalars:
                self._save_seconds.observe(scalars["checkpoint/save_s"])
            for key, metric in (("checkpoint/saved_at", "checkpoint_last_save_timestamp_seconds"),
                                ("checkpoint/step", "checkpoint_last_step"),
                                ("train/data_wait_s", "training_data_wait_seconds")):
                if key in scalars:
                    self._process[metric] = scalars[key]
            if "straggler/ratio" in scalars:
                self._straggler = (str(int(scalars["straggler/process"])), scalars["straggler/ratio"])
            for key, value in scalars.items():
                if m := _MEMORY.match(key):
                    self._memory[(f"device_memory_{m.group(2)}_bytes", m.group(1))] = value

    def _train(self, step: int, scalars: Mapping[str, float], phase: str) -> None:
        if phase != self._phase:
            self._gauges, self._phase = {}, phase  # the old phase's series end here
        self._steps = float(step)
        self._skipped = scalars.get("train/nonfinite_total", self._skipped)
        self._process["training_last_step_timestamp_seconds"] = time.time()
        self._gauges.update({name: scalars[key] for key, (name, _) in _STEP_GAUGES.items() if key in scalars})
        if "train/step_s" in scalars:
            self._step_seconds.observe(scalars["train/step_s"])
        if self.balance:
            for key, value in scalars.items():
                if m := _LAYER.match(key):
                    self._layers[(f"expert_load_{m.group(1)}", m.group(2))] = value

    def collect(self) -> Iterator[Metric]:
        """What a scrape reads (prometheus_client calls this from its server thread)."""
        names, values = list(self.labels), list(self.labels.values())
        with self._lock:
            steps = CounterMetricFamily("training_steps", "Steps the run has completed.", labels=names)
            steps.add_metric(values, self._steps)
            skipped = CounterMetricFamily("training_skipped_steps", "Steps skipped because their loss or gradient "
                                          "was not finite or spiked.", labels=names)
            skipped.add_metric(values, self._skipped)
            yield from (steps, skipped)
            for name, doc in _STEP_GAUGES.values():
                if name in self._gauges:
                    yield self._gauge(name, doc, {"phase": self._phase}, self._gauges[name])
            for name, value in self._process.items():
                yield self._gauge(name, _PROCESS_HELP[name], {}, value)
            if self._straggler is not None:
                yield self._gauge("training_straggler_ratio", "Host seconds per step of the slowest process over "
                                  "the median process's, at the last exchange.",
                                  {"slowest_process": self._straggler[0]}, self._straggler[1])
            if self._eval:
                family = GaugeMetricFamily("eval_ce", "Held-out next-token CE of the last evaluation; domain "
                                           "\"all\" is the phase's whole mixture.", labels=[*names, "phase", "domain"])
                for domain, value in sorted(self._eval.items()):
                    family.add_metric([*values, self._eval_phase, domain], value)
                yield family
            yield from self._by_label(self._layers, "layer", _LAYER_HELP)
            yield from self._by_label(self._memory, "device", _MEMORY_HELP)

    def _gauge(self, name: str, doc: str, extra: dict[str, str], value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=[*self.labels, *extra])
        family.add_metric([*self.labels.values(), *extra.values()], value)
        return family

    def _by_label(self, table: dict[tuple[str, str], float], label: str, docs: dict[str, str]) -> Iterator[Metric]:
        for name, doc in docs.items():
            rows = sorted((key, v) for (metric, key), v in table.items() if metric == name)
            if rows:
                family = GaugeMetricFamily(name, doc, labels=[*self.labels, label])
                for key, value in rows:
                    family.add_metric([*self.labels.values(), key], value)
                yield family

    def close(self) -> None:
        """Serve `linger_s` longer (the last record gets scraped), then stop the server; a second call does
        nothing."""
        if self._server is None:
            return
        if self.linger_s > 0:
            logging.info("prometheus exporter: serving %.0f s more so the last step is scraped", self.linger_s)
            time.sleep(self.linger_s)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._server = None


_PROCESS_HELP = {
    "training_last_step_timestamp_seconds": "Unix time at which the last logged step completed.",
    "training_data_wait_seconds": "Mean seconds per step the loop spent preparing the next batch, last interval.",
    "checkpoint_last_save_timestamp_seconds": "Unix time of the last checkpoint save (its asynchronous start).",
    "checkpoint_last_step": "Step of the last checkpoint saved.",
}
_LAYER_HELP = {
    "expert_load_cv": "Coefficient of variation (std / mean) of the tokens per expert of a MoE layer, last step.",
    "expert_load_max_min": "Most over fewest tokens per expert of a MoE layer (fewest floored at 1), last step.",
}
_MEMORY_HELP = {
    "device_memory_in_use_bytes": "Bytes in use on the device (CPU: the process's resident set).",
    "device_memory_peak_bytes": "Peak bytes in use on the device since the process started (CPU: peak RSS).",
    "device_memory_limit_bytes": "Bytes the device's allocator may use (CPU: the host's physical memory).",
}

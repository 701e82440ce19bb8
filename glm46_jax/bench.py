"""Training-step benchmark: warm-up + K timed steps of the real train step on synthetic tokens.

    python -m glm46_jax.bench --config=configs/pretrain.py:tiny [--steps=20 --warmup=3 --out=bench.json]
    python -m glm46_jax.bench --config=configs/pretrain.py:small --config.data.phases.general.global_batch=8

The step is exactly `train`'s (`pretrain.Pretraining.build`: Muon + AdamW, loss-free balancing, MTP and aux
losses, accumulation and remat from the config); tokens are uniform random ids, which cost the
same FLOPs as text. Prints a table and one JSON line; `--out` also writes the JSON.

MFU = flops_per_token x tokens/s / peak, with flops_per_token = 6 x (matmul weights a token
touches) + causal attention (`counting.flops_per_token`; remat recompute not counted). The peak:
on accelerators the datasheet dense bf16 number x device count (`metrics.PEAK_FLOPS_PER_DEVICE`);
on CPU the host's own measured fp32 matmul throughput (all virtual devices share its cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags

from glm46_jax import cli, run_config
from glm46_jax.errors import InputError
from glm46_jax.parallel import sharding
from glm46_jax.recipes import pretrain
from glm46_jax.run_config import RunConfig
from glm46_jax.monitoring import metrics

_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps after compilation.")
_OUT = flags.DEFINE_string("out", None, "Also write the JSON result here.")
_PHASE = flags.DEFINE_string("phase", None, "Curriculum phase whose shapes to time (default: the first).")


def git_commit() -> str:
    """The checkout's short commit, "+dirty" when tracked files differ from it: what a benchmark record names
    (benchmarks/ use it too)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=root, check=False).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def random_tokens(rows: int, seq_len: int, vocab: int, seed: int) -> np.ndarray:
    """[rows, seq_len + 1] uniform ids: inputs are [:, :-1], targets [:, 1:] (benchmarks/gpu's HF anchor trains
    on these same ids)."""
    return np.random.default_rng(seed).integers(0, vocab, (rows, seq_len + 1)).astype(np.int32)


def synthetic_batch(rows: int, seq_len: int, vocab: int, seed: int, packed: bool = False,
                    mean_document: int | None = None) -> dict[str, np.ndarray]:
    """Random tokens as a training batch. `packed`: laid out as the loader's concat packing lays out a pre-training
    batch (`loader.shift_row`: segment_ids 1, 2, ... per document, positions restarting at each, no loss on a
    document's first target), document lengths exponential with mean `mean_document` (default seq_len / 4, i.e.
    1,024 at 4,096; at least 2 tokens)."""
    mean_document = mean_document or max(2, seq_len // 4)
    tokens = random_tokens(rows, seq_len, vocab, seed)
    if not packed:
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    from glm46_jax.data import loader  # grain: only the packed layout needs the data stack

    rng = np.random.default_rng(seed + 1)
    out = []
    for row in tokens:
        lengths = []
        while sum(lengths) < len(row):
            lengths.append(max(2, int(rng.exponential(mean_document))))
        segments = np.repeat(np.arange(1, len(lengths) + 1), lengths)[:len(row)]
        positions = np.concatenate([np.arange(n) for n in lengths])[:len(row)]
        out.append(loader.shift_row({"tokens": row, "tokens_segment_ids": segments, "tokens_positions": positions},
                                    pad_id=0))
    return {k: np.stack([r[k] for r in out]) for k in out[0]}


def interleave(calls: dict[str, Any], rounds: int, warmup: int = 0) -> dict[str, list[float]]:
    """Seconds per call of each callable (each waits for its own work), `rounds` rounds of all of them, round r in
    the order rotated by r."""
    names = list(calls)
    for _ in range(warmup):
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - t0)
    return times


class PreparedStep:
    """The train step at one phase's shapes, its state and one batch on the devices, compiled once per named set
    of XLA compiler options (`jax.stages.Lowered.compile(compiler_options=...)`, e.g.
    {"xla_gpu_enable_command_buffer": ""}), so variants of one step run side by side in one process."""

    def __init__(self, cfg: RunConfig, devices: Sequence[jax.Device] | None = None, phase_name: str | None = None,
                 packed: bool = False, variants: dict[str, dict[str, Any]] | None = None):
        phases = {p.name: p for p in cfg.data.curriculum.phases}
        if phase_name is not None and phase_name not in phases:
            raise InputError(f"--phase={phase_name!r}: the curriculum's phases are {list(phases)}")
        self.cfg = cfg
        self.run, self.state = pretrain.Pretraining.build(cfg, devices)
        self.phase = phases[phase_name] if phase_name else cfg.data.curriculum.phases[0]
        self.rows, self.seq_len = self.phase.global_batch, self.phase.seq_len
        self.devices = list(self.run.mesh.devices.flatten())
        local = synthetic_batch(self.rows, self.seq_len, cfg.model.vocab_size, cfg.train.seed, packed)
        self.options = variants or {"default": {}}
        self.executables, self.compile_s = {}, {}
        with sharding.use_mesh(self.run.mesh):
            self.batch = self.run.device_batch(local)  # one process's rows (bench runs as a single process)
            self.ctrl = self.run.controls_at(0)  # MTP weight 0.3, balancing rate 1e-3: everything on
            lowered = self.run.steps_for(self.phase).lower(self.state, self.batch, self.ctrl, self.run.frozen)
            for name, options in self.options.items():
                t0 = time.perf_counter()
                self.executables[name] = lowered.compile(compiler_options=options or None)
                self.compile_s[name] = time.perf_counter() - t0
        self.metrics: dict[str, Any] = {}

    def __call__(self, variant: str = "default") -> None:
        """One step of `variant`, waited for (the state carries on from whichever variant ran last)."""
        with sharding.use_mesh(self.run.mesh):
            self.state, self.metrics = self.executables[variant](self.state, self.batch, self.ctrl, self.run.frozen)
            jax.block_until_ready(self.state)

    def interleave(self, steps: int, warmup: int, extra: dict[str, Any] | None = None) -> dict[str, list[float]]:
        """Seconds per step of every variant, run in turn A, B, A, B, ... (`extra`: more callables timed in the
        same rounds, e.g. a matmul peak probe), so drift on the device hits each alike. Each round starts one
        further along (A B P, B P A, P A B, ...): whatever runs just before a call (on the CPU a probe before the
        step slowed it by a third) precedes every variant equally often."""
        calls = {name: (lambda name=name: self(name)) for name in self.executables} | (extra or {})
        return interleave(calls, steps, warmup)

    def result(self, times: list[float], variant: str = "default") -> dict[str, Any]:
        """bench()'s record of one variant's step times."""
        cfg, phase, devs = self.cfg, self.phase, self.devices
        peak_flops, peak_source = metrics.system_peak(devs)
        tokens = self.rows * self.seq_len
        step_s = float(np.median(times))
        per_token = self.run.flops_per_token(phase)
        return {
            "preset": cfg.source.get("model", {}).get("preset", "?"), "device": f"{len(devs)} x {devs[0].device_kind}",
            "commit": git_commit(), "phase": phase.name, "global_batch": self.rows, "seq_len": self.seq_len,
            "accum_steps": cfg.train.accum_steps, "dtype": cfg.model.dtype, "remat": cfg.model.remat,
            "compile_s": self.compile_s[variant], "step_s_median": step_s, "step_s_min": float(np.min(times)),
            "step_s_max": float(np.max(times)), "tokens_per_s": tokens / step_s,
            "model_flops_per_token": per_token, "achieved_tflops": per_token * tokens / step_s / 1e12,
            "peak_tflops": peak_flops / 1e12 if peak_flops else None, "peak_source": peak_source,
            "mfu": metrics.mfu(per_token, tokens / step_s, 1, peak_flops) if peak_flops else None,
            "peak_memory_gib": (metrics.device_memory_peak_bytes(devs[0]) or 0) / 2**30,
            "memory_source": "host RSS" if devs[0].platform == "cpu" else "device peak_bytes_in_use (device 0)",
            "final_loss": float(self.metrics["loss"]), "steps": len(times),
        }


def bench(cfg: RunConfig, steps: int = 20, warmup: int = 3,
          devices: Sequence[jax.Device] | None = None, phase_name: str | None = None,
          packed: bool = False) -> dict[str, Any]:
    """Time the train step at a curriculum phase's shapes (default: the first phase, full batch)."""
    if steps < 1 or warmup < 0:
        raise InputError(f"--steps={steps} must be >= 1 and --warmup={warmup} >= 0")
    step = PreparedStep(cfg, devices, phase_name, packed)
    times = step.interleave(steps, warmup)["default"]
    return {**step.result(times), "warmup": warmup}


def _table(r: dict[str, Any]) -> str:
    rows = [("preset", r["preset"]), ("device", r["device"]), ("commit", r["commit"]),
            ("phase: batch x seq (accum)",
             f"{r['phase']}: {r['global_batch']} x {r['seq_len']} ({r['accum_steps']})"),
            ("dtype / remat", f"{r['dtype']} / {r['remat']}"), ("compile", f"{r['compile_s']:.1f} s"),
            ("step time (median, min-max)",
             f"{r['step_s_median'] * 1e3:.1f} ms ({r['step_s_min'] * 1e3:.1f}-{r['step_s_max'] * 1e3:.1f})"),
            ("tokens/s", f"{r['tokens_per_s']:,.0f}"),
            ("model TFLOP/s", (f"{r['achieved_tflops']:.4g} (of {r['peak_tflops'] or float('nan'):.4g}: "
                              f"{r['peak_source']})")),
            ("MFU", f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"),
            ("peak memory", f"{r['peak_memory_gib']:.2f} GiB ({r['memory_source']})")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv):
    del argv
    cfg = run_config.from_config_dict(flags.FLAGS.config)
    result = bench(cfg, _STEPS.value, _WARMUP.value, phase_name=_PHASE.value)
    if jax.process_index() == 0:
        print(_table(result))
        print(json.dumps(result))
        if _OUT.value:
            with open(_OUT.value, "w") as f:
                json.dump(result, f, indent=2)



def run() -> None:
    """The command line (`python -m glm46_jax.bench`)."""
    # Defined here, not at import: bench and train each own a --config flag.
    config_flags.DEFINE_config_file("config", None, "Training config, e.g. configs/pretrain.py:tiny.",
                                      lock_config=True)
    cli.run_absl(main)


if __name__ == "__main__":
    run()

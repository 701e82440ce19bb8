"""Training-step benchmark: warm-up + K timed steps of the real train step on synthetic tokens.

    python -m glm46_jax.bench --config=configs/pretrain.py:tiny [--steps=20 --warmup=3 --out=bench.json]
    python -m glm46_jax.bench --config=configs/pretrain.py:small --config.data.phases.general.global_batch=8

The step is exactly `train`'s (`pretrain.build`: Muon + AdamW, loss-free balancing, MTP and aux
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
from glm46_jax.cli import InputError
from glm46_jax.parallel import sharding
from glm46_jax.recipes import pretrain
from glm46_jax.run_config import RunConfig
from glm46_jax.training import metrics

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


def bench(cfg: RunConfig, steps: int = 20, warmup: int = 3,
          devices: Sequence[jax.Device] | None = None, phase_name: str | None = None) -> dict[str, Any]:
    """Time the train step at a curriculum phase's shapes (default: the first phase, full batch)."""
    if steps < 1 or warmup < 0:
        raise InputError(f"--steps={steps} must be >= 1 and --warmup={warmup} >= 0")
    phases = {p.name: p for p in cfg.data.curriculum.phases}
    if phase_name is not None and phase_name not in phases:
        raise InputError(f"--phase={phase_name!r}: the curriculum's phases are {list(phases)}")
    run, state = pretrain.build(cfg, devices)
    phase = phases[phase_name] if phase_name else cfg.data.curriculum.phases[0]
    rows, seq_len = phase.global_batch, phase.seq_len
    x = np.random.default_rng(cfg.train.seed).integers(0, cfg.model.vocab_size, (rows, seq_len + 1))
    devs = list(run.mesh.devices.flatten())
    with sharding.use_mesh(run.mesh):
        # One process's rows (bench runs as a single process).
        batch = run.device_batch({"inputs": x[:, :-1].astype(np.int32), "targets": x[:, 1:].astype(np.int32)})
        ctrl = run.controls_at(0)  # MTP weight 0.3, balancing rate 1e-3: everything on
        t0 = time.perf_counter()
        step = run.steps_for(phase).lower(state, batch, ctrl, run.frozen).compile()
        compile_s = time.perf_counter() - t0
        for _ in range(warmup):
            state, m = step(state, batch, ctrl, run.frozen)
        jax.block_until_ready(state)
        times = []
        for _ in range(steps):  # per-step times: the spread shows noise from other tenants
            t0 = time.perf_counter()
            state, m = step(state, batch, ctrl, run.frozen)
            jax.block_until_ready(state)
            times.append(time.perf_counter() - t0)
    peak_flops, peak_source = metrics.system_peak(devs)
    tokens = rows * seq_len
    step_s = float(np.median(times))
    flops = run.flops_per_token(phase) * tokens / step_s
    return {
        "preset": cfg.source.get("model", {}).get("preset", "?"), "device": f"{len(devs)} x {devs[0].device_kind}",
        "commit": git_commit(), "phase": phase.name, "global_batch": rows, "seq_len": seq_len,
        "accum_steps": cfg.train.accum_steps, "dtype": cfg.model.dtype, "remat": cfg.model.remat,
        "compile_s": compile_s, "step_s_median": step_s, "step_s_min": float(np.min(times)),
        "step_s_max": float(np.max(times)), "tokens_per_s": tokens / step_s,
        "model_flops_per_token": run.flops_per_token(phase), "achieved_tflops": flops / 1e12,
        "peak_tflops": peak_flops / 1e12 if peak_flops else None, "peak_source": peak_source,
        "mfu": metrics.mfu(run.flops_per_token(phase), tokens / step_s, 1, peak_flops) if peak_flops else None,
        "peak_memory_gib": (metrics.device_memory_peak_bytes(devs[0]) or 0) / 2**30,
        "memory_source": "host RSS" if devs[0].platform == "cpu" else "device peak_bytes_in_use (device 0)",
        "final_loss": float(m["loss"]), "steps": steps, "warmup": warmup,
    }


def _table(r: dict[str, Any]) -> str:
    rows = [("preset", r["preset"]), ("device", r["device"]), ("commit", r["commit"]),
            ("phase: batch x seq (accum)",
             f"{r['phase']}: {r['global_batch']} x {r['seq_len']} ({r['accum_steps']})"),
            ("dtype / remat", f"{r['dtype']} / {r['remat']}"), ("compile", f"{r['compile_s']:.1f} s"),
            ("step time (median, min-max)",
             f"{r['step_s_median'] * 1e3:.1f} ms ({r['step_s_min'] * 1e3:.1f}-{r['step_s_max'] * 1e3:.1f})"),
            ("tokens/s", f"{r['tokens_per_s']:,.0f}"),
            ("model TFLOP/s", f"{r['achieved_tflops']:.4g} (of {r['peak_tflops'] or float('nan'):.4g}: "
                              f"{r['peak_source']})"),
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

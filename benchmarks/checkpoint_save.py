"""How long a checkpoint save blocks the training loop: async (what `train` does) vs synchronous.

    PYTHONPATH=. python benchmarks/checkpoint_save.py --config=configs/pretrain.py:tiny [--saves 5]
    PYTHONPATH=. python benchmarks/checkpoint_save.py --config=configs/pretrain.py:small \
        --config.model.num_hidden_layers=4      # the small preset's widths, fewer layers (host RAM)

The state is `pretrain.Pretraining.build`'s: params + Muon/AdamW state + correction biases, exactly what `train`
checkpoints, written by the same `Checkpointer` into a temporary directory. For each mode it saves
`--saves` times; "blocking" is the time `Checkpointer.save` holds the caller (with async saving: the
copy off the devices, then the write runs in Orbax's background thread), "total" is until the step
is committed on disk. Prints a table and one JSON line.
"""

from __future__ import annotations

import json
import platform
import tempfile
import time

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags

from glm46_jax import cli
from glm46_jax.recipes.pretrain import Pretraining
from glm46_jax.run_config import from_config_dict
from glm46_jax.bench import git_commit
from glm46_jax.training.checkpoint import Checkpointer

_SAVES = flags.DEFINE_integer("saves", 5, "Saves timed per mode.")
_DIR = flags.DEFINE_string("dir", None, "Where to write (default: a temporary directory, removed after).")


def _time_saves(directory: str, state, saves: int, async_save: bool) -> tuple[list[float], list[float]]:
    ckpt = Checkpointer(directory, every=1, keep=2, async_save=async_save)
    blocking, total = [], []
    for step in range(1, saves + 1):
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        ckpt.save(step, state, {"bench": step}, {"bench": True})
        blocking.append(time.perf_counter() - t0)
        ckpt.wait()
        total.append(time.perf_counter() - t0)
    ckpt.close()
    return blocking, total


def main(argv):
    del argv
    cfg = from_config_dict(flags.FLAGS.config)
    run, state = Pretraining.build(cfg)
    leaves = jax.tree.leaves((state.params, state.buffers, state.opt_state))
    state_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    result = {"preset": cfg.source["model"]["preset"], "num_hidden_layers": cfg.model.num_hidden_layers,
              "params": n_params, "state_gib": state_bytes / 2**30, "mesh": dict(run.mesh.shape),
              "device": f"{jax.devices()[0].device_kind} x{jax.device_count()} ({platform.processor() or 'cpu'})",
              "commit": git_commit(), "saves": _SAVES.value}
    with tempfile.TemporaryDirectory(dir=_DIR.value) as tmp:
        for mode, async_save in (("async", True), ("sync", False)):
            blocking, total = _time_saves(f"{tmp}/{mode}", state, _SAVES.value, async_save)
            # The first save also creates directories and traces Orbax's handlers: report the rest.
            b, t = (blocking[1:], total[1:]) if len(blocking) > 1 else (blocking, total)
            result[mode] = {"blocking_ms_median": 1e3 * float(np.median(b)),
                            "blocking_ms_first": 1e3 * blocking[0],
                            "total_s_median": float(np.median(t)),
                            "write_gib_per_s": result["state_gib"] / float(np.median(t))}
    print(f"{result['preset']} ({result['num_hidden_layers']} layers, {n_params / 1e9:.3f} B params), "
          f"state {result['state_gib']:.2f} GiB on {result['device']}, commit {result['commit']}")
    for mode in ("async", "sync"):
        r = result[mode]
        print(f"  {mode:5s}: loop blocked {r['blocking_ms_median']:9.1f} ms per save (first "
              f"{r['blocking_ms_first']:.0f} ms); committed after {r['total_s_median']:.2f} s "
              f"({r['write_gib_per_s']:.2f} GiB/s)")
    print(json.dumps(result))


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", None, "Training config, e.g. configs/pretrain.py:tiny.",
                                      lock_config=True)
    cli.run_absl(main)

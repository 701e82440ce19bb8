"""Host offload (training/offload.py): the optimizer state in host memory between steps gives bit-identical losses,
parameters and optimizer state to the same run on the device, across a checkpoint and a resume; the step's program
really keeps it in host memory; the plan tool counts it as host memory."""

import json
import os

import jax
import numpy as np
import pytest
from test_train import _one_phase_config

from glm46_jax.errors import InputError
from glm46_jax.run_config import from_config_dict
from glm46_jax.train import train

STEPS = 4


def _losses(run_dir: str) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["train/loss"] for r in map(json.loads, f) if "train/loss" in r}


def _config(run_dir, corpus, steps, offload):
    config = _one_phase_config(run_dir, corpus, steps)  # test_train's shapes and mesh: its programs are shared
    config.optim.offload = offload
    config.checkpoint.update(every=2, async_save=False)
    config.optim.update(decay_steps=STEPS)  # the same schedule for the interrupted run
    return config


def _memory_kinds(tree) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def test_offloaded_optimizer_state_trains_and_resumes_bit_identically(tmp_path, sample_corpus):
    devices = jax.devices()[:1]
    on_device = str(tmp_path / "device")
    state, _ = train(from_config_dict(_config(on_device, sample_corpus, STEPS, "none")), devices)
    assert _memory_kinds(state.opt_state) == {"device"}

    offloaded = str(tmp_path / "host")
    train(from_config_dict(_config(offloaded, sample_corpus, 2, "optimizer")), devices)  # stops after step 2
    host_state, summary = train(from_config_dict(_config(offloaded, sample_corpus, STEPS, "optimizer")), devices)
    assert summary["start_step"] == 3
    assert _memory_kinds(host_state.opt_state) == {"pinned_host"}
    assert _memory_kinds(host_state.params) == {"device"}
    want = _losses(on_device)
    assert sorted(want) == list(range(1, STEPS + 1)) and _losses(offloaded) == want
    for tree in ("params", "opt_state"):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(getattr(state, tree)),
                                jax.tree.leaves(getattr(host_state, tree)), strict=True):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"{tree}{jax.tree_util.keystr(path)}")


def test_an_unknown_offload_is_one_config_error(tmp_path, sample_corpus):
    with pytest.raises(InputError, match=r"optim.offload='gpu'.*one of \('none', 'optimizer'\)"):
        from_config_dict(_config(str(tmp_path), sample_corpus, 1, "gpu"))

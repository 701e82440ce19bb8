"""Pre-training configs: `get_config("<preset>")` for tiny | small | glm45_air | glm45 | glm46.

    python -m glm46_jax.train --config=configs/pretrain.py:tiny
    python -m glm46_jax.train --config=configs/pretrain.py:tiny --config.train.steps=10 --config.run_dir=/tmp/r
    python -m glm46_jax.train --config=configs/pretrain.py:small --config.model.remat=full --config.mesh.data=8

Every ModelConfig field of the preset is listed under `model`, so any of them can be overridden
(`--config.model.num_hidden_layers=4`); `glm46_jax.config.model_config_from_dict` turns the
section into the typed ModelConfig. `optim.decay_steps` follows `train.steps` unless set.

Only "tiny" runs here (CPU, the built-in stdlib-docstring byte corpus). The others carry the
GLM-4.5 recipe (Muon + AdamW, peak 2.5e-4 -> 2.5e-5 cosine, seq 4096, ~16M tokens per batch);
they need the real data pipeline and a GPU cluster.
"""

import dataclasses

import ml_collections
from ml_collections import config_dict

from glm46_jax.balancing import BalanceConfig
from glm46_jax.config import get_preset
from glm46_jax.loss import LossConfig
from glm46_jax.optim import OptimConfig

# preset -> (model overrides, mesh, train, optim). Only what differs from the defaults below.
_PRESETS = {
    # ~1-2 min on a 2-core CPU including compile; next-token CE falls from ~6.2 (ln 512) to ~2.
    "tiny": dict(
        model=dict(),
        mesh=dict(data=-1),
        train=dict(steps=300, global_batch=16, seq_len=128, log_every=20, eval_every=100, eval_batches=4),
        optim=dict(lr=3e-3, end_lr=3e-4, warmup_steps=30),
        # 300 steps x 2048 tokens = 614k tokens: both token-scheduled switches happen in the run.
        loss=dict(mtp_boundary_tokens=400_000.0),
        balance=dict(boundary_tokens=400_000.0),
    ),
    "small": dict(
        model=dict(remat="save_matmuls"),
        mesh=dict(data=-1),
        train=dict(steps=20_000, global_batch=256, seq_len=4096),
        optim=dict(lr=1e-3, end_lr=1e-4, warmup_steps=500),
    ),
    "glm45_air": dict(
        model=dict(dtype="bfloat16", remat="full"),
        mesh=dict(data=-1, expert=8),
        train=dict(steps=500_000, global_batch=4096, seq_len=4096),
        optim=dict(lr=2.5e-4, end_lr=2.5e-5, warmup_steps=2000),
    ),
    "glm45": dict(
        model=dict(dtype="bfloat16", remat="full"),
        mesh=dict(data=-1, expert=8),
        train=dict(steps=500_000, global_batch=4096, seq_len=4096),
        optim=dict(lr=2.5e-4, end_lr=2.5e-5, warmup_steps=2000),
    ),
    "glm46": dict(
        model=dict(dtype="bfloat16", remat="full"),
        mesh=dict(data=-1, expert=8),
        train=dict(steps=500_000, global_batch=4096, seq_len=4096),
        optim=dict(lr=2.5e-4, end_lr=2.5e-5, warmup_steps=2000),
    ),
}


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    if preset not in _PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(_PRESETS)}")
    p = _PRESETS[preset]
    c = ml_collections.ConfigDict()
    c.run_dir = f"runs/{preset}"

    model = dataclasses.asdict(get_preset(preset))
    model["eos_token_id"] = list(model["eos_token_id"])
    model["pad_token_id"] = config_dict.placeholder(int) if model["pad_token_id"] is None else model["pad_token_id"]
    c.model = dict(preset=preset, **{**model, **p["model"]})

    c.mesh = dict(data=1, tensor=1, expert=1, pipeline=1)
    c.mesh.update(p["mesh"])

    # accum_steps: micro-batches per step (global_batch must divide); max_nonfinite: stop after
    # this many non-finite steps in a row (each is skipped).
    c.train = dict(steps=1000, global_batch=16, seq_len=128, seed=0, log_every=50, eval_every=500, eval_batches=8,
                   accum_steps=1, max_nonfinite=10, tensorboard=True)
    c.train.update(p["train"])

    # Every OptimConfig field (glm46_jax/optim.py): Muon for hidden matrices, AdamW for the rest.
    c.optim = dataclasses.asdict(OptimConfig(lr=2.5e-4, end_lr=2.5e-5, warmup_steps=2000))
    c.optim.update(p["optim"])
    c.optim.decay_steps = c.train.get_ref("steps")  # cosine ends with the run, through overrides too

    # GLM-4.5 (GLM_SPEC §5.1): MTP lambda 0.3 -> 0.1 and bias rate 1e-3 -> 0 at 15T tokens,
    # sequence aux loss 1e-4. Boundaries are in tokens (floats: 15e12 overflows an int32 flag parser).
    c.loss = dataclasses.asdict(LossConfig())
    c.loss.update(p.get("loss", {}))
    c.balance = dataclasses.asdict(BalanceConfig())
    c.balance.update(p.get("balance", {}))
    return c

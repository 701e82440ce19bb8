"""Mid-training configs (domain continual pre-training): `get_config("<preset>")` for tiny | glm46.

    make train && python -m glm46_jax.train --config=configs/midtrain.py:tiny
    python -m glm46_jax.train --config=configs/midtrain.py:glm46 --config.checkpoint.init_from=runs/glm46_hf

A mid-training run starts from another run's weights (`checkpoint.init_from`: a pre-training run dir, or an
HF import written by `python -m glm46_jax.convert hf-to-ckpt`), not from its optimizer state or step: a
fresh warm-up and decay at a lower peak LR, with optional layer-wise LR decay (`optim.layer_decay`). Its data
is the domain to learn plus replay of general data, and it is watched per domain: `train.eval_per_domain`
logs eval/<domain>/ce beside the mixture's eval/ce, and the checkpoint kept as best is the one with the lowest
held-out CE of the domain (`checkpoint.keep_best`, `best_metric`).

Every field is `configs/pretrain.py`'s; this file sets what differs. GLM-4.5 trains its mid-training phases
after the 15T-token boundary, so the MTP weight is its later 0.1 and loss-free balancing is off from the start
(docs/training.md#mtp-loss-weight, docs/training.md#loss-free-balancing).

"tiny" continues `make train`'s run (runs/tiny) on the sample corpus: code is the domain, prose the general
data it must not forget.
"""

import os

import ml_collections

from glm46_jax.errors import InputError
from glm46_jax.run_config import config_file

B = 10**9

_PRESETS = {
    "tiny": dict(
        base="tiny", init_from="runs/tiny", domain="code",
        # 100 steps of 16 x 256 best-fit rows at RoPE 1e6, the pre-training run's last phase shapes.
        phase=dict(tokens=409_600, seq_len=256, global_batch=16, rope_theta=1e6, pack="best_fit",
                   mixture=dict(code=0.8, prose=0.2)),
        train=dict(log_every=10, eval_every=25, eval_batches=4),
        checkpoint=dict(every=25, keep=2),
        optim=dict(lr=1e-3, end_lr=1e-4, warmup_steps=10),
    ),
    "glm46": dict(
        base="glm46", init_from="", domain="code",
        phase=dict(tokens=100 * B, seq_len=32768, global_batch=512, rope_theta=1e6, pack="best_fit",
                   mixture=dict(code=0.7, web=0.2, math_science=0.1)),
        train=dict(log_every=50, eval_every=500, eval_batches=8),
        checkpoint=dict(every=500, keep=3),
        # A tenth of pre-training's peak, decayed to its end value; the lower layers move less.
        optim=dict(lr=2.5e-5, end_lr=2.5e-6, warmup_steps=500, layer_decay=0.9),
    ),
}


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    if preset not in _PRESETS:
        raise InputError(f"unknown preset {preset!r}; choose one of {sorted(_PRESETS)}")
    p = _PRESETS[preset]
    c = config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "pretrain.py"), p["base"])
    c.run_dir = f"runs/midtrain_{preset}"
    c.checkpoint.update(init_from=p["init_from"], keep_best=True, best_metric=f"eval/{p['domain']}/ce",
                        **p["checkpoint"])
    c.train.update(eval_per_domain=True, **p["train"])
    c.optim.update(decay_steps=0, **p["optim"])  # 0: the schedule spans this run
    c.loss.update(mtp_boundary_tokens=0.0)  # past GLM's 15T boundary: mtp_weight_after from the start
    c.balance.update(boundary_tokens=0.0)  # and balancing's rate_after (0: the biases stay as trained)
    c.data.phases = ml_collections.ConfigDict({"midtrain": p["phase"]}, sort_keys=False)
    c.data.phase_order = ("midtrain",)
    return c

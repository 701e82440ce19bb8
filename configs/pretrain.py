"""Pre-training configs: `get_config("<preset>")` for tiny | serve | small | glm45_air | glm45 | glm46.

    python -m glm46_jax.train --config=configs/pretrain.py:tiny
    python -m glm46_jax.train --config=configs/pretrain.py:tiny --config.train.steps=10 --config.run_dir=/tmp/r
    python -m glm46_jax.train --config=configs/pretrain.py:small --config.model.remat=full --config.mesh.data=8

Every ModelConfig field of the preset is listed under `model`, so any of them can be overridden
(`--config.model.num_hidden_layers=4`); `glm46_jax.config.model_config_from_dict` turns the
section into the typed ModelConfig. Likewise every other section lists every field of its dataclass, with the
dataclass's defaults (written there once, each field documented there): `mesh`, `train`, `checkpoint`, `data`,
`distributed` (glm46_jax/run_config.py), `optim` (OptimConfig), `loss` (LossConfig), `balance` (BalanceConfig).

`data.phases` is the curriculum (`glm46_jax.data.curriculum`), run in `data.phase_order`: name -> token budget,
sequence length, global batch (rows, optionally ramped), domain mixture, RoPE theta and packing.
A run lasts until the curriculum's tokens are spent (or `train.steps` if > 0); the lr schedule's
`optim.decay_steps` = 0 means "the run's number of steps".

"tiny" runs on a CPU over the sample corpus (`python -m data_prep sample --out data/sample`, which
`make train` builds). The others carry the GLM-4.5 recipe (docs/training.md#summary): Muon + AdamW, peak
2.5e-4 -> 2.5e-5 cosine over pre- and mid-training, batch 16M -> 64M tokens over the first 500B,
15T general + 7T code & reasoning at 4K, then 500B repo code + 500B synthetic reasoning at 32K
(RoPE theta 1e4 -> 1e6) and 100B long-context & agent at 128K. GLM publishes no mixture weights:
the domains and weights below are placeholders naming what each phase upsamples.
"""

import dataclasses

import ml_collections
from ml_collections import config_dict

from glm46_jax.errors import InputError
from glm46_jax.config import get_preset
from glm46_jax.run_config import CheckpointConfig, DataConfig, DistributedConfig, MeshConfig, TrainConfig
from glm46_jax.training.balancing import BalanceConfig
from glm46_jax.training.loss import LossConfig
from glm46_jax.monitoring.monitor import MonitorConfig
from glm46_jax.training.optim import OptimConfig

T, B = 10**12, 10**9


def _glm45_phases(rope_long: float = 1e6) -> dict:
    """The GLM-4.5 report's schedule (token budgets, lengths, RoPE) at 64M-token batches."""
    return {
        "general": dict(tokens=15 * T, seq_len=4096, global_batch=16384, rope_theta=1e4, pack="concat",
                        # 16M -> 64M tokens per batch over the first 500B tokens, in 4M-token steps.
                        batch_ramp=dict(start_rows=4096, ramp_tokens=500 * B, increment=1024),
                        mixture=dict(web=0.6, multilingual=0.1, books_papers=0.1, code=0.15, math_science=0.05)),
        "code_reasoning": dict(tokens=7 * T, seq_len=4096, global_batch=16384, rope_theta=1e4, pack="concat",
                               mixture=dict(web=0.3, multilingual=0.05, books_papers=0.1, code=0.35,
                                            math_science=0.2)),
        "repo_code": dict(tokens=500 * B, seq_len=32768, global_batch=2048, rope_theta=rope_long, pack="best_fit",
                          mixture=dict(repo_code=0.7, web=0.15, code=0.15)),
        "synthetic_reasoning": dict(tokens=500 * B, seq_len=32768, global_batch=2048, rope_theta=rope_long,
                                    pack="best_fit", mixture=dict(synthetic_reasoning=0.7, web=0.15, code=0.15)),
        "long_context_agent": dict(tokens=100 * B, seq_len=131072, global_batch=512, rope_theta=rope_long,
                                   pack="best_fit", mixture=dict(long_context=0.5, agent=0.3, web=0.2)),
    }


def _glm46_phases() -> dict:
    """GLM-4.6: GLM-4.5's schedule with its context grown 32K -> 64K -> 128K -> 200K. GLM publishes no GLM-4.6
    training details (the README says only "from 128K to 200K"; the config keeps RoPE theta 1e6, no scaling), so
    the 64K and 200K phases are our choice: RoPE unchanged at 1e6 (as from 32K to 128K), the report's 64M-token
    batch (1,024 rows of 64K; 320 rows of 202,752 tokens, the model's max_position_embeddings), and budgets a
    tenth of the 32K phases' (docs/long_context.md#the-200k-phase)."""
    p = _glm45_phases()
    return {
        **{k: p[k] for k in ("general", "code_reasoning", "repo_code", "synthetic_reasoning")},
        "long_context_64k": dict(tokens=100 * B, seq_len=65536, global_batch=1024, rope_theta=1e6, pack="best_fit",
                                 mixture=dict(long_context=0.5, repo_code=0.3, web=0.2)),
        "long_context_agent": p["long_context_agent"],
        "long_context_200k": dict(tokens=50 * B, seq_len=202752, global_batch=320, rope_theta=1e6, pack="best_fit",
                                  mixture=dict(long_context=0.6, agent=0.3, web=0.1)),
    }


# One mesh serves a whole run (every phase), so GLM-4.5/4.6's is the one their 128K phase needs: each sequence
# split over context=8 devices, data taking the rest (16 on 2048 H100s). The plan tool puts every phase under
# 80 GB per device on 2048 H100s (docs/long_context.md#the-glm-45-mesh). The 4K phases would run faster with
# context=1 (e.g. data=-1, tensor=8, expert=2): stop the run at the 32K phase's start (train.steps) and resume
# with this mesh; checkpoints restore onto any mesh.
_GLM45_MESH = dict(data=-1, tensor=8, expert=2, context=8)
# GLM-4.5-Air (12B active): the plan fits its 4K / 32K / 128K phases on 512 H100s (data 8) at 26 / 31 / 48 GiB.
_GLM45_AIR_MESH = dict(data=-1, tensor=4, expert=2, context=8)

# preset -> overrides of the defaults in get_config. Only what differs. The presets with 32K+ phases use
# blockwise attention (no [s, s] scores, any backend: docs/long_context.md#blockwise-attention) or "auto" (cuDNN's
# causal flash attention on a GPU where it takes the case, else blockwise: docs/performance.md#attention); the big
# ones split sequences over `context`, which only blockwise does.
_PRESETS = {
    # ~2 min on a 2-core CPU including compile: 200 steps of 16 x 128 tokens (prose-heavy), then
    # 50 steps of 16 x 256 code-heavy rows, best-fit packed, at RoPE theta 1e6.
    "tiny": dict(
        # The CPU-fastest runtime settings measured on the 2-core anchor (docs/performance.md): the shallow
        # stacks unrolled, blockwise attention (no [s, s] probabilities kept for the backward).
        model=dict(scan_unroll=8, attention_impl="blockwise"),
        mesh=dict(data=-1),
        train=dict(log_every=25, eval_every=100, eval_batches=4),
        checkpoint=dict(every=100),
        optim=dict(lr=3e-3, end_lr=3e-4, warmup_steps=30),
        # GLM switches at the end of the general phase (15T); here at its end too.
        loss=dict(mtp_boundary_tokens=409_600.0),
        balance=dict(boundary_tokens=409_600.0),
        data=dict(root="data/sample", phases={
            "general": dict(tokens=409_600, seq_len=128, global_batch=16, rope_theta=1e4, pack="concat",
                            mixture=dict(prose=0.6, code=0.4)),
            "code_long": dict(tokens=204_800, seq_len=256, global_batch=16, rope_theta=1e6, pack="best_fit",
                              mixture=dict(code=0.8, prose=0.2)),
        }),
    ),
    "small": dict(
        model=dict(remat="save_matmuls", attention_impl="auto"),
        mesh=dict(data=-1),
        optim=dict(lr=1e-3, end_lr=1e-4, warmup_steps=500),
        data=dict(phases={
            "general": dict(tokens=80 * B, seq_len=4096, global_batch=256, rope_theta=1e4, pack="concat",
                            mixture=dict(web=0.7, code=0.3)),
            "code_long": dict(tokens=4 * B, seq_len=32768, global_batch=32, rope_theta=1e6, pack="best_fit",
                              mixture=dict(code=0.7, web=0.3)),
        }),
    ),
    "glm45_air": dict(model=dict(dtype="bfloat16", remat="full", attention_impl="blockwise"),
                      mesh=_GLM45_AIR_MESH,
                      data=dict(phases=_glm45_phases())),
    "glm45": dict(model=dict(dtype="bfloat16", remat="full", attention_impl="blockwise"),
                  mesh=_GLM45_MESH,
                  data=dict(phases=_glm45_phases())),
    "glm46": dict(model=dict(dtype="bfloat16", remat="full", attention_impl="blockwise"),
                  mesh=_GLM45_MESH,
                  data=dict(phases=_glm46_phases())),
}

# The serving tests' model (docs/serving.md#the-serve-preset) trains like tiny, on the same corpus.
_PRESETS["serve"] = _PRESETS["tiny"]


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    if preset not in _PRESETS:
        raise InputError(f"unknown preset {preset!r}; choose one of {sorted(_PRESETS)}")
    p = _PRESETS[preset]
    c = ml_collections.ConfigDict()
    c.run_dir = f"runs/{preset}"

    model = dataclasses.asdict(get_preset(preset))
    model["eos_token_id"] = list(model["eos_token_id"])
    model["pad_token_id"] = config_dict.placeholder(int) if model["pad_token_id"] is None else model["pad_token_id"]
    c.model = dict(preset=preset, **{**model, **p["model"]})

    # Device counts per mesh axis; -1 = the devices the other axes leave.
    c.mesh = dataclasses.asdict(MeshConfig())
    c.mesh.update(p["mesh"])

    # Bad steps (a NaN/Inf, or with spike_factor > 0 a loss above spike_factor x its running mean, after
    # spike_warmup steps) are skipped; bad_steps="skip" stops the run after max_nonfinite of them in a row,
    # "rollback" restores the last checkpoint's weights after rollback_after in a row and goes on with the next data.
    c.train = dataclasses.asdict(TrainConfig())
    c.train.update(p.get("train", {}))

    # Orbax checkpoints in <run_dir>/checkpoints: how often, which are kept, where a run starts from.
    c.checkpoint = dataclasses.asdict(CheckpointConfig())
    c.checkpoint.update(p.get("checkpoint", {}))

    # The corpus written by data_prep (`<root>/<domain>/<split>/*.array_record` + metadata.json). Every DataConfig
    # field but the curriculum, which from_config_dict builds from `phases` and `phase_order`.
    c.data = {f.name: f.default for f in dataclasses.fields(DataConfig) if f.name != "curriculum"}
    c.data.update({k: v for k, v in p["data"].items() if k != "phases"})
    c.data.phases = ml_collections.ConfigDict(p["data"]["phases"], sort_keys=False)
    # ConfigDicts may sort their keys (and JSON dumps do): the order is stated, not implied.
    c.data.phase_order = tuple(p["data"]["phases"])

    # Multi-process start-up (glm46_jax/parallel/distributed.py): coordinator/num_processes/process_id all set =
    # explicit (launch/local_multiprocess.sh sets them); none set = Slurm's srun environment if present,
    # else one process. mode="off" forces one process. A process silent for heartbeat_timeout_s makes the
    # others abort (non-zero exit) instead of hanging.
    c.distributed = dataclasses.asdict(DistributedConfig())

    # What watches the run (docs/monitoring.md): metric sinks (jsonl, tensorboard, prometheus, wandb), the
    # Prometheus port (process i serves port + i), the hang watchdog, the straggler exchange.
    c.monitor = dataclasses.asdict(MonitorConfig())

    # Every OptimConfig field (glm46_jax/training/optim.py): Muon for hidden matrices, AdamW for the rest.
    # decay_steps 0: the schedule spans the run, however many steps that is.
    c.optim = dataclasses.asdict(OptimConfig(decay_steps=0))
    c.optim.update(p.get("optim", {}))

    # GLM-4.5 (docs/training.md#summary): MTP lambda 0.3 -> 0.1 and bias rate 1e-3 -> 0 at 15T tokens,
    # sequence aux loss 1e-4. Boundaries are in tokens (floats: 15e12 overflows an int32 flag parser).
    c.loss = dataclasses.asdict(LossConfig())
    c.loss.update(p.get("loss", {}))
    c.balance = dataclasses.asdict(BalanceConfig())
    c.balance.update(p.get("balance", {}))
    return c

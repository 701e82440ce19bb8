"""A training run's settings as typed, frozen dataclasses, converted once from the config file.

    run_cfg = run_config.from_config_dict(config)    # in main: the ConfigDict stops here
    state, summary = train(run_cfg)

The ml_collections file in `configs/` stays the user interface (`--config.train.steps=10`
overrides keep working); below `main` everything takes these dataclasses. Each section checks
itself in `__post_init__` and names the field as the user sets it (`train.eval_every=-1: ...`), so
a bad value stops the run before anything is built, with one line (`errors.InputError`). The model,
optimizer, loss and balancing sections are their own modules' dataclasses (ModelConfig,
OptimConfig, LossConfig, BalanceConfig) and validate themselves the same way (docs/trainer.md#layers-of-a-run).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from glm46_jax.errors import InputError, check_at_least, check_choice, check_field, check_known_fields
from glm46_jax.config import ModelConfig, model_config_from_dict
from glm46_jax.data import curriculum as curriculum_lib
from glm46_jax.data.curriculum import Curriculum
from glm46_jax.model.lora import LoRAConfig
from glm46_jax.parallel.distributed import DistributedConfig
from glm46_jax.parallel.sharding import MESH_AXES
from glm46_jax.recipe_config import (
    PPOConfig,
    PreferenceConfig,
    RLConfig,
    SFTConfig,
    preference_steps,
    rl_steps,
    sft_steps,
)
from glm46_jax.training.balancing import BalanceConfig
from glm46_jax.training.loss import LossConfig
from glm46_jax.training.optim import OptimConfig
from glm46_jax.monitoring.monitor import MonitorConfig
from glm46_jax.training.trainer import TrainConfig


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 500  # steps between saves (and always at the end and on SIGTERM/SIGUSR1)
    keep: int = 3  # the last `keep` steps; 0 = all
    keep_best: bool = False  # also the best step by `best_metric` (lower is better)
    best_metric: str = "eval/ce"  # e.g. "eval/code/ce" (with train.eval_per_domain) in mid-training
    async_save: bool = True
    resume: str = "auto"  # auto: continue from the newest complete checkpoint | never: start fresh
    init_from: str = ""  # a run dir / checkpoint (e.g. from `convert hf-to-ckpt`) whose weights start a new run

    def __post_init__(self):
        check_at_least("checkpoint", self, 1, "every")
        check_at_least("checkpoint", self, 0, "keep", meaning="0 keeps all")
        check_choice("checkpoint", self, "resume", ("auto", "never"))
        check_field("checkpoint", "best_metric", self.best_metric, self.best_metric.startswith("eval/"),
                    "must name a held-out metric (eval/ce, or eval/<domain>/ce with train.eval_per_domain)",
                    "set --config.checkpoint.best_metric")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    curriculum: Curriculum
    root: str = "data/corpus"
    seed: int = 0
    num_workers: int = 0
    read_threads: int = 2
    # documents: each process reads its own 1/P of every domain (scales to many hosts) | rows: every process reads the
    # whole global batch and keeps its rows, so the batches (and losses) are the same for any number of processes
    # and a run can resume on another process count, at P x the reading (fine for small jobs and tests)
    process_split: str = "documents"

    def __post_init__(self):
        check_at_least("data", self, 0, "seed", "num_workers")
        check_at_least("data", self, 1, "read_threads")
        check_choice("data", self, "process_split", ("documents", "rows"))


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    tensor: int = 1
    expert: int = 1
    pipeline: int = 1
    context: int = 1

    def __post_init__(self):
        sizes = self.sizes()
        for axis, size in sizes.items():
            check_field("mesh", axis, size, isinstance(size, int) and (size >= 1 or size == -1),
                        "must be >= 1, or -1 for 'the remaining devices'", f"set --config.mesh.{axis}")
        if list(sizes.values()).count(-1) > 1:
            raise InputError(f"mesh: at most one axis may be -1 (got {sizes}); give the others explicit sizes")

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    run_dir: str
    model: ModelConfig
    mesh: MeshConfig
    train: TrainConfig
    checkpoint: CheckpointConfig
    data: DataConfig
    distributed: DistributedConfig
    optim: OptimConfig
    loss: LossConfig
    balance: BalanceConfig
    monitor: MonitorConfig = MonitorConfig()  # metric sinks, Prometheus, watchdog, stragglers (docs/monitoring.md)
    # The config file's values as given (JSON): written to run_dir/config.json and the checkpoints' meta,
    # so a run can be reproduced from them.
    source: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    recipe: str = "pretrain"  # a name in RECIPES: pretrain (and mid-training) | sft | grpo | ppo | reward | dpo
    sft: SFTConfig | None = None  # recipe "sft": the chat data and full vs LoRA
    lora: LoRAConfig | None = None  # sft.method / rl.method "lora": the adapters
    rl: RLConfig | None = None  # recipe "grpo": reinforcement learning with verifiable rewards
    preference: PreferenceConfig | None = None  # recipes "reward" and "dpo": preference pairs
    ppo: PPOConfig | None = None  # recipe "ppo" (with the rl section): the critic and the PPO objective

    def __post_init__(self):
        check_choice("config", self, "recipe", tuple(RECIPES))
        entry = RECIPES[self.recipe]
        if entry.section and getattr(self, entry.section) is None:
            raise InputError(f"recipe={self.recipe} needs a config.{entry.section} section (see configs/"
                             f"{self.recipe}.py)")
        section = getattr(self, entry.section) if entry.section else None
        if getattr(section, "method", None) == "lora" and self.lora is None:
            raise InputError(f"{entry.section}.method=lora needs a config.lora section (rank, alpha, targets; see "
                             "configs/sft.py)")
        entry.check(self)
        stages = self.mesh.sizes().get("pipeline", 1)
        if stages > 1 and self.optim.layer_decay != 1.0:
            raise InputError(f"mesh.pipeline={stages} with optim.layer_decay={self.optim.layer_decay}: layer-wise lr "
                             "decay counts depth in layer order, not the pipeline's slot order; set "
                             "optim.layer_decay=1.0 or mesh.pipeline=1")
        metric = self.checkpoint.best_metric
        if self.checkpoint.keep_best and metric.count("/") > 1 and not self.train.eval_per_domain:
            raise InputError(f"checkpoint.best_metric={metric!r} is a per-domain metric, which only "
                             "train.eval_per_domain=True computes; set it, or rank by eval/ce")

    @functools.cached_property
    def total_steps(self) -> int:
        """The run's length: the one place it is computed (the recipe's rule, read once)."""
        return RECIPES[self.recipe].steps(self)


@dataclasses.dataclass(frozen=True)
class RecipeEntry:
    """A recipe by name (`config.recipe`; docs/trainer.md#adding-a-recipe)."""
    # "module:function", imported when a run starts (or the function itself): build(run_cfg, devices) ->
    # (trainer.Recipe, TrainState)
    build: str | Callable[..., Any]
    steps: Callable[[RunConfig], int]  # the run's length
    section: str | None = None  # the config section it needs (its settings), e.g. "sft"
    check: Callable[[RunConfig], None] = lambda cfg: None  # what it cannot run with (InputError)

    def load(self) -> Callable[..., Any]:
        if callable(self.build):
            return self.build
        module, name = self.build.split(":")
        return getattr(importlib.import_module(module), name)


def _check_sft(cfg: RunConfig) -> None:
    stages = cfg.mesh.sizes().get("pipeline", 1)
    # Combinations the pipeline's slot-ordered MoE stack does not support (docs/pipeline.md#limits).
    if stages > 1 and cfg.sft.method == "lora":
        raise InputError(f"mesh.pipeline={stages} with sft.method=lora: LoRA adapters are not built for the "
                         "pipeline's layer layout; set mesh.pipeline=1 (or sft.method=full)")


def _check_grpo(cfg: RunConfig) -> None:
    stages, context = cfg.mesh.sizes().get("pipeline", 1), cfg.mesh.sizes().get("context", 1)
    if stages > 1:
        raise InputError(f"mesh.pipeline={stages} with recipe {cfg.recipe}: RL samples with the KV-cache generator and "
                         "replays routing, which run the layers in order, not in pipeline stages; set "
                         "mesh.pipeline=1 (give the devices to mesh.data or mesh.expert)")
    if context > 1:
        raise InputError(f"mesh.context={context} with recipe {cfg.recipe}: RL samples with the KV-cache generator, "
                         "which keeps each sequence whole on a device; set mesh.context=1 (give the devices to "
                         "mesh.data or mesh.expert)")


def _check_ppo(cfg: RunConfig) -> None:
    if cfg.ppo is None:
        raise InputError("recipe=ppo needs a config.ppo section (the critic and the PPO objective; see configs/ppo.py)")
    if cfg.ppo.critic_method == "lora" and cfg.lora is None:
        raise InputError("ppo.critic_method=lora needs a config.lora section (rank, alpha, targets; see configs/ppo.py)")
    _check_grpo(cfg)


def _check_preference(cfg: RunConfig) -> None:
    stages, context = cfg.mesh.sizes().get("pipeline", 1), cfg.mesh.sizes().get("context", 1)
    if context > 1:
        raise InputError(f"mesh.context={context} with recipe {cfg.recipe}: a preference batch reads each reply's "
                         "last position per row, which the context layout splits; set mesh.context=1")
    if stages > 1 and cfg.preference.method == "lora":
        raise InputError(f"mesh.pipeline={stages} with preference.method=lora: LoRA adapters are not built for the "
                         "pipeline's layer layout; set mesh.pipeline=1 (or preference.method=full)")


# Every recipe `python -m glm46_jax.train` runs, by `config.recipe`: the one table the driver looks them up in.
RECIPES: dict[str, RecipeEntry] = {
    "pretrain": RecipeEntry("glm46_jax.recipes.pretrain:build", lambda c: total_steps(c.data, c.train)),
    "sft": RecipeEntry("glm46_jax.recipes.sft:build", lambda c: sft_steps(c.sft, c.train.steps), "sft", _check_sft),
    "grpo": RecipeEntry("glm46_jax.recipes.rl.grpo.recipe:build", lambda c: rl_steps(c.rl, c.train.steps), "rl",
                        _check_grpo),
    "ppo": RecipeEntry("glm46_jax.recipes.rl.ppo.recipe:build", lambda c: rl_steps(c.rl, c.train.steps), "rl",
                       _check_ppo),
    "reward": RecipeEntry("glm46_jax.recipes.preference.recipe:build_reward",
                          lambda c: preference_steps(c.preference, c.train.steps), "preference", _check_preference),
    "dpo": RecipeEntry("glm46_jax.recipes.preference.recipe:build_dpo",
                       lambda c: preference_steps(c.preference, c.train.steps), "preference", _check_preference),
}


def total_steps(data: DataConfig, train: TrainConfig) -> int:
    """Steps of the run: the curriculum's, or train.steps when that is smaller."""
    total = curriculum_lib.num_steps(data.curriculum)
    return min(total, train.steps) if train.steps > 0 else total


def _section(cls: type, name: str, values: Mapping[str, Any], **extra: Any):
    # `extra` is what from_config_dict builds itself (data's curriculum), not a name the user may set.
    check_known_fields(f"config.{name}", values, {f.name for f in dataclasses.fields(cls)} - set(extra))
    return cls(**{**dict(values), **extra})


def from_config_dict(config: Any) -> RunConfig:
    """The ConfigDict of a `configs/` file (after command-line overrides) -> a validated RunConfig."""
    d = json.loads(config.to_json_best_effort()) if hasattr(config, "to_json_best_effort") else dict(config)
    data = dict(d["data"])
    phases, order = data.pop("phases"), data.pop("phase_order", None)
    order = tuple(order) if order is not None else tuple(phases)
    data_cfg = _section(DataConfig, "data", data, curriculum=curriculum_lib.from_config(phases, order))
    train_cfg = _section(TrainConfig, "train", d["train"])
    recipe = d.get("recipe", "pretrain")
    sft = _section(SFTConfig, "sft", d["sft"]) if d.get("sft") is not None else None
    lora = LoRAConfig.from_dict(d["lora"]) if d.get("lora") is not None else None
    rl = None
    if d.get("rl") is not None:
        rl_values = dict(d["rl"])
        for key in ("rewards", "reward_weights", "heldout_rewards"):  # JSON lists -> the dataclass's tuples
            if isinstance(rl_values.get(key), list):
                rl_values[key] = tuple(rl_values[key])
        rl = _section(RLConfig, "rl", rl_values)
    preference = _section(PreferenceConfig, "preference", d["preference"]) if d.get("preference") is not None \
        else None
    ppo = _section(PPOConfig, "ppo", d["ppo"]) if d.get("ppo") is not None else None
    cfg = RunConfig(
        run_dir=os.path.abspath(d["run_dir"]), model=model_config_from_dict(d["model"]),
        mesh=_section(MeshConfig, "mesh", d["mesh"]), train=train_cfg,
        checkpoint=_section(CheckpointConfig, "checkpoint", d["checkpoint"]), data=data_cfg,
        distributed=_section(DistributedConfig, "distributed", d.get("distributed", {})),
        monitor=_section(MonitorConfig, "monitor", d.get("monitor", {})),
        optim=_section(OptimConfig, "optim", d["optim"]), loss=_section(LossConfig, "loss", d["loss"]),
        balance=_section(BalanceConfig, "balance", d["balance"]), source=d, recipe=recipe, sft=sft, lora=lora, rl=rl,
        preference=preference, ppo=ppo)
    if cfg.optim.decay_steps <= 0:  # 0 = the schedule spans the run
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, decay_steps=cfg.total_steps))
    return cfg


def fine_tuning_config(config_dir: str, recipe: str, preset: str, p: Mapping[str, Any]) -> Any:
    """configs/pretrain.py:<p["base"]> set up to continue another run's weights as `recipe` ("sft", "grpo").

    From the preset dict `p`: checkpoint.init_from and the checkpoint / train / optim overrides; the lr schedule
    spans this run (decay_steps 0). Fine-tuning comes after GLM's 15T-token boundary: the MTP loss is at its later
    weight from the start and loss-free balancing is off (the correction biases stay as trained). The recipe's own
    section (sft, rl, lora) is the caller's.
    """
    c = config_file(os.path.join(config_dir, "pretrain.py"), p["base"])
    c.recipe = recipe
    c.run_dir = f"runs/{recipe}_{preset}"
    c.checkpoint.update(init_from=p["init_from"], **p["checkpoint"])
    c.train.update(**p["train"])
    c.optim.update(decay_steps=0, **p["optim"])
    c.loss.update(mtp_boundary_tokens=0.0)
    c.balance.update(boundary_tokens=0.0, rate_after=0.0)
    return c


def config_file(path: str, preset: str) -> Any:
    """`get_config(preset)` of the config file at `path` (e.g. mid-training and SFT build on configs/pretrain.py).
    Loaded by path: config files are not a package, and ml_collections' config flags load them by path too."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"glm46_config_{os.path.splitext(os.path.basename(path))[0]}",
                                                  path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(preset)


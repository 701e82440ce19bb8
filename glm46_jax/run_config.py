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
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from glm46_jax.errors import InputError, check_at_least, check_choice, check_field, check_known_fields
from glm46_jax.config import ModelConfig, model_config_from_dict
from glm46_jax.data import curriculum as curriculum_lib
from glm46_jax.data.curriculum import Curriculum
from glm46_jax.model.lora import LoRAConfig
from glm46_jax.parallel.distributed import DistributedConfig
from glm46_jax.parallel.sharding import MESH_AXES
from glm46_jax.training.balancing import BalanceConfig
from glm46_jax.training.loss import LossConfig
from glm46_jax.training.optim import OptimConfig
from glm46_jax.monitoring.monitor import MonitorConfig
from glm46_jax.training.trainer import TrainConfig


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 500  # steps between saves (and always at the end and on SIGTERM/SIGUSR1)
    keep: int = 3  # the last `keep` steps; 0 = all
    keep_best: bool = False  # also the best step by `best_metric`; a run its recipe stops early ends on it
    best_metric: str = "eval/ce"  # e.g. "eval/code/ce" (with train.eval_per_domain) in mid-training
    best_mode: str = "min"  # min: lower is better (a loss) | max: higher is (an accuracy, a win rate)
    end_on_best: bool = False  # with keep_best: a completed run also ends on its best step, not its last
    async_save: bool = True
    resume: str = "auto"  # auto: continue from the newest complete checkpoint | never: start fresh
    init_from: str = ""  # a run dir / checkpoint (e.g. from `convert hf-to-ckpt`) whose weights start a new run

    def __post_init__(self):
        check_at_least("checkpoint", self, 1, "every")
        check_at_least("checkpoint", self, 0, "keep", meaning="0 keeps all")
        check_choice("checkpoint", self, "resume", ("auto", "never"))
        check_choice("checkpoint", self, "best_mode", ("min", "max"))
        check_field("checkpoint", "end_on_best", self.end_on_best, self.keep_best or not self.end_on_best,
                    "needs a best step to end on", "set --config.checkpoint.keep_best=True (and its best_metric)")
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
    lora: LoRAConfig | None = None  # sft.method / rl.method "lora": the adapters
    # The recipes' own sections, None where the config file has none: each the dataclass SECTIONS names beside its
    # recipe (typed Any: this module names those classes, it cannot import them).
    sft: Any = None  # recipe "sft": the chat data and full vs LoRA
    rl: Any = None  # recipes "grpo" and "ppo": reinforcement learning with verifiable rewards
    preference: Any = None  # recipes "reward" and "dpo": preference pairs
    ppo: Any = None  # recipe "ppo" (with the rl section): the critic and the PPO objective

    def __post_init__(self):
        check_choice("config", self, "recipe", tuple(RECIPES))
        for name in RECIPES[self.recipe].sections:
            section = getattr(self, name)
            if section is None:
                raise InputError(f"recipe={self.recipe} needs a config.{name} section (see configs/{self.recipe}.py)")
            if getattr(section, "method", None) == "lora" and self.lora is None:
                raise InputError(f"{name}.method=lora needs a config.lora section (rank, alpha, targets; see "
                                 "configs/sft.py)")
            section.check_run(self)
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
    # "module:Class.build", the recipe class's builder, imported when a run starts (or the function itself):
    # build(run_cfg, devices) -> (the recipe, a trainer.Recipe; its TrainState)
    build: str | Callable[..., Any]
    steps: Callable[[RunConfig], int]  # the run's length
    # The config sections it is handed (names in SECTIONS): each must be in the file, and each section's
    # `check_run(run_cfg)` refuses what the recipe cannot run with (InputError).
    sections: tuple[str, ...] = ()

    def load(self) -> Callable[..., Any]:
        return named(self.build) if isinstance(self.build, str) else self.build


def named(ref: str) -> Any:
    """The object a "module:name" (or "module:Class.attr") string names, imported now."""
    module, name = ref.split(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


# The recipes and their config sections, named "module:Class" rather than imported (the recipes import this
# module, and imports flow one way): a recipe class's builder is imported when a run starts, a section's class when
# a config file has that section.

# Each recipe's own config section, by its name in the config file and RunConfig: a frozen dataclass beside the
# recipe that checks itself, with `check_run(run_cfg)` and, where RECIPES reads it, `steps(train.steps)`.
SECTIONS: dict[str, str] = {
    "sft": "glm46_jax.recipes.sft:SFTConfig",
    "rl": "glm46_jax.recipes.rl.config:RLConfig",
    "ppo": "glm46_jax.recipes.rl.ppo.config:PPOConfig",
    "preference": "glm46_jax.recipes.preference.config:PreferenceConfig",
}

# Every recipe `python -m glm46_jax.train` runs, by `config.recipe`: the one table the driver looks them up in.
RECIPES: dict[str, RecipeEntry] = {
    "pretrain": RecipeEntry("glm46_jax.recipes.pretrain:Pretraining.build", lambda c: total_steps(c.data, c.train)),
    "sft": RecipeEntry("glm46_jax.recipes.sft:FineTuning.build", lambda c: c.sft.steps(c.train.steps), ("sft",)),
    "grpo": RecipeEntry("glm46_jax.recipes.rl.grpo.recipe:GRPO.build", lambda c: c.rl.steps(c.train.steps), ("rl",)),
    "ppo": RecipeEntry("glm46_jax.recipes.rl.ppo.recipe:PPO.build", lambda c: c.rl.steps(c.train.steps), ("rl", "ppo")),
    "reward": RecipeEntry("glm46_jax.recipes.preference.recipe:Pairs.build_reward",
                          lambda c: c.preference.steps(c.train.steps), ("preference",)),
    "dpo": RecipeEntry("glm46_jax.recipes.preference.recipe:Pairs.build_dpo",
                       lambda c: c.preference.steps(c.train.steps), ("preference",)),
}


def total_steps(data: DataConfig, train: TrainConfig) -> int:
    """Steps of the run: the curriculum's, or train.steps when that is smaller."""
    total = curriculum_lib.num_steps(data.curriculum)
    return min(total, train.steps) if train.steps > 0 else total


def _section(cls: type, name: str, values: Mapping[str, Any], **extra: Any):
    # `extra` is what from_config_dict builds itself (data's curriculum), not a name the user may set.
    check_known_fields(f"config.{name}", values, {f.name for f in dataclasses.fields(cls)} - set(extra))
    hints = typing.get_type_hints(cls)
    return cls(**{k: _typed(hints[k], v) for k, v in values.items()}, **extra)


def _typed(hint: Any, value: Any) -> Any:
    """A JSON value as its field's type has it: JSON has no tuples, so a list becomes a tuple (its items too) where
    the type says tuple (`tuple[str, ...]`, `tuple[int, int]`, `tuple[str, ...] | None`)."""
    if not isinstance(value, list):
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return next((_typed(h, value) for h in args if typing.get_origin(h) is tuple), value)
    if origin is not tuple:
        return value
    items = args[:1] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
    return tuple(_typed(h, v) for h, v in zip(items, value)) if len(items) == len(value) else tuple(value)


def from_config_dict(config: Any) -> RunConfig:
    """The ConfigDict of a `configs/` file (after command-line overrides) -> a validated RunConfig."""
    d = json.loads(config.to_json_best_effort()) if hasattr(config, "to_json_best_effort") else dict(config)
    data = dict(d["data"])
    phases, order = data.pop("phases"), data.pop("phase_order", None)
    order = tuple(order) if order is not None else tuple(phases)
    data_cfg = _section(DataConfig, "data", data, curriculum=curriculum_lib.from_config(phases, order))
    train_cfg = _section(TrainConfig, "train", d["train"])
    recipe = d.get("recipe", "pretrain")
    lora = _section(LoRAConfig, "lora", d["lora"]) if d.get("lora") is not None else None
    sections = {name: _section(named(ref), name, d[name]) for name, ref in SECTIONS.items() if d.get(name) is not None}
    cfg = RunConfig(
        run_dir=os.path.abspath(d["run_dir"]), model=model_config_from_dict(d["model"]),
        mesh=_section(MeshConfig, "mesh", d["mesh"]), train=train_cfg,
        checkpoint=_section(CheckpointConfig, "checkpoint", d["checkpoint"]), data=data_cfg,
        distributed=_section(DistributedConfig, "distributed", d.get("distributed", {})),
        monitor=_section(MonitorConfig, "monitor", d.get("monitor", {})),
        optim=_section(OptimConfig, "optim", d["optim"]), loss=_section(LossConfig, "loss", d["loss"]),
        balance=_section(BalanceConfig, "balance", d["balance"]), source=d, recipe=recipe, lora=lora, **sections)
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


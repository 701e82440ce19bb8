"""Typed run configs (`run_config`): every preset converts, each bad value is refused naming its field;
and the command lines report a user's mistake as one line with exit code 2, no traceback."""

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import subprocess_env
from glm46_jax import run_config
from glm46_jax.errors import InputError

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


def load_config(preset: str):
    spec = importlib.util.spec_from_file_location("pretrain_config", os.path.join(ROOT, "configs", "pretrain.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(preset)


@pytest.mark.parametrize("preset", ["tiny", "small", "glm45_air", "glm45", "glm46"])
def test_every_preset_converts(preset):
    cfg = run_config.from_config_dict(load_config(preset))
    assert cfg.source["model"]["preset"] == preset
    assert cfg.optim.decay_steps == cfg.total_steps > 0  # decay_steps=0 in the file: the schedule spans the run
    assert [p.name for p in cfg.data.curriculum.phases] == list(cfg.source["data"]["phase_order"])


def test_tiny_converts_to_the_values_in_the_file():
    config = load_config("tiny")
    config.train.steps = 7
    cfg = run_config.from_config_dict(config)
    assert cfg.total_steps == 7 and cfg.optim.decay_steps == 7
    assert cfg.train.eval_every == 100 and cfg.checkpoint.every == 100 and cfg.mesh.sizes()["data"] == -1
    assert cfg.model.hidden_size == 64 and cfg.loss.mtp_boundary_tokens == 409_600
    # 200 steps of 16 x 128 then 50 of 16 x 256: 409,600 + 204,800 tokens
    assert run_config.from_config_dict(load_config("tiny")).total_steps == 250


@pytest.mark.parametrize("path, value, field", [
    ("train.eval_every", -1, "train.eval_every=-1"),
    ("train.log_every", 0, "train.log_every=0"),
    ("train.accum_steps", 0, "train.accum_steps=0"),
    ("train.steps", -5, "train.steps=-5"),
    ("train.bad_steps", "ignore", "train.bad_steps='ignore'"),
    ("train.spike_factor", -1.0, "train.spike_factor=-1.0"),
    ("checkpoint.every", 0, "checkpoint.every=0"),
    ("checkpoint.keep", -1, "checkpoint.keep=-1"),
    ("checkpoint.resume", "sometimes", "checkpoint.resume='sometimes'"),
    ("data.process_split", "bytes", "data.process_split='bytes'"),
    ("data.read_threads", 0, "data.read_threads=0"),
    ("mesh.tensor", 0, "mesh.tensor=0"),
    ("distributed.mode", "maybe", "distributed.mode='maybe'"),
    ("distributed.process_id", 3, "distributed: ['coordinator', 'num_processes'] must be set together"),
])
def test_bad_values_are_refused_naming_the_field(path, value, field):
    config = load_config("tiny")
    section, name = path.split(".")
    config[section][name] = value
    with pytest.raises(InputError) as err:
        run_config.from_config_dict(config)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_two_open_mesh_axes_and_unknown_fields_are_refused():
    config = load_config("tiny")
    config.mesh = {"data": -1, "tensor": -1}
    with pytest.raises(InputError, match="at most one axis may be -1"):
        run_config.from_config_dict(config)
    config = load_config("tiny")
    config.unlock()
    config.train.evl_every = 3
    with pytest.raises(InputError, match=r"^config.train has no field 'evl_every'; nearest: eval_every, log_every; "
                       r"valid fields: accum_steps, .*, steps$"):
        run_config.from_config_dict(config)


def test_an_unknown_lora_field_names_the_nearest():
    spec = importlib.util.spec_from_file_location("sft_config", os.path.join(ROOT, "configs", "sft.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("tiny")
    config.unlock()
    config.lora.rnak = 4
    with pytest.raises(InputError, match=r"^config.lora has no field 'rnak'; nearest: rank; valid fields: alpha, "):
        run_config.from_config_dict(config)


def _load(name: str, preset: str):
    spec = importlib.util.spec_from_file_location(f"{name}_config", os.path.join(ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(preset).to_dict()


def test_each_config_section_lists_its_dataclass_fields():
    """A field added to a section's dataclass appears in the config files (they take their defaults from the
    dataclass), so it can be overridden with --config.<section>.<field>; and the files have no field the
    dataclass lacks."""
    from glm46_jax.training.balancing import BalanceConfig
    from glm46_jax.config import ModelConfig
    from glm46_jax.model.lora import LoRAConfig
    from glm46_jax.recipes.rl.config import RLConfig
    from glm46_jax.recipes.sft import SFTConfig
    from glm46_jax.training.loss import LossConfig
    from glm46_jax.training.optim import OptimConfig

    def fields(cls, *drop: str) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} - set(drop)

    c = _load("pretrain", "tiny")
    expected = {
        "model": fields(ModelConfig) | {"preset"},
        "mesh": fields(run_config.MeshConfig), "train": fields(run_config.TrainConfig),
        "checkpoint": fields(run_config.CheckpointConfig),
        # the curriculum is built from phases and phase_order
        "data": fields(run_config.DataConfig, "curriculum") | {"phases", "phase_order"},
        "distributed": fields(run_config.DistributedConfig), "monitor": fields(run_config.MonitorConfig),
        "optim": fields(OptimConfig),
        "loss": fields(LossConfig), "balance": fields(BalanceConfig)}
    assert set(c) == set(expected) | {"run_dir"}
    for section, names in expected.items():
        assert set(c[section]) == names, section
    sft, grpo = _load("sft", "tiny"), _load("grpo", "tiny")
    assert set(sft["sft"]) == fields(SFTConfig) and set(sft["lora"]) == fields(LoRAConfig)
    assert set(grpo["rl"]) == fields(RLConfig) and set(grpo["lora"]) == fields(LoRAConfig)


def _cli(module: str, *args: str) -> subprocess.CompletedProcess:
    env = subprocess_env(1)
    return subprocess.run([sys.executable, "-m", module, *args], check=False, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("module, args, expect", [
    ("glm46_jax.train", ["--config.train.eval_every=-1"], "train.eval_every=-1"),
    ("glm46_jax.train", ["--config.checkpoint.resume=maybe"], "checkpoint.resume='maybe'"),
    ("glm46_jax.train", ["--config.mesh.data=3"], "mesh"),
    ("glm46_jax.train", ["--config.data.root=/nonexistent/corpus", "--config.run_dir=RUN"], "/nonexistent/corpus"),
    # An unknown field: ml_collections' own KeyError names the last key alone ('no_such_field'); the CLI says where.
    ("glm46_jax.train", ["--config.train.evl_every=3"], "config.train has no field 'evl_every'; nearest: eval_every"),
    ("glm46_jax.train", ["--config.model.no_such_field=1"],
     "config.model has no field 'no_such_field'; nearest: no close match; valid fields: attention_bias, "),
    ("glm46_jax.train", ["--config.train.stpes=5"], "config.train has no field 'stpes'; nearest: steps; valid "),
    ("glm46_jax.train", ["--config.data.phases.general.seqlen=1"],
     "config.data.phases.general has no field 'seqlen'; nearest: seq_len; valid fields: global_batch, "),
    ("glm46_jax.train", ["--config=configs/sft.py:tiny", "--config.sft.no_such_field=1"],
     "config.sft has no field 'no_such_field'; nearest: no close match; valid fields: epochs, global_batch, "),
    ("glm46_jax.train", ["--config.no_such_section.x=1"], "config has no field 'no_such_section'"),
    ("glm46_jax.train", ["--config=configs/pretrain.py:nosuch"], "unknown preset 'nosuch'"),
    ("glm46_jax.train", ["--config.optim.lr=abc"], "--config.optim.lr=abc"),
    ("glm46_jax.train", ["--config.optim.lr=-1"], "optim.lr=-1"),
    ("glm46_jax.train", ["--config.data.phases.general.seq_len=0"], "data.phases.general.seq_len=0"),
    ("glm46_jax.bench", ["--phase=nosuch"], "--phase='nosuch'"),
])
def test_cli_user_errors_are_one_line_and_exit_2(tmp_path, module, args, expect):
    args = [a.replace("RUN", str(tmp_path / "run")) for a in args]
    proc = _cli(module, "--config=configs/pretrain.py:tiny", *args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = _error_lines(proc)
    assert len(errors) == 1 and expect in errors[0], proc.stderr[-2000:]


def _midtrain_config(preset: str):
    spec = importlib.util.spec_from_file_location("midtrain_config", os.path.join(ROOT, "configs", "midtrain.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(preset)


@pytest.mark.parametrize("preset, domain", [("tiny", "code"), ("glm46", "code")])
def test_midtrain_presets_start_from_weights_and_rank_by_the_domain(preset, domain):
    cfg = run_config.from_config_dict(_midtrain_config(preset))
    assert cfg.checkpoint.keep_best and cfg.checkpoint.best_metric == f"eval/{domain}/ce"
    assert cfg.train.eval_per_domain and [p.name for p in cfg.data.curriculum.phases] == ["midtrain"]
    assert domain in cfg.data.curriculum.phases[0].mixture
    # Past GLM's 15T boundary from the first step: MTP weight 0.1, no bias updates.
    assert cfg.loss.mtp_boundary_tokens == 0 and cfg.balance.boundary_tokens == 0
    assert cfg.optim.decay_steps == cfg.total_steps
    pre = run_config.from_config_dict(load_config("tiny" if preset == "tiny" else "glm46"))
    assert cfg.model == pre.model and cfg.optim.lr < pre.optim.lr


def test_a_per_domain_best_metric_needs_per_domain_eval():
    config = _midtrain_config("tiny")
    config.train.eval_per_domain = False
    with pytest.raises(InputError, match=r"best_metric='eval/code/ce' is a per-domain metric"):
        run_config.from_config_dict(config)
    config.checkpoint.best_metric = "loss"
    with pytest.raises(InputError, match="checkpoint.best_metric='loss': must name a held-out metric"):
        run_config.from_config_dict(config)


def test_total_steps_are_computed_once_without_disk_io_afterwards(tmp_path):
    """An SFT run's length comes from its dataset's size (metadata.json): read once, when the config is made; the
    trainer asks for `total_steps` every step, and that must not touch the disk (the file may even go away)."""
    import json

    from glm46_jax.run_config import config_file, from_config_dict

    root = tmp_path / "chats"
    root.mkdir()
    (root / "metadata.json").write_text(json.dumps({"kind": "sft", "splits": {"train": {"tokens": 1000}}}))
    c = config_file(os.path.join(ROOT, "configs", "sft.py"), "tiny")
    with c.unlocked():
        c.sft.update(root=str(root), seq_len=64, global_batch=4, epochs=1.0)
        c.train.steps = 0
    cfg = from_config_dict(c)
    assert cfg.total_steps == 4  # ceil(1000 / (4 x 64))
    assert cfg.optim.decay_steps == 4  # decay_steps 0: the schedule spans the run
    (root / "metadata.json").unlink()
    assert cfg.total_steps == 4


@pytest.mark.parametrize("name, preset", [("sft", "tiny"), ("grpo", "tiny"), ("ppo", "addition"), ("dpo", "tiny"),
                                          ("reward", "tiny"), ("sft", "agent_calc"), ("grpo", "agent"),
                                          ("ppo", "agent")])
def test_the_config_file_round_trip_keeps_every_section_as_written(name, preset):
    """The ConfigDict goes through JSON (tuples come back as lists): each section of the typed config equals its
    dataclass built from the file's values, tuples included (rl.rewards, lora.targets)."""
    c = run_config.config_file(os.path.join(ROOT, "configs", f"{name}.py"), preset)
    c.train.steps = 5  # no dataset on disk needed for the run's length
    cfg = run_config.from_config_dict(c)
    written = c.to_dict()
    sections = [s for s in (*run_config.SECTIONS, "lora") if written.get(s) is not None]
    assert set(run_config.RECIPES[name].sections) <= set(sections)
    for section in sections:
        typed = getattr(cfg, section)
        assert typed == type(typed)(**written[section]), section
    if cfg.rl is not None:
        assert cfg.rl.rewards == ("exact_answer",) and cfg.rl.reward_weights == (1.0,)
    if cfg.lora is not None:
        assert isinstance(cfg.lora.targets, tuple) and all(isinstance(t, str) for t in cfg.lora.targets)


def test_the_registry_names_what_exists():
    """RECIPES and SECTIONS name their builders and section classes by string (the recipes import run_config): each
    string resolves to a dataclass with the rule RunConfig calls (`check_run`), under its RunConfig field's name."""
    for entry in run_config.RECIPES.values():
        assert callable(entry.load()) and set(entry.sections) <= set(run_config.SECTIONS)
    for name, ref in run_config.SECTIONS.items():
        cls = run_config.named(ref)
        assert dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(run_config.RunConfig)}
        assert callable(cls.check_run)


def test_an_adaptive_kl_without_a_starting_coefficient_is_refused():
    """ppo.kl_target multiplies rl.kl_coef after each rollout: from 0 it could never move, so the config says so."""
    c = run_config.config_file(os.path.join(ROOT, "configs", "ppo.py"), "addition")
    c.train.steps = 5
    c.ppo.kl_target, c.rl.kl_coef = 0.1, 0.02
    assert run_config.from_config_dict(c).ppo.kl_target == 0.1  # 0.02 is its start
    c.rl.kl_coef = 0.0  # the preset's: no KL
    with pytest.raises(InputError, match=r"ppo.kl_target=0.1 adapts the KL coefficient from rl.kl_coef, which is 0.0"):
        run_config.from_config_dict(c)
    c.ppo.kl_target, c.rl.kl_coef = -1.0, 0.02
    with pytest.raises(InputError, match="kl_target"):
        run_config.from_config_dict(c)


def test_the_reward_model_check_and_the_best_step_settings_are_checked():
    """rl.labeller checks the reward model against a labeller: a run rewarded without one is refused, naming both
    fields; checkpoint.best_mode is min or max."""
    c = run_config.config_file(os.path.join(ROOT, "configs", "ppo.py"), "addition")  # the exact-answer reward
    c.train.steps = 5
    c.rl.labeller = "exact_answer"
    with pytest.raises(InputError, match=r"rl.labeller='exact_answer': checks the reward model, which "
                                         r"rl.rewards=\('exact_answer',\) does not use"):
        run_config.from_config_dict(c)
    c.rl.labeller = ""
    c.checkpoint.best_mode = "highest"
    with pytest.raises(InputError, match="checkpoint.best_mode='highest'"):
        run_config.from_config_dict(c)
    c.checkpoint.best_mode, c.checkpoint.end_on_best = "max", True
    with pytest.raises(InputError, match="checkpoint.end_on_best=True: needs a best step to end on"):
        run_config.from_config_dict(c)

"""The recipe seam (docs/trainer.md#adding-a-recipe): a recipe registered in `run_config.RECIPES` and built by
`models.build` trains several named models through `train.train` with no change to the driver.

The test recipe is what PPO / DPO need: two trained models ("policy" and a smaller "critic"), each with its own
optimizer, and a frozen "reference" read by the loss. Its loss is the sum of the two models' language-model
losses, so each model's update must equal the one-model step (`train_step.make_train_step`, tested against
float64 references in test_train_step) run on that model alone with its own optimizer: the reference here.
"""

import dataclasses
import os

import jax
import numpy as np
import pytest

from glm46_jax.recipes import models
from glm46_jax import run_config, train
from glm46_jax.parallel import sharding
from glm46_jax.config import TINY
from glm46_jax.data import loader
from glm46_jax.training.loss import batch_norms, loss_fn
from glm46_jax.model import init_model
from glm46_jax.training.optim import OptimConfig, build_optimizer
from glm46_jax.recipes.base import RecipeBase
from glm46_jax.training.step import StepConfig, controls, init_state, make_step, make_train_step
from glm46_jax.training.trainer import StepInput

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
POLICY = dataclasses.replace(TINY, num_hidden_layers=2, num_nextn_predict_layers=0)
CRITIC = dataclasses.replace(POLICY, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
CRITIC_OPTIM = OptimConfig(algorithm="adamw", lr=3e-3, end_lr=3e-3, warmup_steps=0, weight_decay=0.0)
ROWS, SEQ, MTP_WEIGHT = 4, 32, 0.3


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    seq_len: int


def batch_at(n: int, seed: int) -> dict[str, np.ndarray]:
    x = np.random.default_rng([seed, n]).integers(2, POLICY.vocab_size, (ROWS, SEQ + 1))
    return {"inputs": x[:, :-1].astype(np.int32), "targets": x[:, 1:].astype(np.int32)}


@dataclasses.dataclass
class TwoModels(RecipeBase):
    """Synthetic token batches; policy and critic learn them, the reference only reports its CE."""
    batches: int = 0

    def current_segment(self) -> Stage:
        return Stage("two_models", SEQ)

    def start(self, state, data_state) -> None:
        self.batches = data_state["batches"] if data_state else 0

    def next_input(self, state, max_loss: float) -> StepInput:
        local = batch_at(self.batches, self.cfg.train.seed)
        self.batches += 1
        with jax.transfer_guard_host_to_device("allow"):
            batch = loader.to_global(local, self.mesh)
            ctrl = controls(MTP_WEIGHT, 0.0, max_loss)
        return StepInput(self.current_segment(), batch, ctrl, self.batches * ROWS * SEQ, {"batches": self.batches})

    def steps_for(self, segment):
        policy, critic, ref = (self.built.models[n] for n in ("policy", "critic", "reference"))

        def loss(params, buffers, batch, ctx):
            norms = {k: ctx[k] for k in ("tokens", "mtp_tokens", "sequences")}
            lm = lambda name, model: loss_fn(params[name], buffers[name], batch, model.graphdef,  # noqa: E731
                                             model.config, self.cfg.loss, ctx["mtp_weight"], norms)
            p_loss, metrics = lm("policy", policy)
            c_loss, c_metrics = lm("critic", critic)
            _, r_metrics = lm("reference", ref)
            metrics = {k: v for k, v in metrics.items() if jax.numpy.ndim(v) == 0}
            metrics.update(critic_ce=c_metrics["ce"], reference_ce=jax.lax.stop_gradient(r_metrics["ce"]),
                           loss=p_loss + c_loss)
            return p_loss + c_loss, metrics

        return make_step(loss, {"policy": policy.tx, "critic": critic.tx}, "policy", batch_stats=batch_norms,
                         lr_schedule=policy.lr_schedule)

    def evaluate(self, state, segment, ctrl) -> dict[str, float]:
        return {}


def build(cfg, devices):
    specs = [models.ModelSpec("policy", POLICY), models.ModelSpec("critic", CRITIC, optim=CRITIC_OPTIM, seed_offset=1),
             models.ModelSpec("reference", POLICY, trained=False)]
    built = models.build(cfg, devices, specs, [models.BatchShape("rows", ROWS, "seq", SEQ)])
    return TwoModels(cfg, built), built.state


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    monkeypatch.setitem(run_config.RECIPES, "two_models", run_config.RecipeEntry(build, lambda c: c.train.steps))


def config(run_dir: str, steps: int):
    c = run_config.config_file(os.path.join(ROOT, "configs", "pretrain.py"), "tiny")
    with c.unlocked():
        c.recipe = "two_models"
        c.run_dir = run_dir
        c.model.update(num_hidden_layers=POLICY.num_hidden_layers, num_nextn_predict_layers=0)
        c.train.update(steps=steps, log_every=1, eval_every=0)
        c.monitor.sinks = "jsonl"
        c.checkpoint.update(every=2, keep=5, async_save=False)
        c.optim.update(algorithm="adamw", lr=1e-2, end_lr=1e-2, warmup_steps=0, weight_decay=0.0, decay_steps=100)
    return run_config.from_config_dict(c)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("straight"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(run_config.RECIPES, "two_models", run_config.RecipeEntry(build, lambda c: c.train.steps))
        cfg = config(run_dir, 4)
        state, summary = train.train(cfg, jax.devices()[:1])
    return cfg, state, summary, run_dir


def _metrics(run_dir):
    import json
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "train/loss" in r}


def test_each_model_steps_with_its_own_optimizer_as_if_trained_alone(straight):
    cfg, state, summary, run_dir = straight
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    ctrl = controls(MTP_WEIGHT, 0.0)
    want = {}  # each model trained alone, with its own optimizer (the critic's lr 3e-3, the policy's 1e-2)
    for name, model_cfg, optim, seed in (("policy", POLICY, cfg.optim, cfg.train.seed),
                                         ("critic", CRITIC, CRITIC_OPTIM, cfg.train.seed + 1)):
        graphdef, params, buffers = init_model(model_cfg, mesh, seed)
        tx, schedule = build_optimizer(optim, params)
        with sharding.use_mesh(mesh), jax.transfer_guard("allow"):
            if name == "policy":  # the frozen reference is these starting weights: its CE on the last batch
                last = loader.to_global(batch_at(3, cfg.train.seed), mesh)
                start_ce = float(loss_fn(params, buffers, last, graphdef, POLICY, cfg.loss, MTP_WEIGHT)[1]["ce"])
            alone = init_state(params, buffers, tx)
            step = make_train_step(graphdef, tx, model_cfg, StepConfig(loss=cfg.loss), lr_schedule=schedule)
            for n in range(4):
                alone, _ = step(alone, loader.to_global(batch_at(n, cfg.train.seed), mesh), ctrl)
        want[name] = alone
    got = {"policy": state, "critic": state.others["critic"]}
    for name in want:
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want[name].params),
                                jax.tree.leaves(got[name].params), strict=True):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=2e-6,
                                       err_msg=f"{name}{jax.tree_util.keystr(path)}")
    m = _metrics(run_dir)
    # The frozen reference is the policy's starting weights, never trained: the same CE at step 1, and at step 4
    # the starting weights' CE while the trained policy's has moved.
    assert m[1]["train/reference_ce"] == pytest.approx(m[1]["train/ce"], rel=1e-6)
    assert m[4]["train/reference_ce"] == pytest.approx(start_ce, rel=1e-5)
    assert abs(m[4]["train/ce"] - start_ce) > 1e-3
    assert summary["steps"] == 4 and int(state.step) == 4


def test_two_model_checkpoint_resumes_bit_identically(straight, tmp_path):
    cfg, state, _, run_dir = straight
    resumed_dir = str(tmp_path / "resumed")
    train.train(config(resumed_dir, 2), jax.devices()[:1])
    resumed, summary = train.train(config(resumed_dir, 4), jax.devices()[:1])
    assert summary["start_step"] == 3
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _metrics(resumed_dir)[4]["train/critic_ce"] == _metrics(run_dir)[4]["train/critic_ce"]


@dataclasses.dataclass
class StopsItself(TwoModels):
    """TwoModels with a scripted held-out score (evaluations at steps 2, 4, 6, ...) that asks to stop once the score
    falls 0.1 below its best."""
    scores: tuple[float, ...] = (0.5, 0.8, 0.6, 0.9)
    seen: list = dataclasses.field(default_factory=list)

    def evaluate(self, state, segment, ctrl) -> dict[str, float]:
        self.seen.append(self.scores[len(self.seen)])
        return {"eval/score": self.seen[-1]}

    def stop_reason(self) -> str | None:
        return "the score fell" if self.seen and self.seen[-1] < max(self.seen) - 0.1 else None


@pytest.mark.parametrize("how", ["stops", "end_on_best"])
def test_a_run_ends_on_its_best_checkpoint(straight, tmp_path, how):
    """stops: the recipe stops a 10-step run after step 6's evaluation (0.6, below step 4's 0.8): step 6 is saved,
    nothing later runs, and with keep_best (best_mode max) the run ends on step 4's weights, those of the straight
    4-step run. end_on_best: a 6-step run that nothing stops ends there too."""
    import json

    _, state4, _, _ = straight
    run_dir = str(tmp_path / how)

    def build_stopping(cfg, devices):
        recipe, state = build(cfg, devices)
        return StopsItself(recipe.cfg, recipe.built), state

    c = config(run_dir, 10 if how == "stops" else 6)
    c = dataclasses.replace(c, train=dataclasses.replace(c.train, eval_every=2),
                            checkpoint=dataclasses.replace(c.checkpoint, keep=1, keep_best=True, best_metric="eval/score",
                                                           best_mode="max", end_on_best=how == "end_on_best"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(run_config.RECIPES, "two_models", run_config.RecipeEntry(build_stopping, lambda c: c.train.steps))
        state, summary = train.train(c, jax.devices()[:1])
    reason = "the score fell" if how == "stops" else None  # at the last step nothing is asked
    assert summary["steps"] == 6 and summary["early_stop"] == reason and summary["rolled_back_to"] == 4
    with open(os.path.join(run_dir, "status.json")) as f:
        assert json.load(f) == {"state": "complete", "step": 6, "total_steps": c.total_steps, "reason": reason,
                                "rolled_back_to": 4}
    assert sorted(int(d) for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.isdigit()) == [4, 6]
    for a, b in zip(jax.tree.leaves(state4), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

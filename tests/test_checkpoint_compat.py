"""Checkpoints written before the trainer refactor still work: tests/fixtures/pre_seam_run is a tiny
pre-training run dir written by commit 2231587's code (`write_fixture` below; tests/fixtures/README.md has the
command). Its step restores onto a freshly built state with the weights, optimizer state and data state on disk,
resumes through `train()` and continues as the old code continued it, exports to a Hugging Face directory whose
tensors are the checkpoint's, and that directory works with the README's `load_hf` / `apply` / `save_hf`.

The run trained on the `sample_corpus` fixture (conftest.py) with `fixture_config`: the corpus is rebuilt the
same way here, so the checkpoint's data-iterator state continues on the same documents. The corpus is cut from the
running Python's standard library; pre_seam_run/expected.json records its fingerprint, and the one check that needs
the very same tokens (the continuation's losses) skips, saying why, on a Python whose stdlib differs."""

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import FIXTURES, jitted_apply
from flax import nnx
from safetensors.numpy import load_file

from glm46_jax.training import checkpoint
from glm46_jax.interop import convert
from glm46_jax.parallel import sharding
from glm46_jax.config import model_config_from_dict
from glm46_jax.interop.hf import load_hf, save_hf
from glm46_jax.run_config import from_config_dict
from glm46_jax.train import train

FIXTURE = os.path.join(FIXTURES, "pre_seam_run")
CONFIG_FILE = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "pretrain.py")
STEPS = 3  # the fixture's step: its one checkpoint
MORE = 2  # the steps resumed on top of it
# The tiny preset made as small as it stays valid: 2 layers (1 dense, 1 MoE) + MTP, every feature still on.
MODEL = {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2,
         "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1}
SEQ_LEN, BATCH = 32, 4
PROBE = "def add(x, y):\n    return x + y\n"  # the text whose next-token NLLs expected.json holds


def load_config(preset: str):
    spec = importlib.util.spec_from_file_location("pretrain_config", CONFIG_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(preset)


def fixture_config(run_dir: str, corpus: str, steps: int):
    """configs/pretrain.py:tiny, its model shrunk (MODEL), one 4 x 32 concat phase, `steps` steps on one device.
    The lr schedule is fixed (decay_steps=20), so it does not depend on `steps`: 3 steps then 2 more are 5 steps."""
    config = load_config("tiny")
    config.run_dir = run_dir
    config.mesh = {"data": 1}
    config.model.update(MODEL)
    config.data.root = corpus
    del config.data.phases["code_long"]
    config.data.phase_order = ("general",)
    config.data.phases.general.update(tokens=100 * BATCH * SEQ_LEN, seq_len=SEQ_LEN, global_batch=BATCH)
    config.train.update(steps=steps, log_every=1, eval_every=0, eval_batches=1)
    config.monitor.sinks = "jsonl"
    config.optim.update(warmup_steps=2, decay_steps=20)
    config.checkpoint.update(every=STEPS, keep=1)
    return config


def _train(run_dir: str, corpus: str, steps: int):
    return train(from_config_dict(fixture_config(run_dir, corpus, steps)), devices=jax.devices()[:1])


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def corpus_fingerprint(corpus: str) -> dict[str, str]:
    """sha256 of the corpus's tokenizer and every shard: equal fingerprints, equal token streams."""
    with open(os.path.join(corpus, "metadata.json")) as f:
        meta = json.load(f)
    files = ["tokenizer.json"] + sorted(s for d in meta["domains"].values() for split in ("train", "heldout")
                                         for s in d[split]["shards"])
    return {name: _sha256(os.path.join(corpus, name)) for name in files}


def _metrics(run_dir: str) -> dict[int, dict[str, float]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r for r in rows if "train/loss" in r}


CONTINUATION_KEYS = ("train/loss", "train/ce", "train/grad_norm", "train/update_rms", "train/lr")


def _nll(mesh, graphdef, params, buffers, ids: list[int]) -> np.ndarray:
    """Next-token NLLs of `ids`: the model's float32 logits (README-style jitted `apply`), log-softmaxed in float64."""
    with sharding.use_mesh(mesh):
        out = jitted_apply(graphdef)(params, buffers, jax.numpy.asarray([ids], np.int32))
    assert out.mtp_logits is not None and out.mtp_logits.shape == out.logits.shape  # the MTP layer came along
    logits = np.asarray(out.logits[0], np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return -logp[np.arange(len(ids) - 1), ids[1:]]


def write_fixture(out: str) -> None:
    """Write tests/fixtures/pre_seam_run with the code of the checkout it runs in (see tests/fixtures/README.md).

    Trains STEPS steps over a fresh sample corpus (built as conftest's `sample_corpus` builds it), keeps that run
    dir, resumes a copy of it for MORE steps and records the continuation (checked against an uninterrupted run of
    STEPS + MORE steps), and the step's NLLs of PROBE."""
    from tokenizers import Tokenizer

    from data_prep import cli

    work = tempfile.mkdtemp(prefix="pre_seam_")
    corpus, run = os.path.join(work, "corpus"), os.path.join(work, "pre_seam_run")
    assert cli.main(["sample", "--out", corpus, "--max-docs-per-domain", "300"]) == 0  # = conftest.sample_corpus
    _, summary = _train(run, corpus, STEPS)
    assert summary["steps"] == STEPS and os.listdir(os.path.join(run, "checkpoints")) == [str(STEPS)]

    resumed = os.path.join(work, "resumed")
    shutil.copytree(run, resumed)
    _, summary = _train(resumed, corpus, STEPS + MORE)
    assert (summary["start_step"], summary["steps"]) == (STEPS + 1, STEPS + MORE)
    straight = os.path.join(work, "straight")
    _, straight_summary = _train(straight, corpus, STEPS + MORE)
    got, want = _metrics(resumed), _metrics(straight)
    continuation = {s: {k: got[s][k] for k in CONTINUATION_KEYS} for s in range(STEPS + 1, STEPS + MORE + 1)}
    for s, row in continuation.items():  # resuming is exact in the code that wrote the fixture
        assert row == {k: want[s][k] for k in CONTINUATION_KEYS}, (s, row, want[s])
    assert summary["eval/ce"] == straight_summary["eval/ce"]

    step_dir = os.path.join(run, "checkpoints", str(STEPS))
    ids = Tokenizer.from_file(os.path.join(run, "tokenizer.json")).encode(PROBE, add_special_tokens=False).ids
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    nll = _nll(mesh, *checkpoint.load_params(step_dir, mesh)[1:], ids).tolist()
    expected = {
        "written_by": "tests/test_checkpoint_compat.py:write_fixture", "steps": STEPS,
        "corpus": corpus_fingerprint(corpus),
        "continuation": {"steps": STEPS + MORE, "metrics": {str(s): row for s, row in continuation.items()},
                         "eval/ce": summary["eval/ce"]},
        "probe": {"text": PROBE, "ids": ids, "nll": nll},
    }
    if os.path.exists(out):
        shutil.rmtree(out)
    # The run dir as train() left it, less what a resume does not read (metrics.jsonl; no tensorboard/ was written).
    shutil.copytree(run, out, ignore=shutil.ignore_patterns("metrics.jsonl", "tensorboard"))
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    shutil.rmtree(work)


# --- the tests ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def expected():
    """What the code that wrote the fixture computed from it (write_fixture)."""
    with open(os.path.join(FIXTURE, "expected.json")) as f:
        return json.load(f)


def _path_key(path) -> tuple[str, ...]:
    """A pytree path as plain names: optax's named tuples, nnx States and the dicts Orbax reads back agree on these."""
    return tuple(str(next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k)) for k in path)


def _by_path(tree) -> dict[tuple[str, ...], np.ndarray]:
    return {_path_key(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _assert_same_arrays(got, want, what: str) -> None:
    got, want = _by_path(got), _by_path(want)
    assert sorted(got) == sorted(want), what
    for key, x in want.items():
        assert got[key].dtype == x.dtype and got[key].shape == x.shape, (what, key)
        np.testing.assert_array_equal(got[key], x, err_msg=f"{what}: {'.'.join(key)}")


def _read_json(step_dir: str, item: str):
    with open(os.path.join(step_dir, item, "metadata")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def saved():
    """The fixture step as plain arrays and JSON, read with Orbax's StandardCheckpointer and `json`, not through
    glm46_jax.training.checkpoint."""
    step_dir = os.path.join(FIXTURE, "checkpoints", str(STEPS))
    with ocp.StandardCheckpointer() as reader:
        model, optimizer = (reader.restore(os.path.join(step_dir, item)) for item in ("model", "optimizer"))
    return {"model": model, "optimizer": optimizer, "data": _read_json(step_dir, "data"),
            "meta": _read_json(step_dir, "meta")}


@pytest.fixture(scope="module")
def run_copy(tmp_path_factory):
    """A copy of the fixture run dir (nothing may write into tests/fixtures)."""
    run = str(tmp_path_factory.mktemp("pre_seam") / "run")
    shutil.copytree(FIXTURE, run)
    return run


def test_fixture_is_a_complete_training_checkpoint(saved):
    assert sorted(os.listdir(FIXTURE)) == ["checkpoints", "config.json", "expected.json", "status.json",
                                           "tokenizer.json"]
    assert os.listdir(os.path.join(FIXTURE, "checkpoints")) == [str(STEPS)]
    assert {"model", "optimizer", "data", "meta"} <= set(os.listdir(os.path.join(FIXTURE, "checkpoints", str(STEPS))))
    assert int(saved["optimizer"]["step"]) == STEPS
    (data,) = saved["data"]["processes"]  # one process
    assert (data["phase_name"], data["step"], data["tokens_seen"]) == ("general", STEPS, STEPS * BATCH * SEQ_LEN)
    assert saved["meta"]["tokens_seen"] == STEPS * BATCH * SEQ_LEN
    assert saved["meta"]["tokenizer"]["sha256"] == _sha256(os.path.join(FIXTURE, "tokenizer.json"))


def test_restores_onto_a_fresh_state(run_copy, sample_corpus, saved):
    """restore_latest onto a newly built state of the same config: the step's weights, optimizer state (Muon and
    AdamW moments, counts), data-iterator state and meta, exactly as on disk."""
    from glm46_jax.recipes import pretrain

    cfg = from_config_dict(fixture_config(run_copy, sample_corpus, STEPS))
    _, fresh = pretrain.Pretraining.build(cfg, jax.devices()[:1])
    ckpt = checkpoint.Checkpointer(run_copy, every=cfg.checkpoint.every, keep=cfg.checkpoint.keep)
    try:
        assert ckpt.steps() == [STEPS]
        step, state, data_state, meta = ckpt.restore_latest(fresh)
    finally:
        ckpt.close()
    assert step == STEPS and int(state.step) == STEPS
    model = saved["model"]
    _assert_same_arrays(nnx.to_pure_dict(state.params), model["params"], "params")
    _assert_same_arrays(nnx.to_pure_dict(state.buffers), model["buffers"], "buffers")
    _assert_same_arrays({"step": state.step, "opt_state": state.opt_state}, saved["optimizer"], "optimizer")
    assert not np.array_equal(np.asarray(state.params["embed_tokens"][...]),
                              np.asarray(fresh.params["embed_tokens"][...]))  # trained, not the init
    assert data_state == saved["data"]["processes"][0]
    assert meta == saved["meta"]
    assert model_config_from_dict(meta["model_config"]) == cfg.model


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, sample_corpus):
    """The fixture run, copied, continued by `train()` for MORE steps."""
    run = str(tmp_path_factory.mktemp("resumed") / "run")
    shutil.copytree(FIXTURE, run)
    _, summary = _train(run, sample_corpus, STEPS + MORE)
    return run, summary


def test_resumes_from_the_next_step(resumed):
    run, summary = resumed
    assert (summary["start_step"], summary["steps"], summary["total_steps"]) == (STEPS + 1, STEPS + MORE,
                                                                                   STEPS + MORE)
    assert summary["tokens_seen"] == (STEPS + MORE) * BATCH * SEQ_LEN  # counted on from the checkpoint's
    assert summary["checkpoint"] == os.path.join(run, "checkpoints", str(STEPS + MORE))
    assert os.listdir(os.path.join(run, "checkpoints")) == [str(STEPS + MORE)]  # keep=1
    assert sorted(_metrics(run)) == list(range(STEPS + 1, STEPS + MORE + 1))  # no step ran twice
    with open(os.path.join(run, "status.json")) as f:
        assert json.load(f) == {"state": "complete", "step": STEPS + MORE, "total_steps": STEPS + MORE,
                                "reason": None}
    (data,) = _read_json(summary["checkpoint"], "data")["processes"]
    assert (data["step"], data["tokens_seen"]) == (STEPS + MORE, (STEPS + MORE) * BATCH * SEQ_LEN)


def test_resumed_steps_equal_the_old_codes(resumed, sample_corpus, expected):
    """The continuation's losses, gradient norms, update sizes, lrs and final held-out CE are those the code that
    wrote the fixture got resuming it (equal there to an uninterrupted run): same data position, weights,
    optimizer state and schedule. Needs the very corpus the fixture trained on."""
    if corpus_fingerprint(sample_corpus) != expected["corpus"]:
        pytest.skip("this Python's stdlib gives another sample corpus than the one the fixture was written with, "
                    "so the continuation reads other tokens")
    run, summary = resumed
    got = _metrics(run)
    for step, want in expected["continuation"]["metrics"].items():
        for key, value in want.items():
            assert got[int(step)][key] == pytest.approx(value, rel=1e-5), (step, key)
    assert summary["eval/ce"] == pytest.approx(expected["continuation"]["eval/ce"], rel=1e-5)


def _hf_tensors(hf_dir: str) -> dict[str, np.ndarray]:
    files = [f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]
    return {k: v for f in files for k, v in load_file(os.path.join(hf_dir, f)).items()}


def _released_layout(model: dict, cfg) -> dict[str, np.ndarray]:
    """The saved weights under GLM-4.5's released names and [out, in] layout
    (docs/architecture.md#hf-checkpoint-layout), spelled out here independently of glm46_jax.interop.hf: the MTP
    layer is layer num_hidden_layers, with copies of the embedding and head."""
    p, b = model["params"], model["buffers"]
    d, kd, L = cfg.hidden_size, cfg.first_k_dense_replace, cfg.num_hidden_layers
    out = {"model.embed_tokens.weight": p["embed_tokens"], "model.norm.weight": p["norm"]["weight"],
           "lm_head.weight": p["lm_head"].T}

    def layer(prefix: str, lp: dict, lb: dict | None) -> None:
        a = lp["self_attn"]
        for x in ("q", "k", "v"):
            out[f"{prefix}self_attn.{x}_proj.weight"] = a[f"{x}_proj"].reshape(d, -1).T
            out[f"{prefix}self_attn.{x}_proj.bias"] = a[f"{x}_bias"].reshape(-1)
        out[f"{prefix}self_attn.o_proj.weight"] = a["o_proj"].reshape(-1, d).T
        for x in ("q_norm", "k_norm"):
            out[f"{prefix}self_attn.{x}.weight"] = a[x]["weight"]
        for x in ("input_layernorm", "post_attention_layernorm"):
            out[f"{prefix}{x}.weight"] = lp[x]["weight"]
        mlp = lp["mlp"]
        if lb is None:
            for x in ("gate_proj", "up_proj", "down_proj"):
                out[f"{prefix}mlp.{x}.weight"] = mlp[x].T
            return
        for x in ("gate_proj", "up_proj", "down_proj"):
            out[f"{prefix}mlp.shared_experts.{x}.weight"] = mlp["shared_experts"][x].T
            for e in range(cfg.n_routed_experts):
                out[f"{prefix}mlp.experts.{e}.{x}.weight"] = mlp[x][e].T
        out[f"{prefix}mlp.gate.weight"] = mlp["router"].T
        out[f"{prefix}mlp.gate.e_score_correction_bias"] = lb["mlp"]["e_score_correction_bias"]

    def index(tree, i):
        return jax.tree.map(lambda x: x[i], tree)

    for i in range(L):
        if i < kd:
            layer(f"model.layers.{i}.", index(p["dense_layers"], i), None)
        else:
            layer(f"model.layers.{i}.", index(p["moe_layers"], i - kd), index(b["moe_layers"], i - kd))
    mtp, m = f"model.layers.{L}.", p["mtp"]
    layer(mtp, m["block"], b["mtp"]["block"])
    out.update({mtp + "enorm.weight": m["enorm"]["weight"], mtp + "hnorm.weight": m["hnorm"]["weight"],
                mtp + "eh_proj.weight": m["eh_proj"].T, mtp + "shared_head.norm.weight": m["shared_head_norm"]["weight"],
                mtp + "embed_tokens.weight": p["embed_tokens"], mtp + "shared_head.head.weight": p["lm_head"].T})
    return {k: np.asarray(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def export(run_copy, tmp_path_factory):
    """`python -m glm46_jax.convert ckpt-to-hf --run-dir <fixture> --out ... --dtype float32`."""
    out = str(tmp_path_factory.mktemp("export") / "hf")
    assert convert.main(["ckpt-to-hf", "--run-dir", run_copy, "--out", out, "--dtype", "float32"]) == out
    return out


def test_exports_the_saved_weights(export, saved):
    cfg = model_config_from_dict(saved["meta"]["model_config"])
    want, got = _released_layout(saved["model"], cfg), _hf_tensors(export)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == np.float32, name
        np.testing.assert_array_equal(got[name], tensor, err_msg=name)
    assert sorted(os.listdir(export)) == ["config.json", "generation_config.json", "model.safetensors",
                                         "tokenizer.json", "tokenizer_config.json"]
    assert _sha256(os.path.join(export, "tokenizer.json")) == _sha256(os.path.join(FIXTURE, "tokenizer.json"))
    with open(os.path.join(export, "config.json")) as f:
        hf_config = json.load(f)
    assert (hf_config["num_hidden_layers"], hf_config["hidden_size"], hf_config["n_routed_experts"],
            hf_config["num_nextn_predict_layers"]) == (2, 32, 4, 1)


def test_readme_api_on_the_export(export, run_copy, saved, expected, tmp_path, mesh1):
    """README's `load_hf` -> `apply` -> `save_hf` on the exported weights: the saved weights, the next-token NLLs
    the old code computed from the checkpoint (through load_params), and a re-save identical to the export.
    load_params itself still reads the same config and weights."""
    ckpt_cfg, _, ckpt_params, ckpt_buffers = checkpoint.load_params(run_copy, mesh1)
    assert ckpt_cfg == model_config_from_dict(saved["meta"]["model_config"])
    _assert_same_arrays(nnx.to_pure_dict(ckpt_params), saved["model"]["params"], "load_params params")
    _assert_same_arrays(nnx.to_pure_dict(ckpt_buffers), saved["model"]["buffers"], "load_params buffers")

    cfg, graphdef, params, buffers = load_hf(export, mesh1)
    _assert_same_arrays(nnx.to_pure_dict(params), saved["model"]["params"], "params")
    _assert_same_arrays(nnx.to_pure_dict(buffers), saved["model"]["buffers"], "buffers")
    probe = expected["probe"]
    np.testing.assert_allclose(_nll(mesh1, graphdef, params, buffers, probe["ids"]), probe["nll"], rtol=0, atol=1e-4)

    again = str(tmp_path / "again")
    save_hf(again, cfg, params, buffers, dtype="float32", mtp_copies=True)
    first, second = _hf_tensors(export), _hf_tensors(again)
    assert sorted(second) == sorted(first)
    for name, tensor in first.items():
        np.testing.assert_array_equal(second[name], tensor, err_msg=name)
    with open(os.path.join(export, "config.json")) as a, open(os.path.join(again, "config.json")) as b:
        assert json.load(a) == json.load(b)


def test_a_resuming_run_does_not_read_init_from(tmp_path, sample_corpus):
    """A run that resumes takes its trained weights from its own checkpoint: `checkpoint.init_from` (a mid-training
    run's starting weights, hundreds of GB at GLM-4.5's size) is not read again on every restart, so a requeued
    run still resumes after that directory is gone."""
    run = str(tmp_path / "run")
    shutil.copytree(FIXTURE, run)
    config = fixture_config(run, sample_corpus, STEPS + 1)
    config.checkpoint.init_from = str(tmp_path / "moved_away")
    _, summary = train(from_config_dict(config), devices=jax.devices()[:1])
    assert (summary["start_step"], summary["steps"]) == (STEPS + 1, STEPS + 1)

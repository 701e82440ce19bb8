"""The conversion CLI (`python -m glm46_jax.convert`): the HF fixture through a checkpoint and back is
bit-identical and keeps HF's golden logits; a trained-like checkpoint exports with its tokenizer and loads
back exactly (and, where torch + transformers are importable, in transformers with equal logits)."""

import contextlib
import json
import os
import pickle

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from conftest import FIXTURES, jitted_apply
from glm46_jax.training import checkpoint
from glm46_jax.interop import convert, hf
from glm46_jax.parallel import sharding
from glm46_jax.errors import InputError
from glm46_jax.config import from_hf_config, get_preset
from glm46_jax.interop.hf import load_hf
from glm46_jax.model import init_model
from test_hf_parity import without_mtp
from test_score import assert_one_line_error, run_cli

HF_FULL = os.path.join(FIXTURES, "hf_full")
# config.json keys the exporter writes in the released checkpoints' form rather than as transformers-5's
# save_pretrained did (the architecture they describe is compared through from_hf_config below):
NORMALISED = {
    "rope_parameters", "rope_theta", "partial_rotary_factor", "rope_scaling",  # nested -> top-level rope fields
    "dtype", "torch_dtype",                                                    # released configs say torch_dtype
    "eos_token_id",                                                            # null -> [] (no eos ids)
    "bos_token_id", "output_router_logits", "transformers_version",           # HF-only bookkeeping, not written
}
TEXT = "def add(x, y):\n    return x + y  # the sum of two numbers\n"


@contextlib.contextmanager
def _no_unpickling():
    """Any unpickling during conversion fails the test: only safetensors, JSON and Orbax may be read."""
    def refuse(*_, **__):
        raise AssertionError("conversion unpickled something")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("load", "loads", "Unpickler"):
            mp.setattr(pickle, name, refuse)
        yield


def _tensors(hf_dir):
    files = [f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]
    return {k: v for f in files for k, v in load_file(os.path.join(hf_dir, f)).items()}


def _logits(mesh, graphdef, params, buffers, ids, positions=None):
    with sharding.use_mesh(mesh):
        out = jitted_apply(graphdef)(params, buffers, jnp.asarray(ids, jnp.int32),
                                     None if positions is None else jnp.asarray(positions))
    return out


def _assert_same_state(a, b):
    la, lb = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb, strict=True):
        assert x.dtype == y.dtype, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def test_hf_fixture_round_trip_is_bit_identical_and_keeps_golden_logits(tmp_path, mesh1):
    run, export = str(tmp_path / "run"), str(tmp_path / "export")
    with _no_unpickling():
        step_dir = convert.main(["hf-to-ckpt", "--hf-dir", HF_FULL, "--out", run])
        with pytest.warns(UserWarning, match="no tokenizer.json"):
            assert convert.main(["ckpt-to-hf", "--run-dir", run, "--out", export, "--dtype", "float32"]) == export
    assert step_dir == os.path.join(run, "checkpoints", "0")
    assert checkpoint.read_meta(step_dir)["fresh_init"] == []  # every weight came from the directory
    assert sorted(os.listdir(export)) == ["config.json", "model.safetensors"]  # weights only, no tokenizer
    assert sorted(os.listdir(tmp_path)) == ["export", "run"]  # no temporary directories left behind

    # Every tensor (the MTP layer's copies of the embedding and head included), bit for bit.
    original, written = _tensors(HF_FULL), _tensors(export)
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        assert written[name].dtype == tensor.dtype, name
        np.testing.assert_array_equal(written[name], tensor, err_msg=name)

    with open(os.path.join(HF_FULL, "config.json")) as f:
        want = json.load(f)
    with open(os.path.join(export, "config.json")) as f:
        got = json.load(f)
    assert {k: v for k, v in got.items() if k not in NORMALISED} == {k: v for k, v in want.items() if k not in NORMALISED}
    assert from_hf_config(got) == from_hf_config(want)

    # golden.npz is transformers' output for exactly these weights.
    gold = np.load(os.path.join(HF_FULL, "golden.npz"))
    _, graphdef, params, buffers = load_hf(export, mesh1)
    out = _logits(mesh1, graphdef, params, buffers, gold["input_ids"], gold["position_ids"])
    err = np.abs(np.asarray(out.logits) - gold["logits"]).max()
    mtp_err = np.abs(np.asarray(out.mtp_logits)[:, :-1] - gold["mtp_logits"]).max()
    print(f"export of the imported fixture vs HF golden: logits max|Δ|={err:.2e}, MTP max|Δ|={mtp_err:.2e}")
    assert err <= 1e-4 and mtp_err <= 1e-4


def _train_tokenizer(path):
    """A small byte-level BPE with the run's special tokens: <|pad|> = 0, <|endoftext|> = 1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|pad|>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT * 3, "the quick brown fox jumps over the lazy dog\n" * 5], trainer)
    tok.save(path)
    return tok


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, mesh1):
    """A tiny run dir with steps 3 (the init) and 7 (perturbed weights, non-zero correction biases),
    the run's tokenizer.json, and step 7 exported in float32."""
    root = tmp_path_factory.mktemp("trained")
    run = str(root / "run")
    cfg = get_preset("tiny")
    graphdef, params, buffers = init_model(cfg, mesh1, 0)
    checkpoint.save_params(os.path.join(run, "checkpoints"), 3, params, buffers, cfg)
    # "Training": perturb in NumPy (a jax.random draw per leaf would compile ~60 programs) and put back in place.
    rng = np.random.default_rng(1)

    def noise(x, scale, keep):
        return jax.device_put(keep * np.asarray(x) + scale * rng.standard_normal(x.shape).astype(x.dtype), x.sharding)

    params = jax.tree.map(lambda p: noise(p, 0.1, 1.0), params)
    buffers = jax.tree.map(lambda b: noise(b, 0.1, 0.0), buffers)
    checkpoint.save_params(os.path.join(run, "checkpoints"), 7, params, buffers, cfg)
    tok = _train_tokenizer(os.path.join(run, "tokenizer.json"))  # where training puts the corpus's
    export = str(root / "export")
    with _no_unpickling():
        convert.main(["ckpt-to-hf", "--run-dir", run, "--out", export, "--dtype", "float32"])
    return {"run": run, "export": export, "cfg": cfg, "graphdef": graphdef, "params": params,
            "buffers": buffers, "tok": tok}


def test_trained_checkpoint_exports_exactly_with_its_tokenizer(trained_run, mesh1):
    t, export = trained_run, trained_run["export"]
    assert float(np.abs(np.asarray(jax.tree.leaves(t["buffers"])[0])).max()) > 0
    cfg, _, params, buffers = load_hf(export, mesh1)  # the latest step (7) was exported
    assert cfg == t["cfg"]
    _assert_same_state(params, t["params"])
    _assert_same_state(buffers, t["buffers"])
    assert _tensors(export)["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == np.float32

    with open(os.path.join(t["run"], "tokenizer.json"), "rb") as a, open(os.path.join(export, "tokenizer.json"), "rb") as b:
        assert a.read() == b.read()
    with open(os.path.join(export, "tokenizer_config.json")) as f:
        tc = json.load(f)
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tc["eos_token"], tc["pad_token"], tc["model_max_length"]) == ("<|endoftext|>", "<|pad|>", 2048)
    with open(os.path.join(export, "generation_config.json")) as f:
        gc = json.load(f)
    assert (gc["eos_token_id"], gc["pad_token_id"]) == (1, 0)


def test_export_options_and_import_back(trained_run, tmp_path, mesh1):
    """bf16 (the default), small shards, an explicit --tokenizer, --step; then the export imported again."""
    t = trained_run
    export, run2 = str(tmp_path / "bf16"), str(tmp_path / "run2")
    tok_copy = str(tmp_path / "tok.json")
    t["tok"].save(tok_copy)
    convert.main(["ckpt-to-hf", "--run-dir", t["run"], "--step", "7", "--out", export, "--tokenizer", tok_copy,
                  "--max-shard-size", "64KiB", "--no-mtp-copies"])
    with open(os.path.join(export, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    tensors = _tensors(export)
    assert tensors["model.layers.1.self_attn.q_proj.weight"].dtype == ml_dtypes.bfloat16
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == np.float32
    assert "model.layers.3.eh_proj.weight" in tensors and "model.layers.3.embed_tokens.weight" not in tensors
    with open(os.path.join(export, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"

    # hf-to-ckpt on the export: a checkpoint a run starts from, with the bf16-rounded weights and the tokenizer.
    convert.main(["hf-to-ckpt", "--hf-dir", export, "--out", run2, "--step", "5"])
    cfg, _, params, buffers = checkpoint.load_params(run2, mesh1)
    assert checkpoint.latest_checkpoint(run2).endswith(os.path.join("checkpoints", "5"))
    assert cfg == t["cfg"]
    bf16 = jax.tree.map(lambda p: np.asarray(p).astype(ml_dtypes.bfloat16).astype(np.float32), t["params"])
    _assert_same_state(params, bf16)
    _assert_same_state(buffers, t["buffers"])  # fp32 on disk, so exact
    assert checkpoint.tokenizer_path(checkpoint.latest_checkpoint(run2)) == os.path.join(run2, "tokenizer.json")


@pytest.mark.live_hf
def test_export_loads_in_transformers_with_equal_logits(trained_run, mesh1):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    t, export = trained_run, trained_run["export"]

    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    ids = tokenizer(TEXT)["input_ids"]
    assert ids == t["tok"].encode(TEXT).ids and tokenizer.decode(ids) == TEXT
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|endoftext|>", 1, 0)

    model = transformers.AutoModelForCausalLM.from_pretrained(
        export, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()
    batch = np.asarray([ids[:12], [1, 5, 9, 200, 511, 0, 3, 77, 300, 42, 8, 1]])
    with torch.no_grad():
        theirs = model(torch.as_tensor(batch, dtype=torch.long)).logits.float().numpy()
    ours = np.asarray(_logits(mesh1, t["graphdef"], t["params"], t["buffers"], batch).logits)
    err = np.abs(ours - theirs).max()
    print(f"transformers {transformers.__version__} on our export vs our model: logits max|Δ|={err:.2e} "
          f"(logit scale {np.abs(theirs).max():.2f})")
    assert err <= 1e-4


def test_missing_step_lists_the_available_ones(trained_run, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--step 5; available steps in .*checkpoints: \[3, 7\]"):
        convert.main(["ckpt-to-hf", "--run-dir", trained_run["run"], "--step", "5", "--out", str(tmp_path / "x")])
    assert not os.path.exists(tmp_path / "x")


def test_not_a_checkpoint_or_hf_dir(tmp_path):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("hello")
    with pytest.raises(FileNotFoundError, match=f"{junk}.*not a checkpoint"):
        convert.main(["ckpt-to-hf", "--run-dir", str(junk), "--out", str(tmp_path / "a")])
    with pytest.raises(FileNotFoundError, match=f"{junk}.*no such directory"):
        convert.main(["ckpt-to-hf", "--run-dir", str(junk / "nope"), "--out", str(tmp_path / "a")])
    with pytest.raises(FileNotFoundError, match=f"{junk}: not a Hugging Face model directory"):
        convert.main(["hf-to-ckpt", "--hf-dir", str(junk), "--out", str(tmp_path / "b")])
    assert sorted(os.listdir(tmp_path)) == ["junk"]


def test_non_empty_out_needs_force_and_failures_leave_nothing(trained_run, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = ["ckpt-to-hf", "--run-dir", trained_run["run"], "--out", str(out), "--dtype", "float32"]
    with pytest.raises(InputError, match=f"{out}: not empty; pass --force"):
        convert.main(args)
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(InputError, match="contains the source"):  # --force must never delete the run
        convert.main(["ckpt-to-hf", "--run-dir", trained_run["run"], "--out", trained_run["run"], "--force"])

    def crash(out_dir, *a, **k):  # dies after writing part of the export
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write("{")
        raise OSError("disk full")
    monkeypatch.setattr(hf, "save_hf", crash)
    with pytest.raises(OSError, match="disk full"):
        convert.main(args + ["--force"])
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(out) == ["keep.txt"]
    monkeypatch.undo()

    convert.main(args + ["--force"])
    assert "keep.txt" not in os.listdir(out) and "config.json" in os.listdir(out)
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_hf_dir_without_mtp_imports_with_a_fresh_mtp_layer(tmp_path, mesh1, capsys):
    """A directory saved by transformers (no MTP tensors): the main model imported bit for bit, the MTP layer
    initialised as a new model's would be (HF's scheme: N(0, initializer_range) matrices, unit norms, zero
    biases), deterministically, and the checkpoint's meta says which part is not imported."""
    d = without_mtp(HF_FULL, str(tmp_path / "hf"))
    step_dir = convert.main(["hf-to-ckpt", "--hf-dir", d, "--out", str(tmp_path / "run")])
    said = [line for line in capsys.readouterr().out.splitlines() if "MTP" in line]
    assert len(said) == 1 and "initialised fresh" in said[0], said
    assert checkpoint.read_meta(step_dir)["fresh_init"] == ["mtp"]

    cfg, graphdef, params, buffers = checkpoint.load_params(step_dir, mesh1)
    assert cfg.num_nextn_predict_layers == 1  # config.json's: a run from here trains the MTP layer
    source = _tensors(d)
    np.testing.assert_array_equal(np.asarray(params["embed_tokens"].get_value()), source["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(params["lm_head"].get_value()), source["lm_head.weight"].T)
    np.testing.assert_array_equal(np.asarray(params["moe_layers"]["mlp"]["gate_proj"].get_value())[1, 5],
                                  source["model.layers.2.mlp.experts.5.gate_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(buffers["moe_layers"]["mlp"]["e_score_correction_bias"].get_value())[0],
                                  source["model.layers.1.mlp.gate.e_score_correction_bias"])
    # Every main-model weight is the fixture's (load_hf of the complete fixture is checked against HF's logits).
    _, _, ref_params, ref_buffers = load_hf(HF_FULL, mesh1)
    for ours, ref in ((params, ref_params), (buffers, ref_buffers)):
        main = {p: v for p, v in nnx.to_flat_state(ours) if p[0] != "mtp"}
        want = {p: v for p, v in nnx.to_flat_state(ref) if p[0] != "mtp"}
        assert sorted(main) == sorted(want)
        for path, v in want.items():
            np.testing.assert_array_equal(np.asarray(main[path].get_value()), np.asarray(v.get_value()), str(path))
    gold = np.load(os.path.join(HF_FULL, "golden.npz"))
    out = _logits(mesh1, graphdef, params, buffers, gold["input_ids"], gold["position_ids"])
    assert np.abs(np.asarray(out.logits) - gold["logits"]).max() <= 1e-4
    assert np.isfinite(np.asarray(out.mtp_logits)).all()

    mtp = {".".join(map(str, p)): np.asarray(v.get_value())
           for p, v in (*nnx.to_flat_state(params["mtp"]), *nnx.to_flat_state(buffers["mtp"]))}
    ones = [k for k in mtp if k.endswith("norm.weight")]
    zeros = [k for k in mtp if k.endswith(("_bias", "correction_bias"))]
    assert len(ones) == 7 and len(zeros) == 4, sorted(mtp)  # 3 MTP norms + 2 block norms + q/k norms; q/k/v + router bias
    for k in ones:
        np.testing.assert_array_equal(mtp[k], 1.0, err_msg=k)
    for k in zeros:
        np.testing.assert_array_equal(mtp[k], 0.0, err_msg=k)
    matrices = sorted(set(mtp) - set(ones) - set(zeros))
    assert len(matrices) == 12, matrices  # eh_proj, q/k/v/o, router, shared gate/up/down, experts gate/up/down
    for k in matrices:
        w = mtp[k]
        assert abs(w.mean()) < 0.1 * cfg.initializer_range and abs(w.std() / cfg.initializer_range - 1) < 0.15, k
    assert len({mtp[k].tobytes() for k in matrices}) == len(matrices)  # independent draws
    original = load_file(os.path.join(HF_FULL, "model.safetensors"))["model.layers.3.eh_proj.weight"].T
    assert not np.allclose(mtp["eh_proj"], original)

    # Deterministic: the same directory imports to the same checkpoint.
    step_dir2 = convert.main(["hf-to-ckpt", "--hf-dir", d, "--out", str(tmp_path / "run2")])
    _, _, params2, buffers2 = checkpoint.load_params(step_dir2, mesh1)
    _assert_same_state(params2, params)
    _assert_same_state(buffers2, buffers)


@pytest.fixture(scope="module")
def bad_convert_inputs(tmp_path_factory, trained_run):
    root = tmp_path_factory.mktemp("bad_convert")
    inconsistent = root / "inconsistent"
    inconsistent.mkdir()
    with open(os.path.join(HF_FULL, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = 4  # the tensors are of 3 layers (+ MTP)
    (inconsistent / "config.json").write_text(json.dumps(config))
    os.link(os.path.join(HF_FULL, "model.safetensors"), inconsistent / "model.safetensors")
    junk = root / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("not a checkpoint")
    return {"run": trained_run["run"], "junk": str(junk), "inconsistent": str(inconsistent),
            "missing": str(root / "nope"), "out": str(root / "out")}


@pytest.mark.parametrize("args, message", [
    (["hf-to-ckpt", "--hf-dir", "{missing}", "--out", "{out}"], "not a Hugging Face model directory"),
    (["hf-to-ckpt", "--hf-dir", "{inconsistent}", "--out", "{out}"], "check num_hidden_layers"),
    (["hf-to-ckpt", "--hf-dir", "{junk}", "--out", "{out}", "--step", "x"], "--step"),
    (["ckpt-to-hf", "--run-dir", "{junk}", "--out", "{out}"], "not a checkpoint"),
    (["ckpt-to-hf", "--run-dir", "{run}", "--out", "{run}", "--force"], "contains the source"),
    (["ckpt-to-hf", "--run-dir", "{run}", "--out", "{out}", "--max-shard-size", "5XB"], "--max-shard-size='5XB'"),
    (["ckpt-to-hf", "--run-dir", "{run}", "--out", "{out}", "--max-shard-size", "1KiB"], "embed_tokens [512, 64]"),
], ids=["missing-hf-dir", "inconsistent-config", "bad-step", "not-a-checkpoint", "out-is-source",
        "bad-size", "too-small-shards"])
def test_convert_user_errors_are_one_line_exit_2(args, message, bad_convert_inputs):
    assert_one_line_error(run_cli("glm46_jax.convert", *(a.format(**bad_convert_inputs) for a in args)), message)
    assert not os.path.exists(bad_convert_inputs["out"])  # and nothing written

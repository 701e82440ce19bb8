"""The SFT recipe (configs/sft.py through python -m glm46_jax.train): LoRA fine-tuning lowers the held-out
assistant-token CE below the base model's (a float64 recomputation), trains and checkpoints only the adapters
and writes merged weights equal to base + scale·A·B in NumPy; full fine-tuning trains every weight; a LoRA run
killed with SIGKILL resumes bit-identically; config mistakes are one line."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import float64_nll, subprocess_env
from optimized_code import optimized

from glm46_jax.training import checkpoint
from glm46_jax import cli
from glm46_jax.parallel import sharding
from glm46_jax.errors import InputError
from glm46_jax.config import TINY
from glm46_jax.data import sft_loader
from glm46_jax.model import init_model
from glm46_jax.run_config import from_config_dict
from glm46_jax.train import train

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
SEQ, BATCH = 512, 8


@pytest.fixture(scope="module")
def base(tmp_path_factory, mesh1):
    """A tiny model's weights saved as a checkpoint: what checkpoint.init_from points at."""
    d = str(tmp_path_factory.mktemp("base"))
    _, params, buffers = init_model(TINY, mesh1, seed=3)
    checkpoint.save_params(os.path.join(d, "checkpoints"), 1, params, buffers, TINY)
    return d


@pytest.fixture(scope="module")
def chats(tmp_path_factory, sample_corpus):
    """The sample chats (`data_prep sample-sft`) tokenized with the sample corpus's tokenizer."""
    from data_prep import cli

    out = str(tmp_path_factory.mktemp("chats"))
    assert cli.main(["sample-sft", "--tokenizer", os.path.join(sample_corpus, "tokenizer.json"), "--out", out,
                     "--conversations", "200"]) == 0
    return out


def _overrides(run_dir, base, chats, steps, method="lora", every=100):
    return {"run_dir": run_dir, "checkpoint.init_from": base, "sft.root": chats, "sft.method": method,
            "sft.seq_len": SEQ, "sft.global_batch": BATCH, "train.steps": steps, "train.log_every": 1,
            "train.eval_every": 1000, "train.eval_batches": 2, "checkpoint.every": every, "optim.warmup_steps": 2,
            "optim.lr": 3e-3}


def _config(**overrides):
    spec = importlib.util.spec_from_file_location("sft_config", os.path.join(ROOT, "configs", "sft.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("tiny")
    for path, value in overrides.items():
        *parents, leaf = path.split(".")
        node = config
        for name in parents:
            node = node[name]
        node[leaf] = value
    config.mesh = {"data": 1}
    return config


def _heldout_ce(graphdef, params, buffers, mesh, chats, count=2):
    """Assistant-token CE of the first `count` held-out batches, in float64 (the run's eval set)."""
    cfg = sft_loader.SFTLoaderConfig(root=chats, split="heldout", num_epochs=1, shuffle=False, process_index=0,
                                     process_count=1)
    total = n = 0.0
    for _, batch in zip(range(count), sft_loader.sft_batches(cfg, SEQ, BATCH)):
        nll = float64_nll(graphdef, params, buffers, mesh, batch)
        total += float(np.sum(nll * batch["loss_mask"]))
        n += float(np.sum(batch["loss_mask"]))
    return total / n


def test_lora_sft_lowers_heldout_ce_and_trains_only_adapters(tmp_path, base, chats, mesh1):
    run_dir = str(tmp_path / "lora")
    graphdef, params, buffers = init_model(TINY, mesh1, seed=3)
    before = _heldout_ce(graphdef, params, buffers, mesh1, chats)
    state, summary = train(from_config_dict(_config(**_overrides(run_dir, base, chats, steps=12))), jax.devices()[:1])
    # Only adapters were trained and saved: every leaf of the train state is an A, B (or DoRA magnitude).
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.params)]
    assert paths and all("_lora" in p for p in paths), paths[:5]
    assert summary["eval/ce"] < before - 0.05, (before, summary["eval/ce"])
    # The merged weights: base + scale * A @ B in float64, and their held-out CE is the run's.
    _, mgraph, merged, mbuffers = checkpoint.load_params(os.path.join(run_dir, "merged"), mesh1)
    adapters = {jax.tree_util.keystr(p): np.asarray(x, np.float64)
                for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
    scale = 32.0 / 16  # the tiny preset's alpha / rank
    for stack in ("moe_layers", "dense_layers"):
        w = np.asarray(params[stack]["self_attn"]["q_proj"].get_value(), np.float64)
        a = adapters[f"['{stack}']['self_attn']['q_proj_lora']['a'].value"]
        b = adapters[f"['{stack}']['self_attn']['q_proj_lora']['b'].value"]
        want = w + scale * np.einsum("ldr,lrhc->ldhc", a, b)
        got = np.asarray(merged[stack]["self_attn"]["q_proj"].get_value(), np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=stack)
        assert np.abs(got - w).max() > 1e-4  # the adapters did move
    np.testing.assert_allclose(_heldout_ce(mgraph, merged, mbuffers, mesh1, chats), summary["eval/ce"], atol=2e-4)


def test_full_sft_trains_every_weight(tmp_path, base, chats, mesh1):
    run_dir = str(tmp_path / "full")
    state, _ = train(from_config_dict(_config(**_overrides(run_dir, base, chats, steps=3, method="full"))),
                     jax.devices()[:1])
    _, params, _ = init_model(TINY, mesh1, seed=3)
    assert jax.tree.structure(state.params) == jax.tree.structure(params)
    moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params))]
    assert min(moved) > 0  # every weight moved (the base was not frozen)
    assert not os.path.exists(os.path.join(run_dir, "merged"))


def _flags(overrides):
    return [f"--config.{k}={v}" for k, v in overrides.items()] + ["--config.mesh.data=1"]


def _process(overrides):
    env = subprocess_env(1)
    cmd = [sys.executable, "-m", "glm46_jax.train", "--config=configs/sft.py:tiny", *_flags(overrides)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["train/loss"] for r in map(json.loads, f) if "train/loss" in r}


@pytest.mark.slow
def test_lora_run_killed_then_resumed_is_bit_identical(tmp_path, base, chats):
    steps = 8
    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "killed")
    ref = _process(_overrides(ref_dir, base, chats, steps, every=3))
    assert ref.wait(timeout=600) == 0, ref.communicate()[0][-3000:]
    proc = _process(_overrides(run_dir, base, chats, steps, every=3))
    def past_first_checkpoint():
        return (os.path.exists(os.path.join(run_dir, "checkpoints", "3", "meta"))
                and os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and max(_losses(run_dir), default=0) >= 5)

    t0 = time.time()
    while not past_first_checkpoint():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() - t0 < 600
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    again = _process(_overrides(run_dir, base, chats, steps, every=3))
    out = again.communicate(timeout=600)[0]
    assert again.returncode == 0, out[-3000:]
    assert "steps 4-8" in out or "steps 7-8" in out, out[-1500:]
    want, got = _losses(ref_dir), _losses(run_dir)
    assert all(got[s] == want[s] for s in range(1, steps + 1)), (want, got)  # the resumed steps too, bit for bit
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    merged = [checkpoint.load_params(os.path.join(d, "merged"), mesh)[2] for d in (ref_dir, run_dir)]
    for a, b in zip(jax.tree.leaves(merged[0]), jax.tree.leaves(merged[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("overrides, field", [
    ({"sft.method": "qlora"}, "sft.method"),
    ({"sft.seq_len": 1}, "sft.seq_len"),
    ({"lora.rank": 0}, "lora.rank"),
    ({"lora.targets": ("nothing_named_so",)}, "lora.targets"),
    ({"sft.root": "/nonexistent/chats"}, "/nonexistent/chats"),
])
def test_config_mistakes_are_one_line(tmp_path, base, chats, overrides, field):
    config = _config(**{**_overrides(str(tmp_path / "r"), base, chats, steps=2), **overrides})
    with pytest.raises(cli.user_errors(), match=field.replace(".", r"\.")):  # what the CLI prints as one line
        train(from_config_dict(config), jax.devices()[:1])


def test_lora_run_exports_a_peft_directory_that_imports_back_exactly(tmp_path, base, chats, mesh1):
    """convert lora-to-peft on a run with attention adapters (what PEFT can express for GLM-4.5 in transformers
    5, docs/lora.md#what-peft-can-express); peft.load_peft on the base gives back the run's adapters bit for bit."""
    from glm46_jax.interop import convert, peft

    run_dir = str(tmp_path / "attn")
    overrides = {**_overrides(run_dir, base, chats, steps=2), "lora.targets": ("q_proj", "k_proj", "v_proj", "o_proj")}
    state, _ = train(from_config_dict(_config(**overrides)), jax.devices()[:1])
    out = convert.main(["lora-to-peft", "--run-dir", run_dir, "--out", str(tmp_path / "peft")])
    with open(os.path.join(out, "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (16, 32.0, base)
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    _, graphdef, params, buffers = checkpoint.load_params(base, mesh1)
    _, _, adapters, _, _ = peft.load_peft(out, graphdef, params, buffers, mesh1)
    got = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(adapters)}
    want = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    with pytest.raises(InputError, match="not a LoRA run"):  # a full fine-tuning run's checkpoint
        convert.main(["lora-to-peft", "--run-dir", base, "--out", str(tmp_path / "peft2")])


@pytest.mark.slow
def test_after_sft_generation_ends_its_turn_at_user(tmp_path, base, chats):
    """Fully fine-tuned on the sample chats, the model answers a chat prompt and stops at <|user|> (the token that
    ends an assistant turn, which the loss mask trains), as the template says a turn ends."""
    from tokenizers import Tokenizer

    from glm46_jax.interop import chat
    from glm46_jax.infer import generate as gen

    run_dir = str(tmp_path / "turns")
    overrides = {**_overrides(run_dir, base, chats, steps=60, method="full"), "optim.lr": 3e-3,
                 "optim.end_lr": 3e-4}
    with optimized():  # 60 steps: a test that runs its programs more than it compiles them (tests/optimized_code.py)
        train(from_config_dict(_config(**overrides)), jax.devices()[:1])
    tok = Tokenizer.from_file(os.path.join(chats, "tokenizer.json"))
    user = tok.token_to_id("<|user|>")
    questions = ["What is 12 + 7?", "Reverse the word 'planet'.", "What is the first letter of 'rocket'?",
                 "Write 'dragon' in capital letters."]
    prompts = [chat.encode_prompt(tok, [{"role": "user", "content": q}], enable_thinking=False).tolist()
               for q in questions]
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    _, graphdef, params, buffers = checkpoint.load_params(run_dir, mesh)
    with sharding.use_mesh(mesh):
        out = gen.generate(graphdef, params, buffers, prompts, max_new_tokens=32, stop_tokens=chat.stop_token_ids(tok))
    ends = [int(np.asarray(out.tokens)[i, n - 1]) for i, n in enumerate(np.asarray(out.lengths))]
    assert ends.count(user) >= 3, [tok.decode(list(map(int, r))) for r in np.asarray(out.tokens)]

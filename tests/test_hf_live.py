"""Live parity against transformers (runs only where torch + transformers are importable; CI uses
the committed golden fixtures instead): random tiny configs, both directions of the conversion."""

import dataclasses
import glob
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from glm46_jax.parallel import sharding  # noqa: E402
from glm46_jax.config import TINY, to_hf_config  # noqa: E402
from glm46_jax.interop.hf import load_hf, save_hf  # noqa: E402
from glm46_jax.model import apply, init_model  # noqa: E402

pytestmark = pytest.mark.live_hf


def _hf_model(cfg_dict, seed):
    config = transformers.Glm4MoeConfig(**cfg_dict)
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Glm4MoeForCausalLM(config).eval()
    with torch.no_grad():  # weights large enough that routing and attention are non-trivial
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (p.shape[-1] ** -0.5 if p.ndim > 1 else 0.1) + (p.ndim == 1) * ("norm" in name))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn_like(b))
    return model


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize("use_qk_norm, n_group", [(True, 2), (False, 1)])
def test_hf_directory_loads_with_identical_logits(tmp_path, mesh1, use_qk_norm, n_group):
    cfg = dataclasses.replace(TINY, vocab_size=96, use_qk_norm=use_qk_norm, n_group=n_group,
                              routed_scaling_factor=2.5 if use_qk_norm else 1.0, num_nextn_predict_layers=0)
    d = to_hf_config(cfg, torch_dtype="float32")
    model = _hf_model({k: v for k, v in d.items() if k not in ("architectures", "model_type")}, seed=0)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ids = np.random.default_rng(0).integers(0, 96, (2, 10))
    loaded_cfg, graphdef, params, buffers = load_hf(str(tmp_path / "hf"), mesh1)
    with sharding.use_mesh(mesh1):
        ours = jax.jit(lambda p, b, t: apply(graphdef, p, b, t).logits)(params, buffers, jnp.asarray(ids, jnp.int32))
    np.testing.assert_allclose(np.asarray(ours), _hf_logits(model, ids), atol=1e-4)


def test_our_export_loads_in_transformers(tmp_path, mesh1):
    cfg = dataclasses.replace(TINY, vocab_size=96)
    graphdef, params, buffers = init_model(cfg, mesh1, seed=7)
    keys = iter(jax.random.split(jax.random.key(1), 100))
    params = jax.tree.map(lambda p: p + 0.2 * jax.random.normal(next(keys), p.shape), params)
    buffers = jax.tree.map(lambda b: 0.1 * jax.random.normal(next(keys), b.shape), buffers)
    save_hf(str(tmp_path / "export"), cfg, params, buffers, dtype="float32")
    model = transformers.Glm4MoeForCausalLM.from_pretrained(
        str(tmp_path / "export"), attn_implementation="eager", experts_implementation="eager").eval()
    ids = np.random.default_rng(1).integers(0, 96, (2, 12))
    with sharding.use_mesh(mesh1):
        ours = jax.jit(lambda p, b, t: apply(graphdef, p, b, t).logits)(params, buffers, jnp.asarray(ids, jnp.int32))
    np.testing.assert_allclose(np.asarray(ours), _hf_logits(model, ids), atol=1e-4)


def test_save_pretrained_drops_mtp_and_the_main_model_still_loads(tmp_path, mesh1, caplog):
    """transformers builds no MTP layer, so `save_pretrained` writes none, yet config.json keeps
    num_nextn_predict_layers=1: the shape of every fine-tune published with transformers."""
    cfg = dataclasses.replace(TINY, vocab_size=96)
    assert cfg.num_nextn_predict_layers == 1
    d = to_hf_config(cfg, torch_dtype="float32")
    model = _hf_model({k: v for k, v in d.items() if k not in ("architectures", "model_type")}, seed=3)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    with open(tmp_path / "hf" / "config.json") as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    names = [k for path in glob.glob(os.path.join(tmp_path, "hf", "*.safetensors"))
             for k in safe_open(path, framework="numpy").keys()]
    assert names and not [n for n in names if n.startswith(f"model.layers.{cfg.num_hidden_layers}.")]

    with caplog.at_level(logging.WARNING):
        loaded_cfg, graphdef, params, buffers = load_hf(str(tmp_path / "hf"), mesh1)
    assert loaded_cfg.num_nextn_predict_layers == 0 and "without the MTP layer" in caplog.text
    ids = np.random.default_rng(2).integers(0, 96, (2, 10))
    with sharding.use_mesh(mesh1):
        ours = jax.jit(lambda p, b, t: apply(graphdef, p, b, t).logits)(params, buffers, jnp.asarray(ids, jnp.int32))
    np.testing.assert_allclose(np.asarray(ours), _hf_logits(model, ids), atol=1e-4)

"""ModelConfig presets, HF config.json interop and parameter counts against docs/architecture.md#parameter-counting."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from glm46_jax.errors import InputError, check_known_fields
from glm46_jax.config import (GLM45, GLM45_AIR, GLM46, PRESETS, TINY, ModelConfig, from_hf_config, get_preset,
                              model_config_from_dict, to_hf_config)
from glm46_jax.model.counting import attention_params, dense_layer_params, moe_layer_params, param_counts
from glm46_jax.model import abstract_model


def test_glm45_counts_match_the_report():
    # docs/architecture.md#parameter-counting, hand arithmetic from config.json values.
    assert attention_params(GLM45) == 136_329_472
    assert dense_layer_params(GLM45) == 325_083_392
    assert moe_layer_params(GLM45) == 3_935_625_632
    assert moe_layer_params(GLM45, active=True) == 349_495_712
    c = param_counts(GLM45)
    assert (c.trunk_total, c.trunk_active) == (351_245_936_544, 32_080_373_664)
    assert (c.mtp_total, c.mtp_active) == (3_988_069_792, 401_939_872)
    assert c.embedding == c.lm_head == 775_946_240
    # The report's convention (trunk + MTP, no embedding/head): "355B total, 32B active".
    assert round(c.report_total / 1e9, 2) == 355.23
    assert round(c.report_active / 1e9, 2) == 32.48
    assert param_counts(GLM46) == c


def test_air_counts_match_the_spec():
    assert attention_params(GLM45_AIR) == 109_066_240
    c = param_counts(GLM45_AIR)
    assert (c.trunk_total, c.trunk_active) == (105_610_737_280, 12_182_615_680)
    assert round(c.trunk_total / 1e9, 2) == 105.61 and round(c.trunk_active / 1e9, 2) == 12.18
    assert c.mtp_total == 2_375_059_584
    assert c.embedding == 620_756_992


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_counting_matches_the_built_model(name):
    """The formulas and the module tree are independent; they must agree for every preset."""
    cfg = PRESETS[name]
    mesh = jax.sharding.AbstractMesh((1, 1, 1, 1), ("data", "tensor", "expert", "pipeline"),
                                     axis_types=(jax.sharding.AxisType.Explicit,) * 4)
    _, params, buffers = abstract_model(cfg, mesh)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves((params, buffers)))
    assert n == param_counts(cfg).model_total


def test_small_preset_is_one_to_two_billion():
    assert 1e9 <= param_counts(PRESETS["small"]).model_total <= 2e9


# config.json of GLM-4.5 as released (docs/architecture.md#config-fields-and-released-values;
# top-level rope fields, transformers 4.54 format).
GLM45_JSON = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
    "attention_dropout": 0.0, "eos_token_id": [151329, 151336, 151338], "first_k_dense_replace": 3,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 131072, "moe_intermediate_size": 1536,
    "n_group": 1, "n_routed_experts": 160, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 92, "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1, "pad_token_id": 151329, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000, "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16", "transformers_version": "4.54.0",
    "use_cache": True, "use_qk_norm": True, "vocab_size": 151552}


def test_from_hf_config_released_and_transformers5_forms(tmp_path):
    assert from_hf_config(GLM45_JSON) == GLM45
    v5 = {k: v for k, v in GLM45_JSON.items() if k not in ("rope_theta", "partial_rotary_factor",
                                                           "num_nextn_predict_layers", "n_routed_experts")}
    v5 |= {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000, "partial_rotary_factor": 0.5},
           "num_mtp_layers": 1, "num_local_experts": 160}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(v5))
    assert from_hf_config(tmp_path) == GLM45
    assert from_hf_config(path, dtype="bfloat16").dtype == "bfloat16"


def test_hf_config_round_trip():
    for cfg in PRESETS.values():
        assert from_hf_config(json.loads(json.dumps(to_hf_config(cfg)))) == dataclasses.replace(
            cfg, dtype="float32")


def test_missing_head_dim_falls_back_like_hf(caplog):
    d = {k: v for k, v in GLM45_JSON.items() if k != "head_dim"}
    assert from_hf_config(d).head_dim == 5120 // 96  # what HF does; wrong for GLM, hence the warning
    assert "head_dim" in caplog.text


# One bad value per ModelConfig field (and the cross-field rules), on the tiny preset.
BAD_MODEL_VALUES = [
    ("vocab_size", 0), ("score_head", -1), ("hidden_size", 0), ("intermediate_size", 0), ("moe_intermediate_size", 0),
    ("num_hidden_layers", 0), ("num_attention_heads", 0), ("num_key_value_heads", 0), ("head_dim", 0),
    ("partial_rotary_factor", 1.5), ("partial_rotary_factor", 0.1),  # 0.1 * 16 = 1.6 dims: not an even count
    ("rope_theta", 0.0), ("rms_norm_eps", 0.0), ("first_k_dense_replace", -1), ("first_k_dense_replace", 4),
    ("n_routed_experts", 0), ("n_shared_experts", -1), ("num_experts_per_tok", 0), ("num_experts_per_tok", 9),
    ("num_experts_per_tok", 5),  # > topk_group 1 x 8 / 2 experts the kept group holds
    ("routed_scaling_factor", 0.0), ("n_group", 0), ("n_group", 3), ("n_group", 8), ("topk_group", 0),
    ("topk_group", 3), ("num_nextn_predict_layers", 2), ("max_position_embeddings", 0),
    ("initializer_range", -0.02), ("hidden_act", "gelu"), ("pad_token_id", -1), ("pad_token_id", 512),
    ("eos_token_id", (512,)), ("tie_word_embeddings", True), ("dtype", "int8"), ("param_dtype", "float8"),
    ("attention_impl", "flash3"), ("attention_block_q", 0), ("attention_block_kv", -1),
    ("moe_capacity_factor", -1.0), ("moe_block_size", 0), ("moe_block_group", 0), ("scan_unroll", 0),
    ("moe_dispatch", "ragged_alltoall"),
    ("pipeline_microbatches", -1), ("pipeline_repeats", 0),
    ("remat", "some"), ("rope_theta", float("nan")), ("hidden_size", "64"),
]


def assert_names_the_field(err, section, field, value):
    """The CLI form: "<section>.<field>=<value>: <why>; <what to do with --config.<section>...>"."""
    msg = str(err.value)
    assert msg.startswith(f"{section}.{field}={value!r}: "), msg
    _, _, fix = msg.partition("; ")
    assert fix and f"--config.{section}." in fix, msg


@pytest.mark.parametrize("field, value", BAD_MODEL_VALUES)
def test_bad_model_value_names_the_field(field, value):
    with pytest.raises(InputError) as err:
        dataclasses.replace(TINY, **{field: value})
    assert_names_the_field(err, "model", field, value)


def _numeric_fields(cls):
    return {f.name for f in dataclasses.fields(cls) if f.type in ("int", "float", "int | None")}


def test_every_numeric_model_field_has_a_bad_value_case():
    assert _numeric_fields(ModelConfig) <= {f for f, _ in BAD_MODEL_VALUES}


def test_model_config_error_is_one_line_for_the_cli():
    with pytest.raises(InputError, match=r"^model\.num_key_value_heads=3: must divide num_attention_heads=8 "
                       r"\(GQA groups\); set --config\.model\.num_key_value_heads to a divisor"):
        dataclasses.replace(TINY, num_key_value_heads=3)


def test_an_unknown_field_names_the_section_the_nearest_and_the_valid_names():
    check_known_fields("config.train", ["steps", "seed"], ["seed", "steps", "eval_every"])  # all known: no error
    with pytest.raises(InputError) as err:
        check_known_fields("config.train", ["stpes", "seed"], ["seed", "steps", "eval_every"])
    assert str(err.value) == "config.train has no field 'stpes'; nearest: steps; valid fields: eval_every, seed, steps"
    with pytest.raises(InputError, match=r"^config.model has no field 'no_such_field'; nearest: no close match; "
                       r"valid fields: a, b$"):
        check_known_fields("config.model", ["no_such_field"], ["b", "a"])
    with pytest.raises(InputError) as err:
        check_known_fields("config.x", ["zz", "evl_every"], ["eval_every", "steps"])
    assert str(err.value) == ("config.x has no fields 'evl_every', 'zz'; nearest: 'evl_every' -> eval_every; "
                              "'zz' -> no close match; valid fields: eval_every, steps")


def test_unknown_model_fields_and_presets_are_input_errors():
    """The one error type for a user's bad input (errors.InputError), with check_known_fields' message."""
    with pytest.raises(InputError, match=r"^config.model has no field 'hiden_size'; nearest: hidden_size, hidden_act"
                       r"; valid fields: attention_bias, .*, preset, .*, vocab_size$"):
        model_config_from_dict({"preset": "tiny", "hiden_size": 64})
    assert model_config_from_dict({"preset": "tiny", "hidden_size": 32}).hidden_size == 32
    with pytest.raises(InputError, match=r"^unknown model preset 'nosuch'; choose one of \['glm45', "):
        get_preset("nosuch")
    with pytest.raises(InputError, match="unknown model preset 'nosuch'"):
        model_config_from_dict({"preset": "nosuch"})


def test_every_preset_and_default_validates():
    """The checks must not reject anything that ran before: the presets, the defaults, and every
    section of every configs/pretrain.py preset."""
    import importlib.util
    import os

    from glm46_jax.training.balancing import BalanceConfig
    from glm46_jax.training.loss import LossConfig
    from glm46_jax.training.optim import OptimConfig

    for cfg in PRESETS.values():
        assert dataclasses.replace(cfg) == cfg
    for cls in (ModelConfig, OptimConfig, LossConfig, BalanceConfig):
        cls()
    path = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "pretrain.py")
    spec = importlib.util.spec_from_file_location("pretrain_config_for_test_config", path)
    pretrain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pretrain)
    for preset in pretrain._PRESETS:
        c = pretrain.get_config(preset).to_dict()
        model_config_from_dict(c["model"])
        OptimConfig(**c["optim"])
        LossConfig(**c["loss"])
        BalanceConfig(**c["balance"])


def test_wrong_model_type():
    with pytest.raises(ValueError, match="glm4_moe"):
        from_hf_config({**GLM45_JSON, "model_type": "llama"})


def test_config_is_hashable_for_jit():
    assert hash(TINY) == hash(ModelConfig(**dataclasses.asdict(TINY)))

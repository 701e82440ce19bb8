"""The plan tool: per-device bytes and FLOPs against hand arithmetic, fit verdicts, mesh errors, CLI."""

import itertools
import math
import os
import subprocess
import sys

import jax
import pytest

from glm46_jax import plan as plan_lib
from glm46_jax.errors import InputError
from glm46_jax.config import GLM45, TINY
from glm46_jax.model.counting import flops_per_token, param_counts
from glm46_jax.model import abstract_model

GiB = 1 << 30
ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
CONFIG = os.path.join(ROOT, "configs", "pretrain.py")
MESH_8192 = {"data": 32, "tensor": 8, "expert": 32, "pipeline": 1}
MESH_256 = {"data": 4, "tensor": 8, "expert": 8, "pipeline": 1}


def test_glm45_per_device_param_bytes_match_hand_arithmetic():
    """data=32, tensor=8, expert=32: every leaf's local shard written out from the model's shapes and the
    logical rules (vocab/heads/kv_heads/mlp/mlp_moe -> tensor, embed/embed_moe -> data, exp -> expert,
    norms, head_dim, router experts and the stacked layers axis replicated)."""
    # H = 5120 over data 32 -> 160; V = 151552 over tensor 8 -> 18944; heads 96/8 -> 12, kv heads 8/8 -> 1;
    # I = 12288/8 -> 1536; Im = 1536/8 -> 192; experts 160/32 -> 5.
    attention = (160 * 12 * 128  # q_proj [H/data, 96/tensor, 128]
                 + 2 * 160 * 1 * 128  # k_proj, v_proj [H/data, 8/tensor, 128]
                 + 12 * 128 * 160  # o_proj [96/tensor, 128, H/data]
                 + 12 * 128 + 2 * 1 * 128  # q/k/v biases [heads/tensor, 128]
                 + 2 * 128  # q_norm, k_norm, replicated
                 + 2 * 5120)  # input / post-attention layernorm, replicated
    dense_ffn = 3 * 160 * 1536  # gate/up [H/data, I/tensor], down [I/tensor, H/data]
    moe_ffn = (160 * 160  # router [H/data, 160 replicated]
               + 3 * 5 * 160 * 192  # routed experts [E/expert, H/data, Im/tensor]
               + 3 * 160 * 192)  # shared expert [H/data, Im/tensor]
    assert (attention, dense_ffn, moe_ffn) == (544_768, 737_280, 578_560)
    embed_and_head = 2 * 18944 * 160  # embed_tokens [V/tensor, H/data], lm_head [H/data, V/tensor]
    final_norm = 5120
    mtp_extra = 10240 * 160 + 3 * 5120  # eh_proj [2H replicated, H/data]; enorm, hnorm, shared_head_norm
    elements = (embed_and_head + final_norm + 3 * (attention + dense_ffn) + 89 * (attention + moe_ffn)
                + (attention + moe_ffn) + mtp_extra)
    assert elements == 112_666_624

    adam = (embed_and_head + 90 * 160 * 160  # embedding, lm_head, 89 + 1 routers
            + 93 * (2 * 5120 + 2 * 128) + final_norm + 3 * 5120  # every norm
            + 93 * (12 * 128 + 2 * 128))  # q/k/v biases
    r = plan_lib.plan(GLM45, MESH_8192, micro_batch=1, seq_len=4096, remat="full")
    assert r.devices == 8192
    assert r.params == r.grads == 4 * elements  # fp32
    assert r.adam_moments == 2 * 4 * adam
    assert r.muon_momentum == 4 * (elements - adam)
    assert r.buffers == 4 * 90 * 160  # e_score_correction_bias [89, 160] + [160], replicated
    assert r.static == 4 * elements * 2 + 4 * (elements - adam) + 8 * adam + 4 * 90 * 160
    # --offload=optimizer: the moments are host memory; the device streams the update in pieces (training/streamed.py),
    # one layer of a stack or every leaf outside the stacks, the largest here: embedding, head, final norm and the
    # MTP layer (Muon leaves one fp32 moment, AdamW two); one MoE layer's is 4.6 MB, this 59.9 MB.
    attention_muon = 160 * 12 * 128 + 2 * 160 * 128 + 12 * 128 * 160  # q, k, v, o
    attention_adam = 12 * 128 + 2 * 128 + 2 * 128 + 2 * 5120  # biases, q/k norm, layernorms
    experts = 3 * 5 * 160 * 192 + 3 * 160 * 192  # routed and shared (Muon); the router is AdamW
    outside = (8 * (embed_and_head + final_norm + attention_adam + 160 * 160 + 3 * 5120)
               + 4 * (attention_muon + experts + 10240 * 160))
    assert outside == 59_858_944
    off = plan_lib.plan(GLM45, MESH_8192, micro_batch=1, seq_len=4096, remat="full", offload="optimizer")
    assert off.host == 4 * (elements - adam) + 8 * adam and r.host == 0
    assert off.streamed_piece == outside
    assert off.static == 4 * elements * 2 + 4 * 90 * 160
    assert off.total == r.total - r.optimizer + off.streamed_piece
    # --offload=optimizer_and_params (bf16 compute): the fp32 masters join the host; the device keeps the projections
    # the model casts to bf16 (paths.COMPUTE_CAST) in bf16, everything else (embedding, router, norms, biases) in fp32, and
    # grads alike; each streamed piece brings its masters too.
    cast = (93 * (160 * 12 * 128 + 2 * 160 * 128 + 12 * 128 * 160)  # q/k/v/o of 3 dense + 89 MoE + 1 MTP layers
            + 3 * 3 * 160 * 1536 + 90 * (3 * 5 * 160 * 192 + 3 * 160 * 192)  # dense FFN; routed + shared experts
            + 10240 * 160 + 18944 * 160)  # eh_proj, lm_head
    both = plan_lib.plan(GLM45.replace(dtype="bfloat16"), MESH_8192, micro_batch=1, seq_len=4096, remat="full",
                         offload="optimizer_and_params")
    assert both.params == both.grads == 2 * cast + 4 * (elements - cast)
    assert both.host == 4 * elements + off.host and both.host_params == 4 * elements
    assert both.streamed_piece == outside + 4 * (embed_and_head + final_norm + attention + moe_ffn + mtp_extra)
    # Unsharded counts agree with counting.py (the correction bias is a buffer, not a param).
    assert r.muon_params + r.adam_params == param_counts(GLM45).model_total - 90 * 160
    assert r.counts.report_total == 351_245_936_544 + 3_988_069_792  # trunk + MTP: "355.23B"


def test_flops_per_token_matches_hand_arithmetic():
    # Matmul weights, no biases/norms (docs/architecture.md#parameter-counting):
    # q 62,914,560 + k 5,242,880 + v 5,242,880 + o 62,914,560.
    attn = 62_914_560 + 5_242_880 + 5_242_880 + 62_914_560
    dense = attn + 188_743_680  # 3 * 5120 * 12288
    moe_active = attn + 9 * 23_592_960 + 160 * 5120  # 8 routed + 1 shared expert, router
    mtp = moe_active + 2 * 5120 * 5120  # + eh_proj
    head = 775_946_240  # 151552 * 5120, for the main logits and again for the MTP logits
    n = 3 * dense + 89 * moe_active + mtp + 2 * head
    assert n == 34_031_861_760
    attention = 6 * (92 + 1) * 4096 * 96 * 128  # causal QK^T + PV, fwd + bwd, 92 layers + MTP
    assert flops_per_token(GLM45, 4096) == 6 * n + attention == 232_276_230_144
    r = plan_lib.plan(GLM45, MESH_8192, seq_len=4096)
    assert (r.flops_per_token, r.matmul_params_per_token) == (232_276_230_144, n)


def test_optimizer_group():
    _, params, _ = abstract_model(TINY, jax.sharding.AbstractMesh(
        (1, 1, 1, 1), ("data", "tensor", "expert", "pipeline"), axis_types=(jax.sharding.AxisType.Explicit,) * 4))
    groups = {jax.tree_util.keystr(p): plan_lib.optimizer_group(p, x.ndim)
              for p, x in jax.tree_util.tree_leaves_with_path(params)}
    adam = sorted(k for k, g in groups.items() if g == "adam")
    assert all(any(s in k for s in ("embed_tokens", "lm_head", "router", "norm", "_bias")) for k in adam)
    for name in ("['moe_layers']['mlp']['gate_proj']", "['dense_layers']['self_attn']['o_proj']",
                 "['mtp']['eh_proj']", "['moe_layers']['mlp']['shared_experts']['down_proj']"):
        assert groups[name + ".value"] == "muon", name
    assert plan_lib.optimizer_group("moe_layers/mlp/router") == "adam"
    assert plan_lib.optimizer_group("moe_layers/mlp/router", router="muon") == "muon"
    assert plan_lib.optimizer_group("moe_layers/input_layernorm/weight", 2) == "adam"
    assert plan_lib.optimizer_group("moe_layers/self_attn/q_proj", 4) == "muon"
    assert plan_lib.optimizer_group("some_stack/vector", 1) == "adam"


def test_does_not_fit_says_so_with_the_shortfall():
    r = plan_lib.plan(GLM45, MESH_256, micro_batch=1, seq_len=4096, remat="save_matmuls", device_memory=16 * GiB)
    assert r.fits is False
    short = (r.total - 16 * GiB) / GiB
    msg = r.verdict()
    assert msg.startswith(f"DOES NOT FIT: needs {r.total / GiB:.2f} GiB per device, the device has 16.00 GiB")
    assert f"short by {short:.2f} GiB" in msg
    assert "params + grads + optimizer state alone need" in msg  # ~28 GiB of state on 256 devices
    assert "--remat=full (now save_matmuls)" in msg
    assert "DOES NOT FIT" in r.report()
    ok = plan_lib.plan(GLM45, MESH_256, remat="full", device_memory=200 * GiB)
    assert ok.fits and ok.verdict().startswith("FITS: ")
    assert plan_lib.plan(GLM45, MESH_256).fits is None


def test_activation_estimate_orders_by_remat():
    cfg = GLM45.replace(dtype="bfloat16")
    est = {m: plan_lib.activation_estimate(cfg, MESH_256, 1, 4096, m) for m in ("none", "save_matmuls", "full")}
    assert est["none"].total > est["save_matmuls"].total > est["full"].total
    assert est["full"].saved_layers == 92 * 4096 * 5120 * 2  # the bf16 layer inputs only
    assert est["none"].recompute == 0 < est["full"].recompute
    double = plan_lib.activation_estimate(cfg, MESH_256, 2, 4096, "full")
    assert double.total == pytest.approx(2 * est["full"].total, rel=1e-6)


@pytest.mark.parametrize("mesh, devices, message", [
    ({"data": 4, "tensor": 8, "expert": 7}, None, "n_routed_experts=160 is not divisible by the expert"),
    ({"data": 4, "tensor": 3, "expert": 8}, None, "num_key_value_heads=8 is not divisible by the tensor"),
    ({"data": 3, "tensor": 8, "expert": 8}, None, "hidden_size=5120 is not divisible by the data"),
    ({"data": 4, "tensor": 8, "expert": 8}, 512, "multiplies to 256 devices but there are 512"),
    ({"data": -1, "tensor": 8, "expert": 8}, None, "needs the device count"),
    ({"data": -1, "tensor": 8, "expert": 8}, 100, "does not divide the 100 devices"),
    ({"data": 4, "tensor": 8, "model": 8}, None, "unknown"),
])
def test_invalid_mesh_errors(mesh, devices, message):
    with pytest.raises(ValueError, match=message):
        plan_lib.plan(GLM45, mesh, devices=devices)


def test_batch_errors():
    with pytest.raises(ValueError, match="global_batch=100 is not divisible"):
        plan_lib.plan(GLM45, MESH_256, global_batch=100)
    with pytest.raises(ValueError, match="global_batch=32 is not a multiple of micro-batch 2"):
        plan_lib.plan(GLM45, MESH_256, micro_batch=2, global_batch=32)
    assert plan_lib.plan(GLM45, {"data": -1, "tensor": 8, "expert": 8}, devices=512).mesh["data"] == 8


def test_parsers():
    assert plan_lib.parse_mesh("data=32,tensor=8,expert=32,pipeline=1") == MESH_8192
    assert plan_lib.parse_mesh("data=-1, expert=8") == {"data": -1, "expert": 8}
    for bad in ("data=4,tensor", "data=4,data=2", ""):
        with pytest.raises(InputError, match="--mesh="):
            plan_lib.parse_mesh(bad)


def test_an_unknown_config_override_names_its_section():
    # ml_collections raised a bare AttributeError("'nosuch'") here, a traceback from the CLI.
    with pytest.raises(InputError, match=r"^config.model has no field 'remt'; nearest: remat, preset; valid fields: "):
        plan_lib.main([f"--config={CONFIG}:tiny", "--mesh=data=1", "--config.model.remt=full"])


def test_device_memory_takes_every_size_form(capsys):
    """--device-memory=80e9 is 80 GB exactly as 80GB is (it was refused once: plan had a parser of its own)."""
    verdicts = set()
    for text in ("80e9", "80GB", "80 GB", "8e10"):
        r = plan_lib.main([f"--config={CONFIG}:tiny", "--mesh=data=1", f"--device-memory={text}"])
        assert r.device_memory == 80_000_000_000, text
        verdicts.add(r.verdict())
    (verdict,) = verdicts
    assert verdict.startswith("FITS: ") and " of 74.51 GiB per device" in verdict  # 80e9 / 2^30
    r = plan_lib.main([f"--config={CONFIG}:tiny", "--mesh=data=1", "--device-memory=80GiB"])
    assert r.device_memory == 80 * GiB
    capsys.readouterr()


def test_cli_exit_codes():
    """A user's mistake: exit 2 and one `error:` line naming the flag, no traceback. Not fitting: exit 1."""
    base = [sys.executable, "-m", "glm46_jax.plan", f"--config={CONFIG}:tiny"]
    cases = {  # flags -> (exit code, what stderr says)
        ("--mesh=data=4,tensor",): (2, "error: --mesh='data=4,tensor': 'tensor' is not axis=size"),
        ("--mesh=data=1", "--device-memory=80 potatoes"): (2, "error: --device-memory='80 potatoes': expected"),
        ("--mesh=data=1", "--device-memory=1MB"): (1, "DOES NOT FIT: needs"),
        ("--search", "--device-memory=1KB"): (1, "no mesh of up to 16384 devices fits"),
        ("--search",): (2, "error: --search needs --device-memory"),
        ("--phase=long",): (2, "error: --phase=long: the config's phases are general, code_long"),
        ("--mesh=data=1", "--offload=disk"): (2, "error: flag --offload=disk: value should be one of"),
    }
    procs = {flags: subprocess.Popen(base + list(flags), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True) for flags in cases}  # in parallel: each pays jax's import
    for flags, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        code, message = cases[flags]
        assert proc.returncode == code, (flags, err)
        if code == 2:
            assert err.startswith(message) and err.count("\n") == 1, (flags, err)
            assert out == ""
        else:
            assert err == "" and message in out, (flags, err)


def test_cli(capsys):
    r = plan_lib.main([f"--config={CONFIG}:glm45", "--mesh=data=4,tensor=8,expert=8,pipeline=1",
                       "--device-memory=80GiB", "--micro-batch=1", "--seq-len=4096", "--remat=full"])
    out = capsys.readouterr().out
    assert r.mesh == {**MESH_256, "context": 1} and r.remat == "full" and r.seq_len == 4096
    assert "355.23B total / 32.48B active" in out and "232.28 GFLOP" in out
    assert "global batch 4096 = 128 accumulation steps" in out
    assert ("FITS: " if r.fits else "DOES NOT FIT") in out

    r = plan_lib.main([f"--config={CONFIG}:glm45", "--mesh=data=-1,tensor=8,expert=32", "--devices=8192",
                       "--device-memory=8GiB", "--config.model.moe_capacity_factor=1.25"])
    out = capsys.readouterr().out
    assert r.mesh == {**MESH_8192, "context": 1} and r.fits is False and r.cfg.moe_capacity_factor == 1.25
    assert "DOES NOT FIT" in out and "short by" in out and "--offload=optimizer" in out
    r = plan_lib.main([f"--config={CONFIG}:glm45", "--mesh=data=-1,tensor=8,expert=32", "--devices=8192",
                       "--offload=optimizer"])
    out = capsys.readouterr().out
    assert r.offload == "optimizer" and f"host memory: {r.host / GiB:.2f} GiB per device" in out
    assert "optimizer: Muon momentum (fp32, host)" in out and "total (device; host state excluded)" in out
    with pytest.raises(ValueError, match="n_routed_experts"):
        plan_lib.main([f"--config={CONFIG}:glm45", "--mesh=data=4,tensor=8,expert=6"])


# --- the layout search ---------------------------------------------------------------------------------------

def test_layouts_are_every_power_of_two_mesh():
    """8 devices as 2^3: tensor, expert, context and data take exponents summing to 3 (C(6, 3) = 20 ways); with
    pipeline <= 2 also the 10 meshes of 4 devices beside pipeline 2."""
    from glm46_jax.plan_search import layouts

    for max_pipeline, count in ((1, 20), (2, 30)):
        meshes = list(layouts(8, max_pipeline=max_pipeline))
        assert len(meshes) == count == len({tuple(m.values()) for m in meshes})
        assert all(math.prod(m.values()) == 8 and m["pipeline"] <= max_pipeline for m in meshes)
    assert all(m["tensor"] <= 2 for m in layouts(64, max_tensor=2))


@pytest.mark.parametrize("memory, devices, mesh", [
    ("80GB", 2048, {"data": 32, "tensor": 8, "expert": 1, "pipeline": 1, "context": 8}),  # H100
    ("141GB", 512, {"data": 8, "tensor": 8, "expert": 1, "pipeline": 1, "context": 8}),  # H200
], ids=["h100", "h200"])
def test_glm46_200k_fewest_devices(memory, devices, mesh, capsys):
    """GLM-4.6's 200K phase (micro-batch 1, 320 rows of 202,752 tokens): the search's layout (recorded in
    docs/long_context.md#the-200k-phase), and, enumerated here independently, no mesh of half as many devices
    (each axis any power of two, tensor <= 8, no pipeline) that fits in 90% of the memory."""
    r = plan_lib.main([f"--config={CONFIG}:glm46", "--phase=long_context_200k", f"--device-memory={memory}",
                       "--search"])
    out = capsys.readouterr().out
    assert (r.devices, r.mesh, r.seq_len, r.global_batch, r.micro_batch) == (devices, mesh, 202752, 320, 1), out
    budget = 0.9 * r.device_memory
    assert r.total <= budget and f"fewest devices: {devices}" in out
    fitting_at_half = []
    exponents = range((devices // 2).bit_length())
    for t, e, c in itertools.product(range(4), exponents, exponents):
        d = devices // 2 // (2 ** (t + e + c))
        if d * 2 ** (t + e + c) != devices // 2 or d < 1:
            continue
        try:
            p = plan_lib.plan(r.cfg, {"data": d, "tensor": 2 ** t, "expert": 2 ** e, "context": 2 ** c},
                              seq_len=202752, global_batch=320)
        except InputError:
            continue
        fitting_at_half += [p.mesh] if p.total <= budget else []
    assert fitting_at_half == []


def test_glm45_air_full_fine_tuning_fits_one_8_h100_node_only_with_offload(capsys):
    """GLM-4.5-Air full fine-tuning at 4K (micro-batch 1, remat full): with the optimizer state and fp32 masters in
    host memory, the update streamed a layer at a time (training/streamed.py), the search's layout is one node of 8
    H100s (recorded in docs/performance.md); with everything on the device, no layout of 8 devices fits (each one
    enumerated here), nor with the optimizer state alone."""
    from glm46_jax.plan_search import layouts

    args = [f"--config={CONFIG}:glm45_air", "--seq-len=4096", "--remat=full", "--device-memory=80GB"]
    r = plan_lib.main([*args, "--offload=optimizer_and_params", "--search"])
    out = capsys.readouterr().out
    assert r.devices == 8 and r.total <= 0.9 * r.device_memory and "fewest devices: 8" in out, out
    assert r.host > 90 * GiB  # the masters and the state: ~820 GiB of the node's RAM
    for offload in ("none", "optimizer", "optimizer_and_params"):
        totals = {}
        for m in layouts(8, max_pipeline=2):
            try:
                totals[tuple(m.values())] = plan_lib.plan(r.cfg, m, seq_len=4096, remat="full", offload=offload).total
            except (InputError, ValueError):  # a mesh the model's shapes do not divide
                continue
        assert len(totals) >= 20
        fitting = [m for m, total in totals.items() if total <= 0.9 * r.device_memory]
        assert (fitting != []) == (offload == "optimizer_and_params"), (offload, fitting)

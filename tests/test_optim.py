"""The optimizer: Muon vs a NumPy reference, the muon/adam split, weight decay, schedules, sharding."""

import dataclasses

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from glm46_jax.parallel import sharding
from glm46_jax.errors import InputError
from glm46_jax.training.muon import NS_COEFFS, newton_schulz
from glm46_jax.training.optim import OptimConfig, build_optimizer, make_schedule, param_labels

B1 = 0.95  # Muon momentum


# --- an independent NumPy Muon ----------------------------------------------------------------

def ns5_np(g: np.ndarray) -> np.ndarray:
    """Newton-Schulz 5 on one matrix, float64: X/(|X|_F+1e-8), transpose if rows > cols."""
    a, b, c = NS_COEFFS
    x = np.asarray(g, np.float64)
    tr = x.shape[0] > x.shape[1]
    if tr:
        x = x.T
    x = x / (np.linalg.norm(x) + 1e-8)
    for _ in range(5):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tr else x


def muon_np(grads: list[np.ndarray], p: np.ndarray, lr: float, wd: float, rms: float = 0.2) -> list[np.ndarray]:
    """Updates of consecutive Muon steps (optax form: bias-corrected EMA Nesterov) on one matrix."""
    mu = np.zeros_like(grads[0], np.float64)
    out = []
    for t, g in enumerate(grads, start=1):
        g = np.asarray(g, np.float64)
        mu = B1 * mu + (1 - B1) * g
        mu_hat = B1 * mu / (1 - B1 ** (t + 1)) + (1 - B1) * g / (1 - B1 ** t)
        o = ns5_np(mu_hat)
        out.append(-lr * (rms * np.sqrt(max(o.shape)) * o + wd * p))
    return out


def _rand(key, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _cfg(**kw):
    base = dict(lr=1.0, end_lr=1.0, warmup_steps=0, decay_steps=10, schedule="constant", clip=1e9,
                weight_decay=0.1, adam_weight_decay=0.1)
    return OptimConfig(**{**base, **kw})


# --- Muon numerics ----------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(48, 32), (32, 48)])
def test_muon_matrix_matches_numpy(shape):
    params = {"mlp": {"down_proj": _rand(0, shape)}}
    tx, _ = build_optimizer(_cfg(), params)
    state = tx.init(params)
    grads = [_rand(1, shape), _rand(2, shape)]
    want = muon_np(grads, np.asarray(params["mlp"]["down_proj"]), lr=1.0, wd=0.1)
    for g, w in zip(grads, want):  # step 1 from zero momentum, then step 2 (momentum used)
        upd, state = tx.update({"mlp": {"down_proj": g}}, state, params)
        np.testing.assert_allclose(np.asarray(upd["mlp"]["down_proj"]), w, atol=1e-5, rtol=0)
    # the update RMS really is ~0.2 (NS5 leaves singular values in roughly [0.7, 1.2])
    rms = np.sqrt(np.mean((want[0] + 0.1 * np.asarray(params["mlp"]["down_proj"])) ** 2))
    assert 0.12 < rms < 0.25


def test_muon_per_expert_and_per_head():
    L, E, D, F, H, Dh = 2, 3, 16, 8, 4, 8
    params = {"moe_layers": {"mlp": {"gate_proj": _rand(0, (L, E, D, F))},
                             "self_attn": {"q_proj": _rand(1, (L, D, H, Dh)), "o_proj": _rand(2, (L, H, Dh, D))}},
              "mtp": {"block": {"mlp": {"up_proj": _rand(3, (E, D, F))}}}}
    tx, _ = build_optimizer(_cfg(weight_decay=0.0), params)
    grads = jax.tree.map(lambda x: jnp.cos(7 * x), params)
    upd, _ = tx.update(grads, tx.init(params), params)
    g1 = lambda g: muon_np([g], np.zeros_like(g), lr=1.0, wd=0.0)[0]
    gx = jax.tree.map(np.asarray, grads)
    ux = jax.tree.map(np.asarray, upd)
    for l in range(L):
        for e in range(E):  # experts [L, E, in, out]: one matrix per (layer, expert)
            np.testing.assert_allclose(ux["moe_layers"]["mlp"]["gate_proj"][l, e],
                                       g1(gx["moe_layers"]["mlp"]["gate_proj"][l, e]), atol=1e-5)
        for h in range(H):  # q_proj [L, D, H, Dh] per head: [D, Dh]; o_proj [L, H, Dh, D]: [Dh, D]
            np.testing.assert_allclose(ux["moe_layers"]["self_attn"]["q_proj"][l, :, h],
                                       g1(gx["moe_layers"]["self_attn"]["q_proj"][l, :, h]), atol=1e-5)
            np.testing.assert_allclose(ux["moe_layers"]["self_attn"]["o_proj"][l, h],
                                       g1(gx["moe_layers"]["self_attn"]["o_proj"][l, h]), atol=1e-5)
    for e in range(E):  # unstacked MTP experts [E, in, out]
        np.testing.assert_allclose(ux["mtp"]["block"]["mlp"]["up_proj"][e],
                                   g1(gx["mtp"]["block"]["mlp"]["up_proj"][e]), atol=1e-5)
    # and not the fused whole: the per-expert result differs from orthogonalising [E*in, out]
    fused = g1(gx["mtp"]["block"]["mlp"]["up_proj"].reshape(E * D, F)).reshape(E, D, F)
    assert np.abs(fused - ux["mtp"]["block"]["mlp"]["up_proj"]).max() > 1e-2


def _dots(jaxpr) -> int:
    """dot_general equations in a jaxpr and every jaxpr nested in its equations (cond branches, pjit, ...)."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "dot_general"
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                    n += _dots(getattr(sub, "jaxpr", sub))
    return n


def test_one_newton_schulz_per_matrix_shape_without_sharding():
    """Unsharded, the leaves whose matrices share a shape share one Newton-Schulz call (5 steps x 3 products): here
    two calls, (16, 8) for the experts, q_proj per head and the MTP experts, and (8, 16) for o_proj per head, not
    one per leaf (4). test_muon_per_expert_and_per_head checks those batched results against float64 NumPy."""
    L, E, D, F, H, Dh = 2, 3, 16, 8, 4, 8
    params = {"moe_layers": {"mlp": {"gate_proj": _rand(0, (L, E, D, F))},
                             "self_attn": {"q_proj": _rand(1, (L, D, H, Dh)), "o_proj": _rand(2, (L, H, Dh, D))}},
              "mtp": {"block": {"mlp": {"up_proj": _rand(3, (E, D, F))}}}}
    tx, _ = build_optimizer(_cfg(muon_ns_dtype="float32"), params)
    grads = jax.tree.map(lambda x: jnp.cos(7 * x), params)
    jaxpr = jax.make_jaxpr(lambda g, s: tx.update(g, s, params))(grads, tx.init(params))
    assert _dots(jaxpr.jaxpr) == 2 * 5 * 3


# --- Newton-Schulz in bf16 (muon_ns_dtype) ----------------------------------------------------
# bf16 keeps 8 significant bits and the quintic's slope 3.4 at 0 amplifies what rounding leaves in small singular
# directions: bf16 inputs with fp32 accumulation land 1.4e-2 to 2.7e-2 (relative Frobenius, per matrix, 18 random
# matrices from 48 x 32 to 512 x 128) from the float64 iteration (fp32: ~1.5e-6; rounding every product to bf16, as
# optax does given bf16 input, 4.3e-2 to 6.9e-2). BF16_REL bounds it; above BF16_FLOOR proves the bf16 path ran.
BF16_REL, BF16_FLOOR = 5e-2, 1e-3


def _rel(got, want, axes=(-2, -1)):
    return np.linalg.norm(got - want, axis=axes) / np.linalg.norm(want, axis=axes)


@pytest.mark.parametrize("shape", [(48, 32), (32, 48), (3, 40, 24), (2, 2, 24, 40)])
def test_newton_schulz_bf16_vs_float64_numpy(shape):
    """Tall, wide, and batches of them (every leading axis is a batch axis): each matrix as float64 NumPy's."""
    x = _rand(0, shape)
    mats = np.asarray(x, np.float64).reshape(-1, *shape[-2:])
    want = np.stack([ns5_np(m) for m in mats]).reshape(shape)
    fp32 = np.asarray(newton_schulz(x, jnp.float32))
    bf16 = np.asarray(newton_schulz(x, jnp.bfloat16))
    assert bf16.dtype == np.float32  # fp32 out: the last iterate is never rounded
    assert _rel(fp32, want).max() < 1e-5
    rel = _rel(bf16, want)
    assert BF16_FLOOR < rel.min() and rel.max() < BF16_REL, rel
    # still the same orthogonalisation: singular values where float64 NS5 puts them
    sv = lambda m: np.linalg.svd(m, compute_uv=False)  # noqa: E731
    np.testing.assert_allclose(sv(bf16), sv(want), atol=BF16_REL)


def test_muon_update_bf16_vs_fp32():
    """Two full optimizer steps on a GLM-like tree (experts, per-head q/o, tall and wide, stacked layers): the Muon
    leaves' updates differ from the fp32 run by bf16 rounding only, everything else (momentum, AdamW leaves, the
    decay term) is bit-identical: the dtype touches nothing but Newton-Schulz."""
    params = _glm_like()
    grads = [jax.tree.map(lambda x, k=k: jnp.cos(7 * x + k), params) for k in range(2)]
    runs = {}
    for dtype in ("float32", "bfloat16"):
        tx, _ = build_optimizer(_cfg(muon_ns_dtype=dtype), params)
        state, upds = tx.init(params), []
        for g in grads:
            u, state = jax.jit(tx.update)(g, state, params)
            upds.append(_flat(u))
        runs[dtype] = upds, _flat(state)
    (u32, s32), (u16, s16) = runs["float32"], runs["bfloat16"]
    chex.assert_trees_all_equal(s32, s16)
    for step in range(2):
        for path, a in u32[step].items():
            b = u16[step][path]
            if any(name in path for name in ADAM):
                np.testing.assert_array_equal(b, a, err_msg=path)
                continue
            p = np.asarray(_flat(params)[path])
            o32, o16 = (np.asarray(u) + 0.1 * p for u in (a, b))  # lr 1: u = -(0.2 sqrt(max) O + 0.1 p)
            rel = np.linalg.norm(o16 - o32) / np.linalg.norm(o32)
            assert BF16_FLOOR < rel < BF16_REL, (step, path, rel)


def test_auto_ns_dtype_follows_the_compile_platform():
    """"auto" is decided where the program is compiled: fp32 matmuls for a CPU, bf16 inputs with fp32 results for
    a GPU (lowered here on the CPU host for CUDA) or TPU."""
    import re

    params = {"mlp": {"down_proj": _rand(0, (48, 32))}, "embed_tokens": _rand(1, (8, 4))}
    tx, _ = build_optimizer(_cfg(), params, sharded=False)
    traced = jax.jit(tx.update).trace(params, tx.init(params), params)
    for platform, operand in (("cpu", "f32"), ("cuda", "bf16"), ("tpu", "bf16")):
        dots = re.findall(r"stablehlo\.dot_general.*: \((tensor<[^)]*)\) -> tensor<([^>]*)>",
                          traced.lower(lowering_platforms=(platform,)).as_text())
        assert len(dots) == 15, (platform, len(dots))  # 5 iterations x 3 matmuls, one matrix
        for ins, out in dots:
            assert ins.count(f"x{operand}>") == 2 and out.endswith("xf32"), (platform, ins, out)


def test_bf16_newton_schulz_under_explicit_sharding():
    """Matrix axes sharded over tensor, experts over expert (Explicit mesh): the bf16 update runs (sharded_update)
    and equals the single-device bf16 update up to the order of fp32 accumulation."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = sharding.make_mesh({"data": 2, "tensor": 2, "expert": 2})
    params = {"moe_layers": {"mlp": {"gate_proj": _rand(0, (2, 4, 32, 16))},
                             "self_attn": {"q_proj": _rand(1, (2, 32, 4, 8))}}}
    specs = {"moe_layers": {"mlp": {"gate_proj": P(None, "expert", "tensor", None)},
                            "self_attn": {"q_proj": P(None, "tensor", None, None)}}}
    grads = jax.tree.map(lambda x: jnp.sin(3 * x), params)
    tx, _ = build_optimizer(_cfg(muon_ns_dtype="bfloat16"), params)
    want, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    with sharding.use_mesh(mesh):
        put = lambda t: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), t, specs)  # noqa: E731
        sp, sg = put(params), put(grads)
        got, _ = jax.jit(tx.update)(sg, jax.jit(tx.init)(sp), sp)
    for path, x in _flat(got).items():
        assert x.sharding.spec == _flat(sp)[path].sharding.spec, path
        assert _rel(np.asarray(x), np.asarray(_flat(want)[path]), axes=None) < 1e-2, path


# --- the split and weight decay ---------------------------------------------------------------

V, D, L, E = 32, 16, 2, 4


def _glm_like():
    k = iter(range(100))
    return {
        "embed_tokens": _rand(next(k), (V, D)),
        "lm_head": _rand(next(k), (D, V)),
        "norm": {"weight": 1 + _rand(next(k), (D,), 0.1)},
        "moe_layers": {
            "input_layernorm": {"weight": 1 + _rand(next(k), (L, D), 0.1)},
            "mlp": {"router": _rand(next(k), (L, D, E)), "gate_proj": _rand(next(k), (L, E, D, 8)),
                    "shared_experts": {"down_proj": _rand(next(k), (L, 8, D))}},
            "self_attn": {"q_proj": _rand(next(k), (L, D, 2, 8)), "q_bias": _rand(next(k), (L, 2, 8)),
                          "q_norm": {"weight": _rand(next(k), (L, 8))}, "o_proj": _rand(next(k), (L, 2, 8, D))}},
        "mtp": {"eh_proj": _rand(next(k), (2 * D, D)), "enorm": {"weight": _rand(next(k), (D,))}},
    }


ADAM = ["embed_tokens", "lm_head", "norm", "input_layernorm", "router", "q_bias", "q_norm", "enorm"]


def _flat(tree):
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_labels():
    params = _glm_like()
    labels = _flat(param_labels(params, _cfg()))
    for path, label in labels.items():
        assert label == ("adam" if any(f"'{n}'" in path for n in ADAM) else "muon"), path
    assert sum(v == "muon" for v in labels.values()) == 5  # gate, shared down, q, o, eh_proj
    switched = _flat(param_labels(params, _cfg(router_optimizer="muon", head_optimizer="muon")))
    assert switched["['moe_layers']['mlp']['router']"] == "muon" and switched["['lm_head']"] == "muon"
    assert switched["['embed_tokens']"] == "adam"
    with pytest.raises(ValueError):
        build_optimizer(_cfg(head_optimizer="sgd"), params)


def test_adam_leaves_equal_optax_adamw():
    params = _glm_like()
    cfg = _cfg(lr=0.3)
    tx, sched = build_optimizer(cfg, params)
    decayed = lambda t: jax.tree_util.tree_map_with_path(
        lambda p, _: any(n in jax.tree_util.keystr(p) for n in ("embed_tokens", "lm_head")), t)
    ref = optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.adam_weight_decay, mask=decayed)
    s, rs = tx.init(params), ref.init(params)
    for i in range(2):
        grads = jax.tree.map(lambda x: jnp.sin(x * (i + 3.0)), params)
        upd, s = tx.update(grads, s, params)
        rupd, rs = ref.update(grads, rs, params)
        labels = _flat(param_labels(params, cfg))
        adam = {path for path, label in labels.items() if label == "adam"}
        chex.assert_trees_all_close({p: x for p, x in _flat(upd).items() if p in adam},
                                    {p: x for p, x in _flat(rupd).items() if p in adam}, atol=1e-6, rtol=1e-7)
        for path, u in _flat(upd).items():
            if labels[path] == "muon":  # Muon updates are not AdamW's
                assert np.abs(np.asarray(u) - np.asarray(_flat(rupd)[path])).max() > 1e-3, path


def test_adamw_algorithm_equals_float64_numpy_adamw():
    """algorithm="adamw" (LoRA adapters, full fine-tuning): AdamW on every leaf, decay on matrices only."""
    params = {"a": _rand(1, (4, 3)), "bias": _rand(2, (3,)), "b": _rand(3, (2, 3, 5))}
    cfg = _cfg(lr=0.01, algorithm="adamw", weight_decay=0.2)
    tx, _ = build_optimizer(cfg, params, sharded=False)
    state = tx.init(params)
    ref = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in ref.items()}
    v2 = {k: np.zeros_like(v) for k, v in ref.items()}
    p = params
    for t in (1, 2, 3):
        grads = {k: jnp.cos(x * t) for k, x in p.items()}
        upd, state = tx.update(grads, state, p)
        p = optax.apply_updates(p, upd)
        for k in ref:
            g = np.asarray(grads[k], np.float64)
            m[k] = cfg.b1 * m[k] + (1 - cfg.b1) * g
            v2[k] = cfg.b2 * v2[k] + (1 - cfg.b2) * g * g
            step = (m[k] / (1 - cfg.b1 ** t)) / (np.sqrt(v2[k] / (1 - cfg.b2 ** t)) + cfg.eps)
            decay = cfg.weight_decay * ref[k] if ref[k].ndim >= 2 else 0.0
            ref[k] = ref[k] - cfg.lr * (step + decay)
    chex.assert_trees_all_close({k: np.asarray(x, np.float64) for k, x in p.items()}, ref, rtol=1e-5, atol=1e-6)


def test_weight_decay_only_where_intended():
    params = _glm_like()
    tx, _ = build_optimizer(_cfg(lr=0.5, weight_decay=0.1, adam_weight_decay=0.01), params)
    upd, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    labels = _flat(param_labels(params, _cfg()))

    def want(path, p):
        if labels[path] == "muon":
            return -0.5 * 0.1 * p
        if "embed_tokens" in path or "lm_head" in path:
            return -0.5 * 0.01 * p
        return np.zeros_like(p)  # norms, biases, router: no decay

    chex.assert_trees_all_close(_flat(upd), {path: want(path, np.asarray(p)) for path, p in _flat(params).items()},
                                atol=1e-7, rtol=1e-7)


def test_layer_decay_scales_updates_by_depth():
    """_glm_like has no dense stack and L=2 MoE layers: depths embed 0, moe 1..2, rest 3 (top)."""
    params = _glm_like()
    grads = jax.tree.map(lambda x: jnp.cos(3 * x), params)
    run = lambda cfg: build_optimizer(cfg, params)[0].update(grads, build_optimizer(cfg, params)[0].init(params),
                                                             params)[0]
    plain, decayed = _flat(run(_cfg(lr=0.1))), _flat(run(_cfg(lr=0.1, layer_decay=0.5)))
    for path, u in plain.items():
        u, d = np.asarray(u), np.asarray(decayed[path])
        if "embed_tokens" in path:
            np.testing.assert_allclose(d, u * 0.5 ** 3, rtol=1e-5, err_msg=path)
        elif "moe_layers" in path:  # layer 0 at depth 1, layer 1 at depth 2
            np.testing.assert_allclose(d[0], u[0] * 0.25, rtol=1e-5, atol=1e-9, err_msg=path)
            np.testing.assert_allclose(d[1], u[1] * 0.5, rtol=1e-5, atol=1e-9, err_msg=path)
        else:  # final norm, head, MTP: the full lr
            np.testing.assert_allclose(d, u, rtol=1e-6, err_msg=path)
    with pytest.raises(ValueError, match="layer_decay"):
        build_optimizer(_cfg(layer_decay=1.5), params)


def test_clip_applies_to_the_global_norm():
    """Hand value: Adam with b1 = b2 = 0 gives g / (|g| + eps); with eps = 1 the step size depends on |g|,
    so it shows whether g was clipped first. 16 entries of 10: global norm 40 -> each 10 / 40 = 0.25."""
    params = {"embed_tokens": jnp.ones((4, 4))}
    big = {"embed_tokens": jnp.full((4, 4), 10.0)}
    for clip, g in ((1.0, 0.25), (1e9, 10.0)):
        tx, _ = build_optimizer(_cfg(clip=clip, adam_weight_decay=0.0, b1=0.0, b2=0.0, eps=1.0), params)
        upd, _ = tx.update(big, tx.init(params), params)
        np.testing.assert_allclose(np.asarray(upd["embed_tokens"]), -g / (g + 1.0), rtol=1e-6)


# --- schedules --------------------------------------------------------------------------------

@pytest.mark.parametrize("name,kw,points", [
    ("warmup_cosine", {}, {0: 0.0, 5: 0.5, 10: 1.0, 60: 0.55, 110: 0.1, 500: 0.1}),
    ("wsd", {"wsd_decay_steps": 20}, {0: 0.0, 5: 0.5, 10: 1.0, 50: 1.0, 90: 1.0, 100: 0.55, 110: 0.1, 500: 0.1}),
    ("wsd", {}, {10: 1.0, 99: 1.0, 104: 1 - 0.9 * 5 / 11, 110: 0.1}),  # default decay: last 10% (11 steps)
    ("cosine_restarts", {"restarts": 2, "decay_steps": 120},
     {0: 0.0, 5: 0.5, 10: 1.0, 35: 0.55, 60: 0.1, 65: 0.55, 70: 1.0, 95: 0.55, 120: 0.1, 500: 0.1}),
    ("constant", {}, {0: 0.0, 5: 0.5, 10: 1.0, 10_000: 1.0}),
])
def test_schedules(name, kw, points):
    cfg = OptimConfig(lr=1.0, end_lr=0.1, warmup_steps=10, decay_steps=110, schedule=name)
    sched = make_schedule(OptimConfig(**{**cfg.__dict__, **kw}))
    for step, want in points.items():
        assert float(sched(step)) == pytest.approx(want, abs=1e-5), (name, step)


def _optax_schedule(cfg: OptimConfig):
    """The schedule as optax builds it (what make_schedule returned before its numbers became step inputs)."""
    w, total = cfg.warmup_steps, cfg.decay_steps
    warm = optax.linear_schedule(0.0, cfg.lr, w)
    if cfg.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, w, max(total, w + 1), cfg.end_lr)
    if cfg.schedule == "wsd":
        d = cfg.wsd_decay_steps or max(1, total // 10)
        return optax.join_schedules([warm, optax.constant_schedule(cfg.lr),
                                     optax.linear_schedule(cfg.lr, cfg.end_lr, d)], [w, total - d])
    if cfg.schedule == "cosine_restarts":
        cycle = total // cfg.restarts
        return optax.sgdr_schedule([dict(init_value=0.0 if i == 0 else cfg.end_lr, peak_value=cfg.lr, warmup_steps=w,
                                         decay_steps=cycle, end_value=cfg.end_lr) for i in range(cfg.restarts)])
    return optax.join_schedules([warm, optax.constant_schedule(cfg.lr)], [w])


@pytest.mark.parametrize("name,kw", [
    ("warmup_cosine", dict(lr=3e-3, end_lr=3e-4, warmup_steps=7, decay_steps=97)),
    ("warmup_cosine", dict(lr=2.5e-4, end_lr=2.5e-5, warmup_steps=0, decay_steps=0)),  # decay_steps 0: warmup + 1
    ("warmup_cosine", dict(lr=0.0, end_lr=0.0, warmup_steps=3, decay_steps=40)),
    ("wsd", dict(lr=1e-2, end_lr=1e-3, warmup_steps=5, decay_steps=90, wsd_decay_steps=17)),
    ("cosine_restarts", dict(lr=1e-2, end_lr=1e-3, warmup_steps=4, decay_steps=101, restarts=3)),
    ("constant", dict(lr=7e-3, warmup_steps=9)),
])
def test_schedule_numbers_as_step_inputs_equal_optax(name, kw):
    """The schedule's numbers are inputs of the train step (one program for every lr, warmup and length). With them
    as constants the values are optax's schedule's to the last bit; as inputs, within a few float32 ulps (XLA divides
    by a constant divisor differently from a runtime one, and 1 + cos near pi magnifies it: optax's own values differ
    as much between jit and eager)."""
    cfg = OptimConfig(schedule=name, **kw)
    sched, reference = make_schedule(cfg), _optax_schedule(cfg)
    counts = jnp.arange(0, 2 * max(cfg.decay_steps, cfg.warmup_steps + 1) + 3, dtype=jnp.int32)
    want = np.asarray(jax.jit(jax.vmap(reference))(counts))
    baked = np.asarray(jax.jit(jax.vmap(sched))(counts))
    as_inputs = np.asarray(jax.jit(jax.vmap(sched.at, in_axes=(0, None)))(counts, sched.inputs()))
    np.testing.assert_array_equal(baked, want)
    np.testing.assert_allclose(as_inputs, want, rtol=1e-6, atol=0)


def test_runs_that_differ_only_in_schedule_numbers_share_one_step_program():
    """Two optimizers whose lr, end_lr, warmup and length differ: the same compiled update (the numbers arrive as
    inputs), each with its own schedule's result."""
    params = {"w": jnp.ones((4, 4), jnp.float32), "embed_tokens": jnp.ones((8, 4), jnp.float32)}
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5), params)
    made = []
    for kw in (dict(lr=1e-2, end_lr=1e-3, warmup_steps=2, decay_steps=20),
               dict(lr=3e-3, end_lr=0.0, warmup_steps=0, decay_steps=7)):
        tx, sched = build_optimizer(OptimConfig(**kw), params)
        step = jax.jit(lambda g, s, p, x, tx=tx: tx.update(g, s, p, lr_inputs=x))
        lowered = step.lower(grads, tx.init(params), params, sched.inputs())
        made.append((lowered.as_text(debug_info=False), tx, sched))
    assert made[0][0] == made[1][0]  # one program
    updates = []
    for _, tx, sched in made:  # ... and each run's own lr: its update after one step equals the constants' one
        state = tx.update(grads, tx.init(params), params, lr_inputs=sched.inputs())[1]
        upd, _ = tx.update(grads, state, params, lr_inputs=sched.inputs())
        ref, _ = tx.update(grads, state, params)  # the numbers as constants
        for key in params:
            np.testing.assert_array_equal(np.asarray(upd[key]), np.asarray(ref[key]))
        updates.append(np.asarray(upd["w"]))
    assert not np.allclose(updates[0], updates[1])


BAD_OPTIM_VALUES = [
    # lr 0 is valid: it freezes the weights (a run started from another's weights is tested that way).
    ("lr", -1.0), ("lr", float("nan")), ("end_lr", -2.5e-5), ("warmup_steps", -1),
    ("decay_steps", -1), ("weight_decay", -0.1), ("clip", 0.0), ("clip", -1.0), ("b1", 1.0), ("b1", -0.1),
    ("b2", 1.0), ("eps", 0.0), ("schedule", "linear"), ("wsd_decay_steps", -1), ("restarts", 0),
    ("muon_momentum", 1.0), ("muon_ns_steps", 0), ("muon_rms", 0.0), ("adam_weight_decay", -0.1),
    ("router_optimizer", "sgd"), ("head_optimizer", "lion"), ("layer_decay", 0.0), ("layer_decay", 1.5),
    ("algorithm", "sgd"), ("muon_ns_dtype", "float16"), ("offload", "disk"),
]


@pytest.mark.parametrize("field, value", BAD_OPTIM_VALUES)
def test_bad_optim_value_names_the_field(field, value):
    """A negative lr used to train (descending the wrong way) without a word; every field is checked."""
    with pytest.raises(InputError) as err:
        OptimConfig(**{field: value})
    msg = str(err.value)
    assert msg.startswith(f"optim.{field}={value!r}: "), msg
    assert f"; set --config.optim.{field} " in msg, msg


def test_every_optim_field_has_a_bad_value_case():
    assert {f.name for f in dataclasses.fields(OptimConfig)} == {f for f, _ in BAD_OPTIM_VALUES}


def test_schedule_errors():
    with pytest.raises(ValueError):
        make_schedule(OptimConfig(schedule="linear"))
    with pytest.raises(ValueError):
        make_schedule(OptimConfig(schedule="cosine_restarts", restarts=100, warmup_steps=2000, decay_steps=100_000))


# --- sharded ----------------------------------------------------------------------------------

def test_sharded_update_matches_single_device():
    from glm46_jax.config import get_preset
    from glm46_jax.model import init_model

    cfg = get_preset("tiny")
    mesh = sharding.make_mesh({"data": 2, "tensor": 2, "expert": 2}, cfg=cfg, global_batch=8)
    _, params, _ = init_model(cfg, mesh, 0)
    ocfg = _cfg(lr=0.01)
    host_params = jax.tree.map(np.asarray, params)
    grad_fn = lambda p: jax.tree.map(lambda x: jnp.sin(1000.0 * x) + 0.1 * x, p)

    with sharding.use_mesh(mesh):
        tx, _ = build_optimizer(ocfg, params)
        state0 = jax.jit(tx.init)(params)
        spec0 = jax.tree.map(lambda x: jax.typeof(x).sharding.spec, state0)
        upd, state1 = jax.jit(lambda p, s: tx.update(grad_fn(p), s, p))(params, state0)
        # the Muon momentum of every matrix keeps its parameter's layout
        for path, x in _flat(params).items():
            assert _flat(upd)[path].sharding.spec == x.sharding.spec, path
        assert jax.tree.map(lambda x: jax.typeof(x).sharding.spec, state1) == spec0
        # without the auto_axes wrapper, Explicit-mode Newton-Schulz fails on a sharded matrix axis
        raw, _ = build_optimizer(ocfg, params, sharded=False)
        with pytest.raises(Exception, match="DuplicateSpec|tensor.*tensor|sharded"):
            jax.jit(lambda p, s: raw.update(grad_fn(p), s, p)).trace(params, state0)

    ref, _ = build_optimizer(ocfg, sharded=False)  # single device, no mesh
    p1 = jax.device_put(host_params, jax.devices()[0])
    rupd, rstate = jax.jit(lambda p, s: ref.update(grad_fn(p), s, p))(p1, ref.init(p1))
    chex.assert_trees_all_close(_flat(upd), _flat(rupd), atol=1e-5, rtol=0)
    chex.assert_trees_all_close(_flat(state1), _flat(rstate), atol=1e-6, rtol=1e-7)

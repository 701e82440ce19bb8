"""The optimizer: clip -> {Muon for hidden matrices, AdamW for the rest} under an LR schedule.

    tx, schedule = build_optimizer(OptimConfig(...), params)     # GLM-4.5 recipe (Muon)

train_step stays optimizer-agnostic: it only sees an `optax.GradientTransformation`.

Muon's update (momentum, Newton-Schulz, RMS scaling, which axes are the matrix) is training/muon.py's;
this module adds decoupled weight decay 0.1, multiplied by the lr (W <- W - lr*(0.2*sqrt(max)*O + wd*W)).
Which leaves are Muon is `optimizer_group` (embedding, norms, biases -> AdamW; router and
lm_head AdamW unless `router_optimizer` / `head_optimizer` = "muon").

Sharding: Newton-Schulz's X @ X.T fails in Explicit mode when a matrix axis is sharded
(DuplicateSpecError, docs/sharding.md#muon-and-explicit-sharding). `build_optimizer` therefore returns
`sharded_update(tx)`, whose update runs under `jax.sharding.auto_axes` with its outputs pinned to the
shardings of the incoming grads and opt state; `tx.update` can be called in Explicit mode (inside jit) as usual.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from glm46_jax.errors import check_choice, check_field, check_range
from glm46_jax.model.paths import LAYER_STACKS, path_names
from glm46_jax.model.pipeline import Layout, mesh_stages
from glm46_jax.training.muon import NS_DTYPES, scale_by_consistent_rms, scale_by_muon
from glm46_jax.training.offload import OFFLOAD
from glm46_jax.training.schedule import SCHEDULES, Schedule, scale_by_schedule
from glm46_jax.training.streamed import LayerStreamed

# --- the optimizer split (the plan tool counts optimizer state with it too) -----------------------

def optimizer_group(path: str | Sequence[Any], ndim: int | None = None, *, router: str = "adam") -> str:
    """"muon" or "adam" for the parameter at `path` (a jax key path or "moe_layers/mlp/router").

    Muon orthogonalises weight *matrices* whose two sides are hidden features. The embedding
    (a lookup table), the lm_head (its rows are per-token outputs), norms and biases are not such
    matrices and go to AdamW, as in Moonlight/Kimi and GLM-4.5. The router is a matrix but a tiny,
    routing-critical one: AdamW by default, `router="muon"` to change that. Everything else
    (attention q/k/v/o, dense and expert FFNs, the shared expert, eh_proj) is Muon; given `ndim`,
    a leaf with fewer than 2 dims once the stacked "layers" axis is removed goes to AdamW too.
    """
    names = path_names(path)
    if any(n in ("embed_tokens", "lm_head") for n in names):
        return "adam"
    if any(n.endswith(("norm", "_bias")) for n in names):
        return "adam"
    if "router" in names:
        if router not in ("adam", "muon"):
            raise ValueError(f"router={router!r}: expected 'adam' or 'muon'")
        return router
    if ndim is not None and ndim - (bool(names) and names[0] in LAYER_STACKS) < 2:
        return "adam"
    return "muon"


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 2.5e-4  # peak
    end_lr: float = 2.5e-5
    warmup_steps: int = 2000
    decay_steps: int = 100_000  # total schedule length, warmup included (optax convention)
    weight_decay: float = 0.1  # Muon leaves (decoupled, times the lr)
    clip: float = 1.0  # global grad-norm clip
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    # --- build_optimizer only ---
    schedule: str = "warmup_cosine"  # one of SCHEDULES
    wsd_decay_steps: int = 0  # wsd: length of the final linear decay; 0 -> 10% of decay_steps
    restarts: int = 1  # cosine_restarts: number of equal cosine cycles over decay_steps
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5
    muon_rms: float = 0.2  # update RMS matched to AdamW's typical 0.2
    muon_ns_dtype: str = "auto"  # Newton-Schulz matmul inputs (fp32 accumulation): one of NS_DTYPES
    adam_weight_decay: float = 0.1  # AdamW leaves: embedding (and lm_head) only, never norms/biases/router
    router_optimizer: str = "adam"  # "adam" | "muon"
    head_optimizer: str = "adam"  # lm_head: "adam" | "muon"
    layer_decay: float = 1.0  # layer-wise lr decay (mid-training / fine-tuning); 1.0 = off
    # muon_adamw: Muon on the matrices, AdamW on the rest (pre-training); adamw: AdamW on every leaf, decoupled
    # weight decay on the matrices (LoRA adapters, or full fine-tuning the way most recipes do it)
    algorithm: str = "muon_adamw"
    # What lives in host memory (pinned_host) between steps: "none"; "optimizer": the optimizer state, streamed to
    # the device for the update; "optimizer_and_params": the fp32 master weights too, the forward reading a
    # compute-dtype copy (training/offload.py, docs/training.md#host-offload)
    offload: str = "none"

    def __post_init__(self):
        def bounds(field, meaning="", **kw):
            check_range("optim", self, field, meaning=meaning, **kw)

        bounds("lr", ge=0, meaning="the peak learning rate; 0 freezes the weights")
        bounds("end_lr", ge=0, meaning="the learning rate the schedule decays to")
        bounds("warmup_steps", ge=0)
        # 0 is allowed: the run config fills in the run's length, and the cosine spans warmup + 1 steps.
        bounds("decay_steps", ge=0, meaning="the schedule's length, warmup included")
        bounds("weight_decay", ge=0, meaning="decoupled weight decay of the Muon leaves")
        bounds("adam_weight_decay", ge=0, meaning="decoupled weight decay of the AdamW embedding and head")
        # clip_by_global_norm(0) zeroes every update (NaN for a zero gradient): 0 is not "off".
        bounds("clip", gt=0, meaning="the global gradient-norm clip; a huge value such as 1e9 clips nothing")
        bounds("b1", ge=0, lt=1, meaning="Adam's first-moment decay")
        bounds("b2", ge=0, lt=1, meaning="Adam's second-moment decay")
        bounds("eps", gt=0, meaning="Adam's denominator epsilon")
        check_choice("optim", self, "schedule", SCHEDULES)
        bounds("wsd_decay_steps", ge=0, meaning="0 = the last 10% of decay_steps")
        bounds("restarts", ge=1, meaning="the number of cosine cycles")
        bounds("muon_momentum", ge=0, lt=1)
        bounds("muon_ns_steps", ge=1, meaning="Newton-Schulz iterations")
        bounds("muon_rms", gt=0, meaning="the RMS Muon's updates are scaled to")
        check_choice("optim", self, "muon_ns_dtype", NS_DTYPES,
                     "the Newton-Schulz matmul inputs; auto = bfloat16 on GPU/TPU, float32 on CPU")
        check_choice("optim", self, "router_optimizer", ("adam", "muon"))
        check_choice("optim", self, "head_optimizer", ("adam", "muon"))
        bounds("layer_decay", gt=0, le=1, meaning="1 = off")
        check_choice("optim", self, "algorithm", ("muon_adamw", "adamw"))
        check_choice("optim", self, "offload", OFFLOAD)


# --- schedules --------------------------------------------------------------------------------

def lr_schedule(cfg: OptimConfig) -> Schedule:
    """0 -> lr linearly over warmup_steps, then cosine to end_lr at decay_steps, flat after."""
    return Schedule("warmup_cosine", cfg.lr, cfg.end_lr, cfg.warmup_steps, cfg.decay_steps)


def make_schedule(cfg: OptimConfig) -> Schedule:
    """The schedule named by `cfg.schedule`; every one warms up linearly 0 -> lr over warmup_steps.

    warmup_cosine    GLM-4.5: cosine lr -> end_lr, ending at decay_steps (`lr_schedule`).
    wsd              warmup, stable at lr, linear lr -> end_lr over the last wsd_decay_steps
                     of decay_steps, flat after.
    cosine_restarts  `restarts` equal cycles over decay_steps; the first warms up from 0, later ones
                     from end_lr; each cosines to end_lr (optax.sgdr_schedule).
    constant         warmup, then lr forever.

    The numbers are inputs of the train step, not constants of it (training/schedule.py).
    """
    w, total = cfg.warmup_steps, cfg.decay_steps
    if cfg.schedule == "warmup_cosine":
        return lr_schedule(cfg)
    if cfg.schedule == "wsd":
        d = cfg.wsd_decay_steps or max(1, total // 10)
        check_field("optim", "wsd_decay_steps", d, w <= total - d,
                    f"warmup_steps={w} + wsd_decay_steps={d} exceed decay_steps={total}",
                    "lower --config.optim.wsd_decay_steps or --config.optim.warmup_steps")
        return Schedule("wsd", cfg.lr, cfg.end_lr, w, total, wsd_decay=d)
    if cfg.schedule == "cosine_restarts":
        n = max(1, cfg.restarts)
        check_field("optim", "restarts", cfg.restarts, total // n > w,
                    f"cycles of decay_steps / restarts = {total // n} steps must exceed warmup_steps={w}",
                    "lower --config.optim.restarts or --config.optim.warmup_steps")
        return Schedule("cosine_restarts", cfg.lr, cfg.end_lr, w, total, restarts=n)
    if cfg.schedule == "constant":
        return Schedule("constant", cfg.lr, cfg.end_lr, w, total)
    raise ValueError(f"schedule={cfg.schedule!r}: expected one of {SCHEDULES}")


# --- Muon + AdamW -------------------------------------------------------------------------------

def param_group(path, x, cfg: OptimConfig) -> str:
    """"muon" or "adam" for one leaf: `optimizer_group`, plus the lm_head switch."""
    if "lm_head" in path_names(path):
        return cfg.head_optimizer
    return optimizer_group(path, x.ndim, router=cfg.router_optimizer)


def param_labels(params, cfg: OptimConfig):
    """The params tree with a "muon" / "adam" string at every leaf."""
    return jax.tree_util.tree_map_with_path(lambda p, x: param_group(p, x, cfg), params)


def _decay_mask(cfg: OptimConfig, group: str, adam_decayed: tuple[str, ...] = ("embed_tokens", "lm_head")):
    """Callable mask: Muon leaves (group="muon"), or embedding / lm_head on AdamW (group="adam")."""

    def leaf(path, x):
        g = param_group(path, x, cfg)
        if group == "muon":
            return g == "muon"
        return g == "adam" and any(n in adam_decayed for n in path_names(path))

    return lambda tree: jax.tree_util.tree_map_with_path(leaf, tree)


def muon_adamw(cfg: OptimConfig, schedule: Schedule, layout: Layout | None = None) -> optax.GradientTransformation:
    """Muon / AdamW partition + decoupled weight decay + lr (no clipping, no sharding wrapper); `layout` as in
    `scale_by_layer_decay`.

    Equal per leaf to
      muon: scale_by_muon -> rms scaling -> add_decayed_weights(weight_decay) -> scale_by_learning_rate
      adam: optax.adamw(schedule, b1, b2, eps, weight_decay=adam_weight_decay on embedding/lm_head only)
    The decay and the lr are applied after the partition, once for both groups (same schedule).
    """
    muon = optax.chain(
        scale_by_muon(cfg.muon_momentum, cfg.muon_ns_steps, cfg.muon_ns_dtype),
        scale_by_consistent_rms(cfg.muon_rms),
    )
    adam = optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    return optax.chain(
        optax.partition({"muon": muon, "adam": adam}, functools.partial(param_labels, cfg=cfg)),
        optax.add_decayed_weights(cfg.weight_decay, mask=_decay_mask(cfg, "muon")),
        optax.add_decayed_weights(cfg.adam_weight_decay, mask=_decay_mask(cfg, "adam")),
        *([scale_by_layer_decay(cfg.layer_decay, layout)] if cfg.layer_decay != 1.0 else []),
        scale_by_schedule(schedule),
    )


def layer_depths(tree, layout: Layout | None = None, piece: Mapping[str, Any] | None = None) -> Any:
    """Depth of every leaf for layer-wise lr decay: embedding 0, decoder layer i (dense first, then
    MoE, as in the model) i + 1, everything after the trunk (final norm, head, MTP) L + 1.

    Stacked leaves get a [layers] vector of depths (one per slice of their leading axis). `layout`: the MoE stack
    is stored in that pipeline's slot order (docs/pipeline.md#layout); each slot gets the depth of the layer it
    holds, identity padding slots the top's (their updates are zero), so the factors are the unpipelined model's.
    `piece`: `tree` is a piece of the model's tree (training/streamed.py): "sizes" the stacks' whole lengths, and
    for a slice of one stack its name ("stack") and the index of its first layer ("start").
    """
    def stack_size(name):
        if piece is not None and name in piece["sizes"]:
            return piece["sizes"][name]
        leaves = [x for p, x in jax.tree_util.tree_leaves_with_path(tree) if path_names(p)[0] == name]
        return leaves[0].shape[0] if leaves else 0

    n_dense, n_moe = (stack_size(n) for n in LAYER_STACKS)
    if layout is None and n_moe and mesh_stages() > 1:  # depths counted along the slots would be silently wrong
        raise ValueError("layer_depths on a mesh with pipeline stages needs the MoE stack's layout: "
                         "build_optimizer(..., layout=model.pipeline.layout(model_cfg, stages))")
    if layout is not None and n_moe:
        if n_moe != layout.slots:
            raise ValueError(f"layer_depths: the MoE stack has {n_moe} slices, the pipeline layout {layout.slots} "
                             "slots; pass layout only for a tree stored in that layout")
        n_moe = layout.layers
    top = n_dense + n_moe + 1

    def depth(path, x):
        name = path_names(path)[0]
        if name == "embed_tokens":
            return jnp.zeros((), jnp.float32)
        if name in LAYER_STACKS:
            first = 1 if name == "dense_layers" else 1 + n_dense
            if name == "moe_layers" and layout is not None:  # slot -> the layer it holds (padding: the top)
                depths = jnp.asarray(first + np.minimum(layout.layer_of_slot(), layout.layers), jnp.float32)
            else:
                depths = jnp.arange(first, first + stack_size(name), dtype=jnp.float32)
            if piece is not None and piece.get("stack") == name:  # a slice of the stack
                return jax.lax.dynamic_slice_in_dim(depths, piece["start"], x.shape[0])
            return depths
        return jnp.asarray(top, jnp.float32)

    return jax.tree_util.tree_map_with_path(depth, tree), top


def scale_by_layer_decay(decay: float, layout: Layout | None = None) -> optax.GradientTransformationExtraArgs:
    """Multiply each leaf's update by decay ** (L + 1 - depth) (`layer_depths`): the top of the model
    keeps the full lr, lower layers get geometrically less (ELECTRA/BEiT-style, for mid-training
    and fine-tuning). optax has no depth-aware scaling, hence this small transform. `layout`: the MoE stack is in
    that pipeline's slot order (a mesh with `pipeline` > 1), depths still count in layer order. The extra argument
    `layer_slice` says where a streamed piece of the tree sits (`layer_depths`' piece)."""
    if not 0 < decay <= 1:
        raise ValueError(f"layer_decay={decay}: expected 0 < layer_decay <= 1")

    def update(updates, state, params=None, *, layer_slice=None, **extra):
        del params, extra
        depths, top = layer_depths(updates, layout, layer_slice)

        def scale(u, d):
            factor = jnp.power(jnp.float32(decay), top - d)
            return u * factor.reshape(factor.shape + (1,) * (u.ndim - factor.ndim)).astype(u.dtype)

        return jax.tree.map(scale, updates, depths), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def _shardings(tree):
    return jax.tree.map(lambda x: jax.typeof(x).sharding, tree)


def sharded_update(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` whose update runs under `jax.sharding.auto_axes`, outputs pinned to the input shardings.

    Newton-Schulz's X @ X.T cannot be typed in Explicit mode when a matrix axis is sharded; in Auto
    mode XLA picks the collectives (many: docs/performance.md#muon-on-a-sharded-mesh-the-collectives).
    Updates come back sharded like the grads, the new opt state like the old one. Without a mesh in
    context (or with an empty one) this is `tx.update` unchanged.
    """

    tx = optax.with_extra_args_support(tx)

    def update(updates, state, params=None, **extra):  # extra: `lr_inputs` (training/schedule.py)
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or not mesh.axis_names:
            return tx.update(updates, state, params, **extra)
        run = jax.sharding.auto_axes(lambda u, s, p, e: tx.update(u, s, p, **e),
                                     out_sharding=(_shardings(updates), _shardings(state)))
        return run(updates, state, params, extra)

    return optax.GradientTransformationExtraArgs(tx.init, update)


def build_optimizer(cfg: OptimConfig, params: Any = None, *, sharded: bool = True, skip_nonfinite: bool = True,
                    layout: Layout | None = None) -> tuple[optax.GradientTransformation, Schedule]:
    """clip_by_global_norm(clip) -> Muon/AdamW (`muon_adamw`), or AdamW alone with `algorithm="adamw"`, and its
    schedule (`make_schedule`).

    `params` (nnx.State or abstract) only validates the grouping up front; the labels are computed
    from whatever tree `init`/`update` see. `sharded=True` wraps the result in `sharded_update`.
    `skip_nonfinite=True` wraps it in `optax.apply_if_finite`: a gradient with a NaN/Inf anywhere
    leaves params and moments untouched and is counted in the state (`notfinite_count`,
    `total_notfinite`); it never gives up and applies one, the training loop stops the run instead.
    `layout`: the pipeline layout the params' MoE stack is stored in (`model.pipeline.layout`), None without
    one; only layer-wise lr decay reads it.
    """
    if cfg.algorithm != "adamw" and params is not None:
        param_labels(params, cfg)  # raises early on an unexpected tree
    return _optimizer(cfg, sharded, skip_nonfinite, layout if cfg.layer_decay != 1.0 else None)


@functools.cache
def _optimizer(cfg: OptimConfig, sharded: bool, skip_nonfinite: bool, layout: Layout | None = None
               ) -> tuple[optax.GradientTransformation, Schedule]:
    # One object per configuration in a process: the train step built on it is then the same jitted function
    # too (training/step.py), and a second run in the process (a resume, another seed) traces nothing again.
    schedule = make_schedule(cfg)
    if cfg.algorithm == "adamw":
        matrices = lambda tree: jax.tree.map(lambda x: x.ndim >= 2, tree)  # noqa: E731
        inner = optax.chain(  # optax.adamw(schedule, ...) with the schedule's numbers as inputs (the same state)
            optax.scale_by_adam(cfg.b1, cfg.b2, cfg.eps),
            optax.add_decayed_weights(cfg.weight_decay, matrices), scale_by_schedule(schedule))
    else:
        inner = muon_adamw(cfg, schedule, layout)
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip), inner)
    tx = sharded_update(tx) if sharded else tx
    skip = 2**31 - 2 if skip_nonfinite else None
    if skip_nonfinite:
        tx = optax.apply_if_finite(tx, max_consecutive_errors=skip)
    if cfg.offload != "none":  # the train step streams the update layer by layer (training/streamed.py)
        tx = LayerStreamed(tx.init, tx.update, inner, cfg.clip, sharded, skip)
    return tx, schedule

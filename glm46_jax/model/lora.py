"""LoRA / DoRA fine-tuning: which weights get adapters, attaching them, and merging them back (docs/lora.md).

    graphdef, adapters, base, buffers = add_adapters(graphdef, params, buffers, LoRAConfig(rank=8), mesh)
    out = apply(graphdef, combine(adapters, base), buffers, tokens)     # the model with adapters
    grads = jax.grad(lambda a: loss(combine(a, base)))(adapters)       # only the adapters are trained
    plain_graphdef, params = merge_adapters(graphdef, adapters, base, buffers, mesh)   # for save_hf

`adapters` holds only `LoRA` leaves (A, B, DoRA magnitudes, fp32) and, on a model with a score head, its `Head`
weight (trained in full); `base` the frozen `nnx.Param` weights (bf16 if `base_dtype` asks); `buffers` the MoE correction biases, as for the plain model.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from glm46_jax.errors import InputError, check_choice, check_field, check_known_fields, check_range
from glm46_jax.model import pipeline
from glm46_jax.model.adapters import Adapter, LoRA
from glm46_jax.model.attention import Attention
from glm46_jax.model.layers import MLP, ExpertBias, Head
from glm46_jax.model.moe import MoE
from glm46_jax.model.paths import LAYER_STACKS
from glm46_jax.parallel import sharding

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
FFN = ("gate_proj", "up_proj", "down_proj")
EXPERT_MODES = ("none", "per_expert", "shared")
TRAINED = nnx.Any(LoRA, Head)  # what a LoRA run trains: the adapters and a score head, if the model has one


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Adapter settings (`--config.lora.<field>`); see docs/lora.md#configuration."""
    rank: int = 8
    alpha: float = 16.0
    rslora: bool = False  # scale alpha / sqrt(rank) instead of alpha / rank
    dora: bool = False  # DoRA: a magnitude per output feature of each adapted weight
    # Name patterns, PEFT's rules: a pattern names a weight if it equals its name, is a dotted suffix of it
    # ("q_proj", "shared_experts.gate_proj") or a regex that fully matches it (docs/lora.md#target-names).
    targets: tuple[str, ...] = ATTENTION + FFN
    experts: str = "none"  # routed experts: none | per_expert (one adapter each) | shared (one for all)
    base_dtype: str = "float32"  # the frozen base weights: float32 | bfloat16 (adapters stay fp32)
    dropout: float = 0.0  # must be 0: adapters are merged into the weight (no x·A·B side path to drop on)

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        check_range("lora", self, "rank", ge=1, meaning="the adapter rank")
        check_field("lora", "rank", self.rank, isinstance(self.rank, int), "must be an integer",
                    "set --config.lora.rank to a whole number >= 1")
        check_range("lora", self, "alpha", gt=0, meaning="the scale numerator")
        check_choice("lora", self, "experts", EXPERT_MODES, "adapters on the routed experts")
        check_choice("lora", self, "base_dtype", ("float32", "bfloat16"), "storage of the frozen weights")
        check_field("lora", "dropout", self.dropout, self.dropout == 0,
                    "LoRA dropout is not supported (adapters are merged into the weight: "
                    "docs/lora.md#merged-weights-not-a-side-path)", "set --config.lora.dropout=0")
        check_field("lora", "targets", self.targets, bool(self.targets) and all(isinstance(t, str) and t
                                                                               for t in self.targets),
                    "must be a non-empty list of name patterns", "e.g. --config.lora.targets='(\"q_proj\",)'")

    @property
    def scale(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.rslora else self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoRAConfig:
        check_known_fields("config.lora", d, [f.name for f in dataclasses.fields(cls)])
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class Target:
    """One adaptable weight of the model: `name` is what patterns match (routed experts read
    `<stack>.mlp.experts.<proj>`), `module`/`attr` where it lives."""
    name: str
    module: tuple[str, ...]
    attr: str
    n_in: int  # input axes of the weight (after its leading layer / expert axes)
    n_out: int
    routed: bool


def adaptable(model: nnx.Module) -> list[Target]:
    """Every weight an adapter can go on: attention projections, dense MLPs, shared and routed experts of
    the layer stacks (not the MTP layer, which HF's Glm4MoeForCausalLM and so PEFT do not have)."""
    out = []
    for path, module in nnx.iter_modules(model):
        path = tuple(str(p) for p in path)
        if not path or path[0] not in LAYER_STACKS:
            continue
        prefix = ".".join(path)
        if isinstance(module, Attention):
            out += [Target(f"{prefix}.{a}", path, a, 2 if a == "o_proj" else 1, 1 if a == "o_proj" else 2, False)
                    for a in ATTENTION]
        elif isinstance(module, MLP):
            out += [Target(f"{prefix}.{a}", path, a, 1, 1, False) for a in FFN]
        elif isinstance(module, MoE):
            out += [Target(f"{prefix}.experts.{a}", path, a, 1, 1, True) for a in FFN]
    return out


def matches(pattern: str, name: str) -> bool:
    if name == pattern or name.endswith("." + pattern):
        return True
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:
        return False


def select(model: nnx.Module, lcfg: LoRAConfig) -> list[Target]:
    """The targets `lcfg` names; a pattern that names nothing is the user's mistake."""
    candidates = [t for t in adaptable(model) if not t.routed or lcfg.experts != "none"]
    names = [t.name for t in candidates]
    for p in lcfg.targets:
        if not any(matches(p, n) for n in names):
            raise InputError(f"lora.targets: {p!r} names no adaptable weight of this model; the names are "
                             f"{', '.join(names)} (routed experts only with lora.experts=per_expert|shared)")
    return [t for t in candidates if any(matches(p, t.name) for p in lcfg.targets)]


def _names(var: nnx.Variable) -> tuple[str | None, ...]:
    return tuple(var.get_metadata().get("out_sharding", (None,) * var.get_value().ndim))


def adapter_layout(target: Target, var: nnx.Variable, lcfg: LoRAConfig):
    """Shapes and logical names of (A, B, magnitude) for one weight, sharded like the weight: A keeps its
    input axes' names, B its output axes', the rank axis is replicated."""
    shape, names = var.get_value().shape, _names(var)
    n_lead = len(shape) - target.n_in - target.n_out
    lead, lead_names = shape[:n_lead], names[:n_lead]
    if target.routed and lcfg.experts == "shared":  # drop the expert axis (the last lead axis)
        lead, lead_names = lead[:-1], lead_names[:-1]
    ins, outs = slice(n_lead, n_lead + target.n_in), slice(n_lead + target.n_in, None)
    r = lcfg.rank
    a = (lead + shape[ins] + (r,), lead_names + names[ins] + (None,))
    b = (lead + (r,) + shape[outs], lead_names + (None,) + names[outs])
    m = (shape[:n_lead] + shape[outs], names[:n_lead] + names[outs])
    return a, b, m, tuple(range(n_lead, n_lead + target.n_in))


def add_adapters(graphdef: nnx.GraphDef, params: nnx.State, buffers: nnx.State, lcfg: LoRAConfig,
                 mesh: jax.sharding.Mesh, seed: int = 0
                 ) -> tuple[nnx.GraphDef, nnx.State, nnx.State, nnx.State]:
    """The model with adapters on the weights `lcfg.targets` names: (graphdef, adapters, base, buffers).

    Init as PEFT: A uniform in +-1/sqrt(fan_in) (kaiming_uniform, a=sqrt(5)), B = 0, so the model starts
    exactly as the base; the DoRA magnitude starts at the base weight's norm per output feature.
    """
    with sharding.use_mesh(mesh):
        model = nnx.merge(graphdef, params, buffers)
        cfg = model.cfg
        targets = select(model, lcfg)
        weights = [getattr(owner(model, t), t.attr) for t in targets]
        layouts = [adapter_layout(t, w, lcfg) for t, w in zip(targets, weights)]

        @jax.jit
        def init(key, values):
            out = []
            for i, (((a_shape, a_names), (b_shape, b_names), (_, m_names), in_axes), w) in \
                    enumerate(zip(layouts, values)):
                fan_in = math.prod(a_shape[-1 - len(in_axes):-1])
                slots = a_names[:1] == (pipeline.SLOT_AXIS,)
                # A pipeline's MoE stack is in slot order: draw in layer order and permute, so a seed gives the same
                # adapters on every mesh (identity padding slots get A = 0 and, never used, keep it).
                shape = (cfg.num_moe_layers, *a_shape[1:]) if slots else a_shape
                a = jax.random.uniform(jax.random.fold_in(key, i), shape, jnp.float32, -1, 1) / math.sqrt(fan_in)
                if slots:
                    a = pipeline.in_slot_order(a, cfg)
                b = jnp.zeros(b_shape, jnp.float32)
                m = None
                if lcfg.dora:
                    w = w.astype(jnp.float32)
                    m = jax.sharding.reshard(jnp.sqrt(jnp.sum(w * w, axis=in_axes)), sharding.logical(*m_names))
                out.append((jax.sharding.reshard(a, sharding.logical(*a_names)),
                            jax.sharding.reshard(b, sharding.logical(*b_names)), m))
            return out

        values = init(jax.random.key(seed), [w.get_value() for w in weights])
        for t, (a_lay, b_lay, m_lay, _), (a, b, m) in zip(targets, layouts, values):
            mag = None if m is None else LoRA(m, out_sharding=m_lay[1])
            setattr(owner(model, t), f"{t.attr}_lora",
                    Adapter(LoRA(a, out_sharding=a_lay[1]), LoRA(b, out_sharding=b_lay[1]), mag, lcfg.scale,
                            t.n_in, t.n_out))
        graphdef, adapters, base, buffers = nnx.split(model, TRAINED, nnx.Param, ExpertBias)
    if lcfg.base_dtype != "float32":
        base = jax.tree.map(lambda x: x.astype(lcfg.base_dtype), base)
    return graphdef, adapters, base, buffers


def owner(model: nnx.Module, target: Target) -> nnx.Module:
    """The module holding `target`'s weight (and its adapter, as `<attr>_lora`)."""
    module = model
    for p in target.module:
        module = getattr(module, p)
    return module


def combine(adapters: nnx.State, base: nnx.State) -> nnx.State:
    """The one parameter State `model.apply` / `loss.loss_fn` take: adapters and the frozen base together."""
    return nnx.merge_state(base, adapters)


def partition(params: nnx.State) -> tuple[nnx.State, nnx.State]:
    """`combine`'s inverse: (adapters, base)."""
    return nnx.split_state(params, TRAINED, ...)


def merge_adapters(graphdef: nnx.GraphDef, adapters: nnx.State, base: nnx.State, buffers: nnx.State,
                   mesh: jax.sharding.Mesh) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) of the plain model with every adapter merged in (W + scale·A·B, or DoRA's
    normalised form), each weight in its base dtype and sharding: what `hf.save_hf` exports."""
    with sharding.use_mesh(mesh):
        model = nnx.merge(graphdef, combine(adapters, base), buffers)
        adapted = [(path, module, name[:-len("_lora")]) for path, module in nnx.iter_modules(model)
                   for name in list(vars(module)) if name.endswith("_lora") and isinstance(getattr(module, name),
                                                                                       Adapter)]

        @jax.jit
        def merged(adapters, base, buffers):
            m = nnx.merge(graphdef, combine(adapters, base), buffers)
            out = {}
            for path, _, attr in adapted:
                module = m
                for p in path:
                    module = getattr(module, p)
                var = getattr(module, attr)
                w = getattr(module, f"{attr}_lora")(sharding.weight(var)).astype(var.get_value().dtype)
                out[tuple(str(p) for p in path) + (attr,)] = jax.sharding.reshard(w, sharding.logical(*_names(var)))
            return out

        new = merged(adapters, base, buffers)
        for _, module, attr in adapted:
            delattr(module, f"{attr}_lora")
        plain, params, _ = nnx.split(model, nnx.Param, ExpertBias)
    flat = [(path, var.replace(new[key]) if (key := tuple(str(p) for p in path)) in new else var)
            for path, var in nnx.to_flat_state(params)]
    return plain, nnx.from_flat_state(flat)

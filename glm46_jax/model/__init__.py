"""The GLM-MoE model: NNX modules split once into pytrees, then used functionally.

    graphdef, params, buffers = init_model(cfg, mesh, seed)
    out = apply(graphdef, params, buffers, tokens)   # pure; jit it

`params` (nnx.Param leaves) is what gradients and the optimizer see; `buffers` holds the
`e_score_correction_bias` of every MoE layer, changed only by the loss-free balancing rule.

    transformer           decoder layers, the scanned layer stacks, the MTP layer and the causal LM (GLMMoE)
    layers                RMSNorm, the SwiGLU MLP, partial rotary embeddings, initialisers
    attention             GQA self-attention (QK-norm, partial RoPE) and its backends
    blockwise_attention   causal attention in blocks with an online softmax (long context, context parallel)
    moe                   the MoE block: sigmoid router with correction bias, routed and shared experts
    experts               the routed experts' grouped SwiGLU matmul every dispatch ends in
    grouped_gemm          dropless routed experts as grouped GEMMs
    pipeline              pipeline parallelism over the MoE layer stack (GPipe, circular)
    lora, adapters        LoRA / DoRA: which weights get adapters, the adapter module, merging back
    paths                 plain names for the parameter tree's key paths
    counting              parameter and FLOP counts from the config alone
    activations           activation memory per device, for the memory plan
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx
from jaxtyping import Array, Float, Int

from glm46_jax.config import ModelConfig
from glm46_jax.model import pipeline
from glm46_jax.model.layers import ExpertBias
from glm46_jax.model.transformer import GenerationCache, GLMMoE, ModelOutput
from glm46_jax.parallel import sharding

__all__ = ["ExpertBias", "GLMMoE", "GenerationCache", "ModelOutput", "abstract_model", "apply", "init_model"]


def init_model(cfg: ModelConfig, mesh: jax.sharding.Mesh | None = None,
               seed: int = 0) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """Random init (HF `_init_weights` scheme), every array created directly in its final sharding.

    Construction runs inside `jax.jit`, so no device ever holds a full replica of a sharded weight.
    """
    mesh = mesh or sharding.make_mesh({"data": 1}, jax.devices()[:1])
    with sharding.use_mesh(mesh):
        graphdef, _, _ = abstract_model(cfg, mesh)
        make = _compiled_init(_init_key(cfg), mesh, jax.config.jax_optimization_level)
        params, buffers = make(jax.random.key(seed))
        if mesh.shape["pipeline"] > 1:  # the same weights as on any other mesh, in the pipeline's slot order
            params, buffers = jax.jit(lambda tree: pipeline.in_slot_order(tree, cfg))((params, buffers))
    return graphdef, params, buffers


def _init_key(cfg: ModelConfig) -> ModelConfig:
    # Runtime fields do not change the parameters: share one compiled init between them.
    return dataclasses.replace(cfg, dtype="float32", attention_impl="xla", remat="none", moe_capacity_factor=0.0,
                               moe_dispatch="allgather", attention_block_q=128, attention_block_kv=128,
                               moe_block_size=128, moe_block_group=4, scan_unroll=1, pipeline_microbatches=0,
                               pipeline_repeats=1)


@functools.lru_cache(maxsize=16)
def _compiled_init(cfg: ModelConfig, mesh: jax.sharding.Mesh, level: str) -> jax.stages.Compiled:
    # Compiled ahead of time once per (config, mesh, optimization level) in a process and kept: XLA compiles every
    # parameter's threefry draw, seconds per model on CPU, and a jitted function is traced and lowered again after
    # each jax.clear_caches(). The level is in the key because the draws' last bits depend on it
    # (docs/performance.md#initialization). Called inside `sharding.use_mesh(mesh)`.
    @jax.jit
    def make(key):
        # In layer order (stages=1) whatever the mesh: init_model permutes it into a pipeline's slots.
        _, params, buffers = nnx.split(GLMMoE(cfg, rngs=nnx.Rngs(params=key), stages=1), nnx.Param, ExpertBias)
        return params, buffers
    return make.lower(jax.random.key(0)).compile()


def abstract_model(cfg: ModelConfig, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh):
    """(graphdef, params, buffers) as ShapeDtypeStructs with shardings; nothing allocated.

    With a concrete mesh the shardings name its devices, so the result can be a restore target.
    """
    abstract = isinstance(mesh, jax.sharding.AbstractMesh)
    with (jax.sharding.use_abstract_mesh(mesh) if abstract else jax.set_mesh(mesh)), \
            nnx.logical_axis_rules(sharding.LOGICAL_RULES):
        graphdef, params, buffers = nnx.split(nnx.eval_shape(lambda: GLMMoE(cfg, rngs=nnx.Rngs(0))),
                                              nnx.Param, ExpertBias)
    if not abstract:  # eval_shape names the abstract mesh; point it at the real devices
        def on_mesh(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.NamedSharding(mesh, x.sharding.spec))
        params, buffers = jax.tree.map(on_mesh, (params, buffers))
    params, buffers = pipeline.with_stage_axis((params, buffers))
    return graphdef, params, buffers


def apply(graphdef: nnx.GraphDef, params: nnx.State, buffers: nnx.State, tokens: Int[Array, "b s"] | None,
          positions: Int[Array, "b s"] | None = None, segment_ids: Int[Array, "b s"] | None = None, *,
          cache: GenerationCache | None = None, index: Int[Array, ""] | Int[Array, "b"] | int = 0,
          start: Int[Array, "b"] | None = None, expert_ids: Int[Array, "l b s k"] | None = None,
          next_tokens: Int[Array, "b s"] | None = None, with_mtp: bool = True,
          hidden: Float[Array, "b s d"] | None = None, with_logits: bool = True) -> ModelOutput:
    """The model's one pure forward pass: logits, final hidden state, MTP logits, router statistics and, given a
    KV cache, the updated cache. Arguments as `GLMMoE.__call__`:

        apply(g, p, b, tokens)                                              # training / scoring: whole rows
        apply(g, p, b, tokens, positions, cache=c, index=i, start=s, with_mtp=False)   # a generation step
        apply(g, p, b, None, positions, cache=c, index=i, start=s, hidden=h, next_tokens=n)  # MTP drafting
        apply(g, p, b, tokens, with_logits=False, with_mtp=False).scores    # a reward model / critic
    """
    return nnx.merge(graphdef, params, buffers)(tokens, positions, segment_ids, cache=cache, index=index, start=start,
                                                expert_ids=expert_ids, next_tokens=next_tokens, with_mtp=with_mtp,
                                                hidden=hidden, with_logits=with_logits)

"""GQA self-attention with q/k/v bias, per-head QK-norm and partial half-split RoPE (docs/architecture.md#attention)."""

from __future__ import annotations

import logging

import einops
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention_api
from jaxtyping import Array, Bool, Float, Int

from glm46_jax.errors import InputError
from glm46_jax.config import ModelConfig
from glm46_jax.model.adapters import adapted
from glm46_jax.model.blockwise_attention import blockwise_attention
from glm46_jax.model.layers import RMSNorm, apply_partial_rope, param
from glm46_jax.parallel.sharding import (context_size, copies_to_split, load_balanced_order, logical, mesh_axes,
                                         shard_map, unsharded_singletons, weight, whole_along)


def attention_mask(segment_ids: Int[Array, "b s"] | None, seq_len: int) -> Bool[Array, "b 1 s t"]:
    """Causal, and documents packed in one row never see each other (segment ids differ)."""
    causal = jnp.tril(jnp.ones((seq_len, seq_len), bool))[None, None]
    if segment_ids is None:
        return causal
    segment_ids = whole_along(segment_ids, 1)  # [s, t] cannot shard both axes over `context`
    same_doc = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return causal & same_doc


@struct.dataclass
class SequenceMask:
    """The causal + same-document mask of `attention_mask` as what it is made of, for the attention paths that never
    hold [s, t] (blockwise: each block's mask; cudnn: its causal mode, per packed document): query i sees key j iff
    positions[j] <= positions[i] and, with segment ids, they share a segment. `positions` index the row
    (not RoPE positions, which restart per packed document); on a mesh with a context axis > 1 the row is in
    the load-balanced layout and `positions` say where each slot came from (`sharding.load_balanced_order`)."""
    positions: Int[Array, "s"]
    segment_ids: Int[Array, "b s"] | None


# cuDNN's packed layout takes at most this many documents (runs of one segment id) per row, as a static shape; the
# softmax statistics it keeps for the backward are [rows * this, heads, s] fp32 (docs/performance.md#attention).
CUDNN_MAX_SEGMENTS = 32


def resolved_attention_impl(cfg: ModelConfig, *, context: int | None = None, platform: str | None = None,
                            packed: bool = False) -> str:
    """`cfg.attention_impl`, with "auto" decided for the platform traced for (`jax.default_backend()` unless given):
    cudnn on a CUDA GPU where its flash attention takes the model's dtype, head_dim and (`packed`) segments, else
    blockwise (any backend, the only one that splits a sequence over `context`)."""
    if cfg.attention_impl != "auto":
        return cfg.attention_impl
    context = context_size() if context is None else context
    platform = _platform() if platform is None else platform
    return "cudnn" if context == 1 and platform == "gpu" and _cudnn_takes(cfg, packed) else "blockwise"


def _platform() -> str:
    return jax.default_backend()


def _cudnn_takes(cfg: ModelConfig, packed: bool) -> bool:
    """jax's cuDNN checks (fused_attention_stablehlo.check_layout / check_is_flash_attention), from the config:
    bf16/fp16, head_dim a multiple of 8 up to 128 (256 from Hopper on), packed documents from Hopper on."""
    hopper = cudnn_attention_api.check_compute_capability("9.0")
    return (cfg.dtype in ("bfloat16", "float16") and cfg.head_dim % 8 == 0
            and cfg.head_dim <= (256 if hopper else 128) and (hopper or not packed))


def self_attention_mask(cfg: ModelConfig, segment_ids: Int[Array, "b s"] | None,
                        seq_len: int) -> Bool[Array, "b 1 s t"] | SequenceMask:
    """The training / scoring forward's mask in the form `cfg.attention_impl` consumes."""
    impl = resolved_attention_impl(cfg, packed=segment_ids is not None)
    if impl in ("blockwise", "cudnn"):
        return SequenceMask(jnp.asarray(load_balanced_order(seq_len, context_size())), segment_ids)
    if context_size() > 1:  # sharding.validate_mesh says this to a user; this is for direct callers
        raise ValueError(f"attention_impl={cfg.attention_impl!r} cannot split a sequence over the context axis")
    return attention_mask(segment_ids, seq_len)


def check_documents_fit(cfg: ModelConfig, segment_ids, *, platform: str, context: int) -> None:
    """On the host, before a batch goes to the devices: refuse rows that pack more documents than cuDNN's packed
    layout takes, where `cfg`'s attention resolves to cudnn (on the device those rows would turn NaN and their
    steps be skipped). Counts runs of equal ids, as `segment_layout` does; any leading axes are rows too."""
    if resolved_attention_impl(cfg, context=context, platform=platform, packed=True) != "cudnn":
        return
    ids = np.asarray(segment_ids)
    most = 1 + int(np.count_nonzero(np.diff(ids, axis=-1), axis=-1).max(initial=0))
    if most > CUDNN_MAX_SEGMENTS:
        raise InputError(f"a batch row packs {most} documents; cuDNN attention takes at most {CUDNN_MAX_SEGMENTS} "
                         "per row (attention.CUDNN_MAX_SEGMENTS): set --config.model.attention_impl=blockwise, "
                         "or pack fewer, longer documents per row")


def segment_layout(segment_ids: Int[Array, "b s"], max_segments: int
                   ) -> tuple[Int[Array, "b m"], Int[Array, "b m1"], Int[Array, "b"]]:
    """Each row's documents (runs of equal segment ids, padding's run included) in the form jax's cuDNN API takes
    packed rows: (lengths [b, max_segments], start offsets [b, max_segments + 1], -1 past a row's last document
    and in the last offset column; the number of documents per row). Documents past `max_segments` are left out
    (`cudnn_attention` makes such rows NaN). Runs, not ids: an id that recurs after another is a new document,
    whereas `attention_mask` would join the two (the loaders give each document of a row its own id)."""
    run = jnp.cumsum(jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                                      segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1), axis=1, dtype=jnp.int32) - 1
    count = run[:, -1] + 1
    lengths = jnp.sum(run[:, :, None] == jnp.arange(max_segments, dtype=jnp.int32), axis=1, dtype=jnp.int32)
    present = jnp.arange(max_segments, dtype=jnp.int32) < count[:, None]
    starts = jnp.where(present, jnp.cumsum(lengths, axis=1, dtype=jnp.int32) - lengths, -1)
    offsets = jnp.concatenate([starts, jnp.full_like(starts[:, :1], -1)], axis=1)
    return jnp.where(present, lengths, -1), offsets, count


# Laid out like the k/v activations (batch over data x expert, kv heads over tensor: `Attention._qkv`'s copies of
# them where they are fewer than tensor devices), one slice per layer; the slots whole (generation does not split a
# sequence over `context`).
CACHE_AXES = ("layers", "batch", "cache_slots", "kv_heads", "head_dim")


@struct.dataclass
class KVCache:
    """Keys and values of one scanned layer stack, preallocated for `max_len` slots.

    k, v: [layers, batch, max_len, kv_heads, head_dim], with `Attention.kv_heads` (copies included) KV heads.
    Keys are stored after QK-norm and RoPE, so a slot is written once and read as is by every later step.
    Updated with dynamic_update_slice: under jit with the cache donated, XLA writes the new slots in place
    instead of copying the whole cache.
    """
    k: Float[Array, "l b t k c"]
    v: Float[Array, "l b t k c"]

    @classmethod
    def zeros(cls, num_layers: int, batch: int, max_len: int, cfg: ModelConfig) -> KVCache:
        shape = (num_layers, batch, max_len, Attention.kv_heads(cfg), cfg.head_dim)
        spec = logical(*CACHE_AXES)
        return cls(*(jnp.zeros(shape, jnp.dtype(cfg.dtype), out_sharding=spec) for _ in range(2)))

    def write(self, layer, index, k: Float[Array, "b s k c"], v: Float[Array, "b s k c"]) -> KVCache:
        """Writes k/v at slots [index, index + s): one index for the whole batch (plain decoding), or one per
        row (`index` of shape [b]: speculative decoding, where rows accept different numbers of tokens)."""
        def put(cache, new):
            new = jax.sharding.reshard(new.astype(cache.dtype)[None], logical(*CACHE_AXES))
            if jnp.ndim(index) == 0:
                return jax.lax.dynamic_update_slice(cache, new, (layer, 0, index, 0, 0))
            b, s = new.shape[1:3]
            rows = jax.sharding.reshard(jnp.broadcast_to(jnp.arange(b)[:, None], (b, s)), logical("batch", None))
            slots = jax.sharding.reshard(index[:, None] + jnp.arange(s), logical("batch", None))
            return cache.at[layer, rows, slots].set(new[0], unique_indices=True, indices_are_sorted=True,
                                                    out_sharding=logical(*CACHE_AXES))
        return KVCache(put(self.k, k), put(self.v, v))

    def layer(self, layer) -> tuple[Float[Array, "b t k c"], Float[Array, "b t k c"]]:
        return (jax.lax.dynamic_index_in_dim(self.k, layer, keepdims=False),
                jax.lax.dynamic_index_in_dim(self.v, layer, keepdims=False))


def cache_mask(start: Int[Array, "b"], index: Int[Array, ""] | Int[Array, "b"] | int, seq_len: int,
               max_len: int) -> Bool[Array, "b 1 s t"]:
    """Query i (at slot index + i) sees slot t iff start[b] <= t <= index + i: causal over the cache,
    and the left padding before a row's first token (slots < start[b]) is never attended.
    `index` is one slot for the batch or one per row ([b])."""
    q_slot = jnp.asarray(index)[..., None, None] + jnp.arange(seq_len)[:, None]  # [s, 1] or [b, s, 1]
    t = jnp.arange(max_len)[None, :]
    return ((t <= q_slot) & (t >= start[:, None, None]))[:, None]


class Attention(nnx.Module):
    """Einsum letters: b batch, s/t query/key position, d model, h query heads, k kv heads,
    g query heads per kv head, c head_dim."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, k, c = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # Fewer KV heads than the devices "kv_heads" splits over (MQA): the k/v weights are replicated and every
        # device computes the copy of its KV head that its query heads read (`_qkv`).
        kv = "kv_heads" if copies_to_split("kv_heads", k) == 1 else None
        self.q_proj = param(rngs, (d, h, c), ("embed", "heads", "head_dim"), cfg)
        self.k_proj = param(rngs, (d, k, c), ("embed", kv, "head_dim"), cfg)
        self.v_proj = param(rngs, (d, k, c), ("embed", kv, "head_dim"), cfg)
        self.o_proj = param(rngs, (h, c, d), ("heads", "head_dim", "embed"), cfg)
        if cfg.attention_bias:  # q/k/v only; o_proj never has a bias
            self.q_bias = param(None, (h, c), ("heads", "head_dim"), cfg, init="zeros")
            self.k_bias = param(None, (k, c), (kv, "head_dim"), cfg, init="zeros")
            self.v_bias = param(None, (k, c), (kv, "head_dim"), cfg, init="zeros")
        if cfg.use_qk_norm:  # one [head_dim] weight shared by all heads
            self.q_norm = RMSNorm(c, cfg)
            self.k_norm = RMSNorm(c, cfg)
        self.cfg = cfg

    @staticmethod
    def kv_heads(cfg: ModelConfig) -> int:
        """The KV heads attention runs with on the mesh in use: the model's, each copied `copies_to_split` times
        where they are fewer than the devices "kv_heads" splits over."""
        return cfg.num_key_value_heads * copies_to_split("kv_heads", cfg.num_key_value_heads)

    @jax.named_scope("attention")  # op names in profiles and HLO dumps: .../attention/...
    def __call__(self, x: Float[Array, "b s d"], cos: Array, sin: Array, mask: Bool[Array, "b 1 s t"] | SequenceMask,
                 cache: KVCache | None = None, layer: Int[Array, ""] | int = 0, index: Int[Array, ""] | int = 0
                 ) -> tuple[Float[Array, "b s d"], KVCache | None]:
        """Self-attention over the s rows of `x`; with a `cache` (generation) the rows' k/v are first written into
        layer `layer` of it at slots [index, index + s), and the queries attend over all of that layer's t slots
        (`mask` says which slots each query may see: causal, and never a padded slot)."""
        q, k, v = self._qkv(x, cos, sin)
        if cache is not None:
            cache = cache.write(layer, index, k, v)
            k, v = cache.layer(layer)
        return self._attend(q, k, v, mask), cache

    def _qkv(self, x, cos, sin):
        cfg, dt = self.cfg, x.dtype
        q = jnp.einsum("bsd,dhc->bshc", x, adapted(self, "q_proj", dt))
        k = jnp.einsum("bsd,dkc->bskc", x, adapted(self, "k_proj", dt))
        v = jnp.einsum("bsd,dkc->bskc", x, adapted(self, "v_proj", dt))
        if cfg.attention_bias:
            q, k, v = q + weight(self.q_bias, dt), k + weight(self.k_bias, dt), v + weight(self.v_bias, dt)
        if cfg.use_qk_norm:  # after the bias, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        copies = copies_to_split("kv_heads", cfg.num_key_value_heads)
        if copies > 1:  # one copy per device; a head's copies adjacent, so query head h still reads (a copy of) h // g
            k, v = (jax.sharding.reshard(jnp.repeat(a, copies, axis=2), logical("batch", "seq", "kv_heads", None))
                    for a in (k, v))
        return q, k, v

    def _attend(self, q, k, v, mask):
        cfg = self.cfg
        scale = cfg.head_dim ** -0.5  # 1/sqrt(head_dim), not 1/sqrt(hidden/heads)
        if context_size() == 1:  # seq names the context axis even at size 1: [s, t] products cannot shard both
            # One KV head is left only where the heads' devices are one (`_qkv` copies it wherever there are more):
            # leave the heads unsharded then, as splitting the query heads into (1 kv head, group), here or inside
            # jax.nn.dot_product_attention, moves their layout onto the group axis, which k does not have.
            heads, kv = ("heads", "kv_heads") if k.shape[2] > 1 else (None, None)
            q, k, v = (jax.sharding.reshard(a, logical("batch", None, names, None))
                       for a, names in ((q, heads), (k, kv), (v, kv)))
            # Likewise every size-1 axis (one row): a reshape that only inserts size-1 axes (that split) drops their
            # layouts, and the products below need q, k, v and the mask to agree on them.
            q, k, v = map(unsharded_singletons, (q, k, v))
            if not isinstance(mask, SequenceMask):
                mask = unsharded_singletons(mask)
        impl = resolved_attention_impl(cfg, packed=isinstance(mask, SequenceMask) and mask.segment_ids is not None)
        if isinstance(mask, SequenceMask):
            pos, seg = mask.positions, mask.segment_ids
            if seg is not None and context_size() == 1:
                seg = unsharded_singletons(whole_along(seg, 1))
            out = None
            if impl == "cudnn":
                try:
                    out = cudnn_attention(q, k, v, seg, scale)
                except (NotImplementedError, RuntimeError) as refused:  # jax's cuDNN checks, at trace time
                    if cfg.attention_impl != "auto":
                        raise
                    logging.getLogger(__name__).warning("attention_impl=auto: cuDNN refused (%s); blockwise", refused)
            if out is None:
                attend = blockwise_attention if context_size() == 1 else context_parallel_attention
                out = attend(q, k, v, q_positions=pos, k_positions=pos, q_segment_ids=seg, k_segment_ids=seg,
                             scale=scale, block_q=cfg.attention_block_q, block_kv=cfg.attention_block_kv)
        elif impl in ("xla", "blockwise") or cfg.attention_impl == "auto":  # generation: a dense cache mask
            out = _xla_attention(q, k, v, mask, scale)
        else:  # generation with a dense cache mask: jax.nn.dot_product_attention (cuDNN when asked for)
            out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale,
                                               implementation="cudnn" if impl == "cudnn" else None)
        # Heads are tensor-sharded: the contraction is a reduce-scatter/all-reduce into the residual layout.
        return jnp.einsum("bshc,hcd->bsd", out, adapted(self, "o_proj", q.dtype),
                          out_sharding=logical("batch", "seq", "act_embed"))


def cudnn_attention(q: Float[Array, "b s h c"], k: Float[Array, "b s k c"], v: Float[Array, "b s k c"],
                    segment_ids: Int[Array, "b s"] | None, scale: float) -> Float[Array, "b s h c"]:
    """cuDNN flash attention in its causal mode: no [s, t] mask or bias, so it skips the masked half.

    Packed rows go through cuDNN's packed (ragged, THD-style) layout: each document is a sequence of its own,
    given by its length and start offset within the row (`segment_layout`), causal within itself. jax's own cuDNN
    API (what `jax.nn.dot_product_attention` calls), as the one on the GPU image that takes lengths + offsets:
    TransformerEngine and tokamax would be extra wheels. Batch and heads may be sharded (run per shard).
    A row of more than CUDNN_MAX_SEGMENTS documents gets a NaN output: its later documents would otherwise be
    left out silently, and a runtime error would cost a device->host copy every step (the loss turns NaN, which
    the trainer's non-finite guard reports; attention_impl="blockwise" takes any number of documents).
    """
    def local(q, k, v, *segment_ids):
        # Each shard's own rows and heads: jax's conversion of lengths + offsets to cuDNN's flat list of documents
        # (`_fix_seqlen_offsets`) refuses explicitly sharded ones, and the calls show in the lowered program
        # (outside a shard_map, a mesh of several devices lowers them to a placeholder partitioned at compile time).
        if not segment_ids:
            return (cudnn_attention_api.dot_product_attention(q, k, v, scale=scale,
                                                              mask_type=cudnn_attention_api.MaskType.CAUSAL),)
        lengths, offsets, count = segment_layout(segment_ids[0], CUDNN_MAX_SEGMENTS)
        out = cudnn_attention_api.dot_product_attention(
            q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets, scale=scale,
            mask_type=cudnn_attention_api.MaskType.PADDING_CAUSAL)
        return (jnp.where((count > CUDNN_MAX_SEGMENTS)[:, None, None, None], jnp.nan, out),)

    args = (q, k, v) + (() if segment_ids is None else (segment_ids,))
    if jax.typeof(q).sharding.mesh.empty:
        return local(*args)[0]
    q_spec, kv_spec = (jax.typeof(a).sharding.spec for a in (q, k))
    row_spec = jax.P((tuple(q_spec) + (None,))[0], None)
    args = args[:3] + tuple(jax.sharding.reshard(a, row_spec) for a in args[3:])
    return shard_map(local, (q_spec, kv_spec, kv_spec) + (row_spec,) * (len(args) - 3), (q_spec,),
                     diff_argnums=(0, 1, 2))(*args)[0]


def context_parallel_attention(q: Float[Array, "b s h c"], k: Float[Array, "b s k c"], v: Float[Array, "b s k c"], *,
                               q_positions: Int[Array, "s"], k_positions: Int[Array, "s"],
                               q_segment_ids: Int[Array, "b s"] | None, k_segment_ids: Int[Array, "b s"] | None,
                               scale: float, block_q: int, block_kv: int) -> Float[Array, "b s h c"]:
    """Blockwise attention with the sequence sharded over `context` (docs/long_context.md#attention-across-shards).

    Each shard all-gathers K/V (and key segment ids) over `context` and attends with its own queries, at their
    true row positions, to every key; the gather's transpose (a reduce-scatter) returns dK/dV to their shards.
    Batch and heads keep their data/expert and tensor sharding. Positions and segment ids are those of the
    whole (laid-out) row, as `self_attention_mask` gives them.
    """
    seq = mesh_axes("seq")
    q_spec, kv_spec = logical("batch", "seq", "heads", None), logical("batch", "seq", "kv_heads", None)
    seg_spec, gathered_pos = logical("batch", "seq"), jax.P()
    packed = q_segment_ids is not None

    def local(q, k, v, q_pos, k_pos, *segments):
        k, v, *k_seg = (jax.lax.all_gather(a, seq, axis=1, tiled=True) for a in (k, v, *segments[1:]))
        return (blockwise_attention(q, k, v, q_positions=q_pos, k_positions=k_pos,
                                    q_segment_ids=segments[0] if packed else None,
                                    k_segment_ids=k_seg[0] if packed else None, scale=scale, block_q=block_q,
                                    block_kv=block_kv),)

    # Inside a pipeline stage the backward recomputes this forward once more (docs/pipeline.md#nested-shard-map).
    in_specs = (q_spec, kv_spec, kv_spec, logical("seq"), gathered_pos) + (seg_spec, seg_spec) * packed
    mapped = shard_map(local, in_specs, (q_spec,), diff_argnums=(0, 1, 2))
    args = [jax.sharding.reshard(q, q_spec), jax.sharding.reshard(k, kv_spec), jax.sharding.reshard(v, kv_spec),
            jax.sharding.reshard(q_positions, logical("seq")), jax.sharding.reshard(k_positions, gathered_pos)]
    if packed:
        args += [jax.sharding.reshard(q_segment_ids, seg_spec), jax.sharding.reshard(k_segment_ids, seg_spec)]
    return mapped(*args)[0]


def _xla_attention(q, k, v, mask, scale):
    # The reference path: HF eager semantics (scores in the activation dtype, softmax in fp32).
    # Query head h uses kv head h // g (HF repeat_kv), so heads split as (kv head, group member). The g query heads
    # of a kv head sit next to the query rows, [s, g]: both products are then plain batched matmuls over
    # (b, kv head) whose [s, t]-sized operands and results need no transposed copies (XLA:CPU otherwise
    # transposes scores and probabilities: docs/performance.md#attention).
    q = einops.rearrange(q, "b s (k g) c -> b k s g c", k=k.shape[2])  # (s, g) adjacent: XLA folds them
    k = einops.rearrange(k, "b t k c -> b k t c")
    v = einops.rearrange(v, "b t k c -> b k t c")
    scores = jnp.einsum("bksgc,bktc->bksgt", q, k) * scale
    # An additive mask, as HF's eager path: the add's backward needs no residual, whereas `where` keeps its
    # predicate broadcast to every head's [s, t] for the backward, stacked over the scanned layers
    # (docs/performance.md#attention).
    bias = jnp.where(mask, 0.0, jnp.finfo(jnp.float32).min)[:, :, :, None, :]  # [b, 1, s, 1, t]
    probs = jax.nn.softmax(scores.astype(jnp.float32) + bias, axis=-1).astype(q.dtype)
    out = jnp.einsum("bksgt,bktc->bksgc", probs, v)
    return einops.rearrange(out, "b k s g c -> b s (k g) c")

"""Memory and FLOPs plan for a mesh, from the real model built abstractly (nothing is allocated).

    python -m glm46_jax.plan --config=configs/pretrain.py:glm45 --mesh=data=32,tensor=8,expert=32,pipeline=1 \
        --micro-batch=1 --seq-len=4096 --device-memory=80GiB
    python -m glm46_jax.plan --config=configs/pretrain.py:glm46 --phase=long_context_200k --device-memory=80GB \
        --search    # the fewest devices and the mesh that fit (glm46_jax/plan_search.py)

Exact per device (from the abstract model's shapes and PartitionSpecs; a dim of size n sharded
over axes of total size k holds ceil(n / k) entries on every device):
  params       every nnx.Param in `param_dtype` (fp32 master weights).
  grads        one params-shaped tree, same layout and dtype (the accumulator when micro-batching).
  optimizer    Muon: one fp32 momentum per matrix; AdamW: two fp32 moments for the embedding,
               lm_head, router, norms and biases (`optimizer_group`). Step counters are ignored.
  buffers      e_score_correction_bias (fp32).

Estimated (`activation_estimate`; a formula, not a compiled program's buffer assignment):
  activations  what the backward pass keeps, plus the one layer it recomputes, plus the logits;
  gathered     parameters all-gathered over the FSDP (data) axis into their compute layout.
XLA adds workspace, fragmentation and collective buffers on top, so leave a margin.

The command line prints the table and exits 1 when the plan does not fit --device-memory,
2 on a user error (a mesh the model cannot be laid out on, a bad flag): one `error: ...` line.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from glm46_jax import cli, errors, plan_search, run_config
from glm46_jax.config import ModelConfig
from glm46_jax.model.counting import ParamCounts, flops_per_token, matmul_params_per_token, param_counts
from glm46_jax.model.paths import COMPUTE_CAST, LAYER_STACKS, path_names
from glm46_jax.parallel import sharding
from glm46_jax.model.activations import ActivationEstimate, activation_estimate
from glm46_jax.training.offload import OFFLOAD
from glm46_jax.training.optim import optimizer_group

GiB = 1 << 30
_OPT_BYTES = 4  # optimizer moments are fp32 whatever the parameter dtype


# --- per-device bytes of an abstract leaf ----------------------------------------------------

def shard_elements(x: jax.ShapeDtypeStruct, mesh_sizes: Mapping[str, int],
                   drop_axes: Sequence[str] = (), skip_leading: bool = False) -> int:
    """Elements of `x` held by one device: prod_i ceil(dim_i / prod(sizes of the axes sharding dim i)).

    `drop_axes` are treated as unsharded (a gathered copy); `skip_leading` drops dim 0 (one layer of a stack).
    """
    spec = tuple(x.sharding.spec) + (None,) * (len(x.shape) - len(x.sharding.spec))
    n = 1
    for i, (dim, entry) in enumerate(zip(x.shape, spec)):
        if skip_leading and i == 0:
            continue
        k = math.prod(mesh_sizes[a] for a in sharding.spec_axes(entry) if a not in drop_axes)
        n *= -(-dim // k)
    return n


def shard_bytes(x: jax.ShapeDtypeStruct, mesh_sizes: Mapping[str, int]) -> int:
    return shard_elements(x, mesh_sizes) * np.dtype(x.dtype).itemsize


# --- the plan ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """The pipeline schedule's idle fraction and its traffic per device per micro-step
    (docs/pipeline.md#memory-and-traffic)."""
    stages: int
    repeats: int
    microbatches: int
    slots: int  # the MoE stack padded to stages x repeats x layers per chunk
    bubble: float  # (S - 1) / (R M + S - 1)
    p2p_bytes: int  # ppermute: one micro-batch's activations per iteration, forward and backward
    boundary_bytes: int  # the all-gather into the stages and the all-reduce out of them, forward and backward


def pipeline_plan(cfg: ModelConfig, mesh_sizes: Mapping[str, int], micro_batch: int, seq_len: int
                  ) -> PipelinePlan | None:
    """None without pipeline stages. `micro_batch` sequences per batch shard around the trunk."""
    s_ = mesh_sizes.get("pipeline", 1)
    if s_ == 1 or not cfg.num_moe_layers:
        return None
    r_, m_ = cfg.pipeline_repeats, cfg.pipeline_microbatches or s_
    c_ = -(-cfg.num_moe_layers // (s_ * r_))
    act = np.dtype(cfg.dtype).itemsize * cfg.hidden_size
    stage_tokens = s_ * micro_batch * seq_len  # a stage streams its whole (data x expert) shard's rows
    p2p = 2 * (r_ * m_ + s_ - 1) * (stage_tokens // m_) * act
    # ring all-gather in and all-reduce out: (S - 1) / S of the stage batch, 1x and 2x; the backward mirrors them
    boundary = 2 * 3 * (s_ - 1) * stage_tokens * act // s_
    return PipelinePlan(s_, r_, m_, s_ * r_ * c_, (s_ - 1) / (r_ * m_ + s_ - 1), p2p, boundary)


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """Per-device bytes (and element counts) for one model on one mesh; `report()` formats it."""
    cfg: ModelConfig
    mesh: dict[str, int]
    devices: int
    micro_batch: int
    seq_len: int
    remat: str
    global_batch: int | None
    params: int
    grads: int
    muon_momentum: int
    adam_moments: int
    buffers: int
    gathered_weights: int
    activations: ActivationEstimate
    counts: ParamCounts
    muon_params: int  # element counts (unsharded) in each optimizer group
    adam_params: int
    unique_params_bytes: int  # one copy of the params, unsharded
    matmul_params_per_token: int  # the N of 6N (counting.matmul_params_per_token)
    flops_per_token: int
    device_memory: int | None = None
    pipeline: PipelinePlan | None = None
    offload: str = "none"  # optim.offload (training/offload.py): what lives in host memory between steps
    # an offloaded update's device share: the largest piece it streams in (training/streamed.py), its optimizer state
    # (and master weights): one layer of a stack, or every leaf outside the streamed stacks
    streamed_piece: int = 0
    host_params: int = 0  # the master weights, when offloaded (`params` is then the device's compute copy)

    @property
    def optimizer(self) -> int:
        return self.muon_momentum + self.adam_moments

    @property
    def static(self) -> int:
        """Exact part on the device: params + grads + optimizer state (unless offloaded) + buffers."""
        return self.params + self.grads + self.buffers + (self.optimizer if self.offload == "none" else 0)

    @property
    def host(self) -> int:
        """Host memory per device: the offloaded optimizer state (and master weights)."""
        return (0 if self.offload == "none" else self.optimizer) + self.host_params

    @property
    def total(self) -> int:
        """Device memory per device; an offloaded update streams its state in pieces (training/streamed.py)."""
        streamed = self.streamed_piece if self.offload != "none" else 0
        return self.static + self.gathered_weights + self.activations.total + streamed

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.total <= self.device_memory

    @property
    def data_parallel(self) -> int:
        return math.prod(self.mesh[a] for a in sharding.mesh_axes("batch"))

    def verdict(self) -> str:
        if self.device_memory is None:
            return "device memory not given (--device-memory=80GiB): fit not checked"
        need, have = self.total / GiB, self.device_memory / GiB
        if self.fits:
            return (f"FITS: {need:.2f} GiB of {have:.2f} GiB per device ({100 * self.total / self.device_memory:.0f}%, "
                    f"{have - need:.2f} GiB left for XLA workspace and fragmentation)")
        cfg, act = self.cfg, self.activations
        hints = []
        if self.static > self.device_memory:
            what = "params + grads + optimizer state" if self.offload == "none" else "params + grads"
            hints.append(f"{what} alone need {self.static / GiB:.2f} GiB: shard them over more devices (a larger "
                         "data axis for FSDP, a larger expert axis for the experts)")
        if self.offload == "none":
            hints.append(f"--offload=optimizer (the optimizer state's {self.optimizer / GiB:.2f} GiB in host memory)")
        elif self.offload == "optimizer":
            hints.append("--offload=optimizer_and_params (the fp32 master weights in host memory too, the device "
                         "keeping a compute-dtype copy)")
        else:
            hints.append("more data / expert sharding (shrinks params, grads and optimizer state)")
        if self.remat != "full":
            hints.append(f"--remat=full (now {self.remat})")
        if self.micro_batch > 1:
            hints.append(f"a smaller --micro-batch (now {self.micro_batch}; accumulate gradients instead)")
        if cfg.moe_capacity_factor <= 0:
            hints.append(f"a MoE capacity factor (--config.model.moe_capacity_factor=1.25): dropless routing keeps "
                         f"a worst-case row space, {act.moe_buffers_per_layer / GiB:.2f} GiB per MoE layer")
        if cfg.attention_impl in ("xla", "dot_product"):
            hints.append("blockwise attention (--config.model.attention_impl=blockwise; cudnn on GPUs) instead of "
                         "[s, s] score matrices")
        if cfg.attention_impl == "blockwise":
            context = self.mesh.get("context", 1)
            hints.append(f"a larger mesh.context (now {context}, {self.micro_batch * self.seq_len // context} tokens "
                         "per device) to split each sequence's activations over more devices")
        return (f"DOES NOT FIT: needs {need:.2f} GiB per device, the device has {have:.2f} GiB "
                f"(short by {need - have:.2f} GiB). Try: " + "; ".join(hints) + ".")

    def report(self) -> str:
        c, n, cfg, act = self.counts, self.devices, self.cfg, self.activations
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items())
        routing = f"capacity factor {cfg.moe_capacity_factor}" if cfg.moe_capacity_factor > 0 else "dropless"
        context = self.mesh.get("context", 1)
        split = f" / context {context}" if context > 1 else ""
        batch = (f"batch: micro-batch {self.micro_batch} x {self.seq_len}{split} = "
                 f"{self.micro_batch * self.seq_len // context} tokens per device; "
                 f"{self.micro_batch * self.data_parallel} sequences per micro-step over {self.data_parallel} batch "
                 "shards (data x expert x pipeline)")
        if self.global_batch is not None:
            steps = self.global_batch // (self.micro_batch * self.data_parallel)
            batch += f"; global batch {self.global_batch} = {steps} accumulation steps"
        lines = [
            (f"mesh {mesh} = {n} devices; params {cfg.param_dtype}, compute {cfg.dtype}, "
             f"attention {cfg.attention_impl}, MoE dispatch {cfg.moe_dispatch} ({routing})"),
            (f"model: {c.report_total / 1e9:.2f}B total / {c.report_active / 1e9:.2f}B active (report convention: "
             f"trunk + MTP, no embedding/head); {c.model_total / 1e9:.2f}B stored with embedding and lm_head"),
            (f"optimizer groups: Muon {self.muon_params / 1e9:.2f}B params, AdamW {self.adam_params / 1e9:.3f}B "
             "(embedding, lm_head, router, norms, biases)"),
            (f"model FLOPs per token: {self.flops_per_token / 1e9:.2f} GFLOP at seq {self.seq_len} (6 x "
             f"{self.matmul_params_per_token / 1e9:.2f}B matmul params + causal attention; fwd + bwd, no remat)"),
            batch,
        ]
        if (pp := self.pipeline) is not None:
            lines.append(
                f"pipeline: {pp.stages} stages x {pp.repeats} repeats, {pp.microbatches} micro-batches per batch shard: "
                f"bubble {100 * pp.bubble:.1f}% ((S-1)/(RM+S-1)); MoE stack in {pp.slots} slots "
                f"({pp.slots - cfg.num_moe_layers} identity); point-to-point {pp.p2p_bytes / GiB:.2f} GiB and "
                f"stage boundary {pp.boundary_bytes / GiB:.2f} GiB per device per micro-step (fwd + bwd)")
        lines += ["", f"{'':42}{'per device':>14}{'all devices':>16}"]

        def row(label: str, b: int):
            lines.append(f"{label:42}{b / GiB:>10.2f} GiB{b * n / GiB / 1024:>12.2f} TiB")

        if self.host_params:
            row(f"master params ({cfg.param_dtype}, host)", self.host_params)
            row(f"params: device copy ({cfg.dtype} projections)", self.params)
            row("grads (as the device copy)", self.grads)
        else:
            row(f"params ({cfg.param_dtype})", self.params)
            row(f"grads ({cfg.param_dtype})", self.grads)
        where = "" if self.offload == "none" else ", host"
        row(f"optimizer: Muon momentum (fp32{where})", self.muon_momentum)
        row(f"optimizer: AdamW moments (2 x fp32{where})", self.adam_moments)
        if self.offload != "none":
            row("  the largest piece of the update streamed in", self.streamed_piece)
        row("buffers (correction bias)", self.buffers)
        row("gathered weights (estimate)", self.gathered_weights)
        row(f"activations (estimate, remat={self.remat})", act.total)
        row("  saved for the scanned layers", act.saved_layers)
        row("  one layer rebuilt for its backward", act.recompute)
        row("  MTP layer, embeddings, norms", act.mtp)
        row("  logits (main + MTP)", act.logits)
        if act.pipeline:
            row("  pipeline micro-batch buffers", act.pipeline)
        row("total" if self.offload == "none" else "total (device; host state excluded)", self.total)
        if self.host:
            lines.append(f"host memory: {self.host / GiB:.2f} GiB per device, {8 * self.host / GiB:.2f} GiB per "
                         "8-device node (pinned: it stays in RAM)")
        lines.append(f"(one copy of the params: {self.unique_params_bytes / GiB:.2f} GiB; MoE dispatch buffers: "
                     f"{act.moe_buffers_per_layer / GiB:.2f} GiB per MoE layer, inside the activation estimate)")
        lines += ["", self.verdict()]
        return "\n".join(lines)


@functools.lru_cache(maxsize=32)
def _abstract_model(cfg: ModelConfig, tensor: int, pipeline: int):
    """The abstract params and buffers. Their shapes depend on the mesh only through `tensor` (KV heads copied) and
    `pipeline` (the stack's slots), their PartitionSpecs not at all (logical names), so meshes that differ
    elsewhere share one shape evaluation (a search plans hundreds)."""
    from glm46_jax.model import abstract_model  # the model pulls in flax; keep `--help` fast

    sizes = {**dict.fromkeys(sharding.MESH_AXES, 1), "tensor": tensor, "pipeline": pipeline}
    amesh = jax.sharding.AbstractMesh(tuple(sizes[a] for a in sharding.MESH_AXES), sharding.MESH_AXES,
                                      axis_types=(jax.sharding.AxisType.Explicit,) * len(sharding.MESH_AXES))
    _, params, buffers = abstract_model(cfg, amesh)
    return params, buffers


def plan(cfg: ModelConfig, mesh_sizes: Mapping[str, int], *, devices: int | None = None, micro_batch: int = 1,
         seq_len: int = 4096, remat: str | None = None, device_memory: int | None = None,
         global_batch: int | None = None, router_optimizer: str = "adam", offload: str = "none") -> PlanResult:
    """Per-device memory of training `cfg` on a mesh of `mesh_sizes` (missing axes are 1).

    One axis may be -1 (the remaining devices) when `devices` is given; otherwise the mesh has
    prod(sizes) devices. Raises errors.InputError (a ValueError) with the reason (`sharding.mesh_shape`,
    `sharding.validate_mesh`) when the model cannot be laid out on the mesh, and when
    `global_batch` is not a whole number of micro-steps.
    """
    if devices is None:
        if any(int(v) == -1 for v in mesh_sizes.values()):
            raise errors.InputError(f"mesh {dict(mesh_sizes)}: an axis of -1 (the rest) needs the device count "
                                 "(--devices)")
        devices = math.prod(int(v) for v in mesh_sizes.values())
    sizes = sharding.mesh_shape(mesh_sizes, devices)
    sharding.validate_mesh(sizes, cfg, global_batch)
    if offload not in OFFLOAD:
        raise errors.InputError(f"--offload={offload!r}: expected one of {', '.join(OFFLOAD)}")
    if micro_batch < 1 or seq_len < 1:
        raise errors.InputError(f"--micro-batch={micro_batch} and --seq-len={seq_len} must be >= 1")
    sharding.check_context_split(seq_len, sizes["context"], "--seq-len")
    remat = cfg.remat if remat is None else remat
    data_parallel = math.prod(sizes[a] for a in sharding.mesh_axes("batch"))
    if global_batch is not None and global_batch % (micro_batch * data_parallel):
        raise errors.InputError(f"train.global_batch={global_batch} is not a multiple of micro-batch {micro_batch} "
                             f"x {data_parallel} batch shards (data x expert x pipeline) = "
                             f"{micro_batch * data_parallel}")
    if sizes["pipeline"] > 1 and (sizes["pipeline"] * micro_batch) % (cfg.pipeline_microbatches or sizes["pipeline"]):
        raise errors.InputError(f"--micro-batch={micro_batch}: a stage streams pipeline x micro-batch = "
                             f"{sizes['pipeline'] * micro_batch} rows in model.pipeline_microbatches="
                             f"{cfg.pipeline_microbatches or sizes['pipeline']} micro-batches; make them divide")

    params, buffers = _abstract_model(cfg, sizes["tensor"], sizes["pipeline"])
    fsdp = {a for name in sharding.FSDP_LOGICAL for a in sharding.mesh_axes(name)}

    param_bytes = device_params = muon = adam = n_muon = n_adam = unique = 0
    pp = pipeline_plan(cfg, sizes, micro_batch, seq_len)
    pieces: dict[str, int] = {}  # the streamed update's pieces: "" the leaves outside the streamed stacks
    masters_on_host = offload == "optimizer_and_params"
    layer_gathered: dict[str, int] = {}  # one layer of each stack (and the MTP layer), compute layout
    head_gathered = 0  # embedding + lm_head, live from the first layer to the MTP logits
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        names = path_names(path)
        local = shard_elements(x, sizes)
        itemsize = np.dtype(x.dtype).itemsize
        # the device's copy: the projections in the compute dtype when the masters are on the host (offload.py)
        on_device = np.dtype(cfg.dtype).itemsize if masters_on_host and names[-1] in COMPUTE_CAST else itemsize
        param_bytes += local * itemsize
        device_params += local * on_device
        size = math.prod(x.shape)
        unique += size * np.dtype(x.dtype).itemsize
        moments = 1 if optimizer_group(path, x.ndim, router=router_optimizer) == "muon" else 2
        if moments == 1:
            muon, n_muon = muon + local * _OPT_BYTES, n_muon + size
        else:
            adam, n_adam = adam + 2 * local * _OPT_BYTES, n_adam + size
        # what the streamed update brings to the device for this leaf: its state (and its master weights), a layer
        # at a time for a stack whose layer axis is not split over pipeline stages (training/streamed.py)
        brought = local * (moments * _OPT_BYTES + (itemsize if masters_on_host else 0))
        piece = names[0] if names[0] in LAYER_STACKS and not (names[0] == "moe_layers" and pp is not None) else ""
        pieces[piece] = pieces.get(piece, 0) + (brought // x.shape[0] if piece else brought)
        gathered = shard_elements(x, sizes, drop_axes=fsdp, skip_leading=names[0] in LAYER_STACKS)
        gathered *= on_device
        if names[0] in ("embed_tokens", "lm_head"):
            head_gathered += gathered
        elif names[0] != "norm":
            layer_gathered[names[0]] = layer_gathered.get(names[0], 0) + gathered
    buffer_bytes = sum(shard_bytes(x, sizes) for x in jax.tree.leaves(buffers))

    # Gathered weights: the embedding and head (+ their full-layout gradients) are live across the
    # whole step; one layer's gathered weights and gradients at a time. Without remat the backward
    # keeps every layer's gathered weights (in the compute dtype) as residuals of its matmuls.
    largest = max(layer_gathered.values(), default=0)
    gathered_weights = 2 * (head_gathered + largest)
    if remat == "none":
        ratio = np.dtype(cfg.dtype).itemsize / np.dtype(cfg.param_dtype).itemsize
        moe_here = (cfg.num_moe_layers if pp is None else pp.slots // pp.stages)  # a stage keeps only its own
        per_layer = {"dense_layers": cfg.num_dense_layers, "moe_layers": moe_here}
        gathered_weights += int(ratio * sum(layer_gathered.get(k, 0) * v for k, v in per_layer.items()))

    return PlanResult(
        cfg=cfg.replace(remat=remat), mesh=sizes, devices=math.prod(sizes.values()), micro_batch=micro_batch,
        seq_len=seq_len, remat=remat,
        global_batch=global_batch, params=device_params, grads=device_params, muon_momentum=muon, adam_moments=adam,
        buffers=buffer_bytes, gathered_weights=gathered_weights,
        activations=activation_estimate(cfg, sizes, micro_batch, seq_len, remat),
        counts=param_counts(cfg), muon_params=n_muon, adam_params=n_adam, unique_params_bytes=unique,
        matmul_params_per_token=matmul_params_per_token(cfg), flops_per_token=flops_per_token(cfg, seq_len),
        device_memory=device_memory, pipeline=pp, offload=offload, streamed_piece=max(pieces.values()),
        host_params=param_bytes if masters_on_host else 0)


# --- command line ------------------------------------------------------------------------------

def parse_mesh(text: str) -> dict[str, int]:
    """"data=32,tensor=8,expert=32,pipeline=1" -> {axis: size}; missing axes are left out (size 1)."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\w+)\s*=\s*(-?\d+)", part)
        if not m:
            raise errors.InputError(f"--mesh={text!r}: {part!r} is not axis=size (axes: "
                                 f"{', '.join(sharding.MESH_AXES)})")
        if m.group(1) in sizes:
            raise errors.InputError(f"--mesh={text!r}: axis {m.group(1)!r} given twice")
        sizes[m.group(1)] = int(m.group(2))
    if not sizes:
        raise errors.InputError(f"--mesh={text!r}: no axis=size entries")
    return sizes


def _flags(argv: list[str]):
    # A FlagValues of our own: importing this module next to glm46_jax.train (which owns the global
    # --config flag) must not clash, and tests call main() repeatedly.
    from absl import flags
    from ml_collections import config_flags

    fv = flags.FlagValues()
    f = {
        "config": config_flags.DEFINE_config_file(
            "config", None, "Config file, e.g. configs/pretrain.py:glm45.", flag_values=fv, lock_config=True,
            sys_argv=argv),
        "mesh": flags.DEFINE_string(
            "mesh", None, "Mesh, e.g. data=32,tensor=8,expert=32,pipeline=1 (default: the config's mesh); "
            "one axis may be -1 (the rest) with --devices.", flag_values=fv),
        "devices": flags.DEFINE_integer(
            "devices", None, "Device count (default: the product of the mesh).", flag_values=fv),
        "device_memory": flags.DEFINE_string(
            "device-memory", None, "Memory per device, e.g. 80GiB or 141GB; checks the fit.", flag_values=fv),
        "micro_batch": flags.DEFINE_integer(
            "micro-batch", 1, "Sequences per batch shard (data x expert) per micro-step.", flag_values=fv),
        "seq_len": flags.DEFINE_integer(
            "seq-len", None, "Sequence length (default: the config's train.seq_len).", flag_values=fv),
        "remat": flags.DEFINE_enum(
            "remat", None, ["none", "full", "save_matmuls"], "Remat policy (default: the config's model.remat).",
            flag_values=fv),
        "router_optimizer": flags.DEFINE_enum(
            "router-optimizer", "adam", ["adam", "muon"], "Optimizer group of the router weights.", flag_values=fv),
        "offload": flags.DEFINE_enum(
            "offload", None, list(OFFLOAD), "What lives in host memory between steps (default: the config's "
            "optim.offload).",
            flag_values=fv),
        "phase": flags.DEFINE_string(
            "phase", None, "Curriculum phase whose seq_len and global batch to plan (default: the first).",
            flag_values=fv),
        "search": flags.DEFINE_boolean(
            "search", False, "Find the fewest devices (powers of two) and the mesh that fit --device-memory "
            "(glm46_jax/plan_search.py); --mesh and --devices are then ignored.", flag_values=fv),
        "margin": flags.DEFINE_float(
            "margin", 0.1, "With --search: the share of device memory left to XLA's workspace.", flag_values=fv),
    }
    if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in argv):
        print(f"python -m glm46_jax.plan --config=configs/pretrain.py:glm45 --mesh=data=32,tensor=8,expert=32 ...\n\n"
              f"{__doc__}\n{fv.get_help()}")
        raise SystemExit(0)
    cli.parse_flags(fv, ["glm46_jax.plan", *argv])  # a bad flag or --config.x.y: one-line InputError
    if f["config"].value is None:
        raise errors.InputError("--config is required, e.g. --config=configs/pretrain.py:glm45")
    return {"config_path": fv["config"].config_filename, **{k: v.value for k, v in f.items()}}


def main(argv: list[str] | None = None) -> PlanResult | None:
    """Parse flags, plan (or search), print the report; returns the PlanResult (None: the search found none)."""
    args = _flags(list(sys.argv[1:] if argv is None else argv))
    run_cfg = run_config.from_config_dict(args["config"])  # the one place the ConfigDict is read
    mesh = parse_mesh(args["mesh"]) if args["mesh"] else run_cfg.mesh.sizes()
    memory = cli.parse_bytes(args["device_memory"], "--device-memory") if args["device_memory"] else None
    # The batch shape of the phase's first step (at the start of any batch ramp); the first phase by default.
    phases = {p.name: p for p in run_cfg.data.curriculum.phases}
    if args["phase"] is not None and args["phase"] not in phases:
        raise errors.InputError(f"--phase={args['phase']}: the config's phases are {', '.join(phases)}")
    phase = phases[args["phase"]] if args["phase"] else run_cfg.data.curriculum.phases[0]
    seq_len = args["seq_len"] or phase.seq_len
    at = functools.partial(plan, run_cfg.model, micro_batch=args["micro_batch"], seq_len=seq_len,
                           remat=args["remat"], device_memory=memory, global_batch=phase.rows_at(0),
                           router_optimizer=args["router_optimizer"], offload=args["offload"] or run_cfg.optim.offload)
    if not args["search"]:
        result = at(mesh, devices=args["devices"])
    elif memory is None:
        raise errors.InputError("--search needs --device-memory (e.g. 80GB)")
    else:
        result = plan_search.smallest_fitting(at, memory, margin=args["margin"])
    print(f"plan for {run_cfg.source['model'].get('preset', 'the config')} ({args['config_path']})")
    if args["search"] and result is None:
        print(f"no mesh of up to 16384 devices fits {memory / GiB:.2f} GiB per device with a "
              f"{100 * args['margin']:.0f}% margin")
        return None
    if args["search"]:
        print(f"fewest devices: {result.devices}, mesh {result.mesh} (plan_search's choice among those that fit in "
              f"{100 * (1 - args['margin']):.0f}% of the device's memory)")
    print(result.report())
    return result


def exit_code() -> int:
    result = main()  # 1: nothing fits (a verdict, not a usage error)
    return 1 if result is None or result.fits is False else 0


if __name__ == "__main__":
    cli.main_guard(exit_code)

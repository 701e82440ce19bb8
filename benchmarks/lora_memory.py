"""Optimizer-state and gradient memory of full fine-tuning vs LoRA, from the models' abstract shapes.

    PYTHONPATH=. python benchmarks/lora_memory.py                        # glm45_air and glm45, ranks 16 / 64
    PYTHONPATH=. python benchmarks/lora_memory.py --presets glm46 --ranks 8,128 --experts per_expert

Nothing is allocated: the full model's figures are `glm46_jax.plan`'s (Muon momentum + AdamW moments, fp32,
and gradients of every weight in its dtype), summed over the whole model (divide by the devices that shard them). The
LoRA figures count the adapters `glm46_jax.model.lora` would attach for `--targets` (each A [*lead, *in, r] and
B [*lead, r, *out], shaped from the weight it adapts) with AdamW's two fp32 moments and fp32 gradients; the frozen
base weights need no gradients and no optimizer state.
"""

from __future__ import annotations

import argparse
import math

import jax
import numpy as np
from flax import nnx

from glm46_jax.config import get_preset
from glm46_jax.model import abstract_model, lora
from glm46_jax.parallel import sharding
from glm46_jax.plan import plan

GB = 1e9


def adapter_elements(preset: str, rank: int, targets: tuple[str, ...], experts: str) -> tuple[int, int]:
    """(adapter elements, adapted weights) for `preset` on a one-device abstract mesh."""
    cfg = get_preset(preset)
    amesh = jax.sharding.AbstractMesh((1,) * len(sharding.MESH_AXES), sharding.MESH_AXES,
                                      axis_types=(jax.sharding.AxisType.Explicit,) * len(sharding.MESH_AXES))
    graphdef, params, buffers = abstract_model(cfg, amesh)
    lcfg = lora.LoRAConfig(rank=rank, targets=targets, experts=experts)
    with jax.sharding.use_abstract_mesh(amesh), nnx.logical_axis_rules(sharding.LOGICAL_RULES):
        model = nnx.merge(graphdef, params, buffers)
        chosen = lora.select(model, lcfg)
        total = 0
        for t in chosen:
            var = getattr(lora.owner(model, t), t.attr)  # the layout rule adapters are built with
            (a_shape, _), (b_shape, _), _, _ = lora.adapter_layout(t, var, lcfg)
            total += math.prod(a_shape) + math.prod(b_shape)
    return total, len(chosen)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="glm45_air,glm45")
    p.add_argument("--ranks", default="16,64")
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--experts", default="none", choices=lora.EXPERT_MODES)
    args = p.parse_args(argv)
    targets = tuple(t for t in args.targets.split(",") if t)
    print("| model | fine-tuning | trained params | gradients | optimizer state (fp32) | gradients + optimizer |")
    print("|---|---|---|---|---|---|")
    for preset in args.presets.split(","):
        cfg = get_preset(preset)
        full = plan(cfg, {"data": 1}, micro_batch=1, seq_len=4096)
        n_full = full.muon_params + full.adam_params
        grads_full = full.grads  # as the plan counts them (the parameters' dtype)
        print(f"| {preset} | full (Muon + AdamW) | {n_full / 1e9:.2f}B | {grads_full / GB:,.1f} GB | "
              f"{full.optimizer / GB:,.1f} GB | {(grads_full + full.optimizer) / GB:,.1f} GB |")
        for rank in (int(r) for r in args.ranks.split(",")):
            n, weights = adapter_elements(preset, rank, targets, args.experts)
            grads, opt = n * 4, n * 8
            saved = 1 - (grads + opt) / (grads_full + full.optimizer)
            print(f"| {preset} | LoRA r={rank} on {weights} weight stacks ({args.experts} experts) | "
                  f"{n / 1e6:.1f}M | {grads / GB:.2f} GB | {opt / GB:.2f} GB | {(grads + opt) / GB:.2f} GB "
                  f"({saved:.2%} less) |")
    return 0


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()

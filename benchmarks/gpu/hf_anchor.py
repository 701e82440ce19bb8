"""HF transformers' training step on the benchmark's config and tokens: the anchor the HF-equivalent row is measured
against in the same call (benchmarks/gpu/step.py runs this file as a subprocess BEFORE JAX starts on the device:
JAX pre-allocates most of the GPU's memory and keeps it until its process exits).

    python benchmarks/gpu/hf_anchor.py --config hf_config.json --tokens tokens.npy --out hf.json [--steps 8]

`Glm4MoeForCausalLM` built from the project's `to_hf_config` (the JSON), random init (seed 0), on CUDA when there is
one (bf16 weights, fused AdamW), else on the CPU (fp32, unfused: bf16 matmuls on a CPU time nothing useful);
sdpa attention, experts through `--experts` (grouped_mm: one grouped GEMM per projection), no activation
checkpointing, no MTP (HF's model has no MTP layer). Step: forward on tokens[:, :-1], token-mean cross-entropy in
fp32 against tokens[:, 1:], backward, clip_grad_norm_(1.0), AdamW (b 0.9/0.95, wd 0.1), zero_grad. The
worker imports neither jax nor glm46_jax (`launch`, which step.py calls, does). Writes one JSON object (`--out`),
also on failure ({"error": ...}).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback


def build(torch, transformers, config: dict, experts: str, device: str, dtype):
    cfg = transformers.Glm4MoeConfig(**config)
    cfg._experts_implementation = experts  # transformers 5.x: "eager" (a loop over experts) | "grouped_mm" | ...
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Glm4MoeForCausalLM(cfg).to(dtype).train()
    return model


def run(args) -> dict:
    import numpy as np
    import torch
    import transformers

    cuda = torch.cuda.is_available() and not args.cpu
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    with open(args.config) as f:
        config = json.load(f)
    tokens = torch.from_numpy(np.load(args.tokens)).long().to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model = build(torch, transformers, config, args.experts, device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=cuda)

    def step() -> float:
        logits = model(input_ids=inputs, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return loss.item()

    t0 = time.perf_counter()
    loss = step()  # first step: kernels' autotuning and allocation, not timed with the rest
    first = time.perf_counter() - t0
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    rows, seq = inputs.shape
    return {
        "torch": torch.__version__, "transformers": transformers.__version__, "device": device,
        "device_name": torch.cuda.get_device_name(0) if cuda else "cpu", "dtype": str(dtype).replace("torch.", ""),
        "experts_implementation": getattr(model.config, "_experts_implementation", "?"),
        "attn_implementation": getattr(model.config, "_attn_implementation", "?"),
        "fused_adamw": cuda, "params": sum(p.numel() for p in model.parameters()),
        "batch": rows, "seq_len": seq, "first_step_s": first, "step_s_median": step_s, "times": times,
        "tokens_per_s": rows * seq / step_s, "loss": loss,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="JSON: glm46_jax.config.to_hf_config(model)")
    p.add_argument("--tokens", required=True, help=".npy int32 [rows, seq_len + 1]")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--experts", default="grouped_mm")
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args(argv)
    try:
        result = run(args)
    except ImportError as err:
        result = {"skipped": f"torch/transformers not importable here ({err})"}
    except Exception as err:  # noqa: BLE001 - the benchmark reports it and carries on
        traceback.print_exc()
        result = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:500]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "times"}), flush=True)
    return 0


# --- the launcher (runs in the benchmark's process; glm46_jax imported here only, never by the worker) ----------


def launch(out_dir: str, python: str, steps: int, platform: str, cfg, timeout_s: float) -> dict:
    """HF transformers on `cfg` (the HF-equivalent RunConfig) and the exact tokens of its first phase
    (bench.random_tokens, which the HF-equivalent row trains on), this file run by `python` as a subprocess;
    the result with its model FLOPs counted as ours are (counting.flops_per_token, no MTP layer)."""
    import numpy as np

    from glm46_jax.bench import random_tokens
    from glm46_jax.config import to_hf_config
    from glm46_jax.model.counting import flops_per_token

    work = os.path.join(out_dir, "hf")
    os.makedirs(work, exist_ok=True)
    phase = cfg.data.curriculum.phases[0]
    tokens = os.path.join(work, "tokens.npy")
    np.save(tokens, random_tokens(phase.global_batch, phase.seq_len, cfg.model.vocab_size, cfg.train.seed))
    with open(os.path.join(work, "config.json"), "w") as f:
        json.dump(to_hf_config(cfg.model), f)
    cmd = [python, os.path.abspath(__file__), "--config", os.path.join(work, "config.json"), "--tokens", tokens,
           "--out", os.path.join(work, "hf.json"), "--steps", str(steps)] + (["--cpu"] if platform != "gpu" else [])
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        sys.stdout.write(proc.stdout[-2000:] + proc.stderr[-2000:])
    finally:
        os.remove(tokens)  # 1 MiB at 8 x 4096 that the device tool need not bring back
    with open(os.path.join(work, "hf.json")) as f:
        out = json.load(f)
    if "tokens_per_s" in out:
        out["model_flops_per_token"] = flops_per_token(cfg.model.replace(num_nextn_predict_layers=0), phase.seq_len)
        out["achieved_tflops"] = out["model_flops_per_token"] * out["tokens_per_s"] / 1e12
    return out


if __name__ == "__main__":
    sys.exit(main())

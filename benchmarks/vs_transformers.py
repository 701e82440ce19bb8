"""glm46_jax vs Hugging Face transformers' `Glm4MoeForCausalLM`: one training step's tokens/s on this CPU.

    .venv/bin/python benchmarks/vs_transformers.py [--rounds 3 --steps 5 --warmup 2]
    .venv/bin/python benchmarks/vs_transformers.py --variants muon,adamw,cf1.25

The issue-16 anchor model (`ANCHOR`: hidden 256, 4 layers = 1 dense + 3 MoE, 8 q / 2 kv heads x 32, 16 experts
top-4 + 1 shared, expert width 128, dense width 768, vocab 8192, no MTP), fp32, batch 8 x 256, trained by

  * HF transformers (torch CPU, eager mode) in the fixtures' Python 3.11 venv (`--hf-python`, default
    .venv-hf/bin/python), started once as a subprocess of this script and driven over stdin, so its model and
    optimizer stay warm between rounds. Step: forward, token-mean cross-entropy on the logits, backward,
    clip_grad_norm_(1.0), `torch.optim.AdamW` (the HF trainer's default optimizer), zero_grad. Its router has no
    aux loss and no bias update; experts and attention run through whatever transformers picks by default
    (the report names them).
  * glm46_jax's real train step (`glm46_jax.bench.bench`, i.e. `pretrain.Pretraining.build` + `train_step`):
    configs/pretrain.py's tiny preset with the model fields overridden to `ANCHOR`, loss.mtp off,
    moe_capacity_factor 0 (dropless), one CPU device. Variants: "muon" = the default optimizer (Muon on the hidden matrices + AdamW on embedding,
    lm_head, router, norms and biases), "adamw" = optim.algorithm "adamw" (AdamW on every leaf, HF's side's
    optimizer), "cf1.25" = Muon with capacity factor 1.25 (drops tokens; not the goal's row). The glm46_jax step also
    does the sequence aux loss (1e-4) and loss-free balancing, which HF's does not: <1% of the FLOPs.

Both run in this process tree one after the other, never at the same time, on the same cores: all of the host's, or
the first `--cores N` (CPU affinity set before either starts; torch gets that many threads, XLA:CPU sizes its pool
from the affinity). Each round times every system in turn
(HF first), so background load on a shared machine hits all of them; a ratio is taken within a round and the
median over rounds is reported. glm46_jax recompiles in every round (bench() builds the step anew); compile time
is not in the step time. Prints a table, markdown rows to paste into benchmarks/RESULTS.md, and one JSON line.
The goal (issue 16): glm46_jax dropless >= 1.5x HF's tokens/s.

This file also is the HF worker (`--hf-worker`, run by the HF venv's Python): it imports neither jax nor glm46_jax.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, SEQ = 8, 256
# HF Glm4MoeConfig field names; glm46_jax's ModelConfig uses the same names.
ANCHOR = {
    "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 128,
    "num_hidden_layers": 4, "first_k_dense_replace": 1, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 32, "partial_rotary_factor": 0.5, "rope_theta": 10_000.0, "rms_norm_eps": 1e-5, "attention_bias": True,
    "use_qk_norm": True, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0,
    "max_position_embeddings": 2048, "tie_word_embeddings": False, "hidden_act": "silu", "initializer_range": 0.02}
# HF's AdamW with the hyper-parameters glm46_jax's OptimConfig uses (b2 0.95, wd 0.1, clip 1.0); a fixed lr.
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0
VARIANTS = {  # name -> (label, optim overrides, model overrides)
    "muon": ("glm46_jax, Muon + AdamW (default), dropless", {}, {"moe_capacity_factor": 0.0}),
    "adamw": ("glm46_jax, AdamW, dropless", {"algorithm": "adamw"}, {"moe_capacity_factor": 0.0}),
    "cf1.25": ("glm46_jax, Muon + AdamW, capacity factor 1.25", {}, {"moe_capacity_factor": 1.25}),
    # The tiny preset's runtime settings off, one at a time (the preset: blockwise attention, layer stacks
    # unrolled, 4 dropless blocks per loop step).
    "xla": ("glm46_jax, Muon + AdamW, dropless, xla attention", {},
            {"moe_capacity_factor": 0.0, "attention_impl": "xla"}),
    "scan": ("glm46_jax, Muon + AdamW, dropless, layer scan not unrolled", {},
             {"moe_capacity_factor": 0.0, "scan_unroll": 1}),
    "group1": ("glm46_jax, Muon + AdamW, dropless, one block per loop step", {},
               {"moe_capacity_factor": 0.0, "moe_block_group": 1}),
}


# --- the HF side (runs in the Python 3.11 venv: torch + transformers, no jax) ----------------------

def hf_worker() -> None:
    """Build the HF model once, then answer stdin lines "<warmup> <steps>" with one JSON line of step times."""
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**ANCHOR, dtype="float32")).train()
    cfg = model.config
    hf_keys = ("partial_rotary_factor", "rope_theta")
    for key, value in ANCHOR.items():  # the config really is the anchor's (rope fields live in rope_parameters)
        got = cfg.rope_parameters[key] if key in hf_keys else getattr(cfg, key)
        assert got == value, f"HF config {key}={got!r}, expected {value!r}"
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, ANCHOR["vocab_size"], (BATCH, SEQ + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        logits = model(input_ids=inputs, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    print(json.dumps({
        "ready": True, "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "python": platform.python_version(), "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "experts_implementation": getattr(cfg, "_experts_implementation", "?"),
        "attn_implementation": getattr(cfg, "_attn_implementation", "?"),
        "params": sum(p.numel() for p in model.parameters())}), flush=True)
    for line in sys.stdin:
        warmup, steps = (int(v) for v in line.split())
        for _ in range(warmup):
            step()
        times, loss = [], float("nan")
        cpu0 = time.process_time()
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - t0)
        print(json.dumps({"times": times, "cpu_s": time.process_time() - cpu0, "loss": loss}), flush=True)


class HFProcess:
    """The HF worker as a subprocess that keeps its model between rounds."""

    def __init__(self, python: str):
        if not os.path.exists(python):
            sys.exit(f"error: --hf-python {python} does not exist; point it at a Python with torch 2.x and "
                     "transformers >= 5 (the fixtures' venv, see tests/fixtures/make_hf_fixtures.py)")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--hf-worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"error: the HF worker exited with status {self.proc.wait()} (its stderr is above)")
        return json.loads(line)

    def run(self, warmup: int, steps: int) -> dict:
        self.proc.stdin.write(f"{warmup} {steps}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# --- the glm46_jax side ------------------------------------------------------------------------------

def jax_config(variant: str):
    """configs/pretrain.py:tiny with the anchor's shapes, one phase of BATCH x SEQ, MTP off, `variant`'s optimizer."""
    from glm46_jax import run_config

    _, optim, model = VARIANTS[variant]
    c = run_config.config_file(os.path.join(ROOT, "configs", "pretrain.py"), "tiny")
    c.model.update({**ANCHOR, **model, "dtype": "float32", "param_dtype": "float32", "remat": "none"})
    c.loss.mtp = False
    c.optim.update(optim)
    c.mesh = {"data": 1, "tensor": 1, "expert": 1, "pipeline": 1}
    c.data.phases.general.update(seq_len=SEQ, global_batch=BATCH, rope_theta=ANCHOR["rope_theta"])
    c.data.phases.code_long.update(seq_len=SEQ, global_batch=BATCH)
    return run_config.from_config_dict(c)


def jax_run(variant: str, warmup: int, steps: int) -> dict:
    import jax

    from glm46_jax.bench import bench

    cpu0 = time.process_time()
    r = bench(jax_config(variant), steps=steps, warmup=warmup, devices=jax.devices()[:1])
    r["cpu_s_total"] = time.process_time() - cpu0  # compile and warm-up included
    return r


# --- the comparison ------------------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds; each times every system once, in turn")
    p.add_argument("--steps", type=int, default=5, help="timed steps per system per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per system per round (after compile)")
    p.add_argument("--variants", default="muon,adamw", help=f"glm46_jax variants, from {sorted(VARIANTS)}")
    p.add_argument("--cores", type=int, default=0,
                   help="pin both systems to the first N cores (0 = all); 1 avoids torch's OpenMP threads spinning "
                        "against other tenants' jobs on a shared machine")
    p.add_argument("--hf-python", default=os.path.join(ROOT, ".venv-hf", "bin", "python"))
    p.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.hf_worker:
        return hf_worker()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants or args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        sys.exit(f"error: --variants must name some of {sorted(VARIANTS)} (got {bad or args.variants!r}); "
                 "--rounds and --steps >= 1, --warmup >= 0")

    if args.cores:  # before jax or the HF worker start: XLA's thread pool and torch size themselves from it
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.cores])
    cores = len(os.sched_getaffinity(0))
    from glm46_jax import host

    host_settings = host.configure_cpu()  # glm46_jax's CPU start-up, as its CLIs do (the HF worker gets none of it)

    import jax

    from glm46_jax.bench import git_commit

    tokens = BATCH * SEQ
    load_before = os.getloadavg()
    hf = HFProcess(args.hf_python)
    hf_rounds, jax_rounds = [], {v: [] for v in variants}
    try:
        for i in range(args.rounds):
            # HF's first round gets extra warm-up: torch's allocator and kernels settle over the first steps.
            h = hf.run(args.warmup + (3 if i == 0 else 0), args.steps)
            hf_rounds.append(h)
            print(f"round {i + 1}: HF {tokens / statistics.median(h['times']):,.0f} tok/s", end="", flush=True)
            for v in variants:
                r = jax_run(v, args.warmup, args.steps)
                jax_rounds[v].append(r)
                print(f", {v} {r['tokens_per_s']:,.0f} tok/s (compile {r['compile_s']:.0f} s)", end="", flush=True)
            print(f"; load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        hf.close()
    load_after = os.getloadavg()

    hf_tps = [tokens / statistics.median(h["times"]) for h in hf_rounds]
    rows = [{"system": f"HF transformers {hf.info['transformers']} Glm4MoeForCausalLM (torch {hf.info['torch']} "
                       f"CPU, AdamW; experts {hf.info['experts_implementation']}, attention "
                       f"{hf.info['attn_implementation']}), dropless",
             "key": "hf", "tokens_per_s": statistics.median(hf_tps), "per_round": hf_tps,
             "step_ms": 1e3 * statistics.median(t for h in hf_rounds for t in h["times"]), "ratio": 1.0,
             "loss": hf_rounds[-1]["loss"]}]
    for v in variants:
        tps = [r["tokens_per_s"] for r in jax_rounds[v]]
        rows.append({"system": VARIANTS[v][0], "key": v, "tokens_per_s": statistics.median(tps), "per_round": tps,
                     "step_ms": 1e3 * statistics.median(r["step_s_median"] for r in jax_rounds[v]),
                     "ratio": statistics.median(t / h for t, h in zip(tps, hf_tps)),
                     "compile_s": statistics.median(r["compile_s"] for r in jax_rounds[v]),
                     "loss": jax_rounds[v][-1]["final_loss"]})

    dev = jax.devices()[0]
    facts = {"date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
             "host": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), "cores_used": cores,
             "jax": jax.__version__, "jax_device": str(dev.device_kind),
             "hf_threads": hf.info["threads"], "load_avg_before": load_before, "load_avg_after": load_after,
             "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "tokens_per_step": tokens,
             "hf_params": hf.info["params"], "glm46_jax_host_settings": host_settings}
    width = max(len(r["system"]) for r in rows)
    print(f"\nanchor: {BATCH} x {SEQ} tokens/step, fp32; {args.rounds} rounds x {args.steps} steps; "
          f"load avg {load_before[0]:.1f} -> {load_after[0]:.1f} on {os.cpu_count()} cores, {cores} used")
    print(f"{'system':<{width}}  {'tokens/s':>9}  {'step ms':>8}  {'vs HF':>6}  per round")
    for r in rows:
        print(f"{r['system']:<{width}}  {r['tokens_per_s']:>9,.0f}  {r['step_ms']:>8.1f}  {r['ratio']:>5.2f}x  "
              + " ".join(f"{t:,.0f}" for t in r["per_round"]))
    print("\nmarkdown:\n")
    print(f"Device: {os.cpu_count()}-core {facts['host']} CPU ({cores} used by each system), shared (load average "
          f"{load_before[0]:.1f} -> {load_after[0]:.1f}); commit {facts['commit']}; jax {facts['jax']}; command "
          f"`.venv/bin/python benchmarks/vs_transformers.py --rounds {args.rounds} --steps {args.steps} "
          f"--warmup {args.warmup} --variants {','.join(variants)} --cores {args.cores}`. Median over rounds; "
          "`vs HF` is the median of per-round ratios. glm46_jax's CPU host settings (`glm46_jax.host`): "
          f"{'; '.join(host_settings) or 'none'}.\n")
    print("| system | tokens/s | step (ms) | vs HF | tokens/s per round |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['system']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.0f} | {r['ratio']:.2f}x | "
              + ", ".join(f"{t:,.0f}" for t in r["per_round"]) + " |")
    print()
    print(json.dumps({"facts": facts, "rows": rows}))


if __name__ == "__main__":
    main()

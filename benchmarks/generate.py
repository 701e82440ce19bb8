"""Generation speed: prefill and decode tokens/s, plain vs MTP speculative decoding, one sequence and a batch.

    PYTHONPATH=. python benchmarks/generate.py --checkpoint runs/tiny --corpus data/sample   # after `make train`
    PYTHONPATH=. python benchmarks/generate.py --preset tiny                                 # random weights
    PYTHONPATH=. python benchmarks/generate.py --checkpoint runs/tiny --corpus data/sample --out   # + RESULTS.md

Prompts are the first `--prompt-len` tokens of held-out documents of `--corpus` (code and prose in turn),
so a trained model's MTP layer drafts on text like its training data; without a corpus they are random ids.
Each configuration runs greedily for `--new-tokens` tokens (no stop token, so every row makes them all):
prefill and decode are jitted separately, compiled by a first call, then timed over `--repeats` calls
(median). Decode tokens/s counts new tokens after the first (which prefill makes) over the decode time.

Tokens per forward = new tokens per row / main-model passes (prefill included): exactly 1 for plain
decoding, 1 + acceptance rate (less the end effects) for speculation. It is what speculation buys on
hardware where a 2-token verify pass costs about what a 1-token pass does (a memory-bound GPU decode); on
this CPU the wall-clock ratio also pays for the MTP layer's own pass and the second token's FLOPs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from glm46_jax.infer import generate as gen
from glm46_jax.infer import speculative as spec
from glm46_jax.parallel import sharding
from glm46_jax.bench import git_commit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")


def _model(args, mesh):
    if args.checkpoint:
        from glm46_jax.training.checkpoint import load_params
        cfg, graphdef, params, buffers = load_params(args.checkpoint, mesh, dtype=args.dtype)
    else:
        from glm46_jax.config import get_preset
        from glm46_jax.model import init_model
        cfg = get_preset(args.preset).replace(dtype=args.dtype)
        graphdef, params, buffers = init_model(cfg, mesh, seed=0)
    if cfg.moe_capacity_factor > 0:  # generation is dropless (rows must not crowd each other out)
        from glm46_jax.model import abstract_model
        cfg = cfg.replace(moe_capacity_factor=0.0)
        graphdef, _, _ = abstract_model(cfg, mesh)
    return cfg, graphdef, params, buffers


def _prompts(args, cfg, n):
    if not args.corpus:
        rng = np.random.default_rng(0)
        return [list(map(int, rng.integers(2, cfg.vocab_size, args.prompt_len))) for _ in range(n)]
    from glm46_jax.data import loader
    from glm46_jax.infer.eval import heldout_batches
    rows = []
    domains = [d for d in loader.known_domains(args.corpus) if loader.has_split(args.corpus, d, "heldout")]
    streams = [heldout_batches(args.corpus, d, args.prompt_len, 8) for d in domains]
    while len(rows) < n:
        for stream in streams:  # documents from each domain in turn, only rows that fill the prompt length
            for inputs, seg in zip((b := next(stream))["inputs"], b["segment_ids"]):
                if np.all(seg == seg[0]) and seg[0] > 0:
                    rows.append(list(map(int, inputs)))
    return rows[:n]


def _time(fn, repeats):
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run(model, prompts, new_tokens, repeats, speculative):
    graphdef, params, buffers = model
    tokens, start = (jnp.asarray(a) for a in gen.pad_batch(prompts, 0))
    need = gen.check_request(prompts, new_tokens, None, 0.0, 0, 1.0, extra_slots=int(speculative))
    kw = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    key, stop, pad = jax.random.key(0), jnp.asarray([-1], jnp.int32), jnp.int32(0)
    if speculative:
        pre = lambda: spec._prefill(graphdef, params, buffers, tokens, start, key, max_len=need, **kw)  # noqa: E731
        t_pre, state = _time(pre, repeats)
        dec = lambda: spec._decode(graphdef, params, buffers, pre()[4], *state[:4], start, key, stop, pad,  # noqa: E731
                                   max_new_tokens=new_tokens, **kw)
    else:
        pre = lambda: gen._prefill(graphdef, params, buffers, tokens, start, max_len=need)  # noqa: E731
        t_pre, state = _time(pre, repeats)
        dec = lambda: gen._decode(graphdef, params, buffers, pre()[1], state[0], start, key, stop, pad,  # noqa: E731
                                  max_new_tokens=new_tokens, **kw)
    # Each decode call needs a fresh (donated) cache: time prefill + decode and subtract the prefill.
    t_both, out = _time(dec, repeats)
    t_dec = max(t_both - t_pre, 1e-9)
    b = len(prompts)
    result = {"prefill_tok_s": b * tokens.shape[1] / t_pre, "decode_tok_s": b * (new_tokens - 1) / t_dec,
              "decode_ms_per_token": 1e3 * t_dec / (new_tokens - 1), "tokens": np.asarray(out[0].tokens)}
    if speculative:
        g, stats = out[0], out[1]
        result["acceptance"] = stats.acceptance_rate
        result["tokens_per_forward"] = spec.tokens_per_forward(g, stats)
    else:
        result["acceptance"], result["tokens_per_forward"] = None, 1.0
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="a training run (e.g. runs/tiny after make train)")
    src.add_argument("--preset", default="tiny", help="random weights of this model preset (default tiny)")
    p.add_argument("--corpus", help="prompts from this corpus's held-out documents (e.g. data/sample)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = p.parse_args(argv)

    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    cfg, graphdef, params, buffers = _model(args, mesh)
    rows = []
    with sharding.use_mesh(mesh):
        for b in (int(x) for x in args.batches.split(",")):
            prompts = _prompts(args, cfg, b)
            plain = run((graphdef, params, buffers), prompts, args.new_tokens, args.repeats, False)
            fast = run((graphdef, params, buffers), prompts, args.new_tokens, args.repeats, True)
            same = bool(np.array_equal(plain.pop("tokens"), fast.pop("tokens")))
            for name, r in (("plain", plain), ("MTP speculative", fast)):
                rows.append({"batch": b, "decoding": name, **r, "same_tokens_as_plain": same})
            rows[-1]["speedup_decode"] = fast["decode_tok_s"] / plain["decode_tok_s"]

    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()}, {os.cpu_count()} CPUs)"
    model = args.checkpoint or f"{args.preset} (random init)"
    head = ("| batch | decoding | prefill tok/s | decode tok/s | ms / token | tokens per forward | acceptance | "
            "same tokens |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.1%}"
        lines.append(f"| {r['batch']} | {r['decoding']} | {r['prefill_tok_s']:,.0f} | {r['decode_tok_s']:,.1f} | "
                     f"{r['decode_ms_per_token']:.1f} | {r['tokens_per_forward']:.2f} | {acc} | "
                     f"{'yes' if r['same_tokens_as_plain'] else 'NO'} |")
    table = "\n".join(lines)
    print(f"model {model}, dtype {args.dtype}, prompt {args.prompt_len} + {args.new_tokens} new tokens, greedy; "
          f"device {device}")
    print(table)
    print(json.dumps({"model": model, "rows": rows}, default=float))
    if args.out:
        cmd = "PYTHONPATH=. python benchmarks/generate.py " + shlex.join(argv if argv is not None else sys.argv[1:])
        with open(RESULTS, "a") as f:
            f.write(f"\n### Generation, {datetime.date.today()}: {model}\n\nDevice: {device}, {platform.machine()}; "
                    f"commit {git_commit()}; command `{cmd}`. Prompt {args.prompt_len} tokens + {args.new_tokens} "
                    f"greedy new tokens, {args.dtype}, median of {args.repeats}.\n\n{table}\n")
    return rows


if __name__ == "__main__":
    main()

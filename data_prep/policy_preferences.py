"""`python -m data_prep policy-preferences`: preference pairs from the policy itself. Samples `--samples` completions of
each prompt from a checkpoint with the RL recipes' sampler, asks a labeller which of two different completions is
better (a checker such as exact_answer, a file of human labels, or a function: glm46_jax/recipes/rl/labellers.py),
and writes the labelled pairs as `preferences` input, which the command then tokenizes like any pair file
(docs/preferences.md#on-policy-pairs).

    python -m data_prep policy-preferences --checkpoint runs/sft_rl_addition \
        --prompts data/rl_addition/prompts_train.jsonl --labeller exact_answer --out runs/rlhf_tiny/round1/pairs
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from glm46_jax import atomic
from glm46_jax.errors import InputError
from glm46_jax.infer.load import add_model_args


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("policy samples")
    add_model_args(g)
    g.add_argument("--prompts", required=True, metavar="FILE.jsonl",
                   help='RL prompts: {"prompt", "answer" | "tests", ...} per line (docs/rl.md#prompt-files)')
    g.add_argument("--labeller", default="exact_answer",
                   help="exact_answer | code_tests | ... | reward:module:fn | file:labels.jsonl | module:function")
    g.add_argument("--max-prompts", type=int, default=0, help="use the first N prompts (0 = all)")
    g.add_argument("--samples", type=int, default=8, help="completions sampled per prompt")
    g.add_argument("--pairs-per-prompt", type=int, default=2, help="most labelled pairs kept per prompt")
    g.add_argument("--max-prompt-len", type=int, default=32, help="prompt tokens (longer prompts are an error)")
    g.add_argument("--max-new-tokens", type=int, default=8, help="completion tokens; a cut completion is left out")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--batch-prompts", type=int, default=256, help="prompts per sampling call")
    g.add_argument("--raw", action="store_true", help="prompts as raw text, not a user turn of the chat format")


def write_pairs(args: argparse.Namespace, pairs_file: str) -> str:
    """Samples, labels and writes the pairs to `pairs_file`; returns the tokenizer.json the policy came with."""
    import jax
    from tokenizers import Tokenizer

    from glm46_jax.infer.load import load_model
    from glm46_jax.interop import chat
    from glm46_jax.parallel import sharding
    from glm46_jax.recipes.rl import labellers, policy_pairs
    from glm46_jax.recipes.rl.config import RLConfig
    from glm46_jax.recipes.rl.prompts import encode_prompts, read_prompts
    from glm46_jax.recipes.rl.rollout import Sampling

    for name in ("samples", "pairs_per_prompt", "max_prompt_len", "max_new_tokens", "batch_prompts"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.samples < 2:
        raise InputError(f"--samples {args.samples}: a pair needs >= 2 completions per prompt")
    if args.temperature <= 0:
        raise InputError(f"--temperature {args.temperature}: must be > 0 (greedy samples are all the same)")
    labeller = labellers.resolve(args.labeller)
    items = read_prompts(args.prompts)[:args.max_prompts or None]
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    cfg, graphdef, params, buffers, tok_path = load_model(mesh, hf_dir=args.hf_dir, checkpoint=args.checkpoint,
                                                          dtype=args.dtype, tokenizer=args.tokenizer)
    if cfg.moe_capacity_factor > 0:  # the RL sampler's rows must not crowd each other out of experts
        from glm46_jax.model import abstract_model
        graphdef, _, _ = abstract_model(cfg.replace(moe_capacity_factor=0.0), mesh)
    if not os.path.isfile(tok_path):
        raise InputError(f"{tok_path}: no tokenizer.json with the policy; pass --tokenizer (the one it trained with)")
    tok = Tokenizer.from_file(tok_path)
    rl = RLConfig(chat=not args.raw, max_prompt_len=args.max_prompt_len)
    prompt_ids = encode_prompts(tok, items, rl, args.prompts)
    stop = tuple(chat.stop_token_ids(tok)) if rl.chat else tuple(cfg.eos_token_id or ())
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop_tokens=stop,
                        pad_id=cfg.pad_token_id or 0, prompt_len=args.max_prompt_len)
    lines, found = policy_pairs.sample_pairs(graphdef, params, buffers, mesh, tok, items, prompt_ids, labeller,
                                             group_size=args.samples, per_prompt=args.pairs_per_prompt,
                                             sampling=sampling, batch_prompts=args.batch_prompts, seed=args.seed,
                                             chat=rl.chat)
    counts = {"prompts": len(items), "samples": len(items) * args.samples, "pairs": len(lines),
              "asked": found.asked, "no_preference": found.no_preference, "unfinished": found.unfinished,
              "single_text_prompts": found.single, "labeller": args.labeller, "source": args.checkpoint or args.hf_dir}
    print(f"policy-preferences: {counts['samples']} samples of {len(items)} prompts -> {len(lines)} labelled pairs "
          f"({found.asked} asked, {found.no_preference} without a preference; {found.unfinished} completions cut at "
          f"--max-new-tokens left out; {found.single} prompts with one distinct finished completion)", file=sys.stderr)
    if not lines:
        raise InputError(f"--labeller {args.labeller}: no labelled pair from {len(items)} prompts x {args.samples} "
                         "samples (every pair a tie or unlabelled); raise --samples or --temperature")
    atomic.write_text(pairs_file, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    atomic.write_json(os.path.join(os.path.dirname(pairs_file), "sampling.json"), counts)
    return tok_path

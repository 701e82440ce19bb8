"""`python -m data_prep COMMAND ...`: the corpus pipeline on a datatrove executor, the SFT and the preference data.

    pipeline        --input DOMAIN=SPEC ... --out DIR     read, clean, filter, dedup, tokenize, write (resumable)
                    [--executor local|slurm|ray]          where the tasks run (pipeline.py, executors.py)
    sample          [--out data/sample]                   the stdlib corpus (code + prose) through `pipeline`
    sft             --input convs.jsonl ... --tokenizer T --out DIR   chats -> SFT samples + loss masks (sft.py)
    sample-sft      [--out data/sample_sft]               the templated sample chats through `sft`
    preferences     --input pairs.jsonl ... --tokenizer T --out DIR   prompt + chosen / rejected -> two sequences
                                                          per pair, the final reply's loss mask (preferences.py)
    sample-preferences  [--out data/sample_preferences]   generated addition and chat pairs through `preferences`
    policy-preferences  --checkpoint RUN --prompts P --labeller L --out DIR   a policy's own samples, labelled in
                                                          pairs, through `preferences` (policy_preferences.py)
    passkey         --tokenizer T --out DIR               synthetic passkey retrieval cases over a (length, depth)
                                                          grid, for `glm46_jax.eval --passkey` (passkey.py)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from datatrove.io import get_datafolder
from tokenizers import Tokenizer

from data_prep import (executors, passkey, pipeline, policy_preferences, preferences, report, sample, sample_chats,
                       sample_preferences, sft)
from data_prep.executors import EXECUTORS
from data_prep.inputs import ReaderOptions, parse_input
from data_prep.minhash import MinHashConfig
from data_prep.quality import parse_rule_override
from data_prep.tokenizer import EOS_TOKEN
from data_prep.tokenizer import load as load_tokenizer
from glm46_jax import atomic, cli
from glm46_jax.errors import InputError
from glm46_jax.interop import chat

# A mistake in what the user gave; anything else is a bug and keeps its traceback. Path errors count:
# the user named the path.
USER_ERRORS = (ValueError, ImportError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


# --- argument groups ----------------------------------------------------------------------------------

def _input_arg(arg: str) -> tuple[str, str]:
    try:
        return parse_input(arg)
    except ValueError as err:  # ArgumentTypeError keeps our message (argparse replaces a ValueError's)
        raise argparse.ArgumentTypeError(str(err)) from err


def _add_inputs(p: Parser) -> None:
    g = p.add_argument_group("inputs")
    g.add_argument("--input", action="append", required=True, type=_input_arg, metavar="DOMAIN=SPEC",
                   help="SPEC: a file, directory, glob (** allowed) or tfds:NAME[@SPLIT]; repeat for more inputs")
    g.add_argument("--text-field", default="text", help="JSONL key / TFDS feature holding the text (default: text)")
    g.add_argument("--parquet-column", default=None, help="Parquet column holding the text (default: --text-field)")
    g.add_argument("--text-lines", action="store_true", help="plain-text files hold one document per line")
    g.add_argument("--tfds-data-dir", default=None, help="data_dir for tfds:NAME inputs")
    g.add_argument("--max-reports", type=int, default=1000, help="malformed-input reports kept in metadata")


def _add_filter(p: Parser) -> None:
    g = p.add_argument_group("quality filter")
    g.add_argument("--rules", default=None, metavar="FILE.json",
                   help='per-domain rules, e.g. {"web": {"preset": "prose", "min_chars": 200}}')
    g.add_argument("--rule", action="append", default=[], metavar="DOMAIN.RULE=VALUE",
                   help="one override (a JSON value; null disables the rule), e.g. code.max_chars=null")


def _add_dedup(p: Parser) -> None:
    g = p.add_argument_group("deduplication")
    g.add_argument("--threshold", type=float, default=0.85, help="near-duplicate Jaccard threshold")
    g.add_argument("--num-perm", type=int, default=128, help="MinHash permutations")
    g.add_argument("--shingle", choices=("word", "char"), default="word")
    g.add_argument("--ngram", type=int, default=5, help="words (or characters) per shingle")
    g.add_argument("--minhash-seed", type=int, default=0)


def _add_vocab(p: Parser) -> None:
    p.add_argument("--vocab-size", type=int, default=512, help="vocabulary of the trained byte-level BPE")


def _add_tokenizer(p: Parser) -> None:
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer", default=None, metavar="tokenizer.json",
                   help="use this tokenizer instead of training a byte-level BPE")
    g.add_argument("--eos-token", default=EOS_TOKEN, help="end-of-document token of --tokenizer")
    _add_vocab(g)
    g.add_argument("--tokenizer-sample-mb", type=float, default=1024.0,
                   help="the BPE is trained on about this much of the deduplicated train split (hash-sampled)")


def _add_executor(p: Parser) -> None:
    g = p.add_argument_group("executor (data_prep/README.md#executors)")
    g.add_argument("--executor", choices=EXECUTORS, default="local", help="where the tasks run (default: local)")
    g.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="local: worker processes; ray: concurrent tasks (never changes the output)")
    g.add_argument("--tasks", type=int, default=None,
                   help="tasks of the prepare/tokenize stages, each a byte slice of the inputs laid end to end (a big "
                        "file spreads over several); default: one per input file or per 256 MB, at most 1000")
    g.add_argument("--write-tasks", type=int, default=None, help="tasks writing shards (default: --tasks)")
    g.add_argument("--work", default=None, help="intermediate files (default: OUT/_work); local path or URL")
    g.add_argument("--partition", default="cpu", help="slurm: partition")
    g.add_argument("--time", default="04:00:00", help="slurm: time limit per task")
    g.add_argument("--cpus-per-task", type=int, default=1, help="slurm/ray: CPUs per task")
    g.add_argument("--mem-per-cpu-gb", type=float, default=2.0, help="slurm/ray: memory per CPU")
    g.add_argument("--slurm-logs", default=None, help="slurm: log folder (default: WORK/slurm_logs)")
    g.add_argument("--wait", action="store_true", help="slurm: return when the last job ended, not when queued")


def _add_heldout(p: Parser) -> None:
    p.add_argument("--heldout-fraction", type=float, default=0.01,
                   help="fraction of documents (chosen by content hash) in the heldout split; never trained on")


def _add_write(p: Parser) -> None:
    g = p.add_argument_group("shards")
    _add_heldout(g)
    g.add_argument("--shard-size-mb", type=float, default=64.0, help="UTF-8 text per shard")
    g.add_argument("--writer-options", default="group_size:1", help="ArrayRecordWriter options")


def _add_sample(p: Parser) -> None:
    p.add_argument("--max-docs-per-domain", type=int, default=3000, help="cap on each domain's documents")
    p.add_argument("--max-reports", type=int, default=1000, help="malformed-input reports kept in metadata")


def _add_sft(p: Parser, sample: bool) -> None:
    g = p.add_argument_group("sft")
    if not sample:
        g.add_argument("--input", action="append", required=True, metavar="FILE.jsonl",
                       help='one conversation per line: {"messages": [...], "tools": [...], "enable_thinking": bool}')
    g.add_argument("--tokenizer", required=not sample, default="data/sample/tokenizer.json" if sample else None,
                   metavar="tokenizer.json", help="a tokenizer with GLM's chat tokens (the model's own)")
    g.add_argument("--eos-token", default=EOS_TOKEN, help="end-of-text token of --tokenizer")
    g.add_argument("--heldout-fraction", type=float, default=0.1,
                   help="fraction of conversations (chosen by content hash) in the heldout split")
    g.add_argument("--max-len", type=int, default=512 if sample else 2048, help="most tokens in one sample")
    g.add_argument("--truncate", choices=sft.TRUNCATE_MODES, default="rounds",
                   help="a sample over --max-len: rounds = drop its earliest whole rounds (system and tools "
                        "kept), drop = drop the sample (docs/sft.md#truncation)")
    g.add_argument("--max-reports", type=int, default=1000, help="skipped-line/truncation reports kept in metadata")
    if sample:
        g.add_argument("--conversations", type=int, default=400, help="how many sample chats to generate")
        g.add_argument("--seed", type=int, default=0, help="generator seed")


def _add_preferences(p: Parser, sample: bool, policy: bool = False) -> None:
    g = p.add_argument_group("preferences")
    if policy:
        g.add_argument("--tokenizer", metavar="tokenizer.json", help="default: the one the policy came with")
    elif not sample:
        g.add_argument("--input", action="append", required=True, metavar="FILE.jsonl",
                       help='one pair per line: {"messages" | "prompt": ..., "chosen": ..., "rejected": ..., '
                            '"margin": float} (docs/preferences.md#input)')
    if not policy:
        g.add_argument("--tokenizer", required=not sample, default="data/sample/tokenizer.json" if sample else None,
                       metavar="tokenizer.json", help="a tokenizer with GLM's chat tokens (the model's own)")
    g.add_argument("--eos-token", default=EOS_TOKEN, help="end-of-text token of --tokenizer")
    g.add_argument("--heldout-fraction", type=float, default=0.1,
                   help="fraction of prompts (chosen by content hash) whose pairs go to the heldout split")
    g.add_argument("--max-len", type=int, default=1024 if sample else 4096,
                   help="most tokens in one pair (chosen + rejected, the prompt in each); longer pairs are skipped")
    g.add_argument("--max-reports", type=int, default=1000, help="skipped-line reports kept in metadata")
    if sample or policy:
        g.add_argument("--seed", type=int, default=0, help="generator seed")
    if sample:
        g.add_argument("--kinds", default=",".join(sample_preferences.KINDS),
                       help=f"comma-separated pair kinds: {', '.join(sample_preferences.KINDS)}")
        g.add_argument("--pairs", type=int, default=400, help="how many pairs to generate (split evenly by kind)")


def build_parser() -> Parser:
    parser = cli.ArgumentParser(prog="python -m data_prep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, about: str, *groups: Callable[[Parser], None], out: str = "dataset directory to write",
                out_default: str | None = None) -> None:
        p = sub.add_parser(name, help=about, description=about)
        for add_group in groups:
            add_group(p)
        p.add_argument("--out", required=out_default is None, default=out_default, help=out)

    command("pipeline", "read, clean, filter, dedup, tokenize and write, on a datatrove executor", _add_inputs,
            _add_filter, _add_dedup, _add_tokenizer, _add_write, _add_executor, out="dataset directory or URL")
    command("sample", "build the stdlib corpus (code + prose) and run the pipeline on it", _add_sample,
            _add_filter, _add_dedup, _add_tokenizer, _add_write, _add_executor,
            out="dataset directory (default: data/sample)", out_default="data/sample")
    command("sft", "chat conversations (JSONL) -> SFT samples with assistant loss masks",
            lambda p: _add_sft(p, sample=False))
    command("sample-sft", "generate the sample chats and run `sft` on them", lambda p: _add_sft(p, sample=True),
            out="dataset directory (default: data/sample_sft)", out_default="data/sample_sft")
    command("preferences", "preference pairs (JSONL) -> chosen/rejected sequences with final-reply loss masks",
            lambda p: _add_preferences(p, sample=False))
    command("sample-preferences", "generate the sample preference pairs and run `preferences` on them",
            lambda p: _add_preferences(p, sample=True),
            out="dataset directory (default: data/sample_preferences)", out_default="data/sample_preferences")
    command("policy-preferences", "sample a policy on prompts, label pairs of its completions and run `preferences` "
            "on them", policy_preferences.add_args, lambda p: _add_preferences(p, sample=False, policy=True))
    command("passkey", "synthetic passkey retrieval cases (a length x depth grid) for `glm46_jax.eval --passkey`",
            passkey.add_args, out="directory to write cases.jsonl (and train.jsonl) in")
    return parser


# --- configs from arguments ---------------------------------------------------------------------------

def _rules_file(path: str) -> dict[str, dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        try:
            rules = json.load(f)
        except json.JSONDecodeError as err:
            raise InputError(f"--rules {path}: not valid JSON: {err}") from err
    shape = '{"DOMAIN": {"RULE": VALUE, ...}, ...}'
    if not isinstance(rules, dict):
        raise InputError(f"--rules {path}: expected an object {shape}, got a JSON {type(rules).__name__}")
    if bad := sorted(d for d, r in rules.items() if not isinstance(r, dict)):
        raise InputError(f"--rules {path}: domain(s) {bad} map to a non-object; expected {shape}")
    return rules


def _rule_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    overrides = _rules_file(args.rules) if args.rules else {}
    for arg in args.rule:
        domain, rule, value = parse_rule_override(arg)
        overrides.setdefault(domain, {})[rule] = value
    return overrides


def _reader(args: argparse.Namespace) -> ReaderOptions:
    return ReaderOptions(args.text_field, args.parquet_column, args.text_lines, args.tfds_data_dir)


def _minhash(args: argparse.Namespace) -> MinHashConfig:
    return MinHashConfig(args.num_perm, args.threshold, args.shingle, args.ngram, args.minhash_seed)


def _write(args: argparse.Namespace) -> pipeline.WriteOptions:
    return pipeline.WriteOptions(args.heldout_fraction, max(1, int(args.shard_size_mb * 2**20)), args.writer_options)


def _tokenizer(args: argparse.Namespace) -> pipeline.TokenizerOptions:
    return pipeline.TokenizerOptions(args.tokenizer, args.vocab_size, args.eos_token,
                                     max(1, int(args.tokenizer_sample_mb * 2**20)))


def _executor(args: argparse.Namespace) -> pipeline.ExecutorOptions:
    for name in ("workers", "tasks", "write_tasks", "cpus_per_task"):
        if (value := getattr(args, name)) is not None and value < 1:
            raise InputError(f"--{name.replace('_', '-')} {value}: must be >= 1")
    return pipeline.ExecutorOptions(args.executor, args.workers, args.tasks, args.write_tasks, args.partition,
                                    args.time, args.cpus_per_task, args.mem_per_cpu_gb, args.slurm_logs)


def pipeline_config(args: argparse.Namespace, inputs: tuple[tuple[str, str], ...]) -> pipeline.PipelineConfig:
    reader = _reader(args) if hasattr(args, "text_field") else ReaderOptions()
    return pipeline.PipelineConfig(inputs=inputs, out=args.out, reader=reader, rule_overrides=_rule_overrides(args),
                                   minhash=_minhash(args), tokenizer=_tokenizer(args), write=_write(args),
                                   executor=_executor(args), work=args.work, max_reports=args.max_reports)


# --- commands -----------------------------------------------------------------------------------------

def _print_dataset(meta: dict[str, Any], run: dict[str, Any], out: str, seconds: float) -> None:
    print("\n".join(report.summary_lines(meta)))
    skipped = ", ".join(f"{stage} {n}" for stage, n in run["skipped"].items() if n) or "none"
    if run.get("peak_rss"):
        print("peak RSS per stage (largest task): " + ", ".join(f"{stage} {p['max_mb']:.0f} MB"
                                                                for stage, p in run["peak_rss"].items()))
    print(f"-> {out.rstrip('/')}/metadata.json ({seconds:.1f} s; tasks already complete and skipped: {skipped}; "
          f"intermediate files: {run['work']})")
    for line in report.warning_lines(meta):
        print(line, file=sys.stderr)


def check_out(out: str, is_file: bool = False) -> None:
    """Fails before the work, not at the first write after it: `out` must be (or be creatable as) a
    writable directory, or for a file, sit in one. Nothing is created here."""
    if "://" in out:
        return  # an object store: the first write says whether it is writable
    path = os.path.abspath(out)
    if is_file:
        if os.path.isdir(path):
            raise InputError(f"--out {out}: is a directory; name the file to write")
        path = os.path.dirname(path)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InputError(f"--out {out}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"--out {out}: {existing} is not writable")


def _run_sft(args: argparse.Namespace) -> None:
    opts = sft.SFTOptions(args.max_len, args.truncate, args.heldout_fraction, args.max_reports)
    inputs = args.input if args.command == "sft" else [os.path.join(args.out, "_source", "chats.jsonl")]
    if not os.path.isfile(args.tokenizer):
        raise InputError(f"--tokenizer {args.tokenizer}: no such file; pass the model's tokenizer.json (the sample "
                         "corpus's comes from `python -m data_prep sample`, i.e. `make data`)")
    info = load_tokenizer(args.tokenizer, args.eos_token)
    if args.command == "sample-sft":
        atomic.write_text(inputs[0], sample_chats.jsonl(sample_chats.conversations(args.conversations, args.seed)))
    chats, malformed, lines = sft.read_conversations(inputs)
    if not chats:
        first = f"; first: {malformed[0]['message']}" if malformed else ""
        raise InputError(f"no valid conversation in {', '.join(inputs)} ({lines} non-blank line(s)){first}")
    meta = sft.write_sft_dataset(args.out, info, inputs, chats, malformed, lines, opts)
    for line in sft.report_lines(meta, malformed):
        print(line, file=sys.stderr)
    print("\n".join(sft.summary_lines(meta)))
    print(f"-> {os.path.join(args.out, 'metadata.json')}")


def _run_preferences(args: argparse.Namespace) -> None:
    opts = preferences.PreferenceOptions(args.max_len, args.heldout_fraction, args.max_reports)
    sample_run = args.command == "sample-preferences"
    kinds = sample_preferences.parse_kinds(args.kinds) if sample_run else ()
    generated = sample_run or args.command == "policy-preferences"
    inputs = [os.path.join(args.out, "_source", "pairs.jsonl")] if generated else args.input
    if args.command == "policy-preferences":
        args.tokenizer = policy_preferences.write_pairs(args, inputs[0])
    if not os.path.isfile(args.tokenizer):
        raise InputError(f"--tokenizer {args.tokenizer}: no such file; pass the model's tokenizer.json (the sample "
                         "corpus's comes from `python -m data_prep sample`, i.e. `make data`)")
    info = load_tokenizer(args.tokenizer, args.eos_token)
    tok = Tokenizer.from_str(info.json)
    if not chat.has_chat_tokens(tok):
        raise InputError(f"tokenizer {args.tokenizer} lacks GLM's chat tokens (docs/chat.md#special-tokens); use "
                         "data_prep's trained tokenizer or GLM's own")
    if sample_run:
        generated = sample_preferences.pairs(args.pairs, kinds, args.seed)
        atomic.write_text(inputs[0], sample_preferences.jsonl(generated))
    pairs, skipped, lines = preferences.read_pairs(inputs, tok, opts.max_len)
    if not pairs:
        first = f"; first: {skipped[0]['message']}" if skipped else ""
        raise InputError(f"no valid preference pair in {', '.join(inputs)} ({lines} non-blank line(s)){first}")
    meta = preferences.write_preference_dataset(args.out, info, inputs, pairs, skipped, lines, opts)
    for line in preferences.report_lines(meta, skipped):
        print(line, file=sys.stderr)
    print("\n".join(preferences.summary_lines(meta)))
    print(f"-> {os.path.join(args.out, 'metadata.json')}")


def run(args: argparse.Namespace) -> None:
    start = time.time()
    check_out(args.out)
    if args.command in ("sft", "sample-sft"):
        return _run_sft(args)
    if args.command in ("preferences", "sample-preferences", "policy-preferences"):
        return _run_preferences(args)
    if args.command == "passkey":
        return passkey.run(args)
    if args.command == "sample":
        inputs, found = sample.build_sources(args.out, args.max_docs_per_domain)
        print(f"sample: {found['code_candidates']} code / {found['prose_candidates']} prose candidates from "
              f"{found['stdlib']}; unreadable: {found['unreadable'] or 'none'}")
    else:
        inputs = tuple(args.input)
    cfg = pipeline_config(args, inputs)
    result = executors.run(cfg, wait=args.wait)
    if cfg.executor.kind == "slurm" and not args.wait:
        return print(f"submitted Slurm jobs {', '.join(map(str, result['jobs']))}; metadata.json appears in "
                     f"{args.out} when the last one ends (intermediate files: {result['work']})")
    with get_datafolder(args.out).open("metadata.json", "r") as f:
        meta = json.load(f)
    order = list(dict.fromkeys(domain for domain, _ in inputs))  # the file's keys are sorted; print in input order
    meta["domains"] = {d: meta["domains"][d] for d in order}
    return _print_dataset(meta, result, args.out, time.time() - start)


def main(argv: list[str] | None = None) -> int:
    try:
        run(build_parser().parse_args(argv))
    except USER_ERRORS as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        print(f"error: {' | '.join(lines) or type(err).__name__}", file=sys.stderr)
        return 2
    except executors.StageFailed as err:  # tasks failed: their logs say why, and a re-run retries only them
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0

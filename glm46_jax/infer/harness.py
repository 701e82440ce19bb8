"""lm-evaluation-harness adapter: the model type `glm46_jax` (loglikelihood, loglikelihood_rolling, generate_until).

    python -m glm46_jax.harness --model glm46_jax --model_args checkpoint=runs/tiny --tasks hellaswag --batch_size 16
    python -m glm46_jax.harness --model glm46_jax --model_args hf_dir=path/to/GLM-4.6,dtype=bfloat16 \
        --include_path my_tasks --tasks my_task

The arguments are lm-eval's own command line (`lm_eval run ...`); this module imports the adapter first, because
lm-eval 0.4 finds models only through its registry (no plugin entry points), and checks every task YAML under
`--include_path` before the model is loaded. Model args: `checkpoint=` or `hf_dir=`, `tokenizer=`, `dtype=`,
`max_length=`, `max_gen_toks=`, `seed=`; the batch size is lm-eval's `--batch_size` (rows per forward pass,
rounded up to a multiple of the devices). What each request computes: docs/evaluation.md#request-types.
Needs the `eval` extra (`pip install -e '.[eval]'`); nothing else in glm46_jax imports this module.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

try:
    import lm_eval.models  # noqa: F401  (lm-eval's own models: get_model registers them only into an empty registry)
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import model_registry
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as err:  # an optional extra: say which one
    raise ImportError(f"glm46_jax.infer.harness needs lm-eval ({err}); install it with: pip install -e '.[eval]'"
                      ) from err

from glm46_jax.errors import InputError
from glm46_jax.infer.generate import generate
from glm46_jax.infer.load import Tokenizer, load_model
from glm46_jax.model import abstract_model, apply
from glm46_jax.parallel import sharding
from glm46_jax.training.loss import token_nll

# Row lengths are rounded up to a power of two from here (capped at max_length), so a whole task compiles
# a handful of forward programs: docs/evaluation.md#batching-and-the-mesh
MIN_BUCKET = 16
GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"}

Row = tuple[list[int], list[int], int]  # (input tokens, target tokens, how many trailing targets are scored)


def bucket(length: int, cap: int) -> int:
    """The padded length of a row of `length` tokens: the next power of two >= MIN_BUCKET, at most `cap`."""
    return min(max(MIN_BUCKET, 1 << max(length - 1, 0).bit_length()), cap)


def continuation_row(context: Sequence[int], continuation: Sequence[int], max_length: int) -> Row:
    """The model input scoring `continuation` after `context`: both joined, cut from the left to max_length + 1
    tokens (the harness's truncation), split into inputs and next-token targets; the last len(continuation)
    targets are scored."""
    if len(continuation) > max_length:
        raise InputError(f"a continuation of {len(continuation)} tokens does not fit max_length={max_length}; "
                         "raise max_length= in --model_args")
    whole = (list(context) + list(continuation))[-(max_length + 1):]
    return whole[:-1], whole[1:], len(continuation)


def rolling_rows(tokens: Sequence[int], prefix: int, max_length: int) -> list[Row]:
    """A whole text as disjoint windows of <= max_length predicted tokens, each with as much context as fits
    (lm-eval's rolling windows), every token predicted exactly once; the first is conditioned on `prefix`."""
    windows = get_rolling_token_windows(token_list=list(tokens), prefix_token=prefix, max_seq_len=max_length,
                                        context_len=1)
    return [continuation_row(ctx, pred, max_length) for ctx, pred in map(make_disjoint_window, windows)]


@functools.partial(jax.jit, static_argnames=("graphdef",))
def score_rows(graphdef, params, buffers, tokens: Int[Array, "b s"], targets: Int[Array, "b s"]
               ) -> tuple[Float[Array, "b s"], Bool[Array, "b s"]]:
    """log p(target | tokens up to here) per position (fp32) and whether the target is the argmax there."""
    logits = apply(graphdef, params, buffers, tokens, with_mtp=False).logits
    return -token_nll(logits, targets), jnp.argmax(logits, axis=-1) == targets


class GLMHarnessLM(TemplateLM):
    """The glm46_jax model behind lm-eval's LM interface, sharded data-parallel over every local device."""

    def __init__(self, checkpoint: str | None = None, hf_dir: str | None = None, tokenizer: str | None = None,
                 dtype: str = "float32", batch_size: int | str | None = 1, max_length: int | None = None,
                 max_gen_toks: int = 256, seed: int = 0, max_batch_size: int | None = None, device: Any = None,
                 **unknown: Any):
        # max_batch_size and device are what lm-eval passes every model; devices here are JAX's, all of them.
        if unknown:
            raise InputError(f"--model_args: unknown {sorted(unknown)}; glm46_jax takes checkpoint= or hf_dir=, "
                             "tokenizer=, dtype=, max_length=, max_gen_toks=, seed=")
        if (checkpoint is None) == (hf_dir is None):
            raise InputError("--model_args: give exactly one of checkpoint=RUN_DIR and hf_dir=HF_DIR")
        if dtype not in ("float32", "bfloat16"):
            raise InputError(f"--model_args dtype={dtype}: expected float32 or bfloat16")
        _rows_per_batch(batch_size, 1)  # the numbers are checked before the (slow) load as well as after
        if int(max_gen_toks) < 1 or (max_length is not None and int(max_length) < 1):
            raise InputError(f"--model_args max_length={max_length} and max_gen_toks={max_gen_toks} must be >= 1")
        mesh = sharding.make_mesh({"data": -1}, jax.local_devices())
        cfg, graphdef, params, buffers, tok_path = load_model(
            mesh, checkpoint=checkpoint and str(checkpoint), hf_dir=hf_dir and str(hf_dir), dtype=dtype,
            tokenizer=tokenizer)
        super().__init__()
        self._setup(cfg, graphdef, params, buffers, Tokenizer(tok_path), mesh, batch_size=batch_size,
                    max_length=max_length, max_gen_toks=max_gen_toks, seed=seed)

    @classmethod
    def from_model(cls, cfg, graphdef, params, buffers, tokenizer: Tokenizer | str, mesh: jax.sharding.Mesh, *,
                   batch_size: int = 1, max_length: int | None = None, max_gen_toks: int = 256,
                   seed: int = 0) -> GLMHarnessLM:
        """An adapter around an already loaded model (params placed on `mesh`) and tokenizer (or its path)."""
        self = cls.__new__(cls)
        TemplateLM.__init__(self)
        tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(str(tokenizer))
        self._setup(cfg, graphdef, params, buffers, tok, mesh, batch_size=batch_size, max_length=max_length,
                    max_gen_toks=max_gen_toks, seed=seed)
        return self

    def _setup(self, cfg, graphdef, params, buffers, tok: Tokenizer, mesh, *, batch_size, max_length,
               max_gen_toks, seed) -> None:
        if not cfg.eos_token_id:
            raise InputError("the model config has no eos_token_id: the harness conditions an empty context on it")
        if cfg.moe_capacity_factor > 0:  # rows of one batch (and pad rows) must not crowd each other out of experts
            cfg = cfg.replace(moe_capacity_factor=0.0)
            graphdef, _, _ = abstract_model(cfg, mesh)
        self.cfg, self.graphdef, self.params, self.buffers, self.tok, self.mesh = (
            cfg, graphdef, params, buffers, tok, mesh)
        shards = math.prod(mesh.shape[a] for a in sharding.mesh_axes("batch") if a in mesh.shape)
        self.batch_rows = _rows_per_batch(batch_size, shards)
        self.max_length = int(max_length or min(cfg.max_position_embeddings, 2048))
        self.max_gen_toks = int(max_gen_toks)
        self.seed = int(seed)
        if not 1 <= self.max_length <= cfg.max_position_embeddings or self.max_gen_toks < 1:
            raise InputError(f"--model_args max_length={self.max_length} must be in [1, "
                             f"{cfg.max_position_embeddings}] and max_gen_toks={self.max_gen_toks} >= 1")
        self.pad_id = int(cfg.pad_token_id or 0)
        self._rows_layout = jax.NamedSharding(mesh, sharding.logical("batch", None))

    # --- what TemplateLM asks of a model -------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return int(self.cfg.eos_token_id[0])

    @property
    def tokenizer_name(self) -> str:
        return self.tok.spec

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tok.encode(string)

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tok._decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probs, whether it is the greedy continuation) per request
        ((context, continuation) text, context ids, continuation ids); docs/evaluation.md#request-types"""
        rows = [continuation_row(ctx, cont, self.max_length) for _, ctx, cont in requests]
        out = [(float(lp.sum()), bool(g.all())) for lp, g in self.score(rows)]
        for (texts, _, _), result in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", texts, result)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's total log-likelihood, its windows from every request batched together."""
        rows, owner = [], []
        for i, req in enumerate(requests):
            windows = rolling_rows(self.tok_encode(req.args[0]), self.prefix_token_id, self.max_length)
            rows += windows
            owner += [i] * len(windows)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, self.score(rows)):
            totals[i] += float(lp.sum())
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or the request's temperature) continuations with generate(), each cut at the first `until`
        string; requests with the same settings are batched, longest prompts first."""
        groups: dict[tuple, list[int]] = {}
        settings = [self._gen_settings(req.args[1]) for req in requests]
        for i, s in enumerate(settings):
            groups.setdefault(s, []).append(i)
        out: list[str] = [""] * len(requests)
        n_batch = 0
        for (until, max_new, temperature, top_k, top_p), members in groups.items():
            max_ctx = max(self.max_length - max_new, 1)
            prompts = {i: self.tok_encode(requests[i].args[0])[-max_ctx:] or [self.prefix_token_id]
                       for i in members}
            order = sorted(members, key=lambda i: -len(prompts[i]))
            # Prompts are padded to their batch's length bucket and short batches filled with 1-token rows, so
            # prefill shapes repeat (docs/evaluation.md#batching-and-the-mesh).
            for chunk in itertools.batched(order, self.batch_rows):
                real = [prompts[i] for i in chunk]
                width = bucket(max(map(len, real)), max_ctx)
                batch = real + [[self.pad_id]] * (self.batch_rows - len(real))
                with sharding.use_mesh(self.mesh):
                    gen = generate(self.graphdef, self.params, self.buffers, batch, max_new_tokens=max_new,
                                   max_len=self.cfg.max_position_embeddings, temperature=temperature, top_k=top_k,
                                   top_p=top_p, stop_tokens=self.cfg.eos_token_id, seed=self.seed + n_batch,
                                   pad_id=self.pad_id, prompt_len=width)
                    tokens, lengths = np.asarray(gen.tokens), np.asarray(gen.lengths)
                n_batch += 1
                for row, i in enumerate(chunk):
                    new = [int(t) for t in tokens[row, :lengths[row]]]
                    if new and new[-1] in self.cfg.eos_token_id:
                        new = new[:-1]
                    out[i] = cut_at_stop(self.tok_decode(new), until)
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out

    # --- batching ---------------------------------------------------------------------------------

    def score(self, rows: Sequence[Row]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(log-probs, greedy flags) of each row's scored targets, in the order given. Rows are run longest
        first in batches of `batch_rows`, each padded to its longest row's bucket (pad rows fill the last)."""
        results: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(0), np.ones(0, bool))] * len(rows)
        order = sorted((i for i, r in enumerate(rows) if r[2]), key=lambda i: -len(rows[i][0]))
        for chunk in itertools.batched(order, self.batch_rows):
            width = bucket(len(rows[chunk[0]][0]), self.max_length)
            tokens = np.full((self.batch_rows, width), self.pad_id, np.int32)
            targets = np.full((self.batch_rows, width), self.pad_id, np.int32)
            for r, i in enumerate(chunk):
                inp, tgt, _ = rows[i]
                tokens[r, :len(inp)], targets[r, :len(tgt)] = inp, tgt
            with sharding.use_mesh(self.mesh):
                logp, greedy = score_rows(self.graphdef, self.params, self.buffers,
                                          jax.device_put(tokens, self._rows_layout),
                                          jax.device_put(targets, self._rows_layout))
                logp, greedy = np.asarray(logp, np.float64), np.asarray(greedy)
            for r, i in enumerate(chunk):
                n_in, n = len(rows[i][0]), rows[i][2]
                results[i] = (logp[r, n_in - n:n_in], greedy[r, n_in - n:n_in])
        return iter(results)

    def _gen_settings(self, kwargs: dict[str, Any]) -> tuple:
        kwargs = dict(kwargs or {})
        unknown = sorted(set(kwargs) - GEN_KWARGS)
        if unknown:
            raise InputError(f"generation kwargs {unknown} are not supported by glm46_jax (it takes "
                             f"{sorted(GEN_KWARGS)}); remove them from the task's generation_kwargs or --gen_kwargs")
        until = kwargs.get("until") or []
        until = (until,) if isinstance(until, str) else tuple(until)
        temperature = float(kwargs.get("temperature", 0.0) or 0.0)
        if not kwargs.get("do_sample", temperature > 0):
            temperature = 0.0
        return (until, int(kwargs.get("max_gen_toks", self.max_gen_toks)), temperature,
                int(kwargs.get("top_k", 0) or 0), float(kwargs.get("top_p", 1.0) or 1.0))


# Registered by its import path (resolved when a task asks for the model): lm-eval's CLI and our own command line
# (`python -m glm46_jax.harness`) then find the one class whichever imported this module first.
model_registry.register("glm46_jax", target="glm46_jax.infer.harness:GLMHarnessLM")


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """`text` up to the earliest occurrence of any of the `until` strings."""
    cuts = [text.find(s) for s in until if s]
    return text[:min((c for c in cuts if c >= 0), default=len(text))]


def _rows_per_batch(batch_size: int | str | None, shards: int) -> int:
    try:
        n = int(batch_size or 1)
    except (TypeError, ValueError):
        raise InputError(f"--batch_size={batch_size}: glm46_jax needs a number of rows per forward pass "
                         "('auto' is not supported)") from None
    if n < 1:
        raise InputError(f"--batch_size={n}: must be >= 1")
    return -(-n // shards) * shards  # the batch axis splits over data x expert: a multiple of the devices


# --- command line ---------------------------------------------------------------------------

def check_task_files(include_paths: Sequence[str], task_args: Sequence[str]) -> int:
    """Every task YAML under `include_paths` (and each task given as a .yaml path) parses, and the local data
    files it names exist: one clear line before the model loads, instead of lm-eval skipping a broken file and
    later not finding the task (docs/evaluation.md#task-file-errors). Returns how many files were checked."""
    import yaml
    from lm_eval.tasks._yaml_loader import load_yaml

    files = [t for t in task_args if t.endswith((".yaml", ".yml"))]
    for root in include_paths:
        if not os.path.exists(root):
            raise InputError(f"--include_path {root}: no such file or directory")
        if os.path.isfile(root):
            files.append(root)
        for dirpath, _, names in os.walk(root):
            files += [os.path.join(dirpath, n) for n in sorted(names) if n.endswith((".yaml", ".yml"))]
    for path in files:
        try:
            task = load_yaml(path, resolve_func=False)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark else path
            raise InputError(f"{where}: the task YAML does not parse ({getattr(e, 'problem', None) or e}); "
                             "fix it or move it out of --include_path") from None
        except (ValueError, OSError) as e:
            raise InputError(f"{path}: not a task config ({e})") from None
        data_files = (task.get("dataset_kwargs") or {}).get("data_files") or []
        for name in _local_paths(data_files):
            if not os.path.exists(name):
                raise InputError(f"{path}: dataset_kwargs.data_files names {name}, which does not exist")
    return len(files)


def _local_paths(spec: Any) -> list[str]:
    # data_files is a path, a list of them or {split: path(s)}; globs and URLs are datasets' to resolve
    if isinstance(spec, dict):
        return [p for v in spec.values() for p in _local_paths(v)]
    if isinstance(spec, (list, tuple)):
        return [p for v in spec for p in _local_paths(v)]
    return [spec] if isinstance(spec, str) and "://" not in spec and not any(c in spec for c in "*?[") else []


def main(argv: list[str] | None = None) -> None:
    """lm-eval's own CLI with the glm46_jax model type registered and the task files checked first."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--include_path", action="append", default=[])
    pre.add_argument("--tasks", "-t", nargs="+", default=[])
    known, _ = pre.parse_known_args(argv)
    check_task_files(known.include_path, [t for arg in known.tasks for t in arg.split(",") if t])
    setup_logging()
    sys.argv = ["lm-eval", *argv]  # lm-eval's parser reads sys.argv itself (to insert a missing `run`)
    parser = HarnessCLI()
    parser.execute(parser.parse_args())


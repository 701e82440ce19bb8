"""Convert training checkpoints to Hugging Face directories and back.

    python -m glm46_jax.convert ckpt-to-hf --run-dir runs/tiny --out export/tiny [--step 200] [--dtype float32]
    python -m glm46_jax.convert hf-to-ckpt --hf-dir path/to/GLM-4.6 --out runs/glm46-init [--step 0]
    python -m glm46_jax.convert lora-to-peft --run-dir runs/sft_tiny --out export/tiny-lora   # PEFT adapters
    python -m glm46_jax.convert quantize --hf-dir export/tiny --out export/tiny-fp8 --scheme fp8_block

ckpt-to-hf writes a directory that transformers, vLLM and SGLang load: config.json, safetensors shards (+ index)
in the released GLM layout (per-expert tensors, fp32 correction biases, the MTP layer as layer
`num_hidden_layers`), and, when the run has one, its tokenizer: tokenizer.json, tokenizer_config.json and
generation_config.json. hf-to-ckpt writes `<out>/checkpoints/<step>/` (+ tokenizer.json), from which
`--config.checkpoint.init_from=<out>` starts a run. A directory saved by transformers has no MTP layer (its
`save_pretrained` drops it): hf-to-ckpt then initialises that layer fresh (the model's initialiser, seed
`MTP_SEED`), says so, and lists it in the checkpoint's meta as `"fresh_init": ["mtp"]`.

Either writes into a temporary sibling of --out and renames it at the end, so an interrupted conversion
leaves nothing half-written. Only safetensors, JSON and Orbax files are read: nothing is unpickled.
The whole model passes through one host's memory (a one-device CPU mesh) in its stored dtype.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import jax
from flax import nnx

from glm46_jax import cli
from glm46_jax.errors import InputError
from glm46_jax.config import ModelConfig, model_config_from_dict
from glm46_jax.interop import chat, hf, reward
from glm46_jax.model import ExpertBias, abstract_model
from glm46_jax.model.transformer import MTPLayer
from glm46_jax.parallel import sharding
from glm46_jax.training import checkpoint

# The MTP layer of a directory that has none is initialised from this seed: the same directory always
# imports to the same checkpoint.
MTP_SEED = 0


def _parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m glm46_jax.convert", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("ckpt-to-hf", help="training checkpoint -> Hugging Face directory")
    e.add_argument("--run-dir", required=True, help="a training run dir (or its checkpoints/ dir, or one step dir)")
    e.add_argument("--step", type=int, help="the step to export (default: the latest)")
    e.add_argument("--out", required=True, help="the Hugging Face directory to write")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="storage dtype of the weights (default bfloat16, as released; float32 is exact)")
    e.add_argument("--tokenizer", help="a tokenizer.json (default: the run's, see checkpoint.tokenizer_path)")
    e.add_argument("--max-shard-size", default="5GiB", help="per safetensors file, e.g. 5GiB, 500MB (default 5GiB)")
    e.add_argument("--no-mtp-copies", action="store_true",
                   help="omit the MTP layer's copies of the embedding and head (vLLM's MTP drafter reads them)")
    e.add_argument("--force", action="store_true", help="replace a non-empty --out")
    i = sub.add_parser("hf-to-ckpt", help="Hugging Face directory -> checkpoint a run can start from")
    i.add_argument("--hf-dir", required=True, help="config.json + safetensors (released or transformers-5 layout)")
    i.add_argument("--out", required=True, help="the run dir to write (<out>/checkpoints/<step>/)")
    i.add_argument("--step", type=int, default=0, help="the step number to save under (default 0)")
    i.add_argument("--force", action="store_true", help="replace a non-empty --out")
    lo = sub.add_parser("lora-to-peft", help="a LoRA fine-tuning run's adapters -> PEFT adapter directory")
    lo.add_argument("--run-dir", required=True, help="a run of configs/sft.py with sft.method=lora")
    lo.add_argument("--step", type=int, help="the step to export (default: the latest)")
    lo.add_argument("--out", required=True, help="the adapter directory to write")
    lo.add_argument("--base-name", help="adapter_config.json's base_model_name_or_path (default: the run's init_from)")
    lo.add_argument("--force", action="store_true", help="replace a non-empty --out")
    q = sub.add_parser("quantize", help="an export -> FP8 / W4A16 compressed-tensors export (docs/serving.md)")
    q.add_argument("--hf-dir", required=True, help="a directory `ckpt-to-hf` wrote (bf16 or float32)")
    q.add_argument("--out", required=True, help="the quantized directory to write")
    q.add_argument("--scheme", required=True, help="fp8_dynamic | fp8_block | w4a16 (glm46_jax/interop/quantize.py)")
    q.add_argument("--force", action="store_true", help="replace a non-empty --out")
    return p


def _host_mesh() -> jax.sharding.Mesh:
    # Conversion only moves bytes between files: keep the weights in host memory, not on an accelerator.
    try:
        devices = jax.devices("cpu")[:1]
    except RuntimeError:  # JAX_PLATFORMS excludes cpu
        devices = jax.devices()[:1]
    return sharding.make_mesh({"data": 1}, devices)


def _is_step_dir(path: str) -> bool:
    try:
        return checkpoint.latest_checkpoint(path) == os.path.abspath(path)
    except FileNotFoundError:
        return False


def resolve_step(run_dir: str, step: int | None) -> str:
    """The step directory to export: `step` of the run, or its latest complete one."""
    run_dir = os.path.abspath(run_dir)
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"{run_dir}: no such directory; pass a training run dir with --run-dir")
    if step is None:
        return checkpoint.latest_checkpoint(run_dir)  # names the path when there is no checkpoint
    ckpts = os.path.join(run_dir, checkpoint.CHECKPOINTS)
    ckpts = ckpts if os.path.isdir(ckpts) else run_dir
    step_dir = os.path.join(ckpts, str(step))
    if not _is_step_dir(step_dir):
        available = sorted(int(d) for d in os.listdir(ckpts) if d.isdigit() and _is_step_dir(os.path.join(ckpts, d)))
        raise FileNotFoundError(f"{step_dir}: no complete checkpoint for --step {step}; available steps in "
                                f"{ckpts}: {available or 'none'}")
    return step_dir


def tokenizer_files(tokenizer_json: str, cfg: ModelConfig) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json and generation_config.json for `tokenizer_json`, checked against the model.

    The eos / pad strings are the tokenizer's own tokens at the model config's ids, so the tokenizer
    and the weights cannot disagree about which token ends a sequence. A tokenizer with GLM's chat tokens
    also gets our chat template and stops at <|user|> / <|observation|> (docs/chat.md#exported-models).
    """
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(tokenizer_json)
    except Exception as e:  # any parse failure means: not a tokenizer.json
        raise InputError(f"{tokenizer_json}: not a readable tokenizer.json ({e})") from e
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > cfg.vocab_size:
        raise InputError(f"{tokenizer_json}: {size} tokens but the model embeds only vocab_size={cfg.vocab_size}; "
                         "this is not the run's tokenizer (pass the right one with --tokenizer)")
    special = {i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}

    def token(i: int, field: str) -> str:
        if i in special:
            return special[i]
        text = tok.id_to_token(i)
        if text is None:
            raise InputError(f"{tokenizer_json}: the model's {field} {i} is not a token of this tokenizer "
                             "(pass the run's tokenizer with --tokenizer)")
        warnings.warn(f"{tokenizer_json}: {field} {i} ({text!r}) is not a special token; decoding will not drop it",
                      stacklevel=2)
        return text

    eos = [token(i, "eos_token_id") for i in cfg.eos_token_id]
    pad = None if cfg.pad_token_id is None else token(cfg.pad_token_id, "pad_token_id")
    # transformers 4 reads the added tokens' flags from here as well as from tokenizer.json: keep them equal.
    added = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                      "single_word": t.single_word, "special": t.special}
             for i, t in sorted(tok.get_added_tokens_decoder().items())}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_position_embeddings,
        "eos_token": eos[0] if eos else None, "pad_token": pad, "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"], "added_tokens_decoder": added}
    stop_ids = list(cfg.eos_token_id)
    if chat.has_chat_tokens(tok):
        tokenizer_config["chat_template"] = chat.CHAT_TEMPLATE
        # A chat turn ends at the next turn's role token: servers must stop there even if config.json lists
        # only <|endoftext|> (the tiny preset's eos).
        stop_ids += [i for i in chat.stop_token_ids(tok) if i not in stop_ids]
    generation_config: dict[str, Any] = {"_from_model_config": False}
    if stop_ids:  # all of them: GLM stops on <|endoftext|>, <|user|> and <|observation|>
        generation_config["eos_token_id"] = stop_ids[0] if len(stop_ids) == 1 else stop_ids
    if pad is not None:
        generation_config["pad_token_id"] = cfg.pad_token_id
    return {"tokenizer_config.json": tokenizer_config, "generation_config.json": generation_config}


def _inside(path: str, parent: str) -> bool:
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return os.path.commonpath([path, parent]) == parent


def _check_out(out: str, force: bool, source: str) -> None:
    # Called before the (slow) load too, so a bad --out fails at once.
    if os.path.exists(out) and not os.path.isdir(out):
        raise InputError(f"{out}: exists and is not a directory; choose another --out")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise InputError(f"{out}: not empty; pass --force to replace it, or choose another --out")
    if _inside(source, out):  # --force would delete what we are converting
        raise InputError(f"--out {out} contains the source {source}; choose another --out")


@contextlib.contextmanager
def _staged(out: str, force: bool, source: str) -> Iterator[str]:
    """A temporary sibling of `out` to write into; renamed to `out` only if the block completes."""
    # Not glm46_jax.atomic: that replaces one file, this replaces a whole directory (shards + config) at once.
    out = os.path.abspath(out)
    _check_out(out, force, source)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; servers may run as another user
    try:
        yield tmp
        for root, _, files in os.walk(tmp):  # safetensors writes 0600 files; give them the umask's mode
            for name in files:
                os.chmod(os.path.join(root, name), 0o666 & ~umask)
        old = None
        if os.path.isdir(out):
            if os.listdir(out):
                old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=parent)
                os.replace(out, old)
            else:
                os.rmdir(out)
        os.replace(tmp, out)
        if old:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ckpt_to_hf(run_dir: str, out: str, *, step: int | None = None, dtype: str = "bfloat16",
               tokenizer: str | None = None, max_shard_bytes: int = 5 * 2**30, mtp_copies: bool = True,
               force: bool = False) -> str:
    step_dir = resolve_step(run_dir, step)
    _check_out(os.path.abspath(out), force, step_dir)
    # The shard limit is checked against the checkpoint's shapes before its (slow) load.
    cfg = model_config_from_dict(checkpoint.read_meta(step_dir)["model_config"])
    mesh = _host_mesh()
    hf.check_max_shard(cfg, *abstract_model(cfg, mesh)[1:], dtype, max_shard_bytes)
    if tokenizer and os.path.isdir(tokenizer):
        tokenizer = os.path.join(tokenizer, "tokenizer.json")
    if tokenizer and not os.path.isfile(tokenizer):
        raise FileNotFoundError(f"{tokenizer}: no such tokenizer.json (--tokenizer)")
    tokenizer = tokenizer or checkpoint.tokenizer_path(step_dir)
    cfg, _, params, buffers = checkpoint.load_params(step_dir, mesh)
    extra = tokenizer_files(tokenizer, cfg) if tokenizer else {}  # checked before anything is written
    if not tokenizer:
        warnings.warn(f"{step_dir}: no tokenizer.json with the run (or --tokenizer); writing the weights and "
                      "config.json only, which servers cannot load without a tokenizer", stacklevel=2)
    with _staged(out, force, step_dir) as tmp:
        hf.save_hf(tmp, cfg, params, buffers, dtype=dtype, max_shard_bytes=max_shard_bytes, mtp_copies=mtp_copies)
        if cfg.score_head:  # a reward model / critic: the causal-LM directory plus its head
            reward.save_score_head(tmp, cfg, params, dtype)
        if tokenizer:
            shutil.copyfile(tokenizer, os.path.join(tmp, "tokenizer.json"))
        for name, content in extra.items():
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(content, f, indent=2)
    print(f"exported {step_dir} -> {os.path.abspath(out)} ({dtype}"
          f"{', tokenizer ' + tokenizer if tokenizer else ', no tokenizer'})")
    return os.path.abspath(out)


def _fresh_mtp(cfg: ModelConfig, mesh: jax.sharding.Mesh) -> tuple[nnx.State, nnx.State]:
    """(params, buffers) of a new MTP layer: the model's own initialiser, seed MTP_SEED, on `mesh`."""
    with sharding.use_mesh(mesh):
        @jax.jit
        def make(key):
            _, params, buffers = nnx.split(MTPLayer(cfg, rngs=nnx.Rngs(params=key)), nnx.Param, ExpertBias)
            return params, buffers
        return make(jax.random.key(MTP_SEED))


def _with_part(state: nnx.State, name: str, part: nnx.State) -> nnx.State:
    return nnx.from_flat_state([*nnx.to_flat_state(state), *(((name, *p), v) for p, v in nnx.to_flat_state(part))])


def hf_to_ckpt(hf_dir: str, out: str, *, step: int = 0, force: bool = False) -> str:
    hf_dir = os.path.abspath(hf_dir)
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise FileNotFoundError(f"{hf_dir}: not a Hugging Face model directory (no config.json); pass the "
                                "directory holding config.json and the *.safetensors files")
    _check_out(os.path.abspath(out), force, hf_dir)
    mesh = _host_mesh()
    declared = hf.read_config(hf_dir)
    cfg, _, params, buffers = hf.load_hf(hf_dir, mesh, declared, warn_missing_mtp=False)
    fresh_init: list[str] = []  # parts initialised rather than imported
    if declared.num_nextn_predict_layers and not cfg.num_nextn_predict_layers:
        # The run from this checkpoint trains what config.json describes, MTP included: start that layer anew.
        mtp_params, mtp_buffers = _fresh_mtp(declared, mesh)
        params, buffers = _with_part(params, "mtp", mtp_params), _with_part(buffers, "mtp", mtp_buffers)
        cfg, fresh_init = declared, ["mtp"]
        print(f"MTP layer initialised fresh (seed {MTP_SEED}): {hf_dir} has no model.layers.{cfg.num_hidden_layers}.* "
              "tensors (transformers' save_pretrained drops them); the checkpoint's meta says fresh_init=['mtp']")
    source_tok = os.path.join(hf_dir, "tokenizer.json")
    target_tok = os.path.join(os.path.abspath(out), "tokenizer.json")
    meta: dict[str, Any] = {"source": {"hf_dir": hf_dir}, "tokenizer": None, "fresh_init": fresh_init}
    if os.path.isfile(source_tok):
        with open(source_tok, "rb") as f:
            meta["tokenizer"] = {"path": target_tok, "source": source_tok, "sha256": hashlib.sha256(f.read()).hexdigest()}
    with _staged(out, force, hf_dir) as tmp:
        checkpoint.save_params(os.path.join(tmp, checkpoint.CHECKPOINTS), step, params, buffers, cfg, meta=meta)
        if meta["tokenizer"]:
            shutil.copyfile(source_tok, os.path.join(tmp, "tokenizer.json"))
    step_dir = os.path.join(os.path.abspath(out), checkpoint.CHECKPOINTS, str(step))
    print(f"imported {hf_dir} -> {step_dir}" + ("" if meta["tokenizer"] else " (no tokenizer.json in the HF dir)"))
    return step_dir


def load_lora_run(step_dir: str, mesh: jax.sharding.Mesh):
    """(cfg, lora config, graphdef, adapters, base, buffers) of a LoRA run's step: the base weights from the
    run's `init_from` (recorded in the step's meta), the adapters and biases from the step."""
    from glm46_jax.model import lora

    meta = checkpoint.read_meta(step_dir)
    if "lora" not in meta:
        raise InputError(f"{step_dir}: not a LoRA run's checkpoint (its meta has no lora section); export a "
                         "fully trained run with ckpt-to-hf")
    cfg = model_config_from_dict(meta["model_config"])
    lcfg = lora.LoRAConfig.from_dict(meta["lora"])
    init_from = meta.get("init_from") or ""
    if not init_from:
        raise InputError(f"{step_dir}: the run started from random weights (no init_from), so its base cannot be "
                         "rebuilt")
    base_cfg, graphdef, params, buffers = checkpoint.load_params(init_from, mesh)
    checkpoint.check_same_model(base_cfg, cfg, f"{step_dir}: its base {init_from}")
    graphdef, adapters, base, buffers = lora.add_adapters(graphdef, params, buffers, lcfg, mesh)
    adapters, buffers = checkpoint.restore_model(step_dir, adapters, buffers)
    return cfg, lcfg, graphdef, adapters, base, buffers


def lora_to_peft(run_dir: str, out: str, *, step: int | None = None, base_name: str | None = None,
                 force: bool = False) -> str:
    """Write a LoRA run's adapters as a PEFT directory (adapter_config.json + adapter_model.safetensors)."""
    from glm46_jax.interop import peft

    step_dir = resolve_step(run_dir, step)
    _check_out(os.path.abspath(out), force, step_dir)
    cfg, lcfg, _, adapters, _, _ = load_lora_run(step_dir, _host_mesh())
    name = base_name if base_name is not None else checkpoint.read_meta(step_dir).get("init_from", "")
    with _staged(out, force, step_dir) as tmp:
        peft.save_peft(tmp, cfg, lcfg, adapters, base_model_name_or_path=name)
    print(f"exported the adapters of {step_dir} -> {os.path.abspath(out)} (PEFT LoRA, r={lcfg.rank})")
    return os.path.abspath(out)


def quantize_export(hf_dir: str, out: str, scheme: str, *, force: bool = False) -> str:
    """`hf_dir` (a ckpt-to-hf export) quantized with `scheme` (glm46_jax/interop/quantize.py) into `out`; every shape
    is checked before anything is written."""
    from glm46_jax.interop import quantize

    p = quantize.plan(hf_dir, scheme)
    with _staged(out, force, p.hf_dir) as tmp:
        quantize.write(p, tmp)
    print(f"quantized {p.hf_dir} -> {os.path.abspath(out)} ({scheme}: {p.targets} Linear weights)")
    return os.path.abspath(out)


def main(argv: list[str] | None = None) -> str:
    """Returns the directory written."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "ckpt-to-hf":
        shard = cli.parse_bytes(args.max_shard_size, "--max-shard-size")
        return ckpt_to_hf(args.run_dir, args.out, step=args.step, dtype=args.dtype, tokenizer=args.tokenizer,
                          max_shard_bytes=shard, mtp_copies=not args.no_mtp_copies, force=args.force)
    if args.command == "quantize":
        return quantize_export(args.hf_dir, args.out, args.scheme, force=args.force)
    if args.command == "lora-to-peft":
        return lora_to_peft(args.run_dir, args.out, step=args.step, base_name=args.base_name, force=args.force)
    return hf_to_ckpt(args.hf_dir, args.out, step=args.step, force=args.force)


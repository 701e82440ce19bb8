"""Loading a model to run it: weights from an HF directory or a training checkpoint, and the tokenizer beside them.

The library API takes plain arguments; `add_model_args` is the matching command-line flags (score, eval, generate).
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from glm46_jax.errors import InputError

if TYPE_CHECKING:  # `add_model_args` serves CLIs that import no jax (data_prep policy-preferences)
    import jax


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--hf-dir | --checkpoint (one of them) and --dtype: what `load_model` reads (score, eval, generate)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-dir", help="Hugging Face GLM-4.5/4.6 directory (config.json + safetensors)")
    src.add_argument("--checkpoint", help="a training run directory or one of its checkpoints")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")


class Tokenizer:
    """A tokenizer.json read with `tokenizers`: encode text, show one token's piece."""

    def __init__(self, spec: str):
        self.spec = spec
        if not os.path.exists(spec):
            raise FileNotFoundError(f"{spec}: tokenizer.json not found (pass --tokenizer PATH)")
        from tokenizers import Tokenizer
        try:
            tok = Tokenizer.from_file(spec)
        except Exception as e:  # any parse failure means: not a tokenizer.json
            raise InputError(f"{spec}: not a readable tokenizer.json ({e})") from e
        self.tokenizer = tok  # the tokenizers.Tokenizer itself (what glm46_jax.interop.chat encodes with)
        self._encode = lambda text: tok.encode(text, add_special_tokens=False).ids
        self._decode = lambda ids: tok.decode(list(ids), skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._encode(text)]

    def piece(self, token: int) -> str:
        return self._decode([token])


def load_model(mesh: jax.sharding.Mesh, *, hf_dir: str | None = None, checkpoint: str | None = None,
               dtype: str = "float32", tokenizer: str | None = None):
    """(cfg, graphdef, params, buffers, tokenizer path) from an HF directory or a training run / checkpoint (exactly
    one of them): what score, eval, generate and the harness load. `tokenizer` overrides where the tokenizer.json is
    looked up (the HF directory's, or the corpus tokenizer training copied into the run)."""
    if (hf_dir is None) == (checkpoint is None):
        raise InputError("give exactly one of --hf-dir and --checkpoint")
    if hf_dir:
        from glm46_jax.interop.hf import load_hf
        cfg, graphdef, params, buffers = load_hf(hf_dir, mesh, dtype=dtype)
        default_tok = os.path.join(hf_dir, "tokenizer.json")
    else:
        from glm46_jax.training.checkpoint import latest_checkpoint, load_params, tokenizer_path
        cfg, graphdef, params, buffers = load_params(checkpoint, mesh, dtype=dtype)
        step_dir = latest_checkpoint(checkpoint)
        default_tok = tokenizer_path(step_dir) or os.path.join(step_dir, "tokenizer.json")
    return cfg, graphdef, params, buffers, tokenizer or default_tok

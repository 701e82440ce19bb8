"""The tokenizer: train a byte-level BPE on the prepared text, or load any `tokenizer.json`.

Trained tokenizers put `<|pad|>` at id 0 and `<|endoftext|>` at id 1, then GLM's chat tokens (ids 2-18:
`[gMASK]`, `<sop>`, the role tokens, `<think>`, the tool-call markup; docs/chat.md#special-tokens), before the
256 byte symbols and the merges, so a model trained on the corpus can be fine-tuned and served in GLM's chat
format. HF `tokenizers` training is deterministic for the same texts in the same order (ties between equally
frequent merges are broken by the pair itself), so a re-run rebuilds the same file.

Documents are encoded with `encode_special_tokens=True`: a document that *contains* the text
"<|endoftext|>" is tokenized as that text, so the only EOS ids in a record are the ones we append.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import fsspec
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from glm46_jax.interop.chat import CHAT_MARKUP_TOKENS, CHAT_TOKENS

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN)  # ids 0 and 1 in a trained tokenizer
ADDED_TOKENS = SPECIAL_TOKENS + CHAT_TOKENS  # ids 0 .. 18, in this order
_PARALLELISM = "TOKENIZERS_PARALLELISM"


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    json: str  # the serialised tokenizer, exactly as it is written to <out>/tokenizer.json
    source: str  # "trained" or the path it was loaded from
    eos_token: str
    eos_id: int
    pad_id: int  # `<|pad|>` if the tokenizer has one, else the EOS id (GLM's tokenizer pads with <|endoftext|>)
    vocab_size: int

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.json.encode("utf-8")).hexdigest()

    def metadata(self) -> dict[str, Any]:
        return {"path": "tokenizer.json", "sha256": self.sha256, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id, "eos_token": self.eos_token, "pad_id": self.pad_id, "source": self.source}


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2 pre-tokenizer regex, no prefix space) trained on `texts`, ADDED_TOKENS first."""
    min_size = len(ADDED_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < min_size:
        raise ValueError(f"vocab_size {vocab_size} < {min_size} ({len(ADDED_TOKENS)} special and chat tokens "
                         "+ 256 byte symbols)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # The trainer is the one place that puts added tokens before the byte symbols, and it makes them all special.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(ADDED_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer, length=len(texts) if isinstance(texts, Sequence) else None)
    return _markup_not_special(tok)


def _markup_not_special(tok: Tokenizer) -> Tokenizer:
    """The chat markup (<think>, <tool_call>, ...) as added but not special tokens, like GLM's tokenizer: still one
    id each, and kept when decoding skips special tokens, which the servers' reasoning/tool parsers read."""
    spec = json.loads(tok.to_str())
    for added in spec["added_tokens"]:
        if added["content"] in CHAT_MARKUP_TOKENS:
            added["special"] = False
    return Tokenizer.from_str(json.dumps(spec))


def _describe(tok: Tokenizer, tokenizer_json: str, source: str, eos_token: str) -> TokenizerInfo:
    eos_id = tok.token_to_id(eos_token)
    if eos_id is None:
        raise ValueError(f"tokenizer {source} has no token {eos_token!r}; pass its end-of-text token with --eos-token")
    # Padding is never attended to nor trained on (segment id 0, loss mask 0): any valid id works, and a
    # tokenizer without `<|pad|>` (GLM's own pads with `<|endoftext|>`) uses its EOS.
    pad_id = tok.token_to_id(PAD_TOKEN)
    return TokenizerInfo(json=tokenizer_json, source=source, eos_token=eos_token, eos_id=eos_id,
                         pad_id=eos_id if pad_id is None else pad_id,
                         vocab_size=tok.get_vocab_size(with_added_tokens=True))


def trained(texts: Iterable[str], vocab_size: int) -> TokenizerInfo:
    tok = train_bpe(texts, vocab_size)
    return _describe(tok, tok.to_str(pretty=True), "trained", EOS_TOKEN)


def load(path: str, eos_token: str = EOS_TOKEN) -> TokenizerInfo:
    """A `tokenizer.json` as-is (its exact bytes are what gets copied to the output)."""
    with fsspec.open(path, "rb") as f:  # bytes, not text mode: newline translation would change the copy
        text = f.read().decode("utf-8")
    try:
        tok = Tokenizer.from_str(text)
    except Exception as err:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"{path} is not a valid tokenizer.json: {err}") from err
    return _describe(tok, text, path, eos_token)


def encoder(info: TokenizerInfo) -> Tokenizer:
    return _encoder(info.json)


@functools.lru_cache(maxsize=2)
def _encoder(tokenizer_json: str) -> Tokenizer:
    """One per process: each `Tokenizer` leaves ~3 MB behind once it has encoded (benchmarks/RESULTS.md), so a
    worker running many tokenize tasks would grow with the task count."""
    tok = Tokenizer.from_str(tokenizer_json)
    tok.encode_special_tokens = True
    return tok


def encode_documents(tok: Tokenizer, texts: Sequence[str], eos_id: int) -> list[np.ndarray]:
    """One int32 array per text: its token ids followed by EOS. On this thread, without offsets: the Rayon pool's
    threads each grew their own malloc arena, so a task's RSS grew with its slice (147 -> 169 MB from 1x to 16x of
    benchmarks/data_prep.py's single file; serial, no offsets: 126 -> 131 MB, and no slower with workers sharing the
    cores). `TOKENIZERS_PARALLELISM` is read at every call, so BPE training elsewhere keeps its threads."""
    before = os.environ.get(_PARALLELISM)
    os.environ[_PARALLELISM] = "false"
    try:
        encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast: tokenizers >= 0.20.1 (no offsets)
        encodings = encode(list(texts), add_special_tokens=False)
    finally:
        if before is None:
            del os.environ[_PARALLELISM]
        else:
            os.environ[_PARALLELISM] = before
    return [np.asarray([*e.ids, eos_id], np.int32) for e in encodings]

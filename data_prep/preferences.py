"""Preference data: JSONL (prompt, chosen, rejected) pairs -> two token sequences per pair, each with the loss mask
of its final assistant turn, in two splits.

    pairs, reports, lines = read_pairs(["pairs.jsonl"], tok, max_len=4096)   # malformed lines reported, not fatal
    meta = write_preference_dataset(out, tok_info, inputs, pairs, reports, lines, options)

Each line is {"messages" | "prompt": ..., "chosen": ..., "rejected": ..., "margin": float, "tools": [...],
"enable_thinking": bool} (docs/preferences.md#input). The prompt + each reply go through `glm46_jax.interop.chat`
exactly as an SFT sample does (`chat.encode(..., close_final_turn=True)`: the renderer and assistant mask of
data_prep/sft.py), and only the reply's own tokens stay masked: its output after the last <|assistant|> plus the
token that ends its turn. Sample 2i of a split is pair i's chosen sequence, sample 2i + 1 its rejected one
(docs/preferences.md#the-dataset-on-disk). Nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jaxtyping import Bool, Int
from tokenizers import Tokenizer

from data_prep import shards
from data_prep.sft import Malformed, begin_dataset, read_lines, save_split, skip_report_lines
from data_prep.tokenizer import TokenizerInfo
from glm46_jax import atomic
from glm46_jax.errors import InputError
from glm46_jax.interop import chat

METADATA_VERSION = 1
SPLITS = shards.SPLITS
ARRAYS = {"tokens": "int32 [total tokens]: the sequences' token ids back to back",
          "assistant_mask": "bool [total tokens]: True where the token is the final reply's (trained) output",
          "offsets": "int64 [2 * pairs + 1]: sequence s is tokens[offsets[s]:offsets[s + 1]]; "
                     "sequence 2i is pair i's chosen reply, 2i + 1 its rejected one",
          "margin": "float32 [pairs]: pair i's margin (0 where the line gave none)"}
KINDS = {  # what each skipped-line kind means (docs/preferences.md#what-is-skipped)
    "invalid_utf8": "the line is not UTF-8",
    "invalid_json": "the line is not JSON",
    "missing_field": "no chosen / rejected, or no prompt (messages or prompt)",
    "bad_field": "a field has the wrong type or shape",
    "bad_message": "chat.parse_messages rejects a message",
    "bad_role": "chosen or rejected is not an assistant message",
    "bad_role_order": "the prompt does not start with a user turn or does not end with a user or tool turn, "
                      "or a tool result follows no tool call",
    "missing_content": "a prompt message or a reply has no content",
    "identical": "chosen and rejected are (or render to) the same reply",
    "too_long": "chosen + rejected are more tokens than --max-len",
}


@dataclasses.dataclass(frozen=True)
class PreferenceOptions:
    max_len: int = 4096  # most tokens in one pair: chosen + rejected, each with the prompt
    heldout_fraction: float = 0.1
    max_reports: int = 1000

    def __post_init__(self):
        if self.max_len < 16:
            raise InputError(f"--max-len {self.max_len}: must be >= 16 tokens (a pair holds two sequences)")
        if not 0.0 <= self.heldout_fraction <= 1.0:
            raise InputError(f"--heldout-fraction {self.heldout_fraction}: must be in [0, 1]")
        if self.max_reports < 0:
            raise InputError(f"--max-reports {self.max_reports}: must be >= 0")


@dataclasses.dataclass(frozen=True)
class Pair:
    """One valid line, its messages normalised by chat.parse_messages."""
    location: str  # file:line
    prompt: list[dict[str, Any]]
    chosen: dict[str, Any]
    rejected: dict[str, Any]
    tools: list[dict[str, Any]] | None
    enable_thinking: bool
    margin: float

    @property
    def prompt_digest(self) -> bytes:
        """Content hash of the prompt (messages, tools, enable_thinking): every pair of one prompt lands in the
        same split, from any file or line (docs/preferences.md#the-dataset-on-disk)."""
        canon = json.dumps([self.prompt, self.tools, self.enable_thinking], sort_keys=True, ensure_ascii=False)
        return hashlib.blake2b(canon.encode("utf-8"), digest_size=16).digest()


@dataclasses.dataclass(frozen=True)
class TokenSequence:
    ids: Int[np.ndarray, " seq"]  # int32
    assistant_mask: Bool[np.ndarray, " seq"]  # True on the final reply's tokens and its end-of-turn token


@dataclasses.dataclass(frozen=True)
class EncodedPair:
    pair: Pair
    chosen: TokenSequence
    rejected: TokenSequence

    def __len__(self) -> int:
        return len(self.chosen.ids) + len(self.rejected.ids)


# --- reading -------------------------------------------------------------------------------------------

def _text(m: dict[str, Any]) -> str:
    content = m.get("content")
    if isinstance(content, list):  # text parts, checked by chat.parse_messages
        return "".join(p if isinstance(p, str) else p["text"] for p in content)
    return content or ""


def _reply(value: Any, field: str, location: str) -> dict[str, Any]:
    """chosen / rejected -> one parsed assistant message (a string, a message, or TRL's one-element list)."""
    shape = "a string, an assistant message {\"role\": \"assistant\", \"content\": ...}, or a one-element list of one"
    if isinstance(value, list):
        if len(value) != 1:
            hint = ("; give the shared prompt as \"prompt\" or \"messages\" and only the final assistant turn here"
                    if len(value) > 1 else "")
            raise Malformed("bad_field", f"{location}: {field} is a list of {len(value)} messages; expected {shape}"
                                         f"{hint}")
        value = value[0]
    if isinstance(value, str):
        value = {"role": "assistant", "content": value}
    if not isinstance(value, dict):
        raise Malformed("bad_field", f"{location}: {field} is a JSON {type(value).__name__}; expected {shape}")
    if value.get("role", "assistant") != "assistant":
        raise Malformed("bad_role", f"{location}: {field} has role {value.get('role')!r}; the reply must be an "
                                    "assistant message")
    try:
        [m] = chat.parse_messages([{"role": "assistant", **value}], f"{location}: {field}")
    except InputError as e:
        raise Malformed("bad_message", str(e).replace(": message 0", "", 1)) from None
    if not (_text(m).strip() or m.get("tool_calls") or m.get("reasoning_content", "").strip()):
        raise Malformed("missing_content", f"{location}: {field} has no content, reasoning or tool calls")
    return m


def _prompt(obj: dict[str, Any], location: str) -> list[dict[str, Any]]:
    if "messages" in obj and "prompt" in obj:
        raise Malformed("bad_field", f'{location}: has both "messages" and "prompt"; give the prompt once')
    if "messages" not in obj and "prompt" not in obj:
        raise Malformed("missing_field", f'{location}: no prompt: expected "messages" (a list of messages) or '
                                         '"prompt" (a string or a list of messages)')
    raw = obj["messages"] if "messages" in obj else obj["prompt"]
    if isinstance(raw, str) and "prompt" in obj:
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        field = "messages" if "messages" in obj else "prompt"
        raise Malformed("bad_field", f"{location}: {field} is a JSON {type(raw).__name__}; expected a list of "
                                     "messages" + (" or a string" if field == "prompt" else ""))
    try:
        messages = chat.parse_messages(raw, f"{location}: prompt")
    except InputError as e:
        raise Malformed("bad_message", str(e)) from None
    _check_prompt(messages, location)
    return messages


def _check_prompt(messages: list[dict[str, Any]], location: str) -> None:
    """What the renderer would accept but a prompt followed by a final assistant reply cannot be."""
    for i, m in enumerate(messages):
        where = f"{location}: prompt message {i} ({m['role']})"
        if m["role"] in ("user", "system") and "content" not in m:
            raise Malformed("missing_content", f"{where} has no content")
        previous = messages[i - 1] if i else None
        if m["role"] == "tool" and not (previous and (previous["role"] == "tool" or previous.get("tool_calls"))):
            raise Malformed("bad_role_order", f"{where} is a tool result that follows no tool call")
        if previous is not None and previous.get("tool_calls") and m["role"] != "tool":
            raise Malformed("bad_role_order", f"{location}: prompt message {i - 1}'s tool calls get no tool result "
                                              f"(message {i} is {m['role']})")
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
    if first is None or messages[first]["role"] != "user":
        what = "only system messages" if first is None else f"message {first} ({messages[first]['role']})"
        raise Malformed("bad_role_order", f"{location}: a prompt starts (after system messages) with a user "
                                          f"message, not {what}")
    last = messages[-1]
    if last["role"] not in ("user", "tool"):
        raise Malformed("bad_role_order", f"{location}: the prompt ends with a{'n' * (last['role'] == 'assistant')} "
                                          f"{last['role']} message; the reply must follow a user or tool message")


def parse_line(text: str, location: str) -> Pair:
    """One JSONL line -> Pair, or Malformed naming the problem (the message starts with `location`)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise Malformed("invalid_json", f"{location}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise Malformed("bad_field", f"{location}: a JSON {type(obj).__name__}; expected an object with a prompt, "
                                     '"chosen" and "rejected"')
    missing = [k for k in ("chosen", "rejected") if obj.get(k) is None]
    if missing:
        raise Malformed("missing_field", f"{location}: no {' and no '.join(repr(k) for k in missing)}; a pair needs "
                                         'both "chosen" and "rejected" (the final assistant turn)')
    thinking = obj.get("enable_thinking", True)
    if not isinstance(thinking, bool):
        raise Malformed("bad_field", f"{location}: enable_thinking must be true or false")
    margin = obj.get("margin")
    margin = 0.0 if margin is None else margin
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not math.isfinite(margin):
        raise Malformed("bad_field", f"{location}: margin must be a finite number, not {json.dumps(obj['margin'])}")
    try:
        tools = chat.parse_tools(obj.get("tools"), location)
    except InputError as e:
        raise Malformed("bad_field", str(e)) from None
    prompt = _prompt(obj, location)
    chosen, rejected = _reply(obj["chosen"], "chosen", location), _reply(obj["rejected"], "rejected", location)
    if json.dumps(chosen, sort_keys=True) == json.dumps(rejected, sort_keys=True):
        raise Malformed("identical", f"{location}: chosen and rejected are the same reply; a pair needs two "
                                     "different ones")
    return Pair(location, prompt, chosen, rejected, tools, thinking, float(margin))


def _masked_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))


def encode_reply(tok: Tokenizer, prompt: list[dict[str, Any]], reply: dict[str, Any],
                 tools: list[dict[str, Any]] | None, enable_thinking: bool) -> TokenSequence:
    """prompt + reply rendered and encoded as SFT renders a sample, the mask narrowed to the reply: each assistant
    message is one maximal run of chat.encode's mask, so the reply's is the last (it ends with the appended
    end-of-turn token)."""
    enc = chat.encode(tok, prompt + [reply], tools=tools, enable_thinking=enable_thinking, close_final_turn=True)
    runs = _masked_runs(enc.assistant_mask)
    if not runs or runs[-1][1] != len(enc.ids):
        raise AssertionError("the final reply's mask does not end the sequence; chat.encode changed?")
    mask = np.zeros(len(enc.ids), bool)
    mask[runs[-1][0]:] = True
    return TokenSequence(enc.ids, mask)


def encode_pair(tok: Tokenizer, p: Pair, max_len: int) -> EncodedPair:
    """Both sequences, or Malformed when they render the same or together exceed `max_len` tokens."""
    chosen = encode_reply(tok, p.prompt, p.chosen, p.tools, p.enable_thinking)
    rejected = encode_reply(tok, p.prompt, p.rejected, p.tools, p.enable_thinking)
    if np.array_equal(chosen.ids, rejected.ids):
        raise Malformed("identical", f"{p.location}: chosen and rejected render to the same tokens (they differ "
                                     "only in what the chat format drops, e.g. surrounding whitespace)")
    n = len(chosen.ids) + len(rejected.ids)
    if n > max_len:
        raise Malformed("too_long", f"{p.location}: the pair is {n} tokens ({len(chosen.ids)} chosen + "
                                    f"{len(rejected.ids)} rejected, prompt included in each) > --max-len {max_len}; "
                                    "skipped (raise --max-len to keep it)")
    return EncodedPair(p, chosen, rejected)


def read_pairs(paths: Sequence[str], tok: Tokenizer,
               max_len: int) -> tuple[list[EncodedPair], list[dict[str, str]], int]:
    """(valid encoded pairs in input order, a report per skipped line in input order, non-blank lines read):
    `sft.read_lines`, so blank lines are ignored and a line that is not UTF-8 is reported like any malformed one."""
    return read_lines(paths, lambda text, location: encode_pair(tok, parse_line(text, location), max_len))


# --- writing -------------------------------------------------------------------------------------------

def split_arrays(pairs: list[EncodedPair]) -> dict[str, np.ndarray]:
    """The four arrays of one split: chosen at sequence 2i, rejected at 2i + 1."""
    seqs = [s for p in pairs for s in (p.chosen, p.rejected)]
    lengths = np.asarray([len(s.ids) for s in seqs], np.int64)
    return {"tokens": np.concatenate([s.ids for s in seqs] or [np.zeros(0, np.int32)]).astype(np.int32),
            "assistant_mask": np.concatenate([s.assistant_mask for s in seqs] or [np.zeros(0, bool)]),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "margin": np.asarray([p.pair.margin for p in pairs], np.float32)}


def split_of(p: Pair, heldout_fraction: float) -> str:
    return "heldout" if shards.is_heldout(p.prompt_digest, heldout_fraction) else "train"


def write_preference_dataset(out: str, info: TokenizerInfo, inputs: Sequence[str], pairs: list[EncodedPair],
                             skipped: list[dict[str, str]], lines: int, opts: PreferenceOptions) -> dict[str, Any]:
    """Writes tokenizer.json, <split>/{tokens,assistant_mask,offsets,margin}.npy and finally metadata.json (present
    <=> complete); returns the metadata."""
    if not pairs:
        raise InputError(f"no valid preference pair to write to {out}")
    by_split: dict[str, list[EncodedPair]] = {s: [] for s in SPLITS}
    for p in pairs:
        by_split[split_of(p.pair, opts.heldout_fraction)].append(p)
    metadata_path = begin_dataset(out, info)
    splits = {}
    for split, members in by_split.items():
        arrays = split_arrays(members)
        save_split(out, split, arrays)
        lengths = np.diff(arrays["offsets"])
        splits[split] = {"pairs": len(members), "prompts": len({p.pair.prompt_digest for p in members}),
                         "tokens": int(lengths.sum()), "assistant_tokens": int(arrays["assistant_mask"].sum()),
                         "max_pair_tokens": int((lengths[0::2] + lengths[1::2]).max(initial=0)),
                         "max_sequence_tokens": int(lengths.max(initial=0))}
    by_kind: dict[str, int] = {}
    for r in skipped:
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0) + 1
    meta = {
        "version": METADATA_VERSION,
        "kind": "preferences",
        "format": {"layout": "<split>/<name>.npy", "splits": list(SPLITS), "arrays": ARRAYS,
                   "pairing": "sequence 2i = pair i's chosen, 2i + 1 = its rejected"},
        "tokenizer": info.metadata(),
        "inputs": list(inputs),
        "pairs": {"lines": lines, "valid": len(pairs), "skipped": len(skipped), "by_kind": dict(sorted(by_kind.items()))},
        "splits": splits,
        "reports": skipped[:opts.max_reports],
        "reports_left_out": max(0, len(skipped) - opts.max_reports),
        "config": dataclasses.asdict(opts),
    }
    atomic.write_json(metadata_path, meta)
    return meta


# --- what the CLI prints -------------------------------------------------------------------------------

def report_lines(meta: dict[str, Any], skipped: list[dict[str, str]]) -> list[str]:
    """stderr: each skipped line as `warning: file:line: reason` (the first 20), then the counts."""
    return skip_report_lines(meta, skipped, meta["pairs"], "line(s)", "pair(s)", "pairs")


def summary_lines(meta: dict[str, Any]) -> list[str]:
    lines = [f"[{split}] {s['pairs']:,} pairs ({s['prompts']:,} prompts), {s['tokens']:,} tokens "
             f"({s['assistant_tokens']:,} trained), longest pair {s['max_pair_tokens']}"
             for split, s in meta["splits"].items()]
    tok = meta["tokenizer"]
    lines.append(f"tokenizer: {tok['source']} vocab {tok['vocab_size']}")
    return lines

"""SFT data: JSONL conversations -> training samples (token ids + assistant loss mask) in two splits.

    chats, reports, lines = read_conversations(["convs.jsonl"])   # malformed lines reported, not fatal
    samples = conversation_samples(tok, chat)                       # one or more per conversation (docs/sft.md)
    meta = write_sft_dataset(out, tok_info, chats, options)         # <out>/<split>/*.npy + metadata.json

Each line is {"messages": [...], "tools": [...] (optional), "enable_thinking": bool (optional)}; other keys are
ignored. Messages go through `glm46_jax.interop.chat` (its parsing, its renderer, its assistant mask). Which assistant
turns a sample trains, and how an over-long sample is cut, is docs/sft.md#samples-per-conversation and
docs/sft.md#truncation. Nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
from jaxtyping import Bool, Int
from tokenizers import Tokenizer

from data_prep import shards
from data_prep.tokenizer import TokenizerInfo
from glm46_jax import atomic
from glm46_jax.errors import InputError
from glm46_jax.interop import chat

METADATA_VERSION = 1
SPLITS = shards.SPLITS
TruncateMode = Literal["rounds", "drop"]
TRUNCATE_MODES = ("rounds", "drop")
# <out>/<split>/<name>.npy: every sample's tokens back to back, and where each sample starts.
ARRAYS = {"tokens": "int32 [total tokens]: the samples' token ids back to back",
          "assistant_mask": "bool [total tokens]: True where the token is trained assistant output",
          "offsets": "int64 [samples + 1]: sample i is tokens[offsets[i]:offsets[i + 1]]"}


@dataclasses.dataclass(frozen=True)
class Chat:
    """One valid conversation, its messages normalised by chat.parse_messages."""
    location: str  # file:line
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    enable_thinking: bool

    @property
    def digest(self) -> bytes:
        """Content hash (not the location): the same conversation lands in the same split from any file."""
        canon = json.dumps([self.messages, self.tools, self.enable_thinking], sort_keys=True, ensure_ascii=False)
        return hashlib.blake2b(canon.encode("utf-8"), digest_size=16).digest()


@dataclasses.dataclass(frozen=True)
class Sample:
    ids: Int[np.ndarray, " seq"]
    assistant_mask: Bool[np.ndarray, " seq"]
    rounds_dropped: int = 0  # rounds cut from the front to fit max_len (docs/sft.md#truncation)


@dataclasses.dataclass(frozen=True)
class SFTOptions:
    max_len: int = 2048
    truncate: TruncateMode = "rounds"
    heldout_fraction: float = 0.1
    max_reports: int = 1000

    def __post_init__(self):
        if self.max_len < 8:
            raise InputError(f"--max-len {self.max_len}: must be >= 8 tokens")
        if self.truncate not in TRUNCATE_MODES:
            raise InputError(f"--truncate {self.truncate!r}: must be one of {TRUNCATE_MODES}")
        if not 0.0 <= self.heldout_fraction <= 1.0:
            raise InputError(f"--heldout-fraction {self.heldout_fraction}: must be in [0, 1]")


# --- reading -------------------------------------------------------------------------------------------

class Malformed(ValueError):
    """A line that is skipped: `kind` counts it, the message says what is wrong with it."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def parse_line(text: str, location: str) -> Chat:
    """One JSONL line -> Chat, or Malformed naming the problem (the message starts with `location`)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise Malformed("invalid_json", f"{location}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
        raise Malformed("missing_messages", f'{location}: expected an object with a "messages" list')
    thinking = obj.get("enable_thinking", True)
    if not isinstance(thinking, bool):
        raise Malformed("bad_field", f"{location}: enable_thinking must be true or false")
    try:
        messages = chat.parse_messages(obj["messages"], location)
        tools = chat.parse_tools(obj.get("tools"), location)
    except InputError as e:  # unknown role, bad content type, bad tool call: chat's message names the message
        raise Malformed("bad_message", str(e)) from None
    _check_order(messages, location)
    return Chat(location, messages, tools, thinking)


def _check_order(messages: list[dict[str, Any]], location: str) -> None:
    """What the renderer would accept but an SFT sample cannot be (docs/sft.md#what-is-skipped)."""
    for i, m in enumerate(messages):
        role, where = m["role"], f"{location}: message {i} ({m['role']})"
        if role in ("user", "system") and "content" not in m:
            raise Malformed("missing_content", f"{where} has no content")
        if role == "assistant" and not (_content_text(m).strip() or m.get("tool_calls")
                                        or m.get("reasoning_content", "").strip()):
            raise Malformed("missing_content", f"{where} has no content, reasoning or tool calls")
        previous = messages[i - 1] if i else None
        if role == "tool" and not (previous and (previous["role"] == "tool" or previous.get("tool_calls"))):
            raise Malformed("bad_role_order", f"{where} is a tool result that follows no tool call")
        if previous is not None and previous.get("tool_calls") and role != "tool":
            raise Malformed("bad_role_order", f"{location}: message {i - 1}'s tool calls get no tool result "
                                              f"(message {i} is {role})")
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
    if first is None or messages[first]["role"] != "user":
        what = "only system messages" if first is None else f"message {first} ({messages[first]['role']})"
        raise Malformed("bad_role_order", f"{location}: a conversation starts (after system messages) with a "
                                          f"user message, not {what}")
    if not any(m["role"] == "assistant" for m in messages):
        raise Malformed("no_assistant", f"{location}: no assistant message to train on")


def read_lines[T](paths: Sequence[str], parse: Callable[[str, str], T]) -> tuple[list[T], list[dict[str, str]], int]:
    """(parse(text, "file:line") of each valid line in input order, a report per line that is not UTF-8 or whose
    parse raised Malformed, non-blank lines read). Blank lines are ignored."""
    items, reports, lines = [], [], 0
    for path in paths:
        with open(path, "rb") as f:  # a missing file is FileNotFoundError: one line from the CLI
            for number, raw in enumerate(f, 1):
                location = f"{path}:{number}"
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    lines += 1
                    reports.append({"location": location, "kind": "invalid_utf8",
                                    "message": f"{location}: not UTF-8 (byte {e.start})"})
                    continue
                if not text.strip():
                    continue
                lines += 1
                try:
                    items.append(parse(text, location))
                except Malformed as e:
                    reports.append({"location": location, "kind": e.kind, "message": str(e)})
    return items, reports, lines


def read_conversations(paths: Sequence[str]) -> tuple[list[Chat], list[dict[str, str]], int]:
    """(valid conversations in input order, a report per malformed line, non-blank lines read): `read_lines`."""
    return read_lines(paths, parse_line)


# --- samples -------------------------------------------------------------------------------------------

def _content_text(m: dict[str, Any]) -> str:
    content = m.get("content")
    if isinstance(content, list):  # text parts, checked by chat.parse_messages
        return "".join(p if isinstance(p, str) else p["text"] for p in content)
    return content or ""


def _has_reasoning(m: dict[str, Any]) -> bool:
    """Whether the message renders differently as the last round (its thinking kept) and as an earlier one."""
    if m["role"] != "assistant":
        return False
    if isinstance(m.get("reasoning_content"), str):
        return bool(m["reasoning_content"].strip())
    return chat.END_THINK in _content_text(m)


def rounds(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """(the system messages before the first user turn, the rounds): a round starts at a user message that
    follows a non-user one and runs to the next such message; it is cut after its last assistant message."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    starts = [i for i in range(first, len(messages))
              if messages[i]["role"] == "user" and (i == first or messages[i - 1]["role"] != "user")] + [len(messages)]
    out = []
    for lo, hi in itertools.pairwise(starts):
        r = messages[lo:hi]
        last = max((j for j, m in enumerate(r) if m["role"] == "assistant"), default=len(r) - 1)
        out.append(r[:last + 1])  # what follows the last assistant turn trains nothing
    while out and not any(m["role"] == "assistant" for m in out[-1]):
        out.pop()  # trailing user turns without an answer
    return messages[:first], out


def sample_plan(round_list: list[list[dict[str, Any]]]) -> list[tuple[int, int]]:
    """(first, last) rounds trained by each sample; the sample renders rounds 0..last. A sample ends at every
    round with reasoning (it is rendered as the last round, thinking kept) and at the final round."""
    plan, first = [], 0
    for k, r in enumerate(round_list):
        if k == len(round_list) - 1 or any(_has_reasoning(m) for m in r):
            plan.append((first, k))
            first = k + 1
    return plan


def _masked_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))


def encode_sample(tok: Tokenizer, c: Chat, head: list[dict[str, Any]], context: list[list[dict[str, Any]]],
                  trained: list[list[dict[str, Any]]]) -> Sample:
    """Renders head + context + trained rounds; only the trained rounds' assistant output stays masked.

    Every assistant message is one maximal run of the mask (its output, plus the end token when one follows;
    the unmasked <|assistant|> separates consecutive ones), so the context's turns are its first runs."""
    messages = head + [m for r in context + trained for m in r]
    enc = chat.encode(tok, messages, tools=c.tools, enable_thinking=c.enable_thinking, close_final_turn=True)
    runs = _masked_runs(enc.assistant_mask)
    n_context = sum(m["role"] == "assistant" for r in context for m in r)
    if len(runs) != sum(m["role"] == "assistant" for m in messages):
        raise AssertionError(f"{c.location}: {len(runs)} masked runs for the assistant turns; chat.encode changed?")
    mask = enc.assistant_mask.copy()
    for lo, hi in runs[:n_context]:
        mask[lo:hi] = False
    return Sample(enc.ids, mask)


def conversation_samples(tok: Tokenizer, c: Chat, max_len: int,
                         truncate: TruncateMode) -> tuple[list[Sample], list[dict[str, str]]]:
    """The conversation's samples (docs/sft.md#samples-per-conversation), each at most `max_len` tokens, and
    a report for each sample truncated or dropped (docs/sft.md#truncation)."""
    head, round_list = rounds(c.messages)
    samples, reports = [], []
    for first, last in sample_plan(round_list):
        lo = 0  # rounds before `lo` are cut off; context first, then trained rounds, never the last one
        while True:
            s = encode_sample(tok, c, head, round_list[lo:first], round_list[max(lo, first):last + 1])
            if len(s.ids) <= max_len:
                break
            if truncate == "drop" or lo == last:
                why = "--truncate drop" if truncate == "drop" else "even its last round alone with system/tools"
                reports.append({"location": c.location, "kind": "dropped_too_long",
                                "message": f"{c.location}: a sample training rounds {first}-{last} is {len(s.ids)} "
                                           f"tokens > --max-len {max_len} ({why}); dropped"})
                s = None
                break
            lo += 1
        if s is None:
            continue
        if lo:
            lost = max(0, lo - first)
            reports.append({"location": c.location, "kind": "truncated",
                            "message": f"{c.location}: cut the first {lo} round(s) ({lost} of them trained) "
                                       f"to fit --max-len {max_len}"})
        samples.append(dataclasses.replace(s, rounds_dropped=lo))
    return samples, reports


# --- writing -------------------------------------------------------------------------------------------

def begin_dataset(out: str, info: TokenizerInfo) -> str:
    """Make `out`, remove its metadata.json (the marker of a complete dataset, written last) and write the tokenizer;
    returns the metadata path."""
    os.makedirs(out, exist_ok=True)
    metadata_path = os.path.join(out, "metadata.json")
    if os.path.exists(metadata_path):
        os.remove(metadata_path)
    atomic.write_text(os.path.join(out, "tokenizer.json"), info.json)
    return metadata_path


def save_split(out: str, split: str, arrays: dict[str, np.ndarray]) -> None:
    """Each array as `<out>/<split>/<name>.npy`, written atomically."""
    for name, array in arrays.items():
        with atomic.atomic_path(os.path.join(out, split, f"{name}.npy")) as tmp, open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)


def _split_arrays(samples: list[Sample]) -> dict[str, np.ndarray]:
    lengths = np.asarray([len(s.ids) for s in samples], np.int64)
    return {"tokens": np.concatenate([s.ids for s in samples] or [np.zeros(0, np.int32)]).astype(np.int32),
            "assistant_mask": np.concatenate([s.assistant_mask for s in samples] or [np.zeros(0, bool)]),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)}


def build_samples(tok: Tokenizer, chats: list[Chat],
                  opts: SFTOptions) -> tuple[dict[str, list[Sample]], dict[str, dict[str, int]], list[dict[str, str]]]:
    """(samples per split, per-split conversation counts and truncation counts, truncation reports)."""
    by_split: dict[str, list[Sample]] = {s: [] for s in SPLITS}
    counts = {"conversations": dict.fromkeys(SPLITS, 0),
              "truncation": {"samples_truncated": 0, "rounds_dropped": 0, "samples_dropped": 0}}
    reports = []
    for c in chats:
        split = "heldout" if shards.is_heldout(c.digest, opts.heldout_fraction) else "train"
        samples, why = conversation_samples(tok, c, opts.max_len, opts.truncate)
        counts["conversations"][split] += 1
        by_split[split] += samples
        reports += why
        counts["truncation"]["samples_truncated"] += sum(s.rounds_dropped > 0 for s in samples)
        counts["truncation"]["rounds_dropped"] += sum(s.rounds_dropped for s in samples)
        counts["truncation"]["samples_dropped"] += sum(r["kind"] == "dropped_too_long" for r in why)
    return by_split, counts, reports


def write_sft_dataset(out: str, info: TokenizerInfo, inputs: Sequence[str], chats: list[Chat],
                      malformed: list[dict[str, str]], lines: int, opts: SFTOptions) -> dict[str, Any]:
    """Writes tokenizer.json, <split>/{tokens,assistant_mask,offsets}.npy and finally metadata.json (present
    <=> complete); returns the metadata. Raises InputError when no sample is left to write."""
    tok = Tokenizer.from_str(info.json)
    if not chat.has_chat_tokens(tok):
        raise InputError(f"tokenizer {info.source} lacks GLM's chat tokens (docs/chat.md#special-tokens); use "
                         "data_prep's trained tokenizer or GLM's own")
    by_split, counts, truncation = build_samples(tok, chats, opts)
    if not any(by_split.values()):
        raise InputError(f"all {len(chats)} valid conversation(s) were dropped as longer than --max-len "
                         f"{opts.max_len}; raise it (or use --truncate rounds)")
    metadata_path = begin_dataset(out, info)
    splits = {}
    for split, samples in by_split.items():
        arrays = _split_arrays(samples)
        save_split(out, split, arrays)
        lengths = np.diff(arrays["offsets"])
        splits[split] = {"conversations": counts["conversations"][split], "samples": len(samples),
                         "tokens": int(lengths.sum()), "assistant_tokens": int(arrays["assistant_mask"].sum()),
                         "max_sample_tokens": int(lengths.max(initial=0))}
    reports = malformed + truncation
    meta = {
        "version": METADATA_VERSION,
        "kind": "sft",
        "format": {"layout": "<split>/<name>.npy", "splits": list(SPLITS), "arrays": ARRAYS},
        "tokenizer": info.metadata(),
        "inputs": list(inputs),
        "conversations": {"lines": lines, "valid": len(chats), "malformed": len(malformed),
                          "by_kind": dict(sorted(_count_kinds(malformed).items()))},
        "splits": splits,
        "truncation": {"mode": opts.truncate, "max_len": opts.max_len, **counts["truncation"]},
        "reports": reports[:opts.max_reports],
        "reports_left_out": max(0, len(reports) - opts.max_reports),
        "config": dataclasses.asdict(opts),
    }
    atomic.write_json(metadata_path, meta)
    return meta


def _count_kinds(reports: list[dict[str, str]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in reports:
        out[r["kind"]] = out.get(r["kind"], 0) + 1
    return out


# --- what the CLI prints -------------------------------------------------------------------------------

SHOWN_REPORTS = 20


def skip_report_lines(meta: dict[str, Any], skipped: list[dict[str, str]], counts: dict[str, Any], what: str,
                      unit: str, size_key: str) -> list[str]:
    """The warnings `sft` and `preferences` share: each skipped line as `warning: file:line: reason` (the first
    20), how many of `counts["lines"]` were skipped by kind, and each split left empty by --heldout-fraction.
    `what`: the skipped lines ("malformed line(s)"); `unit`: what a valid line is ("conversation(s)"); `size_key`:
    a split's count in meta["splits"]."""
    lines = [f"warning: {r['message']}" for r in skipped[:SHOWN_REPORTS]]
    if len(skipped) > SHOWN_REPORTS:
        lines.append(f"warning: ... and {len(skipped) - SHOWN_REPORTS} more (metadata.json lists them)")
    if skipped:
        kinds = ", ".join(f"{k} {n}" for k, n in counts["by_kind"].items())
        lines.append(f"warning: skipped {len(skipped)} {what} of {counts['lines']} ({kinds})")
    fraction = meta["config"]["heldout_fraction"]
    for split, s in meta["splits"].items():
        if not s[size_key] and 0 < fraction < 1:
            lines.append(f"warning: the {split} split is empty (--heldout-fraction {fraction}, "
                         f"{counts['valid']} valid {unit})")
    return lines


def report_lines(meta: dict[str, Any], malformed: list[dict[str, str]]) -> list[str]:
    """stderr: each skipped line as `warning: file:line: reason` (the first 20), then the counts."""
    lines = skip_report_lines(meta, malformed, meta["conversations"], "malformed line(s)", "conversation(s)",
                              "samples")
    t = meta["truncation"]
    if t["samples_truncated"] or t["samples_dropped"]:
        lines.append(f"warning: {t['samples_truncated']} sample(s) lost {t['rounds_dropped']} earliest round(s) and "
                     f"{t['samples_dropped']} were dropped to fit --max-len {t['max_len']} (metadata.json: reports)")
    return lines


def summary_lines(meta: dict[str, Any]) -> list[str]:
    lines = []
    for split, s in meta["splits"].items():
        lines.append(f"[{split}] {s['conversations']:,} conversations -> {s['samples']:,} samples, "
                     f"{s['tokens']:,} tokens ({s['assistant_tokens']:,} trained), longest {s['max_sample_tokens']}")
    tok = meta["tokenizer"]
    lines.append(f"tokenizer: {tok['source']} vocab {tok['vocab_size']}")
    return lines

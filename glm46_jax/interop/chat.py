"""GLM-4.5/4.6's chat format: messages -> text -> token ids, with the mask of what the assistant says.

    messages = chat.load_conversation("chat.json").messages         # or chat.parse_messages(obj, "request")
    text = chat.render(messages, add_generation_prompt=True)          # the built-in renderer (docs/chat.md)
    ids = chat.encode_prompt(tok, messages, template=chat.load_template(hf_dir))   # an HF dir's own template
    sft = chat.encode(tok, messages, close_final_turn=True)          # sft.ids, sft.assistant_mask
    stops = chat.stop_token_ids(tok)                                  # <|endoftext|>, <|user|>, <|observation|>
    more = chat.encode_tool_turn(tok, ["42"], enable_thinking=False)  # after <|observation|>: result, next turn

The built-in renderer is plain Python and renders what the released GLM-4.5/4.6 Jinja template renders
(tests/test_chat.py compares token ids with transformers' `apply_chat_template` on that template).
`CHAT_TEMPLATE` is our own Jinja version of the same format: the HF export writes it into tokenizer_config.json
so vLLM/SGLang/transformers render exported models' chats the same way. Templates read from HF directories are
rendered like transformers renders them (sandboxed Jinja, trim_blocks/lstrip_blocks, JSON `tojson`,
`raise_exception`).

Messages are the OpenAI/HF list of {"role", "content", optional "reasoning_content", "tool_calls"}; roles are
system, user, assistant, tool, and "observation" (GLM's name for a tool turn, rewritten to "tool").
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar, NamedTuple

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
from jaxtyping import Bool, Int
from tokenizers import Tokenizer

from glm46_jax.errors import InputError

GMASK, SOP = "[gMASK]", "<sop>"
SYSTEM, USER, ASSISTANT, OBSERVATION = "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"
THINK, END_THINK = "<think>", "</think>"
NOTHINK = "/nothink"  # appended to user turns when thinking is off
EOS = "<|endoftext|>"
# Tokens that structure a conversation: special (decoding with skip_special_tokens drops them).
CHAT_SPECIAL_TOKENS = (GMASK, SOP, SYSTEM, USER, ASSISTANT, OBSERVATION)
# Markup inside the assistant's and tools' text: single tokens, but not special, so decoded output keeps them
# for the servers' reasoning and tool-call parsers (as in GLM's own tokenizer). docs/chat.md#special-tokens
CHAT_MARKUP_TOKENS = (THINK, END_THINK, "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                      "</arg_value>", "<tool_response>", "</tool_response>", NOTHINK)
CHAT_TOKENS = CHAT_SPECIAL_TOKENS + CHAT_MARKUP_TOKENS
# What a tokenizer needs to encode the format; /nothink also reads fine as plain text.
REQUIRED_CHAT_TOKENS = tuple(t for t in CHAT_TOKENS if t != NOTHINK)

ROLES = ("system", "user", "assistant", "tool")
_ROLE_ALIASES = {"observation": "tool"}
_REASONING_ALIASES = ("reasoning", "thinking")  # other names clients send reasoning under (transformers reads them)

_TOOLS_HEADER = ("<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                 "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
_TOOLS_FOOTER = ("</tools>\n\nFor each function call, output the function name and arguments within the following "
                 "XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n"
                 "<arg_value>{arg-value-1}</arg_value>\n<arg_key>{arg-key-2}</arg_key>\n"
                 "<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>")


# ---------------------------------------------------------------------------------------------- messages

class Conversation(NamedTuple):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


def load_conversation(path: str) -> Conversation:
    """A chat file: a JSON list of messages, or {"messages": [...], "tools": [...]} (tools optional)."""
    with open(path, encoding="utf-8") as f:  # a missing file is FileNotFoundError, a user error already
        text = f.read()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); a chat file is a "
                         'JSON list of {"role": ..., "content": ...} messages or {"messages": [...], "tools": [...]}')
    if isinstance(obj, dict):
        unknown = sorted(set(obj) - {"messages", "tools"})
        if "messages" not in obj or unknown:
            raise InputError(f"{path}: a chat object needs a \"messages\" list and may have \"tools\""
                             + (f"; unknown keys {unknown}" if unknown else ""))
        return Conversation(parse_messages(obj["messages"], path), parse_tools(obj.get("tools"), path))
    return Conversation(parse_messages(obj, path), None)


def parse_tools(tools: Any, source: str) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InputError(f"{source}: tools must be a list of JSON-schema objects "
                         '({"type": "function", "function": {"name", "description", "parameters"}})')
    return tools


def parse_messages(messages: Any, source: str) -> list[dict[str, Any]]:
    """Checked, normalised copies of `messages`; a mistake raises InputError naming `source` and the message.

    Normalising: keys whose value is null are dropped (as transformers does), role "observation" becomes
    "tool", reasoning sent as "reasoning"/"thinking" becomes "reasoning_content", and tool-call arguments sent
    as a JSON string (the OpenAI wire form) are parsed to the object the template iterates over.
    """
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{source}: expected a non-empty list of messages, each {{\"role\": ..., \"content\": ...}}")
    return [_parse_message(m, f"{source}: message {i}") for i, m in enumerate(messages)]


def _parse_message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise InputError(f"{where} is {type(message).__name__}, not an object with \"role\" and \"content\"")
    m = {k: v for k, v in message.items() if v is not None}
    role = m.get("role")
    role = _ROLE_ALIASES.get(role, role)
    if role not in ROLES:
        raise InputError(f"{where} has role {m.get('role')!r}; GLM's chat format knows "
                         f"{', '.join(ROLES)} (and observation, another name for tool)")
    m["role"] = role
    if role == "tool":
        _check_tool_content(m.get("content"), where)
    else:
        _check_text_content(m.get("content"), where)
    for alias in _REASONING_ALIASES:
        if "reasoning_content" not in m and alias in m:
            m["reasoning_content"] = m[alias]
    if "reasoning_content" in m and (role != "assistant" or not isinstance(m["reasoning_content"], str)):
        raise InputError(f"{where}: reasoning_content must be a string, on an assistant message")
    if "tool_calls" in m:
        if role != "assistant" or not isinstance(m["tool_calls"], list):
            raise InputError(f"{where}: tool_calls must be a list, on an assistant message")
        m["tool_calls"] = [_parse_tool_call(c, f"{where} tool call {j}") for j, c in enumerate(m["tool_calls"])]
    return m


def _check_text_content(content: Any, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not (isinstance(part, str) or (isinstance(part, dict) and part.get("type") == "text"
                                              and isinstance(part.get("text"), str))):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InputError(f"{where}: content part {j} is {kind!r}; only text parts "
                                 '({"type": "text", "text": ...}) are supported')
        return
    raise InputError(f"{where}: content must be a string or a list of text parts, not {type(content).__name__}")


def _check_tool_content(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if isinstance(content, list) and all(isinstance(r, str) or (isinstance(r, dict) and isinstance(r.get("output"), str))
                                         for r in content):
        return
    raise InputError(f"{where}: a tool message's content must be a string (or a list of strings or "
                     '{"output": ...} results)')


def _parse_tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise InputError(f"{where} is not an object")
    call = dict(call)
    fn = dict(call["function"]) if isinstance(call.get("function"), dict) else call  # OpenAI shape, or flat
    if not isinstance(fn.get("name"), str):
        raise InputError(f"{where} has no \"name\" string (expected {{\"function\": {{\"name\", \"arguments\"}}}})")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: arguments is a string that is not JSON ({e.msg})")
    if not isinstance(args, dict):
        raise InputError(f"{where}: arguments must be a JSON object of argument name -> value")
    fn["arguments"] = args
    if fn is not call:
        call["function"] = fn
    return call


# ---------------------------------------------------------------------------------------------- built-in renderer

def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p if isinstance(p, str) else p["text"] for p in content)


def _argument(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _assistant_turn(m: Mapping[str, Any], keep_reasoning: bool) -> str:
    """What follows <|assistant|>: thinking, answer, tool calls. docs/chat.md#assistant-turns"""
    content = _text(m.get("content"))
    reasoning = m.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = ""
        if END_THINK in content:  # thinking written inline, as the model emits it
            reasoning = content.split(END_THINK)[0].rstrip("\n").split(THINK)[-1].lstrip("\n")
            content = content.split(END_THINK)[-1].lstrip("\n")
    # Only turns after the last user message keep their thinking; earlier ones show it empty.
    out = f"\n{THINK}{reasoning.strip()}{END_THINK}" if keep_reasoning and reasoning else f"\n{THINK}{END_THINK}"
    if content.strip():
        out += "\n" + content.strip()
    for call in m.get("tool_calls") or ():
        fn = call.get("function") or call
        args = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_argument(v)}</arg_value>\n"
                       for k, v in fn["arguments"].items())
        out += f"\n<tool_call>{fn['name']}\n{args}</tool_call>"
    return out


def _segments(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
              add_generation_prompt: bool, enable_thinking: bool) -> list[tuple[str, bool]]:
    """The rendered text in pieces, each flagged True when it is assistant output (docs/chat.md#assistant-mask)."""
    out = [(GMASK + SOP, False)]
    if tools:
        out.append((_TOOLS_HEADER + "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tools) + _TOOLS_FOOTER,
                    False))
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    for i, m in enumerate(messages):
        role, previous = m["role"], messages[i - 1]["role"] if i else None
        # The token opening a user or tool turn right after the assistant is how the assistant ends its turn.
        ends_assistant_turn = previous == "assistant"
        if role == "system":
            out.append((SYSTEM + "\n" + _text(m.get("content")), False))
        elif role == "user":
            text = _text(m.get("content"))
            nothink = "" if enable_thinking or text.endswith(NOTHINK) else NOTHINK
            out += [(USER, ends_assistant_turn), ("\n" + text + nothink, False)]
        elif role == "assistant":
            out += [(ASSISTANT, False), (_assistant_turn(m, i > last_user), True)]
        else:  # tool
            content = m["content"]
            if isinstance(content, str):  # consecutive tool results share one <|observation|>
                opener = "" if previous == "tool" else OBSERVATION
                results = [content]
            else:
                opener, results = OBSERVATION, [r if isinstance(r, str) else r["output"] for r in content]
            out += [(opener, ends_assistant_turn),
                    ("".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in results), False)]
    if add_generation_prompt:
        out.append((ASSISTANT + ("" if enable_thinking else f"\n{THINK}{END_THINK}"), False))
    return out


def render(messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
           add_generation_prompt: bool = False, enable_thinking: bool = True) -> str:
    """The conversation in GLM-4.5/4.6's format (the released template's output, docs/chat.md#the-format)."""
    messages = parse_messages(list(messages), "messages")
    return "".join(s for s, _ in _segments(messages, tools, add_generation_prompt, enable_thinking))


def tool_turn(results: Sequence[str], *, enable_thinking: bool = True) -> str:
    """What follows the <|observation|> a model ends a tool-calling turn with: the tools' results, then the next
    assistant turn's opening, exactly as `render` writes them in a whole conversation (an agentic rollout appends
    it to the tokens the model generated; docs/rl.md#agentic-rl)."""
    messages = [{"role": "assistant", "content": ""}, *({"role": "tool", "content": r} for r in results)]
    segments = _segments(messages, None, True, enable_thinking)
    first = next(i for i, (s, _) in enumerate(segments) if s == OBSERVATION)
    return "".join(s for s, _ in segments[first + 1:])


# ---------------------------------------------------------------------------------------------- Jinja templates

class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask markers) renders its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes and sorts keys; chat templates expect plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_template(template: str, messages: Sequence[Mapping[str, Any]], *,
                    tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = False,
                    enable_thinking: bool = True, source: str = "chat template", **variables: Any) -> str:
    """`messages` rendered by a Jinja chat template as transformers' apply_chat_template renders it.

    `variables` are further template variables (transformers passes the tokenizer's bos_token, eos_token, ...).
    A template that does not parse, or that rejects the conversation, is an InputError naming `source`.
    """
    messages = parse_messages(list(messages), "messages")
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise InputError(f"{source}: the chat template does not parse (line {e.lineno}: {e.message})") from e
    try:
        return compiled.render(messages=messages, tools=list(tools) if tools else None, documents=None,
                               add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                               **variables)
    except jinja2.TemplateError as e:  # raise_exception(...) or an undefined field: the conversation doesn't fit
        raise InputError(f"{source}: rendering the conversation failed: {e}") from e


def render_chat(messages: Sequence[Mapping[str, Any]], *, template: str | None = None,
                tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = False,
                enable_thinking: bool = True) -> str:
    """`template`'s rendering when given (an HF directory's, see load_template), else the built-in one."""
    if template is None:
        return render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                      enable_thinking=enable_thinking)
    return render_template(template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                           enable_thinking=enable_thinking)


def load_template(hf_dir: str) -> str | None:
    """The chat template of an HF directory, where transformers looks for it: chat_template.jinja (transformers 5
    saves it there), else tokenizer_config.json's "chat_template" (a string, or named templates: "default").
    None when the directory has neither."""
    jinja_file = os.path.join(hf_dir, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    config_file = os.path.join(hf_dir, "tokenizer_config.json")
    if not os.path.isfile(config_file):
        return None
    with open(config_file, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise InputError(f"{config_file}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
    template = config.get("chat_template") if isinstance(config, dict) else None
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise InputError(f"{config_file}: chat_template lists templates {sorted(map(str, named))} but none named "
                         "\"default\"; add one or write the template to chat_template.jinja")
    raise InputError(f"{config_file}: chat_template is a {type(template).__name__}; expected the template string")


# ---------------------------------------------------------------------------------------------- token ids

@dataclasses.dataclass(frozen=True)
class ChatTokens:
    ids: Int[np.ndarray, " seq"]  # int32
    assistant_mask: Bool[np.ndarray, " seq"]  # True: ids[i] is assistant output the SFT loss predicts


def _chat_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    # data_prep's encoder reads special-token text in documents as plain text; a chat's markup must not be.
    if not tokenizer.encode_special_tokens:
        return tokenizer
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.encode_special_tokens = False
    return copy


def _check_chat_tokens(tokenizer: Tokenizer, text: str) -> None:
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    missing = [t for t in REQUIRED_CHAT_TOKENS if t in text and t not in added]
    if missing:
        raise InputError(f"the tokenizer has no token for {missing}: it was not built for chat (data_prep's trained "
                         "tokenizer and GLM's own have them); use a tokenizer with GLM's chat tokens")


def encode(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *,
           tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = False,
           enable_thinking: bool = True, close_final_turn: bool = False) -> ChatTokens:
    """Token ids of the built-in rendering and the mask of assistant output (docs/chat.md#assistant-mask).

    Without close_final_turn the ids are exactly the tokenized `render(...)`. With it, a conversation that ends
    with an assistant message gets the token that ends that turn appended and trained (<|observation|> after
    tool calls, else <|user|>): what an SFT example needs so the model learns to stop.
    """
    messages = parse_messages(list(messages), "messages")
    segments = _segments(messages, tools, add_generation_prompt, enable_thinking)
    if close_final_turn and messages[-1]["role"] == "assistant" and not add_generation_prompt:
        segments.append((OBSERVATION if messages[-1].get("tool_calls") else USER, True))
    text = "".join(s for s, _ in segments)
    tok = _chat_tokenizer(tokenizer)
    _check_chat_tokens(tok, text)
    enc = tok.encode(text, add_special_tokens=False)
    bounds = np.cumsum([0] + [len(s) for s, _ in segments])
    flags = np.asarray([f for _, f in segments], bool)
    # Every piece boundary sits next to a chat token, so no token straddles one; a token belongs to the piece
    # holding its first character (byte-level pieces of one character share its offsets).
    starts = np.asarray([s for s, _ in enc.offsets], np.int64)
    piece = np.searchsorted(bounds, starts, side="right") - 1
    return ChatTokens(ids=np.asarray(enc.ids, np.int32), assistant_mask=flags[piece] if len(piece) else
                      np.zeros(0, bool))


def encode_prompt(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *, template: str | None = None,
                  tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
                  enable_thinking: bool = True) -> Int[np.ndarray, " seq"]:
    """int32 token ids of `render_chat(...)` (an HF dir's template if given), ready to generate from."""
    return _ids(tokenizer, render_chat(messages, template=template, tools=tools,
                                       add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking))


def encode_tool_turn(tokenizer: Tokenizer, results: Sequence[str], *, enable_thinking: bool = True
                     ) -> Int[np.ndarray, " seq"]:
    """int32 token ids of `tool_turn(results)`: what an agentic rollout appends after the model's <|observation|>."""
    return _ids(tokenizer, tool_turn(results, enable_thinking=enable_thinking))


def _ids(tokenizer: Tokenizer, text: str) -> Int[np.ndarray, " seq"]:
    # Chat text as int32 ids, its markup read as the chat tokens it must be.
    tok = _chat_tokenizer(tokenizer)
    _check_chat_tokens(tok, text)
    return np.asarray(tok.encode(text, add_special_tokens=False).ids, np.int32)


def stop_token_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids generation stops at: <|endoftext|>, <|user|>, <|observation|>, those the tokenizer has."""
    ids = (tokenizer.token_to_id(t) for t in (EOS, USER, OBSERVATION))
    return [i for i in ids if i is not None]


def has_chat_tokens(tokenizer: Tokenizer) -> bool:
    """Whether every token the format needs is one added token of `tokenizer` (so it encodes as one id)."""
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    return all(t in added for t in REQUIRED_CHAT_TOKENS)


# ---------------------------------------------------------------------------------------------- shipped template

# Our Jinja rendering of the format, written for exports (docs/chat.md#the-shipped-template). It renders what
# `render` renders; every tag trims its own whitespace, so it renders the same with or without trim_blocks.
CHAT_TEMPLATE = importlib.resources.files("glm46_jax").joinpath("chat_template.jinja").read_text(encoding="utf-8")

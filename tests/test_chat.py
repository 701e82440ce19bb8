"""GLM-4.5/4.6 chat format (glm46_jax.interop.chat): the built-in renderer and our shipped Jinja template give the
token ids transformers' apply_chat_template gives with the released template (fixtures from make_chat_fixtures.py); the
assistant mask covers exactly the hand-written assistant output; HF directories' templates are read and used;
exports carry the template and the chat stop ids; bad chat input is a one-line InputError."""

import json
import os

import jinja2
import jinja2.sandbox
import numpy as np
import pytest
from conftest import FIXTURES
from tokenizers import Tokenizer

from data_prep import tokenizer as data_tokenizer
from glm46_jax.interop import chat
from glm46_jax.training import checkpoint
from glm46_jax.interop import convert
from glm46_jax.errors import InputError

CHAT = os.path.join(FIXTURES, "chat")
HF_TOKENIZER = os.path.join(CHAT, "hf_tokenizer")
with open(os.path.join(CHAT, "apply_chat_template.json"), encoding="utf-8") as _f:
    GOLDEN = json.load(_f)
EXAMPLES = {e["name"]: e for e in GOLDEN["examples"]}
with open(os.path.join(CHAT, "glm45_official_chat_template.jinja"), encoding="utf-8") as _f:
    OFFICIAL = _f.read()
# Ids in the fixture tokenizer, read off its tokenizer.json by hand.
EOS_ID, USER_ID, OBSERVATION_ID = 1, 5, 7


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(os.path.join(HF_TOKENIZER, "tokenizer.json"))


def _flags(e):
    return {"tools": e["tools"], "add_generation_prompt": e["add_generation_prompt"],
                "enable_thinking": e["enable_thinking"]}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_builtin_renderer_gives_transformers_ids(tok, name):
    e = EXAMPLES[name]
    assert chat.render(e["messages"], **_flags(e)) == e["text"]
    encoded = chat.encode(tok, e["messages"], **_flags(e))
    assert encoded.ids.dtype == np.int32 and encoded.ids.tolist() == e["ids"]
    assert encoded.assistant_mask.shape == encoded.ids.shape


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_shipped_template_gives_transformers_ids(tok, name):
    e = EXAMPLES[name]
    assert chat.render_template(chat.CHAT_TEMPLATE, e["messages"], **_flags(e)) == e["text"]
    assert chat.encode_prompt(tok, e["messages"], template=chat.CHAT_TEMPLATE, **_flags(e)).tolist() == e["ids"]
    # Our Jinja path renders the released template as transformers does (the environment, tojson, ...).
    assert chat.render_template(OFFICIAL, e["messages"], **_flags(e)) == e["text"]


def _plain_env() -> jinja2.Environment:
    """A sandbox without trim_blocks / lstrip_blocks, with what chat templates expect of a server."""
    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment()
    env.filters["tojson"] = lambda x, ensure_ascii=False: json.dumps(x, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    return env


def test_shipped_template_does_not_depend_on_trim_blocks():
    template = _plain_env().from_string(chat.CHAT_TEMPLATE)
    for e in EXAMPLES.values():
        messages = chat.parse_messages(e["messages"], "fixture")
        assert template.render(messages=messages, **_flags(e)) == e["text"], e["name"]


@pytest.mark.parametrize("message,error", [
    ({"role": "narrator", "content": "x"}, "unknown role narrator"),
    ({"role": "assistant", "tool_calls": [{"name": "f", "arguments": "{}"}]}, "arguments must be a JSON object"),
])
def test_shipped_template_rejects_what_it_cannot_render(message, error):
    """Servers hand the template unchecked messages: it raises rather than rendering them wrongly."""
    with pytest.raises(jinja2.TemplateError, match=error):
        _plain_env().from_string(chat.CHAT_TEMPLATE).render(messages=[message])


EDGE_CASES = {
    "observation_alias_and_mixed_results": ([
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": '{"x": 1.5, "y": "é"}'}}]},
        {"role": "observation", "content": "r1"},
        {"role": "tool", "content": ["r2"]},
        {"role": "tool", "content": "r3"}], True, True),
    "inline_think_without_close_and_blank_reasoning": ([
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>open only"},
        {"role": "assistant", "content": "x", "reasoning_content": "   "},
        {"role": "assistant", "content": "\n<think>\n\nr\n</think>\n\n  ans  ", "reasoning": "alias wins"}],
        False, True),
    "no_user_at_all": ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "<think>t</think>a"}],
                       True, False),
}


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_edge_cases_render_like_the_released_template(name):
    messages, add_generation_prompt, enable_thinking = EDGE_CASES[name]
    flags = {"add_generation_prompt": add_generation_prompt, "enable_thinking": enable_thinking}
    ours = chat.render(messages, **flags)
    assert chat.render_template(chat.CHAT_TEMPLATE, messages, **flags) == ours
    # The released template drops an "observation" turn; fed the same turn as "tool", it agrees with us.
    as_tool = [{**m, "role": "tool"} if m["role"] == "observation" else m for m in messages]
    assert chat.render_template(OFFICIAL, as_tool, **flags) == ours


def test_edge_case_text_by_hand():
    messages, _, _ = EDGE_CASES["observation_alias_and_mixed_results"]
    assert chat.render(messages) == (
        '[gMASK]<sop><|user|>\ngo<|assistant|>\n<think></think>\n<tool_call>f\n<arg_key>x</arg_key>\n'
        '<arg_value>1.5</arg_value>\n<arg_key>y</arg_key>\n<arg_value>é</arg_value>\n</tool_call>'
        '<|observation|>\n<tool_response>\nr1\n</tool_response><|observation|>\n<tool_response>\nr2\n</tool_response>'
        '\n<tool_response>\nr3\n</tool_response>')


def _masked_runs(tok, encoded):
    """The decoded text of each maximal run of masked tokens."""
    runs, current = [], []
    for i, m in zip(encoded.ids.tolist(), encoded.assistant_mask.tolist(), strict=True):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    return [tok.decode(r, skip_special_tokens=False) for r in runs + ([current] if current else [])]


def test_assistant_mask_is_the_assistant_output_and_its_end_token(tok):
    e = EXAMPLES["multi_turn_thinking"]
    closed = chat.encode(tok, e["messages"], close_final_turn=True)
    assert closed.ids.tolist() == e["ids"] + [USER_ID]  # the appended end of the last turn
    assert _masked_runs(tok, closed) == ["\n<think></think>\n51<|user|>", "\n<think>51 + 4 = 55.</think>\n55.<|user|>"]
    open_ = chat.encode(tok, e["messages"])
    assert open_.assistant_mask.tolist() == closed.assistant_mask.tolist()[:-1]

    e = EXAMPLES["tool_call_and_response"]
    runs = _masked_runs(tok, chat.encode(tok, e["messages"], tools=e["tools"], close_final_turn=True))
    assert runs[0].startswith("\n<think>I need the weather tool twice.</think>\n<tool_call>get_weather\n")
    assert runs[0].endswith('<arg_value>{"wind": true, "rain": null}</arg_value>\n</tool_call><|observation|>')
    assert runs[1:] == ["\n<think></think>\nParis: 24 °C. Zürich: 19 °C.<|user|>"]
    # A conversation ending in tool calls closes with <|observation|>; one ending with a user turn is unchanged.
    e = EXAMPLES["tool_results_as_list"]
    calls_only = chat.encode(tok, e["messages"][:2], tools=e["tools"], close_final_turn=True)
    assert calls_only.ids[-1] == OBSERVATION_ID and calls_only.assistant_mask[-1]
    e = EXAMPLES["thinking_off_generation_prompt"]
    prompt = chat.encode(tok, e["messages"], add_generation_prompt=True, enable_thinking=False, close_final_turn=True)
    assert prompt.ids.tolist() == e["ids"] and not prompt.assistant_mask.any()


def test_back_to_back_assistant_turns_have_no_end_token(tok):
    e = EXAMPLES["two_assistant_turns_after_last_user"]
    runs = _masked_runs(tok, chat.encode(tok, e["messages"], close_final_turn=True))
    assert runs == ["\n<think>one</think>\n1", "\n<think>two</think>\n2<|user|>"]


def test_stop_token_ids(tok):
    assert chat.stop_token_ids(tok) == [EOS_ID, USER_ID, OBSERVATION_ID]
    assert chat.stop_token_ids(_without_chat_tokens()) == [1]
    assert chat.has_chat_tokens(tok) and not chat.has_chat_tokens(_without_chat_tokens())


def _without_chat_tokens() -> Tokenizer:
    from tokenizers import decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["hello world"] * 4, trainers.BpeTrainer(
        vocab_size=270, special_tokens=["<|pad|>", "<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return t


def test_encoding_needs_the_chat_tokens():
    with pytest.raises(InputError, match=r"no token for \['\[gMASK\]'"):
        chat.encode(_without_chat_tokens(), [{"role": "user", "content": "hi"}])


def test_encode_special_tokens_setting_does_not_split_the_markup(tok):
    e = EXAMPLES["tool_call_and_response"]
    like_data_prep = Tokenizer.from_str(tok.to_str())
    like_data_prep.encode_special_tokens = True  # data_prep.tokenizer.encoder's setting
    assert chat.encode(like_data_prep, e["messages"], tools=e["tools"]).ids.tolist() == e["ids"]
    assert like_data_prep.encode_special_tokens  # the caller's tokenizer is left as it was


def test_sample_corpus_tokenizer_has_the_fixture_tokenizers_chat_tokens(tok):
    """data_prep's tokens, ids and special flags are those the fixture generator lists independently."""
    def added(t):
        return [(i, a.content, a.special) for i, a in sorted(t.get_added_tokens_decoder().items())]

    trained = data_tokenizer.train_bpe(["def f(x):\n    return x\n", "the cat sat on the mat\n"] * 20, 300)
    assert added(trained) == added(tok)
    assert [c for _, c, _ in added(trained)][:2] == ["<|pad|>", "<|endoftext|>"]
    assert chat.encode(trained, EXAMPLES["tool_call_and_response"]["messages"]).ids[:2].tolist() == [2, 3]


# ---------------------------------------------------------------------------------------------- HF directories

def test_template_saved_by_transformers_is_read_and_used(tok):
    assert chat.load_template(HF_TOKENIZER) == OFFICIAL  # chat_template.jinja, as transformers 5 saved it
    e = EXAMPLES["tool_call_and_response"]
    ids = chat.encode_prompt(tok, e["messages"], template=chat.load_template(HF_TOKENIZER), **_flags(e))
    assert ids.tolist() == e["ids"]


def test_load_template_sources(tmp_path):
    custom = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    d = tmp_path / "config_only"
    d.mkdir()
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": custom}))
    assert chat.load_template(str(d)) == custom
    msgs = [{"role": "user", "content": "hi"}, {"role": "observation", "content": "r"}]
    assert chat.render_chat(msgs, template=chat.load_template(str(d)), add_generation_prompt=True) == "[user]hi[tool]r>"
    assert chat.render_chat(msgs) == "[gMASK]<sop><|user|>\nhi<|observation|>\n<tool_response>\nr\n</tool_response>"

    (d / "chat_template.jinja").write_text("jinja file wins")
    assert chat.load_template(str(d)) == "jinja file wins"

    named = tmp_path / "named"
    named.mkdir()
    (named / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]}))
    assert chat.load_template(str(named)) == "d"
    (named / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "t"}]}))
    with pytest.raises(InputError, match="none named \"default\""):
        chat.load_template(str(named))

    empty = tmp_path / "none"
    empty.mkdir()
    assert chat.load_template(str(empty)) is None
    (empty / "tokenizer_config.json").write_text("{}")
    assert chat.load_template(str(empty)) is None
    (empty / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(InputError, match="tokenizer_config.json: not valid JSON"):
        chat.load_template(str(empty))


def test_template_errors_are_input_errors():
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(InputError, match=r"my dir: the chat template does not parse \(line 1"):
        chat.render_template("{% if %}", msgs, source="my dir")
    with pytest.raises(InputError, match="rendering the conversation failed: no users"):
        chat.render_template("{{ raise_exception('no users') }}", msgs)
    with pytest.raises(InputError, match="message 0: tool_calls must be a list, on an assistant message"):
        chat.render_template(chat.CHAT_TEMPLATE, [{"role": "user", "content": "x", "tool_calls": []}])


# ---------------------------------------------------------------------------------------------- bad input

def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("text,expected", [
    ('[{"role": "user", "content": "hi"', "not valid JSON"),
    ('[{"role": "narrator", "content": "hi"}]', "message 0 has role 'narrator'; GLM's chat format knows system"),
    ('[{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]', "message 1 has role 'bot'"),
    ('[{"content": "hi"}]', "message 0 has role None"),
    ("[]", "expected a non-empty list of messages"),
    ('{"messages": [], "extra": 1}', "unknown keys ['extra']"),
    ('{"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}', "tools must be a list"),
    ('[{"role": "user", "content": [{"type": "image", "url": "x"}]}]', "content part 0 is 'image'"),
    ('[{"role": "user", "content": 3}]', "content must be a string or a list of text parts, not int"),
    ('[{"role": "tool"}]', "a tool message's content must be a string"),
    ('[{"role": "user", "content": "x", "reasoning_content": "r"}]', "reasoning_content must be a string, on an"),
    ('[{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]',
     "message 0 tool call 0: arguments is a string that is not JSON"),
    ('[{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]', 'tool call 0 has no "name"'),
    ('[{"role": "assistant", "tool_calls": [{"name": "f", "arguments": [1]}]}]', "arguments must be a JSON object"),
])
def test_bad_chat_files_are_one_line_input_errors(tmp_path, text, expected):
    path = tmp_path / "chat.json"
    path.write_text(text)
    with pytest.raises(InputError) as err:
        chat.load_conversation(str(path))
    line = _one_line(err)
    assert line.startswith(str(path)) and expected in line


def test_chat_file_forms(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi", "name": None}],
                                "tools": [{"type": "function", "function": {"name": "f"}}]}))
    conv = chat.load_conversation(str(path))
    assert conv.messages == [{"role": "user", "content": "hi"}] and conv.tools[0]["function"]["name"] == "f"
    path.write_text(json.dumps([{"role": "observation", "content": "r"}]))
    assert chat.load_conversation(str(path)) == ([{"role": "tool", "content": "r"}], None)
    with pytest.raises(FileNotFoundError):
        chat.load_conversation(str(tmp_path / "missing.json"))


# ---------------------------------------------------------------------------------------------- export

def _tokenizer_file(path, with_chat: bool) -> str:
    t = data_tokenizer.train_bpe(["def add(x, y):\n    return x + y\n", "the cat sat on the mat\n"] * 20, 400)
    if not with_chat:
        t = _without_chat_tokens()
    t.save(path)
    return path


def test_tokenizer_files_with_and_without_chat_tokens(tmp_path):
    from glm46_jax.config import get_preset

    cfg = get_preset("tiny")  # eos (1,), pad 0
    files = convert.tokenizer_files(_tokenizer_file(str(tmp_path / "chat.json"), True), cfg)
    tc, gc = files["tokenizer_config.json"], files["generation_config.json"]
    assert tc["chat_template"] == chat.CHAT_TEMPLATE and tc["eos_token"] == "<|endoftext|>"
    assert gc["eos_token_id"] == [1, USER_ID, OBSERVATION_ID] and gc["pad_token_id"] == 0
    flags = {v["content"]: (int(k), v["special"]) for k, v in tc["added_tokens_decoder"].items()}
    assert flags["<|user|>"] == (USER_ID, True) and flags["<think>"] == (8, False) and flags["/nothink"] == (18, False)
    assert len(flags) == 19

    files = convert.tokenizer_files(_tokenizer_file(str(tmp_path / "plain.json"), False), cfg)
    assert "chat_template" not in files["tokenizer_config.json"]
    assert files["generation_config.json"]["eos_token_id"] == 1


@pytest.fixture(scope="module")
def chat_export(tmp_path_factory, mesh1):
    """The tiny preset (random init) exported with a data_prep-trained tokenizer that has the chat tokens."""
    from glm46_jax.config import get_preset
    from glm46_jax.model import init_model

    root = tmp_path_factory.mktemp("chat_export")
    cfg = get_preset("tiny")
    _, params, buffers = init_model(cfg, mesh1, 0)
    run = str(root / "run")
    checkpoint.save_params(os.path.join(run, "checkpoints"), 1, params, buffers, cfg)
    tokenizer = _tokenizer_file(str(root / "tokenizer.json"), True)
    export = str(root / "export")
    convert.main(["ckpt-to-hf", "--run-dir", run, "--out", export, "--tokenizer", tokenizer, "--dtype", "float32"])
    return export


def test_export_carries_the_chat_template_and_stop_ids(chat_export):
    with open(os.path.join(chat_export, "tokenizer_config.json")) as f:
        assert json.load(f)["chat_template"] == chat.CHAT_TEMPLATE
    with open(os.path.join(chat_export, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == [1, USER_ID, OBSERVATION_ID]
    template = chat.load_template(chat_export)
    assert template == chat.CHAT_TEMPLATE
    tok = Tokenizer.from_file(os.path.join(chat_export, "tokenizer.json"))
    e = EXAMPLES["tool_response_generation_prompt"]
    assert (chat.encode_prompt(tok, e["messages"], template=template, tools=e["tools"]).tolist()
            == chat.encode(tok, e["messages"], tools=e["tools"], add_generation_prompt=True).ids.tolist())


@pytest.mark.live_hf
def test_export_chats_in_transformers(chat_export):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(chat_export)
    tok = Tokenizer.from_file(os.path.join(chat_export, "tokenizer.json"))
    for e in EXAMPLES.values():
        theirs = hf.apply_chat_template(e["messages"], tokenize=True, return_dict=False, **_flags(e))
        assert list(theirs) == chat.encode(tok, e["messages"], **_flags(e)).ids.tolist(), e["name"]
    decoded = hf.decode(chat.encode(tok, EXAMPLES["multi_turn_thinking"]["messages"]).ids.tolist(),
                        skip_special_tokens=True)
    assert "<think>" in decoded and "<|user|>" not in decoded  # markup kept, role tokens dropped

"""Tool environments for agentic RL (recipes/rl/environments.py), no model: GLM's tool-call markup as GLM's own chat
template renders it parses back to the same calls; malformed markup, unknown tools, bad arguments, failing,
timed-out and memory-hungry programs all come back as "error:" observations, never exceptions; the calculator
against hand-computed values; the lookup store's search and open; the registry's errors."""

import json
import os

import pytest

from glm46_jax.errors import InputError
from glm46_jax.interop import chat
from glm46_jax.recipes.rl import environments as envs
from glm46_jax.recipes.rl.environments import ToolCall

TEMPLATE = os.path.join(os.path.dirname(__file__), os.pardir, "glm46_jax", "chat_template.jinja")


def test_calls_rendered_by_glms_template_parse_back():
    calls = [{"function": {"name": "calculate", "arguments": {"expression": "(12 + 30) * 7"}}},
             {"function": {"name": "python", "arguments": {"code": "x = [1, 2]\nprint(sum(x))", "n": 3}}}]
    with open(TEMPLATE) as f:
        text = chat.render_template(f.read(), [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "Let me compute.",
                                                "tool_calls": calls}])
    turn = text.split("<|assistant|>")[-1]
    got, error = envs.parse_tool_calls(turn)
    assert error is None
    # the template writes non-string values as JSON: 3 -> "3"
    assert got == [ToolCall("calculate", {"expression": "(12 + 30) * 7"}),
                   ToolCall("python", {"code": "x = [1, 2]\nprint(sum(x))", "n": "3"})]
    assert envs.parse_tool_calls("The answer is 4.") == ([], None)


@pytest.mark.parametrize("text, says", [
    ("<tool_call>calculate\n<arg_key>expression</arg_key>\n<arg_value>1+1</arg_value>\n", "not closed"),
    ("<tool_call>\n<arg_key>expression</arg_key><arg_value>1</arg_value></tool_call>", "start with the tool's name"),
    ("<tool_call>calculate\nplease <arg_key>expression</arg_key><arg_value>1</arg_value></tool_call>",
     "not an <arg_key>/<arg_value> pair: 'please"),
    ("<tool_call>calculate\n<arg_key>expression</arg_key></tool_call>", "not an <arg_key>/<arg_value> pair"),
    (("<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key><arg_value>2</arg_value>"
      "</tool_call>"), "argument 'a' is given twice"),
    ("<tool_call>f\n<tool_call>g\n</tool_call></tool_call>", "not an <arg_key>/<arg_value> pair"),
])
def test_malformed_markup_is_an_observation(text, says):
    calls, error = envs.parse_tool_calls(text)
    assert calls == [] and error.startswith("error: ") and says in error, error
    env = envs.resolve("calculator")
    assert envs.observations(env, calls, error, {}) == [error]


@pytest.mark.parametrize("expression, want", [
    ("(7 + 5) / 4", "3"),
    ("1/3 + 1/6", "1/2"),
    ("0.1 + 0.2", "3/10"),  # exact, not 0.30000000000000004
    ("-2 ** 10 + 17 // 5 - 17 % 5", str(-1024 + 3 - 2)),
    ("123456789012345678901234567890 * 987654321098765432109876543210",
     "121932631137021795226185032733622923332237463801111263526900"),
    ("2 ** 1001", "error: the power has more than 1000 digits"),
    ("1 / (3 - 3)", "error: division by zero"),
    ("__import__('os').system('true')", "error: Call is not arithmetic"),
    ("x + 1", "error: Name is not arithmetic"),
    ("2 ** 0.5", "error: only whole-number powers"),
    ("1 +", "error: not an arithmetic expression"),
])
def test_calculator(expression, want):
    got = envs.resolve("calculator").call(ToolCall("calculate", {"expression": expression}), {})
    assert got == want or (want.startswith("error:") and got.startswith(want)), got


def test_tool_and_argument_mistakes_are_observations():
    env = envs.resolve("calculator")
    assert env.call(ToolCall("calc", {"expression": "1"}), {}) == "error: no tool 'calc'; the tools are calculate"
    assert env.call(ToolCall("calculate", {"expr": "1"}), {}) == \
        "error: calculate takes the arguments expression; missing expression; unexpected expr"
    messages, tools = env.start({"prompt": "What is 2 + 2?", "answer": "4"})
    assert [m["role"] for m in messages] == ["system", "user"] and messages[1]["content"] == "What is 2 + 2?"
    assert tools[0]["function"]["name"] == "calculate"
    assert tools[0]["function"]["parameters"]["required"] == ["expression"]
    assert env.reward("The answer is 4.", {"answer": "4"}) == 1.0 and env.reward("The answer is 5.", {"answer": "4"}) == 0


def test_python_tool_output_failures_time_and_memory():
    env = envs.resolve("python", code_timeout_s=2.0, code_memory_mb=128)
    run = lambda code: env.call(ToolCall("python", {"code": code}), {})
    assert run("print(sum(range(101)))") == "5050\n"
    assert run("x = 1") == "(no output: print what you want to see)"
    assert run("print('so far')\nraise ValueError('bad input')") == "error: ValueError: bad input\nso far"
    assert run("while True:\n    pass").startswith("error: the program did not finish within 2 s")
    assert run("b = bytearray(1 << 30)\nprint(len(b))") == "error: MemoryError"
    assert run("import socket\nsocket.socket()").startswith("error: PermissionError: sandbox: socket.")
    long = run("print('x' * 5000)")
    assert len(long) < 2100 and long.endswith("more characters cut]")


def test_lookup_search_and_open(tmp_path):
    store = tmp_path / "docs.jsonl"
    docs = [{"id": "d1", "title": "Rivers of Nowhere", "text": "The Blue River is 412 km long."},
            {"id": "d2", "title": "Mountains", "text": "Mount Ash rises 3,101 m above the Blue valley."},
            {"id": "d3", "title": "Lakes", "text": "Lake Quiet holds 7 islands."}]
    store.write_text("".join(json.dumps(d) + "\n" for d in docs))
    env = envs.resolve("lookup", store=str(store))
    search = lambda q: env.call(ToolCall("search", {"query": q}), {})
    assert search("how long is the Blue River") == "d1: Rivers of Nowhere\nd2: Mountains"  # 3 and 1 shared words
    assert search("zebra") == "no document matches; try other words"
    assert env.call(ToolCall("open", {"id": " d3 "}), {}) == "Lakes\nLake Quiet holds 7 islands."
    assert env.call(ToolCall("open", {"id": "d9"}), {}) == "error: no document 'd9'; search for one first"


def test_registry_and_store_errors(tmp_path):
    with pytest.raises(InputError, match="environment 'web' is neither a built-in"):
        envs.resolve("web")
    with pytest.raises(InputError, match="lookup needs its document store"):
        envs.resolve("lookup")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "title": "t", "text": "x"}\n{"id": "a", "title": "u", "text": "y"}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: id 'a' is already used"):
        envs.resolve("lookup", store=str(bad))
    bad.write_text('{"id": "a", "title": "t"}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:1: a document needs string"):
        envs.resolve("lookup", store=str(bad))
    with pytest.raises(InputError, match=r"document store .*missing.jsonl: No such file"):
        envs.resolve("lookup", store=str(tmp_path / "missing.jsonl"))
    made = envs.resolve("test_environments:a_users_environment")  # "module:function" returning an Environment
    assert made.name == "mine" and made.call(ToolCall("calculate", {"expression": "6 * 7"}), {}) == "42"


def a_users_environment():
    return envs.ToolEnvironment("mine", envs.resolve("calculator").tools)

"""Tool environments for agentic RL: how an episode starts, what a tool call returns, the episode's reward; a
registry like the rewards' (rewards.py) and three built-ins that run offline on a CPU (docs/rl.md#tool-environments).

    env = environments.resolve("calculator")
    messages, tools = env.start(item)               # the first turns, and the tools' JSON schemas for chat.render
    calls, error = parse_tool_calls(generated)      # GLM's <tool_call> markup in a generated assistant turn
    observation = env.call(calls[0], item)          # always text, what the next <tool_response> shows the model
    reward = env.reward(final_answer_turn, item)

Nothing a model writes raises here: malformed markup, an unknown tool, a missing or unexpected argument, an
expression that does not evaluate, a program that fails, times out or exhausts its memory each come back as text
starting "error:", which the episode shows the model as the tool's answer.

Built-ins (`BUILTIN`): "calculator" (exact rational arithmetic on an expression), "python" (a program in
rl/sandbox.py's subprocess: time and memory limits, no network, its own directory; its output), "lookup" (search
and open over a local document store, one JSON object per line: {"id", "title", "text"}), "none" (no tools: every
call is refused, the baseline that shows what the tools add). Each rewards the final
answer by `rewards.exact_answer` against item["answer"]; item["prompt"] is the user turn.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any, Protocol

from glm46_jax.errors import InputError, json_lines
from glm46_jax.recipes.rl import rewards, sandbox

MAX_OBSERVATION = 2000  # characters of a tool's answer the model sees; the rest is cut, saying so


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, str]  # as written between <arg_value> tags; a tool converts what it needs


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[list[ToolCall], str | None]:
    """The tool calls in a generated assistant turn, in GLM's markup (docs/chat.md#assistant-turns):
    `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>`. Returns (calls, None), or
    ([], "error: ...") naming what is malformed: an unclosed or nested tag, no name, text between the arguments, a
    key given twice."""
    if text.count("<tool_call>") != text.count("</tool_call>"):
        return [], "error: a <tool_call> is not closed by </tool_call> (or a </tool_call> has no opening tag)"
    calls = []
    for body in _CALL.findall(text):
        name, _, rest = body.strip().partition("\n")
        name = name.strip()
        if not name or "<" in name:
            return [], "error: a tool call must start with the tool's name on its own line, after <tool_call>"
        arguments, at = {}, 0
        for m in _ARG.finditer(rest):
            if m.start() != at:
                break
            key = m.group(1).strip()
            if key in arguments:
                return [], f"error: argument {key!r} is given twice in the call of {name}"
            arguments[key], at = m.group(2), m.end()
        if rest[at:].strip():
            return [], (f"error: the call of {name} has text that is not an <arg_key>/<arg_value> pair: "
                        f"{rest[at:].strip()[:80]!r}")
        calls.append(ToolCall(name, arguments))
    return calls, None


class Environment(Protocol):
    """What agentic RL needs of a task's world (module docstring)."""
    name: str

    def start(self, item: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]: ...
    def call(self, call: ToolCall, item: Mapping[str, Any]) -> str: ...
    def reward(self, text: str, item: Mapping[str, Any]) -> float: ...


@dataclasses.dataclass(frozen=True)
class Tool:
    """One function the model may call: its JSON schema's parts and the Python function that answers it."""
    name: str
    description: str
    parameters: Mapping[str, str]  # argument name -> its description (every argument a required string)
    fn: Callable[..., str]

    @property
    def schema(self) -> dict[str, Any]:
        """OpenAI's function schema, as chat.render lists tools in the system turn."""
        props = {k: {"type": "string", "description": v} for k, v in self.parameters.items()}
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": {
            "type": "object", "properties": props, "required": list(self.parameters)}}}


@dataclasses.dataclass(frozen=True)
class ToolEnvironment:
    """An Environment made of tools: the user turn is item["prompt"], the reward `reward_fn` of the final answer
    (the exact answer by default)."""
    name: str
    tools: tuple[Tool, ...]
    system: str = "Use the tools to work out the answer. End with: The answer is <answer>."
    reward_fn: Callable[[str, Mapping[str, Any]], float] = rewards.exact_answer  # (final answer, item) -> reward

    def start(self, item: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        messages = [{"role": "system", "content": self.system}, {"role": "user", "content": item["prompt"]}]
        return messages, [t.schema for t in self.tools]

    def call(self, call: ToolCall, item: Mapping[str, Any]) -> str:
        del item
        tool = next((t for t in self.tools if t.name == call.name), None)
        if tool is None:
            if not self.tools:
                return "error: no tools here; answer directly"
            return f"error: no tool {call.name!r}; the tools are {', '.join(t.name for t in self.tools)}"
        missing = [k for k in tool.parameters if k not in call.arguments]
        extra = [k for k in call.arguments if k not in tool.parameters]
        if missing or extra:
            return (f"error: {call.name} takes the arguments {', '.join(tool.parameters)}"
                    + (f"; missing {', '.join(missing)}" if missing else "")
                    + (f"; unexpected {', '.join(extra)}" if extra else ""))
        try:
            out = tool.fn(**call.arguments)
        except Exception as e:  # noqa: BLE001 - whatever a tool raises on the model's input is the model's answer
            out = f"error: {type(e).__name__}: {e}"
        if len(out) > MAX_OBSERVATION:
            out = out[:MAX_OBSERVATION] + f"\n[... {len(out) - MAX_OBSERVATION} more characters cut]"
        return out

    def reward(self, text: str, item: Mapping[str, Any]) -> float:
        return self.reward_fn(text, item)


# --- calculator -------------------------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_DIGITS = 1000  # the largest result (numerator or denominator) the calculator gives, in decimal digits


def calculate(expression: str) -> str:
    """An arithmetic expression (+ - * / // % ** and parentheses on integers and decimals) exactly: an integer, or a
    fraction p/q in lowest terms. Anything else (names, calls, attributes) is refused, never evaluated."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        return f"error: not an arithmetic expression ({e.msg})"

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            a, b = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow):
                if b.denominator != 1:
                    raise ValueError("only whole-number powers")
                if abs(b) * max(len(str(a.numerator)), len(str(a.denominator))) > MAX_DIGITS:
                    raise ValueError(f"the power has more than {MAX_DIGITS} digits")
            out = _BINARY[type(node.op)](a, b)
            if max(len(str(abs(out.numerator))), len(str(out.denominator))) > MAX_DIGITS:
                raise ValueError(f"the result has more than {MAX_DIGITS} digits")
            return Fraction(out)
        raise ValueError(f"{type(node).__name__} is not arithmetic (numbers, + - * / // % ** and parentheses)")

    try:
        v = value(tree.body)
    except ZeroDivisionError:
        return "error: division by zero"
    except ValueError as e:
        return f"error: {e}"
    return str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator}"


# --- python -----------------------------------------------------------------------------------------------------

def python_tool(timeout_s: float = 5.0, memory_mb: int = 256) -> Tool:
    def run(code: str) -> str:
        r = sandbox.run_python(code, timeout_s=timeout_s, memory_mb=memory_mb)
        if r.timed_out:
            return f"error: the program did not finish within {timeout_s:g} s and was stopped\n{r.stdout}".rstrip()
        if r.returncode != 0:
            last = r.stderr.strip().splitlines()[-1:] or [f"exit status {r.returncode}"]
            return f"error: {last[0]}\n{r.stdout}".rstrip()
        return r.stdout if r.stdout else "(no output: print what you want to see)"
    return Tool("python", f"Run a Python program (no network, {timeout_s:g} s, {memory_mb} MB); returns what it "
                          "prints.", {"code": "the whole program"}, run)


# --- lookup -----------------------------------------------------------------------------------------------------

def read_store(path: str) -> dict[str, dict[str, str]]:
    """A document store (one {"id", "title", "text"} object per line) by id; InputError naming the line at fault."""
    docs = {}
    for where, doc in json_lines(path, "document store"):
        if not all(isinstance(doc.get(k), str) for k in ("id", "title", "text")):
            raise InputError(f"{where}: a document needs string \"id\", \"title\" and \"text\"")
        if doc["id"] in docs:
            raise InputError(f"{where}: id {doc['id']!r} is already used on an earlier line")
        docs[doc["id"]] = doc
    return docs


def _terms(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def lookup_tools(docs: Mapping[str, Mapping[str, str]], results: int = 3) -> tuple[Tool, Tool]:
    def search(query: str) -> str:
        want = _terms(query)
        scored = sorted(((len(want & _terms(d["title"] + " " + d["text"])), i) for i, d in docs.items()),
                        key=lambda s: (-s[0], s[1]))
        hits = [(n, i) for n, i in scored[:results] if n > 0]
        if not hits:
            return "no document matches; try other words"
        return "\n".join(f"{i}: {docs[i]['title']}" for _, i in hits)

    def open_doc(id: str) -> str:  # "id": the argument's name in the tool's schema
        doc = docs.get(id.strip())
        return f"{doc['title']}\n{doc['text']}" if doc else f"error: no document {id.strip()!r}; search for one first"

    return (Tool("search", f"The ids and titles of up to {results} documents sharing the most words with the query.",
                 {"query": "words to look for"}, search),
            Tool("open", "A document's whole text.", {"id": "a document id that search returned"}, open_doc))


# --- registry ---------------------------------------------------------------------------------------------------

BUILTIN = ("calculator", "python", "lookup", "none")  # none: no tools (a baseline: the same episodes, tools refused)


def resolve(name: str, *, store: str | None = None, code_timeout_s: float = 5.0, code_memory_mb: int = 256
            ) -> Environment:
    """A built-in by name, or "package.module:function" returning an Environment; "lookup" needs the store's
    path. An unknown name or a missing store is an InputError."""
    if name == "calculator":
        return ToolEnvironment(name, (Tool("calculate", "Evaluate an arithmetic expression exactly.",
                                           {"expression": "e.g. (12345 * 678) + 9"}, calculate),))
    if name == "none":
        return ToolEnvironment(name, ())
    if name == "python":
        return ToolEnvironment(name, (python_tool(code_timeout_s, code_memory_mb),))
    if name == "lookup":
        if store is None:
            raise InputError("environment lookup needs its document store (a JSONL file of {\"id\", \"title\", "
                             "\"text\"})")
        return ToolEnvironment(name, lookup_tools(read_store(store)))
    if ":" not in name:
        raise InputError(f"environment {name!r} is neither a built-in ({', '.join(BUILTIN)}) nor 'module:function'")
    return rewards.import_callable(name, "environment")()


def observations(env: Environment, calls: Sequence[ToolCall], error: str | None, item: Mapping[str, Any]
                 ) -> list[str]:
    """The tool turn's answers to a generated turn's calls: the parse error alone when its markup is malformed."""
    return [error] if error is not None else [env.call(c, item) for c in calls]

"""Tools in the model's own chat template: tools described in OpenAI's function schema, shown to the model by
its tokenizer's ``apply_chat_template(tools=...)``, called in a turn as ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` (the Hermes format Qwen's and Llama's templates ask for), run, and answered as a ``tool``
message rendered by the same template, token in, token out (``rollout.tools``: the interaction of a multi-turn
rollout; the reply is context, masked out of the loss).

A tool is registered with its schema (``register_tool``); the built-in ``python`` runs the code it is given in
:func:`rlnb.sandbox.run_python`'s sandbox and answers with what it printed.

Example:
    >>> parse_tool_calls('<tool_call>{"name": "python", "arguments": {"code": "print(2)"}}</tool_call>')
    [('python', {'code': 'print(2)'})]
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from rlnb.errors import ConfigError
from rlnb.sandbox import SandboxConfig, run_python

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass(frozen=True)
class Tool:
    """A tool: its OpenAI function schema and the function that runs it (keyword arguments as the schema's
    ``parameters`` name them; ``sandbox`` too where it takes it), returning text."""

    schema: dict
    fn: Callable

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


TOOLS: dict[str, Tool] = {}


def check_tool_schema(schema, key: str = "rollout.tools") -> dict:
    """``schema`` if it is an OpenAI function-tool schema (``{"type": "function", "function": {"name", "description",
    "parameters": {"type": "object", "properties": {...}, "required": [...]}}}``), else a :class:`ConfigError`
    naming ``key``, what was expected and what was given."""

    def bad(what: str):
        raise ConfigError(
            f"{key}: a tool schema {what} (OpenAI's function-tool schema); got {str(schema)[:200]}", key
        )

    if (
        not isinstance(schema, dict)
        or schema.get("type") != "function"
        or not isinstance(schema.get("function"), dict)
    ):
        bad('is {"type": "function", "function": {...}}')
    fn = schema["function"]
    if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", fn["name"]):
        bad("names its function with an identifier of at most 64 characters")
    if not isinstance(fn.get("description", ""), str):
        bad("describes its function with a string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if (
        not isinstance(params, dict)
        or params.get("type") != "object"
        or not isinstance(params.get("properties", {}), dict)
    ):
        bad('gives its parameters as {"type": "object", "properties": {...}}')
    required = params.get("required", [])
    if not isinstance(required, list) or any(r not in params.get("properties", {}) for r in required):
        bad("requires only parameters it lists in properties")
    return schema


def register_tool(schema: dict) -> Callable[[Callable], Callable]:
    """Register a function as the tool ``schema`` describes (checked: :func:`check_tool_schema`); a notebook cell's
    works like the built-ins. Returns the function."""
    check_tool_schema(schema, "register_tool")

    def add(fn: Callable) -> Callable:
        TOOLS[schema["function"]["name"].lower()] = Tool(schema, fn)
        return fn

    return add


def get_tools(names: list[str], key: str = "rollout.tools") -> list[Tool]:
    """The registered tools ``names``, or a :class:`ConfigError` naming ``key`` and the choices."""
    unknown = [n for n in names if not isinstance(n, str) or n.lower() not in TOOLS]
    if unknown:
        raise ConfigError(f"{key}: {unknown} are not registered tools; registered: {sorted(TOOLS)}", key)
    return [TOOLS[n.lower()] for n in names]


def parse_tool_calls(text: str) -> list[tuple[str, dict] | str]:
    """The calls in ``text``, in order: ``(name, arguments)``, or for a call that does not parse, a string saying
    why (the model is told, as a tool's error)."""
    out: list[tuple[str, dict] | str] = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            out.append(f"error: the tool call is not JSON ({e.msg})")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            out.append('error: a tool call is {"name": ..., "arguments": {...}}')
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):  # (some templates put the arguments as a JSON string)
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        out.append(
            (call["name"], args) if isinstance(args, dict) else "error: the arguments are not an object"
        )
    return out


PYTHON = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code (the standard library) and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the code to run"}},
            "required": ["code"],
        },
    },
}


@register_tool(PYTHON)
def python_tool(code: str, sandbox: SandboxConfig | None = None) -> str:
    """The built-in ``python`` tool: ``code`` run in the sandbox (``reward.sandbox``'s limits); what it printed, or
    its error's last line."""
    return run_python(code, sandbox).text()


class ChatTools:
    """The interaction of ``rollout.tools``: after each of the model's turns, the last tool call in it is run and
    answered with a ``tool`` message as the tokenizer's chat template renders it, the assistant's next turn opened;
    a turn that calls no tool is the final answer.

    Args:
        tools: the tools the model may call (:class:`Tool`, or registered names).
        tokenizer: the model's tokenizer, whose chat template renders the tool messages.
        sandbox: the limits the ``python`` tool (and any tool taking ``sandbox``) runs under.
        max_result_chars: a result longer than this is cut (a model's context is short).
    """

    def __init__(self, tools, tokenizer, sandbox: SandboxConfig | None = None, max_result_chars: int = 1000):
        self.tools = {t.name: t for t in (get_tools([t])[0] if isinstance(t, str) else t for t in tools)}
        self.tok, self.sandbox, self.max_result_chars = (
            tokenizer,
            sandbox or SandboxConfig(),
            max_result_chars,
        )
        # the text a tool message adds after an assistant turn: the template's rendering of a conversation with
        # it, past the rendering without it (veRL's and SGLang's way of rendering one message of a conversation)
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        before = tokenizer.apply_chat_template(base, tokenize=False)
        after = tokenizer.apply_chat_template(
            [*base, {"role": "tool", "content": "\x00"}], tokenize=False, add_generation_prompt=True
        )
        if not after.startswith(before) or "\x00" not in after:
            raise ConfigError(
                "rollout.tools: the model's chat template does not render a tool message after an assistant turn "
                "(a template without tool support); give a model whose template has one",
                "rollout.tools",
            )
        eos = tokenizer.eos_token or ""
        cut = (
            before.rfind(eos) + len(eos) if eos and eos in before else len(before)
        )  # (the model's EOS ends its turn)
        self._around = after[cut:].split("\x00")

    def schemas(self) -> list[dict]:
        """The tools' schemas, as ``apply_chat_template(tools=...)`` takes them."""
        return [t.schema for t in self.tools.values()]

    def __call__(self, last_turn: str) -> str | None:
        calls = parse_tool_calls(last_turn)
        if not calls:
            return None
        call = calls[-1]
        if isinstance(call, str):
            result = call
        else:
            name, args = call
            tool = self.tools.get(name)
            if tool is None:
                result = f"error: no tool named {name!r}"
            else:
                result = self._run(tool, args)
        result = result.rstrip("\n")[
            : self.max_result_chars
        ]  # (print's last newline: the template has its own)
        return self._around[0] + result + self._around[1]

    def _run(self, tool: Tool, args: dict) -> str:
        import inspect

        params = inspect.signature(tool.fn).parameters
        extra = {"sandbox": self.sandbox} if "sandbox" in params else {}
        try:
            return str(tool.fn(**args, **extra))
        except TypeError as e:  # arguments the tool does not take
            return f"error: {e}"
        except Exception as e:  # a tool's own failure is the model's to see
            return f"error: {type(e).__name__}"


__all__ = [
    "TOOLS",
    "ChatTools",
    "Tool",
    "check_tool_schema",
    "get_tools",
    "parse_tool_calls",
    "register_tool",
]

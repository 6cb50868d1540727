"""Interactions: what answers the model between its turns in a multi-turn rollout (``rollout.max_turns``).

After each of the model's turns but the last, the rollout calls the interaction with the transcript so far;
it returns the text that comes next in the conversation (a tool's output, a user's follow-up, an env's
observation), or ``None`` to end the episode there. The model then takes its next turn from the whole
transcript. Only the model's own tokens are trained on: what the interaction said is context, masked out of
the loss, as veRL's multi-turn rollouts and AReaL's agent workflows mask tool outputs.

An interaction is called with the inputs it accepts among ``completion`` (the transcript after the prompt:
the model's turns and the replies so far), ``last_turn`` (the model's latest turn alone), ``turn`` (how many
turns the model has taken, 1 after the first), ``answer``, ``prompt`` and the prompt record's other fields, by
keyword: the same contract as a reward's, for built-ins and functions defined in a notebook alike.

Tools: :func:`tool_calls` makes an interaction of plain functions. The model calls one by writing
``name(arguments)`` in a turn; the function's result follows, and a turn that calls none is the model's final
answer (``calculator`` is the built-in one: ``calc(3*(4+5))`` -> `` = 27;``).

Example:
    >>> from rlnb.algorithms.interactions import get_interaction
    >>> retry = get_interaction("arithmetic_retry")
    >>> retry(completion="12", answer="11", turn=1)
    ' no. '
    >>> retry(completion="12 no. 11", last_turn="11", answer="11", turn=2) is None
    True
"""

from __future__ import annotations

import ast
import logging
import operator
import re
from collections.abc import Callable

from rlnb.algorithms.contract import LM
from rlnb.algorithms.registry import Entry, Registry, check_serves
from rlnb.algorithms.rewards import arithmetic_reward
from rlnb.errors import ConfigError

INTERACTIONS = Registry("interaction", key="rollout.interaction")
register_interaction = INTERACTIONS.register
log = logging.getLogger("rlnb.interactions")
_warned: set[str] = set()

INTERACTION_INPUTS = frozenset({"completion", "last_turn", "turn", "answer", "prompt"})
"""What the LM loop offers an interaction, besides the prompt record's other fields."""


@register_interaction("arithmetic_retry")
def arithmetic_retry(last_turn: str, answer: str) -> str | None:
    """The arithmetic task with retries: a turn whose answer is right ends the episode; a wrong one is told
    `` no. `` and the model answers again after it (a reward then reads the transcript's last answer)."""
    return None if arithmetic_reward(last_turn, answer) >= 1.0 else " no. "


def tool_calls(tools: dict, result: str = " = {result};") -> Callable[[str], str | None]:
    """An interaction running the tools the model calls: in its latest turn, the last ``name(arguments)`` of a
    tool in ``tools`` (``{name: function of the text between the parentheses}``) is called, and ``result``
    (formatted with its return value) follows; a turn that calls no tool ends the episode (its answer is
    final). A tool that raises answers ``error: <its exception's type>``, which the model sees and the episode
    goes on.

    Example:
        >>> calc = tool_calls({"calc": calculator})
        >>> calc(last_turn="I need calc(3*(4+5))")
        ' = 27;'
        >>> calc(last_turn="27") is None
        True
    """
    if not tools or not all(isinstance(name, str) and name.isidentifier() for name in tools):
        raise ConfigError(
            f"tools: expected {{name: function}} with identifier names, got {list(tools)}", "tools"
        )
    call = re.compile(r"\b(" + "|".join(map(re.escape, tools)) + r")\(([^()]*(?:\([^()]*\)[^()]*)*)\)")

    def run_tools(last_turn: str) -> str | None:
        calls = call.findall(last_turn)
        if not calls:
            return None
        name, arguments = calls[-1]
        try:
            value = tools[name](arguments)
        except Exception as e:
            value = f"error: {type(e).__name__}"
        return result.format(result=value)

    run_tools.__name__ = "tool_calls"
    run_tools.__doc__ = (
        f"Runs the tool the model called last in its latest turn ({', '.join(f'``{t}(...)``' for t in tools)}) and "
        f"answers {result!r} with its result; a turn that calls none is the final answer (:func:`tool_calls`)."
    )
    return run_tools


_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos,
}  # fmt: skip


def calculator(expression: str) -> int | float:
    """The value of an arithmetic expression of numbers, ``+ - * / // %`` and parentheses (no names, no
    powers: nothing a model could make run long); an integer where the value is one.

    Example:
        >>> calculator("3*(4+5)"), calculator("7/2")
        (27, 3.5)
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    out = value(ast.parse(expression.strip(), mode="eval").body)
    return int(out) if isinstance(out, float) and out.is_integer() else out


register_interaction("calculator")(tool_calls({"calc": calculator}))


def check_interaction(interaction, fields=()) -> Entry:
    """The interaction's entry (a name or a function) if the LM loop can call it, else a :class:`rlnb.ConfigError`
    naming ``rollout.interaction``. ``fields``: the prompt records' fields it may also read (``None``: not known
    yet, any input it needs is taken for one)."""
    if fields is None:
        fields = INTERACTIONS.entry(interaction).needs
    try:
        return check_serves(
            INTERACTIONS,
            interaction,
            INTERACTION_INPUTS | set(fields),
            LM.layout,
            "rollout.interaction",
            LM.name,
        )
    except ConfigError as e:
        has = f"these records have {', '.join(fields)}" if fields else "these records have none"
        raise ConfigError(
            f"{e}. An interaction may also read any field every prompt record has ({has})", e.key
        ) from None


class SafeInteraction:
    """An interaction that never kills a run: one that raises ends that episode there, logged once per name;
    one that returns something other than a string or ``None`` likewise."""

    def __init__(self, interaction):
        self.entry = INTERACTIONS.entry(interaction)
        self.name = self.entry.name

    def __call__(
        self,
        completion: str,
        turn: int,
        answer: str = "",
        prompt: str = "",
        last_turn: str | None = None,
        **fields,
    ) -> str | None:
        # (a record's own field of one of these names gives way to the loop's, as for rewards)
        fields = {k: v for k, v in fields.items() if k not in INTERACTION_INPUTS}
        offered = dict(completion=completion, turn=turn, answer=answer, prompt=prompt)
        offered["last_turn"] = completion if last_turn is None else last_turn
        try:
            reply = self.entry(**fields, **offered)
            if reply is not None and not isinstance(reply, str):
                raise TypeError(f"returned {type(reply).__name__}, expected a string or None")
            return reply
        except Exception as e:
            if self.name not in _warned:
                _warned.add(self.name)
                log.warning(
                    "interaction %r raised %s: %s; that episode ends there (logged once)",
                    self.name, type(e).__name__, e,
                )  # fmt: skip
            return None

    def __repr__(self) -> str:
        return f"<interaction {self.name}>"


def get_interaction(name: str) -> SafeInteraction:
    """The registered interaction ``name``, wrapped as the rollout calls it (:class:`SafeInteraction`)."""
    return SafeInteraction(INTERACTIONS.entry(name))


__all__ = [
    "INTERACTIONS",
    "INTERACTION_INPUTS",
    "SafeInteraction",
    "arithmetic_retry",
    "calculator",
    "check_interaction",
    "get_interaction",
    "register_interaction",
    "tool_calls",
]

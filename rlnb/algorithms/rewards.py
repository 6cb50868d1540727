"""Rewards: ``get_reward(name)`` -> callable ``(completion: str, answer: str) -> float``.

A reward that raises returns 0.0 and logs once per reward name; it never kills a run.
"""

from __future__ import annotations

import functools
import logging
import re
import threading

from rlnb.algorithms.registry import Registry

REWARDS = Registry("reward", key="reward.name")
register_reward = REWARDS.register
log = logging.getLogger("rlnb.rewards")
_warned: set[str] = set()


class SafeReward:
    """Wraps a reward function: exceptions become 0.0, logged once.

    The function is called with the inputs it accepts among ``completion``, ``answer``, ``prompt`` and the
    prompt record's other fields (by keyword: the reward contract, the same for built-ins and functions
    defined in a notebook).
    """

    def __init__(self, name: str, fn):
        self.name = name
        self.entry = REWARDS.entry(fn)
        self.fn = self.entry.fn
        functools.update_wrapper(self, getattr(fn, "fn", fn))

    def __call__(self, completion: str, answer: str, prompt: str | None = None, **fields) -> float:
        try:
            return float(self.entry(**fields, completion=completion, answer=answer, prompt=prompt))
        except Exception as e:
            if self.name not in _warned:
                _warned.add(self.name)
                log.warning(
                    "reward %r raised %s: %s; scoring 0.0 (logged once)", self.name, type(e).__name__, e
                )
            return 0.0

    def __repr__(self) -> str:
        return f"<reward {self.name}>"


def get_reward(name: str, **kwargs) -> SafeReward:
    """The reward registered as ``name``, with ``kwargs`` bound, wrapped so it never raises.

    Example:
        >>> get_reward("math")("so the answer is \\\\boxed{\\\\frac{1}{2}}", "0.5")
        1.0
    """
    fn = REWARDS.get(name, key="reward.name")
    return SafeReward(name.lower(), functools.partial(fn, **kwargs) if kwargs else fn)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (braces balanced)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: last ``\\boxed{}``, else after ``####``, else the last number."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalise(ans: str) -> str:
    ans = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", ans.strip())  # 1,000 -> 1000
    return ans.strip("$ ").rstrip(".")


MATH_MAX_ANSWER_CHARS = 200
"""Final answers longer than this score 0.0 without being parsed (bounds sympy's work)."""
MATH_TIMEOUT_S = 5.0
"""A comparison still running after this many seconds scores 0.0."""


@register_reward("math")
def math_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's final answer equals ``answer`` mathematically (via ``math-verify``).

    ``0.5``, ``1/2`` and ``\\frac{1}{2}`` agree, as do ``2x+1`` and ``1+2x``, ``1,000`` and ``1000``.

    Rewards run on worker threads, where ``math-verify``'s default ``signal.alarm`` timeouts raise (and
    every completion would score 0.0), so its timeouts are off and the work is bounded here instead:
    answers over :data:`MATH_MAX_ANSWER_CHARS` characters score 0.0, and so does a comparison still
    running after :data:`MATH_TIMEOUT_S` seconds (on a helper thread, which is left to finish).
    """
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    gold_text = extract_answer(answer) if ("\\boxed" in answer or "####" in answer) else answer
    if gold_text is None or max(len(pred), len(gold_text)) > MATH_MAX_ANSWER_CHARS:
        return 0.0
    result: list[float] = []
    worker = threading.Thread(target=lambda: result.append(_math_equal(gold_text, pred)), daemon=True)
    worker.start()
    worker.join(MATH_TIMEOUT_S)
    return result[0] if result else 0.0


def _math_equal(gold_text: str, pred: str) -> float:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    # parsing_timeout/timeout_seconds None: no signal.alarm, which only works on the main thread
    gold = parse(f"${_normalise(gold_text)}$", extraction_config=config, parsing_timeout=None)
    guess = parse(f"${_normalise(pred)}$", extraction_config=config, parsing_timeout=None)
    return 1.0 if gold and guess and verify(gold, guess, timeout_seconds=None) else 0.0


_LEADING_INT = re.compile(r"^\s*(-?\d+)")


@register_reward("arithmetic")
def arithmetic_reward(completion: str, answer: str) -> float:
    """1.0 if the completion starts with exactly the integer ``answer`` (the toy task of tests and recipes)."""
    m = _LEADING_INT.match(completion)
    return 1.0 if m is not None and int(m.group(1)) == int(answer) else 0.0


@register_reward("format")
def format_reward(completion: str, answer: str, pattern: str = r"\\boxed\{[^{}]+\}|####\s*\S+") -> float:
    """1.0 if the completion contains the required answer format (default: ``\\boxed{..}`` or ``#### x``)."""
    return 1.0 if re.search(pattern, completion) else 0.0

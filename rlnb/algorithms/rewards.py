"""Rewards: ``get_reward(name)`` -> callable ``(completion: str, answer: str) -> float``.

A reward that raises returns 0.0 and logs once per reward name; it never kills a run.
"""

from __future__ import annotations

import functools
import logging
import re
import threading

from rlnb.algorithms.registry import Registry
from rlnb.errors import ConfigError

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

    def many(
        self, completions: list[str], answers: list[str], prompts: list, fields: list[dict]
    ) -> list[float]:
        """Scores of a batch: in one call where the reward scores batches (``score_batch(completions, prompts)``,
        as :class:`RewardModel` does), else one by one. A batch that raises scores 0.0, logged once."""
        score_batch = getattr(self.entry.fn, "score_batch", None)
        if score_batch is None:
            return [self(c, a, p, **f) for c, a, p, f in zip(completions, answers, prompts, fields)]
        try:
            scores = [float(s) for s in score_batch(list(completions), list(prompts))]
            if len(scores) != len(completions):
                raise ValueError(
                    f"score_batch returned {len(scores)} scores for {len(completions)} completions"
                )
            return scores
        except Exception as e:
            if self.name not in _warned:
                _warned.add(self.name)
                log.warning(
                    "reward %r raised %s: %s; scoring 0.0 (logged once)", self.name, type(e).__name__, e
                )
            return [0.0] * len(completions)


class RewardModel:
    """A learned reward: a ``transformers`` sequence-classification model's score (its first logit) of the
    prompt followed by the completion, as TRL's ``GRPOTrainer`` scores with a model among its ``reward_funcs``
    (OpenRLHF's and veRL's reward models likewise).

    It travels to workers as its path alone and loads there on first use, once per process; it scores a
    rollout's completions ``batch_size`` texts per forward (:meth:`score_batch`, which a reward component
    calls once per batch) rather than one at a time.

    Args:
        model_path: a local ``save_pretrained`` directory or a hub id (``from_pretrained``).
        batch_size: texts per forward.
        device: ``"auto"`` (CUDA where the process has a GPU, else CPU), ``"cpu"`` or ``"cuda"``.
        name: the reward's name, in logs (``reward/<name>/mean``).

    Example:
        >>> rm = RewardModel("runs/models/tiny-rm")                              # doctest: +SKIP
        >>> rm.score_batch(["4", "5"], ["2+2=", "2+2="])                          # doctest: +SKIP
        [0.131..., -0.274...]
    """

    def __init__(self, model_path, batch_size: int = 16, device: str = "auto", name: str = "reward_model"):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(
                f"RewardModel: batch_size: expected an integer >= 1, got {batch_size!r}", "batch_size"
            )
        self.model_path, self.batch_size, self.device = str(model_path), batch_size, device
        self.__name__ = name
        self._loaded = None  # (model, tokenizer, device), in the process that scores

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_loaded": None}  # the path travels, not the weights

    def __repr__(self) -> str:
        return f"RewardModel({self.model_path!r}, batch_size={self.batch_size}, name={self.__name__!r})"

    def __call__(self, completion: str, prompt: str | None) -> float:
        return self.score_batch([completion], [prompt])[0]

    def score_batch(self, completions: list[str], prompts: list[str | None]) -> list[float]:
        """The score of each ``prompt + completion`` (no special tokens added, as TRL tokenizes them)."""
        import torch

        from rlnb.models.lm import load_reward_model

        if self._loaded is None:
            device = self.device
            if device == "auto":
                device = "cuda" if torch.cuda.is_available() else "cpu"
            self._loaded = (*load_reward_model(self.model_path, device), device)
        model, tok, device = self._loaded
        texts = [(p or "") + c for p, c in zip(prompts, completions)]
        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = tok(
                    texts[start : start + self.batch_size],
                    return_tensors="pt",
                    padding=True,
                    add_special_tokens=False,
                ).to(device)
                scores += model(**batch).logits[:, 0].float().cpu().tolist()
        return scores


def recipe_rewards(name, model_path: str | None = None, model_batch_size: int = 16) -> list:
    """A recipe's rewards (``reward.name``, ``reward.model_path``, ``reward.model_batch_size``) as a list: the
    registered names, then the reward model, if any.

    Example:
        >>> recipe_rewards("math", "models/rm")
        ['math', RewardModel('models/rm', batch_size=16, name='reward_model')]
    """
    names = list(name) if isinstance(name, (list, tuple)) else [name]
    return names + ([RewardModel(model_path, model_batch_size)] if model_path is not None else [])


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
    import math_verify  # noqa: F401  (imported here, not inside the deadline: seconds of sympy on a loaded machine)

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


@register_reward("final_answer")
def final_answer_reward(completion: str, answer: str) -> float:
    """1.0 if a tool-using transcript's final answer is the reference exactly: what follows the last tool result
    (after its last ``;``, where :func:`rlnb.algorithms.interactions.tool_calls`' reply ``" = {result};"`` ends);
    a transcript with no tool result is its own final answer. A right answer the model did not give last, or
    a tool's result left uncopied, scores 0.

    Example:
        >>> final_answer_reward("calc(12*13) = 156;156", "156"), final_answer_reward("calc(12*13) = 156;", "156")
        (1.0, 0.0)
    """
    return 1.0 if completion.rsplit(";", 1)[-1].strip() == answer.strip() else 0.0


@register_reward("format")
def format_reward(completion: str, answer: str, pattern: str = r"\\boxed\{[^{}]+\}|####\s*\S+") -> float:
    """1.0 if the completion contains the required answer format (default: ``\\boxed{..}`` or ``#### x``)."""
    return 1.0 if re.search(pattern, completion) else 0.0


_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


@register_reward("code_tests")
def code_tests(completion: str, tests: str, sandbox=None) -> float:
    """1.0 where the completion's code passes the record's ``tests`` (Python ``assert`` statements, run after the
    code in :func:`rlnb.sandbox.run_python`'s sandbox under ``reward.sandbox``'s limits), else 0.0. The code is the
    completion's last fenced block (```python ... ```), or the whole completion where it has none."""
    from rlnb.sandbox import run_python

    blocks = _FENCE.findall(completion)
    code = blocks[-1] if blocks else completion
    return 1.0 if run_python(code + "\n\n" + tests, sandbox).ok else 0.0

"""Prompts with reference answers."""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from rlnb.errors import ConfigError

RESERVED_FIELDS = ("prompt", "answer", "completion")
"""What a reward is given by these names: never a record's own column of that name."""


@dataclass(frozen=True)
class Problem:
    """A prompt, its reference answer, and the record's other ``fields`` (e.g. a coding task's tests), which a
    reward may read by name, as TRL passes a dataset's columns to its reward functions. A prompt is text, or a
    conversation (``(role, content)`` pairs) until a chat template makes it text (:func:`chat_prompts`)."""

    prompt: str | tuple
    answer: str
    fields: dict = field(default_factory=dict, compare=False)

    def __repr__(self) -> str:
        extra = f", fields={self.fields!r}" if self.fields else ""
        return f"Problem(prompt={self.prompt!r}, answer={self.answer!r}{extra})"


def common_fields(*splits: list[Problem]) -> tuple[str, ...]:
    """The fields every problem of ``splits`` has, sorted: what a reward may ask for by name.

    Example:
        >>> common_fields([Problem("1+1=", "2", {"level": 1}), Problem("2+2=", "4", {"level": 2, "src": "x"})])
        ('level',)
    """
    problems = [p for split in splits for p in split]
    if not problems:
        return ()
    names = set(problems[0].fields)
    for p in problems[1:]:
        names &= p.fields.keys()
    return tuple(sorted(names))


class ArithmeticTask:
    """``a+b=`` with a held-out split of operand pairs never seen in training.

    Args:
        max_operand: operands are drawn from ``min_operand..max_operand`` (difficulty).
        ops: operators, from ``+``, ``-`` and ``*``.
        held_out_frac: fraction of all operand pairs kept for evaluation.
        seed: the split and the sampling order.
        min_operand: the smallest operand.

    Example:
        >>> task = ArithmeticTask(max_operand=9, seed=0)
        >>> p = task.train[0]; p.prompt.endswith("="), p.answer == str(eval(p.prompt[:-1]))
        (True, True)
    """

    def __init__(
        self,
        max_operand: int = 20,
        ops: str = "+",
        held_out_frac: float = 0.2,
        seed: int = 0,
        min_operand: int = 0,
    ):
        if max_operand < 1:
            raise ConfigError(
                f"data.max_operand: expected an integer >= 1, got {max_operand}", "data.max_operand"
            )
        if not 0 <= min_operand <= max_operand:
            raise ConfigError(
                f"data.min_operand: expected an integer from 0 to data.max_operand ({max_operand}), got {min_operand}",
                "data.min_operand",
            )
        bad = set(ops) - set("+-*")
        if not ops or bad:
            raise ConfigError(f"data.ops: expected characters from '+-*', got {ops!r}", "data.ops")
        problems = [
            Problem(f"{a}{op}{b}=", str(eval(f"{a}{op}{b}")))
            for op in ops
            for a in range(min_operand, max_operand + 1)
            for b in range(min_operand, max_operand + 1)
        ]
        random.Random(seed).shuffle(problems)
        n_eval = max(1, int(len(problems) * held_out_frac))
        self.held_out, self.train = problems[:n_eval], problems[n_eval:]
        self._rng = random.Random(seed + 1)
        self._order: list[int] = []
        self.position = 0  # how many training prompts were drawn: saved in checkpoints

    def sample(self, n: int) -> list[Problem]:
        """The next ``n`` training problems (an endless shuffled stream, reproducible from ``position``)."""
        out = []
        for _ in range(n):
            epoch, i = divmod(self.position, len(self.train))
            if i == 0 or not self._order:
                self._order = self._epoch_order(epoch)
            out.append(self.train[self._order[i]])
            self.position += 1
        return out

    def problem(self, serial: int) -> Problem:
        """The training problem :meth:`sample` drew (or will draw) at position ``serial``."""
        epoch, i = divmod(serial, len(self.train))
        return self.train[self._epoch_order(epoch)[i]]

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.train)))
        random.Random(hash((epoch, len(self.train))) & 0xFFFFFFFF).shuffle(order)
        return order

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]
        self._order = []
        if self.position % len(self.train):  # rebuild the current epoch's order
            self._order = self._epoch_order(self.position // len(self.train))


def load_qa_file(
    path: str | Path, question_key: str = "question", answer_key: str = "answer"
) -> list[Problem]:
    """Problems from a local ``.jsonl`` or ``.parquet`` file, or a Hugging Face dataset saved with
    ``save_to_disk`` (a directory; of a ``DatasetDict``, its ``train`` split), in the common question/answer
    layout.

    GSM8K-style answers (worked solution then ``#### 72``) keep only the final answer.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"data.path: {str(path)!r} does not exist", "data.path")
    if path.is_dir():
        return problems_from_records(
            _saved_dataset(path), question_key, answer_key, key="data.path", source=path.name
        )
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    elif path.suffix == ".parquet":
        import pandas as pd

        rows = pd.read_parquet(path).to_dict("records")
    else:
        raise ConfigError(f"data.path: expected a .jsonl or .parquet file, got {path.name!r}", "data.path")
    return problems_from_records(rows, question_key, answer_key, key="data.path", source=path.name)


def _saved_dataset(path: Path):
    """The rows of a dataset ``datasets.Dataset.save_to_disk`` wrote to ``path`` (a ``DatasetDict``: its
    ``train`` split, or its only one)."""
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(
            f"data.path: {str(path)!r} is a directory, read as a dataset saved with save_to_disk, which needs "
            "the `datasets` package: pip install 'rlnb[datasets]'",
            "data.path",
        ) from e
    try:
        data = datasets.load_from_disk(str(path))
    except (
        FileNotFoundError,
        ValueError,
    ) as e:  # (what load_from_disk raises for a directory of another kind)
        raise ConfigError(
            f"data.path: {str(path)!r} is a directory but not a dataset saved with save_to_disk ({e}); expected "
            "that, or a .jsonl or .parquet file",
            "data.path",
        ) from e
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data and len(data) != 1:
            raise ConfigError(
                f"data.path: the dataset at {str(path)!r} has splits {sorted(data)} and none named 'train'; "
                "save the split to train on alone, or name it 'train'",
                "data.path",
            )
        data = data["train"] if "train" in data else next(iter(data.values()))
    return data


def is_conversation(prompt) -> bool:
    """Whether ``prompt`` is a conversation: messages with a ``role`` and a ``content`` each (a list of
    mappings, as TRL's conversational records hold them, or the ``(role, content)`` pairs a Problem keeps)."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return False
    return all(
        (hasattr(m, "keys") and "role" in m and "content" in m) or (isinstance(m, tuple) and len(m) == 2)
        for m in prompt
    )


def template_prompts(prompts: list, tokenizer, system_prompt: str | None = None, tools: list[dict] | None = None
                     ) -> list[str]:  # fmt: skip
    """Each prompt through ``tokenizer``'s chat template with the assistant's turn opened
    (``apply_chat_template(..., add_generation_prompt=True)``): a question as a user turn, a conversation
    (:func:`is_conversation`) as its messages; a system turn first if ``system_prompt`` and the conversation has
    none of its own; ``tools`` (OpenAI function schemas) as the template shows tools (``apply_chat_template(tools=)``).

    Raises:
        ConfigError: the tokenizer has no chat template (a base model's, not an instruct model's).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "data.chat_template: the model's tokenizer has no chat template (a base model's?); give an instruct "
            "model's (actor.model_path) or set data.chat_template=false",
            "data.chat_template",
        )
    out = []
    for prompt in prompts:
        if is_conversation(prompt):
            messages = [dict(m) if hasattr(m, "keys") else {"role": m[0], "content": m[1]} for m in prompt]
        else:
            messages = [{"role": "user", "content": prompt}]
        if system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        extra = {"tools": tools} if tools else {}
        out.append(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        )
    return out


def chat_prompts(problems: list[Problem], tokenizer, system_prompt: str | None = None,
                 tools: list[dict] | None = None) -> list[Problem]:  # fmt: skip
    """``problems`` with each prompt given through ``tokenizer``'s chat template (:func:`template_prompts`: a
    question as a user turn, a conversation as its messages), after a system turn if ``system_prompt``, showing
    ``tools``; answers and fields unchanged."""
    texts = template_prompts([p.prompt for p in problems], tokenizer, system_prompt, tools)
    return [dataclasses.replace(p, prompt=text) for text, p in zip(texts, problems)]


def problems_from_records(
    records,
    question_key: str = "question",
    answer_key: str = "answer",
    key: str = "prompts",
    source: str = "the records",
) -> list[Problem]:
    """Problems from any iterable of prompt/answer records: dicts, or a ``datasets.Dataset``.

    The question is ``record[question_key]`` (or ``record["prompt"]``); GSM8K-style answers (worked
    solution then ``#### 72``) keep only the final answer. The record's other keys are the problem's
    ``fields`` (but ``prompt``, ``answer`` and ``completion``, which a reward is given by the loop).

    Example:
        >>> problems_from_records([{"prompt": "2+2=", "answer": "4"}])
        [Problem(prompt='2+2=', answer='4')]
        >>> problems_from_records([{"question": "2+2=", "answer": "4", "level": 1}])
        [Problem(prompt='2+2=', answer='4', fields={'level': 1})]
    """
    out = []
    for i, row in enumerate(records):
        if not hasattr(row, "keys"):
            raise ConfigError(
                f"{key}: row {i} of {source} is a {type(row).__name__}; expected a mapping with "
                f"{question_key!r} (or 'prompt') and {answer_key!r} keys",
                key,
            )
        q_key = "prompt" if question_key not in row and "prompt" in row else question_key
        missing = [k for k in (q_key, answer_key) if k not in row]
        if missing:
            raise ConfigError(
                f"{key}: row {i} of {source} has no {missing} (keys: {sorted(row.keys())})", key
            )
        answer, prompt = str(row[answer_key]), row[q_key]
        if isinstance(prompt, (list, tuple)):  # a conversation (TRL's conversational records)
            if not is_conversation(prompt):
                raise ConfigError(
                    f"{key}: row {i} of {source} has a {q_key!r} list that is not a conversation: expected "
                    f"messages with 'role' and 'content' each, got {prompt!r:.200}",
                    key,
                )
            prompt = tuple((str(m["role"]), str(m["content"])) for m in prompt)  # (kept hashable)
        out.append(
            Problem(
                prompt if isinstance(prompt, tuple) else str(prompt),
                answer.rsplit("####", 1)[1].strip() if "####" in answer else answer.strip(),
                {k: row[k] for k in row if k not in (q_key, answer_key, *RESERVED_FIELDS)},
            )
        )
    if not out:
        raise ConfigError(f"{key}: {source} hold no rows", key)
    return out

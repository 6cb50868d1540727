"""The GRPO family's data: the problems it trains and evaluates on (an arithmetic task made procedurally, or a local
file of questions and answers, split into training and held-out problems), and the warm start's demonstrations,
multi-turn conversations included."""

from __future__ import annotations

import random
import re

from rlnb.algorithms.interactions import SafeInteraction, check_interaction
from rlnb.data.prompts import Problem, common_fields
from rlnb.errors import ConfigError

_ARITHMETIC = re.compile(r"(-?\d+)([+*-])(-?\d+)=")


def conversation(problem: Problem, turns: list[str], reply, key: str) -> list[tuple]:
    """A warm start's conversation of ``problem``: each turn of ``turns`` (format strings over the problem's
    names, see ``data.sft_turns``) after the transcript before it, ``reply`` (the interaction) answering between
    two; as ``(context, turn)`` rows, a context being the prompt or ``[prompt, turn, reply, ...]``."""
    names = {**problem.fields, "expression": problem.prompt.removesuffix("="), "answer": problem.answer}
    # an arithmetic problem's last expression (a templated prompt holds it inside the chat template's text)
    found = list(_ARITHMETIC.finditer(problem.prompt)) if isinstance(problem.prompt, str) else []
    if found:
        names.update(zip(("a", "op", "b"), found[-1].groups()), expression=found[-1][0].removesuffix("="))
    pieces, transcript, rows = [problem.prompt], "", []
    for k, template in enumerate(turns):
        try:
            text = template.format(**names)
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(
                f"{key}: {template!r} cannot be written for the problem {problem.prompt!r} ({type(e).__name__}: {e}); "
                f"its names: {', '.join('{' + n + '}' for n in names)}",
                key,
            ) from None
        rows.append((list(pieces) if k else problem.prompt, text))
        if k + 1 < len(turns):
            transcript += text
            answer = reply(transcript, k + 1, problem.answer, problem.prompt, text, **problem.fields)
            if answer is None:
                raise ConfigError(
                    f"{key}: the interaction ended the warm start's conversation of {problem.prompt!r} after its turn "
                    f"{k + 1} ({text!r}), and {len(turns)} turns were given",
                    key,
                )
            transcript += answer
            pieces += [text, answer]
    return rows


class FileTask:
    """Problems from a local file, split like :class:`ArithmeticTask` (same sampling interface)."""

    def __init__(self, problems: list[Problem], held_out_frac: float, seed: int):
        problems = list(problems)
        random.Random(seed).shuffle(problems)
        n_eval = max(1, int(len(problems) * held_out_frac))
        self.held_out, self.train = problems[:n_eval], problems[n_eval:]
        self.position = 0

    def sample(self, n: int) -> list[Problem]:
        out = [self.train[(self.position + i) % len(self.train)] for i in range(n)]
        self.position += n
        return out

    def problem(self, serial: int) -> Problem:
        """The training problem :meth:`sample` drew (or will draw) at position ``serial``."""
        return self.train[serial % len(self.train)]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def recipe_task(recipe, model_path: str) -> tuple:
    """``(task, chat tokenizer or None)``: the problems of a recipe's ``data`` section, split into ``train`` and
    ``held_out`` as every run of it splits them (by ``seed``), through the model's chat template where
    ``data.chat_template`` says."""
    from rlnb.data.prompts import ArithmeticTask, chat_prompts, load_qa_file
    from rlnb.models.lm import load_tokenizer

    d = recipe.data
    if d.task == "arithmetic":
        task = ArithmeticTask(d.max_operand, d.ops, d.held_out_frac, recipe.seed, d.min_operand)
    else:
        task = FileTask(load_qa_file(d.path, d.question_key, d.answer_key), d.held_out_frac, recipe.seed)
    conversations = [p for p in task.train + task.held_out if not isinstance(p.prompt, str)]
    if conversations and not d.chat_template:
        raise ConfigError(
            f"data.chat_template: {len(conversations)} record(s) of {d.path} are conversations (lists of "
            "messages, as TRL's conversational records), which only a chat template makes a prompt of; set "
            "data.chat_template=true",
            "data.chat_template",
        )
    chat = None
    if d.chat_template:  # (the split and the sampling order stay those of the bare questions)
        chat = load_tokenizer(model_path)
        tools = recipe_tool_schemas(recipe)  # (rollout.tools: shown to the model by its template)
        task.train = chat_prompts(task.train, chat, d.system_prompt, tools)
        task.held_out = chat_prompts(task.held_out, chat, d.system_prompt, tools)
    return task, chat


def turn_demonstrations(
    task, recipe, model_path: str | None = None
) -> tuple[list, list, list | None, list | None]:
    """``data.sft_turns``: the warm start's rows, ``(contexts, targets)``, one per turn of each training
    problem's conversation, the interaction replying between turns as in training; and the imperfect
    teacher's (``data.sft_noise_turns``: its own conversation's row where it has a turn, else the right one),
    or ``None``."""
    d = recipe.data
    reply = None
    if len(d.sft_turns) > 1:
        fields = common_fields(task.train, task.held_out)
        # (rollout.tools: the tools run and answer in the model's template, as in training)
        reply = SafeInteraction(recipe_interaction(recipe, model_path or recipe.actor.model_path, fields))
    noisy = d.sft_noise_turns if d.sft_noise else None
    rows, wrong_rows = [], []
    for problem in task.train:
        right = conversation(problem, d.sft_turns, reply, "data.sft_turns")
        rows += right
        if noisy is not None:
            turns = [n if n is not None else t for n, t in zip(noisy, d.sft_turns)]
            theirs = conversation(problem, turns, reply, "data.sft_noise_turns")
            wrong_rows += [t if n is not None else r for n, t, r in zip(noisy, theirs, right)]
    contexts, targets = [c for c, _ in rows], [t for _, t in rows]
    if noisy is None:
        return contexts, targets, None, None
    return contexts, targets, [c for c, _ in wrong_rows], [t for _, t in wrong_rows]


def shard(items: list, n: int) -> list[list]:
    size = -(-len(items) // n)
    return [items[i * size : (i + 1) * size] for i in range(n)]


def recipe_tool_schemas(recipe) -> list[dict] | None:
    """The schemas of ``rollout.tools`` (``None``: no tools)."""
    if not recipe.rollout.tools:
        return None
    from rlnb.algorithms.tools import get_tools

    return [t.schema for t in get_tools(list(recipe.rollout.tools))]


def recipe_interaction(recipe, model_path: str, fields):
    """What answers between the model's turns (``rollout.max_turns`` >= 2): its tools, run and rendered by the
    model's own chat template (``rollout.tools``), or ``rollout.interaction``; checked as the loop calls it."""
    ro = recipe.rollout
    if ro.tools:
        from rlnb.algorithms.tools import ChatTools
        from rlnb.models.lm import load_tokenizer

        tools = ChatTools(list(ro.tools), load_tokenizer(model_path), recipe.reward.sandbox)
        return check_interaction(tools, fields)
    return check_interaction(ro.interaction, fields)

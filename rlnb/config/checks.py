"""The helpers every recipe section's ``check`` uses (each section checks itself beside its dataclass)."""

from __future__ import annotations

import string

from rlnb.errors import did_you_mean

LM_BACKENDS = ("hf", "vllm")  # rollout.backend values of the LM loop
# LM backends that generate whole completions: asynchronous mode sends them weights between batches
WHOLE_COMPLETION_BACKENDS = ("vllm",)
SFT_TURN_FIELDS = ("expression", "answer", "a", "op", "b")  # data.sft_turns' names for arithmetic problems


def infer_loop(backend: str) -> str:
    """The loop a recipe with no ``loop:`` runs, from its ``rollout.backend``."""
    return "grpo" if backend in LM_BACKENDS else "embodied"


def need(errs: list[str], ok, key: str, expected: str, given) -> None:
    """Add ``key: expected ..., got ...`` to ``errs`` unless ``ok()``; a value of the wrong type was reported when
    it was converted, so a ``TypeError`` here adds nothing."""
    try:
        passed = ok()
    except TypeError:
        return
    if not passed:
        errs.append(f"{key}: expected {expected}, got {given!r}")


def at_least(*checks: tuple[str, object, int]) -> list[str]:
    """``(key, value, low)``: an error for each whole-number value below its ``low``."""
    return [f"{key}: expected an integer >= {low}, got {value!r}" for key, value, low in checks
            if isinstance(value, int) and value < low]  # fmt: skip


def _sft_turns_errors(d, ro) -> list[str]:
    """``data.sft_turns`` and ``data.sft_noise_turns``: format strings over a problem's names, as many turns as
    the rollout takes, an interaction to reply between them."""
    errs = []
    turns, noisy = d.sft_turns, d.sft_noise_turns
    if turns is None:
        if noisy is not None:
            errs.append(
                "data.sft_noise_turns: the imperfect teacher's turns need data.sft_turns, the right ones"
            )
        return errs
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        return [f"data.sft_turns: expected a non-empty list of format strings, got {turns!r}"]
    if noisy is None and isinstance(d.sft_noise, (int, float)) and d.sft_noise > 0:
        errs.append(
            f"data.sft_noise: {d.sft_noise} of a multi-turn warm start's demonstrations come from an imperfect "
            "teacher, whose turns data.sft_noise_turns gives (null for a turn it gets right); set it, or sft_noise=0"
        )
    if len(turns) > 1 and (not isinstance(ro.max_turns, int) or ro.max_turns < len(turns)):
        errs.append(
            f"data.sft_turns: {len(turns)} turns, and the rollout takes rollout.max_turns={ro.max_turns}; set it to "
            f"{len(turns)} or more"
        )
    if noisy is not None and (
        not isinstance(noisy, list)
        or len(noisy) != len(turns)
        or not all(t is None or isinstance(t, str) for t in noisy)
    ):
        errs.append(
            f"data.sft_noise_turns: expected a list of {len(turns)} format strings or nulls (one per data.sft_turns "
            f"entry), got {noisy!r}"
        )
        noisy = None
    for key, texts in (("data.sft_turns", turns), ("data.sft_noise_turns", noisy or [])):
        for text in (t for t in texts if t is not None):
            try:
                names = [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
            except ValueError as e:
                errs.append(f"{key}: {text!r} is not a format string ({e})")
                continue
            unknown = [n for n in names if n not in SFT_TURN_FIELDS]
            if d.task == "arithmetic" and unknown:
                hint = did_you_mean(unknown[0], SFT_TURN_FIELDS)
                errs.append(
                    f"{key}: {text!r} names {{{unknown[0]}}}; an arithmetic problem has "
                    f"{', '.join('{' + n + '}' for n in SFT_TURN_FIELDS)}.{hint}"
                )
    return errs

"""One phase of a step being timed, and the small helpers every part of the loop uses on phase results (a leaf:
it imports nothing of the loop)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from rlnb.errors import ConfigError


@dataclasses.dataclass
class Phase:
    """One phase being timed by :meth:`rlnb.loop.session.Session.timed`."""

    name: str
    """``sync``, ``rollout``, ``advantages`` or ``train``: the record's ``{name}/...`` and ``time/{name}_s``."""
    metrics: dict
    """What the phase reports (numbers go into the step's record; ``version`` stays out)."""
    duration_s: float | None = None
    """Its time where measured elsewhere (a chain's call on the worker); else the wall time since it started."""
    started_s: float = dataclasses.field(default_factory=time.perf_counter)
    """``time.perf_counter()`` when it started."""

    def elapsed_s(self) -> float:
        """Its time so far (``duration_s`` where given)."""
        return time.perf_counter() - self.started_s if self.duration_s is None else self.duration_s


def mean_dicts(dicts: list[dict]) -> dict:
    """Per-key mean of the numeric entries that every rank reported."""
    if len(dicts) == 1:  # one rank: its numbers as they are (the per-step path of a one-slot loop)
        return {k: float(v) for k, v in dicts[0].items() if isinstance(v, (int, float))}
    keys = dicts[0].keys()
    return {
        k: float(np.mean([d[k] for d in dicts]))
        for k in keys
        if all(isinstance(d.get(k), (int, float)) for d in dicts)
    }


def count_or_default(value, name: str, default: int, bounds_of: tuple | None = None) -> int:
    """``value``, a count given to a loop's method (``name`` in the error), or ``default`` for ``None``;
    ``bounds_of``: ``(section, field)`` of the recipe setting whose bounds apply to it.

    Raises:
        ConfigError: anything but ``None`` or an integer >= 1 (within the setting's bounds).
    """
    if value is None:
        return default
    if bounds_of is not None:
        from rlnb.config.checks import check_field

        check_field(*bounds_of, value, name)
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}: expected an integer >= 1, got {value!r}", name)
    return value

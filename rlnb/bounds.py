"""A numeric setting's range on both sides, declared beside the setting (``bounded``) and checked for a whole
recipe section (``bounds_errors``). A leaf module: what any module's settings dataclass may use (the recipe's
sections, ``rlnb.sandbox``'s limits) without importing the config package."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Bounds:
    """A numeric setting's range, both sides: ``[low, high]`` (``(low, high]`` with ``low_open``). ``why``: the
    reason for the upper bound, said in the error. For a list of numbers, each item's range; ``length``: how
    many items it may have."""

    low: float
    high: float
    why: str = ""
    low_open: bool = False
    length: tuple[int, int] | None = None

    def expected(self, integer: bool) -> str:
        left = "(" if self.low_open else "["
        kind = "an integer" if integer else "a number"
        return f"{kind} in {left}{_num(self.low)}, {_num(self.high)}]" + (
            f" ({self.why})" if self.why else ""
        )

    def holds(self, value) -> bool:
        return (self.low < value if self.low_open else self.low <= value) and value <= self.high


def _num(x: float) -> str:
    """A bound as people read it: ``1000000``, not ``1e+06``."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def bounded(default=dataclasses.MISSING, low: float = 0, high: float = 0, why: str = "", *, factory=None,
            low_open: bool = False, length: tuple[int, int] | None = None):  # fmt: skip
    """A dataclass field whose numbers lie within :class:`Bounds` (``default`` or ``factory`` as ``field`` takes
    them): :func:`bounds_errors` checks every such field of a recipe, so each range is said once, beside the
    setting it bounds."""
    meta = {"bounds": Bounds(low, high, why, low_open, length)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def bounds_errors(section, prefix: str) -> list[str]:
    """Every field of ``section`` (a recipe dataclass, and the sections inside it) outside its :class:`Bounds`,
    as ``key: expected ..., got ...``. A value of the wrong type was reported when it was converted: skipped."""
    errs: list[str] = []
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            errs += bounds_errors(value, key + ".")
            continue
        bounds = f.metadata.get("bounds")
        if bounds is None or value is None:
            continue
        integer = "int" in str(f.type) and "float" not in str(f.type)  # (the annotation: int, list[int]...)
        items = value if isinstance(value, list) else [value]
        if isinstance(value, list) and bounds.length is not None:
            low, high = bounds.length
            if not low <= len(value) <= high:
                errs.append(f"{key}: expected {low} to {high} item(s), got {len(value)}")
                continue
        for i, item in enumerate(items):
            # (an item of the wrong type was not converted: said when it was, so not again here)
            if isinstance(item, bool) or not isinstance(item, int if integer else float):
                continue
            if not (math.isfinite(item) and bounds.holds(item)):
                where = f"{key}[{i}]" if isinstance(value, list) else key
                errs.append(f"{where}: expected {bounds.expected(integer)}, got {item!r}")
                break
    return errs

"""Name -> function registries with case-insensitive lookup, "did you mean" errors, and the input
contract of every entry: which inputs it needs, which it accepts, and which batch layout it reads.

A loop offers what it has (``available``); an entry is called with the part of it that it accepts,
and refused before anything starts when something it needs is missing. Built-in entries and those
registered in a notebook cell go through the same path.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rlnb.errors import ConfigError, UnknownNameError

LAYOUTS = ("trajectory", "sequence")
"""``trajectory``: embodied rollouts ``[T, N]``; ``sequence``: LM batches ``[B]`` / ``[B, L]``."""


@dataclass(frozen=True)
class Entry:
    """A registered function and its input contract (travels to workers with the function).

    Attributes:
        name: the registered name (lower case).
        fn: the function.
        needs: inputs it cannot run without (default: its parameters without a default value).
        accepts: every input it takes (``None``: it takes ``**kwargs``, so everything offered).
        layouts: batch layouts it reads (``()``: any).
        zero_at_zero_advantage: (a policy loss) a row whose advantages are all 0 adds exactly 0 to the
            loss and to its gradient, so an actor may leave such rows out of its forward and backward.
    """

    name: str
    fn: Callable
    needs: frozenset[str]
    accepts: frozenset[str] | None
    layouts: tuple[str, ...] = ()
    zero_at_zero_advantage: bool = False

    def missing(self, available: Iterable[str]) -> list[str]:
        """The inputs this entry needs that ``available`` lacks, sorted."""
        return sorted(self.needs - set(available))

    def serves(self, available: Iterable[str], layout: str) -> bool:
        """Whether a loop offering ``available`` inputs in ``layout`` can call this entry."""
        return not self.missing(available) and (not self.layouts or layout in self.layouts)

    def __call__(self, **available):
        """Call the function with the offered inputs it accepts (the rest are not its business)."""
        if self.accepts is not None:
            available = {k: v for k, v in available.items() if k in self.accepts}
        return self.fn(**available)


def _signature_contract(fn: Callable) -> tuple[frozenset[str], frozenset[str] | None]:
    params = inspect.signature(fn).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    needs = frozenset(p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return needs, None
    return needs, frozenset(p.name for p in params if p.kind in kinds)


class Registry:
    """A case-insensitive registry of named callables, each with its input contract.

    Example:
        >>> advantages = Registry("advantage")
        >>> @advantages.register("mine", layouts=("sequence",))
        ... def mine(rewards, group_size=1):
        ...     return rewards
        >>> advantages.get("MINE") is mine
        True
        >>> sorted(advantages.entry("mine").needs)
        ['rewards']
    """

    def __init__(self, kind: str, key: str | None = None):
        self.kind, self.key = kind, key
        self._items: dict[str, Entry] = {}
        self._aliases: dict[str, str] = {}

    def register(
        self,
        name: str,
        *,
        needs: Iterable[str] | None = None,
        layouts: Iterable[str] = (),
        aliases: Iterable[str] = (),
        overwrite: bool = False,
        zero_at_zero_advantage: bool = False,
    ):
        """Decorator registering a function under ``name`` (case-insensitive).

        Args:
            name: the name recipes use (``algorithm.advantage: name``).
            needs: inputs it cannot run without; default: its parameters that have no default.
            layouts: batch layouts it reads (``trajectory``, ``sequence``); default: any.
            aliases: other names for the same entry (old names kept after a rename).
            overwrite: replace an entry of the same name.
            zero_at_zero_advantage: (a policy loss) a row whose advantages are all 0 adds exactly 0 to the
                loss and its gradient (true of PPO's clipped surrogate, whatever the ratio): the LM actor
                then leaves such rows out of the update (GRPO groups whose completions all scored alike).
        """
        key = name.lower()
        layouts = tuple(layouts)
        for layout in layouts:
            if layout not in LAYOUTS:
                raise ConfigError(f"layouts: expected some of {list(LAYOUTS)}, got {layout!r}", "layouts")

        def deco(fn: Callable) -> Callable:
            old = self._items.get(key)
            if old is not None and not overwrite and old.fn is not fn:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered; pass overwrite=True to replace it"
                )
            sig_needs, accepts = _signature_contract(fn)
            entry = Entry(
                key, fn, frozenset(needs) if needs is not None else sig_needs, accepts, layouts,
                zero_at_zero_advantage,
            )  # fmt: skip
            self._items[key] = entry
            self._aliases.pop(key, None)
            for alias in aliases:
                self._aliases[alias.lower()] = key
            return fn

        return deco

    def _resolve(self, name: str, key: str | None = None) -> str:
        """The registered (lower-case) name behind ``name`` or one of its aliases."""
        if name not in self:
            raise UnknownNameError(self.kind, str(name), self._items, key=key or self.key)
        return self._aliases.get(name.lower(), name.lower())

    def entry(self, name_or_fn) -> Entry:
        """The :class:`Entry` registered as ``name``; a plain function gets its signature's contract."""
        if callable(name_or_fn) and not isinstance(name_or_fn, str):
            if isinstance(name_or_fn, Entry):
                return name_or_fn
            needs, accepts = _signature_contract(name_or_fn)
            return Entry(getattr(name_or_fn, "__name__", "custom"), name_or_fn, needs, accepts)
        return self._items[self._resolve(name_or_fn)]

    def get(self, name: str, key: str | None = None) -> Callable:
        """The function registered as ``name``; :class:`UnknownNameError` (with "did you mean") otherwise."""
        return self._items[self._resolve(name, key)].fn

    def names(self) -> list[str]:
        return sorted(self._items)

    def aliases(self, name: str) -> list[str]:
        """Other names of the entry registered as ``name`` (old names kept after a rename)."""
        key = self._resolve(name)
        return sorted(a for a, target in self._aliases.items() if target == key)

    def serving(self, available: Iterable[str], layout: str) -> list[str]:
        """Names of the entries a loop offering ``available`` inputs in ``layout`` can call."""
        available = set(available)
        return [n for n in self.names() if self._items[n].serves(available, layout)]

    def __contains__(self, name: str) -> bool:
        return isinstance(name, str) and (name.lower() in self._items or name.lower() in self._aliases)


def check_serves(
    registry: Registry, choice, available: Iterable[str], layout: str, key: str, loop: str
) -> Entry:
    """The entry for ``choice`` (a name or a function), or a :class:`ConfigError` naming ``key``, the
    value, what the loop cannot give it and the choices that would work."""
    entry = registry.entry(choice)
    available = set(available)
    missing = entry.missing(available)
    problems = []
    if missing:
        problems.append(f"needs input(s) {', '.join(missing)} that the {loop} loop does not provide")
    if entry.layouts and layout not in entry.layouts:
        problems.append(f"reads {'/'.join(entry.layouts)} batches, the {loop} loop has {layout} batches")
    if problems:
        ok = registry.serving(available, layout)
        raise ConfigError(
            f"{key}: {registry.kind} {entry.name!r} {' and '.join(problems)} "
            f"(it offers: {', '.join(sorted(available))}); compatible choices: {', '.join(ok) or '(none)'}",
            key,
        )
    return entry

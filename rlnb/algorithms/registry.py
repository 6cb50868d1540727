"""Name -> function registries with case-insensitive lookup and "did you mean" errors."""

from __future__ import annotations

from collections.abc import Callable

from rlnb.errors import UnknownNameError


class Registry:
    """A case-insensitive registry of named callables.

    Example:
        >>> advantages = Registry("advantage")
        >>> @advantages.register("mine")
        ... def mine(rewards):
        ...     return rewards
        >>> advantages.get("MINE") is mine
        True
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, Callable] = {}

    def register(self, name: str, *, overwrite: bool = False):
        """Decorator registering a function under ``name`` (case-insensitive)."""
        key = name.lower()

        def deco(fn: Callable) -> Callable:
            if key in self._items and not overwrite and self._items[key] is not fn:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered; pass overwrite=True to replace it"
                )
            self._items[key] = fn
            return fn

        return deco

    def get(self, name: str, key: str | None = None) -> Callable:
        """The function registered as ``name``; :class:`UnknownNameError` (with "did you mean") otherwise."""
        if not isinstance(name, str) or name.lower() not in self._items:
            raise UnknownNameError(self.kind, str(name), self._items, key=key)
        return self._items[name.lower()]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return isinstance(name, str) and name.lower() in self._items

"""Placement: which device slots host which component ranks. Pure functions, no cluster needed.

A placement spec maps component names to slot selections, as a recipe writes it::

    component_placement:
      actor: 0-1              # slots 0 and 1
      "rollout,env": all      # both components on every slot
      reward: 2,3             # a list
      sim: {node_group: sim, slots: 0-1}   # slots 0-1 among the workers of node group "sim"
      learner: {host: gpu-node-3}          # every slot on the host named gpu-node-3

The mode follows from the overlap: all components on the same slots is **collocated**, pairwise
disjoint is **disaggregated**, anything else is **hybrid**.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rlnb.errors import PlacementError

COLLOCATED, DISAGGREGATED, HYBRID = "collocated", "disaggregated", "hybrid"
_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_slots(spec, num_slots: int, key: str = "placement") -> tuple[int, ...]:
    """Parse a slot selection into sorted, unique slot indices within ``[0, num_slots)``.

    Accepts ``"all"``, an int, ``"0-3"``, ``"0,2"``, ``"0-1,4"`` or a list of ints/ranges.

    Example:
        >>> parse_slots("0-1,3", num_slots=4)
        (0, 1, 3)
    """
    valid = f"valid slots are 0-{num_slots - 1}" if num_slots > 0 else "the cluster has no slots"
    if isinstance(spec, bool) or spec is None:
        raise PlacementError(
            f"{key}: expected a slot selection like '0-1', '0,2' or 'all', got {spec!r}", key
        )
    if isinstance(spec, int):
        parts: list = [str(spec)]
    elif isinstance(spec, str):
        if spec.strip().lower() == "all":
            if num_slots <= 0:
                raise PlacementError(f"{key}: 'all' selects nothing: {valid}", key)
            return tuple(range(num_slots))
        parts = [p for p in spec.split(",")]
    elif isinstance(spec, Sequence):
        parts = [str(p) for p in spec]
    else:
        raise PlacementError(
            f"{key}: expected a slot selection like '0-1', '0,2' or 'all', got {type(spec).__name__} {spec!r}",
            key,
        )
    slots: list[int] = []
    for part in parts:
        m = _RANGE.match(part)
        if not m:
            raise PlacementError(
                f"{key}: cannot parse {part.strip()!r} in {spec!r}; expected N or N-M ({valid})", key
            )
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise PlacementError(f"{key}: range {part.strip()!r} is reversed; write {hi}-{lo}", key)
        for s in range(lo, hi + 1):
            if s >= num_slots:
                raise PlacementError(f"{key}: slot {s} in {spec!r} is beyond the cluster: {valid}", key)
            if s in slots:
                raise PlacementError(f"{key}: slot {s} appears twice in {spec!r}", key)
            slots.append(s)
    if not slots:
        raise PlacementError(f"{key}: empty slot selection {spec!r} ({valid})", key)
    return tuple(sorted(slots))


@dataclass(frozen=True)
class Placement:
    """Resolved placement: component name -> global slot ranks (one rank per slot, in order)."""

    slots: Mapping[str, tuple[int, ...]]

    @property
    def mode(self) -> str:
        """``collocated``, ``disaggregated`` or ``hybrid``."""
        return placement_mode(self.slots)

    def __getitem__(self, component: str) -> tuple[int, ...]:
        if component not in self.slots:
            from rlnb.errors import did_you_mean

            raise PlacementError(
                f"no placement for component {component!r}; placed: {sorted(self.slots)}."
                + did_you_mean(component, self.slots),
                component,
            )
        return self.slots[component]

    def components_on(self, slot: int) -> list[str]:
        return [c for c, s in self.slots.items() if slot in s]


def placement_mode(slots: Mapping[str, Sequence[int]]) -> str:
    """Classify a placement: every component on the same slots, pairwise disjoint, or mixed."""
    sets = [frozenset(s) for s in slots.values()]
    if len(sets) <= 1 or all(s == sets[0] for s in sets):
        return COLLOCATED
    if all(a.isdisjoint(b) for i, a in enumerate(sets) for b in sets[i + 1 :]):
        return DISAGGREGATED
    return HYBRID


def resolve_placement(
    spec: Mapping,
    num_slots: int,
    node_groups: Mapping[str, Sequence[int]] | None = None,
    required: Sequence[str] = (),
    known: Sequence[str] | None = None,
    hosts: Mapping[str, Sequence[int]] | None = None,
) -> Placement:
    """Resolve a recipe's ``component_placement`` mapping against a cluster.

    Args:
        spec: component (or comma-joined components) -> slot selection or
            ``{node_group: NAME, slots: SELECTION}`` or ``{host: NAME, slots: SELECTION}``.
        num_slots: how many slots the cluster has.
        node_groups: node group name -> the global slot ranks in it (from worker resources).
        hosts: host name -> the global slot ranks on it (the workers' hosts).
        required: components that must be placed.
        known: if given, component names outside it are rejected with a "did you mean".

    Example:
        >>> p = resolve_placement({"actor,rollout": "0-1", "env": 2}, num_slots=3)
        >>> p.slots["rollout"], p.mode
        ((0, 1), 'hybrid')
    """
    from rlnb.errors import did_you_mean

    if not isinstance(spec, Mapping):
        raise PlacementError(
            f"component_placement: expected a mapping like {{actor: 0-1}}, got {type(spec).__name__} {spec!r}",
            "component_placement",
        )
    node_groups = dict(node_groups or {})
    out: dict[str, tuple[int, ...]] = {}
    for raw_key, value in spec.items():
        names = [n.strip() for n in str(raw_key).split(",")]
        key = f"component_placement.{raw_key}"
        if any(not n for n in names):
            raise PlacementError(f"{key}: empty component name in {raw_key!r}", key)
        if isinstance(value, Mapping):
            slots = _resolve_named_slots(value, node_groups, dict(hosts or {}), key)
        else:
            slots = parse_slots(value, num_slots, key)
        for name in names:
            if known is not None and name not in known:
                raise PlacementError(
                    f"{key}: unknown component {name!r}; components are {sorted(known)}."
                    + did_you_mean(name, known),
                    key,
                )
            if name in out:
                raise PlacementError(f"{key}: component {name!r} is placed twice", key)
            out[name] = slots
    missing = [r for r in required if r not in out]
    if missing:
        raise PlacementError(
            f"component_placement: no placement for {missing}; add e.g. `{missing[0]}: 0`",
            "component_placement",
        )
    return Placement(out)


def _resolve_named_slots(
    value: Mapping, node_groups: Mapping[str, Sequence[int]], hosts: Mapping[str, Sequence[int]], key: str
) -> tuple[int, ...]:
    """``{node_group: NAME, slots: ...}`` or ``{host: NAME, slots: ...}``: ``slots`` among that name's workers."""
    from rlnb.errors import did_you_mean

    extra = set(value) - {"node_group", "host", "slots"}
    if extra:
        raise PlacementError(
            f"{key}: unexpected keys {sorted(extra)}; expected node_group or host, and slots", key
        )
    if ("node_group" in value) == ("host" in value):
        raise PlacementError(
            f"{key}: expected node_group or host, one of them; got keys {sorted(value)}", key
        )
    if "host" in value:  # the workers of one machine, by its host name
        name, named = value["host"], hosts
        missing = f"host {name!r} has no workers; the cluster's hosts: {sorted(hosts) or '(none)'}."
        hint = ""
    else:  # the workers started with that resource
        name, named = value["node_group"], node_groups
        missing = f"node group {name!r} has no workers; node groups: {sorted(node_groups) or '(none)'}."
        hint = " Start workers with `dask worker ADDRESS --resources NAME=1`."
    if name not in named:
        raise PlacementError(f"{key}: {missing}" + did_you_mean(str(name), named) + hint, key)
    members = list(named[name])
    local = parse_slots(value.get("slots", "all"), len(members), f"{key}.slots")
    return tuple(sorted(members[i] for i in local))

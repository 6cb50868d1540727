"""An env's state as plain data, so a checkpoint loads without running code.

A checkpoint used to pickle the vector envs whole; loading such a file runs whatever code it names. Here the
state is read out of the live objects instead (every attribute that holds plain data: numbers, strings, numpy
arrays and tensors, RNGs, lists, tuples, dicts and deques of them, and the attributes of nested objects) and,
on resume, written back into envs freshly built from their constructor (the same class and arguments, so the
same objects exist to receive it). Nothing is constructed from the file but numpy arrays, tensors and RNGs of
numpy's own bit generators.

What is not plain data (simulator handles, renderers, callables) comes from the constructor; MuJoCo's physics
state is read and written through MuJoCo's own API (:func:`rlnb.envs.gym_envs.capture_sim_state`).

Example:
    >>> import gymnasium as gym
    >>> a, b = gym.make("CartPole-v1"), gym.make("CartPole-v1")
    >>> _ = a.reset(seed=3)
    >>> restore_state(b, capture_state(a))
    >>> bool((a.unwrapped.state == b.unwrapped.state).all())
    True
"""

from __future__ import annotations

import collections
import types

import numpy as np

TAG = "__rlnb_state__"  # marks an encoded record (a dict the encoding made, not one of the env's)
MAX_DEPTH = 16  # nested objects followed this deep (a vector env, its envs, their wrappers, their parts)
# numpy's bit generators, by the name their state carries: the only classes a restore builds
BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")
_LEAVES = (type(None), bool, int, float, complex, str, bytes, np.generic)
_SKIP = {TAG: "skip"}
_NOT_OBJECTS = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def capture_state(obj) -> dict:
    """The plain-data state of ``obj`` and the objects it holds (see the module's docstring)."""
    return _encode(obj, 0, set())


def restore_state(obj, state: dict) -> None:
    """Write a :func:`capture_state` of an object of the same construction back into ``obj``.

    Raises:
        ValueError: ``state`` is not such a record.
    """
    if not (isinstance(state, dict) and state.get(TAG) == "object"):
        raise ValueError("restore_state: expected a record capture_state made")
    _restore_object(obj, state)


def _encode(value, depth: int, seen: set):
    if isinstance(value, _LEAVES):
        return value
    if isinstance(value, np.ndarray):
        return _SKIP if value.dtype.hasobject else value.copy()
    if _is_tensor(value):
        return value.detach().cpu().clone()
    if isinstance(value, np.random.Generator):
        return {TAG: "generator", "state": value.bit_generator.state}
    if depth >= MAX_DEPTH or id(value) in seen:
        return _SKIP
    if isinstance(value, (list, tuple)):
        seen.add(id(value))
        return {TAG: type(value).__name__, "items": [_encode(v, depth + 1, seen) for v in value]}
    if isinstance(value, collections.deque):
        seen.add(id(value))
        return {TAG: "deque", "items": [_encode(v, depth + 1, seen) for v in value], "maxlen": value.maxlen}
    if isinstance(value, dict):
        seen.add(id(value))
        if not all(isinstance(k, _LEAVES) for k in value):
            return _SKIP
        return {TAG: "dict", "items": {k: _encode(v, depth + 1, seen) for k, v in value.items()}}
    if callable(value) or isinstance(value, _NOT_OBJECTS):
        return _SKIP  # comes from the constructor
    try:
        attrs = vars(value)
    except TypeError:  # no __dict__ (a C object: a simulator handle)
        return _SKIP
    seen.add(id(value))
    return {
        TAG: "object",
        "attrs": {k: _encode(v, depth + 1, seen) for k, v in attrs.items() if isinstance(k, str)},
    }


_KEEP = object()  # restore: leave the current value as the constructor made it


def _decode(current, record):
    """The value to put where ``current`` is, from its record (or ``_KEEP``)."""
    if not isinstance(record, dict) or TAG not in record:
        return record  # plain data (a leaf, an array, a tensor)
    kind = record[TAG]
    if kind == "skip":
        return _KEEP
    if kind == "object":
        if current is not None and hasattr(current, "__dict__"):
            _restore_object(current, record)
        return _KEEP
    if kind == "generator":
        name = record["state"].get("bit_generator")
        if name not in BIT_GENERATORS:
            raise ValueError(f"env state: unknown bit generator {name!r} (expected one of {BIT_GENERATORS})")
        rng = np.random.Generator(getattr(np.random, name)())
        rng.bit_generator.state = record["state"]
        return rng
    if kind == "dict":
        cur = current if isinstance(current, dict) else {}
        out = {}
        for k, v in record["items"].items():
            got = _decode(cur.get(k), v)
            if got is _KEEP:
                if k not in cur:
                    continue
                got = cur[k]
            out[k] = got
        return out
    if kind in ("list", "tuple", "deque"):
        cur = list(current) if isinstance(current, (list, tuple, collections.deque)) else []
        items = []
        for i, v in enumerate(record["items"]):
            got = _decode(cur[i] if i < len(cur) else None, v)
            if got is _KEEP:
                if i >= len(cur):
                    return _KEEP  # an element only the constructor can make, and none to keep
                got = cur[i]
            items.append(got)
        if kind == "deque":
            return collections.deque(items, maxlen=record["maxlen"])
        return tuple(items) if kind == "tuple" else items
    raise ValueError(f"env state: unknown record kind {kind!r}")


def _restore_object(obj, record: dict) -> None:
    """Write ``record``'s attributes into ``obj``: data attributes only. A name the object's class defines (a
    method, a property), a dunder, or an attribute now holding a method, class or function is refused: a file
    cannot add or replace behaviour. (A name the fresh object lacks is state its env makes later, as
    gymnasium's ``_np_random`` at the first reset.)"""
    attrs = vars(obj)
    for name, rec in record["attrs"].items():
        if name not in attrs and (name.startswith("__") or _behaviour(type(obj), name)):
            raise ValueError(
                f"env state: {type(obj).__name__}.{str(name)[:80]} is not a data attribute; a checkpoint restores data only"
            )
        current = attrs.get(name)
        if (callable(current) or isinstance(current, _NOT_OBJECTS)) and rec != _SKIP:
            raise ValueError(
                f"env state: {type(obj).__name__}.{name} is {type(current).__name__}, not state; a checkpoint "
                "restores data only"
            )
        got = _decode(current, rec)
        if got is not _KEEP:
            attrs[name] = got


def _behaviour(cls, name: str) -> bool:
    """Whether ``cls`` defines ``name`` as behaviour (a method, property or other descriptor, a class), not as a
    data default such as gymnasium's ``Env._np_random = None``."""
    import inspect

    found = inspect.getattr_static(cls, name, _KEEP)
    if found is _KEEP:
        return False
    return (
        callable(found)
        or isinstance(found, (property, classmethod, staticmethod))
        or hasattr(type(found), "__get__")
    )


def _is_tensor(value) -> bool:
    torch = __import__("sys").modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)

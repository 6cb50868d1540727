"""Load recipes: YAML + dotted overrides -> typed dataclasses, with every error reported at once.

Example:
    >>> recipe = load_recipe(None, ["env.num_envs=16", "algorithm.clip_coef=0.1"])
    >>> recipe.env.num_envs, recipe.algorithm.clip_coef
    (16, 0.1)
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import functools
import inspect
import itertools
import logging
import math
import os
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from rlnb.config.checks import OLD_LOOPS, infer_family
from rlnb.config.presets import apply_preset
from rlnb.config.schema import Recipe
from rlnb.errors import ConfigError, did_you_mean
from rlnb.files import UnsafePathError, read_text_regular

log = logging.getLogger("rlnb")
_SAID_FAMILY: set[str] = set()  # recipe files whose family was inferred, said once a process


MAX_MAGNITUDE = 1e15  # the largest number a recipe's float field takes (either sign)
MAX_RECIPE_BYTES = 1 << 20  # a recipe is a page of settings: a bigger file is not one (and is not read whole)
MAX_DEPTH = 32  # nesting of a recipe's mappings and lists (its sections are two or three deep)
MAX_NUMBER_CHARS = 64  # a number written with more characters is no setting (and int() of one is costly)


class _StrictLoader(yaml.SafeLoader):
    """YAML as a recipe takes it: no duplicate keys (where the last would silently win), no aliases (whose
    expansion lets a few hundred bytes grow into gigabytes: a "billion laughs"), nothing nested deeper than
    :data:`MAX_DEPTH`, no number longer than :data:`MAX_NUMBER_CHARS` characters."""

    _depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.YAMLError(
                f"a YAML alias (*name) at line {mark.line + 1}: recipes take none; write the value out"
            )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise yaml.YAMLError(
                    f"values nested more than {MAX_DEPTH} deep at line {mark.line + 1}: no recipe setting is"
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_yaml_int(self, node):
        self._check_length(node, "an integer")
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node):
        self._check_length(node, "a number")
        return super().construct_yaml_float(node)

    @staticmethod
    def _check_length(node, kind: str) -> None:
        if len(node.value) > MAX_NUMBER_CHARS:
            raise yaml.YAMLError(
                f"{kind} of {len(node.value)} characters at line {node.start_mark.line + 1}: no recipe setting takes "
                f"one longer than {MAX_NUMBER_CHARS}"
            )

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.YAMLError(f"duplicate key {key!r} at line {key_node.start_mark.line + 1}")
            seen.add(key) if isinstance(key, (str, int, float, bool)) else None
        return super().construct_mapping(node, deep)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _StrictLoader.construct_yaml_float)


def read_yaml(text: str):
    """``text`` read as YAML, refusing duplicate keys, aliases, deep nesting and overlong numbers (see
    :class:`_StrictLoader`).

    Raises:
        yaml.YAMLError: malformed YAML or any of those (a value YAML's own constructors fail on too).
    """
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except (ValueError, OverflowError, RecursionError) as e:  # (a constructor's own failure, as YAML's)
        raise yaml.YAMLError(f"{type(e).__name__}: {str(e)[:200]}") from None


class RecipeError(ConfigError):
    """One or more recipe errors; ``errors`` lists them (each names the file and the dotted key)."""

    def __init__(self, errors: list[str], source: str = "<recipe>"):
        self.errors, self.source = errors, source
        lines = "\n".join(f"  - {e}" for e in errors)
        super().__init__(f"{len(errors)} error(s) in {source}:\n{lines}", key=None)


# ---------------------------------------------------------------------------- docs of fields
@functools.cache
def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string literal under each field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@functools.cache
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# ---------------------------------------------------------------------------- conversion
def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        empty = " (or empty)" if type(None) in typing.get_args(tp) else ""
        return " or ".join(_type_name(a) for a in args) + empty
    if origin is list:
        (item,) = typing.get_args(tp)
        plural = {int: "integers", float: "numbers", str: "strings", bool: "true/false values"}
        return f"a list of {plural.get(item) or _type_name(item)}"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _short(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (a 5,000-digit number is said, not printed)."""
    text = (
        repr(value)
        if not isinstance(value, int) or value.bit_length() < 4000
        else f"<an integer of {value.bit_length()} bits>"
    )
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _convert(value, tp, key: str, errors: list[str]):
    """Check/convert ``value`` to type ``tp``; append an error and return the value unchanged on mismatch."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, errors)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(value, inner[0], key, errors)
        for option in inner:  # the first type the value fits
            trial: list[str] = []
            converted = _convert(value, option, key, trial)
            if not trial:
                return converted
        errors.append(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {_short(value)}")
        return value
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            errors.append(
                f"{key}: expected one of {', '.join(map(repr, choices))}, got {_short(value)}.{did_you_mean(str(value), map(str, choices))}"
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            errors.append(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {_short(value)}")
            return value
        (item_tp,) = typing.get_args(tp)
        return [_convert(v, item_tp, f"{key}[{i}]", errors) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{key}: expected a mapping, got {type(value).__name__} {_short(value)}")
        return value
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > MAX_MAGNITUDE:  # (float() of a huge integer overflows)
            errors.append(
                f"{key}: expected a number of magnitude at most {MAX_MAGNITUDE:g}, got {str(value)[:40]}..."
            )
            return value
        return float(value)
    if tp is float and isinstance(value, str) and len(value) <= MAX_NUMBER_CHARS:
        with contextlib.suppress(ValueError):  # YAML reads 1e-3 (no dot) as a string
            value = float(value)
    if tp is float and isinstance(value, float) and not math.isfinite(value):
        errors.append(f"{key}: expected a finite number, got {_short(value)}")
        return value
    if tp is float and isinstance(value, float) and abs(value) > MAX_MAGNITUDE:
        # (a coefficient this big overflows float32 in the first update, far from where it was set)
        errors.append(f"{key}: expected a number of magnitude at most {MAX_MAGNITUDE:g}, got {_short(value)}")
        return value
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        errors.append(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {_short(value)}")
    elif tp is int and not -(2**63) <= value < 2**63:
        errors.append(f"{key}: expected an integer of at most 64 bits, got {_short(value)}")
    elif tp is str and any(ord(c) < 32 and c not in "\t\n" for c in value):
        errors.append(f"{key}: expected text without control characters, got {value[:80]!r}")
    return value


def _build(cls, data, prefix: str, errors: list[str]):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        errors.append(
            f"{prefix or 'recipe'}: expected a mapping of keys, got {type(data).__name__} {_short(data)}"
        )
        return cls()
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            errors.append(
                f"{key}: unknown key; valid keys here: {', '.join(names)}.{did_you_mean(str(k), names)}"
            )
            continue
        kwargs[k] = _convert(v, hints[k], key, errors)
    return cls(**kwargs)


def to_dict(obj) -> dict:
    """A recipe (or section) as plain nested dicts, ready for YAML."""
    return dataclasses.asdict(obj)


def to_yaml(obj) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False)


# ---------------------------------------------------------------------------- overrides
def _set_dotted(tree: dict, dotted: str, value, errors: list[str]) -> None:
    if dotted == "loop":  # (the key before families: read as the family it names, see _old_loop_key)
        tree["loop"] = value
        return
    parts = dotted.split(".")
    node, cls = tree, Recipe
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        if cls is not None:
            names = [f.name for f in dataclasses.fields(cls)]
            if part not in names:
                errors.append(
                    f"{here}: unknown key; valid keys here: {', '.join(names)}.{did_you_mean(part, names)}"
                )
                return
            tp = _hints(cls)[part]
            nxt_cls = tp if dataclasses.is_dataclass(tp) else None
        else:
            nxt_cls = None
        if i == len(parts) - 1:
            if here == "cluster.component_placement" and isinstance(value, dict):
                node[part] = value
            elif parts[:2] == ["cluster", "component_placement"] and len(parts) == 3:
                _place_component(node, part, value)
            else:
                node[part] = value
            return
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node, cls = node[part], nxt_cls


def _place_component(placement: dict, component: str, value) -> None:
    """``cluster.component_placement.actor=0-1``: move ``actor`` out of any comma-joined key first."""
    names = [n.strip() for n in component.split(",")]
    for key in list(placement):
        members = [m.strip() for m in str(key).split(",")]
        rest = [m for m in members if m not in names]
        if len(rest) != len(members):
            slots = placement.pop(key)
            if rest:
                placement[",".join(rest)] = slots
    placement[component] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b=1"`` -> ``("a.b", 1)``; the value is read as YAML (numbers, true/false, lists...)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. env.num_envs=16", text)
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = read_yaml(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


# ---------------------------------------------------------------------------- entry point
def recipe_path(name_or_path: str | Path) -> Path:
    """A recipe file: a path, or the name of a bundled recipe (``ppo_cartpole``)."""
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ConfigError(f"recipe: expected a recipe file or bundled name, got {name_or_path!r}", "recipe")
    p = Path(name_or_path)
    if p.is_dir():
        raise ConfigError(f"recipe: expected a recipe file, got {str(p)!r}, which is a directory", "recipe")
    if p.exists():
        return p
    bundled = bundled_recipes()
    stem = p.name.removesuffix(".yaml")
    if stem in bundled:
        return bundled[stem]
    raise ConfigError(
        f"recipe {str(name_or_path)!r} not found; bundled recipes: {', '.join(sorted(bundled))}."
        + did_you_mean(stem, bundled),
        "recipe",
    )


def bundled_recipes() -> dict[str, Path]:
    """Recipes shipped with the package (``rlnb/recipes/``; ``recipes/`` in a clone links there)."""
    root = Path(__file__).resolve().parents[1] / "recipes"
    return {p.stem: p for p in sorted(root.glob("*.yaml"))}


def load_recipe(
    path: str | Path | None = None, overrides: list[str] | dict | None = None, check: bool = True
) -> Recipe:
    """Load a recipe file (or the defaults), apply dotted overrides, convert and validate.

    Args:
        path: YAML file or bundled recipe name; ``None`` for the defaults.
        overrides: ``["env.num_envs=16", ...]`` or ``{"env.num_envs": 16}``.
        check: run the range and cross-field checks (:func:`validate`).

    Raises:
        RecipeError: listing every problem at once, each with the file and the dotted key.
    """
    source = "<defaults>"
    tree: dict = {}
    if path is not None:
        p = recipe_path(path)
        source = str(p)
        try:  # a regular file of at most MAX_RECIPE_BYTES: never a FIFO or a device, never read whole if bigger
            text = read_text_regular(p, MAX_RECIPE_BYTES)
        except UnicodeDecodeError as e:
            raise RecipeError(
                [f"expected UTF-8 text (a YAML file), got byte {e.object[e.start]:#04x} at offset {e.start}"],
                source,
            ) from None
        except UnsafePathError as e:
            raise RecipeError([e.strerror], source) from None
        except ValueError:
            raise RecipeError(
                [f"expected a recipe (a page of YAML), got a file of more than {MAX_RECIPE_BYTES} bytes"],
                source,
            ) from None
        except OSError as e:
            raise RecipeError([f"cannot read it ({e.strerror or e})"], source) from None
        try:
            tree = read_yaml(text) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise RecipeError(
                [f"malformed YAML{where}: {getattr(e, 'problem', None) or e}"], source
            ) from None
        if not isinstance(tree, dict):
            raise RecipeError(
                [f"expected a mapping of sections at the top, got {type(tree).__name__}"], source
            )
        tree.setdefault("name", p.stem)
    tree = copy.deepcopy(tree)
    errors: list[str] = []
    items = overrides.items() if isinstance(overrides, dict) else [parse_override(o) for o in overrides or []]
    items = list(items)
    for key, value in items:
        _set_dotted(tree, key, value, errors)
    _old_loop_key(tree, errors)
    apply_preset(tree, errors, frozenset(key for key, _ in items))
    recipe = _build(Recipe, tree, "", errors)
    if (
        recipe.family == "auto"
    ):  # a recipe that does not say which family runs it: inferred once, and said once
        recipe.family = infer_family(recipe.rollout.backend)
        if path is not None and source not in _SAID_FAMILY:
            _SAID_FAMILY.add(source)
            log.warning(
                "%s names no family; rollout.backend=%s runs family: %s (add `family: %s` to the recipe to say so)",
                source, recipe.rollout.backend, recipe.family, recipe.family,
            )  # fmt: skip
    if check:
        try:
            errors += validate(recipe)
        except (TypeError, AttributeError, ValueError, OSError):
            if not errors:
                raise
            # (a value of the wrong type, reported above, broke a cross-field check that reads it)
    if errors:
        raise RecipeError(errors, source)
    return recipe


def _old_loop_key(tree: dict, errors: list[str]) -> None:
    """``loop: embodied`` / ``loop: grpo`` (recipes and run directories from before families): the family it names,
    unless the recipe names one itself."""
    if "loop" not in tree:
        return
    old = tree.pop("loop")
    if old not in OLD_LOOPS:
        errors.append(
            f"loop: expected one of {', '.join(map(repr, OLD_LOOPS))} (now family: ppo or grpo), got {_short(old)}"
        )
    elif tree.get("family", "auto") == "auto":
        tree["family"] = OLD_LOOPS[old]


def validate(recipe: Recipe) -> list[str]:
    """Range and cross-field checks that need no cluster (each section's beside its dataclass in
    :mod:`rlnb.config.schema`). Returns the list of problems."""
    return recipe.check()

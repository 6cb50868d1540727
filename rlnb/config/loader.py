"""Load recipes: YAML + dotted overrides -> typed dataclasses, with every error reported at once.

Example:
    >>> recipe = load_recipe(None, ["env.num_envs=16", "algorithm.clip_coef=0.1"])
    >>> recipe.env.num_envs, recipe.algorithm.clip_coef
    (16, 0.1)
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import itertools
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from rlnb.config.schema import Recipe
from rlnb.errors import ConfigError, did_you_mean


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
        errors.append(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        return value
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            errors.append(
                f"{key}: expected one of {', '.join(map(repr, choices))}, got {value!r}.{did_you_mean(str(value), map(str, choices))}"
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            errors.append(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
            return value
        (item_tp,) = typing.get_args(tp)
        return [_convert(v, item_tp, f"{key}[{i}]", errors) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return value
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML reads 1e-3 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        errors.append(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def _build(cls, data, prefix: str, errors: list[str]):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        errors.append(f"{prefix or 'recipe'}: expected a mapping of keys, got {type(data).__name__} {data!r}")
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
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


# ---------------------------------------------------------------------------- entry point
def recipe_path(name_or_path: str | Path) -> Path:
    """A recipe file: a path, or the name of a bundled recipe (``ppo_cartpole``)."""
    p = Path(name_or_path)
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
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise RecipeError([f"malformed YAML{where}: {getattr(e, 'problem', e)}"], source) from None
        if not isinstance(tree, dict):
            raise RecipeError(
                [f"expected a mapping of sections at the top, got {type(tree).__name__}"], source
            )
        tree.setdefault("name", p.stem)
    tree = copy.deepcopy(tree)
    errors: list[str] = []
    items = overrides.items() if isinstance(overrides, dict) else [parse_override(o) for o in overrides or []]
    for key, value in items:
        _set_dotted(tree, key, value, errors)
    recipe = _build(Recipe, tree, "", errors)
    if check:
        errors += validate(recipe)
    if errors:
        raise RecipeError(errors, source)
    return recipe


def validate(recipe: Recipe) -> list[str]:
    """Range and cross-field checks that need no cluster. Returns the list of problems."""
    from rlnb.algorithms import ADVANTAGES, POLICY_LOSSES, REWARDS
    from rlnb.algorithms.interactions import INTERACTIONS

    errs: list[str] = []

    def need(ok, key: str, expected: str, given):
        try:
            passed = ok()
        except TypeError:  # a wrong type, already reported by the conversion
            return
        if not passed:
            errs.append(f"{key}: expected {expected}, got {given!r}")

    r, a, e = recipe.runner, recipe.algorithm, recipe.env
    need(lambda: r.steps >= 0, "runner.steps", "an integer >= 0", r.steps)
    need(lambda: r.save_interval >= 0, "runner.save_interval", "an integer >= 0", r.save_interval)
    need(lambda: r.keep_checkpoints >= 1, "runner.keep_checkpoints", "an integer >= 1", r.keep_checkpoints)
    need(
        lambda: r.completions_interval >= 0,
        "runner.completions_interval",
        "an integer >= 0",
        r.completions_interval,
    )
    if (
        recipe.rollout.backend == "policy"
        and isinstance(r.completions_interval, int)
        and r.completions_interval
    ):
        errs.append(
            f"runner.completions_interval: {r.completions_interval} logs an LM's completions; this recipe trains a "
            "policy on an env (rollout.backend=policy): look at its batches with loop.sample() instead"
        )
    need(lambda: r.max_restarts >= 0, "runner.max_restarts", "an integer >= 0", r.max_restarts)
    need(lambda: r.eval_episodes >= 1, "runner.eval_episodes", "an integer >= 1", r.eval_episodes)
    need(
        lambda: 0.0 <= recipe.data.sft_noise <= 1.0,
        "data.sft_noise",
        "a number in [0, 1]",
        recipe.data.sft_noise,
    )
    need(
        lambda: 0.0 < recipe.data.held_out_frac < 1.0,
        "data.held_out_frac",
        "a number in (0, 1)",
        recipe.data.held_out_frac,
    )
    d = recipe.data
    need(
        lambda: 0 <= d.min_operand <= d.max_operand,
        "data.min_operand",
        f"an integer from 0 to data.max_operand ({d.max_operand})",
        d.min_operand,
    )
    errs.extend(_sft_turns_errors(d, recipe.rollout))
    need(lambda: 0.0 <= a.gamma <= 1.0, "algorithm.gamma", "a number in [0, 1]", a.gamma)
    need(lambda: 0.0 <= a.gae_lambda <= 1.0, "algorithm.gae_lambda", "a number in [0, 1]", a.gae_lambda)
    need(lambda: a.clip_coef > 0, "algorithm.clip_coef", "a number > 0", a.clip_coef)
    need(
        lambda: a.dual_clip is None or a.dual_clip > 1,
        "algorithm.dual_clip",
        "a number > 1 (or empty)",
        a.dual_clip,
    )
    need(lambda: a.update_epochs >= 1, "algorithm.update_epochs", "an integer >= 1", a.update_epochs)
    need(
        lambda: a.behave_weight_cap is None or a.behave_weight_cap > 1,
        "algorithm.behave_weight_cap",
        "a number > 1 (or empty)",
        a.behave_weight_cap,
    )
    need(
        lambda: (
            isinstance(a.max_staleness, int)
            and not isinstance(a.max_staleness, bool)
            and a.max_staleness >= 0
        ),
        "algorithm.max_staleness",
        "an integer >= 0 (0: synchronous)",
        a.max_staleness,
    )
    need(lambda: a.num_minibatches >= 1, "algorithm.num_minibatches", "an integer >= 1", a.num_minibatches)
    need(lambda: a.max_grad_norm > 0, "algorithm.max_grad_norm", "a number > 0", a.max_grad_norm)
    need(lambda: recipe.actor.lr > 0, "actor.lr", "a number > 0", recipe.actor.lr)
    need(
        lambda: recipe.actor.torch_threads >= 1,
        "actor.torch_threads",
        "an integer >= 1",
        recipe.actor.torch_threads,
    )
    need(
        lambda: all(h > 0 for h in recipe.actor.model.hidden_sizes),
        "actor.model.hidden_sizes",
        "positive widths",
        recipe.actor.model.hidden_sizes,
    )
    need(
        lambda: recipe.rollout.steps_per_rollout >= 1,
        "rollout.steps_per_rollout",
        "an integer >= 1",
        recipe.rollout.steps_per_rollout,
    )
    need(lambda: e.num_envs >= 1, "env.num_envs", "an integer >= 1", e.num_envs)
    need(lambda: e.pipeline_stages >= 1, "env.pipeline_stages", "an integer >= 1", e.pipeline_stages)
    ints = all(isinstance(x, int) for x in (e.num_envs, e.pipeline_stages))
    if ints and e.num_envs >= 1 and e.pipeline_stages >= 1 and e.num_envs % e.pipeline_stages:
        errs.append(f"env.pipeline_stages: {e.pipeline_stages} stages must divide env.num_envs={e.num_envs}")
    need(
        lambda: a.max_sampling_rounds >= 1,
        "algorithm.max_sampling_rounds",
        "an integer >= 1",
        a.max_sampling_rounds,
    )
    if a.dynamic_sampling is True and isinstance(a.max_staleness, int) and a.max_staleness > 0:
        errs.append(
            f"algorithm.dynamic_sampling: it samples more prompts until a synchronous step's batch has enough groups "
            f"with a learning signal; with algorithm.max_staleness={a.max_staleness} (asynchronous) groups are trained "
            "as they finish. Set one of them off"
        )
    if a.dynamic_sampling is True and recipe.rollout.backend == "policy":
        errs.append(
            "algorithm.dynamic_sampling: it filters an LM's groups of completions; this recipe trains a policy on an env"
        )
    ro = recipe.rollout
    need(
        lambda: isinstance(ro.max_turns, int) and not isinstance(ro.max_turns, bool) and ro.max_turns >= 1,
        "rollout.max_turns",
        "an integer >= 1",
        ro.max_turns,
    )
    if ro.backend == "vllm" and isinstance(a.max_staleness, int) and a.max_staleness > 0:
        errs.append(
            f"rollout.backend: vllm generates whole completions in its engine, and asynchronous generation "
            f"(algorithm.max_staleness={a.max_staleness}) takes new weights between chunks of tokens, with rlnb's "
            "own decoding; use rollout.backend=hf, or algorithm.max_staleness=0"
        )
    if ro.backend == "policy" and recipe.actor.dtype != "float32":  # (an embodied run would ignore it)
        errs.append(
            f"actor.dtype: {recipe.actor.dtype} compute is for LM actors (rollout.backend hf or vllm); an "
            "embodied policy trains in float32; set actor.dtype=float32"
        )
    if ro.dtype != "auto" and ro.backend != "hf":
        errs.append(
            f"rollout.dtype: the precision of the hf backend's model; rollout.backend={ro.backend} does not use it; "
            "leave rollout.dtype=auto"
        )
    if ro.static_cache is True and ro.backend != "hf":
        errs.append(
            f"rollout.static_cache: a static KV cache for the hf backend's generate; rollout.backend={ro.backend} "
            "does not use it (vLLM manages its own cache); set rollout.static_cache=false"
        )
    if isinstance(ro.max_turns, int) and ro.max_turns >= 2:
        if ro.backend == "policy":
            errs.append(
                "rollout.max_turns: turns of an LM's conversation; this recipe trains a policy on an env"
            )
        elif ro.interaction is None:
            errs.append(
                f"rollout.interaction: with rollout.max_turns={ro.max_turns} something must answer between the "
                f"model's turns; registered interactions: {', '.join(INTERACTIONS.names())}"
            )
    elif ro.interaction is not None:
        errs.append(
            f"rollout.interaction: it answers between the model's turns, and with rollout.max_turns={ro.max_turns} "
            "there are none; set rollout.max_turns >= 2, or drop the interaction"
        )
    if isinstance(ro.interaction, str) and ro.interaction not in INTERACTIONS:
        errs.append(
            f"rollout.interaction: unknown interaction {ro.interaction!r}; registered: "
            f"{', '.join(INTERACTIONS.names())}.{did_you_mean(ro.interaction, INTERACTIONS.names())}"
        )
    if recipe.reward.model_path is not None:
        need(
            lambda: recipe.reward.model_batch_size >= 1,
            "reward.model_batch_size",
            "an integer >= 1",
            recipe.reward.model_batch_size,
        )
        if recipe.rollout.backend in ("hf", "vllm"):
            from rlnb.models.lm import resolve_model

            try:  # before any worker starts: a missing directory, or a hub id not in this machine's cache
                resolve_model(recipe.reward.model_path, "reward.model_path")
            except ConfigError as err:
                errs.append(str(err))
    several = isinstance(recipe.reward.name, list)  # rewards summed with reward.weights
    rewards = recipe.reward.name if several else [recipe.reward.name]
    for key, value, reg in (
        ("algorithm.advantage", a.advantage, ADVANTAGES),
        ("algorithm.policy_loss", a.policy_loss, POLICY_LOSSES),
        *((f"reward.name[{i}]" if several else "reward.name", r, REWARDS) for i, r in enumerate(rewards)),
    ):
        if isinstance(value, str) and value not in reg:
            errs.append(
                f"{key}: unknown {reg.kind} {value!r}; registered: {', '.join(reg.names())}.{did_you_mean(value, reg.names())}"
            )
    if all(
        isinstance(v, str) and v in reg
        for v, reg in ((a.advantage, ADVANTAGES), (a.policy_loss, POLICY_LOSSES))
    ):
        from rlnb.algorithms.contract import EMBODIED, LM, check_algorithm, check_rewards
        from rlnb.algorithms.rewards import recipe_rewards

        lm = recipe.rollout.backend in ("hf", "vllm")
        try:  # a combination the loop cannot serve is refused here, before any worker starts
            check_algorithm(LM if lm else EMBODIED, a.advantage, a.policy_loss)
            if lm and all(isinstance(r, str) and r in REWARDS for r in rewards):
                # a data file's fields are known once it is read: the loop checks them then
                fields = () if recipe.data.task == "arithmetic" else None
                rw = recipe.reward
                check_rewards(recipe_rewards(rw.name, rw.model_path, rw.model_batch_size), rw.weights, fields)
        except ConfigError as err:
            errs.append(str(err))
    if (
        a.advantage in ("grpo", "rloo", "reinforce_pp_baseline")
        and isinstance(a.group_size, int)
        and a.group_size < 2
    ):
        errs.append(
            f"algorithm.group_size: {a.advantage} needs at least 2 samples per prompt, got {a.group_size}"
        )
    if recipe.rollout.backend == "policy" and isinstance(e.id, str):
        err = check_env_id(e.id)
        if err:
            errs.append(err)
    if recipe.rollout.backend in ("hf", "vllm"):
        errs.extend(_check_lm(recipe))
    if not isinstance(recipe.cluster.component_placement, dict) or not recipe.cluster.component_placement:
        errs.append(
            f"cluster.component_placement: expected a mapping like {{actor: 0}}, got {recipe.cluster.component_placement!r}"
        )
    need(
        lambda: recipe.cluster.call_timeout_s > 0,
        "cluster.call_timeout_s",
        "a number > 0",
        recipe.cluster.call_timeout_s,
    )
    return errs


SFT_TURN_FIELDS = ("expression", "answer", "a", "op", "b")  # data.sft_turns' names for arithmetic problems


def _sft_turns_errors(d, ro) -> list[str]:
    """``data.sft_turns`` and ``data.sft_noise_turns``: format strings over a problem's names, as many turns as
    the rollout takes, an interaction to reply between them."""
    import string

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


def _check_lm(recipe: Recipe) -> list[str]:
    """LM-RL checks: model path, data, batch sizes."""
    from rlnb.models.lm import is_hub_id

    errs = []
    a, d, act, ro = recipe.algorithm, recipe.data, recipe.actor, recipe.rollout
    if act.model_path is None:
        errs.append("actor.model_path: expected a model directory for rollout.backend=hf/vllm, got nothing")
    elif (
        not act.build_if_missing
        and not is_hub_id(act.model_path)
        and not (Path(act.model_path) / "config.json").exists()
    ):
        errs.append(
            f"actor.model_path: {act.model_path!r} has no config.json (not a save_pretrained directory); "
            "fix the path or set actor.build_if_missing=true to build a tiny LM there"
        )
    if d.task == "file" and (d.path is None or not Path(d.path).exists()):
        errs.append(f"data.path: data.task=file needs an existing .jsonl/.parquet file, got {d.path!r}")
    if d.system_prompt is not None and not d.chat_template:  # it would be dropped without a word
        errs.append(
            f"data.system_prompt: {d.system_prompt!r} is set, but data.chat_template is false, which gives the "
            "model bare questions; set data.chat_template=true to open each prompt with it"
        )
    if d.task == "arithmetic" and d.path is not None:  # it would train on generated problems instead
        errs.append(
            f"data.path: {d.path!r} is set, but data.task is 'arithmetic', which generates its problems and "
            "would ignore the file; set data.task=file to train on it"
        )
    for key, value, low in (
        ("data.prompts_per_step", d.prompts_per_step, 1), ("data.eval_size", d.eval_size, 1),
        ("rollout.max_new_tokens", ro.max_new_tokens, 1), ("rollout.chunk_tokens", ro.chunk_tokens, 1),
        ("actor.micro_batch_size", act.micro_batch_size, 1),
        ("actor.sft_steps", act.sft_steps, 0), ("actor.sft_batch_size", act.sft_batch_size, 1),
        ("actor.length_buckets", act.length_buckets, 1), ("rollout.top_k", ro.top_k, 0),
    ):  # fmt: skip
        if isinstance(value, int) and value < low:
            errs.append(f"{key}: expected an integer >= {low}, got {value!r}")
    if isinstance(ro.temperature, float) and ro.temperature <= 0:
        errs.append(f"rollout.temperature: expected a number > 0, got {ro.temperature!r}")
    if isinstance(ro.top_p, float) and not 0 < ro.top_p <= 1:
        errs.append(f"rollout.top_p: expected a number in (0, 1], got {ro.top_p!r}")
    batch = d.prompts_per_step * a.group_size if isinstance(d.prompts_per_step, int) else 0
    if batch and isinstance(a.num_minibatches, int) and a.num_minibatches >= 1 and batch % a.num_minibatches:
        errs.append(
            f"algorithm.num_minibatches: {a.num_minibatches} must divide the batch of "
            f"data.prompts_per_step x algorithm.group_size = {batch} sequences"
        )
    return errs


def check_env_id(env_id: str) -> str | None:
    """An error message if ``env_id`` is not a registered gymnasium id (ManiSkill ids are checked on GPU).

    ``module:id`` (gymnasium's form) imports ``module`` first, where the id is registered; workers do the
    same when they build the env."""
    if env_id.startswith("maniskill:"):
        return None
    import importlib

    import gymnasium as gym

    import rlnb.envs  # noqa: F401  (registers rlnb/ ids)

    if ":" in env_id:
        module, _, name = env_id.partition(":")
        try:
            importlib.import_module(module)
        except ImportError as e:
            return f"env.id: {env_id!r}: module {module!r} does not import ({e})"
        if name in gym.registry:
            return None
        return f"env.id: {env_id!r}: {module} registers no gymnasium environment {name!r}.{did_you_mean(name, list(gym.registry))}"
    if env_id in gym.registry:
        return None
    return f"env.id: {env_id!r} is not a registered gymnasium environment.{did_you_mean(env_id, list(gym.registry))}"

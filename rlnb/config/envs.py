"""The env section's checks that build or look up the env: its id registered in gymnasium, and ``env.kwargs`` that
the registered env's constructor takes (checked before any worker builds it)."""

from __future__ import annotations

import inspect

from rlnb.errors import did_you_mean


def check_env_id(env_id: str) -> str | None:
    """An error message if ``env_id`` is not a registered gymnasium id, or a ManiSkill task (``maniskill:``) or a
    LIBERO task (``libero:``) that cannot run here (:func:`rlnb.envs.gym_envs.maniskill_problem`,
    :func:`rlnb.envs.libero.libero_problem`).

    ``module:id`` (gymnasium's form) imports ``module`` first, where the id is registered; workers do the
    same when they build the env."""
    if env_id.startswith("maniskill:"):
        from rlnb.envs.gym_envs import maniskill_problem

        return maniskill_problem(env_id.removeprefix("maniskill:"))
    if env_id.startswith("libero:"):
        from rlnb.envs.libero import libero_problem

        return libero_problem(env_id)
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


# what gymnasium.make itself takes beside the env's own arguments
MAKE_KWARGS = ("max_episode_steps", "disable_env_checker", "render_mode")


def check_env_kwargs(env_id: str, kwargs) -> str | None:
    """An error message if ``env.kwargs`` names an argument the registered env's constructor does not take
    (checked here, before any worker builds it); ``None`` when it may (or the env takes ``**kwargs``)."""
    if env_id.startswith("maniskill:") or not kwargs or not isinstance(kwargs, dict):
        return None
    import gymnasium as gym

    if env_id.startswith("libero:"):  # LiberoEnv's own settings (the suite and task come from the id)
        from rlnb.envs.libero import LiberoEnv

        takes = [n for n in _takes(LiberoEnv) or [] if n not in ("suite", "task")] + ["max_episode_steps"]
    else:
        spec = gym.registry.get(env_id.rpartition(":")[2] if ":" in env_id else env_id)
        if spec is None:
            return None
        creator = spec.entry_point or spec.vector_entry_point
        try:
            if isinstance(creator, str):
                creator = gym.envs.registration.load_env_creator(creator)
            takes = _takes(creator)
        except Exception:  # (an entry point that does not import here is reported by the worker building it)
            return None
    if takes is None:
        return None
    unknown = [k for k in kwargs if k not in takes and k not in MAKE_KWARGS]
    if not unknown:
        return None
    takes = [n for n in takes if n not in MAKE_KWARGS]
    accepted = ", ".join([*takes, *MAKE_KWARGS])
    return f"env.kwargs: {env_id} takes no argument {unknown[0]!r} (it takes {accepted})." + did_you_mean(
        str(unknown[0]), [*takes, *MAKE_KWARGS]
    )


def _takes(creator) -> list[str] | None:
    """The keyword arguments ``creator`` takes, following ``**kwargs`` of a class's ``__init__`` into the base
    classes' (``HalfCheetahEnv(**kwargs)`` hands them to ``MujocoEnv``); ``None`` where that ends open."""
    inits = (
        [c.__dict__["__init__"] for c in creator.__mro__ if "__init__" in c.__dict__]
        if isinstance(creator, type)
        else [creator]
    )
    takes: list[str] = []
    for fn in inits:
        params = inspect.signature(fn).parameters
        takes += [
            n
            for n, p in params.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "self"
        ]
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return list(dict.fromkeys(takes))
    return None

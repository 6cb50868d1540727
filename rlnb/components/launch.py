"""Placing a plain component class on a cluster: argument checks on the driver, then one rank per slot.

``launch`` is attached to the built-in components as a classmethod (``PPOActor.launch(cluster, "1",
lr=1e-3)``); for a class of your own call ``rlnb.launch(MyRollout, cluster, "0", ...)``. Either way the
class stays plain: the same object works in-process.
"""

from __future__ import annotations

import inspect

from rlnb.errors import ComponentError, ConfigError, did_you_mean


def check_arguments(cls: type, args: tuple, kwargs: dict, name: str) -> None:
    """Refuse, on the driver, arguments ``cls`` does not take and objects that cannot reach a worker."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        params = sig.parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for key in kwargs:
            if not takes_any and key not in params:
                known = [p for p in params if p != "rank_info"]
                raise ConfigError(
                    f"{name}: {cls.__name__}() takes no argument {key!r}; it takes {', '.join(known)}."
                    + did_you_mean(key, known),
                    key,
                )
        try:
            sig.bind(*args, **kwargs, **({"rank_info": None} if "rank_info" in params else {}))
        except TypeError as e:
            raise ConfigError(f"{name}: {cls.__name__}{sig}: {e}", name) from None
    import cloudpickle

    for key, value in [*((f"args[{i}]", a) for i, a in enumerate(args)), *kwargs.items()]:
        try:
            cloudpickle.dumps(value)
        except Exception as e:
            raise ComponentError(
                f"cannot be sent to a worker ({type(e).__name__}: {e}); pass something picklable, "
                "e.g. a class or factory function that builds it there",
                name,
                cls.__name__,
                key,
            ) from e


def launch(
    cls: type,
    cluster,
    placement="0",
    *,
    name: str | None = None,
    call_timeout_s: float | None = None,
    start_timeout_s: float = 120.0,
    **kwargs,
):
    """Start one rank of ``cls(**kwargs)`` on each slot of ``placement``; returns the :class:`rlnb.Group`.

    Args:
        cls: a plain component class (a built-in, a subclass of one, or your own).
        cluster: an :class:`rlnb.Cluster`.
        placement: slots, e.g. ``"0"``, ``"0-1"``, ``[0, 2]``, ``"all"``.
        name: the component's name in errors, views and checkpoints (default: the class name, lower case).
        call_timeout_s: deadline of every call on the group (default 600 s).
        start_timeout_s: how long construction may take.
        **kwargs: the constructor's arguments; objects defined in a notebook cell travel by value.

    Example:
        >>> env = rlnb.launch(Env, cluster, "0", make_env="CartPole-v1", num_envs=8)   # doctest: +SKIP
    """
    from rlnb.runtime.group import DEFAULT_CALL_TIMEOUT_S, Group

    name = name or cls.__name__.lower()
    check_arguments(cls, (), kwargs, name)
    prepare = getattr(cls, "prepare_launch", None)  # a component's own driver-side resolution
    if prepare is not None:
        kwargs = prepare(kwargs)
    return Group.launch(
        cls,
        cluster,
        placement,
        kwargs=kwargs,
        name=name,
        call_timeout_s=DEFAULT_CALL_TIMEOUT_S if call_timeout_s is None else call_timeout_s,
        start_timeout_s=start_timeout_s,
    )


def launcher(default_name: str):
    """A ``launch`` classmethod for a built-in component, naming its group ``default_name`` by default."""

    def launch_cls(cls, cluster, placement="0", *, name: str | None = None, **kwargs):
        return launch(cls, cluster, placement, name=name or default_name, **kwargs)

    launch_cls.__doc__ = (
        f"Place this component on ``placement`` slots of ``cluster`` (group name ``{default_name}`` by "
        "default); see :func:`rlnb.launch` for the arguments."
    )
    return classmethod(launch_cls)

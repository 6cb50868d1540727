"""Typed errors. Every error rlnb raises derives from :class:`RlnbError`.

Errors carry their context as attributes (component, rank, worker address, config key...) and
survive pickling, so an error raised on a Dask worker arrives intact in the notebook.
"""

from __future__ import annotations

import difflib
import pickle
import traceback
from collections.abc import Iterable


def did_you_mean(given: str, choices: Iterable[str]) -> str:
    """A ``" Did you mean 'x'?"`` suffix for the closest choice, or ``""`` when none is close.

    Example:
        >>> did_you_mean("actr", ["actor", "rollout"])
        " Did you mean 'actor'?"
    """
    choices = [str(c) for c in choices]  # may be a generator: read it once
    close = difflib.get_close_matches(str(given).lower(), [c.lower() for c in choices], n=1)
    if not close:
        return ""
    original = {c.lower(): c for c in choices}[close[0]]
    return f" Did you mean {original!r}?"


class RlnbError(Exception):
    """Base class of all rlnb errors."""

    def __reduce__(self):
        # Keep attributes across pickling (Dask moves errors between processes).
        return (_rebuild_error, (type(self), self.args, self.__dict__))


def _rebuild_error(cls, args, state):
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class ConfigError(RlnbError, ValueError):
    """A recipe, config value or argument is invalid. ``key`` names the dotted key or argument."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class UnknownNameError(ConfigError, KeyError):
    """A name looked up in a registry (advantage, loss, reward, env...) is not registered."""

    def __init__(self, kind: str, name: str, known: Iterable[str], key: str | None = None):
        known = sorted(known)
        msg = (
            f"unknown {kind} {name!r}; registered: {', '.join(known) or '(none)'}.{did_you_mean(name, known)}"
        )
        super().__init__(msg, key=key)
        self.kind, self.name, self.known = kind, name, known

    def __str__(self):  # KeyError would otherwise repr() the message
        return self.args[0]


class PlacementError(ConfigError):
    """A component placement does not fit the cluster or cannot be parsed."""


class ClusterError(RlnbError, RuntimeError):
    """The cluster cannot be started, reached, or cannot provide what was asked."""


class RemoteError(RlnbError, RuntimeError):
    """A call on a component rank failed on its worker.

    Attributes:
        component: the component (group) name.
        rank: the rank within the group.
        address: the Dask worker address hosting the rank.
        method: the method that was called.
        remote_traceback: the traceback text from the worker, if any.
    """

    def __init__(
        self,
        message: str,
        component: str = "?",
        rank: int = -1,
        address: str = "?",
        method: str = "?",
        remote_traceback: str = "",
        cause_type: str = "",
    ):
        super().__init__(message)
        self.component, self.rank, self.address, self.method = component, rank, address, method
        self.remote_traceback, self.cause_type = remote_traceback, cause_type

    def __str__(self):
        head = f"{self.component}[rank {self.rank}] on {self.address}: {self.method}() failed: {self.args[0]}"
        if self.remote_traceback:
            head += "\n--- remote traceback ---\n" + self.remote_traceback.rstrip()
        return head


class WorkerLostError(RemoteError):
    """The worker process hosting a rank died or became unreachable."""


class RemoteTimeoutError(RemoteError, TimeoutError):
    """A call on a rank did not finish within its timeout."""


class ChannelTimeoutError(RlnbError, TimeoutError):
    """A channel ``get``/``put`` did not complete within its timeout."""


class ChannelClosedError(RlnbError, RuntimeError):
    """The channel was closed: blocked readers wake with this error and later puts are refused."""


class ComponentError(ConfigError):
    """A component, or an object given to one (env, policy, reward...), does not fit where it is used.

    Attributes:
        component: the component (group) it belongs to.
        obj: a short name of the object (``MyPolicy``, ``make_env``...).
        member: the method, output or argument that is missing or wrong.
    """

    def __init__(self, message: str, component: str = "?", obj: str = "?", member: str = "?"):
        super().__init__(f"{component}: {obj}.{member}: {message}", key=member)
        self.component, self.obj, self.member = component, obj, member


# ---------------------------------------------------------------------------------- remote replies
def pack_exception(exc: BaseException) -> dict:
    """An exception as plain data, keeping the object itself when it pickles."""
    try:
        pickle.dumps(exc)
        obj = exc
    except Exception:
        obj = None
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "exception": obj,
    }


def remote_error(status: str, value, component: str, rank: int, address: str, method: str):
    """The typed error for a failed remote reply: ``WorkerLostError`` when the worker is gone
    (``value`` says why), else ``RemoteError`` from a :func:`pack_exception` dict."""
    if status == "timeout":  # the request could not even be sent in time
        return RemoteTimeoutError(
            f"sending the request timed out ({value}): the worker stopped reading it (a hung or stopped process?)",
            component,
            rank,
            address,
            method,
        )
    if status in ("lost", "unreachable"):
        why = value if isinstance(value, str) else f"{type(value).__name__}: {value}"
        return WorkerLostError(
            f"worker process is gone or unreachable ({why})", component, rank, address, method
        )
    err = RemoteError(
        f"{value['type']}: {value['message']}",
        component,
        rank,
        address,
        method,
        remote_traceback=value["traceback"],
        cause_type=value["type"],
    )
    err.__cause__ = value.get("exception")
    return err

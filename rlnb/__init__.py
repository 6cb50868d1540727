"""rlnb: reinforcement learning you build and step cell by cell in a notebook, run on Dask.

Example:
    >>> import rlnb
    >>> cluster = rlnb.Cluster(slots=2)                                               # doctest: +SKIP
    >>> env = rlnb.Env.launch(cluster, "0", make_env="CartPole-v1", num_envs=8)        # doctest: +SKIP
    >>> rollout = rlnb.PolicyRollout.launch(cluster, "0")                             # doctest: +SKIP
    >>> actor = rlnb.PPOActor.launch(cluster, "1", lr=1e-3)                           # doctest: +SKIP
    >>> loop = rlnb.Loop(env=env, rollout=rollout, actor=actor)                       # doctest: +SKIP
"""

from rlnb.cluster import Cluster, Placement, Slot
from rlnb.errors import (
    ChannelClosedError,
    ChannelTimeoutError,
    ClusterError,
    ComponentError,
    ConfigError,
    PlacementError,
    RemoteError,
    RemoteTimeoutError,
    RlnbError,
    UnknownNameError,
    WorkerLostError,
)

__version__ = "0.1.0"


def _widget(name: str):
    def show(*args, **kwargs):
        from rlnb import widgets  # (ipywidgets and friends: imported when a view is first shown)

        return getattr(widgets, name)(*args, **kwargs)

    show.__name__ = name
    return show


VIEWS = {
    "dashboard_for": _widget("dashboard_for"),
    "show_dashboard": _widget("show_dashboard"),
    "attached_dashboard": _widget("attached_dashboard"),
}
"""The notebook views a loop shows (``loop.dashboard()``, ``loop.run(live=True)``): the widget layer's, wired here
so that the loop never imports it. Replace an entry to show another front end."""

# the runtime, components and loops import torch (seconds): loaded on first use, so `import rlnb` (and
# the CLI) stays quick, and an embedded cluster's workers start importing it while the driver does too
_LAZY = {
    **dict.fromkeys(
        ("Channel", "Group", "GroupResult", "RankInfo", "current_rank", "init_collective", "process_group"),
        "rlnb.runtime",
    ),
    "Env": "rlnb.components",
    "HFRollout": "rlnb.components",
    "LMActor": "rlnb.components",
    "PPOActor": "rlnb.components",
    "PolicyRollout": "rlnb.components",
    "RewardWorker": "rlnb.components",
    "ReplayBuffer": "rlnb.components",
    "launch": "rlnb.components",
    "Loop": "rlnb.loop",
    "GRPOLoop": "rlnb.loop",
    "SACLoop": "rlnb.loop",
    "load_policy": "rlnb.export",
    "attach": "rlnb.loop.control",
    "AttachedRun": "rlnb.loop.control",
    "TrainedPolicy": "rlnb.export",
}


def warm_up(lm: bool = False) -> bool:
    """Start, in the background, what a first embedded :class:`Cluster` waits for; returns at once.

    A first cluster in a process waits for torch to be imported, ~1-2 s of one core here: once in the
    fork server its workers start from, once in this process. Call this in a notebook's import cell: while
    you read and run the next cells, both imports happen, and the first ``rlnb.Cluster()`` is up, its loop
    built, in under a second. ``rlnb run`` does it itself. Calling it again does nothing more. The fork
    server lives as long as this process.

    Args:
        lm: the workers will build ``transformers`` models (``HFRollout``, ``LMActor``): the fork server
            imports transformers and ``torch._dynamo`` too (~1.5 s a worker would otherwise spend). Only the
            first call's choice counts.

    Returns:
        Whether the workers' fork server is starting or running (``False`` with
        ``RLNB_WORKER_START=spawn``, where each worker imports torch itself).

    Example:
        >>> import rlnb
        >>> rlnb.warm_up(lm=True)  # doctest: +SKIP
        True
    """
    from rlnb._dask import fork_server_preload, prestart_fork_server
    from rlnb.cluster.cluster import _import_in_background

    started = prestart_fork_server(fork_server_preload(lm))
    _import_in_background("rlnb.loop")
    return started


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlnb' has no attribute {name!r}")


__all__ = [
    "AttachedRun",
    "Channel",
    "ChannelClosedError",
    "ChannelTimeoutError",
    "Cluster",
    "ClusterError",
    "ComponentError",
    "ConfigError",
    "Env",
    "GRPOLoop",
    "Group",
    "GroupResult",
    "HFRollout",
    "LMActor",
    "Loop",
    "PPOActor",
    "Placement",
    "PlacementError",
    "PolicyRollout",
    "RankInfo",
    "RemoteError",
    "RemoteTimeoutError",
    "ReplayBuffer",
    "RewardWorker",
    "RlnbError",
    "SACLoop",
    "Slot",
    "TrainedPolicy",
    "UnknownNameError",
    "WorkerLostError",
    "attach",
    "current_rank",
    "init_collective",
    "launch",
    "load_policy",
    "process_group",
    "warm_up",
]

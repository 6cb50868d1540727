"""rlnb: reinforcement learning you build and step cell by cell in a notebook, run on Dask.

Example:
    >>> import rlnb
    >>> cluster = rlnb.Cluster(slots=2)                          # doctest: +SKIP
    >>> group = rlnb.Group.launch(MyComponent, cluster, "0-1")   # doctest: +SKIP
"""

from rlnb.cluster import Cluster, Placement, Slot
from rlnb.errors import (
    ChannelTimeoutError,
    ClusterError,
    ConfigError,
    PlacementError,
    RemoteError,
    RemoteTimeoutError,
    RlnbError,
    UnknownNameError,
    WorkerLostError,
)
from rlnb.runtime import Channel, Group, GroupResult, RankInfo, current_rank, init_collective, process_group

__version__ = "0.1.0"

__all__ = [
    "Channel",
    "ChannelTimeoutError",
    "Cluster",
    "ClusterError",
    "ConfigError",
    "Group",
    "GroupResult",
    "Placement",
    "PlacementError",
    "RankInfo",
    "RemoteError",
    "RemoteTimeoutError",
    "RlnbError",
    "Slot",
    "UnknownNameError",
    "WorkerLostError",
    "current_rank",
    "init_collective",
    "process_group",
]

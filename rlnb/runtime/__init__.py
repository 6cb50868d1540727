"""Runtime: groups of component ranks as Dask actors, channels, and process groups across ranks."""

from rlnb.runtime.channel import Channel
from rlnb.runtime.collective import all_reduce_, broadcast_, broadcast_state_dict
from rlnb.runtime.group import Group, GroupResult, init_collective
from rlnb.runtime.rank import RankInfo, current_rank, local_peer, process_group

__all__ = [
    "Channel",
    "Group",
    "GroupResult",
    "RankInfo",
    "all_reduce_",
    "broadcast_",
    "broadcast_state_dict",
    "current_rank",
    "init_collective",
    "local_peer",
    "process_group",
]

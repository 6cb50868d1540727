"""Cluster and placement: which Dask worker (slot) hosts which component rank."""

from rlnb.cluster.cluster import Cluster, Slot
from rlnb.cluster.placement import (
    COLLOCATED,
    DISAGGREGATED,
    HYBRID,
    Placement,
    parse_slots,
    placement_mode,
    resolve_placement,
)
from rlnb.cluster.processes import DaskProcesses

__all__ = [
    "COLLOCATED",
    "DISAGGREGATED",
    "HYBRID",
    "Cluster",
    "DaskProcesses",
    "Placement",
    "Slot",
    "parse_slots",
    "placement_mode",
    "resolve_placement",
]

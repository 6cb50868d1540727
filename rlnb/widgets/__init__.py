"""Notebook widgets: the only layer that imports ipywidgets (and draws with matplotlib). They observe a run;
the dashboard's controls steer it between steps."""

from rlnb.widgets.cluster_view import cluster_view, refresh_cluster_view
from rlnb.widgets.dashboard import Dashboard, dashboard_for, show_dashboard
from rlnb.widgets.model import DashboardModel

__all__ = [
    "Dashboard",
    "DashboardModel",
    "cluster_view",
    "dashboard_for",
    "refresh_cluster_view",
    "show_dashboard",
]

"""Notebook widgets: the only layer that imports ipywidgets (curves with bqplot, or matplotlib PNGs). They
observe a run; the dashboard's controls steer it between steps."""

from rlnb.widgets.cluster_view import cluster_view, refresh_cluster_view
from rlnb.widgets.curves import LiveCurves
from rlnb.widgets.dashboard import Dashboard, attached_dashboard, dashboard_for, show_dashboard
from rlnb.widgets.model import DashboardModel

__all__ = [
    "Dashboard",
    "DashboardModel",
    "LiveCurves",
    "attached_dashboard",
    "cluster_view",
    "dashboard_for",
    "refresh_cluster_view",
    "show_dashboard",
]

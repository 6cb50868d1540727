"""A cluster view: slots by node and device, the component ranks on each, worker memory, Dask dashboard."""

from __future__ import annotations

import html

import ipywidgets as w

from rlnb.cluster.cluster import listed_workers


def cluster_view(cluster) -> w.HTML:
    """An HTML widget of the cluster's slots; call again (or ``refresh_cluster_view``) to update it."""
    view = w.HTML()
    refresh_cluster_view(view, cluster)
    return view


def refresh_cluster_view(view: w.HTML, cluster) -> None:
    workers = listed_workers(cluster.client)
    rows = []
    for node, ranks in cluster.nodes.items():
        for r in ranks:
            s = cluster.slots[r]
            info = workers.get(s.address, {})
            mem = info.get("metrics", {}).get("memory", 0) / 2**20
            status = "up" if s.address in workers else "gone"
            placed = ", ".join(cluster.placed_on(r)) or "-"
            rows.append(
                f"<tr><td>{r}</td><td>{html.escape(node)}</td><td>{html.escape(s.device)}</td><td>{status}</td>"
                f"<td>{mem:.0f} MiB</td><td>{html.escape(placed)}</td></tr>"
            )
    link = cluster.dashboard_link
    dash = f' · <a href="{html.escape(link)}" target="_blank">Dask dashboard</a>' if link else ""
    view.value = (
        f"<b>Cluster</b> <code>{html.escape(cluster.address)}</code>{dash}<table>"
        "<tr><th>slot</th><th>node</th><th>device</th><th>worker</th><th>memory</th><th>components</th></tr>"
        + "".join(rows)
        + "</table>"
    )

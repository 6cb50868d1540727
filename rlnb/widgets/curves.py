"""Live curves for the dashboard: bqplot figures whose lines grow as steps finish.

Each panel of :meth:`DashboardModel.curves` is a bqplot ``Figure``: hover a point for its step and value;
the toolbar above it turns on pan and zoom (drag, mouse wheel) and resets the view. A background run's
thread updates the lines' ``x``/``y`` traits; ipywidgets sends the new arrays to the page as binary buffers,
so the curves move in JupyterLab, Notebook 7 and Voila without a redraw on the Python side. bqplot has no
append: a metric that gained a point is sent whole (16 bytes a point, twice: line and points); one that did
not is not sent again. A long run's series is thinned before it is sent (:func:`thin`): the newest
``RECENT_POINTS`` exactly, older ones as the lowest and highest point of each bucket, so a step costs at most
``MAX_POINTS`` points a metric however long the run, and no spike disappears from the curve.

Example:
    >>> from rlnb.widgets.model import DashboardModel
    >>> model = DashboardModel(total=10)
    >>> curves = LiveCurves()
    >>> model.update({"step": 1, "env/episode_return_mean": 20.0}); curves.update(model)
    >>> curves.points("return / reward", "env/episode_return_mean")
    [(1.0, 20.0)]
"""

from __future__ import annotations

import bqplot as bq
import ipywidgets as w
import numpy as np

MAX_POINTS = 2000
"""Most points a line is sent (the axes still span every step)."""
RECENT_POINTS = 500
"""The newest points, always sent exactly."""
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]


def thin(values: np.ndarray, max_points: int = MAX_POINTS, recent: int = RECENT_POINTS) -> np.ndarray:
    """Indices of the points of a series to draw: all of them up to ``max_points``; beyond, the newest
    ``recent`` and, of the older ones, the first, lowest and highest of each bucket of ``k`` points. ``k`` is a
    power of two fixed from the start of the series, so the buckets, and the points drawn, stay put as it
    grows (``k`` doubles now and then).

    Example:
        >>> idx = thin(np.sin(np.arange(10_000) / 50))
        >>> len(idx) <= MAX_POINTS, int(idx[0]), int(idx[-RECENT_POINTS])
        (True, 0, 9500)
    """
    n = len(values)
    if n <= max_points:
        return np.arange(n)
    old = n - recent
    buckets = (max_points - recent) // 3  # up to three points each
    k = 1 << max(0, int(np.ceil(np.log2(old / buckets))))
    padded = np.concatenate([values[:old], np.full(-old % k, np.nan)]).reshape(-1, k)
    nan = np.isnan(padded)
    lowest = np.where(nan, np.inf, padded).argmin(axis=1)
    highest = np.where(nan, -np.inf, padded).argmax(axis=1)
    starts = np.arange(len(padded)) * k
    kept = np.concatenate([starts, starts + lowest, starts + highest])  # a bucket's first point anchors it
    return np.unique(np.concatenate([kept[kept < old], np.arange(old, n)]))


class _Panel:
    """One figure: a shared step axis, one line per metric (metrics may be logged at different steps)."""

    def __init__(self, title: str):
        self.x_scale, self.y_scale = bq.LinearScale(), bq.LinearScale()
        self.lines: dict[str, tuple[bq.Lines, bq.Scatter]] = {}
        self.sent: dict[str, int] = {}  # metric -> points the page holds
        self.figure = bq.Figure(
            title=title,
            marks=[],
            axes=[
                bq.Axis(scale=self.x_scale, label="step", num_ticks=5),
                bq.Axis(scale=self.y_scale, orientation="vertical", num_ticks=5, tick_format=".3~g"),
            ],
            legend_location="top-left",
            fig_margin={"top": 40, "bottom": 40, "left": 55, "right": 15},
            layout=w.Layout(width="100%", height="240px"),
            title_style={"font-size": "13px"},
        )
        # pan/zoom is a toggle in the toolbar: while it is on it takes the mouse, and hovering shows no values
        self.toolbar = bq.Toolbar(figure=self.figure)
        self.box = w.VBox([self.toolbar, self.figure], layout=w.Layout(width="100%"))

    def follow(self, steps: np.ndarray, values: np.ndarray) -> None:
        """Set the axes' ranges to the data, unless the user zoomed or panned (the toolbar's pan/zoom was
        turned on since its last reset). The ranges are set here rather than left to the page: a figure
        shown before its first points, as a dashboard is, otherwise kept the range of its first point."""
        if self.toolbar._panzoom is not None:
            return
        values = values[np.isfinite(values)]
        if not len(steps) or not len(values):
            return
        x_lo, x_hi = float(steps.min()), float(steps.max())
        y_lo, y_hi = float(values.min()), float(values.max())
        pad = 0.05 * (y_hi - y_lo) or max(abs(y_hi) * 0.05, 1e-3)
        for scale, lo, hi in ((self.x_scale, x_lo - (x_lo == x_hi), x_hi + (x_lo == x_hi)),
                              (self.y_scale, y_lo - pad, y_hi + pad)):  # fmt: skip
            with scale.hold_sync():
                scale.min, scale.max = lo, hi

    def line(self, metric: str) -> tuple[bq.Lines, bq.Scatter]:
        """The line of ``metric`` and its points (the points carry the hover values: a bqplot line's
        tooltip knows the line, not the point under the mouse)."""
        if metric not in self.lines:
            color = COLORS[len(self.lines) % len(COLORS)]
            scales = {"x": self.x_scale, "y": self.y_scale}
            line = bq.Lines(
                x=np.zeros(0),
                y=np.zeros(0),
                scales=scales,
                colors=[color],
                labels=[metric],
                display_legend=True,
            )
            points = bq.Scatter(
                x=np.zeros(0), y=np.zeros(0), scales=scales, colors=[color], default_size=14,
                tooltip=bq.Tooltip(fields=["x", "y"], labels=["step", metric], formats=[".0f", ".4~g"]),
            )  # fmt: skip
            self.lines[metric] = (line, points)
            self.figure.marks = [*self.figure.marks, line, points]
        return self.lines[metric]


class LiveCurves(w.GridBox):
    """The dashboard's curve panels, two per row, updated in place by :meth:`update`."""

    def __init__(self):
        super().__init__(layout=w.Layout(grid_template_columns="repeat(2, minmax(0, 1fr))", width="100%"))
        self.panels: dict[str, _Panel] = {}

    def update(self, model) -> None:
        """Bring every panel up to the model's series (new panels appear when their metrics first do)."""
        added = False
        for title, data in model.curves():
            if title not in self.panels:
                self.panels[title] = _Panel(title)
                added = True
            panel = self.panels[title]
            if all(panel.sent.get(metric) == len(series) for metric, series in data.items()):
                continue  # nothing new in this panel (e.g. evaluation metrics between evaluations)
            all_steps, all_values = [], []
            for metric, series in data.items():
                steps, values = (np.asarray(v, dtype=float) for v in zip(*series))
                if panel.sent.get(metric) != len(series):
                    drawn = thin(values)
                    for mark in panel.line(metric):
                        with mark.hold_sync():  # x and y in one message, so the page never sees them unequal
                            mark.x, mark.y = steps[drawn], values[drawn]
                    panel.sent[metric] = len(series)
                all_steps.append(steps)
                all_values.append(values)
            panel.follow(np.concatenate(all_steps), np.concatenate(all_values))
        if added:
            self.children = [p.box for p in self.panels.values()]

    def points(self, title: str, metric: str) -> list[tuple[float, float]]:
        """``(step, value)`` pairs one line holds now (what the page is sent)."""
        line, _ = self.panels[title].lines[metric]
        return [(float(x), float(y)) for x, y in zip(line.x, line.y)]

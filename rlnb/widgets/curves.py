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

import html

import bqplot as bq
import ipywidgets as w
import numpy as np

from rlnb.metrics import explain
from rlnb.widgets.model import nice_ticks, short_name, smoothed

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
    """One figure: a shared step axis, one line per metric (metrics may be logged at different steps); the y
    axis labelled with what it measures (:class:`rlnb.widgets.model.Panel`), the legend a line of names above
    the plot, in the lines' colours, so it never covers a curve."""

    def __init__(self, title: str, spec=None):
        from rlnb.widgets.model import panel_for

        self.spec = spec or panel_for(title)
        self.x_scale, self.y_scale = bq.LinearScale(), bq.LinearScale()
        self.lines: dict[str, tuple[bq.Lines, bq.Scatter]] = {}
        self.sent: dict[str, int] = {}  # metric -> points the page holds
        # a smoothed panel's metric -> (its smoothed values so far, the average's state: smoothed())
        self.smooth: dict[str, tuple[list, list]] = {}
        self.figure = bq.Figure(
            title=title,
            marks=[],
            axes=[
                bq.Axis(scale=self.x_scale, label="step", tick_format="~s"),
                bq.Axis(scale=self.y_scale, orientation="vertical", tick_format=".4~g",
                        label=self.spec.y_label, label_offset="42px"),
            ],
            fig_margin={"top": 30, "bottom": 40, "left": 62, "right": 12},
            padding_x=0.0,
            padding_y=0.0,  # (the y range is already at round numbers around the data)
            layout=w.Layout(width="100%", height="240px"),
            title_style={"font-size": "13px"},
        )  # fmt: skip
        self.legend = w.HTML(layout=w.Layout(margin="0 0 0 62px", flex="1 1 auto"))
        # pan/zoom is a toggle: while it is on it takes the mouse (hovering shows no values) and the axes stay
        # where the user put them; reset turns it off and the axes follow the data again
        small = {"width": "30px", "height": "24px", "padding": "0"}
        self.zoom = w.ToggleButton(
            icon="arrows", tooltip="pan and zoom (drag, mouse wheel)", layout=w.Layout(**small)
        )
        self.reset = w.Button(
            icon="refresh", tooltip="reset the view: follow the data", layout=w.Layout(**small)
        )
        self.zoom.observe(self._on_zoom, names="value")
        self.reset.on_click(lambda _: self._on_reset())
        self._data: tuple[np.ndarray, np.ndarray] | None = None  # what follow() last saw
        self.box = w.VBox(
            [
                w.HBox([self.legend, self.zoom, self.reset], layout=w.Layout(align_items="center")),
                self.figure,
            ],
            layout=w.Layout(width="100%"),
        )

    def smoothed(self, metric: str, values: np.ndarray) -> np.ndarray:
        """``values`` (a metric's whole series) smoothed, the values new since the last call only."""
        done, state = self.smooth.setdefault(metric, ([], []))
        done += smoothed(values[len(done) :].tolist(), state=state)
        return np.asarray(done)

    def _on_zoom(self, change) -> None:
        scales = {"x": [self.x_scale], "y": [self.y_scale]}
        self.figure.interaction = bq.PanZoom(scales=scales) if change["new"] else None

    def _on_reset(self) -> None:
        self.zoom.value = False
        if self._data is not None:
            self.follow(*self._data)

    def follow(self, steps: np.ndarray, values: np.ndarray) -> None:
        """Set the axes' ranges to the data (y at round ticks, :func:`nice_ticks`), unless the user pans or
        zooms (:attr:`zoom` on). The ranges are set here rather than left to the page: a figure shown
        before its first points, as a dashboard is, otherwise kept the range of its first point."""
        self._data = (steps, values)
        if self.zoom.value:
            return
        values = values[np.isfinite(values)]
        if not len(steps) or not len(values):
            return
        x_lo, x_hi = float(steps.min()), float(steps.max())
        ticks = nice_ticks(float(values.min()), float(values.max()), self.spec.floor, self.spec.ceiling)
        y_axis = self.figure.axes[1]
        y_axis.tick_values = np.asarray(ticks)
        y_axis.tick_format = "~s" if max(abs(ticks[0]), abs(ticks[-1])) >= 1e4 else ".4~g"  # 30k, not 3e+4
        for scale, lo, hi in ((self.x_scale, x_lo - (x_lo == x_hi), x_hi + (x_lo == x_hi)),
                              (self.y_scale, ticks[0], ticks[-1])):  # fmt: skip
            with scale.hold_sync():
                scale.min, scale.max = lo, hi

    def line(self, metric: str, x_label: str = "step") -> tuple[bq.Lines, bq.Scatter]:
        """The line of ``metric`` and its points (the points carry the hover values: a bqplot line's
        tooltip knows the line, not the point under the mouse; over env steps, the training step too)."""
        if metric not in self.lines:
            color = COLORS[len(self.lines) % len(COLORS)]
            scales = {"x": self.x_scale, "y": self.y_scale}
            line = bq.Lines(x=np.zeros(0), y=np.zeros(0), scales=scales, colors=[color], labels=[metric])
            if x_label == "step":
                tip = bq.Tooltip(fields=["x", "y"], labels=["step", metric], formats=[".0f", ".4~g"])
            else:  # the points' names are their training steps
                tip = bq.Tooltip(fields=["x", "name", "y"], labels=[x_label, "step", metric],
                                 formats=[",.0f", "", ".4~g"])  # fmt: skip
            points = bq.Scatter(
                x=np.zeros(0), y=np.zeros(0), scales=scales, colors=[color], default_size=14, tooltip=tip,
                display_names=False, default_opacities=[0.35 if self.spec.smooths(metric) else 1.0],
            )  # fmt: skip
            self.figure.axes[0].label = x_label
            self.lines[metric] = (line, points)
            self.figure.marks = [*self.figure.marks, line, points]
            self.legend.value = " ".join(
                f"<span style='color:{m[0].colors[0]};font-size:12px;margin-right:1em' "
                f"title='{html.escape(explain(k), quote=True)}'>&#9473; {html.escape(short_name(k))}</span>"
                for k, m in self.lines.items()
            )
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
                self.panels[title] = _Panel(title, model.panel(title))
                added = True
            panel = self.panels[title]
            if all(panel.sent.get(metric) == len(series) for metric, series in data.items()):
                continue  # nothing new in this panel (e.g. evaluation metrics between evaluations)
            all_steps, all_values = [], []
            for metric, series in data.items():
                steps, values = (np.asarray(v, dtype=float) for v in zip(*series))
                if panel.sent.get(metric) != len(series):
                    drawn = thin(values)
                    xs = np.fromiter((model.x(int(s)) for s in steps[drawn]), float, len(drawn))
                    line, points = panel.line(metric, model.x_label)
                    # (a noisy metric's line smoothed, TensorBoard's way; its points as logged)
                    ys = (
                        panel.smoothed(metric, values)[drawn] if panel.spec.smooths(metric) else values[drawn]
                    )
                    with line.hold_sync():  # x and y in one message, so the page never sees them unequal
                        line.x, line.y = xs, ys
                    with points.hold_sync():
                        if model.x_counts:
                            points.names = [str(int(s)) for s in steps[drawn]]
                        points.x, points.y = xs, values[drawn]
                    panel.sent[metric] = len(series)
                    all_steps.append(xs[[0, -1]])  # (the x range: thinning keeps the first and last points)
                else:
                    all_steps.append(np.asarray([model.x(int(steps[0])), model.x(int(steps[-1]))]))
                all_values.append(values)
            panel.follow(np.concatenate(all_steps), np.concatenate(all_values))
        if added:
            self.children = [p.box for p in self.panels.values()]

    def points(self, title: str, metric: str) -> list[tuple[float, float]]:
        """``(step, value)`` pairs one line holds now (what the page is sent)."""
        line, _ = self.panels[title].lines[metric]
        return [(float(x), float(y)) for x, y in zip(line.x, line.y)]

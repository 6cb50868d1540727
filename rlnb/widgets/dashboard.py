"""The live dashboard widget (ipywidgets; curves by bqplot, or matplotlib PNGs), a view of
:class:`DashboardModel`."""

from __future__ import annotations

import html
import math
import threading
import time
from pathlib import Path

import ipywidgets as w

from rlnb.loop.runner import Callback
from rlnb.metrics import GLOSSARY, WORK_IN_PHASE, explain, format_value, read_table
from rlnb.widgets.kernel import controls_subshell, route_to_subshell
from rlnb.widgets.model import (
    RECENT_STEPS,
    DashboardModel,
    curves_for,
    nice_range,
    panel_for,
    short_name,
    smoothed,
    watch_messages,
)

COMPLETION_CHARS = 160
"""A prompt or completion longer than this is cut in the dashboard's table (the whole text is its tooltip)."""


def completions_table(rows: list[dict]) -> str:
    """HTML of the latest group of completions an LM run trained on: prompt, completion, reward, advantage."""
    if not rows:
        return ""

    def cell(text) -> str:
        text = str(text)
        short = text if len(text) <= COMPLETION_CHARS else text[: COMPLETION_CHARS - 1] + "…"
        return f"<td title='{html.escape(text, quote=True)}' style='white-space:pre-wrap'>{html.escape(short)}</td>"

    head = "".join(
        f"<th style='text-align:left'>{h}</th>" for h in ("prompt", "completion", "reward", "advantage")
    )
    body = "".join(
        "<tr>" + cell(r.get("prompt", "")) + cell(r.get("completion", ""))
        + "".join(f"<td>{format_value(r[k]) if isinstance(r.get(k), (int, float)) else ''}</td>"
                  for k in ("reward", "advantage"))
        + "</tr>"
        for r in rows
    )  # fmt: skip
    return (
        f"<b>completions trained on at step {rows[0].get('step', '?')}</b>"
        f"<table style='font-size:12px'><tr>{head}</tr>{body}</table>"
    )


BAR_STYLE = {"done": "success", "solved": "success", "stopped": "warning", "interrupted": "warning"}
"""The progress bar's colour once a run has ended, by how it ended (``failed``: ``danger``)."""


def _work_in(latest: dict, phase: str) -> str:
    """`` (work 0.004)``: the seconds of a phase's work in the latest step, where the loop logs them."""
    keys = WORK_IN_PHASE.get(phase, ())
    if not keys or any(k not in latest for k in keys):
        return ""
    return f"  (work {sum(latest[k] for k in keys):.3f})"


def _table(rows: list[tuple[str, str]], titles: dict[str, str] | None = None) -> str:
    """An HTML table of ``(name, value)`` rows; a name in ``titles`` shows that text on hover."""
    titles = titles or {}

    def name(k: str) -> str:
        tip = titles.get(k)
        return (
            f"<abbr title='{html.escape(tip, quote=True)}'>{html.escape(k)}</abbr>" if tip else html.escape(k)
        )

    body = "".join(
        f"<tr><td style='padding-right:1em'>{name(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in rows
    )
    return f"<table>{body}</table>"


class Dashboard(w.VBox):
    """Progress bar with ETA, live curves, per-phase time breakdown and the latest metrics.

    It observes a :class:`DashboardModel` (fed by the loop's metric stream). With ``controls`` (the loop),
    a row of controls steers the run at step boundaries: pause/resume, stop, save now, and ``lr``,
    ``ent_coef``, ``clip_coef`` (:meth:`rlnb.loop.steering.Steering.set_hyperparameters`).

    Curves: ``"live"`` (default) streams every step into interactive bqplot figures (zoom, pan, hover;
    :class:`rlnb.widgets.curves.LiveCurves`); ``"png"`` redraws a static image every ``plot_every`` updates,
    for a front end that cannot load bqplot's JavaScript.

    The view is drawn at most every ``render_interval_s`` (0.1 s): drawing sends every curve and table to the
    page again, which at every step of a fast run would slow training measurably. What arrives in
    between is drawn once the interval has passed; a finished run is drawn at once; :meth:`flush` draws now.
    """

    def __init__(
        self,
        model: DashboardModel,
        title: str = "rlnb",
        plot_every: int = 10,
        controls=None,
        curves: str = "live",
        render_interval_s: float = 0.1,
    ):
        if curves not in ("live", "png"):
            raise ValueError(f"Dashboard(curves=...): expected 'live' or 'png', got {curves!r}")
        self.model = model
        self.plot_every = plot_every
        self.controls = controls
        self.bar = w.FloatProgress(
            value=0.0, min=0.0, max=1.0, description=title, layout=w.Layout(width="60%")
        )
        self.label = w.Label(value=model.progress_text())
        if curves == "live":
            from rlnb.widgets.curves import LiveCurves

            self.plots = LiveCurves()
        else:
            self.plots = w.Image(format="png", layout=w.Layout(min_height="260px"))
        self.phases = w.HTML()
        self.metrics = w.HTML()
        self.messages = w.HTML()  # the latest warnings and errors, workers' included
        self.completions = w.HTML()  # an LM run's latest logged completions (runner.completions_interval)
        self._shown_completions: list | None = None
        # the latest evaluation episode's video (runner.video_interval, loop.record_episode), once there is one
        self.video = w.Video(
            format="mp4", autoplay=True, loop=True, controls=True, layout=w.Layout(max_width="480px")
        )
        self.video_label = w.HTML()
        self.video_box = w.VBox([self.video_label, self.video], layout=w.Layout(display="none"))
        self._shown_video: tuple[int, str] | None = None
        rows = [w.HBox([self.bar, self.label])]
        if controls is not None:
            rows.append(self._control_row(controls))
        rows += [
            self.plots,
            w.HBox(
                [
                    w.VBox(
                        [
                            w.HTML(f"<b>time per phase (s, mean of the last {RECENT_STEPS} steps)</b>"),
                            self.phases,
                        ]
                    ),
                    w.VBox([w.HTML("<b>latest metrics</b>"), self.metrics]),
                ]
            ),
            self.video_box,
            self.completions,
            self.messages,
        ]
        super().__init__(rows)
        self.render_interval_s = render_interval_s
        self._plotted_at = 0  # model.updates at the last PNG
        self.renders = 0  # times the view was drawn
        self._render_lock = threading.Lock()
        self._drawn_at = -float("inf")
        self._deferred: threading.Timer | None = None  # the draw of what arrived within the interval
        self._drawn_outcome: str | None = None  # the ended run the view was last drawn as
        self.on_finish: list = []  # fn(dashboard), once the view shows a run's end (show_dashboard's snapshot)
        model.observe(self._on_update)
        self.flush()

    def _on_update(self, model: DashboardModel) -> None:
        """The model changed (a step was logged, a message came): draw now, or once the interval has passed."""
        wait_s = self._drawn_at + self.render_interval_s - time.monotonic()
        if wait_s <= 0 or model.done:
            self.flush()
            return
        with self._render_lock:
            if self._deferred is None:
                self._deferred = threading.Timer(wait_s, self.flush)
                self._deferred.daemon = True
                self._deferred.start()

    def flush(self) -> None:
        """Draw the model's latest state now."""
        with self._render_lock:
            if self._deferred is not None:
                self._deferred.cancel()  # (a no-op when the timer itself is drawing)
                self._deferred = None
            self._drawn_at = time.monotonic()
            self.renders += 1
            self._render(self.model)

    def _control_row(self, loop) -> w.HBox:
        """Stop, pause/resume, save now, and hyperparameters applied at the next step boundary."""
        from rlnb.loop.steering import STEERABLE

        self.pause_button = w.ToggleButton(description="pause", value=False, tooltip="hold at the next step")
        self.stop_button = w.Button(description="stop", tooltip="end the run at the next step boundary")
        self.save_button = w.Button(description="save now", tooltip="checkpoint at the end of this step")

        def current(name: str) -> float:
            section, field = STEERABLE[name]
            return getattr(getattr(loop.recipe, section), field)

        self.hyperparameters = {
            name: w.FloatText(value=current(name), description=name, layout=w.Layout(width="170px"))
            for name in STEERABLE
        }
        self.apply_button = w.Button(description="apply", tooltip="use these from the next step on")

        def on_pause(change):
            loop.pause() if change["new"] else loop.unpause()
            self.model.set_paused(change["new"])
            self.pause_button.description = "resume" if change["new"] else "pause"

        def on_stop(_):
            loop.stop()
            loop.unpause()  # a paused run ends too
            # (said at once: under load the click reaches the kernel seconds after it was made)
            self.model.note(
                f"stop asked after step {loop.step}: the run ends after the step under way (and those the worker "
                "already runs ahead)"
            )

        def on_save(_):
            loop.request_save()
            self.model.note(f"a checkpoint will be written after step {loop.step + 1}")

        def on_apply(_):
            changed = {
                name: box.value for name, box in self.hyperparameters.items() if box.value != current(name)
            }
            if not changed:
                return
            try:
                loop.set_hyperparameters(**changed)
                self.model.note(f"from step {loop.step + 1}: {changed}")
            except Exception as e:  # a bad value: say so here, change nothing
                self.model.note(f"not applied: {e}")

        self.pause_button.observe(on_pause, names="value")
        self.stop_button.on_click(on_stop)
        self.save_button.on_click(on_save)
        self.apply_button.on_click(on_apply)
        controls = [
            self.pause_button, self.stop_button, self.save_button, *self.hyperparameters.values(), self.apply_button
        ]  # fmt: skip
        # (answered on a subshell of the kernel's: a run in the foreground holds the main shell)
        subshell = controls_subshell()
        if subshell is not None:
            route_to_subshell(controls, subshell)
        return w.HBox(controls)

    def _render(self, model: DashboardModel) -> None:
        total = sum(model.phase_s.values()) or 1.0
        rows = [
            (p, f"{s:.3f}  {'█' * int(20 * s / total)}{_work_in(model.latest, p)}")
            for p, s in sorted(model.phase_s.items(), key=lambda kv: -kv[1])
        ]
        if "time/overhead_frac" in model.latest:  # how much of a step is the loop's own, not the work
            rows.append(("overhead", f"{100 * model.latest['time/overhead_frac']:.1f} % of the step"))
        if model.eval_s is not None:  # apart: an evaluation is not every step's, and would dwarf them
            rows.append(("evaluation", f"{model.eval_s:.3f}  (the latest)"))
        self.phases.value = _table(rows, {"overhead": GLOSSARY["time/overhead_frac"]})
        keys = [k for k in sorted(model.latest) if not k.startswith("time/")][:16]
        self.metrics.value = _table(
            [(k, format_value(model.latest[k])) for k in keys], {k: explain(k) for k in keys}
        )
        self.messages.value = (
            "<b>warnings and errors</b><pre style='white-space:pre-wrap'>"
            + html.escape("\n".join(model.messages))
            + "</pre>"
            if model.messages
            else ""
        )
        if model.video is not None and model.video != self._shown_video:
            self._show_video(model)
        if model.completions is not self._shown_completions:
            self._shown_completions = model.completions
            self.completions.value = completions_table(model.completions)
        if not isinstance(self.plots, w.Image):
            self.plots.update(model)  # live: every step, the series that gained a point (thinned past 2000)
        elif model.updates - self._plotted_at >= self.plot_every or (
            model.done and model.updates > self._plotted_at
        ):
            self._plotted_at = model.updates
            self._plot(model)
        # the progress last: a draw on the deferred timer's thread shows a step there once the rest shows it
        self.bar.value = 1.0 if model.outcome == "solved" else model.fraction
        self.bar.bar_style = (
            BAR_STYLE.get(model.outcome, "danger") if model.outcome else "success" if model.done else ""
        )
        self.label.value = model.progress_text()
        if model.outcome != self._drawn_outcome:  # a run ended (or another began): steer only a running one
            self._drawn_outcome = model.outcome
            for control in self._controls():
                control.disabled = model.outcome is not None
            if model.outcome is not None:
                for fn in list(self.on_finish):
                    fn(self)

    def _show_video(self, model: DashboardModel) -> None:
        step, path = self._shown_video = model.video
        where = Path(model.run_dir) / path if model.run_dir is not None else Path(path)
        try:
            self.video.value = where.read_bytes()
        except OSError as e:  # (a video removed since, or a run directory moved: said, not raised in a draw)
            self.video_label.value = f"<b>evaluation episode, step {step}</b>: {html.escape(str(e))}"
        else:
            said = f"return {model.latest.get('eval/video_return', float('nan')):.4g}"
            self.video_label.value = f"<b>evaluation episode, step {step}</b> ({said}; {html.escape(path)})"
        self.video_box.layout.display = None

    def _controls(self) -> list:
        if self.controls is None:
            return []
        return [self.pause_button, self.stop_button, self.save_button, *self.hyperparameters.values(),
                self.apply_button]  # fmt: skip

    def snapshot_png(self) -> bytes | None:
        """The curves as a PNG, titled with the progress line (``solved at step 124 of 390 · 57 s``): the
        static form of the view, for a page without widgets (the docs site)."""
        curves = self.model.curves()
        if not curves:
            return None
        heading = f"{self.bar.description} · {self.model.progress_text()}"
        return render_curves_png(curves, heading, self.model.x, self.model.x_label)

    def _repr_mimebundle_(self, **kwargs):
        """The widget, and once the run has ended its snapshot as ``image/png`` too: JupyterLab shows the
        widget; a renderer without widgets (nbconvert, the docs) shows the image."""
        bundle = super()._repr_mimebundle_(**kwargs)
        if self.model.outcome is not None and bundle is not None:
            png = self.snapshot_png()
            if png is not None:
                import base64

                bundle["image/png"] = base64.b64encode(png).decode("ascii")
        return bundle

    def _plot(self, model: DashboardModel) -> None:
        """Redraw the curves as a PNG (matplotlib, ~0.1 s): an ``Image`` widget needs no JavaScript beyond
        ipywidgets' own, so it renders wherever ipywidgets does."""
        curves = model.curves()
        if not curves:
            return
        self.plots.value = render_curves_png(curves, None, model.x, model.x_label, model.panel)


def render_curves_png(
    curves, heading: str | None = None, x=float, x_label: str = "step", panel=panel_for
) -> bytes:
    """PNG bytes of the dashboard's curve panels (2 per row) under an optional ``heading``, each metric logged
    at step ``s`` drawn at ``x(s)`` on an axis of ``x_label`` (:meth:`DashboardModel.x`), drawn with matplotlib's
    object API (no pyplot state, so a background run's thread can draw while the notebook works). ``panel``:
    a title's :class:`~rlnb.widgets.model.Panel` (a smoothed one draws its line smoothed over faint points)."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = min(2, len(curves))
    rows = -(-len(curves) // cols)
    fig = Figure(figsize=(4.6 * cols, 2.7 * rows), dpi=80)
    FigureCanvasAgg(fig)
    for index, (title, data) in enumerate(curves):
        ax = fig.add_subplot(rows, cols, index + 1)
        spec = panel(title)
        finite = []
        for metric, points in data.items():
            steps, values = zip(*points)
            xs = [x(s) for s in steps]
            finite += [v for v in values if math.isfinite(v)]
            if spec.smooths(metric):  # the points as logged, faint; the line smoothed
                dots = ax.plot(xs, values, linestyle="none", marker=".", alpha=0.3)
                ax.plot(
                    xs, smoothed(values), label=short_name(metric), linewidth=1.2, color=dots[0].get_color()
                )
                continue
            ax.plot(
                xs, values, label=short_name(metric), linewidth=1.2, marker="." if len(points) < 20 else None
            )
        if finite:
            ax.set_ylim(*nice_range(min(finite), max(finite), spec.floor, spec.ceiling))
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_xlabel(x_label, fontsize=8)
        ax.set_ylabel(spec.y_label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        # above the plot, right of the title: a legend never covers a curve
        ax.legend(
            fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=3, frameon=False, borderaxespad=0.2
        )
    if heading:
        fig.suptitle(heading, fontsize=11)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


class RunWatch(Callback):
    """Tells a :class:`DashboardModel` when each of the loop's ``run()`` calls begins and how it ends. With
    ``one_run``, the model follows that one run only: at its end it stops listening to the loop (a dashboard
    shown by ``run(live=True)`` stays as its run ended; the next ``run(live=True)`` shows its own)."""

    def __init__(self, model: DashboardModel, one_run: bool = False):
        self.model, self.one_run, self._ran = model, one_run, False

    def on_run_start(self, loop, steps: int) -> None:
        if not (self.one_run and self._ran):
            self.model.start_run(loop.step + steps, loop.step)

    def on_run_end(self, loop) -> None:
        if self.one_run and self._ran:
            return
        self._ran = True
        self.model.finish(loop.run_outcome or "failed", loop.step)
        if self.one_run:
            if loop.logger is not None:
                loop.logger.remove_listener(self.model.update)
                loop.logger.remove_row_listener(self.model.update_rows)
            loop.unwatch(self)


def show_dashboard(loop, total: int | None = None) -> Dashboard:
    """Display a dashboard for ``loop``'s next ``run()``; it follows that run and, once the run has ended, says
    how and shows the curves' snapshot as an image too (what a page without widgets shows)."""
    from IPython.display import display

    dash = dashboard_for(loop, total=total, one_run=True)
    handle = display(dash, display_id=True)
    if handle is not None:  # (None outside IPython)
        dash.on_finish.append(lambda d: handle.update(d))
    return dash


def dashboard_for(
    loop, total: int | None = None, plot_every: int = 10, curves: str = "live", one_run: bool = False
) -> Dashboard:
    """A dashboard observing ``loop``'s metric logger (history replayed first) and its runs' ends: every later
    ``run()``, or with ``one_run`` the next one only."""
    model = DashboardModel(total=total, start_step=loop.step, panels=curves_for(loop.recipe.family))
    model.run_dir = loop.run_dir
    for record in loop.history:
        model.update(record)
    if loop.run_dir is not None:  # the latest completions logged before (runner.completions_interval)
        logged = read_table(loop.run_dir)
        last = [r for r in logged if r.get("step") == logged[-1].get("step")] if logged else []
        if last:
            model.update_rows(
                "completions", last[0]["step"], [{k: v for k, v in r.items() if k != "step"} for r in last]
            )
    loop.logger.add_listener(model.update)
    loop.logger.add_row_listener(model.update_rows)
    watch_messages(model)
    model.run_watch = RunWatch(model, one_run=one_run)  # (the loop holds it weakly: it lives with the model)
    loop.watch(model.run_watch)
    return Dashboard(model, title=loop.recipe.name, plot_every=plot_every, controls=loop, curves=curves)


def attached_dashboard(run, poll_s: float = 0.5) -> Dashboard:
    """A dashboard of a run another process drives (:class:`rlnb.loop.control.AttachedRun`): its curves from its
    metrics file, read again every ``poll_s`` by a thread of its own until the run ends, and its controls steering
    it through its driver."""
    from rlnb.metrics import MetricsTail

    model = DashboardModel(total=run.recipe.runner.steps, panels=curves_for(run.recipe.family))
    model.run_dir = run.run_dir
    tail = MetricsTail(run.run_dir)

    def follow() -> None:
        while True:
            live = run.live()  # (asked first: what the run wrote before it ended is read below)
            for record in tail.new():
                model.update(record)
            if not live:
                model.finish(run.outcome() or "failed", model.step)
                return
            time.sleep(poll_s)

    for record in tail.new():  # (the history first, as dashboard_for replays a loop's)
        model.update(record)
    dash = Dashboard(model, title=run.recipe.name, controls=run)
    threading.Thread(target=follow, name="rlnb-attached-dashboard", daemon=True).start()
    return dash

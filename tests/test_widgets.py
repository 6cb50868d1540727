"""Widgets driven without a browser: the model after N updates, the view's widget state, background runs."""

import re
import time

import pytest

from rlnb.loop import Loop
from rlnb.widgets import Dashboard, DashboardModel, cluster_view


def _records(n: int):
    for i in range(1, n + 1):
        yield {
            "step": i,
            "env/episode_return_mean": 10.0 * i,
            "train/policy_loss": -0.01 * i,
            "train/approx_kl": 0.001,
            "rollout/steps_per_s": 1000.0,
            "time/rollout_s": 0.02,
            "time/train_s": 0.05,
            "time/step_s": 0.07,
        }


def test_model_state_after_updates():
    model = DashboardModel(total=10)
    seen = []
    model.observe(lambda m: seen.append(m.step))
    for rec in _records(4):
        model.update(rec)
    assert seen == [1, 2, 3, 4] and model.step == 4 and model.fraction == 0.4
    assert model.series["env/episode_return_mean"] == [(1, 10.0), (2, 20.0), (3, 30.0), (4, 40.0)]
    assert model.phase_s == {"rollout": 0.02, "train": 0.05}  # time/step_s is the total, not a phase
    assert model.latest["train/policy_loss"] == pytest.approx(-0.04)
    assert model.eta_s is not None and model.eta_s >= 0
    assert [title for title, _ in model.curves()] == ["return / reward", "policy loss", "KL", "throughput"]
    assert model.progress_text().startswith("step 4/10 · ETA")
    for rec in _records(10):
        model.update(rec)
    assert model.done and model.fraction == 1.0 and model.progress_text().endswith("done")


def test_counters_read_as_numbers_not_scientific_notation():
    """A count of 31,740 env steps was shown as ``3.174e+04`` in the dashboard's table and the progress bar."""
    from rlnb.loop.runner import ProgressBar
    from rlnb.metrics import format_value

    assert [format_value(v) for v in (31740.0, 31740, 2.5e6, 0.98765, -12.5, 3e-5, 0.0)] == [
        "31,740", "31,740", "2,500,000", "0.9877", "-12.5", "3e-05", "0"
    ]  # fmt: skip
    model = DashboardModel(total=5)
    dash = Dashboard(model, title="test", render_interval_s=0)
    model.update({"step": 1, "env/steps": 31740.0, "train/lr": 0.0003})
    assert (
        "31,740" in dash.metrics.value and "e+04" not in dash.metrics.value and "0.0003" in dash.metrics.value
    )

    class Bar:  # (tqdm's postfix, as the progress bar sets it)
        n = 0

        def set_postfix_str(self, text, refresh):
            self.postfix = text

        def update(self, n):
            self.n += n

    class Run:
        SUMMARY_KEYS = ("env/steps",)
        step = 1

    bar = ProgressBar()
    bar.first, bar.bar = 0, Bar()
    bar.on_step(Run(), {"env/steps": 31740.0})
    assert bar.bar.postfix == "steps 31,740"


def test_a_paused_run_shows_no_eta_and_its_pause_is_not_counted_in_its_pace():
    model = DashboardModel(total=10)
    model.start_run(10, 0)
    model.started -= 4.0  # four steps in 4 s: 1 s a step
    for rec in _records(4):
        model.update(rec)
    assert model.progress_text().startswith("step 4/10 · ETA 6 s")
    model.set_paused(True)
    assert model.eta_s is None and model.progress_text() == "step 4/10 · paused"
    model.paused_since -= 60.0  # a minute held
    model.started -= 60.0
    model.set_paused(False)
    assert model.paused_s == pytest.approx(60.0, abs=0.5)
    assert model.progress_text().startswith("step 4/10 · ETA 6 s")  # not (64 s / 4 steps) x 6


def test_dashboard_view_follows_the_model():
    model = DashboardModel(total=5)
    dash = Dashboard(model, title="test", render_interval_s=0)  # (drawn at every update)
    for rec in _records(3):
        model.update(rec)
    assert dash.bar.value == pytest.approx(0.6) and dash.label.value.startswith("step 3/5")
    assert "rollout" in dash.phases.value and "train" in dash.phases.value
    assert "env/episode_return_mean" in dash.metrics.value and "30" in dash.metrics.value
    # hovering a metric shows its glossary entry
    assert "title='Mean return of the last 20 finished episodes" in dash.metrics.value
    # live curves: every update reaches the lines the page draws, one panel per group of metrics
    series = [(float(s), float(v)) for s, v in model.series["env/episode_return_mean"]]
    assert len(series) == 3 and dash.plots.points("return / reward", "env/episode_return_mean") == series
    assert [p.figure.title for p in dash.plots.panels.values()] == [title for title, _ in model.curves()]
    for rec in _records(5):
        model.update(rec)
    assert dash.bar.bar_style == "success"
    assert len(dash.plots.points("policy loss", "train/policy_loss")) == len(
        model.series["train/policy_loss"]
    )
    panel = dash.plots.panels["return / reward"]  # the axes follow the data...
    # (the y axis at round numbers around the returns 10..50, not below zero where they are not)
    assert (panel.x_scale.min, panel.x_scale.max) == (1.0, 5.0) and (
        panel.y_scale.min,
        panel.y_scale.max,
    ) == (
        10.0,
        50.0,
    )
    panel.zoom.value = True  # ...until the user pans or zooms
    assert panel.figure.interaction is not None
    model.update({**next(_records(1)), "step": 9, "env/episode_return_mean": 500.0})
    assert panel.x_scale.max == 5.0 and panel.y_scale.max == 50.0
    panel.reset.click()  # reset: following again, at once
    assert not panel.zoom.value and panel.figure.interaction is None and panel.x_scale.max == 9.0
    model.update({**next(_records(1)), "step": 10})
    assert panel.x_scale.max == 10.0 and panel.y_scale.max >= 500.0 and panel.y_scale.min == 0.0


def test_a_long_runs_curves_send_a_bounded_number_of_points_keeping_the_newest_and_every_spike():
    from rlnb.widgets.curves import MAX_POINTS, RECENT_POINTS, LiveCurves

    model, curves = DashboardModel(total=None), LiveCurves()
    for i in range(1, 6001):  # a slow rise with one spike far back
        model.update({"step": i, "env/episode_return_mean": 900.0 if i == 1234 else i / 100})
    curves.update(model)
    drawn = curves.points("return / reward", "env/episode_return_mean")
    series = [(float(s), v) for s, v in model.series["env/episode_return_mean"]]
    assert len(drawn) <= MAX_POINTS and drawn[-RECENT_POINTS:] == series[-RECENT_POINTS:]
    assert drawn[0] == (1.0, 0.01) and (1234.0, 900.0) in drawn
    assert [x for x, _ in drawn] == sorted({x for x, _ in drawn})  # in step order, no repeats
    panel = curves.panels["return / reward"]
    assert (panel.x_scale.min, panel.x_scale.max) == (1.0, 6000.0)  # the axes still span every step
    model.update({"step": 6001, "env/episode_return_mean": 60.01})
    curves.update(model)
    again = curves.points("return / reward", "env/episode_return_mean")
    assert again[-1] == (6001.0, 60.01) and again[:100] == drawn[:100]  # older points stay put


def test_the_dashboard_draws_at_most_every_render_interval_and_then_what_came_meanwhile():
    """Drawing sends every curve and table again (~0.6 ms): steps a few milliseconds apart are drawn at most
    every 0.1 s, the last of them once the interval has passed, and a finished run at once."""
    model = DashboardModel(total=40)
    dash = Dashboard(model, title="test", render_interval_s=0.1)
    records = list(_records(40))
    for rec in records[:30]:
        model.update(rec)
    assert dash.renders <= 3 and dash.model.step == 30
    deadline = time.perf_counter() + 5
    while not dash.label.value.startswith("step 30/40"):  # what came meanwhile, drawn by the deferred draw
        time.sleep(0.01)
        assert time.perf_counter() < deadline
    assert len(dash.plots.points("return / reward", "env/episode_return_mean")) == 30
    drawn = dash.renders
    for rec in records[30:]:
        model.update(rec)
    assert model.done and dash.renders > drawn and dash.label.value.endswith("done")  # at once


def test_dashboard_png_curves_redraw_every_plot_every_updates():
    model = DashboardModel(total=5)
    dash = Dashboard(model, title="test", plot_every=2, curves="png", render_interval_s=0)
    model.update(next(_records(1)))
    assert dash.plots.value == b""  # not yet: the first redraw is at the 2nd update
    for rec in list(_records(3))[1:]:
        model.update(rec)
    assert dash.plots.value[:8] == b"\x89PNG\r\n\x1a\n" and len(dash.plots.value) > 5000  # curves drawn
    with pytest.raises(ValueError, match="expected 'live' or 'png', got 'svg'"):
        Dashboard(model, curves="svg")


def test_loop_dashboard_background_run_and_stop(cluster, tmp_path):
    overrides = ["runner.steps=200", "runner.stop_return=100000", "runner.tensorboard=false"]
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        dash = loop.dashboard()
        thread = loop.run(background=True)
        t0 = time.perf_counter()
        while loop.step < 3:  # the notebook's thread stays free while the loop trains
            time.sleep(0.01)
            assert time.perf_counter() - t0 < 60
        loop.stop()
        loop.join(timeout=60)
        assert not thread.is_alive()
        stopped_at = loop.step
        assert 3 <= stopped_at < 200 and loop.stopped
        assert dash.model.step == stopped_at
        while dash.bar.value != pytest.approx(stopped_at / 200):  # the last steps are drawn within 0.1 s
            time.sleep(0.01)
            assert time.perf_counter() - t0 < 60
        # the view says how the run ended, where, after how long, and steers no more
        _wait_until(lambda: dash.label.value.startswith(f"stopped at step {stopped_at} of 200 · "))
        assert dash.bar.bar_style == "warning" and "ETA" not in dash.label.value
        assert dash.stop_button.disabled and dash.pause_button.disabled and dash.apply_button.disabled
        assert loop.run_outcome == "stopped"
        assert "overhead</abbr>" in dash.phases.value and "% of the step" in dash.phases.value
        assert dash.phases.value.count("(work ") == 3  # rollout, advantages, train: the work inside each
        # the live curves hold a point for every step the background run finished
        assert len(dash.plots.points("return / reward", "env/episode_return_mean")) == stopped_at
        assert len(loop.history) == stopped_at  # no half-finished step
        view = loop._repr_html_()  # the step, the placement and the latest summary metric
        assert f"step {stopped_at}" in view and "<td>env</td>" in view and loop.SUMMARY_KEYS[0] in view
        slots = cluster_view(cluster).value  # every slot up, with what is placed on it
        assert slots.count("<td>up</td>") == cluster.num_slots and "actor[0]" in slots
        # the same dashboard follows the next run: running again, then solved (the bar full, in green)
        loop.recipe.runner.stop_return = -1.0  # (any return solves it)
        records = loop.run(3, progress=False)
        assert len(records) == 1 and loop.run_outcome == "solved"
        _wait_until(
            lambda: dash.label.value.startswith(f"solved at step {stopped_at + 1} of {stopped_at + 3} · ")
        )
        assert dash.bar.value == 1.0 and dash.bar.bar_style == "success" and dash.stop_button.disabled
        png = dash._repr_mimebundle_()["image/png"]  # its snapshot, titled with how it ended
        assert png and "application/vnd.jupyter.widget-view+json" in dash._repr_mimebundle_()
        # run(live=True) shows a dashboard of its own that keeps its run's end when the loop runs on
        from rlnb.widgets import dashboard

        shown = dashboard.show_dashboard(loop, total=loop.step + 1)
        loop.run(1, progress=False)
        _wait_until(lambda: shown.label.value.startswith("solved at step"))
        at = shown.label.value
        loop.run(1, progress=False)
        time.sleep(0.3)
        assert shown.label.value == at and shown.model.step == loop.step - 1
        assert dash.model.step == loop.step  # (the loop's own dashboard follows every run)


def test_the_progress_line_says_how_a_run_ended():
    model = DashboardModel(total=390)
    assert model.progress_text() == "step 0/390"
    for rec in _records(4):
        model.update(rec)
    assert model.progress_text().startswith("step 4/390 · ETA ")
    model.finish("solved", 124)
    assert model.done and model.progress_text().startswith("solved at step 124 of 390 · ")
    model.finish("failed")
    assert model.progress_text().startswith("failed at step 124 of 390 · ")
    model.start_run(400, 124)  # a later run() on the same view: running again
    assert not model.done and model.outcome is None and model.progress_text() == "step 124/400"
    model.finish("done", 400)
    assert model.progress_text().startswith("done at step 400 · ")
    dash = Dashboard(model, title="t", render_interval_s=0)
    assert dash.bar.bar_style == "success"
    from rlnb.widgets.model import _duration

    assert [_duration(s) for s in (0.4, 57, 725, 7380)] == ["0 s", "57 s", "12 min 5 s", "2 h 3 min"]


def test_a_finished_dashboard_gives_its_snapshot_to_pages_without_widgets(tmp_path):
    """A run(live=True) cell's output, once the run has ended, holds the dashboard's curves as a PNG beside
    the widget; the docs pages show that image where they said "a live widget" before."""
    import base64

    model = DashboardModel(total=5)
    dash = Dashboard(model, title="ppo_cartpole", render_interval_s=0)
    for rec in _records(3):
        model.update(rec)
    assert "image/png" not in dash._repr_mimebundle_()  # running: the widget only
    seen = []
    dash.on_finish.append(seen.append)
    model.finish("stopped")
    assert seen == [dash]
    bundle = dash._repr_mimebundle_()
    png = base64.b64decode(bundle["image/png"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and "application/vnd.jupyter.widget-view+json" in bundle


def test_async_runs_get_a_staleness_panel():
    from rlnb.widgets.model import DashboardModel

    m = DashboardModel(total=3)
    m.update({"step": 1, "env/episode_return_mean": 10.0})
    assert [title for title, _ in m.curves()] == ["return / reward"]  # synchronous: no such panel
    m.update({"step": 2, "rollout/staleness_mean": 1.0, "rollout/staleness_max": 1, "time/rollout_s": 0.1})
    panels = dict(m.curves())
    assert panels["staleness (versions behind)"] == {
        "rollout/staleness_mean": [(2, 1.0)],
        "rollout/staleness_max": [(2, 1.0)],
    }


def test_worker_warnings_and_a_failed_background_run_reach_the_dashboard(cluster, tmp_path):
    import logging
    import time

    import rlnb
    from rlnb.loop import Loop
    from rlnb.testing import Echo
    from rlnb.widgets.model import DashboardModel, watch_messages

    model = DashboardModel(total=1)
    handler = watch_messages(model)
    echo = rlnb.Group.launch(Echo, cluster, "1")
    try:
        echo.warn("disk almost full here").result(timeout=30)  # logged on the worker
        deadline = time.monotonic() + 15
        while not any("disk almost full" in m for m in model.messages) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(
            m.startswith("WARNING disk almost full here") and cluster.slots[1].address in m
            for m in model.messages
        ), list(model.messages)
        overrides = [
            "runner.tensorboard=false",
            "env.id=rlnb.testing:rlnb-test/NaNReward-v0",
            "env.kwargs={nan_after: 10}",
        ]
        with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop:
            loop.run(5, background=True).join(120)
            assert loop.run_outcome == "failed"
            assert any("training diverged" in m and "Traceback" in m for m in model.messages), list(
                model.messages
            )
    finally:
        logging.getLogger("rlnb").removeHandler(handler)
        echo.shutdown()


def _wait_until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_dashboard_steers_a_background_run(cluster, tmp_path):
    """Its controls, clicked as a user would: pause holds the run at a step boundary, new hyperparameters
    take effect on the next step (logged there, in the recipe and on the actor's worker), save now writes a
    checkpoint after that step, a bad value is refused in the messages, stop ends the run."""
    from rlnb.loop import complete_checkpoints

    overrides = [
        "runner.steps=400",
        "runner.tensorboard=false",
        "runner.stop_return=null",
        "actor.anneal_lr=false",
    ]
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        dash = loop.dashboard()
        # paced: the worker runs one step ahead of the driver at a time (a block of about 0.1 s of steps)
        loop.logger.add_listener(lambda record: time.sleep(0.1))
        loop.run(background=True)
        _wait_until(lambda: loop.step >= 2)
        dash.pause_button.value = True
        time.sleep(1.0)  # the step in progress finishes
        held = loop.step
        time.sleep(1.0)
        assert loop.paused and loop.step == held and dash.pause_button.description == "resume"
        dash.hyperparameters["lr"].value = -1.0
        dash.apply_button.click()
        assert (
            "not applied: set_hyperparameters: lr expected a number > 0, got -1.0" in dash.model.messages[-1]
        )
        dash.hyperparameters["lr"].value = 5e-4
        dash.hyperparameters["clip_coef"].value = 0.1
        dash.apply_button.click()
        dash.save_button.click()
        dash.pause_button.value = False
        _wait_until(lambda: loop.step >= held + 3)
        dash.stop_button.click()
        asked = int(re.fullmatch(r"stop asked after step (\d+): .*", dash.model.messages[-1]).group(1))
        loop.join(60)
        assert held + 3 <= asked <= loop.step <= asked + 2  # the step under way and one run ahead
        changed = [r for r in loop.history if any(k.startswith("steer/") for k in r)]
        assert [(r["step"], r["steer/lr"], r["steer/clip_coef"]) for r in changed] == [(held + 1, 5e-4, 0.1)]
        lrs = {r["step"]: r["train/lr"] for r in loop.history}
        assert all(lr == 1e-3 for s, lr in lrs.items() if s <= held) and all(
            lr == 5e-4 for s, lr in lrs.items() if s > held
        )
        assert loop.groups["actor"].describe().result()[0]["algorithm"]["clip_coef"] == 0.1
        assert [p.name for p in complete_checkpoints(tmp_path)] == [f"step_{held + 1:06d}"]
        assert "lr: 0.0005" in (tmp_path / "recipe.yaml").read_text()


def test_each_curve_reads_on_its_own_axis_with_a_label_and_the_phase_table_averages_recent_steps():
    """Losses of different sizes and KL beside clipping get their own axes; each y axis says what it measures;
    the legend is a line above the plot; ticks at round numbers within the metric's range; the phase table is
    a mean over the latest steps, a (slow, occasional) evaluation shown apart."""
    model = DashboardModel(total=40)
    dash = Dashboard(model, title="t", render_interval_s=0)
    for i in range(1, 31):
        model.update({
            "step": i, "train/policy_loss": -0.01, "train/value_loss": 40.0 + i, "train/approx_kl": 0.004,
            "train/clip_frac": 0.1 + 0.01 * i, "rollout/steps_per_s": 900.0 + i,
            "time/rollout_s": 1.0 if i <= 10 else 0.1, "time/train_s": 0.2,
            **({"time/eval_s": 3.0, "eval/return_mean": 20.0} if i == 30 else {}),
        })  # fmt: skip
    panels = dash.plots.panels
    assert {"policy loss", "value loss", "KL", "clip fraction", "throughput"} <= set(panels)
    assert (
        "train/value_loss" not in panels["policy loss"].lines and "train/clip_frac" not in panels["KL"].lines
    )
    model.update({"step": 31, "train/loss": 5.0})  # PPO's total loss: not beside the policy loss it dwarfs
    assert "loss" not in dict(model.curves()) and "train/loss" not in panels["policy loss"].lines
    lm = DashboardModel()
    lm.update({"step": 1, "train/loss": 0.3})  # an LM actor logs the total alone: it gets its panel
    assert dict(lm.curves())["loss"] == {"train/loss": [(1, 0.3)]}
    clip, speed = panels["clip fraction"], panels["throughput"]
    assert (
        clip.figure.axes[1].label == "fraction clipped" and 0.0 <= clip.y_scale.min < clip.y_scale.max <= 1.0
    )
    assert speed.y_scale.min >= 0.0 and speed.y_scale.max % 10 == 0  # no dip below zero, a round top
    ticks = list(panels["value loss"].figure.axes[1].tick_values)  # ticks at round numbers: 40, 45, ... 70
    assert ticks[0] == panels["value loss"].y_scale.min and all(t % 5 == 0 for t in ticks), ticks
    assert (
        "episode" not in panels["value loss"].legend.value
        and "value loss" in panels["value loss"].legend.value
    )
    assert not any(
        line.display_legend for line, _ in panels["policy loss"].lines.values()
    )  # (not over the data)
    # the rollout's 1 s steps 1-10 have left the mean of the last 20: 0.1 s
    assert model.phase_s["rollout"] == pytest.approx(0.1) and "eval" not in model.phase_s
    assert "evaluation</td><td>3.000  (the latest)" in dash.phases.value
    model.finish("done")
    png = dash.snapshot_png()  # the static form draws the same panels, under the progress line
    assert png[:4] == b"\x89PNG" and len(png) > 10_000
    from unittest import mock

    from matplotlib.figure import Figure

    with mock.patch.object(Figure, "suptitle", autospec=True) as suptitle:
        dash.snapshot_png()
    assert suptitle.call_args.args[1].startswith("t · done at step 31 of 40 · ")


def test_an_embodied_runs_curves_go_along_env_steps_with_the_training_step_on_hover():
    """SB3, CleanRL and TensorBoard users read curves against env steps: where the loop logs ``global_step``
    the x axis counts them, and a hovered point names its training step too; an evaluation logged before any
    env step is placed at the pace so far."""
    model = DashboardModel(total=10)
    dash = Dashboard(model, title="t", render_interval_s=0)
    model.update({"step": 0, "eval/return_mean": 9.0})  # (before any global_step: at x = 0)
    for i in range(1, 4):
        model.update({"step": i, "global_step": 256 * i, "env/episode_return_mean": 10.0 * i})
    model.update({"step": 3, "eval/return_mean": 30.0})
    panel = dash.plots.panels["return / reward"]
    assert model.x_label == "env steps" and panel.figure.axes[0].label == "env steps"
    assert dash.plots.points("return / reward", "env/episode_return_mean") == [
        (256, 10),
        (512, 20),
        (768, 30),
    ]
    assert dash.plots.points("return / reward", "eval/return_mean") == [(0, 9), (768, 30)]
    _line, points = panel.lines["env/episode_return_mean"]
    assert list(points.names) == ["1", "2", "3"]
    assert list(points.tooltip.labels) == ["env steps", "step", "env/episode_return_mean"]
    assert (panel.x_scale.min, panel.x_scale.max) == (0.0, 768.0)
    assert "global_step" not in dict(model.curves()).get("return / reward", {})
    plain = DashboardModel()
    plain.update({"step": 2, "reward/mean": 0.5})  # a loop that logs no counter: training steps
    assert plain.x_label == "step" and plain.x(2) == 2.0
    grpo = DashboardModel()  # GRPO: the completions trained on so far (TRL's samples)
    grpo.update({"step": 2, "samples_total": 256, "reward/mean": 0.5})
    assert grpo.x_label == "completions" and grpo.x(2) == 256.0


def test_a_sac_runs_dashboard_shows_its_q_values_entropy_and_alpha(tmp_path):
    """SAC's panels (issue 56): what SB3's and CleanRL's users watch, each metric of them documented."""
    from rlnb.metrics import MetricLogger, undocumented
    from rlnb.widgets.model import SAC_CURVES, curves_for

    assert curves_for("sac") is SAC_CURVES
    assert not undocumented({k for p in SAC_CURVES for k in p.keys})
    model = DashboardModel(total=10, panels=curves_for("sac"))
    dash = Dashboard(model, title="sac", render_interval_s=0)
    logger = MetricLogger(tmp_path, tensorboard=False)
    logger.add_listener(model.update)
    for i in range(1, 4):
        logger.log(i, {"env/episode_return_mean": -1000.0 + 100 * i, "train/q1_mean": -50.0 + i, "train/q2_mean": -50.0,
                       "train/q_loss": 1.0, "train/actor_loss": 40.0, "train/entropy": -0.5, "train/alpha": 0.5 / i,
                       "buffer/size": 80.0 * i, "rollout/steps_per_s": 1000.0})  # fmt: skip
    assert list(dash.plots.panels) == ["return / reward", "Q-values", "Q loss", "actor loss", "policy entropy",
                                       "entropy coefficient", "replay buffer", "throughput"]  # fmt: skip


def test_a_grpo_runs_dashboard_has_panels_of_its_own_smoothed_and_a_table_of_its_completions(tmp_path):
    """A GRPO run's dashboard shows what TRL's and veRL's users watch (reward, accuracy, response length, KL,
    entropy, clipping, tokens per second), not PPO's panels with accuracy under "return per episode"; noisy
    curves are drawn smoothed over their points as logged; the latest logged group of completions is a table."""
    from rlnb.metrics import MetricLogger
    from rlnb.widgets.model import EMBODIED_CURVES, LM_CURVES, curves_for, smoothed

    assert curves_for("grpo") is LM_CURVES and curves_for("ppo") is EMBODIED_CURVES
    model = DashboardModel(total=20, panels=curves_for("grpo"))
    dash = Dashboard(model, title="grpo", render_interval_s=0)
    logger = MetricLogger(tmp_path, tensorboard=False)
    logger.add_listener(model.update)
    logger.add_row_listener(model.update_rows)
    noisy = [0.2, 0.8, 0.1, 0.9, 0.3]
    for i, r in enumerate(noisy, 1):
        logger.log(i, {"samples_total": 64 * i, "reward/mean": r, "reward/accuracy": r / 2,
                       "rollout/response_len_mean": 5.0 + i, "train/kl": 0.01, "train/entropy": 1.2,
                       "train/clip_frac": 0.05, "train/loss": 0.3, "rollout/tokens_per_s": 500.0})  # fmt: skip
    panels = dash.plots.panels
    assert list(panels) == ["reward", "accuracy", "response length", "KL", "entropy", "clip fraction", "loss",
                            "tokens per second"]  # fmt: skip
    line, points = panels["reward"].lines["reward/mean"]
    assert list(points.y) == noisy  # the points as logged, the line smoothed (TensorBoard's 0.6)
    assert list(line.y) == pytest.approx(smoothed(noisy)) and list(line.y) != pytest.approx(noisy)
    assert (
        panels["accuracy"].figure.axes[1].label == "fraction correct" and panels["accuracy"].y_scale.max <= 1
    )
    logger.log(6, {"eval/accuracy": 0.6})
    logger.log(7, {"eval/accuracy": 0.1})  # an evaluation every few steps: its line as logged, not smoothed
    assert list(panels["accuracy"].lines["eval/accuracy"][0].y) == [0.6, 0.1]
    assert panels["reward"].figure.axes[0].label == "completions"
    assert dash.completions.value == ""
    logger.log_rows("completions", 5, [
        {"prompt": "2+3=", "completion": "5", "reward": 1.0, "advantage": 0.87},
        {"prompt": "2+3=", "completion": "<b>6</b>" + "7" * 300, "reward": 0.0, "advantage": -0.87},
    ])  # fmt: skip
    table = dash.completions.value
    assert "completions trained on at step 5" in table and table.count("<tr>") == 3
    assert "&lt;b&gt;6&lt;/b&gt;" in table and "-0.87" in table and "…" in table  # escaped, long ones cut
    png = dash.snapshot_png()  # the static form: the same panels
    assert png[:4] == b"\x89PNG"

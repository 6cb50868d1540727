"""``run()``: the steps in a row, with evaluation, checkpoints, early stop, pause and recovery from a lost
worker as callbacks around each step (as Stable-Baselines3's ``learn()``), a progress bar, and the notebook views
the package's facade wires in (:data:`rlnb.VIEWS`; the loop never imports the widget layer)."""

from __future__ import annotations

import logging
import weakref

from rlnb.errors import ConfigError, WorkerLostError
from rlnb.metrics import format_value

log = logging.getLogger("rlnb")


def view(name: str):
    """The notebook view ``name`` (``dashboard_for``, ``show_dashboard``) wired into :data:`rlnb.VIEWS`."""
    import rlnb

    return rlnb.VIEWS[name]


class Callback:
    """Called by :meth:`Runner.run` around each step, as Stable-Baselines3's callbacks: subclass it and pass
    ``loop.run(callbacks=[...])``. Evaluation and checkpoints every N steps are callbacks too
    (:class:`EvaluateEvery`, :class:`SaveEvery`), run before the ones given.

    Example:
        >>> class StopAtReturn(rlnb.loop.Callback):                    # doctest: +SKIP
        ...     def on_step(self, loop, record):
        ...         if record.get("return/mean", 0) > 450:
        ...             loop.stop()
    """

    def on_run_start(self, loop, steps: int) -> None:
        """Before the first of ``steps`` steps."""

    def on_step(self, loop, record: dict) -> None:
        """After a step (its metric ``record``); a worker lost here is recovered from as one lost in the step."""

    def on_recovered(self, loop) -> None:
        """After recovering from a lost worker (the loop goes on from its latest checkpoint, ``loop.step``)."""

    def on_run_end(self, loop) -> None:
        """When ``run()`` ends, whatever ended it (``loop.run_outcome`` says what: :data:`RUN_OUTCOMES`)."""


RUN_OUTCOMES = ("done", "solved", "stopped", "interrupted", "failed")
"""How a ``run()`` ended (``loop.run_outcome``): all its steps taken; ``runner.stop_return`` reached; ``stop()``
(the dashboard's stop button, the CLI's Ctrl-C or SIGTERM); a ``KeyboardInterrupt`` (a notebook's interrupt);
an error."""


class EvaluateEvery(Callback):
    """``loop.evaluate()`` every ``runner.eval_interval`` steps."""

    def on_step(self, loop, record: dict) -> None:
        interval = loop.recipe.runner.eval_interval
        if interval and loop.step % interval == 0:
            loop.evaluate()  # (never with a step ahead: step_once does not run past one)


class RecordEvery(Callback):
    """``loop.record_episode()`` every ``runner.video_interval`` steps (an embodied loop's)."""

    def on_step(self, loop, record: dict) -> None:
        interval = loop.recipe.runner.video_interval
        if interval and loop.step % interval == 0:
            loop.record_episode()


class SaveEvery(Callback):
    """A checkpoint every ``runner.save_interval`` steps, and where one was asked for (``loop.request_save()``)."""

    def on_step(self, loop, record: dict) -> None:
        interval = loop.recipe.runner.save_interval
        steering = loop.steer
        if (interval and loop.step % interval == 0) or (steering.save_requested and not loop.schedule.ahead):
            steering.save_requested = False
            loop.save()


class ProgressBar(Callback):
    """A text progress bar (``tqdm``) with the loop's first summary metric."""

    def on_run_start(self, loop, steps: int) -> None:
        from tqdm.auto import tqdm

        self.first, self.bar = loop.step, tqdm(total=steps, desc=loop.recipe.name, unit="step")

    def on_step(self, loop, record: dict) -> None:
        key = loop.SUMMARY_KEYS[0] if loop.SUMMARY_KEYS else None
        value = record.get(key) if key else None
        self.bar.set_postfix_str(  # (drawn by update(), at most every 0.1 s: not twice a step)
            f"{key.split('/')[-1]} {format_value(value)}" if isinstance(value, (int, float)) else "",
            refresh=False,
        )
        self.bar.update(loop.step - self.first - self.bar.n)

    def on_recovered(self, loop) -> None:
        self.bar.n = max(0, loop.step - self.first)
        self.bar.refresh()

    def on_run_end(self, loop) -> None:
        outcome = loop.run_outcome
        if outcome in ("solved", "stopped"):  # (ended before its steps: the bar's last line says why)
            postfix = self.bar.postfix
            self.bar.set_postfix_str(f"{postfix}, {outcome}" if postfix else outcome, refresh=False)
        self.bar.close()


class Runner:
    """``run()`` of one loop (the facade's): the steps in a row with their callbacks, in this thread or in the
    background, recovery from a lost worker, and the views it shows."""

    def __init__(self, loop):
        self.loop = loop
        self.thread = None  # a background run's thread
        self.run_outcome: str | None = None
        self.watching: weakref.WeakSet | None = None  # callbacks of every run(), held elsewhere (watch())
        self.error: BaseException | None = None  # what ended a background run, raised again by join()
        self.progress = False  # whether the run under way shows a text progress bar (its warm start's too)

    def watch(self, callback: Callback) -> None:
        if not isinstance(callback, Callback):
            raise ConfigError(
                f"watch: expected an rlnb.loop.Callback, got {type(callback).__name__}", "callback"
            )
        if self.watching is None:
            self.watching = weakref.WeakSet()
        self.watching.add(callback)

    def unwatch(self, callback: Callback) -> None:
        if self.watching is not None:
            self.watching.discard(callback)

    def run(self, steps, progress: bool, live: bool, background: bool, callbacks):
        loop = self.loop
        runner = loop.recipe.runner
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ConfigError(f"steps: expected an integer >= 0, got {steps!r}", "steps")
        bad = [c for c in callbacks or () if not isinstance(c, Callback)]
        if bad:
            raise ConfigError(
                f"callbacks: expected rlnb.loop.Callback objects, got {type(bad[0]).__name__}", "callbacks"
            )
        steps = runner.steps - loop.step if steps is None else steps
        if loop.step + steps > runner.steps:
            loop._extend_run(loop.step + steps)
        if live:
            view("show_dashboard")(loop, total=loop.step + steps)
            progress = False
        self.progress = progress
        chosen = [
            *loop._default_callbacks(),
            *([ProgressBar()] if progress else []),
            *(self.watching or ()),
            *(callbacks or []),
        ]
        loop.steer.stop_requested = False
        if background:
            import threading

            self.error = None

            def target():
                try:
                    self.run_steps(steps, [c for c in chosen if not isinstance(c, ProgressBar)])
                except BaseException as e:  # surfaced by join(), and logged for the dashboard
                    self.error = e
                    log.error("the background run stopped at step %d", loop.step, exc_info=True)

            self.thread = threading.Thread(target=target, name=f"rlnb-{loop.recipe.name}", daemon=True)
            self.thread.start()
            return self.thread
        return self.run_steps(steps, chosen)

    def join(self, timeout: float | None = None) -> None:
        thread = self.thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"the background run is still going after {timeout} s")
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def run_steps(self, steps: int, callbacks: list[Callback]) -> list[dict]:
        """The steps, each followed by the callbacks; a lost worker is recovered from (``runner.max_restarts``) and
        the run goes on from the latest checkpoint. Ends early when solved or stopped, once the steps the worker
        runs ahead are taken."""
        loop = self.loop
        session, steering = loop.session, loop.steer
        records, restarts = [], 0
        target = session.run_target = loop.step + steps
        self.run_outcome, outcome = None, "failed"
        for c in callbacks:
            c.on_run_start(loop, steps)
        try:
            while loop.step < target:
                if (
                    not loop.schedule.ahead
                ):  # (steps the worker runs ahead are taken first: they are under way)
                    steering.wait_while_paused()
                    if steering.stop_requested:
                        break
                try:
                    record = loop.step_once()
                    for c in callbacks:
                        c.on_step(loop, record)
                except WorkerLostError as e:
                    if restarts >= loop.recipe.runner.max_restarts:
                        raise
                    restarts += 1
                    loop.restarts += 1
                    log.warning("%s; recovering (%d/%d)", e, restarts, loop.recipe.runner.max_restarts)
                    loop.recover()
                    for c in callbacks:
                        c.on_recovered(loop)
                    continue
                records.append(record)
                if (loop._solved() or steering.stop_requested) and not loop.schedule.ahead:
                    break
            outcome = "solved" if loop._solved() else "stopped" if steering.stop_requested else "done"
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):  # a notebook's interrupt, or a second Ctrl-C in the CLI
                outcome = "interrupted"
            if (
                loop.schedule.ahead
            ):  # (interrupted between steps) the steps under way on the worker are still taken
                loop.schedule.take_after_error(loop)
            raise
        finally:
            session.run_target = None
            self.run_outcome = outcome
            for c in callbacks:
                c.on_run_end(loop)
        return records

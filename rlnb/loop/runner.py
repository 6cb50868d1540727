"""``run()``: the steps in a row, with evaluation, checkpoints, early stop, pause and recovery from a lost
worker as callbacks around each step (as Stable-Baselines3's ``learn()``), a progress bar, and the notebook views
the package's facade wires in (:data:`rlnb.VIEWS`; the loop never imports the widget layer)."""

from __future__ import annotations

import logging
import weakref

from rlnb.errors import ConfigError, WorkerLostError

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


class SaveEvery(Callback):
    """A checkpoint every ``runner.save_interval`` steps, and where one was asked for (:meth:`request_save`)."""

    def on_step(self, loop, record: dict) -> None:
        interval = loop.recipe.runner.save_interval
        if (interval and loop.step % interval == 0) or (loop._save_requested and not loop._ahead):
            loop._save_requested = False
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
            f"{key.split('/')[-1]} {value:.3g}" if isinstance(value, (int, float)) else "", refresh=False
        )
        self.bar.update(loop.step - self.first - self.bar.n)

    def on_recovered(self, loop) -> None:
        self.bar.n = max(0, loop.step - self.first)
        self.bar.refresh()

    def on_run_end(self, loop) -> None:
        self.bar.close()


class Runner:
    """A mixin of :class:`rlnb.loop.base.LoopBase`: ``run()`` and what it shows."""

    _thread = None  # a background run()'s thread
    run_outcome: str | None = None
    """How the latest ``run()`` ended (one of :data:`RUN_OUTCOMES`; ``None`` before the first, or during one)."""
    _watching: weakref.WeakSet | None = None  # callbacks of every run(), held elsewhere (watch())
    _error: BaseException | None = None  # what ended it, raised again by join()

    def _default_callbacks(self) -> list[Callback]:
        """What every ``run()`` does after each step, before the callbacks given: evaluate, then checkpoint."""
        return [EvaluateEvery(), SaveEvery()]

    def dashboard(self, total: int | None = None, plot_every: int = 10, curves: str = "live"):
        """A live notebook dashboard of this loop (progress, curves, phase times, metrics, controls).

        ``curves="live"`` streams every step into interactive curves (zoom, pan, hover); ``"png"`` draws a
        static image every ``plot_every`` steps, for a front end without bqplot's JavaScript."""
        total = total or self.recipe.runner.steps
        return view("dashboard_for")(self, total=total, plot_every=plot_every, curves=curves)

    def watch(self, callback: Callback) -> None:
        """Call ``callback`` in every later ``run()`` too, for as long as something else holds it: how a view
        shown once (``loop.dashboard()``) learns when each run starts and how it ends. The loop holds it
        weakly, so a view that is gone stops being called."""
        if not isinstance(callback, Callback):
            raise ConfigError(
                f"watch: expected an rlnb.loop.Callback, got {type(callback).__name__}", "callback"
            )
        if self._watching is None:
            self._watching = weakref.WeakSet()
        self._watching.add(callback)

    def unwatch(self, callback: Callback) -> None:
        """Stop calling ``callback`` in later runs (see :meth:`watch`); nothing if it was not watching."""
        if self._watching is not None:
            self._watching.discard(callback)

    def run(
        self, steps: int | None = None, progress: bool = True, live: bool = False, background: bool = False,
        callbacks: list[Callback] | None = None,
    ):  # fmt: skip
        """Run ``steps`` steps (default: up to ``runner.steps``) with evaluation, checkpoints and early stop.

        Args:
            steps: how many steps (default: the rest of ``runner.steps``).
            progress: a text progress bar (ignored with ``live``).
            live: show the notebook dashboard (needs ipywidgets).
            background: run in a thread and return it at once; the notebook stays responsive and
                :meth:`stop` ends the run at a step boundary. :meth:`join` waits for it.
            callbacks: :class:`Callback` objects called around each step, after evaluation and saving.

        A lost worker is recovered from up to ``runner.max_restarts`` times. Returns the step records
        (or the thread, with ``background``).

        Example:
            >>> loop.run(50, live=True)                                    # doctest: +SKIP
        """
        runner = self.recipe.runner
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ConfigError(f"steps: expected an integer >= 0, got {steps!r}", "steps")
        bad = [c for c in callbacks or () if not isinstance(c, Callback)]
        if bad:
            raise ConfigError(
                f"callbacks: expected rlnb.loop.Callback objects, got {type(bad[0]).__name__}", "callbacks"
            )
        steps = runner.steps - self.step if steps is None else steps
        if self.step + steps > runner.steps:
            self._extend_run(self.step + steps)
        if live:
            view("show_dashboard")(self, total=self.step + steps)
            progress = False
        chosen = [
            *self._default_callbacks(),
            *([ProgressBar()] if progress else []),
            *(self._watching or ()),
            *(callbacks or []),
        ]
        if background:
            import threading

            self._stop = False
            self._error = None

            def target():
                try:
                    self._run_steps(steps, [c for c in chosen if not isinstance(c, ProgressBar)])
                except BaseException as e:  # surfaced by join(), and logged for the dashboard
                    self._error = e
                    log.error("the background run stopped at step %d", self.step, exc_info=True)

            self._thread = threading.Thread(target=target, name=f"rlnb-{self.recipe.name}", daemon=True)
            self._thread.start()
            return self._thread
        self._stop = False
        return self._run_steps(steps, chosen)

    def _extend_run(self, steps: int) -> None:
        """``runner.steps`` grows to ``steps`` for a :meth:`run` that goes past it, and the actor learns of it:
        the learning-rate decay of ``actor.anneal_lr`` then spans the longer run, instead of holding the rate at
        0 past the old end. Written to the run's ``recipe.yaml`` (a resume continues with it)."""
        before, self.recipe.runner.steps = self.recipe.runner.steps, steps
        self.groups["actor"].set_total_steps(steps).result()
        self._write_recipe()
        log.info(
            "run() goes to step %d, past runner.steps=%d: runner.steps is now %d (with actor.anneal_lr, the "
            "learning rate decays to 0 over the %d steps)", steps, before, steps, steps
        )  # fmt: skip

    def join(self, timeout: float | None = None) -> None:
        """Wait for a background run; re-raise its error, if any."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"the background run is still going after {timeout} s")
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _run_steps(self, steps: int, callbacks: list[Callback]) -> list[dict]:
        """The steps, each followed by the callbacks; a lost worker is recovered from (``runner.max_restarts``)
        and the run goes on from the latest checkpoint. Ends early when solved or stopped, once the steps the
        worker runs ahead are taken."""
        records, restarts = [], 0
        target = self._run_target = self.step + steps
        self.run_outcome, outcome = None, "failed"
        for c in callbacks:
            c.on_run_start(self, steps)
        try:
            while self.step < target:
                if not self._ahead:  # (steps the worker runs ahead are taken first: they are under way)
                    self._wait_while_paused()
                    if self._stop:
                        break
                try:
                    record = self.step_once()
                    for c in callbacks:
                        c.on_step(self, record)
                except WorkerLostError as e:
                    if restarts >= self.recipe.runner.max_restarts:
                        raise
                    restarts += 1
                    self.restarts += 1
                    log.warning("%s; recovering (%d/%d)", e, restarts, self.recipe.runner.max_restarts)
                    self.recover()
                    for c in callbacks:
                        c.on_recovered(self)
                    continue
                records.append(record)
                if (self._solved() or self._stop) and not self._ahead:
                    break
            outcome = "solved" if self._solved() else "stopped" if self._stop else "done"
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):  # a notebook's interrupt, or a second Ctrl-C in the CLI
                outcome = "interrupted"
            if self._ahead:  # (interrupted between steps) the step under way on the worker is still taken
                self._take_ahead_after_error()
            raise
        finally:
            self._run_target = None
            self.run_outcome = outcome
            for c in callbacks:
                c.on_run_end(self)
        return records

    def _take_ahead_after_error(self) -> None:
        """``run()`` is ending on an error or an interrupt while steps run ahead on the worker: take and log
        them, so that the loop's step count and the workers' agree (a failure here is logged, not raised: the
        first error is the one to see)."""
        self._run_target = None  # (nothing further runs ahead)
        while self._ahead:
            try:
                self.step_once()
            except Exception as e:
                log.warning("a step run ahead on the worker could not be taken: %s: %s", type(e).__name__, e)

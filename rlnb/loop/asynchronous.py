"""Asynchronous RL (AReaL-style), both loops: rollout runs ahead of training by at most
``algorithm.max_staleness`` policy versions. What is in flight is drained where nothing may be (a checkpoint, an
evaluation, the end of ``run()``). :class:`Asynchronous` is what both loops share; :class:`GRPOAsynchronous`
streams LM generation through weight updates (partial rollouts, admission control);
:class:`EmbodiedAsynchronous` collects the next rollout while the actor trains."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from rlnb.errors import ComponentError, ConfigError

if TYPE_CHECKING:
    from rlnb.loop.base import Phase


class Settled:
    """Rollout work that was in flight when a checkpoint was written, restored from it: finished, its values
    (one per rank, as its call returned them) and, for the first of a step's calls, the batches it made (one
    per rollout rank), which the loop hands to the actor ranks itself. It stands where the pending call stood
    (``result``, ``wait``, ``durations_s``), so the resumed step takes it as the uninterrupted run took the call."""

    def __init__(self, values: list, batches: list | None = None):
        self.values, self.batches = values, batches
        self.durations_s = [0.0] * len(values)

    def result(self, timeout: float | None = None) -> list:
        return self.values

    def wait(self, timeout: float | None = None) -> Settled:
        return self

    def done(self) -> bool:
        return True


class Asynchronous:
    """A mixin of :class:`rlnb.loop.base.LoopBase`: ``_in_flight`` holds the rollout work running ahead (``None``:
    none), ``_rollout_version`` the newest policy version the rollout ranks have."""

    _in_flight: list | None = None
    _rollout_version: int | None = None

    def _in_flight_state(self) -> dict:
        """The work in flight, finished first (a checkpoint written mid-pipeline, as after a stop): each call's
        values and the batches the rollout ranks hold, as plain data; :meth:`_restore_in_flight` puts it back,
        so the resumed run trains on that batch next, as the uninterrupted one would."""
        self._settle_in_flight()
        return {"values": [p.result() for p in self._in_flight], "batches": self._held_batches()}

    def _held_batches(self) -> list[dict]:
        """The batch each rollout rank holds, not yet handed over (a settled collection's)."""
        return self.groups["rollout"].take_batch().result()

    def _restore_in_flight(self, saved: dict) -> None:
        values = saved["values"]
        self._in_flight = [Settled(v, saved["batches"] if i == 0 else None) for i, v in enumerate(values)]

    @property
    def max_staleness(self) -> int:
        """``algorithm.max_staleness``: how many policy versions rollout may run ahead (0: synchronous)."""
        return self.recipe.algorithm.max_staleness

    def _settle_in_flight(self) -> None:
        """Let the rollout work in flight finish (its batch still goes to the next ``rollout()``)."""
        for pending in self._in_flight or ():
            pending.wait()

    def _sync_rollout(self) -> None:
        """Actor -> rollout weights now (waiting for them to load), remembered as the rollout's version."""
        self._sync()
        self._rollout_version = self.step

    def _take_ahead(
        self, start: Callable[[], list], finish: Callable[[list], list[dict]]
    ) -> tuple[list[dict], dict]:
        """Whole batches ahead (the embodied loop; GRPO with an engine of whole completions): wait for the batch in
        flight and hand it over (``finish(pending)``: its summaries, each with the ``version`` it was made with),
        then start the next at once (``start()``: the pending calls). A batch made with version ``v`` is trained
        at ``t <= v + N``: weights go to the rollout ranks first whenever the next would be trained later.
        Returns the summaries and the mode's metrics."""
        pending = self._in_flight
        t_wait = time.perf_counter()
        pending[0].wait()
        wait_s = time.perf_counter() - t_wait
        busy_s = max(d or 0.0 for d in pending[0].durations_s)  # the ranks' own time for the batch
        summaries = finish(pending)
        self._in_flight = None
        # versions behind when trained (at self.step), from the batch's own version: an evaluation may have sent
        # the rollout ranks newer weights since it was made
        staleness = self.step - min(s["version"] for s in summaries)
        if not self._must_drain():
            if (self.step + 1) - self._rollout_version > self.max_staleness:  # admission for the next batch
                self._sync_rollout()
            self._in_flight = start()
        return summaries, {
            "staleness_mean": float(staleness),
            "staleness_max": staleness,
            "wait_s": wait_s,
            "overlap_frac": max(0.0, 1.0 - wait_s / busy_s) if busy_s > 0 else 0.0,  # hidden behind training
            "in_flight": int(self._in_flight is not None),
        }

    def _sync_between_batches(self) -> dict:
        """``sync_weights()`` where whole batches run ahead (:meth:`_take_ahead`): the batch in flight finishes
        first (kept for the next ``rollout()``), then the rollout ranks take the actor's weights."""
        with self.timed("sync") as phase:
            self._settle_in_flight()
            if self._in_flight is None:
                self._sync_rollout()
            phase.metrics["version"] = self._rollout_version
        return phase.metrics

    def _check_async_apart(self, example: str) -> None:
        """Asynchronous mode needs rollout and actor on different slots; ``example`` is a placement that works."""
        shared = sorted(set(self.placement["rollout"]) & set(self.placement["actor"]))
        if self.max_staleness and shared:
            raise ConfigError(
                f"algorithm.max_staleness={self.max_staleness} needs rollout and actor on different slots: a "
                f"worker runs one call at a time, so rollout cannot run ahead of training on shared slot(s) "
                f"{shared}. Place them apart (component_placement={example}) or use 0",
                "algorithm.max_staleness",
            )

    def rollout_status(self) -> dict:
        """What is in flight and how stale: the newest policy version sent to the rollout ranks, the
        actor's, and whether rollout work is running ahead now."""
        return {
            "max_staleness": self.max_staleness,
            "actor_version": self.step,
            "rollout_version": self._rollout_version,
            "in_flight": self._in_flight is not None,
        }

    def _must_drain(self) -> bool:
        """Whether the step being taken ends where nothing may be in flight: a checkpoint or an evaluation
        of ``run()``, or its last step (so checkpoints resume exactly and nothing runs on unused)."""
        return self._drains_at(self.step + 1)

    def _drains_at(self, step: int) -> bool:
        """Whether step ``step`` (a step number: the steps done once it is) ends where nothing may be in
        flight (see :meth:`_must_drain`)."""
        r = self.recipe.runner
        return bool(
            (r.save_interval and step % r.save_interval == 0)
            or (r.eval_interval and step % r.eval_interval == 0)
            or (self._run_target is not None and step >= self._run_target)
        )


class GRPOAsynchronous:
    """A mixin of :class:`rlnb.loop.grpo.GRPOLoop`: its rollout ranks generate the next batch a chunk of tokens at
    a time (:meth:`rlnb.components.HFRollout.stream`) while the actor trains, taking new weights between chunks."""

    def _check_async(self) -> None:
        """Asynchronous mode needs rollout apart from the actor (it generates while the actor trains) and
        the reward next to the rollout (each finished group is scored where it is made)."""
        n, p = self.max_staleness, self.placement
        if not n:
            return
        key = "algorithm.max_staleness"
        rollout = self.groups.get("rollout")
        # (an engine generating whole completions needs no stream(): its next batch runs ahead whole)
        if (
            rollout is not None
            and not self._whole_completions()
            and not callable(getattr(rollout.cls, "stream", None))
        ):
            raise ComponentError(
                f"lacks method stream, which asynchronous generation ({key}={n}) calls; subclass the built-in "
                "rlnb.components.HFRollout and override what you change",
                rollout.name, rollout.cls.__name__, "stream",
            )  # fmt: skip
        self._check_async_apart("{'rollout,reward': 0, actor: 1}")
        if tuple(p["reward"]) != tuple(p["rollout"]):
            raise ConfigError(
                f"{key}={n} scores each group where it is generated: place the reward on the rollout's slots "
                f"{list(p['rollout'])} (it is on {list(p['reward'])}), e.g. component_placement="
                "{'rollout,reward': 0, actor: 1}",
                key,
            )

    def _whole_completions(self) -> bool:
        """Whether the rollout's engine generates whole completions (vLLM): asynchronous mode then generates the
        next batch while the actor trains and sends weights between batches, not between chunks of tokens."""
        rollout = self.groups.get("rollout")
        return rollout is not None and not getattr(rollout.cls, "CHUNKED_GENERATION", True)

    def sync_weights(self) -> dict:
        """Actor -> rollout weights. In asynchronous mode the actor publishes them without waiting: the
        rollout ranks take them at their next chunk boundary, mid-generation. An engine generating whole
        completions gets them from the loop between batches, when admission needs them; calling this waits for
        the batch in flight (kept for the next :meth:`rollout`) first."""
        if not self.max_staleness:
            return super().sync_weights()
        if self._whole_completions():
            return self._sync_between_batches()
        with self.timed("sync", version=self.step) as phase:
            if self._in_flight is not None and self._rollout_version != self.step:
                self._publish()
        return phase.metrics

    def _settle_in_flight(self) -> None:
        """Let the generation in flight finish: it ends once its batch is done and the actor's newest
        version reached the rollout ranks, so that version is published first."""
        if (
            self._in_flight is not None
            and self._rollout_version != self.step
            and not self._whole_completions()
        ):
            self._publish()
        super()._settle_in_flight()

    def _held_batches(self) -> list[dict]:
        """Streaming generation puts each finished batch into the batches channel itself: read back from there
        (and put again: a checkpoint leaves the pipeline as it was)."""
        if self._whole_completions():
            return super()._held_batches()
        ch, keys = self.channels["batches"], self._put_keys()
        held = [ch.get(key=k) for k in keys]
        for k, batch in zip(keys, held):
            ch.put(batch, key=k)
        return held

    def _restore_in_flight(self, saved: dict) -> None:
        if self._whole_completions():
            return super()._restore_in_flight(saved)
        ch = self.channels["batches"]
        for k, batch in zip(self._put_keys(), saved["batches"]):
            ch.put(batch, key=k)
        self._in_flight = [Settled(v) for v in saved["values"]]

    def _publish(self) -> None:
        rollout, ch = self.groups["rollout"], self.channels["weights"]
        self._publish_weights(ch, [f"w{r}" for r in rollout.ranks], self.step)
        self._rollout_version = self.step

    def _rollout_async(self, phase: Phase) -> None:
        if self._whole_completions():
            return self._rollout_ahead(phase)
        if self._in_flight is None:  # an empty pipeline (first step, after a checkpoint or evaluation)
            if self._rollout_version != self.step:
                self._sync_rollout()
            self._in_flight = [self._start_stream(self.step)]
        elif self._rollout_version != self.step:
            self._publish()  # sync_weights() was skipped: the ranks wait for this version
        t_wait = time.perf_counter()
        summaries = self._in_flight[0].result()
        wait_s = time.perf_counter() - t_wait
        self._in_flight = None
        self._take_batches(self._batch_keys()[1])
        if not self._must_drain():
            self._in_flight = [self._start_stream(self.step + 1)]
        staleness = [s for summary in summaries for s in summary["staleness"]]
        self.trained_problems.append(sorted(x for summary in summaries for x in summary["serials"]))
        generate_s = max(s["generate_s"] for s in summaries)
        extra = {
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "interrupted_frac": sum(s["interrupted"] for s in summaries)
            / sum(s["sequences"] for s in summaries),
            "weight_swaps": sum(s["swaps"] for s in summaries),
            "pool_groups": sum(s["pool"] for s in summaries),
            "wait_s": wait_s,
            "overlap_frac": max(0.0, 1.0 - wait_s / generate_s) if generate_s > 0 else 0.0,
            "in_flight": int(self._in_flight is not None),
        }
        self._rollout_summary(phase, summaries, extra)

    def _rollout_ahead(self, phase: Phase) -> None:
        """Whole completions (vLLM): hand over the batch generated while the last step trained, and start the
        next at once (:meth:`Asynchronous._take_ahead`)."""
        rollout, prompts = self.groups["rollout"], self.recipe.data.prompts_per_step

        def start() -> list:
            return [self._start_generate(rollout, self.task.sample(prompts))]

        def finish(pending: list) -> list[dict]:
            summaries = pending[0].result()
            self._hand_batches(pending[0].batches if isinstance(pending[0], Settled) else None)
            return summaries

        if self._in_flight is None:  # an empty pipeline (first step, after a checkpoint or evaluation)
            if self._rollout_version != self.step:
                self._sync_rollout()
            self._in_flight = start()
        self._rollout_summary(phase, *self._take_ahead(start, finish))

    def _start_stream(self, train_version: int):
        """Admit problems to each rollout rank (AReaL's admission control) and start generating the batch
        trained at ``train_version``; the batch goes to the actor ranks through the batch channel."""
        r, rollout = self.recipe, self.groups["rollout"]
        per_rank = r.data.prompts_per_step // rollout.world_size
        limit = self._admission_limit()
        puts, _ = self._batch_keys()
        calls = []
        for k in rollout.ranks:
            new = max(0, limit - self._admitted[k])
            first = self.task.position
            problems = [
                (first + i, p.prompt, p.answer, p.fields) for i, p in enumerate(self.task.sample(new))
            ]
            self._admitted[k] += new
            key, shards = puts[k]
            calls.append(
                dict(problems=problems, n=r.algorithm.group_size, train_version=train_version, groups=per_rank,
                     max_staleness=self.max_staleness, weights=self.channels["weights"], weights_key=f"w{k}",
                     batches=self.channels["batches"], batch_key=key, reward=self.groups["reward"].name,
                     shards=shards, chunk_tokens=r.rollout.chunk_tokens)
            )  # fmt: skip
        return rollout.call_each("stream", calls)

    def _admission_limit(self) -> int:
        """AReaL's admission control: by version ``v`` (the newest sent is ``self.step``) a rollout rank
        admits at most ``(N + v + 1) x`` its share of ``data.prompts_per_step`` problems."""
        per_rank = self.recipe.data.prompts_per_step // len(self._admitted)
        return (self.max_staleness + self.step + 1) * per_rank

    def rollout_status(self) -> dict:
        """What is in flight and how stale (see :meth:`LoopBase.rollout_status`), and how many groups each
        rollout rank has admitted against the limit."""
        if self._whole_completions():
            return super().rollout_status()
        return {
            **super().rollout_status(),
            "admitted": list(self._admitted),
            "admission_limit": self._admission_limit(),
        }


class EmbodiedAsynchronous:
    """A mixin of :class:`rlnb.loop.embodied.Loop`: the next rollout is collected, with the policy version it
    had, while the actor trains on this one."""

    def sync_weights(self) -> dict:
        """Actor -> rollout weights. In asynchronous mode the loop sends them itself when admission needs
        them; calling this waits for the collection in flight (kept for the next :meth:`rollout`) first."""
        if not self.max_staleness:
            return super().sync_weights()
        return self._sync_between_batches()

    def rollout_status(self) -> dict:
        """What is in flight and how stale (see :meth:`LoopBase.rollout_status`), and how many versions
        behind the next batch will be."""
        version = self._rollout_version
        return {
            **super().rollout_status(),
            "next_batch_staleness": None if version is None else self.step - version,
        }

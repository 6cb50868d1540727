"""Chains: several calls to ranks of one worker sent as one request, run one after another as separate calls would
run them (stopping at the first failure), answered in one round trip; and steps run ahead on the worker
(:class:`RunAhead`), taken with one request a block."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlnb.runtime.group import Group, GroupResult


class ChainedCall:
    """One call's outcome in a :func:`chain`: ``result()`` returns its value or raises its typed error, as
    ``GroupResult.result()`` would for the call made alone. ``duration_s``: its time on the worker."""

    def __init__(self, group: Group, method: str, reply: tuple):
        self.group, self.method = group, method
        self.status, self.value, self.duration_s = reply

    def result(self):
        rank = self.group._ranks[0]
        if self.status != "ok":
            raise self.group._error(rank, self.method, self.status, self.value)
        return self.value

    def __repr__(self) -> str:
        return f"<ChainedCall {self.group.name}.{self.method} {self.status}>"


class ChainResult(list):
    """The :class:`ChainedCall` of each call of a chain that ran (a list), and what the worker did next.

    Attributes:
        ahead: whether the worker went on with the chain's ``then`` (:class:`RunAhead`) without waiting:
            take its replies with :func:`take_ahead` (:func:`take_run_ahead`). For the chains of one
            ``take_run_ahead``, whether it went on after the last of them.
        idle_s: for a chain run ahead, how long the worker waited between the chain before it and this one
            (sending the reply, a driver late with the next request); ``None`` for a chain sent as a request.
        duration_s: the whole chain's time on the worker.
    """

    def __init__(self, calls: Sequence[tuple[Group, str, tuple]], reply: tuple, duration_s: float = 0.0):
        replies, self.ahead, self.idle_s = reply
        self.duration_s = duration_s
        super().__init__(ChainedCall(g, m, r) for (g, m, _), r in zip(calls, replies))


@dataclass(frozen=True)
class RunAhead:
    """A chain for the worker to start as soon as it has answered the current one, without waiting for the
    driver's next request: the driver's own work between two steps, and the round trip, then overlap the
    worker's next step instead of delaying it.

    Attributes:
        calls: ``(group, method, args)`` tuples, as for :func:`chain`, on the same worker.
        proceed: ``proceed(values, *args)``, run on the worker with each value the current chain returned:
            the chain runs ahead only if it is true (``None``: always, once every call succeeded). A
            module-level function: it travels by reference.
        args: its further arguments: one tuple, unpickled once on the worker, for every ``proceed`` call of
            this run ahead, so a rule can keep state in it (e.g. a list it extends).
        more: further chains to run after ``calls``, one after another, each as long as every call so far
            succeeded and ``proceed`` is true on the chain before it: a block of chains with no request
            between them. Take their replies with :func:`take_run_ahead`.
    """

    calls: Sequence[tuple[Group, str, tuple]]
    proceed: Callable | None = None
    args: tuple = ()
    more: Sequence[Sequence[tuple[Group, str, tuple]]] = ()

    @property
    def chains(self) -> list[Sequence[tuple[Group, str, tuple]]]:
        """``calls``, then each of ``more``."""
        return [self.calls, *self.more]


def _chain_payload(
    calls: Sequence[tuple[Group, str, tuple]], first: Group | None = None
) -> tuple[Group, list]:
    """The first group of ``calls`` (or ``first``) and the calls as the worker takes them, after checking that
    they are one rank each, on one worker, of one driver."""
    if not calls:
        raise ValueError("chain: no calls")
    first = first or calls[0][0]
    for group, _method, _args in calls:
        if len(group._ranks) != 1:
            raise ValueError(
                f"chain: {group.name} has ranks {group._ranks}; narrow it to one (group.on(rank))"
            )
        where = (group.infos[group._ranks[0]].address, group.cluster.session)
        if where != (first.infos[first._ranks[0]].address, first.cluster.session):
            raise ValueError(
                f"chain: {group.name}[{group._ranks[0]}] is not in the worker of {first.name}[{first._ranks[0]}] "
                "or not of this driver"
            )
    return first, [(g.name, g._ranks[0], method, tuple(args), {}) for g, method, args in calls]


def _chain_request(
    op: str, chains: list, then: RunAhead | None, timeout_s: float | None
) -> list[ChainResult]:
    """Send ``chain`` (with its calls, ``chains[0]``) or ``take_ahead`` (without: ``chains`` ran already, or
    their first ones) and read its reply: a :class:`ChainResult` per chain that ran."""
    first, payload = _chain_payload(chains[0])
    args = (payload,) if op == "chain" else ()
    label = f"{op}({', '.join(f'{g.name}.{m}' for g, m, _ in chains[0])}{' ...' if len(chains) > 1 else ''})"
    if timeout_s is None:  # a bound, not a sum: a stuck chain is said within one call's deadline
        timeout_s = max(g.call_timeout_s for calls in chains for g, _, _ in calls)
    if then is not None:
        if first.transport != "direct":  # (Dask's actor rpc has no "after the reply": nothing would run)
            raise ValueError(
                f"{op}: `then` needs direct calls; {first.name} is reached through {first.transport}"
            )
        ahead = [_chain_payload(calls, first)[1] for calls in then.chains]
        args = (*args, (ahead, then.proceed, tuple(then.args)))
    pending = first._start(op, [(first._ranks[0], args)])
    result = GroupResult(first, label, first._ranks, pending, timeout_s)
    with contextlib.nullcontext() if then is None else _waking_without_preempting():
        block, ahead = result.result()[0]
    if len(block) > len(chains):
        raise ValueError(
            f"{op}: the worker ran {len(block)} chains ahead and the caller names {len(chains)}; take a "
            "RunAhead with `more` with take_run_ahead(that RunAhead)"
        )
    return [
        ChainResult(calls, (replies, ahead, idle_s), duration)
        for calls, (replies, idle_s, duration) in zip(chains, block)
    ]


@contextlib.contextmanager
def _waking_without_preempting():
    """Wait as a ``SCHED_BATCH`` thread (Linux): a reply sent by a worker that goes on computing (a chain run
    ahead) wakes this thread without preempting that worker.

    A socket's reply is a "sync" wake-up: the kernel takes the sender for about to sleep and may run the
    woken thread on the sender's CPU, ahead of it. Here the sender goes on with the next step, which then
    waited for the driver's own work (``docs/benchmarks.md``). A batch thread never preempts on waking (it runs once a CPU is free for it)."""
    try:  # (a real-time or idle driver thread is left as its user set it)
        batch = os.sched_getscheduler(0) == os.SCHED_OTHER
        if batch:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or not allowed
        batch = False
    try:
        yield
    finally:
        if batch:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def chain(
    calls: Sequence[tuple[Group, str, tuple]], timeout_s: float | None = None, *, then: RunAhead | None = None
) -> ChainResult:
    """Call ``group.method(*args)`` for each of ``calls``, one after another, in one round trip: the groups
    are one rank each (``group.on(rank)``), all in one worker process, launched by one driver. The worker
    runs them as it runs separate calls, each in its rank's context, and stops at the first that fails.

    A training step's phases on one collocated slot cost one wake-up of the worker and of the driver
    instead of one per phase.

    Args:
        calls: ``(group, method, args)`` tuples.
        timeout_s: for the whole chain (default: the longest of the groups' call timeouts: a chain is answered
            in one round trip, and its deadline bounds it as one call's does).
        then: a chain the worker runs next, at once, once it has sent this reply (:class:`RunAhead`); its
            replies are taken with :func:`take_ahead`. Only over direct calls (``group.transport``).

    Returns:
        A :class:`ChainResult`: a :class:`ChainedCall` per call that ran, in order: all of them, or up to and
        including the first that failed (``ChainedCall.result()`` raises its error); ``.ahead`` says whether
        ``then`` runs.

    Raises:
        ValueError: a group with more than one rank, groups on different workers or of another driver.
        WorkerLostError, RemoteTimeoutError: as a call on the first group would.

    Example:
        >>> steps = chain([(rollout.on(0), "collect", (32, "env")), (actor.on(0), "train", ())])  # doctest: +SKIP
        >>> [c.result() for c in steps]  # doctest: +SKIP
        >>> first = chain(calls, then=RunAhead(calls))  # doctest: +SKIP
        >>> second = take_ahead(calls) if first.ahead else None  # doctest: +SKIP
    """
    if not calls:
        return ChainResult([], ([], False, None))
    return _chain_request("chain", [calls], then, timeout_s)[0]


def take_ahead(
    calls: Sequence[tuple[Group, str, tuple]], timeout_s: float | None = None, *, then: RunAhead | None = None
) -> ChainResult:
    """The replies of the chain ``calls`` that the worker ran ahead (a :class:`RunAhead` whose chain or
    ``take_ahead`` said ``.ahead``), waiting for it to end; ``then``: the chain to run ahead after it, as
    for :func:`chain`. ``.idle_s`` says how long the worker waited before it.

    Raises:
        RemoteError: nothing ran ahead on that worker (or it was taken already).
        ValueError: the worker ran several chains ahead (a :class:`RunAhead` with ``more``): take them with
            :func:`take_run_ahead`.
        WorkerLostError, RemoteTimeoutError: as a call on the first group would.
    """
    return _chain_request("take_ahead", [calls], then, timeout_s)[0]


def take_run_ahead(
    run: RunAhead, timeout_s: float | None = None, *, then: RunAhead | None = None
) -> list[ChainResult]:
    """The replies of the chains of ``run`` (a :class:`RunAhead` whose chain or take said ``.ahead``) that
    the worker ran, waiting for the last to end: ``run.calls``, then each of ``run.more`` until one failed or
    ``run.proceed`` said stop. ``then``: the chains to run ahead after them, as for :func:`chain`; each
    result's ``.ahead`` says whether they run. Each result's ``.idle_s`` is the worker's time between the chain
    before it and this one.

    A block of several chains taken in one request costs the worker one request's reading and one reply's
    writing for all of them, instead of one each (costly on a small VM, the caches cold from the chain's
    own work).

    Raises:
        RemoteError: nothing ran ahead on that worker (or it was taken already).
        WorkerLostError, RemoteTimeoutError: as a call on the first group would.

    Example:
        >>> run = RunAhead(calls, more=[calls, calls])  # doctest: +SKIP
        >>> first = chain(calls, then=run)  # doctest: +SKIP
        >>> [c.result() for done in take_run_ahead(run) for c in done]  # doctest: +SKIP
    """
    return _chain_request("take_ahead", run.chains, then, timeout_s)

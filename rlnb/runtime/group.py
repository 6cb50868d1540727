"""Groups: the ranks of one component, one Dask actor each, called together.

Example:
    >>> group = Group.launch(Counter, cluster, placement="0-1", kwargs={"start": 1})  # doctest: +SKIP
    >>> group.add(2).result(timeout=10)                                              # doctest: +SKIP
    [3, 3]
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import html
import inspect
import os
import threading
import time
import uuid
from collections import Counter as _Counter
from collections.abc import Sequence

from rlnb.cluster.cluster import Cluster
from rlnb.cluster.placement import parse_slots
from rlnb.errors import (
    ComponentError,
    RemoteError,
    RemoteTimeoutError,
    WorkerLostError,
    did_you_mean,
    remote_error,
)
from rlnb.runtime import direct, transport
from rlnb.runtime.plugin import ensure_worker_runtime
from rlnb.runtime.rank import RankHost, RankInfo
from rlnb.runtime.transport import DaskRoute, DirectRoute

DEFAULT_CALL_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = (
    10.0  # freeing a loop's components, all groups together: a bound that holds after a failure
)
LIVENESS_CHECK_S = 1.0  # while a call runs, how often to ask the scheduler whether its workers live


class GroupResult:
    """The pending result of one method call on several ranks.

    ``result(timeout)`` returns the per-rank values in rank order, raising one typed error
    (:class:`RemoteError`, :class:`WorkerLostError` or :class:`RemoteTimeoutError`) as soon as any
    rank fails, never after waiting for the others. It is also awaitable. Replies are read through
    the calls' route (:mod:`rlnb.runtime.transport`), whichever it is.
    """

    def __init__(
        self,
        group: Group,
        method: str,
        ranks: Sequence[int],
        calls: list,
        timeout_s: float,
        owners=None,
    ):
        self.group, self.method, self.ranks = group, method, list(ranks)
        # owners[i] is the group of ranks[i]; several groups when one call spans them (init_collective)
        self._owners = list(owners) if owners is not None else [group] * len(self.ranks)
        self.timeout_s = timeout_s
        self.durations_s: list[float | None] = [None] * len(self.ranks)
        self._pending = set(range(len(self.ranks)))
        self._values: list = [None] * len(self.ranks)
        self._failure: Exception | None = None
        self._lock = threading.Lock()
        self._calls = list(calls)

    def _settle(self, i: int, reply) -> None:
        """Record rank ``i``'s ``(status, value, duration_s)``, raising its typed error if it failed."""
        status, value, duration = reply
        self._pending.discard(i)
        self.durations_s[i] = duration
        if status != "ok":
            raise self._owners[i]._error(self.ranks[i], self.method, status, value)
        self._values[i] = value

    def _raise_if_lost(self, identity: dict) -> None:
        alive = identity.get("workers", {})
        for i in sorted(self._pending):
            owner, rank = self._owners[i], self.ranks[i]
            if owner.infos[rank].address not in alive:
                raise owner._error(rank, self.method, "lost", "the scheduler no longer lists this worker")

    def _read(self, timeout: float) -> bool:
        """Read the replies that arrive within ``timeout`` seconds; True once all are in. The first
        failure is kept (and raised again by later calls); the other replies are then dropped."""
        if self._failure is not None:
            raise self._failure
        try:
            self._read_replies(time.monotonic() + timeout)
        except RemoteError as e:
            self._failure = e
            for j in self._pending:  # their replies will never be read
                self._calls[j].discard()
            raise
        return not self._pending

    def _read_replies(self, deadline: float) -> None:
        quiet_since = time.monotonic()
        while self._pending:
            wait = min(LIVENESS_CHECK_S, deadline - time.monotonic())
            ready = transport.wait_any([self._calls[i] for i in self._pending], wait)
            for i in sorted(self._pending):
                if self._calls[i] in ready:
                    self._settle(i, self._calls[i].read())
                    quiet_since = time.monotonic()
            if not self._pending or time.monotonic() >= deadline:
                return
            if time.monotonic() - quiet_since >= LIVENESS_CHECK_S:  # is each pending rank's worker alive?
                client = self.group.cluster.client
                fut = asyncio.run_coroutine_threadsafe(client.scheduler.identity(), client.loop.asyncio_loop)
                with contextlib.suppress(TimeoutError, OSError):
                    self._raise_if_lost(fut.result(10))
                quiet_since = time.monotonic()

    def result(self, timeout: float | None = None) -> list:
        """Block until every rank returned (list in rank order) or one failed; ``timeout`` in seconds."""
        timeout = self.timeout_s if timeout is None else timeout
        with self._lock:
            if self._read(timeout):
                return self._values
        raise self._timed_out(timeout) from None

    def _timed_out(self, timeout: float) -> RemoteTimeoutError:
        """The error for ranks still pending after ``timeout`` seconds; their workers are marked unresponsive
        (closing does not wait on them again: see shutdown_groups)."""
        i = min(self._pending) if self._pending else 0
        pending = [f"{self._owners[j].name}[{self.ranks[j]}]" for j in sorted(self._pending)]
        for j in self._pending:
            self._owners[j].cluster.unresponsive.add(self._owners[j].infos[self.ranks[j]].address)
        return self._owners[i]._timeout_error(self.ranks[i], self.method, timeout, pending)

    def outcomes(self, timeout: float | None = None) -> list:
        """Every rank's value or typed error (a :class:`RemoteError`), in rank order, waiting for all of them
        within ``timeout`` (seconds): for a caller that goes on without a failed rank (an elastic run), where
        :meth:`result` raises at the first failure."""
        timeout = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        errors: dict[int, RemoteError] = {}
        with self._lock:
            if self._failure is not None:
                raise self._failure
            while self._pending and time.monotonic() < deadline:
                try:
                    self._read_replies(deadline)
                except RemoteError as e:
                    i = next(j for j in range(len(self.ranks)) if self.ranks[j] == e.rank and j not in errors)
                    errors[i] = e
                    if i in self._pending:  # (lost while its reply was awaited: it will never come)
                        self._pending.discard(i)
                        self._calls[i].discard()
            if self._pending:
                raise self._timed_out(timeout)
        return [errors.get(i, v) for i, v in enumerate(self._values)]

    def wait(self, timeout: float | None = None) -> GroupResult:
        """Like :meth:`result` but returns ``self`` (for chaining and timings)."""
        self.result(timeout)
        return self

    def done(self) -> bool:
        with self._lock:
            with contextlib.suppress(RemoteError):
                self._read(0)
            return not self._pending or self._failure is not None

    def __await__(self):
        return asyncio.to_thread(self.result).__await__()

    def __repr__(self) -> str:  # local state only: replies already read, never a read from the network
        if self._failure is not None:
            state = f"failed: {type(self._failure).__name__}"
        elif not self._pending:
            state = "done"
        else:
            state = f"{len(self.ranks) - len(self._pending)}/{len(self.ranks)} replies read (.done() checks for more)"
        return f"<GroupResult {self.group.name}.{self.method} ranks={self.ranks} {state}>"


class Group:
    """The ranks of one component, each a Dask actor on the worker that owns its slot.

    Calling any method of the component class on the group calls it on every rank and returns a
    :class:`GroupResult`. ``group.on(0)`` narrows to some ranks.
    """

    def __init__(
        self, name: str, cluster: Cluster, cls: type, hosts: list, infos: list[RankInfo], timeout_s: float
    ):
        self.name, self.cluster, self.cls = name, cluster, cls
        self.infos = infos
        self.call_timeout_s = timeout_s
        self._ranks = list(range(len(infos)))
        self._dropped: set[int] = set()  # ranks left out for good (drop)
        # an elastic group's rank states are saved and loaded by position among its ranks, not by rank number
        # (ranks come and go; a resumed run starts as many as it launched)
        self.positional_state = False
        self.unrestored: list[
            int
        ] = []  # with positional_state: the ranks the last load_state had no file for
        self._closed = False
        # how calls reach the ranks: Dask's rpc until the ranks offer direct sockets (chosen once, at launch)
        self._dask_route = DaskRoute(hosts, cluster.client)
        self._route: DirectRoute | DaskRoute = self._dask_route

    # ------------------------------------------------------------------ launch
    @classmethod
    def launch(
        cls,
        component_cls: type,
        cluster: Cluster,
        placement="all",
        *,
        args: tuple = (),
        kwargs: dict | None = None,
        rank_kwargs=None,
        name: str | None = None,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        start_timeout_s: float = 120.0,
    ) -> Group:
        """Start one rank of ``component_cls`` per slot of ``placement``.

        Args:
            component_cls: a plain class; built on the worker as ``component_cls(*args, **kwargs)``
                (plus ``rank_info=`` if its constructor takes that argument).
            cluster: the :class:`Cluster`.
            placement: slot selection (``"0-1"``, ``[0, 2]``, ``"all"``) or a tuple of slot ranks.
            args, kwargs: constructor arguments shared by every rank.
            rank_kwargs: optional callable ``rank -> dict`` of extra per-rank kwargs (e.g. seeds).
            name: component name used in errors and views (default: the class name, lower case).
            call_timeout_s: default timeout of every call on this group.
            start_timeout_s: how long construction may take.
        """
        name = name or component_cls.__name__.lower()
        _refuse_shadowed_methods(component_cls, name)
        slots = (
            tuple(placement)
            if isinstance(placement, tuple)
            else parse_slots(placement, cluster.num_slots, name)
        )
        for s in slots:
            if not 0 <= s < cluster.num_slots:
                raise RemoteError(f"slot {s} is beyond the cluster (0-{cluster.num_slots - 1})", name)
        per_node = _Counter(cluster.slots[s].node for s in slots)
        seen: _Counter = _Counter()
        infos = []
        for rank, s in enumerate(slots):
            node = cluster.slots[s].node
            infos.append(_rank_info(cluster, name, rank, len(slots), s, seen[node], per_node[node]))
            seen[node] += 1
        ensure_worker_runtime(cluster)
        uid = uuid.uuid4().hex[:16]  # unique across drivers sharing the scheduler (Dask dedups by key)
        hosts = _start_hosts(
            component_cls, cluster, infos, args, kwargs, rank_kwargs, name, uid, start_timeout_s
        )
        group = cls(name, cluster, component_cls, hosts, infos, call_timeout_s)
        group._launch_spec = {
            "component_cls": component_cls, "cluster": cluster, "placement": slots, "args": args,
            "kwargs": kwargs, "rank_kwargs": rank_kwargs, "name": name, "call_timeout_s": call_timeout_s,
            "start_timeout_s": start_timeout_s,
        }  # fmt: skip
        group._uid = uid
        ready = group._raw("ready", (), {}, group._ranks, label="__init__").result(start_timeout_s)
        group._route = DirectRoute.connect([r["direct"] for r in ready]) or group._dask_route
        for info in infos:
            cluster.register_component(info.slot, f"{name}[{info.rank}]")
        return group

    def relaunch(self) -> Group:
        """A new group of the same class, arguments, slots and name (after a lost worker was replaced)."""
        return type(self).launch(**self._launch_spec)

    # ------------------------------------------------------------------ elastic membership
    def drop(self, ranks: Sequence[int]) -> None:
        """Leave ``ranks`` out of this group's calls from now on (their workers were lost or retired); their
        numbers are never reused, so a rank's seed and name stay its own."""
        for r in ranks:
            if r in self._ranks:
                self._ranks.remove(r)
                self._dropped.add(r)
                self.cluster.unregister_component(f"{self.name}[{r}]")

    def grow(self, slot: int) -> int:
        """Start one more rank of this group's class and arguments on ``slot`` (a worker that joined), numbered
        after every rank it ever had; returns its rank. Calls from then on include it."""
        spec = self._launch_spec
        s = self.cluster.slots[slot]
        rank = len(self.infos)
        info = _rank_info(self.cluster, self.name, rank, rank + 1, slot, 0, 1)
        timeout = spec["start_timeout_s"]
        (host,) = _start_hosts(
            self.cls, self.cluster, [info], spec["args"], spec["kwargs"], spec["rank_kwargs"], self.name,
            self._uid, timeout,
        )  # fmt: skip
        self.infos.append(info)
        self._dask_route.hosts.append(host)
        link = None
        try:
            (ready,) = GroupResult(
                self, "__init__", [rank], self._dask_route.send([(rank, "ready", ())], timeout), timeout
            ).result()
            if isinstance(self._route, DirectRoute):
                link = DirectRoute.connect([ready["direct"]])
                if link is None:
                    raise WorkerLostError("its direct call port cannot be reached from the driver", self.name,
                                          rank, s.address, "__init__")  # fmt: skip
        except RemoteError:
            self.infos.pop()  # (as if it had never started: its number is free again)
            self._dask_route.hosts.pop()
            raise
        if link is not None:
            self._route.links.extend(link.links)
        self._ranks.append(rank)
        self.cluster.register_component(slot, f"{self.name}[{rank}]")
        return rank

    # ------------------------------------------------------------------ calls
    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        if not callable(getattr(self.cls, method, None)):
            public = [m for m in dir(self.cls) if not m.startswith("_")]
            raise AttributeError(
                f"{self.cls.__name__} has no method {method!r}.{did_you_mean(method, public)}"
            ) from None

        def call(*args, **kwargs) -> GroupResult:
            return self.call(method, *args, **kwargs)

        # `group.train?` in a notebook shows the component's own signature and docstring
        doc, signature = _method_help(self.cls, method)
        call.__name__ = call.__qualname__ = method
        call.__doc__ = (
            f"{self.cls.__name__}.{method} on every rank of {self.name!r} (ranks {self._ranks}); {doc}"
        )
        if signature is not None:
            call.__signature__ = signature
        return call

    def __dir__(self):  # `group.<TAB>` completes the component's methods too
        methods = [m for m in dir(self.cls) if not m.startswith("_") and callable(getattr(self.cls, m, None))]
        return sorted(set(super().__dir__()) | set(methods))

    def call(self, method: str, *args, **kwargs) -> GroupResult:
        """Call ``method(*args, **kwargs)`` on every rank of this (possibly narrowed) group."""
        return self._raw("call", (method, args, kwargs), {}, self._ranks, label=method)

    def call_each(self, method: str, per_rank: Sequence) -> GroupResult:
        """Call ``method`` with different arguments per rank: ``per_rank[i]`` is an args tuple or kwargs dict."""
        if len(per_rank) != len(self._ranks):
            raise ValueError(
                f"call_each({method!r}): {len(per_rank)} argument sets for {len(self._ranks)} ranks"
            )
        calls = [(method, (), a) if isinstance(a, dict) else (method, tuple(a), {}) for a in per_rank]
        return self._each("call", calls, method)

    def on(self, ranks) -> Group:
        """A view of this group narrowed to ``ranks`` (an int or a list)."""
        ranks = [ranks] if isinstance(ranks, int) else list(ranks)
        for r in ranks:
            if r not in self._ranks:
                raise ValueError(f"{self.name}: rank {r} not in {self._ranks}")
        view = Group(
            self.name, self.cluster, self.cls, self._dask_route.hosts, self.infos, self.call_timeout_s
        )
        view._ranks, view._route = ranks, self._route
        return view

    def _start(self, op: str, per_rank: list[tuple[int, tuple]], route=None) -> list:
        """Start ``op`` on each ``(rank, args)`` through this group's route (or ``route``): one
        pending call per rank, read by :class:`GroupResult`."""
        if self._closed:
            r = per_rank[0][0]
            raise RemoteError("group was shut down", self.name, r, self.infos[r].address, op)
        try:
            return (route or self._route).send([(r, op, a) for r, a in per_rank], self.call_timeout_s)
        except Exception as e:  # raised while encoding, before anything was sent
            method = per_rank[0][1][0] if op == "call" else op
            if isinstance(e, direct.MessageTooLarge):
                raise direct.MessageTooLarge(f"{self.name}.{method}(): {e}") from None
            raise TypeError(
                f"{self.name}.{method}(): an argument cannot be sent to the ranks: {type(e).__name__}: {e}"
            ) from e

    @property
    def transport(self) -> str:
        """``"direct"`` (the ranks' own sockets) or ``"dask"`` (Dask actor rpc)."""
        return self._route.name

    @property
    def _links(self):
        """The direct links to the ranks (``None`` on Dask's route)."""
        return getattr(self._route, "links", None)

    def _raw(self, op: str, args: tuple, kwargs: dict, ranks, label: str | None = None) -> GroupResult:
        futures = self._start(op, [(r, args) for r in ranks])
        return GroupResult(self, label or op, ranks, futures, self.call_timeout_s)

    # ------------------------------------------------------------------ errors
    def _error(self, rank: int, method: str, status: str, value) -> RemoteError:
        return remote_error(status, value, self.name, rank, self.infos[rank].address, method)

    def _timeout_error(
        self, rank: int, method: str, timeout: float, pending: list[str]
    ) -> RemoteTimeoutError:
        return RemoteTimeoutError(
            f"no result within {timeout:g} s (ranks still running: {pending})",
            self.name,
            rank,
            self.infos[rank].address,
            method,
        )

    # ------------------------------------------------------------------ checkpoints
    def state_path(self, directory: str, rank: int) -> str:
        return os.path.join(str(directory), f"{self.name}_rank{rank}.pt")

    def save_state(self, directory: str) -> GroupResult:
        """Each rank writes ``<directory>/<name>_rank<r>.pt`` from its component's ``state_dict()`` (atomically);
        ``r`` its position among the ranks for a group with ``positional_state``."""
        return self._each("save_state", [(self.state_path(directory, r),) for r in self._state_numbers()],
                          "save_state")  # fmt: skip

    def load_state(self, directory: str) -> GroupResult:
        """Each rank restores its component with ``load_state_dict`` from ``<directory>/<name>_rank<r>.pt``. A
        group with ``positional_state`` (an elastic run's env and rollout ranks, whose number may have changed)
        loads the files there are; a rank without one starts afresh."""
        paths = [self.state_path(directory, r) for r in self._state_numbers()]
        if not self.positional_state:
            return self._each("load_state", [(p,) for p in paths], "load_state")
        have = [i for i, path in enumerate(paths) if os.path.exists(path)]
        self.unrestored = [r for i, r in enumerate(self._ranks) if i not in have]
        view = self.on([self._ranks[i] for i in have]) if have else None
        if view is None:
            return GroupResult(self, "load_state", [], [], self.call_timeout_s)
        return view._each("load_state", [(paths[i],) for i in have], "load_state")

    def _state_numbers(self) -> list[int]:
        return list(range(len(self._ranks))) if self.positional_state else list(self._ranks)

    def _each(self, op: str, per_rank_args: list[tuple], label: str) -> GroupResult:
        futures = self._start(op, list(zip(self._ranks, per_rank_args)))
        return GroupResult(self, label, self._ranks, futures, self.call_timeout_s)

    # ------------------------------------------------------------------ process groups
    def init_process_group(
        self, backend: str = "auto", name: str = "default", timeout_s: float = 120.0
    ) -> str:
        """Form a torch.distributed process group over this group's ranks (see :func:`init_collective`)."""
        return init_collective([self], backend=backend, name=name, timeout_s=timeout_s)

    # ------------------------------------------------------------------ lifecycle and views
    @property
    def world_size(self) -> int:
        return len(self._ranks)

    @property
    def ranks(self) -> list[int]:
        return list(self._ranks)

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Release the actors (their workers stay); the slots can host a new launch. A rank that does not answer
        within ``timeout_s`` (a hung or stopped worker) is left to its worker's end."""
        shutdown_groups([self], timeout_s)

    def _start_shutdown(self) -> GroupResult | None:
        """Ask every rank to free its component (see :func:`shutdown_groups`); ``None`` if shut down already."""
        if self._closed:
            return None
        return self._raw(
            "destroy_groups", (), {}, [r for r in range(len(self.infos)) if r not in self._dropped]
        )

    def _finish_shutdown(self) -> None:
        for info in self.infos:
            self.cluster.unregister_component(f"{self.name}[{info.rank}]")
        self._route.close()
        self._route = self._dask_route = DaskRoute([], self.cluster.client)
        self._closed = True

    def __repr__(self) -> str:
        slots = [self.infos[r].slot for r in self._ranks]
        return f"<rlnb.Group {self.name} ranks={self._ranks} slots={slots}>"

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{i.rank}</td><td>{i.slot}</td><td>{html.escape(i.device)}</td>"
            f"<td>{html.escape(i.node)}</td><td><code>{html.escape(i.address)}</code></td></tr>"
            for i in (self.infos[r] for r in self._ranks)
        )
        return (
            f"<div><b>rlnb Group</b> <code>{html.escape(self.name)}</code> "
            f"({html.escape(self.cls.__name__)}, {len(self._ranks)} ranks, {self.transport} calls)"
            f"<table><tr><th>rank</th><th>slot</th><th>device</th><th>node</th><th>worker</th></tr>{rows}</table></div>"
        )


def _start_hosts(
    component_cls, cluster, infos, args, kwargs, rank_kwargs, name, uid, start_timeout_s
) -> list:
    """One :class:`RankHost` of ``component_cls`` per ``infos`` on its worker, waited for together; their actor
    handles bound to ``cluster``."""
    futures = []
    for info in infos:
        kw = dict(kwargs or {})
        if rank_kwargs is not None:
            kw.update(rank_kwargs(info.rank))
        futures.append(
            cluster.client.submit(
                RankHost,
                component_cls,
                tuple(args),
                kw,
                info,
                actor=True,
                workers=[info.address],
                allow_other_workers=False,
                key=f"rlnb-{name}-{uid}-rank{info.rank}",
                pure=False,
            )
        )
    hosts = []
    for info, fut in zip(infos, futures):
        try:
            hosts.append(cluster.bind(fut.result(timeout=start_timeout_s)))
        except TimeoutError:
            raise RemoteTimeoutError(
                f"rank did not start within {start_timeout_s:g} s", name, info.rank, info.address, "__init__"
            ) from None
        except Exception as e:
            raise WorkerLostError(
                f"could not start: {e}", name, info.rank, info.address, "__init__"
            ) from None
    return hosts


@functools.lru_cache(maxsize=1024)
def _method_help(cls: type, method: str) -> tuple[str, inspect.Signature | None]:
    """The docstring tail and the signature (without ``self``) that ``group.<method>`` shows, worked
    out once per class and method: ``inspect`` takes about as long as a whole group call."""
    target = getattr(cls, method)
    doc = f"returns a GroupResult.\n\n{inspect.getdoc(target) or ''}"
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return doc, None
    return doc, inspect.Signature(params[1:] if params and params[0].name == "self" else params)


def _rank_info(
    cluster, name: str, rank: int, world_size: int, slot: int, local_rank: int, local_world_size: int
):
    """Rank ``rank`` of ``world_size`` of component ``name`` on ``slot``, with the slot's device, address and node
    (``local_rank`` of ``local_world_size``: its place among the group's ranks on that node)."""
    s = cluster.slots[slot]
    return RankInfo(
        component=name, rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size,
        slot=slot, device=s.device, address=s.address, node=s.node, session=cluster.session,
    )  # fmt: skip


def _refuse_shadowed_methods(component_cls: type, name: str) -> None:
    """A component method named like one of :class:`Group`'s own (``shutdown``, ``on``, ``call``...) could
    never be called as ``group.<name>()``: refuse it at launch, naming it."""
    own = {n for n in dir(Group) if not n.startswith("_")}
    clashes = sorted(n for n in own if inspect.isfunction(inspect.getattr_static(component_cls, n, None)))
    if clashes:
        raise ComponentError(
            f"method(s) {', '.join(clashes)} share a name with the Group's own, so group.{clashes[0]}(...) would "
            "not reach them; rename them",
            name, component_cls.__name__, clashes[0],
        )  # fmt: skip


# the backend of a group with NCCL for GPU tensors and gloo for CPU ones (FSDP2's CPU offload reduces its
# gradients' norm on CPU)
BOTH = "cpu:gloo,cuda:nccl"


def shutdown_groups(groups: Sequence[Group], timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Shut ``groups`` down together within one deadline of ``timeout_s`` seconds in all (a bound, not a sum
    over groups): every rank is asked at once, and a rank that does not answer in time (its worker hung,
    stopped or lost) is left to its worker's end; nothing is raised."""
    deadline = time.monotonic() + timeout_s
    started = []
    for g in groups:
        with contextlib.suppress(RemoteError, OSError):  # a lost worker has nothing left to free
            started.append((g, g._start_shutdown()))
    for g, pending in started:
        if pending is None:  # shut down already
            continue
        # a worker that let a call time out is not waited for again (hung or stopped): asked, not awaited
        hung = any(info.address in g.cluster.unresponsive for info in g.infos)
        wait_s = 0.0 if hung else max(0.0, deadline - time.monotonic())
        with contextlib.suppress(RemoteError):
            pending.result(wait_s)
        g._finish_shutdown()


def _backend_for(groups: Sequence[Group], backend: str) -> str:
    if backend not in ("auto", "gloo", "nccl", BOTH):
        raise ValueError(f"backend: expected 'auto', 'gloo', 'nccl' or {BOTH!r}, got {backend!r}")
    on_gpu = all(g.infos[r].device.startswith("cuda") for g in groups for r in g._ranks)
    if backend == "auto":
        return "nccl" if on_gpu else "gloo"
    if backend in ("nccl", BOTH) and not on_gpu:
        from rlnb.errors import ClusterError

        raise ClusterError(
            f"backend={backend!r} needs every rank on a GPU slot; this placement has CPU ranks"
        )
    return backend


def init_collective(
    groups: Sequence[Group], backend: str = "auto", name: str = "weights", timeout_s: float = 120.0
):
    """Form one torch.distributed process group over the ranks of several groups, in order.

    Rank 0 of the first group opens a ``TCPStore`` on a free port chosen at run time (never a fixed
    port); every rank then joins. Inside a rank the group is :func:`rlnb.runtime.process_group`
    (``name``). ``name="default"`` (one group only) initialises torch's default process group, as
    DDP needs. Returns the backend used (``gloo`` on CPU, ``nccl`` when every rank has a GPU).
    """
    backend = _backend_for(groups, backend)
    members = [(g, r) for g in groups for r in g._ranks]
    by_worker: dict[str, str] = {}
    for g, r in members:
        here = f"{g.name}[{r}]"
        other = by_worker.setdefault(g.infos[r].address, here)
        if other != here:
            from rlnb.errors import PlacementError

            raise PlacementError(
                f"init_collective({name!r}): {other} and {here} share worker {g.infos[r].address}; a process "
                "group needs one rank per worker process. Collocated ranks exchange tensors in-process instead.",
                "component_placement",
            )
    world = len(members)
    g0, r0 = members[0]
    (host, port) = _single(g0, r0, "open_store", (name, world, timeout_s), timeout_s)
    # one call's replies are read together: if any group is on Dask's route, all take it
    on_dask = any(g.transport == "dask" for g in groups)
    futures = [
        g._start(
            "join_group",
            [(r, (name, host, port, global_rank, world, backend, timeout_s))],
            g._dask_route if on_dask else None,
        )[0]
        for global_rank, (g, r) in enumerate(members)
    ]
    GroupResult(
        g0,
        f"init_process_group[{name}]",
        [r for _, r in members],
        futures,
        timeout_s + 10,
        [g for g, _ in members],
    ).result()
    return backend


def _single(group: Group, rank: int, op: str, args: tuple, timeout_s: float):
    return GroupResult(group, op, [rank], group._start(op, [(rank, args)]), timeout_s).result()[0]

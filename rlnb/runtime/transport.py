"""How the driver reaches a group's ranks: one interface, two routes, chosen once per group.

A route sends one operation to some ranks and hands back one pending call per rank; the calls of a
route know how to wait for the first replies among them. :class:`~rlnb.runtime.group.GroupResult`
reads replies through that interface and never asks which route it has.

- :class:`DirectRoute`: the ranks' own call servers (:mod:`rlnb.runtime.direct`), one socket per
  call in flight; several times cheaper than Dask's rpc (figures: ``README.md``, ``docs/benchmarks.md``).
- :class:`DaskRoute`: Dask's actor rpc, for workers that offer no direct port (``tls://``, a
  firewall, ``RLNB_DIRECT_CALLS=0``).

Both return ``(status, value, duration_s)`` replies; status ``"ok"``, ``"err"`` (a packed
exception), ``"lost"`` (the worker is gone) or ``"timeout"`` (the request could not be sent in time).
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from rlnb import _dask
from rlnb.runtime import direct
from rlnb.runtime.direct import DirectLink, PendingCall


class DirectRoute:
    """Calls over the ranks' direct sockets (one :class:`~rlnb.runtime.direct.DirectLink` per rank)."""

    name = "direct"

    def __init__(self, links: list[DirectLink]):
        self.links = links

    @classmethod
    def connect(cls, offers: list) -> DirectRoute | None:
        """A route to every rank, or ``None`` if any rank offers no direct port, ``RLNB_DIRECT_CALLS=0``,
        or one cannot be reached from here (e.g. a firewall)."""
        if not direct.enabled() or any(o is None for o in offers):
            return None
        links = [DirectLink(*o, rank=True) for o in offers]
        try:
            for link in links:
                link.give_back(link.connect(timeout_s=5.0))
        except OSError:
            for link in links:
                link.close()
            return None
        return cls(links)

    def send(self, per_rank: list[tuple[int, str, tuple]], timeout_s: float) -> list[PendingCall]:
        """Send ``op(*args)`` to each ``(rank, op, args)``; each distinct args tuple is encoded once,
        all before anything is sent (an argument that cannot be encoded raises here, nothing sent)."""
        encoded: dict[int, list] = {}
        for _, _, args in per_rank:
            if id(args) not in encoded:
                encoded[id(args)] = direct.dumps(args)
        return [self.links[r].send(op, encoded[id(a)], timeout_s) for r, op, a in per_rank]

    def close(self) -> None:
        for link in self.links:
            link.close()


class DaskCall:
    """One actor call running on the client's event loop."""

    def __init__(self, future: concurrent.futures.Future):
        self.future, self.reply = future, None

    @staticmethod
    def wait_any(calls: list[DaskCall], timeout_s: float) -> list[DaskCall]:
        """Those of ``calls`` whose reply is in within ``timeout_s`` seconds (at least one, or none)."""
        done = [c for c in calls if c.reply is not None or c.future.done()]
        if done:
            return done
        finished, _ = concurrent.futures.wait(
            [c.future for c in calls], max(timeout_s, 0), concurrent.futures.FIRST_COMPLETED
        )
        return [c for c in calls if c.future in finished]

    def read(self) -> tuple:
        if self.reply is None:
            try:
                self.reply = self.future.result(0)
            except Exception as e:  # cancelled, or the client's loop went away
                self.reply = ("lost", e, 0.0)
        return self.reply

    def discard(self) -> None:
        self.future.cancel()


class DaskRoute:
    """Calls through Dask's actor rpc (``hosts``: the ranks' actor handles, bound to ``client``)."""

    name = "dask"

    def __init__(self, hosts: list, client):
        self.hosts, self.client = hosts, client

    def send(self, per_rank: list[tuple[int, str, tuple]], timeout_s: float) -> list[DaskCall]:
        loop = self.client.loop.asyncio_loop
        return [
            DaskCall(asyncio.run_coroutine_threadsafe(_call_host(self.hosts[r], op, args), loop))
            for r, op, args in per_rank
        ]

    def close(self) -> None:
        pass


async def _call_host(actor, op: str, args: tuple):
    """One actor call straight over the worker rpc (what ``Actor.__getattr__`` does, without its
    per-call closure and extra thread hops). A lost worker gives status ``"lost"``."""
    try:
        msg = await _dask.actor_execute(actor, op, args)
    except OSError as e:  # connection refused/closed: the worker process is gone
        return ("lost", e, 0.0)
    if msg["status"] == "OK":
        return msg["result"]
    return ("lost", msg["exception"], 0.0)  # e.g. the actor is no longer on that worker


def wait_any(calls: list, timeout_s: float) -> list:
    """Those of ``calls`` (all from one kind of route) with a reply in within ``timeout_s`` seconds."""
    if not calls:
        return []
    return type(calls[0]).wait_any(calls, timeout_s)


__all__ = ["DaskCall", "DaskRoute", "DirectRoute", "wait_any"]

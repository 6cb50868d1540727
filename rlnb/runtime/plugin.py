"""rlnb's part of each Dask worker, set up and torn down by Dask as a ``WorkerPlugin``.

It owns what one worker process shares between the components living on it: the direct-call
server (:class:`rlnb.runtime.direct.CallServer`) and, at start, a sweep of shared-memory segments
left by dead processes. On an embedded cluster it also makes the worker ignore Ctrl-C, SIGTERM and SIGHUP
sent to the driver's process group (a terminal, ``systemctl stop``, Slurm): the notebook or ``rlnb run`` handles
them (a checkpoint, then a clean shutdown), then stops the workers.
"""

from __future__ import annotations

import logging
import weakref

from distributed import WorkerPlugin

from rlnb._dask import leave_stop_signals_to_driver
from rlnb.runtime import direct
from rlnb.runtime.shm import close_pool, sweep_dead_segments

log = logging.getLogger("rlnb")
NAME = "rlnb-runtime"


class WorkerRuntime(WorkerPlugin):
    """Registered once per scheduler (``idempotent``: a second driver keeps the first one's, so it
    never tears down servers that another driver's components use).

    Args:
        ignore_sigint: make the worker process leave ``SIGINT``, ``SIGTERM`` and ``SIGHUP`` to the driver
            (embedded clusters, whose workers share the driver's process group).
    """

    idempotent = True
    name = NAME

    def __init__(self, ignore_sigint: bool = False):
        self.ignore_sigint = ignore_sigint
        self.server: direct.CallServer | None = None
        self.swept = 0

    def setup(self, worker):
        rlnb_log = logging.getLogger("rlnb")
        if rlnb_log.level == logging.NOTSET:  # workers' root logger may be at ERROR: rlnb warnings count
            rlnb_log.setLevel(logging.WARNING)
        self.swept = sweep_dead_segments()
        if self.swept:
            log.info(
                "worker %s removed %d shared-memory segment(s) of dead processes", worker.address, self.swept
            )
        _quiet_heartbeat_at_close(worker)
        # the embedded cluster's: a signal to the driver's process group is the driver's
        if self.ignore_sigint:
            leave_stop_signals_to_driver()
        # (the driver decides whether to use it) on TCP, and on TLS where the worker listens on loopback only
        # (the embedded cluster): its tokens reach drivers over TLS, and nobody can read loopback traffic
        if worker.address.startswith("tcp://") or _loopback_tls(worker.address):
            try:
                self.server = direct.CallServer(worker)
            except (OSError, ValueError) as e:
                log.warning(
                    "worker %s offers no direct calls (%s); its ranks use Dask's rpc", worker.address, e
                )

    def teardown(self, worker):
        if self.server is not None:
            self.server.close()
            self.server = None
        close_pool()


class _HeartbeatAtClose(logging.Filter):
    """Drops Dask's "Failed to communicate with scheduler during heartbeat" traceback when the worker itself is
    closing: a heartbeat still connecting when the close ends the connection pool (under load, a few seconds of
    TLS handshake) printed it after a successful run's last line. A heartbeat failing while it runs is kept."""

    def __init__(self, worker):
        super().__init__()
        self.worker = weakref.ref(worker)

    def filter(self, record: logging.LogRecord) -> bool:
        worker = self.worker()
        closing = worker is None or worker.status.name in (
            "closing",
            "closed",
            "closing_gracefully",
            "failed",
        )
        return not (closing and record.getMessage().startswith("Failed to communicate with scheduler"))


def _quiet_heartbeat_at_close(worker) -> None:
    logger = logging.getLogger("distributed.worker")
    for old in [f for f in logger.filters if isinstance(f, _HeartbeatAtClose)]:
        logger.removeFilter(old)  # (a plugin set up again on the same process: one filter, this worker's)
    logger.addFilter(_HeartbeatAtClose(worker))


def _loopback_tls(address: str) -> bool:
    host = address.removeprefix("tls://").rsplit(":", 1)[0].strip("[]")
    return address.startswith("tls://") and (host.startswith("127.") or host == "::1")


def ensure_worker_runtime(cluster) -> None:
    """Register :class:`WorkerRuntime` with the cluster's scheduler (once per :class:`rlnb.Cluster`):
    every current worker sets it up now, every later one (a restarted worker too) when it starts."""
    cluster.once(
        "worker_runtime",
        lambda: cluster.client.register_plugin(WorkerRuntime(ignore_sigint=cluster.embedded), name=NAME),
    )

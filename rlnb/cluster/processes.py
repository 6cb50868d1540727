"""A `dask scheduler` and `dask worker` processes on this machine, started as a real deployment starts them.

For trying a remote cluster anywhere (a notebook, the tests): the same command lines you would run on
your nodes, on loopback with ports chosen at run time, stopped and cleaned up on exit.

Example:
    >>> with DaskProcesses({"trainer": {"train": 1}, "simulator": {"sim": 1}}) as procs:  # doctest: +SKIP
    ...     cluster = rlnb.Cluster(procs.address, min_slots=2)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlnb.errors import ClusterError


class DaskProcesses:
    """``dask scheduler`` plus one ``dask worker`` per entry of ``workers``, as separate processes.

    Args:
        workers: worker name -> its resources (node groups, e.g. ``{"sim": 1}``), or a number of plain
            workers named ``w0``, ``w1``...
        host: the interface everything listens on (loopback by default: nothing reachable from outside).
        timeout_s: how long the scheduler may take to start.
        env: extra environment variables for the processes (e.g. ``DASK_DISTRIBUTED__WORKER__DAEMON=False``).
        gpu: start each worker as ``dask cuda worker`` (dask-cuda: one worker process per GPU of this
            machine, each seeing its own as ``cuda:0``) instead of ``dask worker``.

    Attributes:
        address: the scheduler's address (``tcp://127.0.0.1:PORT``), once started.
        log_dir: where each process writes its log (removed on :meth:`close`).
    """

    def __init__(
        self,
        workers: dict[str, dict[str, float]] | int = 2,
        host: str = "127.0.0.1",
        timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
        gpu: bool = False,
    ):
        self.workers = {f"w{i}": {} for i in range(workers)} if isinstance(workers, int) else dict(workers)
        self.host, self.timeout_s, self.gpu = host, timeout_s, gpu
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.address: str | None = None
        self.log_dir: Path | None = None
        self.processes: list[subprocess.Popen] = []

    @staticmethod
    def _dask() -> list[str]:
        """The ``dask`` command: this Python's script, else the one on ``PATH``, else ``python -m dask`` (packages
        installed with ``pip --target`` bring no scripts; their subcommands are still found)."""
        here = Path(sys.executable).with_name("dask")
        found = str(here) if here.exists() else shutil.which("dask")
        return [found] if found else [sys.executable, "-m", "dask"]

    def _spawn(self, name: str, args: list[str]) -> Path:
        log = self.log_dir / f"{name}.log"
        with log.open("w") as out:
            self.processes.append(
                subprocess.Popen([*self._dask(), *args], stdout=out, stderr=subprocess.STDOUT, env=self.env)
            )
        return log

    def start(self) -> str:
        """Start the scheduler, wait for its address, start the workers; returns the address."""
        self.log_dir = Path(tempfile.mkdtemp(prefix="rlnb-dask-"))
        log = self._spawn(
            "scheduler",
            ["scheduler", "--host", self.host, "--port", "0", "--dashboard-address", ":0", "--no-show"],
        )
        deadline = time.monotonic() + self.timeout_s
        while self.address is None:
            found = re.search(r"Scheduler at:\s+(tcp://\S+)", log.read_text())
            if found:
                self.address = found.group(1)
            elif self.processes[0].poll() is not None or time.monotonic() > deadline:
                tail = log.read_text()[-2000:]
                self.close()
                raise ClusterError(f"`dask scheduler` did not start within {self.timeout_s:g} s:\n{tail}")
            else:
                time.sleep(0.1)
        for name, resources in self.workers.items():
            args = (
                ["cuda", "worker", self.address, "--nthreads", "1", "--no-dashboard"]
                if self.gpu
                else ["worker", self.address, "--nthreads", "1", "--nworkers", "1", "--no-dashboard"]
            )
            args += ["--host", self.host, "--name", name]
            if resources:
                args += ["--resources", ",".join(f"{k}={v}" for k, v in resources.items())]
            self._spawn(f"worker-{name}", args)
        return self.address

    def logs(self) -> dict[str, str]:
        """Each process's log so far (name -> text)."""
        if self.log_dir is None or not self.log_dir.exists():
            return {}
        return {p.stem: p.read_text() for p in sorted(self.log_dir.glob("*.log"))}

    def close(self) -> None:
        """Stop the workers, then the scheduler (SIGTERM, then SIGKILL after 10 s), and remove the logs."""
        for p in self.processes[::-1]:
            if p.poll() is None:
                p.terminate()
        for p in self.processes[::-1]:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.processes = []
        if self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> DaskProcesses:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        alive = sum(p.poll() is None for p in self.processes)
        return f"DaskProcesses(address={self.address!r}, workers={list(self.workers)}, running={alive})"

"""Small components the runtime demo (``rlnb demo``), ``make gpu-check`` and the docs place on a cluster.

They live in the package so that workers started with the ``dask worker`` command line import them.
"""

from __future__ import annotations

import os
import time

import torch

from rlnb.runtime.rank import RankInfo, current_rank, process_group


class Echo:
    """Returns what it is given, knows its rank, moves tensors through channels: the runtime demo's component."""

    def __init__(self, offset: int = 0, rank_info: RankInfo | None = None):
        self.offset = offset
        self.rank_info = rank_info

    def noop(self):
        return None

    def echo(self, x):
        return x

    def add(self, x):
        return x + self.offset

    def whoami(self) -> dict:
        info = current_rank()
        return {
            "rank": info.rank,
            "world_size": info.world_size,
            "local_rank": info.local_rank,
            "slot": info.slot,
            "device": info.device,
            "address": info.address,
            "env_rank": os.environ.get("RANK"),
            "env_world_size": os.environ.get("WORLD_SIZE"),
            "pid": os.getpid(),
            "init_rank": self.rank_info.rank if self.rank_info else None,
        }

    def produce(
        self, channel, n: int, numel: int, key: str = "default", fill: bool = True, shared: bool = False
    ):
        """Put ``n`` float32 tensors of ``numel`` elements (value = index) into ``channel``.

        One buffer is reused for every item: ``put`` has copied the data out when it returns.
        ``shared=True`` builds each item in shared memory instead (``channel.empty``), which a put
        sends without copying. ``fill=False`` only writes the first element (the index): a
        benchmark then times the transfer, not a 16 MiB memset per item.
        """
        buf = torch.zeros(numel)
        for i in range(n):
            if shared:
                buf = channel.empty((numel,))  # the previous item is the reader's now
            if fill:
                buf.fill_(float(i))
            else:
                buf[0] = float(i)
            channel.put(buf, key=key)
        return n

    def consume(self, channel, n: int, key: str = "default", timeout: float = 60):
        """Take ``n`` items and return their first elements."""
        return [float(channel.get(key=key, timeout=timeout)[0]) for _ in range(n)]


class Collective:
    """Exercises process groups: all-reduce within a group, state-dict broadcast across groups."""

    def __init__(self, rank_info: RankInfo):
        self.info = rank_info
        self.model = torch.nn.Linear(3, 2).to(rank_info.device)
        torch.nn.init.zeros_(self.model.weight)
        torch.nn.init.zeros_(self.model.bias)

    def all_reduce(self, name: str = "default") -> list[float]:
        from rlnb.runtime.collective import all_reduce_

        t = torch.tensor([float(self.info.rank + 1), 10.0 * (self.info.rank + 1)], device=self.info.device)
        return all_reduce_(t, process_group(name)).cpu().tolist()

    def set_weights(self, value: float):
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(value)

    def broadcast_weights(self, src: int, name: str = "weights") -> dict:
        from rlnb.runtime.collective import broadcast_state_dict

        sd = self.model.state_dict()
        broadcast_state_dict(sd, src, process_group(name))
        return {k: v.cpu().tolist() for k, v in sd.items()}


class CudaProbe:
    """Puts and takes CUDA tensors through channels: shows whether they move without a host round trip."""

    def __init__(self, rank_info: RankInfo):
        self.device = torch.device(rank_info.device)
        self.sent: torch.Tensor | None = None
        self.taken: torch.Tensor | None = None

    def put(self, channel, size_mib: int, value: float, how: str = "ipc") -> int:
        """Put a ``size_mib`` MiB tensor filled with ``value``: on the GPU (``ipc``: CUDA IPC on one node)
        or copied to the host first (``host``: the round trip it saves)."""
        self.sent = torch.full((size_mib << 18,), value, device=self.device)
        torch.cuda.synchronize(self.device)
        channel.put({"t": self.sent if how == "ipc" else self.sent.cpu(), "t0": time.perf_counter()}, key="t")
        return self.sent.numel()

    def fill(self, value: float) -> None:
        self.sent.fill_(value)
        torch.cuda.synchronize(self.device)

    def take(self, channel) -> dict:
        """Take the tensor onto this rank's GPU; ``seconds``: from the put to the tensor usable here."""
        msg = channel.get(key="t")
        self.taken = msg["t"].to(self.device, non_blocking=True)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - msg["t0"]
        return {"device": msg["t"].device.type, "value": float(self.taken[0]), "seconds": seconds}

    def read(self) -> float:
        return float(self.taken[-1])

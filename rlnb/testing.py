"""Small plain components used by the tests, the benchmarks and the runtime demo.

They live in the package (not in ``tests/``) so workers started with the ``dask worker`` command
line can import them.
"""

from __future__ import annotations

import os
import time

import gymnasium as gym
import numpy as np
import torch
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

from rlnb.runtime.rank import RankInfo, current_rank, process_group


class Echo:
    """Returns what it is given; knows its rank."""

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

    def apply(self, fn, *args):
        """``fn(*args)`` here: checks that functions and classes defined in a notebook travel by value."""
        return fn(*args)

    def thread(self) -> str:
        """The name of the thread running component code (Dask's actor thread, whatever the transport)."""
        import threading

        return threading.current_thread().name

    def unpicklable(self):
        import threading

        return threading.Lock()

    def mmapped_bytes_of_a_1mib_tensor(self) -> int:
        return mmapped_bytes_of_a_1mib_tensor()

    def fail(self, message: str = "boom"):
        raise ValueError(message)

    def warn(self, message: str) -> str:
        """Log a warning on the ``rlnb`` logger here, on the worker."""
        import logging

        logging.getLogger("rlnb").warning(message)
        return message

    def sleep(self, seconds: float):
        time.sleep(seconds)
        return seconds

    def pid(self) -> int:
        return os.getpid()

    def produce(self, channel, n: int, numel: int, key: str = "default", fill: bool = True):
        """Put ``n`` float32 tensors of ``numel`` elements (value = index) into ``channel``.

        One buffer is reused for every item: ``put`` has copied the data out when it returns.
        ``fill=False`` only writes the first element (the index): a benchmark then times the
        transfer, not a 16 MiB memset per item.
        """
        buf = torch.zeros(numel)
        for i in range(n):
            if fill:
                buf.fill_(float(i))
            else:
                buf[0] = float(i)
            channel.put(buf, key=key)
        return n

    def consume(self, channel, n: int, key: str = "default", timeout: float = 60):
        """Take ``n`` items and return their first elements."""
        return [float(channel.get(key=key, timeout=timeout)[0]) for _ in range(n)]


def mmapped_bytes_of_a_1mib_tensor() -> int:
    """Bytes glibc ``mmap``-ed to hold one new 1 MiB tensor (``mallinfo2().hblkhd`` before and after):
    ~1 MiB under Dask's ``MALLOC_TRIM_THRESHOLD_`` (each such tensor is a fresh mapping whose pages
    fault in on first touch), 0 once freed heap memory is reused."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
        )]  # fmt: skip

    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = MallInfo2
    before = mallinfo2().hblkhd
    t = torch.empty(1 << 18)
    grown = mallinfo2().hblkhd - before
    del t
    return grown


class FailsToStart:
    def __init__(self):
        raise RuntimeError("constructor exploded")


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


class NaNRewardCartPole(CartPoleEnv):
    """CartPole whose rewards turn NaN after ``nan_after`` steps: drives the NaN-loss handling tests."""

    def __init__(self, nan_after: int = 200, **kwargs):
        super().__init__(**kwargs)
        self.nan_after, self.count = nan_after, 0

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        self.count += 1
        return obs, (np.nan if self.count > self.nan_after else reward), terminated, truncated, info


if "rlnb-test/NaNReward-v0" not in gym.registry:
    gym.register("rlnb-test/NaNReward-v0", entry_point=NaNRewardCartPole, max_episode_steps=500)

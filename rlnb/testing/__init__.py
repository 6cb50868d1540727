"""Components for the tests and the benchmarks (the demo's are in :mod:`rlnb.demo`). Importing this
module registers the test env ``rlnb-test/NaNReward-v0``; a recipe names it ``rlnb.testing:rlnb-test/NaNReward-v0``
so that workers import this module first (gymnasium's ``module:id`` form).

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

from rlnb import demo
from rlnb.demo import Collective, CudaProbe  # noqa: F401  (the tests import them from here too)


class Echo(demo.Echo):
    """The demo's :class:`rlnb.demo.Echo` plus what the tests probe: threads, pickling, failures, logs."""

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

    def mmapped_bytes_of_an_8mib_tensor(self) -> int:
        return mmapped_bytes_of_an_8mib_tensor()

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


def mmapped_bytes_of_an_8mib_tensor() -> int:
    """Bytes glibc ``mmap``-ed to hold one new 8 MiB tensor (``mallinfo2().hblkhd`` before and after):
    ~8 MiB under Dask's ``MALLOC_TRIM_THRESHOLD_`` (each such tensor is a fresh mapping whose pages
    fault in on first touch), 0 once freed heap memory is reused. (8 MiB, not less: compiling the modules on
    their first import, as on a fresh clone, leaves free chunks in the heap that hold a 1 MiB one, mapping nothing
    even untuned.)"""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
        )]  # fmt: skip

    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = MallInfo2
    before = mallinfo2().hblkhd
    t = torch.empty(1 << 21)
    grown = mallinfo2().hblkhd - before
    del t
    return grown


class FailsToStart:
    def __init__(self):
        raise RuntimeError("constructor exploded")


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

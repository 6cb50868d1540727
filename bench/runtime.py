"""Runtime benchmark: group call latency and channel throughput, against plain Dask and a raw Pipe.

Run: ``.venv/bin/python bench/runtime.py`` (prints figures; not a timed test).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import torch

import rlnb
from rlnb.demo import Echo

CALLS = 500


def pct(samples: list[float]) -> str:
    a = np.array(samples) * 1e3
    return f"p50 {np.percentile(a, 50):.3f} ms  p90 {np.percentile(a, 90):.3f} ms"


def time_calls(fn, n=CALLS) -> list[float]:
    for _ in range(20):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


class Sink:
    """Consumes n items from a channel and reports the time from first to last."""

    def drain(self, channel, n: int, key: str):
        t0 = None
        for _ in range(n):
            channel.get(key=key, timeout=120)
            t0 = t0 or time.perf_counter()
        return time.perf_counter() - t0


def channel_throughput(cluster, producer, nbytes: int, n: int, shared: bool = False) -> tuple[float, float]:
    ch = rlnb.Channel.create(cluster, f"bench{nbytes}", maxsize=4, slot=0)
    numel = nbytes // 4
    producer.on(1).produce(ch, 2, numel, key="warm", shared=shared).result(120)
    producer.on(0).consume(ch, 2, key="warm").result(120)
    t0 = time.perf_counter()
    consumer = producer.on(0).consume(ch, n, key="x")
    # The producer rewrites only element 0 of one buffer per item (fill=False), as the Pipe floor
    # sends one ready payload: this times the transfer, not a memset of the whole tensor per item.
    producer.on(1).produce(ch, n, numel, key="x", fill=False, shared=shared).result(300)
    consumer.result(300)
    dt = time.perf_counter() - t0
    ch.close()
    return n / dt, n * nbytes / dt / 1e9


def _pipe_child(conn, n, nbytes):
    conn.send(b"ready")
    for _ in range(n):
        conn.recv_bytes()
    conn.send(b"done")


def pipe_throughput(nbytes: int, n: int) -> float:
    a, b = mp.Pipe()
    p = mp.get_context("spawn").Process(target=_pipe_child, args=(b, n, nbytes))
    p.start()
    payload = np.ones(nbytes // 4, dtype=np.float32).tobytes()
    a.recv()  # the child has started (spawn re-imports this module) before timing begins
    t0 = time.perf_counter()
    for _ in range(n):
        a.send_bytes(payload)
    a.recv()
    dt = time.perf_counter() - t0
    p.join()
    return n * nbytes / dt / 1e9


def _pipe_echo(conn):
    while conn.recv() is not None:
        conn.send(None)


def pipe_latency() -> list[float]:
    a, b = mp.Pipe()
    p = mp.get_context("spawn").Process(target=_pipe_echo, args=(b,))
    p.start()
    lat = time_calls(lambda: (a.send(1), a.recv()))
    a.send(None)
    p.join()
    return lat


def _pipe_echo_bytes(conn):
    buf = bytearray(64)
    while conn.recv_bytes_into(buf) != 1 or buf[0] != 0:
        conn.send_bytes(b"k")


def pipe_bytes_latency() -> list[float]:
    """The floor for one request/reply between two processes: raw bytes, no pickling at all."""
    a, b = mp.Pipe()
    p = mp.get_context("spawn").Process(target=_pipe_echo_bytes, args=(b,))
    p.start()
    buf = bytearray(64)
    lat = time_calls(lambda: (a.send_bytes(b"q"), a.recv_bytes_into(buf)))
    a.send_bytes(b"\0")
    p.join()
    return lat


def memcpy_gbs(nbytes: int, n: int = 20) -> float:
    """One thread copying ``nbytes`` between two already-faulted buffers: a single copy's floor."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(n):
        dst.copy_(src)
    return n * nbytes / (time.perf_counter() - t0) / 1e9


def main():
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cluster = rlnb.Cluster(slots=2, gpus=False)
    print(f"cluster start: {time.perf_counter() - t0:.2f} s")
    t0 = time.perf_counter()
    group = rlnb.Group.launch(Echo, cluster, "0-1")
    print(f"group launch (2 ranks): {time.perf_counter() - t0:.2f} s")

    print("\n== call latency (no-op) ==")
    g2 = time_calls(lambda: group.noop().result())
    g1 = time_calls(lambda: group.on(0).noop().result())
    a = cluster.client.submit(Echo, actor=True, workers=[cluster.slots[0].address], pure=False).result()
    b = cluster.client.submit(Echo, actor=True, workers=[cluster.slots[1].address], pure=False).result()
    d1 = time_calls(lambda: a.noop().result())
    d2 = time_calls(lambda: [f.result() for f in (a.noop(), b.noop())])
    os.environ["RLNB_DIRECT_CALLS"] = "0"  # the same group calls over Dask's comm (the tls:// route)
    over_comm = rlnb.Group.launch(Echo, cluster, "0-1", name="over_comm")
    del os.environ["RLNB_DIRECT_CALLS"]
    c1 = time_calls(lambda: over_comm.on(0).noop().result())
    pl = pipe_latency()
    pb = pipe_bytes_latency()
    print(f"rlnb group call, 2 ranks     : {pct(g2)}")
    print(f"rlnb group call, 1 rank      : {pct(g1)}")
    print(f"rlnb 1 rank over Dask comm   : {pct(c1)}")
    print(f"plain Dask actor, 1          : {pct(d1)}")
    print(f"plain Dask actors, 2 at once : {pct(d2)}")
    print(f"raw multiprocessing.Pipe     : {pct(pl)}")
    print(f"raw Pipe, bytes (the floor)  : {pct(pb)}")
    print(f"ratio rlnb 2-rank / raw Pipe bytes round trip (p50): {np.median(g2) / np.median(pb):.2f}")
    print(f"ratio rlnb 2-rank / plain Dask 2-at-once (p50): {np.median(g2) / np.median(d2):.2f}")
    print(
        f"ratio Dask-comm route / direct-socket route, 1 rank (p50): {np.median(c1) / np.median(g1):.2f} "
        "(a comm handler would be preferred within 1.5)"
    )

    print("\n== channel worker -> worker (same node) ==")
    for mib, n in ((1, 400), (16, 100)):
        nbytes = mib * 1024 * 1024
        items_s, gbs = channel_throughput(cluster, group, nbytes, n)
        floor = pipe_throughput(nbytes, n)
        copy = memcpy_gbs(nbytes)
        print(
            f"{mib:>2} MiB tensors: {items_s:8.1f} items/s  {gbs:5.2f} GB/s   "
            f"raw Pipe {floor:5.2f} GB/s   ratio channel/Pipe {gbs / floor:.2f}   "
            f"1-thread memcpy {copy:5.2f} GB/s   ratio channel/memcpy {gbs / copy:.2f}"
        )
        items_s, gbs = channel_throughput(cluster, group, nbytes, n, shared=True)
        print(
            f"{mib:>2} MiB built in shared memory (Channel.empty, no copy): {items_s:8.1f} items/s  "
            f"{gbs:5.2f} GB/s   ratio to memcpy {gbs / copy:.2f}"
        )
    cluster.close()


if __name__ == "__main__":
    main()

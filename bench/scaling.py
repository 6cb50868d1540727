"""How group calls and channels scale with the number of ranks, and where the driver becomes the bottleneck.

Run: ``.venv/bin/python bench/scaling.py [--ranks 2 8 32 64]`` (prints figures; not a timed test).

For each size it starts an embedded cluster of that many small CPU worker processes and measures, against a
floor taken in the same run:
- a no-op group call on every rank (p50), against the same number of plain Dask actor calls issued at once;
- channel fan-in (every rank puts small items into one queue, the driver drains it) and fan-out (the driver
  puts, every rank takes its own key), in items per second.
It then fits the driver's cost of one group call as ``fixed + per_rank * ranks`` and prints the rank count at
which a call would exceed a given share of a training step (see docs/benchmarks.md, "Scaling").
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import rlnb
from rlnb.demo import Echo

CALLS = 40


class Feeder(Echo):
    """Puts and takes small items on a channel (a rank's side of fan-in and fan-out)."""

    def put_many(self, channel, n: int) -> float:
        item = torch.zeros(256)  # 1 KiB
        t0 = time.perf_counter()
        for _ in range(n):
            channel.put(item, key="in")
        return time.perf_counter() - t0

    def take_many(self, channel, n: int, key: str) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            channel.get(key=key, timeout=120)
        return time.perf_counter() - t0


def p50_ms(fn, n: int = CALLS) -> tuple[float, float]:
    """Median wall time of ``fn()`` and the driver thread's median CPU time for it, in ms."""
    fn()
    wall, cpu = [], []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return float(np.median(wall)) * 1e3, float(np.median(cpu)) * 1e3


def measure(ranks: int, items_per_rank: int) -> dict:
    t0 = time.perf_counter()
    cluster = rlnb.Cluster(slots=ranks, gpus=False, timeout_s=300)
    start_s = time.perf_counter() - t0
    try:
        group = rlnb.Group.launch(Feeder, cluster, "all", name="feeder", start_timeout_s=300)
        call, call_cpu = p50_ms(lambda: group.noop().result(60))
        actors = [
            cluster.client.submit(Echo, actor=True, workers=[s.address], pure=False).result()
            for s in cluster.slots
        ]
        dask, _ = p50_ms(lambda: [f.result() for f in [a.noop() for a in actors]], n=10)

        channel = rlnb.Channel.create(cluster, "fan")
        total = ranks * items_per_rank
        t0 = time.perf_counter()
        puts = group.put_many(channel, items_per_rank)
        channel.get_batch(total, key="in", timeout=300)
        puts.result(300)
        fan_in = total / (time.perf_counter() - t0)

        t0 = time.perf_counter()
        takes = group.call_each("take_many", [(channel, items_per_rank, f"r{r}") for r in range(ranks)])
        item = torch.zeros(256)
        for _ in range(items_per_rank):
            for r in range(ranks):
                channel.put(item, key=f"r{r}")
        takes.result(300)
        fan_out = total / (time.perf_counter() - t0)
        group.shutdown()
        return {
            "ranks": ranks,
            "start_s": start_s,
            "call_ms": call,
            "call_cpu_ms": call_cpu,
            "dask_ms": dask,
            "fan_in": fan_in,
            "fan_out": fan_out,
        }
    finally:
        cluster.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 32, 64])
    parser.add_argument("--items-per-rank", type=int, default=200)
    parser.add_argument("--step-s", type=float, default=0.5, help="a training step's duration, for the model")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(
        f"{'ranks':>5} {'start':>7} {'group call':>11} {'driver CPU':>11} {'Dask actors':>12} {'ratio':>6} "
        f"{'fan-in':>10} {'fan-out':>10}"
    )
    for n in args.ranks:
        r = measure(n, args.items_per_rank)
        rows.append(r)
        print(
            f"{n:>5} {r['start_s']:>6.1f}s {r['call_ms']:>9.2f}ms {r['call_cpu_ms']:>9.2f}ms "
            f"{r['dask_ms']:>10.2f}ms {r['call_ms'] / r['dask_ms']:>6.2f} "
            f"{r['fan_in']:>7.0f}/s {r['fan_out']:>7.0f}/s",
            flush=True,
        )
        if len(rows) >= 2:  # the model so far (a later, larger size may take long on a small machine)
            model(rows, args.step_s)


def model(rows: list[dict], step_s: float) -> None:
    """Fit the driver's CPU per group call as ``fixed + per_rank * ranks`` and print where it would
    reach 1% and 10% of a training step. The driver's own work (encode once, one send and one receive per
    rank) is what grows with ranks wherever the workers run; the wall time measured here also counts
    ranks sharing this machine's few cores."""
    x = np.array([r["ranks"] for r in rows], dtype=float)
    y = np.array([r["call_cpu_ms"] for r in rows])
    per_rank, fixed = np.polyfit(x, y, 1)
    print(f"  driver CPU per group call ~ {fixed:.3f} ms + {per_rank * 1e3:.1f} us x ranks (least squares)")
    for share in (0.01, 0.1):
        limit = (share * step_s * 1e3 - fixed) / per_rank if per_rank > 0 else float("inf")
        print(
            f"  a call's driver work stays under {share:.0%} of a {step_s:g} s step up to ~{limit:,.0f} ranks"
        )


if __name__ == "__main__":
    main()

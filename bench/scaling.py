"""How group calls and channels scale with the number of ranks, and where the driver becomes the bottleneck.

Run: ``.venv/bin/python bench/scaling.py [--part ranks work] [--ranks 2 8 32 64]`` (prints figures; not a
timed test).

For each size it starts an embedded cluster of that many small CPU worker processes and measures, against a
floor taken in the same run:
- a no-op group call on every rank (p50), against the same number of plain Dask actor calls issued at once;
- channel fan-in (every rank puts small items into one queue, the driver drains it) and fan-out (the driver
  puts, every rank takes its own key), in items per second.
It then fits the driver's cost of one group call as ``fixed + per_rank * ranks`` and prints the rank count at
which a call would exceed a given share of a training step (see docs/benchmarks.md, "Scaling").

``--part work``: how a PPO step's cost grows with the work, on the default embedded cluster: ``ppo_cartpole``
(collocated, synchronous) with num_envs 8 -> 1024, policy width 64 -> 1024, and 1 -> 2 data-parallel
ranks. Each row gives the step time and its parts timed where they run (env stepping, inference, the
advantage and update compute) and the loop's own overhead, the rest, as a share of the step (target < 5%)
and of ``run()``'s wall time per step (which also holds the driver's own work between steps), then where that
overhead goes: each phase's time outside its timed work (on one slot the sync phase carries the step's one
round trip, or, where the worker ran the step ahead, its wait between the two steps). The recipe is measured
twice: as it runs, and with ``runner.run_ahead=false``. Each size is measured over at least ``--steps`` steps
and at least 3 s of them (the recipe's 13 ms steps: ~230): the median step, and the means of the parts and of
the overhead over the steps within 10 % of it (a slow moment of the VM left out). The recipe's own size runs
``--recipe-repeats`` times (3), each a fresh loop: its row is the run of median overhead, and every run's is
printed after it. It saves a plot to ``docs/img/scaling_work.png``.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

import rlnb
from rlnb.demo import Echo
from rlnb.metrics import WORK_IN_PHASE

CALLS = 40
MIN_MEASURED_S = 3.0  # --part work: each size is measured over at least this many seconds of steps
MAX_STEPS = 400


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


WORK_PARTS = tuple(  # env, inference, advantages_compute, train_compute
    key.removeprefix("time/").removesuffix("_s") for keys in WORK_IN_PHASE.values() for key in keys
)
SIZES = [  # (label, overrides): one axis grows at a time from the recipe's own size
    ("num_envs 8 (recipe)", []),
    ("recipe, no run-ahead", ["runner.run_ahead=false"]),
    ("num_envs 64", ["env.num_envs=64"]),
    ("num_envs 256", ["env.num_envs=256"]),
    ("num_envs 1024", ["env.num_envs=1024"]),
    ("width 256", ["actor.model.hidden_sizes=[256, 256]"]),
    ("width 1024", ["actor.model.hidden_sizes=[1024, 1024]"]),
    ("num_envs 64, 1 rank", ["env.num_envs=64"]),
    ("num_envs 64, 2 ranks", ["env.num_envs=64", "cluster.component_placement={'actor,rollout,env': 0-1}"]),
]


def work_row(cluster, overrides: list[str], steps: int, min_s: float = MIN_MEASURED_S) -> dict:
    """Medians over at least ``steps`` PPO steps, and at least ``min_s`` seconds of them, after three warm-up
    steps (a fresh loop's first steps fault in its memory): the step, its timed work, the overhead share."""
    import tempfile

    from rlnb.loop import Loop

    base = ["runner.tensorboard=false", "runner.stop_return=100000", "runner.eval_interval=0"]
    with (
        tempfile.TemporaryDirectory() as run_dir,
        Loop.from_recipe("ppo_cartpole", [*base, *overrides], cluster=cluster, run_dir=run_dir) as loop,
    ):
        warm = loop.run(3, progress=False)
        # a short step is measured over more of them: 8 steps of 13 ms are a tenth of a second, where one
        # slow moment of the VM moves the median (the recipe runs 390)
        steps = max(steps, min(MAX_STEPS, math.ceil(min_s / max(1e-3, warm[-1]["time/step_s"]))))
        t0 = time.perf_counter()
        records = loop.run(steps, progress=False)
        wall_s = (time.perf_counter() - t0) / steps
    step_s = np.array([r["time/step_s"] for r in records])
    row = {"step_s": float(np.median(step_s))}
    # the loop's overhead against run()'s wall time, which also holds the driver's work between steps
    work_s = np.mean([sum(r[f"time/{part}_s"] for part in WORK_PARTS) for r in records])
    row["wall_s"], row["wall_overhead_frac"] = wall_s, 1 - work_s / wall_s
    # means, not medians: steps run ahead in blocks, and the first step of a block carries the block's
    # request (a median step would leave it out); over the steps no slow moment of the VM held up (within 10 %
    # of the median step), one of which would move a mean of 230 steps by ~0.5 point
    kept = [r for r, s in zip(records, step_s) if s <= 1.1 * row["step_s"]]
    row["steps_kept"] = (len(kept), len(records))
    for part in WORK_PARTS:
        row[part] = float(np.mean([r[f"time/{part}_s"] for r in kept]))
    row["mean_step_s"] = sum(r["time/step_s"] for r in kept) / len(kept)
    row["overhead_frac"] = 1 - sum(row[part] for part in WORK_PARTS) / row["mean_step_s"]
    # where the overhead goes: each phase's time outside its timed work (the sync phase has none; on one
    # slot it carries the step's one round trip, or the worker's time between steps run ahead)
    for phase, work in WORK_IN_PHASE.items():
        row[f"{phase}_rest"] = float(np.mean([r[f"time/{phase}_s"] - sum(r[k] for k in work) for r in kept]))
    return row


def _busy_child(conn) -> None:
    """Answer each request after spinning for the seconds it names (b"" ends)."""
    while msg := conn.recv_bytes():
        end = time.perf_counter() + float(msg)
        while time.perf_counter() < end:
            pass
        conn.send_bytes(b"r")


def pipe_round_trip_around(call_s: float, n: int = 60) -> float:
    """p50 of a raw ``multiprocessing.Pipe`` round trip (bytes) around a ``call_s`` call in the other process,
    the caller asleep meanwhile: what one round trip a step costs on this machine, where waking a process that
    slept through a step costs far more than a round trip back to back."""
    import multiprocessing

    ours, theirs = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(target=_busy_child, args=(theirs,), daemon=True)
    child.start()
    try:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            ours.send_bytes(repr(call_s).encode())
            ours.recv_bytes()
            times.append(time.perf_counter() - t0 - call_s)
        return float(np.median(times))
    finally:
        ours.send_bytes(b"")
        child.join(10)


def work_scaling(steps: int, plot: str | None, recipe_repeats: int = 3) -> None:
    print(
        f"{'PPO step, ppo_cartpole':<22} {'step':>8} {'env':>8} {'inference':>9} {'GAE':>7} {'update':>8} "
        f"{'overhead':>9} {'of wall':>8} | its parts: {'sync':>7} {'rollout':>7} {'GAE':>7} {'update':>7}"
    )
    rows = []
    with rlnb.Cluster(slots=2, gpus=False) as cluster:
        for i, (label, overrides) in enumerate(SIZES):
            # the recipe's own size, where the overhead is largest, measured in several windows (a fresh loop
            # each): the row is the run of median overhead, and the line after it gives every run's
            repeats = [work_row(cluster, overrides, steps) for _ in range(recipe_repeats if i == 0 else 1)]
            r = sorted(repeats, key=lambda row: row["overhead_frac"])[len(repeats) // 2]
            rows.append((label, r))
            print(
                f"{label:<22} {r['step_s'] * 1e3:>6.1f}ms {r['env'] * 1e3:>6.1f}ms {r['inference'] * 1e3:>7.1f}ms "
                f"{r['advantages_compute'] * 1e3:>5.1f}ms {r['train_compute'] * 1e3:>6.1f}ms "
                f"{100 * r['overhead_frac']:>8.1f}% {100 * r['wall_overhead_frac']:>7.1f}% | {' ' * 11}"
                + " ".join(f"{r[f'{p}_rest'] * 1e3:>5.2f}ms" for p in WORK_IN_PHASE),
                flush=True,
            )
            if len(repeats) > 1:
                print(
                    f"{'':<22} {len(repeats)} runs: overhead "
                    + " / ".join(f"{100 * x['overhead_frac']:.1f}%" for x in repeats)
                    + ", of wall "
                    + " / ".join(f"{100 * x['wall_overhead_frac']:.1f}%" for x in repeats),
                    flush=True,
                )
    recipe_step_s = rows[0][1]["step_s"]
    floor = pipe_round_trip_around(recipe_step_s)
    by_label = dict(rows)
    print(
        f"floor of the recipe's round trip: a raw multiprocessing.Pipe round trip around a {recipe_step_s * 1e3:.1f} ms "
        f"call (the child busy, the parent asleep): p50 {floor * 1e3:.2f} ms, against 0.03-0.04 ms back to back; "
        f"the sync part without run-ahead (its round trip) is {by_label['recipe, no run-ahead']['sync_rest'] / floor:.1f}x "
        f"it; with run-ahead there is no round trip in the step: its sync part, "
        f"{by_label['num_envs 8 (recipe)']['sync_rest'] * 1e3:.2f} ms, is the worker's time between two steps "
        "(a block's request read and its reply written, shared by its steps) and the weight copy"
    )
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        labels = [label for label, _ in rows]
        bottom = np.zeros(len(rows))
        for part in WORK_PARTS:
            share = np.array([r[part] / r["mean_step_s"] for _, r in rows])
            ax.barh(labels, share, left=bottom, label=part.replace("_", " "))
            bottom += share
        # the rest of the mean step
        ax.barh(labels, np.clip(1 - bottom, 0, None), left=bottom, label="loop overhead", color="0.3")
        for y, (_, r) in enumerate(rows):
            ax.text(1.02, y, f"{r['step_s'] * 1e3:.0f} ms/step", va="center", fontsize=8)
        ax.set_xlim(0, 1.18)
        ax.invert_yaxis()
        ax.set_xlabel("share of a PPO step")
        ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=5, fontsize=8, frameon=False)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
        print(f"plot: {plot}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", nargs="+", choices=["ranks", "work"], default=["work", "ranks"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--items-per-rank", type=int, default=200)
    parser.add_argument("--step-s", type=float, default=0.5, help="a training step's duration, for the model")
    parser.add_argument(
        "--steps",
        type=int,
        default=8,
        help=f"--part work: steps measured per size, at least (and at least {MIN_MEASURED_S:g} s of them)",
    )
    parser.add_argument(
        "--plot", default="docs/img/scaling_work.png", help="--part work: where the plot goes"
    )
    parser.add_argument(
        "--recipe-repeats",
        type=int,
        default=3,
        help="--part work: runs of the recipe's own size (the median's row)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if "work" in args.part:
        work_scaling(args.steps, args.plot, args.recipe_repeats)
    if "ranks" not in args.part:
        return
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

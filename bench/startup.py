"""Start-up: how long until a loop can step, from a fresh driver process; one run.

Run: ``.venv/bin/python bench/startup.py [--runs 3]`` (prints figures; not a timed test).

Each run is a fresh Python process that imports rlnb, starts an embedded 2-slot cluster and builds the
``ppo_cartpole`` loop, as a notebook's first cells do (components launched and composed), then does it again in the same process (a
notebook restarting its cluster, or the next test). Both start methods of the workers are measured in the
same run: Dask's default (``spawn``: each worker imports torch itself) and rlnb's (a fork server that
imported torch, torch._dynamo, gymnasium and rlnb once; ``RLNB_WORKER_START``), the latter also as a
notebook uses it: ``rlnb.warm_up()`` in the import cell, the cluster 8 s later. Medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, time
t0 = time.perf_counter()
import rlnb
t1 = time.perf_counter()
out = {"import_s": t1 - t0}
if __name__ == "__main__":
    if WARM:  # a notebook: rlnb.warm_up() in the import cell, the cluster a few cells (seconds) later
        rlnb.warm_up()
        time.sleep(THINK_S)
        t0 = time.perf_counter()
    for i in (1, 2):
        t = time.perf_counter()
        cluster = rlnb.Cluster(slots=2, gpus=False)
        t_cluster = time.perf_counter()
        from rlnb.loop import Loop

        loop = Loop.from_recipe("ppo_cartpole", ["runner.tensorboard=false"], cluster=cluster, run_dir=RUN_DIR)
        t_loop = time.perf_counter()
        out[f"cluster{i}_s"], out[f"loop{i}_s"] = t_cluster - t, t_loop - t_cluster
        out[f"total{i}_s"] = t_loop - (t0 if i == 1 else t)  # the first from the process's first line
        loop.close()
        cluster.close()
    print("RESULT " + json.dumps(out))
"""


THINK_S = 8.0  # +warm_up: seconds between the notebook's import cell and its cluster cell


def one_run(method: str, run_dir: str) -> dict:
    warm = method.endswith("+warm_up")
    env = {**os.environ, "RLNB_WORKER_START": method.removesuffix("+warm_up")}
    code = (
        CHILD.replace("RUN_DIR", repr(run_dir)).replace("WARM", repr(warm)).replace("THINK_S", repr(THINK_S))
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the start-up run failed:\n{proc.stderr[-2000:]}")
    return json.loads(line[len("RESULT ") :])


def main():
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    results = {"spawn": [], "forkserver": [], "forkserver+warm_up": []}
    with tempfile.TemporaryDirectory() as run_dir:
        for _ in range(args.runs):  # interleaved, so drift hits both alike
            for method in results:
                results[method].append(one_run(method, run_dir))
    print(f"{'workers start by':<18} {'import rlnb':>12} {'1st cluster':>12} {'1st loop':>9} {'1st total*':>10} "
          f"{'2nd cluster':>12} {'2nd loop':>9} {'2nd total':>10}")  # fmt: skip
    for method, runs in results.items():

        def med(key, runs=runs):
            return statistics.median(r[key] for r in runs)

        first = statistics.median(r["total1_s"] for r in runs)
        second = statistics.median(r["cluster2_s"] + r["loop2_s"] for r in runs)
        print(
            f"{method:<18} {med('import_s'):>10.2f} s {med('cluster1_s'):>10.2f} s {med('loop1_s'):>7.2f} s "
            f"{first:>8.2f} s {med('cluster2_s'):>10.2f} s {med('loop2_s'):>7.2f} s {second:>8.2f} s"
        )
    print(
        "* from the process's first line: import rlnb, the cluster, the loop; for +warm_up, from the "
        f"`rlnb.Cluster()` call, {THINK_S:g} s after `rlnb.warm_up()` (a notebook's import cell)"
    )
    with tempfile.TemporaryDirectory() as run_dir:
        runs = [whole_process(f"{run_dir}/{i}") for i in range(args.runs)]
    ours, floor = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    print(
        f"`rlnb run ppo_cartpole runner.steps=1`, whole process: {ours:.2f} s; floor (a process importing torch "
        f"and gymnasium): {floor:.2f} s -> ratio {ours / floor:.2f}"
    )


def whole_process(run_dir: str) -> tuple[float, float]:
    """Wall time of ``rlnb run ppo_cartpole runner.steps=1`` as a fresh process, and of the floor: a fresh
    process importing what a worker needs (torch, gymnasium), which one core must do."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, gymnasium"], check=True)
    floor = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "rlnb.cli", "run", "ppo_cartpole", "runner.steps=1", "runner.tensorboard=false",
         "runner.eval_episodes=1", "--run-dir", run_dir, "--no-progress"],
        check=True, capture_output=True,
    )  # fmt: skip
    return time.perf_counter() - t0, floor


if __name__ == "__main__":
    main()

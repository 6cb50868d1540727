"""Asynchronous PPO (``algorithm.max_staleness``) against synchronous training, same recipe, one run.

Run: ``.venv/bin/python bench/async_vs_sync.py [--seeds 1 2 3]`` (prints figures; not a timed test).

Settings, each on the same 2-slot embedded cluster, to CartPole's solved mark (mean return of the last 20
training episodes >= 475):
- synchronous, env and rollout on slot 0 and the actor on slot 1 (the placement asynchrony needs);
- synchronous, everything on slot 0 (the best synchronous placement on this machine: no transfers);
- asynchronous with N = 1, 2, 4 on the apart placement.
For each: median wall-clock to the mark (loop only, cluster already up), steps, env steps/s, the final
return, and the ratio to each synchronous baseline.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import rlnb
from rlnb.loop import Loop

APART = "cluster.component_placement={'env,rollout': 0, actor: 1}"
TOGETHER = "cluster.component_placement={'actor,rollout,env': 0}"
SETTINGS = {
    "sync, apart": [APART, "algorithm.max_staleness=0"],
    "sync, collocated": [TOGETHER, "algorithm.max_staleness=0"],
    "async N=1": [APART, "algorithm.max_staleness=1"],
    "async N=2": [APART, "algorithm.max_staleness=2"],
    "async N=4": [APART, "algorithm.max_staleness=4"],
}


def one_run(cluster, overrides: list[str], seed: int) -> dict:
    base = ["runner.tensorboard=false", "runner.stop_return=475", f"seed={seed}"]
    with (
        tempfile.TemporaryDirectory() as run_dir,
        Loop.from_recipe("ppo_cartpole", [*base, *overrides], cluster=cluster, run_dir=run_dir) as loop,
    ):
        t0 = time.perf_counter()
        loop.run(progress=False)
        wall = time.perf_counter() - t0
        return {
            "wall_s": wall,
            "steps": loop.step,
            "env_steps_per_s": loop.global_step / wall,
            "return": loop.episode_stats()["episode_return_mean"] or 0.0,
            "solved": loop._solved(),
        }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    with rlnb.Cluster(slots=2, gpus=False) as cluster:
        for seed in args.seeds:  # interleaved, so drift over the run hits every setting alike
            for name, overrides in SETTINGS.items():
                results[name].append(one_run(cluster, overrides, seed))
    med = {n: statistics.median(r["wall_s"] for r in rs) for n, rs in results.items()}
    print(f"{'setting':<18} {'wall to 475':>12} {'steps':>6} {'env steps/s':>12} {'return':>7} {'solved':>7} "
          f"{'vs sync apart':>14} {'vs sync collocated':>19}")  # fmt: skip
    for name, rs in results.items():
        print(
            f"{name:<18} {med[name]:>10.1f} s {statistics.median(r['steps'] for r in rs):>6.0f} "
            f"{statistics.median(r['env_steps_per_s'] for r in rs):>12.0f} "
            f"{statistics.median(r['return'] for r in rs):>7.1f} {sum(r['solved'] for r in rs)}/{len(rs):<5} "
            f"{med['sync, apart'] / med[name]:>13.2f}x {med['sync, collocated'] / med[name]:>18.2f}x"
        )


if __name__ == "__main__":
    main()

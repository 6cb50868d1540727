"""Compiled train steps (``actor.compile``) against eager ones, on the actor's worker; one run.

Run: ``.venv/bin/python bench/compile.py [--recipe ppo_cartpole] [--steps 60] [--set KEY=VALUE ...]`` (prints
figures; not a timed test). A sharded LM actor, whose decoder layers compile one by one::

    .venv/bin/python bench/compile.py --recipe grpo_arith --steps 12 --set actor.strategy=fsdp2 \
        actor.tiny_lm.hidden_size=256 actor.tiny_lm.num_layers=4 runner.eval_interval=0 actor.sft_steps=0 \
        "cluster.component_placement={'rollout,reward': 0, actor: 0-1}"

Three runs of the same recipe, each on a fresh 2-slot embedded cluster (fresh worker processes, so
nothing compiled stays in memory between runs):
- eager (``actor.compile=false``);
- compiled with an empty kernel cache (a first run);
- compiled again with the cache the previous run filled (a second run of the same recipe).
For each: compile time (``time/compile_s``), the median train phase per step (compile excluded), the
loop's wall-clock for ``--steps`` steps, and ratios to eager. ``AUTO`` in ``rlnb/components/compile.py``
is set from these figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import rlnb
from rlnb.config import load_recipe
from rlnb.loop import loop_class


def one_run(recipe: str, compile_: str, steps: int, cache: str, extra: list[str]) -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # the workers inherit it
    with (
        tempfile.TemporaryDirectory() as run_dir,
        rlnb.Cluster(slots=2, gpus=False) as cluster,
        loop_class(load_recipe(recipe)).from_recipe(
            recipe, ["runner.tensorboard=false", f"actor.compile={compile_}", f"runner.steps={steps}", *extra],
            cluster=cluster, run_dir=run_dir,
        ) as loop,
    ):  # fmt: skip
        t0 = time.perf_counter()
        records = loop.run(progress=False)
        wall = time.perf_counter() - t0
        trained = [r for r in records if "time/train_s" in r]
        episodes = getattr(loop, "episode_stats", None)  # (an env loop's; an LM loop has none)
        return {
            "compile_s": trained[0].get("time/compile_s", 0.0),
            # (a later step that compiles again, for a new shape, shows in the loop's wall-clock, not here)
            "train_s": statistics.median(r["time/train_s"] for r in trained[1:]),
            "wall_s": wall,
            "return": (episodes()["episode_return_mean"] or 0.0) if episodes else float("nan"),
        }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="ppo_cartpole")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--set", nargs="*", default=[], help="more recipe overrides, KEY=VALUE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        runs = {
            "eager": one_run(args.recipe, "false", args.steps, cache, args.set),
            "compiled, cold cache": one_run(args.recipe, "true", args.steps, cache, args.set),
            "compiled, warm cache": one_run(args.recipe, "true", args.steps, cache, args.set),
        }
    eager = runs["eager"]
    print(f"{args.recipe}, {args.steps} steps; train step = the train phase of one step (compile excluded)")
    print(
        f"{'run':<22} {'compile':>9} {'train step':>11} {'vs eager':>9} {'loop wall':>10} {'vs eager':>9} {'return':>7}"
    )
    for name, r in runs.items():
        print(
            f"{name:<22} {r['compile_s']:>7.1f} s {r['train_s'] * 1e3:>8.1f} ms {eager['train_s'] / r['train_s']:>8.2f}x "
            f"{r['wall_s']:>8.1f} s {eager['wall_s'] / r['wall_s']:>8.2f}x {r['return']:>7.1f}"
        )


if __name__ == "__main__":
    main()

"""PPO on CartPole-v1: wall-clock time-to-solve, rlnb vs Stable-Baselines3, measured in one run.

Goal for both: mean return of the last 20 training episodes >= 475. SB3 uses RL Zoo's tuned
CartPole-v1 hyperparameters; rlnb uses ``recipes/ppo_cartpole.yaml`` with its default placement on
the default embedded cluster. Time-to-solve counts from the first training step; cluster and
component start-up are reported apart. Then end to end: the whole-process wall time of
``rlnb run ppo_cartpole`` and of a script doing the same with SB3 (imports included), each a fresh
process per seed. Also prints the pipelining gain (env ``pipeline_stages=2`` vs 1) on an env whose step
costs ~1 ms.

Run: ``.venv/bin/python bench/ppo_vs_sb3.py [--seeds 3]`` (needs ``pip install stable-baselines3``).
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

GOAL = 475.0


def sb3_time_to_solve(seed: int) -> tuple[float, int]:
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.utils import get_linear_fn

    class Solved(BaseCallback):
        def _on_step(self) -> bool:
            buf = list(self.model.ep_info_buffer)[-20:]
            return not (len(buf) == 20 and np.mean([e["r"] for e in buf]) >= GOAL)

    env = make_vec_env("CartPole-v1", n_envs=8, seed=seed)
    model = PPO(  # RL Zoo hyperparameters for CartPole-v1
        "MlpPolicy", env, n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20, ent_coef=0.0,
        learning_rate=get_linear_fn(1e-3, 0, 1.0), clip_range=get_linear_fn(0.2, 0, 1.0), seed=seed, device="cpu",
    )  # fmt: skip
    t0 = time.perf_counter()
    model.learn(100_000, callback=Solved())
    return time.perf_counter() - t0, model.num_timesteps


def rlnb_time_to_solve(seed: int) -> tuple[float, int, float, bool]:
    from rlnb.loop import Loop

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        loop = Loop.from_recipe("ppo_cartpole", [f"seed={seed}", "runner.tensorboard=false"], run_dir=d)
        startup = time.perf_counter() - t0
        try:
            t1 = time.perf_counter()
            loop.run(progress=False)
            dt = time.perf_counter() - t1
            solved = (loop.episode_stats()["episode_return_mean"] or 0) >= GOAL
            return dt, loop.global_step, startup, solved
        finally:
            loop.close()


SB3_SCRIPT = """
import sys, time
import numpy as np
GOAL = 475.0
{fn}
print(sb3_time_to_solve(int(sys.argv[1])))
"""


def end_to_end(seed: int) -> tuple[float, float]:
    """Whole-process wall time (imports, start-up, training, exit) of ``rlnb run`` and of the SB3 script."""
    code = SB3_SCRIPT.format(fn=inspect.getsource(sb3_time_to_solve))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, str(seed)], check=True, capture_output=True)
    sb3 = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "rlnb.cli", "run", "ppo_cartpole", f"seed={seed}", "runner.tensorboard=false",
             "--run-dir", d],
            check=True, capture_output=True,
        )  # fmt: skip
        ours = time.perf_counter() - t0
    return sb3, ours


def pipelining_gain(hidden: tuple[int, ...], steps: int = 4) -> tuple[float, float]:
    """Env steps/s of the rollout phase, env on its own slot, with 1 and 2 pipeline stages."""
    import rlnb
    from rlnb.loop import Loop

    rates = []
    with rlnb.Cluster(slots=2, gpus=False) as cluster:
        for stages in (1, 2):
            overrides = [
                "env.id=rlnb/SlowCartPole-v1", "env.kwargs={step_cost_ms: 1.0}", "env.num_envs=8",
                f"env.pipeline_stages={stages}", "rollout.steps_per_rollout=32", "runner.tensorboard=false",
                f"actor.model.hidden_sizes={list(hidden)}", "cluster.component_placement={'actor,rollout': 0, env: 1}",
            ]  # fmt: skip
            with (
                tempfile.TemporaryDirectory() as d,
                Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=d) as loop,
            ):
                loop.run(1, progress=False)  # warm-up
                recs = loop.run(steps, progress=False)
                rates.append(statistics.median(r["rollout/steps_per_s"] for r in recs))
    return rates[0], rates[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    # SB3 makes a log directory in /tmp for each model (empty, with verbose=0) and leaves it: here, in one
    # removed at the end (its scripts' processes inherit the setting)
    with tempfile.TemporaryDirectory() as sb3_logs:
        os.environ["SB3_LOGDIR"] = sb3_logs
        compare(args.seeds)


def compare(seeds: int) -> None:
    sb3, ours = [], []
    for seed in range(1, seeds + 1):
        t, n = sb3_time_to_solve(seed)
        sb3.append((t, n))
        print(f"seed {seed}: SB3  {t:6.2f} s  {n:6d} env steps  ({n / t:7.0f} steps/s)", flush=True)
        t, n, startup, solved = rlnb_time_to_solve(seed)
        ours.append((t, n, startup, solved))
        print(
            f"seed {seed}: rlnb {t:6.2f} s  {n:6d} env steps  ({n / t:7.0f} steps/s)  start-up {startup:.2f} s  solved={solved}",
            flush=True,
        )
    sb3_t = statistics.median(t for t, _ in sb3)
    our_t = statistics.median(t for t, *_ in ours)
    print(
        f"\nmedian time-to-solve: SB3 {sb3_t:.2f} s, rlnb {our_t:.2f} s  ->  ratio rlnb/SB3 = {our_t / sb3_t:.2f}"
    )
    print(
        f"median env steps/s: SB3 {statistics.median(n / t for t, n in sb3):.0f}, rlnb {statistics.median(n / t for t, n, *_ in ours):.0f}"
    )
    print(f"rlnb start-up (cluster + components, median): {statistics.median(s for *_, s, _ in ours):.2f} s")
    whole = [end_to_end(seed) for seed in range(1, seeds + 1)]
    sb3_e, ours_e = statistics.median(w[0] for w in whole), statistics.median(w[1] for w in whole)
    print(
        f"end to end, fresh process each (imports, start-up, training, exit), median: SB3 script {sb3_e:.2f} s, "
        f"`rlnb run ppo_cartpole` {ours_e:.2f} s  ->  ratio {ours_e / sb3_e:.2f}"
    )
    print("\npipelining (8 envs, env step ~1 ms each, env on its own slot):")
    for hidden in ((64, 64), (1024, 1024)):
        one, two = pipelining_gain(hidden)
        print(
            f"  MLP {hidden}: 1 stage {one:.0f} steps/s, 2 stages {two:.0f} steps/s -> gain {two / one:.2f}x"
        )


if __name__ == "__main__":
    main()

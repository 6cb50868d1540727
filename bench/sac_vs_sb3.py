"""SAC on Pendulum-v1: rlnb's SAC against Stable-Baselines3's SAC, the same env-step budget and SB3's default
hyperparameters (lr 3e-4, batch 256, [256, 256] networks, tau 0.005, gamma 0.99, entropy tuned towards -dim(A), one
gradient step an env step, one env), measured in one run. Both warm up on 256 random steps (SB3's default is 100,
and rlnb refuses a batch larger than its warm-up, which SB3 samples with replacement).

rlnb runs twice: ``apart``, its SAC family with collectors and learner apart on 2 slots (``rlnb.SACLoop``, the
collectors one batch of 50 steps ahead of the learner, weights synced every 50 updates), and ``inproc``, its buffer
and learner stepped in one process as CleanRL's ``sac_continuous_action.py`` steps its own. Printed: the final
return of each (the deterministic policy on the same 10 episodes, mean over seeds), and each one's wall time
against SB3's (from building it to the end of training; ``apart``'s includes starting its cluster, shown apart).
SB3 and ``inproc`` train with ``--threads`` torch threads (default torch's own: the cores); ``apart``'s learner
with ``--learner-threads`` (default 2: the learner is the bottleneck, and one Pendulum collector needs little of the
other core). rlnb's sides run ``--kernel`` (default ``fused``, the
recipe's: the same update with its gradients written out; ``autograd`` is the readable one).

Run: ``.venv/bin/python bench/sac_vs_sb3.py [--steps 10000] [--seeds 3]`` (needs ``pip install
stable-baselines3``: the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import statistics
import time

import gymnasium as gym
import numpy as np
import torch

ENV = "Pendulum-v1"
LEARNING_STARTS = 256  # (see the docstring)
CHUNK = 50  # the family's env steps a loop step: weights to the collectors every CHUNK updates


def evaluate(act, seed: int, episodes: int = 10) -> float:
    env = gym.make(ENV)
    returns = []
    for i in range(episodes):
        obs, _ = env.reset(seed=10_000 + seed * 100 + i)
        done, ret = False, 0.0
        while not done:
            obs, r, term, trunc, _ = env.step(act(obs))
            ret += float(r)
            done = term or trunc
        returns.append(ret)
    return float(np.mean(returns))


def rlnb_inproc(steps: int, seed: int, threads: int, args) -> tuple[float, float, float]:
    from rlnb.components.replay import ReplayBuffer
    from rlnb.components.sac import SACLearner

    env = gym.make(ENV)
    t0 = time.perf_counter()
    learner = SACLearner(
        env.observation_space, env.action_space, seed=seed, torch_threads=threads, kernel=args.kernel
    )
    buf = ReplayBuffer(env.observation_space, env.action_space, capacity=steps, seed=seed)
    obs, _ = env.reset(seed=seed)
    env.action_space.seed(seed)
    for t in range(steps):
        a = env.action_space.sample() if t < LEARNING_STARTS else learner.act(obs[None])[0]
        nxt, r, term, trunc, _ = env.step(a)
        buf.add(obs[None], a[None], [r], [term], [trunc], nxt[None])
        obs = env.reset()[0] if term or trunc else nxt
        if t >= LEARNING_STARTS:
            learner.update(buf.sample(256))
    wall = time.perf_counter() - t0
    return evaluate(lambda o: learner.act(o[None], deterministic=True)[0], seed), wall, 0.0


def rlnb_apart(steps: int, seed: int, threads: int, args) -> tuple[float, float, float]:
    """The SAC family on 2 slots: env and collector on one, buffer and learner on the other (the learner on
    ``--learner-threads`` threads: two made the whole run 0.79x as long as one did, docs/benchmarks.md)."""
    import tempfile

    import rlnb

    overrides = [
        f"seed={seed + 1}", f"runner.steps={steps // CHUNK}", "runner.eval_interval=0", "runner.stop_return=null",
        "runner.tensorboard=false", "sac.lr=0.0003", "sac.hidden_sizes=[256,256]", "sac.batch_size=256",
        f"sac.learning_starts={LEARNING_STARTS}", f"buffer.capacity={steps}", "env.num_envs=1",
        f"rollout.steps_per_rollout={CHUNK}", "algorithm.max_staleness=1",
        f"actor.torch_threads={args.learner_threads}", f"sac.kernel={args.kernel}",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as run_dir:
        t0 = time.perf_counter()
        with rlnb.SACLoop.from_recipe("sac_pendulum", [*overrides, f"runner.run_dir={run_dir}/run"]) as loop:
            start_s = time.perf_counter() - t0
            loop.run(progress=False)
            wall = time.perf_counter() - t0
            learner = loop.groups["actor"].on(0)
            ret = evaluate(lambda o: learner.act(o[None], True).result()[0][0], seed)
    return ret, wall, start_s


def sb3_sac(steps: int, seed: int, threads: int, args) -> tuple[float, float, float]:
    from stable_baselines3 import SAC

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = SAC(
        "MlpPolicy", gym.make(ENV), seed=seed, learning_starts=LEARNING_STARTS, device="cpu", verbose=0
    )
    model.learn(total_timesteps=steps)
    wall = time.perf_counter() - t0
    return evaluate(lambda o: model.predict(o, deterministic=True)[0], seed), wall, 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10_000, help="env steps for each (default 10,000)")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    p.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch threads of each learner"
    )
    p.add_argument(
        "--kernel", choices=("fused", "autograd"), default="fused", help="rlnb's update (sac.kernel)"
    )
    p.add_argument("--learner-threads", type=int, default=2, help="torch threads of apart's learner")
    p.add_argument(
        "--sides",
        default="apart,inproc",
        help="rlnb's sides to run beside SB3: apart, inproc or both (default)",
    )
    args = p.parse_args()
    ours = {"apart": rlnb_apart, "inproc": rlnb_inproc}
    picked = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not picked or set(picked) - set(ours):
        p.error(f"--sides: expected a comma-separated choice of {sorted(ours)}, got {args.sides!r}")
    sides = (("sb3", sb3_sac), *((name, ours[name]) for name in picked))
    rows: dict[str, list] = {name: [] for name, _ in sides}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for name, fn in sides:  # (alternating: drift falls on every side)
            ret, wall, start_s = fn(args.steps, seed, args.threads, args)
            rows[name].append((ret, wall, start_s))
            print(f"seed {seed} {name:6s} final return {ret:8.1f}  wall {wall:6.1f} s (start-up {start_s:.1f} s)",
                  flush=True)  # fmt: skip
    ret = {k: statistics.mean(r for r, _, _ in v) for k, v in rows.items()}
    wall = {k: statistics.mean(w for _, w, _ in v) for k, v in rows.items()}
    start = statistics.mean(s for _, _, s in rows["apart"]) if "apart" in rows else 0.0
    print(f"{args.steps} env steps, {args.seeds} seed(s), {args.threads} torch thread(s) each (apart's learner "
          f"{args.learner_threads}), sac.kernel={args.kernel}")  # fmt: skip
    for name in picked:
        # returns are negative on Pendulum: within 10% of SB3's
        close = abs(ret[name] - ret["sb3"]) <= 0.1 * abs(ret["sb3"])
        print(f"rlnb {name:6s}: final return {ret[name]:.1f} (SB3 {ret['sb3']:.1f}; within 10%: {close}); wall "
              f"{wall[name]:.1f} s, rlnb/SB3 = {wall[name] / wall['sb3']:.2f}"
              + (f" ({(wall[name] - start) / wall['sb3']:.2f} without the cluster's start-up)" if name == "apart" else ""))  # fmt: skip


if __name__ == "__main__":
    main()

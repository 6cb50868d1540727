"""SAC on Pendulum-v1: rlnb's SAC parts against Stable-Baselines3's SAC, the same env-step budget and SB3's default
hyperparameters (lr 3e-4, batch 256, [256, 256] networks, tau 0.005, gamma 0.99, entropy tuned towards -dim(A),
100 random steps first, one gradient step an env step), measured in one run.

rlnb's side is its replay buffer (:class:`rlnb.components.replay.ReplayBuffer`) and learner
(:class:`rlnb.components.sac.SACLearner`) stepped in one process, as CleanRL's ``sac_continuous_action.py`` steps
its own; collectors and learner apart on two slots come with SAC's family. Printed: the final return of each
(the deterministic policy, 10 episodes, mean over seeds), rlnb / SB3, and the wall time ratio.

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
LEARNING_STARTS = 100  # SB3's default


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


def rlnb_sac(steps: int, seed: int) -> tuple[float, float]:
    from rlnb.components.replay import ReplayBuffer
    from rlnb.components.sac import SACLearner

    env = gym.make(ENV)
    t0 = time.perf_counter()
    learner = SACLearner(env.observation_space, env.action_space, seed=seed, torch_threads=1)
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
    return evaluate(lambda o: learner.act(o[None], deterministic=True)[0], seed), wall


def sb3_sac(steps: int, seed: int) -> tuple[float, float]:
    from stable_baselines3 import SAC

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model = SAC(
        "MlpPolicy", gym.make(ENV), seed=seed, learning_starts=LEARNING_STARTS, device="cpu", verbose=0
    )
    model.learn(total_timesteps=steps)
    wall = time.perf_counter() - t0
    return evaluate(lambda o: model.predict(o, deterministic=True)[0], seed), wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10_000, help="env steps for each (default 10,000)")
    p.add_argument("--seeds", type=int, default=1)
    args = p.parse_args()
    rows = {"rlnb": [], "sb3": []}
    for seed in range(args.seeds):
        for name, fn in (("sb3", sb3_sac), ("rlnb", rlnb_sac)):  # (alternating: drift falls on both)
            ret, wall = fn(args.steps, seed)
            rows[name].append((ret, wall))
            print(f"seed {seed} {name:5s} final return {ret:8.1f}  wall {wall:6.1f} s", flush=True)
    ret = {k: statistics.mean(r for r, _ in v) for k, v in rows.items()}
    wall = {k: statistics.mean(w for _, w in v) for k, v in rows.items()}
    # returns are negative on Pendulum: the ratio of the costs (-return), lower is better
    print(f"final return: rlnb {ret['rlnb']:.1f}, SB3 {ret['sb3']:.1f}; cost ratio rlnb/SB3 = "
          f"{ret['rlnb'] / ret['sb3']:.2f} (within 10%: {abs(ret['rlnb'] - ret['sb3']) <= 0.1 * abs(ret['sb3'])})")  # fmt: skip
    print(
        f"wall time: rlnb {wall['rlnb']:.1f} s, SB3 {wall['sb3']:.1f} s; rlnb/SB3 = {wall['rlnb'] / wall['sb3']:.2f}"
    )


if __name__ == "__main__":
    main()

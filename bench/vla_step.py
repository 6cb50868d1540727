"""The tiny VLA's PPO step: rlnb's loop against a plain loop on the same model and batch, and the env's pipelining.

1. **Overhead.** The same work both ways: ``env.num_envs`` PixelReach envs stepped ``rollout.steps_per_rollout``
   times with the VLA sampling an action token a step, then PPO's update (GAE, ``update_epochs`` passes of
   ``num_minibatches`` minibatches, the clipped loss, Adam). rlnb: ``vla_pixelreach`` on the embedded cluster,
   collocated on one slot, no warm start; plain: a CleanRL-shaped loop in this process (gymnasium's vector env, the
   same ``VLAPolicy`` module, hand-written GAE and loss). Printed: seconds per env step each, and rlnb's over plain
   (the goal: at most 1.10).
2. **Pipelining.** Env and VLA on separate slots (the env apart, RLinf's disaggregated placement), the env's batch in
   2 stages against 1: one stage's envs step while the VLA infers the other's actions. Printed: the rollout's time
   per step with 2 stages over 1 (below 1: the overlap pays). PixelReach steps in microseconds, so the env gives
   little to hide; ``--env-ms`` adds that much sleep to each env step (a simulator's cost) to show the overlap.

Run: ``.venv/bin/python bench/vla_step.py [--steps 8] [--env-ms 2]``. Figures: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import gymnasium as gym
import numpy as np
import torch

from rlnb.envs.pixel import PixelReach

ENVS, T, EPOCHS, MINIBATCHES, GAMMA, LAM, CLIP = 8, 16, 2, 2, 0.95, 0.9, 0.2
OVERRIDES = ["runner.tensorboard=false", "runner.eval_interval=0", "actor.warm_start.episodes=0", "seed=1"]


def rlnb_seconds_per_env_step(path: str, steps: int, cluster) -> float:
    from rlnb.loop import Loop

    overrides = [*OVERRIDES, f"actor.model.vla.path={path}"]
    with tempfile.TemporaryDirectory() as d, Loop.from_recipe("vla_pixelreach", overrides, cluster=cluster,
                                                             run_dir=d) as loop:  # fmt: skip
        loop.run(1, progress=False)  # (first-step costs out of the measure)
        t0 = time.perf_counter()
        loop.run(steps + 1, progress=False)
        return (time.perf_counter() - t0) / (steps * ENVS * T)


def plain_seconds_per_env_step(path: str, steps: int) -> float:
    from rlnb.envs.obs import PackObservation
    from rlnb.models.vla import VLAPolicy

    torch.set_num_threads(1)
    torch.manual_seed(1)
    envs = gym.vector.SyncVectorEnv(
        [lambda: PackObservation(gym.make("rlnb/PixelReach-v0"))] * ENVS,
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,  # (rlnb's: the final observation in info, stepped once)
    )
    policy = VLAPolicy(envs.single_observation_space, envs.single_action_space, path)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-4, eps=1e-5)
    g = torch.Generator().manual_seed(1)
    obs, _ = envs.reset(seed=1)
    elapsed = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        buf = {k: [] for k in ("obs", "actions", "logprobs", "values", "rewards", "dones")}
        with torch.no_grad():
            for _ in range(T):
                o = torch.as_tensor(obs)
                a, logp, v = policy.act(o, g)
                obs, r, term, trunc, info = envs.step(a.numpy())
                cut = trunc & ~term  # a truncated episode's last reward bootstraps its value (SB3's, rlnb's)
                if cut.any():
                    final = torch.as_tensor(np.stack(info["final_obs"][cut]))
                    r = r.copy()
                    r[cut] += GAMMA * policy.value(final).numpy()
                for k, x in zip(buf, (o, a, logp, v, torch.as_tensor(r, dtype=torch.float32),
                                      torch.as_tensor(term | trunc, dtype=torch.float32))):  # fmt: skip
                    buf[k].append(x)
            last = policy.value(torch.as_tensor(obs))
        b = {k: torch.stack(v) for k, v in buf.items()}  # [T, N, ...]
        adv, gae = torch.zeros(T, ENVS), torch.zeros(ENVS)
        for t in reversed(range(T)):  # GAE
            nxt = last if t == T - 1 else b["values"][t + 1]
            delta = b["rewards"][t] + GAMMA * nxt * (1 - b["dones"][t]) - b["values"][t]
            gae = delta + GAMMA * LAM * (1 - b["dones"][t]) * gae
            adv[t] = gae
        ret = adv + b["values"]
        flat = {k: v.flatten(0, 1) for k, v in {**b, "adv": adv, "ret": ret}.items()}
        n = T * ENVS
        for _ in range(EPOCHS):
            for idx in torch.randperm(n, generator=g).split(n // MINIBATCHES):
                logp, ent, v = policy(flat["obs"][idx], flat["actions"][idx])
                a = flat["adv"][idx]
                a = (a - a.mean()) / (a.std() + 1e-8)
                ratio = (logp - flat["logprobs"][idx]).exp()
                pg = torch.max(-a * ratio, -a * ratio.clamp(1 - CLIP, 1 + CLIP)).mean()
                loss = pg + 0.5 * ((v - flat["ret"][idx]) ** 2).mean() - 0.01 * ent.mean()
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 0.5)
                optimizer.step()
        if step:  # (first-step costs out of the measure)
            elapsed.append(time.perf_counter() - t0)
    envs.close()
    return sum(elapsed) / (steps * ENVS * T)


def rollout_seconds(path: str, stages: int, steps: int, env_ms: float, cluster) -> float:
    from rlnb.loop import Loop

    overrides = [*OVERRIDES, f"actor.model.vla.path={path}", f"env.pipeline_stages={stages}",
                 "cluster.component_placement={env: 0, 'actor,rollout': 1}"]  # fmt: skip
    if env_ms:
        overrides += ["env.id=vla_step:rlnb-bench/SlowPixelReach-v0", f"env.kwargs={{sleep_ms: {env_ms}}}"]
    with tempfile.TemporaryDirectory() as d, Loop.from_recipe("vla_pixelreach", overrides, cluster=cluster,
                                                             run_dir=d) as loop:  # fmt: skip
        loop.run(1, progress=False)
        loop.run(steps + 1, progress=False)
        return statistics.median(r["time/rollout_s"] for r in loop.history[-steps:] if "time/rollout_s" in r)


class SlowPixelReach(PixelReach):
    """PixelReach with a simulator's step cost (``sleep_ms`` a step)."""

    def __init__(self, sleep_ms: float = 2.0, **kwargs):
        super().__init__(**kwargs)
        self.sleep_s = sleep_ms / 1000

    def step(self, action):
        time.sleep(self.sleep_s)
        return super().step(action)


# (env.id=vla_step:rlnb-bench/SlowPixelReach-v0: the env's workers import this module, which registers it)
if "rlnb-bench/SlowPixelReach-v0" not in gym.registry:
    gym.register("rlnb-bench/SlowPixelReach-v0", entry_point=SlowPixelReach, max_episode_steps=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="PPO steps measured (after one not measured)")
    parser.add_argument("--env-ms", type=float, default=2.0, help="sleep added to each env step for part 2")
    args = parser.parse_args()
    import rlnb
    from rlnb.models.vla import build_tiny_vla

    with tempfile.TemporaryDirectory() as d:
        path = str(build_tiny_vla(f"{d}/vla", image_size=20, patch_size=4, seed=1))
        plain = plain_seconds_per_env_step(path, args.steps)
        with rlnb.Cluster(slots=2, gpus=False) as cluster:
            ours = rlnb_seconds_per_env_step(path, args.steps, cluster)
            print(f"VLA PPO step, {ENVS} envs x {T} steps, {EPOCHS} epochs x {MINIBATCHES} minibatches:")
            print(f"  plain loop {plain * 1e3:.2f} ms/env step, rlnb {ours * 1e3:.2f} ms/env step: "
                  f"rlnb/plain = {ours / plain:.2f} (goal <= 1.10)")  # fmt: skip
            one = rollout_seconds(path, 1, args.steps, args.env_ms, cluster)
            two = rollout_seconds(path, 2, args.steps, args.env_ms, cluster)
            print(f"env apart ({args.env_ms:g} ms a step), rollout per step: 1 stage {one:.2f} s, 2 stages {two:.2f} s: "
                  f"2 stages / 1 = {two / one:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()

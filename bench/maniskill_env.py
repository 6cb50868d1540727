"""Env steps a second of rlnb's ManiSkill env rank against ManiSkill's own CPU vector env, in the same run.

Run: ``.venv/bin/python bench/maniskill_env.py [--task PickCube-v1] [--envs 2] [--steps 200] [--obs-modes state rgb]``
(prints a table; not a timed test). Needs the ``maniskill`` extra and a Vulkan driver SAPIEN accepts (here Mesa's
software one: ``make setup-system``).

ManiSkill's CPU simulation holds one env in a process, so on CPUs both sides step ``--envs`` processes:

- ``maniskill``: the peer, as ManiSkill's docs build CPU envs: ``gymnasium.vector.AsyncVectorEnv`` over
  ``CPUGymWrapper(gym.make(task, num_envs=1, ...))`` (with ``FlattenRGBDObservationWrapper`` for images);
- ``rlnb``: :class:`rlnb.Env` with ``env.kwargs.sim_backend=physx_cpu`` and ``env.vector_mode=async``: the same
  processes, plus dict observations packed into one row, episode statistics and success counts.

Random actions, the same seeds; each side steps ``--steps`` times after a warm-up of 10. The ratio is rlnb's
steps a second over ManiSkill's (1.0: no overhead).
"""

from __future__ import annotations

import argparse
import functools
import time

import gymnasium as gym


def _maniskill_env(task: str, obs_mode: str, camera_px: int):
    import mani_skill.envs  # noqa: F401  (registers the tasks)
    from mani_skill.utils.wrappers.flatten import FlattenRGBDObservationWrapper
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    if obs_mode == "state":
        return CPUGymWrapper(gym.make(task, num_envs=1, obs_mode="state", render_backend="none"))
    env = gym.make(task, num_envs=1, obs_mode="rgb", sensor_configs={"width": camera_px, "height": camera_px})
    return CPUGymWrapper(
        FlattenRGBDObservationWrapper(env, rgb=True, depth=False, state=obs_mode == "rgb+state")
    )


def peer_steps_per_s(task: str, obs_mode: str, n: int, steps: int, camera_px: int) -> float:
    fns = [functools.partial(_maniskill_env, task, obs_mode, camera_px) for _ in range(n)]
    vec = gym.vector.AsyncVectorEnv(
        fns, context="forkserver", autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    try:
        vec.reset(seed=list(range(n)))
        vec.action_space.seed(0)
        for _ in range(10):
            vec.step(vec.action_space.sample())
        t0 = time.perf_counter()
        for _ in range(steps):
            vec.step(vec.action_space.sample())
        return steps * n / (time.perf_counter() - t0)
    finally:
        vec.close()


def rlnb_steps_per_s(task: str, obs_mode: str, n: int, steps: int, camera_px: int) -> float:
    from rlnb.components import Env

    kwargs = {"sim_backend": "physx_cpu", "obs_mode": obs_mode}
    if obs_mode != "state":
        kwargs["sensor_configs"] = {"width": camera_px, "height": camera_px}
    env = Env(make_env=f"maniskill:{task}", num_envs=n, vector_mode="async", kwargs=kwargs, seed=0)
    try:
        env.reset()
        space = env.envs[0].action_space
        space.seed(0)
        for _ in range(10):
            env.step(0, space.sample())
        t0 = time.perf_counter()
        for _ in range(steps):
            env.step(0, space.sample())
        return steps * n / (time.perf_counter() - t0)
    finally:
        env.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="PickCube-v1")
    p.add_argument("--envs", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--camera-px", type=int, default=64)
    p.add_argument("--obs-modes", nargs="+", default=["state", "rgb+state"])
    a = p.parse_args()
    print(f"{a.task}, {a.envs} env processes, {a.steps} steps of random actions (camera {a.camera_px} px)")
    print(f"{'obs_mode':<10} {'ManiSkill steps/s':>18} {'rlnb steps/s':>13} {'rlnb / ManiSkill':>17}")
    for mode in a.obs_modes:
        peer = peer_steps_per_s(a.task, mode, a.envs, a.steps, a.camera_px)
        ours = rlnb_steps_per_s(a.task, mode, a.envs, a.steps, a.camera_px)
        print(f"{mode:<10} {peer:>18.1f} {ours:>13.1f} {ours / peer:>17.2f}")


if __name__ == "__main__":
    main()

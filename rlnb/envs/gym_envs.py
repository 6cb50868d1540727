"""Gymnasium vector envs with same-step autoreset, so truncated episodes can be bootstrapped."""

from __future__ import annotations

import functools
import time

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleEnv
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv


class SlowCartPole(CartPoleEnv):
    """CartPole whose step busy-waits ``step_cost_ms``: a stand-in for an expensive simulator."""

    def __init__(self, step_cost_ms: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.step_cost_s = step_cost_ms / 1000.0

    def step(self, action):
        end = time.perf_counter() + self.step_cost_s
        while time.perf_counter() < end:
            pass
        return super().step(action)


if "rlnb/SlowCartPole-v1" not in gym.registry:
    gym.register(
        "rlnb/SlowCartPole-v1", entry_point=SlowCartPole, max_episode_steps=500, reward_threshold=475.0
    )


def make_vector_env(
    env_id, num_envs: int, mode: str = "sync", kwargs: dict | None = None
) -> gym.vector.VectorEnv:
    """``num_envs`` copies of ``env_id`` in a vector env with ``AutoresetMode.SAME_STEP``.

    ``env_id`` is a registered gymnasium id, or a ``gymnasium.Env`` class or factory called with ``kwargs``.

    On the step an episode ends, the returned obs is already the reset obs and the last obs of the
    episode is in ``info["final_obs"]`` (mask ``info["_final_obs"]``). Built from picklable
    ``functools.partial`` factories, so a sync vector env can be pickled into a checkpoint.
    """
    if callable(env_id):
        fns = [functools.partial(env_id, **(kwargs or {})) for _ in range(num_envs)]
    elif env_id.startswith("maniskill:"):
        return ManiSkillVector(env_id.removeprefix("maniskill:"), num_envs, kwargs)
    else:
        fns = [functools.partial(gym.make, env_id, **(kwargs or {})) for _ in range(num_envs)]
    if mode == "sync":
        return SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
    return AsyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP, shared_memory=True)


def capture_sim_state(vec_env) -> list[dict] | None:
    """What pickling a sync vector env loses, per sub-env: the RNG of the unwrapped env and, for MuJoCo
    envs, the full physics integration state. (MuJoCo envs pickle through ``EzPickle``, i.e. they are
    rebuilt from their constructor arguments; wrappers and classic-control envs pickle their state.)"""
    envs = getattr(vec_env, "envs", None)
    if envs is None:
        return None
    out = []
    for env in envs:
        base = env.unwrapped
        rng = getattr(base, "_np_random", None)
        state: dict = {"np_random": rng.bit_generator.state if rng is not None else None}
        if (
            hasattr(base, "model")
            and hasattr(base, "data")
            and type(base.data).__module__.startswith("mujoco")
        ):
            import mujoco

            spec = mujoco.mjtState.mjSTATE_INTEGRATION
            buf = np.empty(mujoco.mj_stateSize(base.model, spec))
            mujoco.mj_getState(base.model, base.data, buf, spec)
            state["mujoco"] = buf
        out.append(state)
    return out


def restore_sim_state(vec_env, states: list[dict] | None) -> None:
    """Put back what :func:`capture_sim_state` took, into a vector env unpickled from the same checkpoint."""
    if states is None:
        return
    for env, state in zip(vec_env.envs, states):
        base = env.unwrapped
        rng = state["np_random"]
        if rng is not None:
            base._np_random = np.random.Generator(getattr(np.random, rng["bit_generator"])())
            base._np_random.bit_generator.state = rng
        if "mujoco" in state:
            import mujoco

            mujoco.mj_setState(base.model, base.data, state["mujoco"], mujoco.mjtState.mjSTATE_INTEGRATION)


class ManiSkillVector:  # pragma: no cover - needs a Vulkan-capable GPU (SAPIEN); its tests skip without one
    """A ManiSkill3 GPU-parallel task behind the same contract as our gymnasium vector envs.

    Wraps ``mani_skill.vector.wrappers.gymnasium.ManiSkillVectorEnv`` (auto reset, episode metrics)
    and converts its GPU tensors to numpy; on the step an episode ends, ``info["final_obs"]`` holds
    the batch's true next observations (ManiSkill's ``final_observation``) with mask ``_final_obs``.
    """

    def __init__(self, task: str, num_envs: int, kwargs: dict | None = None):
        import mani_skill.envs  # noqa: F401  (registers the ManiSkill tasks)
        import torch
        from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv

        kw = {
            "obs_mode": "state",
            "control_mode": "pd_joint_delta_pos",
            "sim_backend": "physx_cuda",
            **(kwargs or {}),
        }
        self._torch = torch
        self.env = ManiSkillVectorEnv(
            gym.make(task, num_envs=num_envs, **kw),
            auto_reset=True,
            ignore_terminations=False,
            record_metrics=True,
        )
        self.single_observation_space = self.env.single_observation_space
        self.single_action_space = self.env.single_action_space
        self.num_envs = num_envs

    @staticmethod
    def _np(x):
        return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)

    def reset(self, seed=None):
        obs, info = self.env.reset(seed=seed[0] if isinstance(seed, list) else seed)
        return self._np(obs), info

    def step(self, actions):
        obs, reward, terminated, truncated, info = self.env.step(
            self._torch.as_tensor(actions, device=self.env.device)
        )
        out = {}
        if "final_observation" in info:
            out["final_obs"] = self._np(info["final_observation"])
            out["_final_obs"] = self._np(info["_final_observation"])
        return self._np(obs), self._np(reward), self._np(terminated), self._np(truncated), out

    def close(self):
        self.env.close()


class RunningMeanStd:
    """Running mean/variance (parallel algorithm, Chan et al.), for observation and reward normalisation."""

    def __init__(self, shape=(), epsilon: float = 1e-4):
        self.mean = np.zeros(shape, np.float64)
        self.var = np.ones(shape, np.float64)
        self.count = epsilon

    def update(self, x: np.ndarray) -> None:
        batch_mean, batch_var, n = x.mean(axis=0), x.var(axis=0), x.shape[0]
        delta, total = batch_mean - self.mean, self.count + n
        self.mean = self.mean + delta * n / total
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.var, self.count = m2 / total, total

    def normalize(self, x: np.ndarray, clip: float = 10.0) -> np.ndarray:
        return np.clip((x - self.mean) / np.sqrt(self.var + 1e-8), -clip, clip).astype(np.float32)

"""Demonstrations for a behaviour-cloning warm start (RLinf's and SimpleVLA-RL's way to start RL from a VLA that
sometimes succeeds): episodes of an env's scripted expert, recorded as the policy sees them.

An env offers an expert with an ``expert_action()`` method on its unwrapped env (``rlnb/PixelReach-v0`` has one), or
rlnb has one for it (:mod:`rlnb.envs.experts`: ManiSkill's ``PushCube-v1``);
the observations are packed as the env component packs them (dict observations: one row of bytes each).

Shapes: ``N`` recorded steps.
"""

from __future__ import annotations

import numpy as np

from rlnb.errors import ConfigError


def collect_demos(env_id, env_kwargs: dict | None = None, episodes: int = 100, seed: int = 0,
                  key: str = "actor.warm_start.episodes") -> dict:  # fmt: skip
    """Run ``episodes`` episodes of ``env_id``'s expert (seeds ``seed``, ``seed + 1``...): ``{"obs": [N, ...],
    "actions": [N, ...], "success_rate": float, "episodes": int}``.

    Raises:
        ConfigError: naming ``key``, when the env has no expert.
    """
    import gymnasium as gym

    from rlnb.envs.experts import EXPERTS, expert_for
    from rlnb.envs.gym_envs import make_maniskill_cpu_env
    from rlnb.envs.obs import packed

    kwargs = env_kwargs or {}
    # (an env class or factory takes the kwargs as make_vector_env gives them; a ManiSkill task is made as its
    # CPU vector env makes each of its envs)
    if isinstance(env_id, str) and env_id.startswith("maniskill:"):
        env = packed(make_maniskill_cpu_env, env_id.removeprefix("maniskill:"), kwargs)
    else:
        env = packed(gym.make, env_id, **kwargs) if isinstance(env_id, str) else packed(env_id, **kwargs)
    try:
        expert = expert_for(env)
        if expert is None:
            known = ", ".join(f"{name} ({mode})" for name, (mode, _) in EXPERTS.items())
            raise ConfigError(
                f"{key}: a warm start needs the env's demonstrations, and {env_id} has no scripted expert (an "
                f"expert_action() method on its unwrapped env, or one of rlnb's for {known}); give demonstrations "
                "of your own to loop.warm_start(demos=...), or set it to 0",
                key,
            )
        obs, actions, successes = [], [], 0
        for episode in range(episodes):
            o, _ = env.reset(seed=seed + episode)
            while True:
                a = expert()
                obs.append(o)
                actions.append(a)
                o, _, terminated, truncated, info = env.step(a)
                if terminated or truncated:
                    successes += bool(info.get("is_success", info.get("success", terminated)))
                    break
    finally:
        env.close()
    return {"obs": np.stack(obs), "actions": np.asarray(actions), "success_rate": successes / max(episodes, 1),
            "episodes": episodes}  # fmt: skip


__all__ = ["collect_demos"]

"""Demonstrations for a behaviour-cloning warm start (RLinf's and SimpleVLA-RL's way to start RL from a VLA that
sometimes succeeds): episodes of an env's scripted expert, recorded as the policy sees them.

An env offers an expert with an ``expert_action()`` method on its unwrapped env (``rlnb/PixelReach-v0`` has one);
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

    from rlnb.envs.obs import packed

    kwargs = env_kwargs or {}
    # (an env class or factory takes the kwargs as make_vector_env gives them)
    env = packed(gym.make, env_id, **kwargs) if isinstance(env_id, str) else packed(env_id, **kwargs)
    try:
        expert = getattr(env.unwrapped, "expert_action", None)
        if not callable(expert):
            raise ConfigError(
                f"{key}: a warm start needs the env's demonstrations, and {env_id} has no scripted expert (an "
                "expert_action() method on its unwrapped env); give demonstrations of your own to "
                "loop.warm_start(demos=...), or set it to 0",
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

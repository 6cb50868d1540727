"""``rlnb/PixelReach-v0``: a small env with a camera image, proprioception and an instruction, made in numpy.

The agent (green) moves on a grid towards a target (red) that only the image shows: the state holds the
agent's own position, so a policy must read the pixels to succeed. It runs in microseconds a step, for the
tests, the manipulation notebook and trying a pixel policy before a simulator's minutes.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

_MOVES = np.array([[-1, 0], [1, 0], [0, -1], [0, 1]])  # up, down, left, right (row, column)


class PixelReach(gym.Env):
    """Reach the target on a ``grid x grid`` board seen by a camera of ``grid * cell_px`` pixels a side.

    Observations: ``{"rgb": H x W x 3 uint8, "state": [row, column] of the agent in [0, 1], "instruction": text}``.
    Actions: ``Discrete(4)`` (up, down, left, right). Reward 1 on reaching the target (the episode ends,
    ``info["is_success"]``), ``-step_penalty`` a step otherwise; truncated by the registration's
    ``max_episode_steps``.
    """

    metadata = {"render_modes": ["rgb_array"]}
    INSTRUCTION = "move the green square onto the red square"

    def __init__(self, grid: int = 5, cell_px: int = 4, step_penalty: float = 0.01, render_mode=None):
        if not (2 <= grid <= 32 and 1 <= cell_px <= 16):
            raise ValueError(
                f"PixelReach: expected 2 <= grid <= 32 and 1 <= cell_px <= 16, got {grid}, {cell_px}"
            )
        self.grid, self.cell_px, self.step_penalty, self.render_mode = (
            grid,
            cell_px,
            step_penalty,
            render_mode,
        )
        side = grid * cell_px
        self.observation_space = gym.spaces.Dict(
            {
                "rgb": gym.spaces.Box(0, 255, (side, side, 3), np.uint8),
                "state": gym.spaces.Box(0.0, 1.0, (2,), np.float32),
                "instruction": gym.spaces.Text(64, charset=" abcdefghijklmnopqrstuvwxyz"),
            }
        )
        self.action_space = gym.spaces.Discrete(4)
        self.agent = np.zeros(2, np.int64)
        self.target = np.zeros(2, np.int64)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.agent = self.np_random.integers(0, self.grid, 2)
        self.target = self.agent
        while (self.target == self.agent).all():
            self.target = self.np_random.integers(0, self.grid, 2)
        return self._obs(), {}

    def step(self, action):
        self.agent = np.clip(self.agent + _MOVES[int(action)], 0, self.grid - 1)
        reached = bool((self.agent == self.target).all())
        reward = 1.0 if reached else -self.step_penalty
        return self._obs(), reward, reached, False, {"is_success": reached}

    def expert_action(self) -> int:
        """A scripted expert's action (the demonstrations of a behaviour-cloning warm start): along the rows to the
        target's, then along the columns."""
        d = self.target - self.agent
        if d[0]:
            return 0 if d[0] < 0 else 1
        return 2 if d[1] < 0 else 3

    def render(self) -> np.ndarray:
        c = self.cell_px
        image = np.full((self.grid * c, self.grid * c, 3), 40, np.uint8)
        (tr, tc), (ar, ac) = self.target, self.agent
        image[tr * c : (tr + 1) * c, tc * c : (tc + 1) * c] = (220, 40, 40)
        image[ar * c : (ar + 1) * c, ac * c : (ac + 1) * c] = (40, 220, 40)
        return image

    def _obs(self) -> dict:
        state = (self.agent / max(self.grid - 1, 1)).astype(np.float32)
        return {"rgb": self.render(), "state": state, "instruction": self.INSTRUCTION}


if "rlnb/PixelReach-v0" not in gym.registry:
    gym.register("rlnb/PixelReach-v0", entry_point=PixelReach, max_episode_steps=20)

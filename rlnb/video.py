"""Episode videos: the frames of an evaluation episode written as MP4 with imageio's own ffmpeg (the ``video``
extra: ``imageio`` and ``imageio-ffmpeg``, which bundles its encoder; no system ffmpeg, no torchvision), and
shown in a notebook.

Frames are ``H x W x 3`` uint8 arrays: a dict observation's images side by side (the cameras the policy saw),
or the env's own ``render()`` for envs without images.
"""

from __future__ import annotations

import base64
import html
import os
import tempfile
from pathlib import Path

import numpy as np

MIN_SIDE_PX = (
    160  # small frames (a 20-pixel camera) are scaled up by a whole factor to at least this, to be seen
)


def _even(frame: np.ndarray) -> np.ndarray:
    """``frame`` scaled up (nearest) to at least :data:`MIN_SIDE_PX` a side and padded to even sides (H.264's
    4:2:0 colour needs them)."""
    if frame.ndim == 2:
        frame = np.repeat(frame[:, :, None], 3, axis=2)
    if frame.shape[2] == 1:
        frame = np.repeat(frame, 3, axis=2)
    frame = frame[:, :, :3]
    k = max(1, -(-MIN_SIDE_PX // min(frame.shape[:2])))
    if k > 1:
        frame = np.repeat(np.repeat(frame, k, axis=0), k, axis=1)
    h, w = frame.shape[:2]
    return np.pad(frame, ((0, h % 2), (0, w % 2), (0, 0)))


def write_mp4(frames: list[np.ndarray], path: str | os.PathLike, fps: int = 20) -> Path:
    """Write ``frames`` (``H x W x C`` uint8, the same size each) to the MP4 file ``path`` atomically (a temporary
    file beside it, then renamed); returns the path.

    Raises:
        ImportError: the ``video`` extra is not installed (``pip install 'rlnb[video]'``).
        ValueError: no frames, or frames that are not images.
    """
    try:
        import imageio.v2 as imageio
    except ImportError as e:
        raise ImportError(
            "episode videos need imageio and its ffmpeg: pip install 'rlnb[video]' (no system ffmpeg needed)"
        ) from e
    if not frames:
        raise ValueError("write_mp4: expected at least one frame, got none")
    frames = [_even(np.asarray(f, np.uint8)) for f in frames]
    if any(f.shape != frames[0].shape for f in frames):
        raise ValueError(f"write_mp4: expected frames of one size, got {sorted({f.shape for f in frames})}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".mp4", dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        with imageio.get_writer(
            tmp, fps=fps, codec="libx264", macro_block_size=1, quality=7, ffmpeg_log_level="error"
        ) as w:
            for f in frames:
                w.append_data(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class EpisodeVideo:
    """An evaluation episode's video: its MP4 file, frames, return and length; shown inline in a notebook."""

    def __init__(self, path: Path, frames: int, episode_return: float, length: int, success: bool | None):
        self.path, self.frames = Path(path), frames
        self.episode_return, self.length, self.success = episode_return, length, success

    def __repr__(self) -> str:
        said = "" if self.success is None else f", success={self.success}"
        return (
            f"EpisodeVideo({str(self.path)!r}, return={self.episode_return:.3g}, length={self.length}{said})"
        )

    def _repr_html_(self) -> str:
        data = base64.b64encode(self.path.read_bytes()).decode("ascii")
        caption = html.escape(repr(self))
        return (
            f'<figure><video controls autoplay loop muted playsinline src="data:video/mp4;base64,{data}"></video>'
            f"<figcaption><code>{caption}</code></figcaption></figure>"
        )


def episode_frames(policy, env, max_steps: int) -> tuple[list[np.ndarray], float, int, bool | None]:
    """Play one deterministic episode of ``env`` (an :class:`rlnb.Env` of one env, one stage) with ``policy``
    (a :class:`rlnb.export.TrainedPolicy`): its frames, return, length and success (``None`` where the env does
    not say), at most ``max_steps`` steps. Frames are the observation's images side by side, the episode's last
    observation included; else the env's ``render()``."""
    from rlnb.components.env import episode_success
    from rlnb.envs.obs import layout_of

    layout = layout_of(env.observation_space)
    if layout is None or not layout.images:
        return _rendered_frames(policy, env, max_steps)

    def frame(row) -> np.ndarray:
        parts = layout.unpack(np.asarray(row))
        return np.concatenate([np.asarray(parts[p.key])[:, :, :3] for p in layout.images], axis=1)

    # the vector env itself: its info has the last observation of an episode that succeeded too (dict
    # observations are never normalised, so the policy sees what the env gives)
    vec = env.envs[0]
    obs, _ = vec.reset(seed=[env.seed])
    frames, total, steps, success = [frame(obs[0])], 0.0, 0, None
    while steps < max_steps:
        obs, reward, terminated, truncated, info = vec.step(policy._act(obs, deterministic=True))
        total, steps = total + float(reward[0]), steps + 1
        if terminated[0] or truncated[0]:
            frames.append(frame(info["final_obs"][0]))
            success = episode_success(info, np.array([0]))[0]
            break
        frames.append(frame(obs[0]))
    return frames, total, steps, None if success is None else bool(success)


def _rendered_frames(policy, env, max_steps: int) -> tuple[list[np.ndarray], float, int, bool | None]:
    def frame() -> np.ndarray:
        shown = env.envs[0].render()
        return np.asarray(shown[0] if isinstance(shown, (tuple, list)) else shown)

    obs = env.reset()[0]
    env.pop_episodes()
    frames, total, steps = [frame()], 0.0, 0
    while steps < max_steps:
        out = env.step(0, policy._act(obs, deterministic=True))
        total, steps, obs = total + float(out["reward"][0]), steps + 1, out["obs"]
        if out["done"][0]:  # (the env has reset already: its frame would be the next episode's)
            break
        frames.append(frame())
    ended = env.pop_episodes()  # (its return unnormalised, whatever env.normalize_reward says)
    success = bool(ended[0][2]) if ended and len(ended[0]) > 2 else None
    return frames, (ended[0][0] if ended else total), steps, success


__all__ = ["EpisodeVideo", "episode_frames", "write_mp4"]

"""Dict observations (camera images, proprioception, a language instruction) as one array of bytes.

An env whose observation space is a ``gymnasium.spaces.Dict`` is wrapped, env by env, in
:class:`PackObservation`: each observation becomes one ``uint8`` row of :attr:`ObsLayout.nbytes` bytes, the
parts side by side (vectors as float32 first, then images, then text as UTF-8). Everything that moves
observations (vector envs and their shared memory, the rollout's buffers, channels, minibatches, checkpoints)
moves one array as before; the policy reads the parts back as views (:meth:`ObsLayout.unpack`), without a copy.

Shapes: ``B`` a batch of observations, ``H, W, C`` an image's height, width and channels.

Example:
    >>> space = gym.spaces.Dict({"state": gym.spaces.Box(-1, 1, (3,)),
    ...                          "rgb": gym.spaces.Box(0, 255, (8, 8, 3), np.uint8)})
    >>> layout = ObsLayout.of(space)
    >>> row = layout.pack(space.sample())                                # (nbytes,) uint8
    >>> sorted(layout.unpack(row[None]))                                # views, [B, ...] each
    ['rgb', 'state']
"""

from __future__ import annotations

import dataclasses

import gymnasium as gym
import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
class ObsPart:
    """One named part of a dict observation: where its bytes lie in a packed row."""

    key: str
    kind: str  # "vector" (float32), "image" (uint8, H x W x C) or "text" (UTF-8, zero-padded)
    shape: tuple[int, ...]
    offset: int  # bytes from the row's start
    nbytes: int


def _kind(space: gym.Space) -> str | None:
    if isinstance(space, gym.spaces.Text):
        return "text"
    if not isinstance(space, gym.spaces.Box):
        return None
    if (
        space.dtype == np.uint8 and len(space.shape) == 3
    ):  # channels last, as gymnasium's and ManiSkill's cameras
        return "image"
    if np.issubdtype(space.dtype, np.floating) or np.issubdtype(space.dtype, np.integer):
        return "vector" if len(space.shape) <= 1 else None
    return None


def dict_space_problem(space: gym.spaces.Dict) -> tuple[str, str, gym.Space] | None:
    """Why no built-in policy takes the dict observation ``space``: the first part that is neither a vector
    (a 1-D ``Box``), an image (a ``uint8`` ``Box`` of ``H x W x C``) nor text (``Text``), as ``(its name, what was
    expected, the part)``; ``None`` if every part is one of them."""
    if not len(space.spaces):
        return "observation_space", "a dict of at least one part", space
    for key, part in space.spaces.items():
        if _kind(part) is None:
            return (
                f"observation_space[{key!r}]",
                "a part that is a vector (a 1-D Box), an image (a uint8 Box of height x width x channels) or text "
                "(a Text space)",
                part,
            )
    return None


@dataclasses.dataclass(frozen=True)
class ObsLayout:
    """Where each part of a dict observation lies in its packed row of bytes."""

    parts: tuple[ObsPart, ...]
    nbytes: int

    @classmethod
    def of(cls, space: gym.spaces.Dict) -> ObsLayout:
        """The layout of ``space`` (refused by :func:`dict_space_problem` first): vectors first (each float32,
        4-byte aligned), then images, then texts (4 bytes a character), the row padded to a multiple of 4 bytes
        so that every vector part is an aligned float32 view in any batch."""
        problem = dict_space_problem(space)
        if problem is not None:
            which, expected, got = problem
            raise ValueError(f"{which}: expected {expected}, got {got}")
        order = {"vector": 0, "image": 1, "text": 2}
        parts, offset = [], 0
        for key, sub in sorted(space.spaces.items(), key=lambda kv: order[_kind(kv[1])]):
            kind = _kind(sub)
            if kind == "text":
                shape = (int(sub.max_length),)
                nbytes = 4 * shape[0]
            else:
                shape = tuple(int(d) for d in sub.shape) or (1,)
                nbytes = int(np.prod(shape)) * (4 if kind == "vector" else 1)
            parts.append(ObsPart(str(key), kind, shape, offset, nbytes))
            offset += nbytes
        return cls(tuple(parts), offset + (-offset) % 4)

    def part(self, key: str) -> ObsPart:
        for p in self.parts:
            if p.key == key:
                return p
        raise KeyError(f"the observation has no part {key!r}; its parts are {[p.key for p in self.parts]}")

    @property
    def images(self) -> tuple[ObsPart, ...]:
        return tuple(p for p in self.parts if p.kind == "image")

    @property
    def vectors(self) -> tuple[ObsPart, ...]:
        return tuple(p for p in self.parts if p.kind == "vector")

    @property
    def texts(self) -> tuple[ObsPart, ...]:
        return tuple(p for p in self.parts if p.kind == "text")

    def pack(self, obs: dict) -> np.ndarray:
        """One observation (a dict of its parts) as one row of ``nbytes`` bytes."""
        row = np.zeros(self.nbytes, np.uint8)
        for p in self.parts:
            value = obs[p.key]
            if p.kind == "text":
                data = str(value).encode("utf-8")[: p.nbytes]
                row[p.offset : p.offset + len(data)] = np.frombuffer(data, np.uint8)
            elif p.kind == "vector":
                row[p.offset : p.offset + p.nbytes].view(np.float32)[:] = np.asarray(
                    value, np.float32
                ).ravel()
            else:
                row[p.offset : p.offset + p.nbytes] = np.asarray(value, np.uint8).ravel()
        return row

    def batched(self, obs: dict) -> bool:
        """Whether ``obs`` (a dict of the parts) holds a batch of observations (one more dimension) or one."""
        p = next((p for p in self.parts if p.kind != "text"), None)
        if p is None:
            return not isinstance(obs[self.parts[0].key], str)
        return np.ndim(obs[p.key]) == len(p.shape) + 1

    def pack_batch(self, obs: dict) -> np.ndarray:
        """A batch of observations (a dict of ``[B, ...]`` parts, texts a list of ``B`` strings) as ``[B, nbytes]``."""
        first = obs[self.parts[0].key]
        n = len(first)
        return np.stack([self.pack({p.key: obs[p.key][i] for p in self.parts}) for i in range(n)])

    def pack_tensors(self, parts: dict) -> torch.Tensor:
        """A batch of observations given as tensors (``[B, ...]`` each, on any device: a GPU simulator's) as
        ``[B, nbytes]`` uint8 on that device, without leaving it; text parts stay empty (a batched simulator gives
        none)."""
        first = next(parts[p.key] for p in self.parts if p.kind != "text")
        n = first.shape[0]
        rows = torch.zeros((n, self.nbytes), dtype=torch.uint8, device=first.device)
        for p in self.parts:
            if (
                p.kind == "vector"
            ):  # (float32-aligned: vectors come first and the row is a multiple of 4 bytes)
                rows[:, p.offset : p.offset + p.nbytes].view(torch.float32).copy_(parts[p.key].reshape(n, -1))
            elif p.kind == "image":
                rows[:, p.offset : p.offset + p.nbytes].copy_(parts[p.key].reshape(n, -1))
        return rows

    def unpack(self, rows) -> dict:
        """The parts of packed observations ``rows`` (``[..., nbytes]``, a numpy array or a torch tensor): views
        ``[..., *shape]`` (float32 vectors, uint8 images), and for text parts the strings (nested lists shaped as the
        leading dimensions; one string for one row without them)."""
        lead = tuple(rows.shape[:-1])
        out: dict = {}
        for p in self.parts:
            raw = rows[..., p.offset : p.offset + p.nbytes]
            if p.kind == "text":
                flat = raw.reshape(-1, p.nbytes)
                flat = flat.cpu().numpy() if isinstance(flat, torch.Tensor) else np.asarray(flat)
                texts = [bytes(r).rstrip(b"\0").decode("utf-8", "ignore") for r in flat]
                out[p.key] = np.array(texts, dtype=object).reshape(lead).tolist() if lead else texts[0]
                continue
            if p.kind == "vector":
                raw = raw.view(torch.float32) if isinstance(raw, torch.Tensor) else raw.view(np.float32)
            out[p.key] = raw.reshape(*lead, *p.shape)
        return out

    def nonfinite(self, rows) -> tuple[str, int] | None:
        """The first vector part holding NaN or inf in ``rows`` (``[..., nbytes]``), and the first row (counted
        over the leading dimensions flattened) with it; ``None`` where all are finite."""
        rows = rows.detach().cpu().numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
        rows = np.ascontiguousarray(rows.reshape(-1, self.nbytes))
        for p in self.vectors:
            bad = (~np.isfinite(rows[:, p.offset : p.offset + p.nbytes].view(np.float32))).any(-1)
            if bad.any():
                return p.key, int(bad.nonzero()[0][0])
        return None


class PackedBox(gym.spaces.Box):
    """The observation space of a :class:`PackObservation` env: rows of ``layout.nbytes`` bytes, with the dict
    space they pack (``dict_space``) and its :class:`ObsLayout` (``layout``)."""

    def __init__(self, dict_space: gym.spaces.Dict, seed=None):
        self.dict_space = dict_space
        self.layout = ObsLayout.of(dict_space)
        super().__init__(0, 255, (self.layout.nbytes,), np.uint8, seed=seed)

    def sample(self, mask=None, probability=None) -> np.ndarray:
        return self.layout.pack(self.dict_space.sample())

    def __repr__(self) -> str:
        return f"PackedBox({self.dict_space})"

    def __eq__(self, other) -> bool:
        return isinstance(other, PackedBox) and other.dict_space == self.dict_space


class PackObservation(gym.ObservationWrapper):
    """An env with dict observations, seen as one with :class:`PackedBox` observations (one row of bytes)."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.observation_space = PackedBox(env.observation_space)

    def observation(self, observation: dict) -> np.ndarray:
        return self.observation_space.layout.pack(observation)


def packed(make, *args, **kwargs) -> gym.Env:
    """``make(*args, **kwargs)``, wrapped in :class:`PackObservation` where its observations are a dict that a
    policy can take (any other is left as it is, for the env component to refuse naming the part)."""
    env = make(*args, **kwargs)
    space = env.observation_space
    if isinstance(space, gym.spaces.Dict) and dict_space_problem(space) is None:
        return PackObservation(env)
    return env


def layout_of(space: gym.Space) -> ObsLayout | None:
    """The :class:`ObsLayout` of a packed observation space, ``None`` for any other."""
    return space.layout if isinstance(space, PackedBox) else None


__all__ = [
    "ObsLayout",
    "ObsPart",
    "PackObservation",
    "PackedBox",
    "dict_space_problem",
    "layout_of",
    "packed",
]

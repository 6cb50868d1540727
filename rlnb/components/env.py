"""Env component: vectorised gymnasium envs split into pipeline stages, with episode statistics.

A plain class: use it in-process, or place it with ``Env.launch(cluster, "0", ...)``.

Example:
    >>> env = Env(make_env="CartPole-v1", num_envs=4, seed=1)
    >>> obs = env.reset()[0]                         # one array per stage: (num_envs, 4)
    >>> out = env.step(0, np.zeros(4, dtype=np.int64))
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time

import numpy as np
import torch

from rlnb.components.launch import launcher
from rlnb.config.schema import EnvConfig
from rlnb.envs.groups import group_misfit
from rlnb.envs.gym_envs import (
    RunningMeanStd,
    capture_sim_state,
    make_vector_env,
    restore_sim_state,
    space_problem,
)
from rlnb.envs.obs import layout_of
from rlnb.envs.state import capture_state, restore_state
from rlnb.errors import ComponentError, ConfigError, did_you_mean
from rlnb.runtime.rank import RankInfo, current_rank
from rlnb.seeding import rank_seed

log = logging.getLogger("rlnb")


_perf_counter = time.perf_counter  # (a module global: one lookup fewer at every env step)
_FLOAT64 = np.dtype(np.float64)  # (a dtype: compared at every env step without converting np.float64 first)
_NONE_ENDED = np.zeros(0, dtype=np.int64)  # final_idx of a step that ended no episode (read-only)
_NONE_ENDED.flags.writeable = False


def _host(x, dtype=None) -> np.ndarray:
    """A host (numpy) copy of a small per-env array the env returned as a tensor (on any device) or array."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


SUCCESS_KEYS = ("is_success", "success")
"""Where an episode's success is read, in the info of its last step: gymnasium's and SB3's ``is_success``,
ManiSkill's ``success``."""


def episode_success(info, ended: np.ndarray) -> list[float | None]:
    """For the sub-envs ``ended`` whose episodes ended this step: 1.0 or 0.0 where their last step's info said
    whether they succeeded (a same-step autoreset vector env's ``info["final_info"]``), else ``None``."""
    final = info.get("final_info") if isinstance(info, dict) else None
    for key in SUCCESS_KEYS if isinstance(final, dict) else ():
        if key in final:
            values, mask = _host(final[key]), final.get(f"_{key}")
            mask = _host(mask) if mask is not None else None
            return [float(bool(values[i])) if mask is None or mask[i] else None for i in ended]
    return [None] * len(ended)


def held_steps(info, done: np.ndarray) -> np.ndarray | None:
    """``[n]`` bool: which sub-envs' steps were held after their episode's early end (their info's ``held``; an
    episode's last step's in ``info["final_info"]``, where a same-step autoreset vector env puts it), or ``None``
    where no env says (:class:`rlnb.envs.groups.GroupedEpisodes` does)."""
    if not isinstance(info, dict):
        return None
    final = info.get("final_info")
    now, last = info.get("held"), final.get("held") if isinstance(final, dict) else None
    if now is None and last is None:
        return None
    held = np.zeros(len(done), np.bool_) if now is None else _host(now, np.bool_).copy()
    if last is not None:
        held[done] = _host(last, np.bool_)[done]
    return held


def success_rate(episodes) -> float | None:
    """The share of ``episodes`` (``(return, length[, success])``, as :meth:`Env.pop_episodes` gives them) that
    succeeded, over those whose env said; ``None`` where none did."""
    successes = [e[2] for e in episodes if len(e) > 2]
    return math.fsum(successes) / len(successes) if successes else None


def _env_config(cfg, settings: dict | None = None) -> EnvConfig:
    cfg = cfg if isinstance(cfg, EnvConfig) else EnvConfig(**(cfg or {}))
    if settings:
        names = [f.name for f in dataclasses.fields(EnvConfig)]
        for key in settings:
            if key not in names:
                raise ConfigError(
                    f"env: unknown setting {key!r}; settings are fields of EnvConfig: {', '.join(names)}."
                    + did_you_mean(key, names),
                    key,
                )
        cfg = dataclasses.replace(cfg, **settings)
    if cfg.num_envs % cfg.pipeline_stages:
        raise ConfigError(
            f"env.pipeline_stages: {cfg.pipeline_stages} stages must divide env.num_envs={cfg.num_envs}",
            "pipeline_stages",
        )
    return cfg


class Env:
    """``num_envs`` environments of one rank, as ``pipeline_stages`` vector envs of equal size.

    Args:
        config: an :class:`rlnb.config.EnvConfig` (or its dict); default ``EnvConfig()``.
        seed: base seed; env ``i`` of rank ``r`` resets with ``rlnb.seeding.rank_seed(seed, r, "env") + i``.
        gamma: discount, for reward normalisation.
        group_size: ``G > 1``: episodes for embodied GRPO (:mod:`rlnb.envs.groups`): envs ``[gG, (g+1)G)`` of each
            stage start every episode from one state, and each episode lasts the env's time limit
            (``env.kwargs.max_episode_steps`` or its registration's); ``1``: episodes as the env makes them.
        make_env: a registered gymnasium id, or a ``gymnasium.Env`` class or factory (called with
            ``config.kwargs``) defined anywhere, a notebook cell included; default ``config.id``.
        **settings: any field of ``EnvConfig`` by name (``num_envs=8``, ``pipeline_stages=2``...).
    """

    launch = launcher("env")

    def __init__(
        self,
        config=None,
        seed: int = 0,
        gamma: float = 0.99,
        rank_info: RankInfo | None = None,
        *,
        make_env=None,
        group_size: int = 1,
        **settings,
    ):
        rank_info = rank_info or current_rank()  # subclasses need not pass it on
        if isinstance(make_env, str):
            settings["id"] = make_env
            make_env = None
        self.cfg = _env_config(config, settings)
        self.make_env = make_env
        self.name = rank_info.component if rank_info else "env"
        self.rank = rank_info.rank if rank_info else 0
        self.stages = self.cfg.pipeline_stages
        self.per_stage = self.cfg.num_envs // self.stages
        self.seed = rank_seed(seed, self.rank, "env")
        self.gamma = gamma
        self.group_size = group_size
        misfit = group_misfit(self.cfg.num_envs, self.stages, group_size)
        if misfit is not None:
            raise ConfigError(misfit, "num_envs")
        self.envs = self._make_envs()
        self.observation_space = self.envs[0].single_observation_space
        self.action_space = self.envs[0].single_action_space
        if make_env is not None:
            self._check_spaces()
        n = self.cfg.num_envs
        self.obs: list[np.ndarray | None] = [None] * self.stages
        self.ep_return, self.ep_len = np.zeros(n), np.zeros(n, dtype=np.int64)
        self._ones = np.ones(n, dtype=np.int64)  # (adding an array of ones takes half the time of adding 1)
        self.finished: list[tuple] = []  # episodes finished since the last pop_episodes()
        self.layout = layout_of(self.observation_space)  # dict observations: where their parts lie
        if self.layout is not None and self.cfg.normalize_obs:
            raise ConfigError(
                f"env.normalize_obs: {self.label!r} gives dict observations ({', '.join(p.key for p in self.layout.parts)}), "
                "which are not normalised: set env.normalize_obs=false (images are scaled to [0, 1] by the policy)",
                "normalize_obs",
            )
        self.obs_rms = RunningMeanStd(self.observation_space.shape) if self.cfg.normalize_obs else None
        self.obs_rms_frozen = False  # evaluation: normalise with training's statistics, unchanged
        self.ret_rms = RunningMeanStd(()) if self.cfg.normalize_reward else None
        self.disc_return = np.zeros(n)
        self._obs_shape = (self.per_stage, *(self.observation_space.shape or ()))  # a stage's observations
        self.started = False
        self.sim_s = 0.0  # seconds inside the vector envs' step(), since the last pop_sim_s()

    @classmethod
    def prepare_launch(cls, kwargs: dict) -> dict:
        """On the driver, before launch: refuse unknown settings and a bad ``pipeline_stages``."""
        named = {"config", "seed", "gamma", "make_env", "group_size"}
        settings = {k: v for k, v in kwargs.items() if k not in named}
        if isinstance(kwargs.get("make_env"), str):
            settings["id"] = kwargs["make_env"]
        _env_config(kwargs.get("config"), settings)
        return kwargs

    def _check_spaces(self) -> None:
        problem = space_problem(self.observation_space, self.action_space)
        if problem is not None:
            which, expected, got = problem
            label = getattr(self.make_env, "__name__", type(self.make_env).__name__)
            raise ComponentError(f"expected {expected}, got {got}", self.name, label, which)

    def spec(self) -> dict:
        """What builds fresh envs like these (for evaluation): ``{"config", "make_env"}``."""
        return {"config": self.cfg, "make_env": self.make_env}

    # ------------------------------------------------------------------ stepping
    def reset(self) -> list[np.ndarray]:
        """Reset every env with its seed; returns the observation of each stage."""
        for s, env in enumerate(self.envs):
            # (a group's envs the same seed: GroupedEpisodes makes each of their episodes start alike)
            seeds = [self.seed + (s * self.per_stage + i) // self.group_size for i in range(self.per_stage)]
            obs, _ = env.reset(seed=seeds)
            self.check_obs(obs)
            self.obs[s] = self._norm_obs(obs)
        self.started = True
        return list(self.obs)

    def current_obs(self) -> list[np.ndarray]:
        """The latest observation of each stage (resetting first if never reset)."""
        if not self.started:
            return self.reset()
        return list(self.obs)

    def step(self, stage: int, actions) -> dict:
        """Step one stage.

        Returns a dict: ``obs [n, ...]`` (after autoreset), ``reward [n]`` (float64), ``terminated [n]``,
        ``truncated [n]``, ``done [n]`` (either), and ``final_obs [k, ...]`` with ``final_idx [k]``: the last
        observation of the ``k`` episodes truncated on this step (the rollout bootstraps them with the value
        function); ``held [n]`` (bool) where an env says which of its steps were held after an episode's early end
        (:class:`rlnb.envs.groups.GroupedEpisodes`), else ``None``.
        """
        if type(actions) is not np.ndarray:
            actions = np.asarray(actions)
        t0 = _perf_counter()
        try:
            obs, reward, terminated, truncated, info = self.envs[stage].step(actions)
        except ValueError as e:  # (gymnasium's vector env stacking what does not fit: said naming the env)
            raise ValueError(
                f"env.id {self.label!r}: step failed ({e}); each env's observation must fit the observation space "
                f"{self.observation_space}"
            ) from e
        self.sim_s += _perf_counter() - t0  # the simulator's own work, for the loop's overhead share
        # rewards and done flags ([n] each) come to the host for the episode statistics; observations
        # of a simulator on a GPU stay there (torch tensors), as do its final observations
        if type(reward) is not np.ndarray or reward.dtype != _FLOAT64:
            reward = _host(reward, np.float64)
        if type(terminated) is not np.ndarray or type(truncated) is not np.ndarray:
            terminated, truncated = _host(terminated), _host(truncated)
        if self.stages == 1:  # (one stage: the whole rank's arrays, no slicing)
            idx, lo = slice(None), 0
            self.ep_return += reward
            self.ep_len += self._ones
        else:
            lo = stage * self.per_stage
            idx = slice(lo, lo + self.per_stage)
            self.ep_return[idx] += reward
            self.ep_len[idx] += 1
        done = terminated | truncated
        ended = done.nonzero()[0]
        final_idx, final_obs = _NONE_ENDED, None
        if len(ended):  # (most steps end no episode: nothing of this runs)
            rows = ended + lo  # (one op for all the episodes that ended: a thousand envs end dozens a step)
            # (return, length), and success where the env says (a third field: pairs stay pairs otherwise)
            for episode in zip(
                self.ep_return[rows].tolist(), self.ep_len[rows].tolist(), episode_success(info, ended)
            ):
                self.finished.append(episode if episode[2] is not None else episode[:2])
            self.ep_return[rows], self.ep_len[rows] = 0.0, 0
            final_idx = np.logical_and(truncated, np.logical_not(terminated)).nonzero()[0]
            if len(final_idx) and isinstance(info["final_obs"], torch.Tensor):
                final_obs = info["final_obs"][torch.as_tensor(final_idx, device=info["final_obs"].device)]
            elif len(final_idx):
                final_obs = np.stack([info["final_obs"][i] for i in final_idx])
        if obs.shape != self._obs_shape:  # (an env whose observations do not fit its own space)
            self.check_obs(obs)
        if self.obs_rms is not None or type(obs) is not np.ndarray or obs.dtype == _FLOAT64:
            obs = self._norm_obs(obs, update=not self.obs_rms_frozen)  # (else: obs as they are)
        if final_obs is not None:
            final_obs = self._norm_obs(final_obs)
        if self.ret_rms is not None:
            reward = self._norm_reward(reward, done, idx)
        self.obs[stage] = obs
        held = held_steps(info, done)
        return {
            "held": held,
            "obs": obs,
            "reward": reward,
            "terminated": terminated,
            "truncated": truncated,
            "done": done,
            "final_obs": final_obs,
            "final_idx": final_idx,
        }

    @property
    def label(self) -> str:
        """What the envs are, for messages: ``env.id``, or the name of the class or factory given."""
        return self.cfg.id if self.make_env is None else getattr(self.make_env, "__name__", "make_env")

    def check_obs(self, obs) -> None:
        """Refuse a stage's observations that do not fit the observation space: another shape, or NaN or
        infinite values (an env's overflow), naming ``env.id`` and what was expected (gymnasium's and torch's own
        errors name neither). The shape is checked at every step; the values at a reset and where the policy failed
        on them, and over each collected batch (:meth:`PolicyRollout._finish`)."""
        shape, label = tuple(getattr(obs, "shape", ())), self.label
        if shape != self._obs_shape:
            raise ValueError(
                f"env.id {label!r}: observations of shape {shape}, expected {self._obs_shape} ({self.per_stage} "
                f"env(s) x the observation space's {tuple(self.observation_space.shape or ())})"
            )
        values = obs.detach().cpu().numpy() if isinstance(obs, torch.Tensor) else np.asarray(obs)
        bad_part = self.layout.nonfinite(values) if self.layout is not None else None
        if bad_part is not None:
            key, row = bad_part
            raise ValueError(
                f"env.id {label!r}: observations hold NaN or infinite values in their part {key!r} (env {row} of "
                f"this stage), e.g. {self.layout.unpack(values[row : row + 1])[key].ravel()[:6].tolist()}"
            )
        if np.issubdtype(values.dtype, np.floating) and not np.isfinite(values).all():
            bad = sorted({int(i) for i in np.argwhere(~np.isfinite(values))[:, 0]})
            raise ValueError(
                f"env.id {label!r}: observations hold NaN or infinite values (env(s) {bad[:8]} of this stage; a "
                f"value beyond float32's range overflows to inf), e.g. {values[bad[0]].ravel()[:6].tolist()}"
            )

    def _norm_obs(self, obs, update: bool = False):
        # a simulator on a device: normalise there (a host array is told apart first: isinstance on torch's
        # Tensor class costs more than the rest of this for one)
        if type(obs) is not np.ndarray and isinstance(obs, torch.Tensor):
            obs = obs.float() if obs.dtype == torch.float64 else obs
            if self.obs_rms is None:
                return obs
            if update:
                var, mean = torch.var_mean(obs.double(), dim=0, correction=0)
                self.obs_rms.update_from_moments(mean.cpu().numpy(), var.cpu().numpy(), obs.shape[0])
            mean = torch.as_tensor(self.obs_rms.mean, device=obs.device, dtype=torch.float32)
            std = torch.as_tensor(np.sqrt(self.obs_rms.var + 1e-8), device=obs.device, dtype=torch.float32)
            return ((obs - mean) / std).clamp(-10.0, 10.0)
        obs = np.asarray(obs)
        if self.obs_rms is None:
            return obs.astype(np.float32) if obs.dtype == np.float64 else obs
        if update:
            self.obs_rms.update(obs)
        return self.obs_rms.normalize(obs)

    def obs_normalization(self) -> RunningMeanStd | None:
        """A copy of the running mean and variance observations are normalised with (``env.normalize_obs``),
        or ``None`` when they are not normalised."""
        return copy.deepcopy(self.obs_rms)

    def normalize_obs_with(self, statistics: RunningMeanStd) -> None:
        """Normalise observations with ``statistics`` (:meth:`obs_normalization` of a training env) from now
        on, without updating them: what an evaluation must see, as SB3's ``VecNormalize(training=False)``.
        Call it before :meth:`reset`."""
        self.obs_rms, self.obs_rms_frozen = copy.deepcopy(statistics), True

    def _norm_reward(self, reward: np.ndarray, done: np.ndarray, idx: slice) -> np.ndarray:
        self.disc_return[idx] = self.disc_return[idx] * self.gamma + reward
        self.ret_rms.update(self.disc_return[idx])
        self.disc_return[idx][done] = 0.0
        return np.clip(reward / np.sqrt(self.ret_rms.var + 1e-8), -10, 10)

    def run_episodes(self, act, episodes: int) -> dict:
        """Play ``episodes`` whole episodes from a reset, ``act(obs) -> actions`` choosing the env's actions
        (one stage); returns ``return_mean``, ``return_std`` and ``len_mean`` of their undiscounted returns.

        Each env has its share of the episodes, fixed before any ends, as SB3's ``evaluate_policy`` shares them:
        counting the first episodes to end would favour short ones, an env that fails fast ending several
        before a good one ends one.
        """
        if self.stages != 1:
            raise ValueError(f"run_episodes: expected an env of one stage, got pipeline_stages={self.stages}")
        n = self.cfg.num_envs
        wanted = np.array([(episodes + i) // n for i in range(n)])
        counted = np.zeros(n, dtype=np.int64)
        returns: list[tuple] = []
        obs = self.reset()[0]
        self.ep_return[:], self.ep_len[:], self.finished = 0.0, 0, []  # (every episode starts here)
        while (counted < wanted).any():
            out = self.step(0, act(obs))
            obs = out["obs"]
            # the episodes that ended this step, in the order of their envs (as step() records them)
            ended = np.flatnonzero(np.logical_or(out["terminated"], out["truncated"]))
            for i, episode in zip(ended, self.pop_episodes()):
                if counted[i] < wanted[i]:
                    counted[i] += 1
                    returns.append(episode)
        r = np.array([x[0] for x in returns])
        out = {
            "return_mean": float(r.mean()),
            "return_std": float(r.std()),
            "len_mean": float(np.mean([x[1] for x in returns])),
        }
        rate = success_rate(returns)
        if rate is not None:  # an env that says whether its episodes succeeded
            out["success_rate"] = rate
        return out

    # ------------------------------------------------------------------ channel mode
    def run(self, steps: int, obs_channel, act_channel, key: str) -> int:
        """Serve ``steps`` steps through channels: take actions for each stage, step it, put the result.

        Stages interleave, so while this rank steps stage ``s`` the rollout infers stage ``s + 1``.
        The very first call also puts the initial observations.
        """
        if not self.started:
            for s, obs in enumerate(self.reset()):
                obs_channel.put({"obs": obs}, key=f"{key}/{s}")
        for _ in range(steps):
            for s in range(self.stages):
                actions = act_channel.get(key=f"{key}/{s}")
                obs_channel.put(self.step(s, actions), key=f"{key}/{s}")
        return steps * self.cfg.num_envs

    # ------------------------------------------------------------------ stats and state
    def pop_sim_s(self) -> float:
        """Seconds spent inside the vector envs' own ``step()`` since the last call."""
        out, self.sim_s = self.sim_s, 0.0
        return out

    def pop_episodes(self) -> list[tuple]:
        """``(return, length)`` of the episodes finished since the last call, in finishing order, and a third
        field, ``success`` (1.0 or 0.0), for an episode whose env said at its end (:data:`SUCCESS_KEYS`)."""
        out, self.finished = self.finished, []
        return out

    def spaces(self):
        return self.observation_space, self.action_space

    def _make_envs(self) -> list:
        return [
            make_vector_env(
                self.make_env or self.cfg.id,
                self.per_stage,
                self.cfg.vector_mode,
                self.cfg.kwargs,
                group_horizon=0 if self.group_size > 1 else None,
            )
            for _ in range(self.stages)
        ]

    def state_dict(self) -> dict:
        """Everything needed to continue exactly, as plain data: the sync vector envs' state (with their RNGs)
        and counters.

        The envs are not pickled (a pickle runs code when loaded): their plain-data attributes are read out
        (:func:`rlnb.envs.state.capture_state`) and, on resume, written into envs built afresh from the
        same class and arguments, so an env class defined in a notebook cell resumes too. MuJoCo's physics
        goes through MuJoCo's own state API (:func:`rlnb.envs.gym_envs.capture_sim_state`).
        Async vector envs live in subprocesses and are not saved: after a resume they are reset (every
        episode restarts; counters, statistics and normalisation are restored).
        A vector env with its own ``state_dict()``/``load_state_dict()`` (ManiSkill on the GPU, and on the CPU
        in subprocesses too; :class:`rlnb.envs.TorchCartPole`) is saved through them.
        """
        own = self._own_state_api()
        captured = self.cfg.vector_mode == "sync" and not own
        return {
            "env_state": [capture_state(v) for v in self.envs] if captured else None,
            "sim_state": [capture_sim_state(v) for v in self.envs] if captured else None,
            "vector_state": [v.state_dict() for v in self.envs] if own else None,
            "obs": [o.cpu() if isinstance(o, torch.Tensor) else o for o in self.obs],
            "ep_return": self.ep_return,
            "ep_len": self.ep_len,
            "finished": self.finished,
            "obs_rms": None if self.obs_rms is None else self.obs_rms.state(),
            "ret_rms": None if self.ret_rms is None else self.ret_rms.state(),
            "disc_return": self.disc_return,
            "started": self.started,
            "config": dataclasses.asdict(self.cfg),
        }

    def load_state_dict(self, state: dict) -> None:
        if "env_state" not in state and "envs" in state:
            raise ValueError(
                "this env state was written by an older rlnb, which pickled the envs (unpickling them could run "
                "code, so they are not loaded); start the run again, or resume it with that rlnb version"
            )
        for k in ("obs", "ep_return", "ep_len", "finished", "disc_return", "started"):
            setattr(self, k, state[k])
        self.obs_rms = RunningMeanStd.from_state(state["obs_rms"])
        self.ret_rms = RunningMeanStd.from_state(state["ret_rms"])
        if state.get("vector_state") is not None:  # through the simulator's own state API
            for vec, vec_state in zip(self.envs, state["vector_state"]):
                vec.load_state_dict(vec_state)
            device = getattr(self.envs[0], "device", None)
            self.obs = [o.to(device) if isinstance(o, torch.Tensor) and device else o for o in self.obs]
            return
        if state["env_state"] is None:  # async envs: not in the checkpoint; start fresh episodes
            log.warning(
                "%s[%d]: async vector envs restart their episodes after a resume", self.name, self.rank
            )
            self.ep_return[:], self.ep_len[:], self.disc_return[:] = 0.0, 0, 0.0
            self.reset()
            return
        for env in self.envs:
            env.close()
        self.envs = self._make_envs()
        for vec, captured, sim in zip(self.envs, state["env_state"], state["sim_state"]):
            restore_state(vec, captured)
            restore_sim_state(vec, sim)  # MuJoCo physics, through MuJoCo's own API

    def _own_state_api(self) -> bool:
        return all(
            callable(getattr(v, m, None)) for v in self.envs for m in ("state_dict", "load_state_dict")
        )

    def close(self) -> None:
        for env in self.envs:
            env.close()

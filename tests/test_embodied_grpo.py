"""Embodied GRPO (SimpleVLA-RL's, RLinf's): groups of envs starting each episode alike, episodes of one length,
each episode's return against its group's; the tiny VLA trained with it on a worker."""

import numpy as np
import pytest
import torch

import rlnb.envs.pixel  # noqa: F401  (registers rlnb/PixelReach-v0)
from rlnb.algorithms.advantages import episode_grpo
from rlnb.components.env import Env
from rlnb.errors import ConfigError
from rlnb.loop import Loop


def test_each_episode_is_scored_against_the_same_episode_of_its_groups_envs():
    # 4 envs in groups of 2, two episodes of 2 steps each; rewards by hand
    rewards = torch.tensor(
        [[0.0, 0.0, 0.5, 0.0], [1.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 2.0], [0.0, 1.0, 0.0, 0.0]]
    )
    dones = torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    advantages, returns = episode_grpo(rewards, dones, group_size=2)
    # episode returns: first episodes (1, 0 | 1, 0), second (0, 1 | 0, 2), each carried over its 2 steps
    assert returns.tolist() == [[1, 0, 1, 0], [1, 0, 1, 0], [0, 1, 0, 2], [0, 1, 0, 2]]
    a = 1 / np.sqrt(2)  # (x - mean) / std of a pair (Bessel): +-1/sqrt(2)
    expected = [[a, -a, a, -a], [a, -a, a, -a], [-a, a, -a, a], [-a, a, -a, a]]
    assert torch.allclose(advantages, torch.tensor(expected, dtype=torch.float32), atol=1e-5)
    # a group whose episodes all scored alike teaches nothing (-0.2's mean over 8 rounds to 1.5e-8 off it)
    same, _ = episode_grpo(torch.full((2, 8), -0.2), torch.ones(2, 8), group_size=8)
    assert not same.any()
    unscaled, _ = episode_grpo(rewards, dones, group_size=2, scale="none")
    assert unscaled[0].tolist() == [0.5, -0.5, 0.5, -0.5]


def test_episodes_that_are_not_whole_or_not_aligned_are_refused_naming_the_setting():
    with pytest.raises(ConfigError, match="rollout.steps_per_rollout") as e:
        episode_grpo(
            torch.zeros(3, 4), torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]), group_size=2
        )
    assert e.value.key == "rollout.steps_per_rollout"
    with pytest.raises(ConfigError, match="different steps"):
        episode_grpo(torch.zeros(2, 4), torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]]), group_size=2)
    with pytest.raises(ConfigError, match="algorithm.group_size"):
        episode_grpo(torch.zeros(2, 6), torch.ones(2, 6), group_size=4)


def test_a_groups_envs_start_every_episode_alike_and_every_episode_lasts_the_time_limit():
    env = Env(make_env="rlnb/PixelReach-v0", num_envs=8, pipeline_stages=2, seed=3, group_size=2)
    rng = np.random.default_rng(0)
    starts = [np.concatenate(env.reset())]
    for t in range(1, 41):
        out = [env.step(s, rng.integers(0, 4, 4)) for s in (0, 1)]
        done = np.concatenate([o["done"] for o in out])
        # PixelReach ends on reaching the target; here every episode lasts its 20 steps, held once it ended
        assert done.all() == (t % 20 == 0) and done.any() == (t % 20 == 0), t
        if t % 20 == 0:
            starts.append(np.concatenate([o["obs"] for o in out]))
    for obs in starts:  # within a group alike, groups apart (4 groups of 2 over the 2 stages)
        assert all((obs[g] == obs[g + 1]).all() for g in range(0, 8, 2))
        assert len({obs[g].tobytes() for g in range(0, 8, 2)}) == 4
    assert not (starts[0] == starts[1]).all(axis=1).any()  # each episode from a new state
    episodes = env.pop_episodes()
    assert len(episodes) == 16 and all(length == 20 for _, length, *_ in episodes)
    assert {len(e) for e in episodes} == {3}  # the success of each, said at its fixed-length end
    assert sum(e[2] for e in episodes) > 0  # (random actions reach the target now and then)
    with pytest.raises(ConfigError, match="groups of algorithm.group_size=3") as e:
        Env(make_env="rlnb/PixelReach-v0", num_envs=8, group_size=3)
    assert e.value.key == "num_envs"


@pytest.mark.parametrize("stages", [1, 2])
def test_steps_held_after_an_episodes_early_end_are_left_out_of_the_loss(stages):
    """A group's env whose episode ended early holds until the group's episodes end; its actions there did nothing,
    so the batch's ``loss_mask`` is 0.0 on them (SimpleVLA-RL's and RLinf's mask) and the update is the same
    whatever they were."""
    from rlnb.components.actor import PPOActor
    from rlnb.components.rollout import PolicyRollout
    from rlnb.runtime import rank as rank_mod

    env = Env(make_env="rlnb/PixelReach-v0", num_envs=8, pipeline_stages=stages, seed=1, group_size=2)
    rollout = PolicyRollout(None, env.observation_space, env.action_space, seed=0)
    host = type("Host", (), {"obj": env})()  # (as the worker's registry of rank hosts holds it: weakly)
    rank_mod._HOSTS[("", f"env-held-{stages}", 0)] = host
    rollout.collect(40, f"env-held-{stages}")
    batch, episodes = rollout.batch, env.pop_episodes()
    mask = batch["loss_mask"]  # [T, N]
    assert mask.shape == batch["rewards"].shape and set(mask.unique().tolist()) <= {0.0, 1.0}
    n = batch["rewards"].shape[1]
    by_episode = mask.view(2, 20, n)  # [episode, step, env]
    # an episode's steps count up to its real end, then none: ones, then zeros
    assert (by_episode[:, 1:] <= by_episode[:, :-1]).all() and (by_episode[:, 0] == 1).all()
    lengths = by_episode.sum(1).T.flatten()  # [env * episode]: each env's episodes, in order
    # (stages step their envs one after the other: the episodes end, and are counted, stage by stage)
    order = torch.arange(n).view(stages, n // stages)
    real = [int(lengths[e * 2 + k]) for k in range(2) for row in order for e in row.tolist()]
    successes = [e[2] for e in episodes]
    assert len(successes) == 2 * n and sum(successes) > 0
    assert all(s == 1.0 for r, s in zip(real, successes) if r < 20)  # held only after reaching the target
    assert (mask == 0).any()
    # the update: the same whatever the held steps' actions and advantages were
    settings = {"update_epochs": 2, "num_minibatches": 2, "advantage": "episode_grpo", "group_size": 2,
                "norm_adv": False}  # fmt: skip

    def trained(b):
        actor = PPOActor(None, settings, env.observation_space, env.action_space, seed=3)
        actor.set_batch([b])
        actor.train()
        return dict(actor.policy.named_parameters())

    other = dict(batch)
    held = mask == 0
    other["actions"] = torch.where(held, (batch["actions"] + 1) % 4, batch["actions"])
    other["logprobs"] = torch.where(held, batch["logprobs"] - 0.5, batch["logprobs"])
    masked, changed = trained(batch), trained(other)
    assert all(torch.equal(p, changed[name]) for name, p in masked.items())
    # and without the mask, the held steps would have changed it
    unmasked = trained({k: v for k, v in other.items() if k != "loss_mask"})
    assert any(not torch.equal(p, unmasked[name]) for name, p in masked.items())


GRPO = ["algorithm.advantage=episode_grpo", "algorithm.vf_coef=0", "algorithm.norm_adv=false",
        "runner.eval_interval=0", "runner.tensorboard=false"]  # fmt: skip


def test_a_recipe_whose_rollouts_cut_episodes_or_groups_is_refused_before_launch(cluster, tmp_path):
    for more, key in ((["rollout.steps_per_rollout=16"], "rollout.steps_per_rollout"),
                      (["algorithm.group_size=3"], "env.num_envs")):  # fmt: skip
        overrides = [*GRPO, "algorithm.group_size=4", "rollout.steps_per_rollout=20", *more]
        with pytest.raises(ConfigError) as e:
            Loop.from_recipe("ppo_pixelreach", overrides, cluster=cluster, run_dir=tmp_path)
        assert e.value.key == key, e.value


def test_embodied_grpo_learns_pixelreach_on_a_worker(cluster, tmp_path):
    """The built-in CNN policy from scratch, groups of 8 envs, two 20-step episodes per env a step: the sampled
    episodes' success rate rises from a random policy's (~0.1-0.3 here) to well above it (seeded; measured here:
    0.1 in the first steps, 0.5-0.8 from step 16 on)."""
    overrides = [
        *GRPO,
        "algorithm.group_size=8",
        "rollout.steps_per_rollout=40",
        "runner.steps=30",
        "actor.lr=0.001",
    ]
    with Loop.from_recipe("ppo_pixelreach", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        loop.run(progress=False)
        success = [r["env/success_rate"] for r in loop.history if "env/success_rate" in r]
        advantages = [
            r["advantages/advantage_mean"] for r in loop.history if "advantages/advantage_mean" in r
        ]
    assert np.mean(success[:5]) < 0.4 and np.mean(success[-10:]) > np.mean(success[:5]) + 0.2, success
    assert np.abs(advantages).max() < 1e-5  # group-relative: each group's mean is taken out

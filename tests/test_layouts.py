"""Placement layouts that share or split slots between actor, rollout and env, on workers."""

import math

import pytest

import rlnb
from rlnb.loop import GRPOLoop, Loop
from tests.test_lm import GRPO_SMALL


def test_rlinf_hybrid_layout_learns_with_the_actor_on_every_slot(cluster, tmp_path):
    """Actor data-parallel on all slots, env and rollout on disjoint halves: each rollout batch is split
    over the actor ranks (it was refused: "rollout ranks cannot feed actor ranks evenly")."""
    overrides = ["runner.stop_return=195", "runner.tensorboard=false", "cluster.call_timeout_s=60",
                 "cluster.component_placement={actor: 0-1, env: 0, rollout: 1}"]  # fmt: skip
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        assert loop.mode == "hybrid" and loop.groups["actor"].world_size == 2
        loop.run(progress=False)
        assert loop.episode_stats()["episode_return_mean"] >= 195, loop.summary()


@pytest.mark.parametrize(
    "placement",
    [
        "{actor: 0-1, 'env,rollout': 0}",  # the rollout shares actor rank 0's worker: weights must not wait on it
        "{'actor,rollout': 0, env: 1}",
    ],
)
def test_layouts_sharing_a_worker_between_actor_and_rollout_step(cluster, tmp_path, placement):
    overrides = [
        "runner.tensorboard=false",
        "cluster.call_timeout_s=30",
        f"cluster.component_placement={placement}",
    ]
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        records = [loop.step_once() for _ in range(2)]  # used to wait out the call timeout in sync_weights
    assert [r["step"] for r in records] == [1, 2] and all(math.isfinite(r["train/loss"]) for r in records)


def test_grpo_with_more_actor_than_rollout_ranks_splits_whole_groups(cluster, tmp_path):
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "actor.sft_steps=10", "runner.steps=1",
                 "cluster.component_placement={actor: 0-1, 'rollout,reward': 1}"]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        record = loop.step_once()
        intake = loop.paths.hand_batches()  # the same batch again: what each actor rank receives
    assert "train/loss" in record
    assert [i["sequences"] for i in intake] == [64, 64]  # 16 prompts x 8 completions, whole groups per rank


def test_env_and_rollout_partly_sharing_slots_is_refused_before_anything_starts(tmp_path):
    overrides = ["cluster.component_placement={actor: 0, rollout: 0, env: 0-1}", "cluster.slots=2"]
    with pytest.raises(rlnb.PlacementError, match=r"env \[0, 1\] and rollout \[0\] share slot\(s\) \[0\]"):
        Loop.from_recipe("ppo_cartpole", overrides, run_dir=tmp_path)  # no cluster given: none was started

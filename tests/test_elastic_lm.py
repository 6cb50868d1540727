"""Elastic rollout ranks of asynchronous LM GRPO (``cluster.elastic``): a worker lost mid-generation has the problems
its pool held admitted again where its share of the batch goes, and made into that share in the same step; its
replacement joins (a rollout and a reward rank) with the latest weights and a share; every problem admitted is
trained once, across a resume too."""

import itertools
import os
import signal
import time

import pytest

import rlnb
from rlnb.cluster.cluster import listed_workers
from rlnb.errors import PlacementError
from rlnb.loop import GRPOLoop
from rlnb.metrics import read_metrics
from tests.test_elastic import wait_for_workers

pytestmark = pytest.mark.timeout(600)

PER_STEP, GROUP = 8, 4


def elastic_lm(tmp_path, steps: int, extra=()) -> list[str]:
    return [
        f"actor.model_path={tmp_path / 'model'}", "actor.sft_steps=0", "actor.tiny_lm.hidden_size=32",
        "actor.tiny_lm.num_layers=1", "data.max_operand=9", f"data.prompts_per_step={PER_STEP}",
        f"algorithm.group_size={GROUP}", "rollout.max_new_tokens=6", "rollout.chunk_tokens=1",
        "algorithm.max_staleness=1", "runner.eval_interval=0", "runner.tensorboard=false", "runner.save_interval=0",
        f"runner.steps={steps}", "cluster.elastic=true",
        "cluster.component_placement={actor: 0, 'rollout,reward': 1-2}", *extra,
    ]  # fmt: skip


def pools(loop) -> list[int]:
    """The serials every live rollout rank holds in its pool."""
    rollout = loop.groups["rollout"]
    states = rollout.state_dict().result()
    return [g["serial"] for state in states for g in state["pool"]]


def assert_each_problem_trained_once(loop) -> None:
    trained = [x for step in loop.trained_problems for x in step]
    assert len(trained) == len(set(trained)) == loop.step * PER_STEP  # none twice, every step whole
    # none skipped: what was admitted and not trained is in the live pools
    assert sorted(trained + pools(loop)) == list(range(loop.task.position))


def test_a_rollout_worker_killed_mid_generation_has_its_problems_made_again_and_its_replacement_joins(
    tmp_path,
):
    with rlnb.Cluster(slots=3, gpus=False) as cluster:
        loop = GRPOLoop.from_recipe(
            "grpo_arith", elastic_lm(tmp_path, 8), cluster=cluster, run_dir=tmp_path / "r"
        )
        try:
            loop.run(2, progress=False)
            lost = cluster.slots[2].address
            loop.sync_weights()
            loop.rollout()  # the next batch's generation is issued now, and runs while this step trains
            os.kill(cluster.slots[2].pid, signal.SIGKILL)
            loop.advantages()
            loop.train()
            loop.run(2, progress=False)  # no error, no restart: rank 0 makes the lost share from its problems
            wait_for_workers(cluster, 3)  # the Nanny restarts the worker: it joins at the next step (or has)
            loop.run(progress=False)
            assert loop.step == 8
            rollout, reward = loop.groups["rollout"], loop.groups["reward"]
            assert rollout.ranks == reward.ranks == [0, 2]
            assert rollout.infos[2].slot == 2 and rollout.infos[2].address != lost
            assert_each_problem_trained_once(loop)
        finally:
            loop.close()
    records = [r for r in read_metrics(tmp_path / "r") if "train/loss" in r]
    assert [r["step"] for r in records] == list(range(1, 9))
    samples = [b["samples_total"] - a["samples_total"] for a, b in itertools.pairwise(records)]
    assert samples == [PER_STEP * GROUP] * 7
    ranks = [r["cluster/ranks"] for r in records]
    assert ranks[0] == 2 and ranks[-1] == 2, ranks
    assert records[-1]["cluster/reissued"] == 1 and records[-1]["cluster/joined"] == 1
    assert all(r["rollout/staleness_max"] <= 1 for r in records)


def test_an_elastic_lm_run_resumes_exactly_from_fewer_ranks_than_it_launched_with(tmp_path):
    with rlnb.Cluster(slots=3, gpus=False) as cluster:
        # two versions ahead: each rank's pool holds a step's groups of each share between steps
        ahead = elastic_lm(tmp_path, 6, ["algorithm.max_staleness=2"])
        loop = GRPOLoop.from_recipe("grpo_arith", ahead, cluster=cluster, run_dir=tmp_path / "r")
        try:
            loop.run(2, progress=False)
            leaving = cluster.slots[2].address
            cluster._local.scale(2)  # a scale-down: slot 2's worker closes between steps
            while leaving in listed_workers(cluster.client):
                time.sleep(0.1)
            loop.sync_weights()
            loop.rollout()
            loop.advantages()
            loop.train()
            assert loop.groups["rollout"].ranks == [0]
            loop.save()  # with the next batch in flight; one rank's pool holds both shares' problems
            held = pools(loop)
            assert len(held) == PER_STEP, held  # (a step ahead: both shares' groups)
            trained = [list(x) for x in loop.trained_problems]
        finally:
            loop.close()
        cluster._local.scale(3)
        wait_for_workers(cluster, 3)
        with GRPOLoop.resume(tmp_path / "r", cluster=cluster) as loop:
            assert loop.step == 3 and loop.trained_problems == trained
            assert loop.groups["rollout"].ranks == [0, 1]  # launched afresh: rank 1 holds no pool yet
            assert pools(loop) == held
            loop.run(progress=False)
            assert loop.step == 6
            assert_each_problem_trained_once(loop)
            pool = loop.groups["rollout"].state_dict().result()
            # the problems held followed the shares: each rank a step ahead on its own, within the bound
            assert [len(state["pool"]) for state in pool] == [PER_STEP // 2] * 2
            assert all(r["rollout/staleness_max"] <= 2 for r in loop.history if "train/loss" in r)


def test_elastic_lm_ranks_are_refused_before_launch_where_they_cannot_come_and_go(tmp_path):
    two = "cluster.component_placement={actor: 0, 'rollout,reward': 1}"  # (the default cluster's two slots)
    sync = [*elastic_lm(tmp_path, 2), two, "algorithm.max_staleness=0"]
    with pytest.raises(PlacementError, match="max_staleness") as e:
        GRPOLoop.from_recipe("grpo_arith", sync, run_dir=tmp_path / "a")
    assert e.value.key == "cluster.elastic"
    adapters = [*elastic_lm(tmp_path, 2), two, "actor.lora.rank=4"]
    with pytest.raises(PlacementError, match="lora") as e:
        GRPOLoop.from_recipe("grpo_arith", adapters, run_dir=tmp_path / "b")
    assert e.value.key == "cluster.elastic"

"""The LM actor sharded with FSDP2 (``actor.strategy: fsdp2``) over two CPU ranks (gloo) on Dask workers."""

import math

import pytest

from rlnb.config import load_recipe
from rlnb.loop import GRPOLoop
from tests.test_lm import GRPO_SMALL

TWO_RANKS = [
    *GRPO_SMALL, "actor.sft_steps=30", "runner.steps=3", "data.prompts_per_step=4", "algorithm.group_size=4",
    "algorithm.update_epochs=2", "rollout.max_new_tokens=3", "cluster.component_placement={'actor,rollout,reward': 0-1}",
]  # fmt: skip


def _run(cluster, tmp_path, name: str, extra: list[str]) -> tuple[list[dict], int]:
    overrides = [*TWO_RANKS, f"actor.model_path={tmp_path / 'model'}", *extra]
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / name) as loop:
        records = loop.run(progress=False)
        state_bytes = records[-1]["memory/actor_state_bytes"]
    return records, state_bytes


def test_fsdp2_on_two_cpu_ranks_trains_as_ddp_does_with_a_shard_of_the_state_each(cluster, tmp_path):
    """The same warm start and GRPO steps, sharded or not: the same losses (float32: to rounding), each rank
    holding about half the parameters, gradients and AdamW state; in bf16 (FSDP2's mixed precision) finite."""
    ddp, ddp_bytes = _run(cluster, tmp_path, "ddp", ["actor.strategy=ddp"])
    fsdp, fsdp_bytes = _run(cluster, tmp_path, "fsdp2", ["actor.strategy=fsdp2"])
    losses = [(a["train/loss"], b["train/loss"]) for a, b in zip(ddp, fsdp)]
    assert len(losses) == 3 and all(a == pytest.approx(b, rel=1e-3, abs=1e-4) for a, b in losses), losses
    assert 0.4 < fsdp_bytes / ddp_bytes < 0.6, (fsdp_bytes, ddp_bytes)
    bf16, _ = _run(cluster, tmp_path, "bf16", ["actor.strategy=fsdp2", "actor.dtype=bfloat16"])
    assert all(math.isfinite(r["train/loss"]) for r in bf16), bf16


def test_a_sharded_run_checkpoints_and_resumes_exactly_and_exports_the_whole_model(cluster, tmp_path):
    extra = ["actor.strategy=fsdp2", "runner.save_interval=1"]
    whole, _ = _run(cluster, tmp_path, "whole", extra)
    overrides = [*TWO_RANKS, f"actor.model_path={tmp_path / 'model'}", *extra, "runner.steps=2"]
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "cut") as loop:
        loop.run(progress=False)
    resumed = GRPOLoop.resume(tmp_path / "cut", cluster=cluster, overrides=["runner.steps=3"])
    with resumed as loop:
        assert loop.step == 2
        last = loop.run(progress=False)[-1]
        exported = loop.export(tmp_path / "exported")
    assert last["train/loss"] == pytest.approx(whole[-1]["train/loss"], rel=1e-5, abs=1e-7)
    from rlnb.models.lm import load_lm

    model, _ = load_lm(str(exported))  # a whole model in Hugging Face format, not a shard
    assert sum(p.numel() for p in model.parameters()) > 0


def test_fsdp2_misfits_are_refused_naming_the_key():
    from rlnb.config import RecipeError

    with pytest.raises(RecipeError, match="actor.strategy: fsdp2 shards an LM actor"):
        load_recipe("ppo_cartpole", ["actor.strategy=fsdp2"])
    with pytest.raises(RecipeError, match="actor.strategy: fsdp2 gathers the weights"):
        load_recipe("grpo_arith", ["actor.strategy=fsdp2", "rollout.weight_sync=broadcast"])

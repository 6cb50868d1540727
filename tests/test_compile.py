"""Compiled train steps (``actor.compile``) where they run: on the actor's worker, timed apart from
training, equal to eager training, and falling back to eager with one warning when compiling fails."""

import logging

import pytest

from rlnb.loop import Loop

QUIET = ["runner.tensorboard=false", "runner.steps=3", "algorithm.update_epochs=2"]
COMPARED = ("train/loss", "train/policy_loss", "train/value_loss", "train/approx_kl", "train/entropy")


def test_the_compiled_step_runs_on_the_worker_and_trains_as_eager_does(cluster, tmp_path):
    runs = {}
    for setting in ("false", "true"):
        overrides = [*QUIET, f"actor.compile={setting}"]
        with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path / setting) as loop:
            runs[setting] = loop.run(progress=False)
            stats = loop.groups["actor"].on(0).compile_stats().result()[0]
        if setting == "true":
            assert stats["compiled"] and stats["fallback"] is None and stats["frames_ok"] >= 1, stats
            assert stats["graphs"] >= 1 and stats["cache_dir"].endswith("rlnb/inductor"), stats
            first, later = runs["true"][0], runs["true"][1:]
            assert first["time/compile_s"] == pytest.approx(stats["compile_s"])  # its own metric...
            assert all("time/compile_s" not in r for r in later)  # ...once
            assert first["time/train_s"] < first["time/compile_s"]  # not hidden in the first step
        else:
            assert not stats["compiled"] and "time/compile_s" not in runs["false"][0]
    for eager, compiled in zip(runs["false"], runs["true"]):
        for key in COMPARED:
            assert compiled[key] == pytest.approx(eager[key], rel=1e-3, abs=1e-5), key


def _failing_backend(name, dask_worker=None):
    """On a worker: register a compile backend that always fails and select it (``None``: the default)."""
    import os

    import torch._dynamo

    def fails(graph, example_inputs):
        raise RuntimeError("this backend cannot compile anything")

    if name is None:
        os.environ.pop("RLNB_COMPILE_BACKEND", None)
        return None
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(fails, name=name)
    os.environ["RLNB_COMPILE_BACKEND"] = name
    return name


def test_a_compile_failure_trains_eager_with_one_warning(cluster, tmp_path, caplog):
    cluster.client.run(_failing_backend, "rlnb_test_fails")  # on the workers only
    overrides = [*QUIET, "actor.compile=true"]
    try:
        with (
            caplog.at_level(logging.WARNING, logger="rlnb"),
            Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop,
        ):
            records = loop.run(progress=False)
            stats = loop.groups["actor"].on(0).compile_stats().result()[0]
    finally:
        cluster.client.run(_failing_backend, None)
    assert not stats["compiled"] and "this backend cannot compile anything" in stats["fallback"], stats
    warnings = [r.getMessage() for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len(warnings) == 1 and "this backend cannot compile anything" in warnings[0], warnings
    assert len(records) == 3 and all(r["train/loss"] == r["train/loss"] for r in records)  # trained, eager
    assert "time/compile_s" in records[0]


def test_the_lm_actor_compiles_its_step_on_the_worker_and_trains_as_eager_does(cluster, tmp_path):
    """GRPO with actor.compile=true: the LM actor's micro-batch objective (forward, loss, backward) runs
    compiled on its worker, its compile time is its own metric, and the updates match eager training."""
    from rlnb.loop import GRPOLoop

    base = ["data.max_operand=9", "actor.sft_steps=10", "actor.tiny_lm.hidden_size=32", "actor.tiny_lm.num_layers=1",
            "runner.eval_interval=0", "runner.tensorboard=false", "runner.steps=2", "data.prompts_per_step=4",
            "algorithm.group_size=4", "algorithm.update_epochs=2", "cluster.component_placement={'actor,rollout,reward': 0}",
            f"actor.model_path={tmp_path / 'model'}",
            # every row computed both ways (a compiled step computes them all, and the loss's metrics
            # are over the rows computed)
            "actor.skip_zero_advantage=false"]  # fmt: skip
    runs = {}
    for setting in ("false", "true"):
        overrides = [*base, f"actor.compile={setting}"]
        with GRPOLoop.from_recipe(
            "grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / setting
        ) as loop:
            runs[setting] = [r for r in loop.run(progress=False) if "train/loss" in r]
            stats = loop.groups["actor"].on(0).compile_stats().result()[0]
        if setting == "true":
            assert stats["compiled"] and stats["fallback"] is None and stats["frames_ok"] >= 1, stats
            assert runs["true"][0]["time/compile_s"] == pytest.approx(stats["compile_s"])
        else:
            assert not stats["compiled"]
    assert len(runs["true"]) == len(runs["false"]) == 2
    for eager, compiled in zip(runs["false"], runs["true"]):
        for key in ("train/loss", "train/clip_frac", "train/approx_kl"):
            assert compiled[key] == pytest.approx(eager[key], rel=1e-3, abs=1e-5), key

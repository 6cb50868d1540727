"""Advertised options exercised where they really run: on Dask workers, through the loop or the CLI."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

import rlnb
from rlnb.loop import GRPOLoop, Loop, complete_checkpoints
from rlnb.loop.grpo_data import turn_demonstrations
from tests.conftest import last_answer
from tests.test_lm import GRPO_SMALL

RLNB = [sys.executable, "-m", "rlnb.cli"]


def test_math_reward_scores_on_a_worker_thread(cluster):
    """math-verify's signal-based timeouts raise off the main thread: every score used to be 0.0."""
    reward = rlnb.RewardWorker.launch(cluster, "1", fn="math")
    try:
        completions = ["so \\boxed{\\frac{1}{2}}", "#### 1,000", "it is \\boxed{2x+1}", "\\boxed{3}"]
        answers = ["0.5", "1000", "1+2x", "4"]
        assert reward.score(completions, answers).result() == [[1.0, 1.0, 1.0, 0.0]]
    finally:
        reward.shutdown()


def test_grpo_with_the_math_reward_on_a_boxed_jsonl(cluster, tmp_path):
    rows = [{"question": f"{a}+{b}=", "answer": f"\\boxed{{{a + b}}}"} for a in range(10) for b in range(10)]
    data = tmp_path / "boxed.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=2", "reward.name=math",
                 "data.task=file", f"data.path={data}", "rollout.max_new_tokens=10", "data.eval_size=20",
                 "actor.sft_steps=150"]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        accuracy = [r["eval/accuracy"] for r in loop.history if "eval/accuracy" in r]
        rewards = [r["reward/mean"] for r in loop.history if "reward/mean" in r]
    assert accuracy[0] > 0.2 and max(rewards) > 0.2, (accuracy, rewards, loop.last_samples)


def test_async_vector_envs_run_on_workers_through_the_cli(tmp_path):
    """Dask's workers are daemonic by default: AsyncVectorEnv could not start its subprocesses there."""
    out = subprocess.run(
        [*RLNB, "run", "ppo_cartpole", "env.vector_mode=async", "env.num_envs=2", "runner.steps=2",
         "runner.tensorboard=false", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert complete_checkpoints(tmp_path / "run")  # saved at the end, without pickling subprocess envs
    with Loop.resume(tmp_path / "run", overrides=["runner.steps=3"]) as loop:
        assert loop.step == 2
        loop.run(progress=False)
        assert loop.step == 3


def test_daemonic_remote_workers_are_refused_for_child_processes(tmp_path):
    import dask
    from distributed import LocalCluster

    with dask.config.set({"distributed.worker.daemon": True}):
        local = LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None)
    try:
        with rlnb.Cluster(local.scheduler_address) as cluster:
            assert cluster.slots[0].daemonic
            with pytest.raises(
                rlnb.ClusterError,
                match=r"env.vector_mode=async .* slot\(s\) \[0\] are daemonic.*DASK_DISTRIBUTED__WORKER__DAEMON=False",
            ):
                Loop.from_recipe("ppo_cartpole", ["env.vector_mode=async"], cluster=cluster, run_dir=tmp_path)
            assert not cluster.placed_on(0)  # refused before anything was launched
    finally:
        local.close()


def test_info_against_a_server_that_is_not_dask_fails_within_the_timeout():
    import http.server
    import threading
    import time

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        t0 = time.perf_counter()
        out = subprocess.run(
            [*RLNB, "info", "--address", f"tcp://127.0.0.1:{server.server_port}", "--timeout-s", "2"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        elapsed = time.perf_counter() - t0
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode in (1, 2), out
    assert "an HTTP server answered there" in out.stderr and "not a Dask scheduler" in out.stderr, out.stderr
    assert elapsed < 2 + 20, elapsed  # the wait is bounded (the rest is Python and Dask imports)


def test_cli_options_and_overrides_mix_in_any_order(tmp_path):
    out = subprocess.run(
        [*RLNB, "run", "ppo_cartpole", "--run-dir", str(tmp_path), "seed=3", "--print-config", "env.num_envs=4"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "seed: 3" in out.stdout and "num_envs: 4" in out.stdout and f"run_dir: {tmp_path}" in out.stdout
    bad = subprocess.run([*RLNB, "run", "ppo_cartpole", "seed=3", "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unrecognized arguments: --bogus" in bad.stderr


def test_bundled_recipes_run_from_an_installed_wheel(tmp_path):
    """Recipes ship as package data: `rlnb run ppo_cartpole` works from a wheel, away from the source tree."""
    import shutil
    import sysconfig
    from pathlib import Path

    root = tmp_path / "src"  # a copy: building writes build/ and *.egg-info next to the sources
    shutil.copytree(
        Path(__file__).resolve().parents[1], root, symlinks=True,
        ignore=shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info", "__pycache__", "site"),
    )  # fmt: skip
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(root)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = dist.glob("rlnb-*.whl")
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(next(n for n in zf.namelist() if n.endswith("METADATA"))).decode()
    # no dask-cuda build exists for macOS or Windows: required on Linux only
    assert 'Requires-Dist: dask-cuda>=26.10; sys_platform == "linux"' in metadata
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    # the dependencies come from this environment's site-packages (a .pth line adds the directory; the
    # editable install of rlnb there is not activated, since .pth files of added directories are not read)
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run(
        [str(python), "-c", "import rlnb, rlnb.config as c; print(rlnb.__file__); print(sorted(c.bundled_recipes()))"],
        capture_output=True, text=True, cwd=elsewhere, check=True,
    ).stdout  # fmt: skip
    assert where.startswith(site) and "ppo_cartpole" in where, where
    out = subprocess.run(
        [str(python), "-m", "rlnb.cli", "run", "ppo_cartpole", "runner.steps=2", "runner.tensorboard=false",
         "--run-dir", str(tmp_path / "run"), "--no-progress"],
        capture_output=True, text=True, cwd=elsewhere, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert complete_checkpoints(tmp_path / "run")


def test_a_hub_id_is_never_replaced_by_a_random_model(cluster, tmp_path, monkeypatch):
    """`actor.model_path=org/name` used to build a random tiny LM in ./org/name (build_if_missing)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a machine without internet
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    overrides = ["actor.model_path=rlnb-test/not-cached", "runner.tensorboard=false"]
    placed = [cluster.placed_on(s) for s in range(cluster.num_slots)]
    with pytest.raises(
        rlnb.ConfigError, match="actor.model_path: 'rlnb-test/not-cached' is not a local directory"
    ) as e:
        GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run")
    assert e.value.key == "actor.model_path" and "huggingface-cli download" in str(e.value)
    assert not (tmp_path / "rlnb-test").exists()
    assert [cluster.placed_on(s) for s in range(cluster.num_slots)] == placed  # nothing was launched


def test_a_hub_id_in_the_local_cache_loads_through_from_pretrained(tmp_path):
    import os

    from rlnb.models.lm import build_tiny_lm, is_hub_id

    # the Hugging Face cache layout, made locally: hub/models--org--name/{refs/main, snapshots/<rev>/}
    revision = "0" * 40
    repo = tmp_path / "hf" / "hub" / "models--rlnb-test--tiny"
    build_tiny_lm(repo / "snapshots" / revision, 32, 1, 2, seed=0)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    assert (
        is_hub_id("rlnb-test/tiny") and not is_hub_id("./models/tiny") and not is_hub_id("runs/models/tiny")
    )
    # a fresh process: huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when imported
    code = (
        "from rlnb.models.lm import load_lm; m, t = load_lm('rlnb-test/tiny'); "
        "print(m.config.model_type, t.pad_token_id is not None)"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.split() == ["qwen2", "True"], out.stderr[-2000:]


def test_lm_actor_honours_target_kl_and_anneal_lr_and_accepts_compile(cluster, tmp_path):
    # 60 SFT steps: ~1 answer in 8 right, so groups differ in reward and the update moves the policy (after
    # 10 steps, ~2 of 128 were: a step whose groups were all wrong moved it by weight decay alone, ~1e-12)
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=2", "actor.sft_steps=60",
                 "algorithm.update_epochs=3", "algorithm.target_kl=1e-12", "actor.anneal_lr=true"]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        trained = [r for r in loop.history if "train/epochs" in r]
    # epoch 1 starts at the sampling policy (approx_kl 0); after it the KL exceeds the target: 2 of 3 epochs
    assert [r["train/epochs"] for r in trained] == [2.0, 2.0]
    lr = loop.recipe.actor.lr
    assert [r["train/lr"] for r in trained] == pytest.approx([lr, lr / 2])  # annealed over runner.steps=2
    # actor.compile=true is served now (tests/test_compile.py compiles the LM actor's step on a worker)
    assert rlnb.config.load_recipe("grpo_arith", ["actor.compile=true"]).actor.compile is True


def test_resume_purges_tensorboard_and_tolerates_a_torn_metrics_line(cluster, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = ["runner.steps=4", "runner.save_interval=2", "runner.stop_return=100000", "env.num_envs=4",
                 "rollout.steps_per_rollout=16"]  # fmt: skip
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        loop.run(3, progress=False)  # checkpoint at 2, then step 3 is logged and lost
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "env/episode_ret')  # a killed driver's torn last line
    with Loop.resume(tmp_path, cluster=cluster) as loop:
        assert loop.step == 2
        loop.run(progress=False)
    steps = []
    for events in sorted((tmp_path / "tensorboard").glob("events.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if "train/policy_loss" in acc.Tags()["scalars"]:
            steps.append([e.step for e in acc.Scalars("train/policy_loss")])
    assert steps[0][:2] == [1, 2] and steps[-1] == [3, 4]
    acc = EventAccumulator(str(tmp_path / "tensorboard"))  # the directory, as TensorBoard reads it
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/policy_loss")] == [1, 2, 3, 4]  # no overlapping points
    assert [r["step"] for r in rlnb.metrics.read_metrics(tmp_path) if "train/policy_loss" in r] == [
        1,
        2,
        3,
        4,
    ]


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
        intake = loop._hand_batches()  # the same batch again: what each actor rank receives
    assert "train/loss" in record
    assert [i["sequences"] for i in intake] == [64, 64]  # 16 prompts x 8 completions, whole groups per rank


def test_env_and_rollout_partly_sharing_slots_is_refused_before_anything_starts(tmp_path):
    overrides = ["cluster.component_placement={actor: 0, rollout: 0, env: 0-1}", "cluster.slots=2"]
    with pytest.raises(rlnb.PlacementError, match=r"env \[0, 1\] and rollout \[0\] share slot\(s\) \[0\]"):
        Loop.from_recipe("ppo_cartpole", overrides, run_dir=tmp_path)  # no cluster given: none was started


def test_mujoco_resume_is_exact(cluster, tmp_path):
    """Pickling rebuilt MuJoCo envs from their constructor arguments: physics state and RNG were lost."""
    from tests.conftest import without_wall_clock

    base = ["runner.steps=4", "runner.save_interval=2", "runner.tensorboard=false", "runner.eval_interval=0",
            "runner.stop_return=100000", "rollout.steps_per_rollout=24", "env.num_envs=4",
            "algorithm.update_epochs=2", "algorithm.num_minibatches=2"]  # fmt: skip
    with Loop.from_recipe("ppo_mujoco", base, cluster=cluster, run_dir=tmp_path / "full") as loop:
        full = [without_wall_clock(r) for r in loop.run(progress=False)]
    with Loop.from_recipe("ppo_mujoco", base, cluster=cluster, run_dir=tmp_path / "cut") as loop:
        loop.run(2, progress=False)
    with Loop.resume(tmp_path / "cut", cluster=cluster) as loop:
        resumed = [without_wall_clock(r) for r in loop.run(progress=False)]
    assert resumed == full[2:]


@pytest.mark.parametrize("recipe", ["ppo_mujoco", "grpo_arith"])
def test_evaluating_between_steps_does_not_change_training(cluster, tmp_path, recipe):
    """A deterministic evaluation used to draw from the rollout's sampling generator (continuous
    actions) or shift its seeds (greedy LM decoding), so evaluating in a notebook changed the run."""
    from tests.conftest import without_wall_clock

    small = {
        "ppo_mujoco": ["env.num_envs=4", "rollout.steps_per_rollout=16", "algorithm.update_epochs=1"],
        "grpo_arith": [*GRPO_SMALL, "actor.sft_steps=10", "data.eval_size=8", "data.prompts_per_step=4"],
    }[recipe]
    overrides = [*small, "runner.tensorboard=false", "runner.eval_interval=0", "runner.stop_return=100000",
                 "cluster.component_placement={'actor,rollout,env,reward': 0}"]  # fmt: skip
    runs = []
    for evaluate in (False, True):
        run_dir = tmp_path / str(evaluate)
        loop_cls = GRPOLoop if recipe == "grpo_arith" else Loop
        extra = [f"actor.model_path={tmp_path / 'model'}"] if recipe == "grpo_arith" else []
        place = [
            o.replace(",reward", "") if recipe == "ppo_mujoco" else o.replace(",env", "") for o in overrides
        ]
        with loop_cls.from_recipe(recipe, [*place, *extra], cluster=cluster, run_dir=run_dir) as loop:
            if recipe == "grpo_arith":
                loop.sft()
            records = [loop.step_once()]
            if evaluate:
                loop.evaluate(2) if recipe == "ppo_mujoco" else loop.evaluate()
            records.append(loop.step_once())
        runs.append([without_wall_clock(r) for r in records])
    assert runs[0] == runs[1]


def test_resume_continues_the_same_wandb_run(cluster, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no account, no network: runs are written locally
    monkeypatch.setenv("WANDB_SILENT", "true")
    overrides = ["runner.steps=3", "runner.save_interval=2", "runner.tensorboard=false", "runner.stop_return=100000",
                 "runner.wandb_project=rlnb-test", "env.num_envs=4", "rollout.steps_per_rollout=16"]  # fmt: skip
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        loop.run(2, progress=False)
    run_id = (tmp_path / "wandb_run_id").read_text()
    with Loop.resume(tmp_path, cluster=cluster) as loop:
        loop.run(progress=False)
    # one offline folder per process, named by the second it started (wandb adds "-1" when two share one),
    # each holding the same run's records: one run, resumed
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    records = [sorted(f.name for f in run.glob("run-*.wandb")) for run in runs]
    assert len(runs) == 2 and records == [[f"run-{run_id}.wandb"]] * 2, (run_id, runs, records)


def test_gpu_check_dry_run_checks_the_plan_and_imports_without_a_gpu(tmp_path):
    """`make gpu-check DRY_RUN=1`: the plan, the imports and the recipes it loads, on a CPU machine, exit 0."""
    import json
    import subprocess
    import sys

    report = tmp_path / "gpu-check.json"
    out = subprocess.run(
        [sys.executable, "-m", "rlnb.gpu_check", "--dry-run", "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(report.read_text())
    assert (
        plan["dry_run"] and plan["plan"][0] == "environment" and "nccl_broadcast_two_groups" in plan["plan"]
    )
    assert plan["imports"]["rlnb.loop"] == "ok" and sorted(plan["recipes"]) == [
        "grpo_arith",
        "ppo_cartpole",
        "ppo_maniskill",
    ]
    bad = subprocess.run(
        [sys.executable, "-m", "rlnb.gpu_check", "--only", "clustr"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "unknown check(s) ['clustr']" in bad.stderr


# the three places a reward scores: in-process next to the rollout, on its own slot, asynchronously
SCORING_PATHS = [
    ["cluster.component_placement={'actor,rollout,reward': 0}"],
    ["cluster.component_placement={'actor,rollout': 0, reward: 1}"],
    ["cluster.component_placement={'rollout,reward': 0, actor: 1}", "algorithm.max_staleness=1"],
]
SCORING_PATH_IDS = ["scored-next-to-the-rollout", "scored-on-its-own-slot", "asynchronous"]


def half_point(completion: str) -> float:
    """A reward of 0.5 whatever the completion (with weight 2.0: 1.0, which an accuracy of the weighted sum
    would count as right)."""
    return 0.5


@pytest.mark.parametrize("placement", SCORING_PATHS, ids=SCORING_PATH_IDS)
def test_several_weighted_rewards_are_summed_and_logged_apart(cluster, tmp_path, monkeypatch, placement):
    """``reward.name: [arithmetic, half_point]`` with ``reward.weights: [1, 2]`` (TRL's reward_funcs and
    reward_weights), on workers in each scoring path: each reward's mean is logged, the training reward is
    the weighted sum, and accuracy counts the first reward alone."""
    from rlnb.algorithms.rewards import REWARDS, register_reward

    monkeypatch.setattr(REWARDS, "_items", dict(REWARDS._items))  # registered for this test only
    register_reward("half_point")(half_point)
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=3", "actor.sft_steps=40",
                 "reward.name=[arithmetic,half_point]", "reward.weights=[1,2]", *placement]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        group = loop.sample_group(0)
        tried = loop.try_prompt("2+3=", "5")
    steps = [r for r in loop.history if "reward/mean" in r]
    assert len(steps) == 3
    for r in steps:
        assert r["reward/half_point/mean"] == 0.5
        assert r["reward/mean"] == pytest.approx(r["reward/arithmetic/mean"] + 2 * 0.5)
        assert r["reward/accuracy"] == pytest.approx(r["reward/arithmetic/mean"])  # 0/1 scores
    assert any(r["reward/accuracy"] > 0 for r in steps)  # the warm start answers some
    for row in [*group, *tried]:
        assert row["rewards"]["half_point"] == 0.5
        assert row["reward"] == pytest.approx(row["rewards"]["arithmetic"] + 1.0)
    evals = [r for r in loop.history if "eval/accuracy" in r]
    assert evals and all(r["eval/reward_mean"] == pytest.approx(r["eval/accuracy"] + 1.0) for r in evals)


def test_reward_functions_from_a_notebook_cell_are_weighted_on_a_worker(cluster):
    def exact(completion, answer):
        return float(completion.strip() == answer)

    def short(completion):
        return -0.1 * len(completion)

    reward = rlnb.RewardWorker.launch(cluster, "1", fn=[exact, short], weights=[1.0, 0.5])
    try:
        scored = reward.score_terms(["4", "5 "], ["4", "4"]).result()[0]
        assert scored["terms"] == {"exact": [1.0, 0.0], "short": [pytest.approx(-0.1), pytest.approx(-0.2)]}
        assert scored["rewards"] == [pytest.approx(0.95), pytest.approx(-0.1)]
        assert reward.score(["4"], ["4"]).result() == [[pytest.approx(0.95)]]
    finally:
        reward.shutdown()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["reward.name=[arithmetic,fromat]"],
            r"reward.name\[1\]: unknown reward 'fromat'.*Did you mean 'format'",
        ),
        (["reward.name=[arithmetic,format]", "reward.weights=[1]"], r"reward.weights: expected a list of 2"),
        (["reward.name=[format,format]"], r"reward.name: each reward is logged under its name, and 'format'"),
        (["reward.name=[]"], r"reward.name: expected a reward or a non-empty list"),
        (
            ["reward.weights=[.nan]"],
            r"reward.weights\[0\]: expected a finite number \(the weight of 'arithmetic'\)",
        ),
    ],
)
def test_bad_reward_lists_are_refused_naming_the_key(overrides, message):
    from rlnb.config import load_recipe

    with pytest.raises(rlnb.ConfigError, match=message):
        load_recipe("grpo_arith", overrides)


def test_grpo_through_the_cli_with_two_rewards_shows_rlnb_progress_only(tmp_path):
    """``rlnb run grpo_arith reward.name=[...] reward.weights=[...]``: the list overrides reach the workers, each
    reward is logged, and the workers' ``transformers`` bars ("Loading weights", one per rank and model) are
    not interleaved in the terminal."""
    out = subprocess.run(
        [*RLNB, "run", "grpo_arith", "reward.name=[arithmetic,format]", "reward.weights=[1,0.5]",
         "runner.steps=2", "actor.sft_steps=5", "data.eval_size=8", "runner.eval_interval=0",
         "runner.tensorboard=false", f"actor.model_path={tmp_path / 'model'}", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Loading weights" not in out.stderr and "Writing model shards" not in out.stderr, out.stderr[
        -3000:
    ]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward/format/mean" in r and "reward/arithmetic/mean" in r] == [
        1,
        2,
    ]


def parity(level: int) -> float:
    """A reward read from the prompt record's own ``level`` field (nothing of the completion)."""
    return float(level)


def _group_or_none(loop, group: int) -> list[dict]:
    try:
        return loop.sample_group(group)
    except rlnb.RemoteError:  # past this actor rank's share of the batch
        return []


def _parity_records(path):
    rows = [
        {"question": f"{a}+{b}=", "answer": str(a + b), "level": (a + b) % 2}
        for a in range(10)
        for b in range(10)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return {r["question"]: r["level"] for r in rows}


@pytest.mark.parametrize("placement", SCORING_PATHS, ids=SCORING_PATH_IDS)
def test_rewards_read_the_prompt_records_other_fields(cluster, tmp_path, monkeypatch, placement):
    """A reward taking ``level`` gets each completion's record's ``level`` column (TRL passes a dataset's
    columns to its reward functions), on workers in every scoring path, in evaluation and in try_prompt."""
    from rlnb.algorithms.rewards import REWARDS, register_reward

    monkeypatch.setattr(REWARDS, "_items", dict(REWARDS._items))
    register_reward("parity")(parity)
    level = _parity_records(tmp_path / "data.jsonl")
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=2", "actor.sft_steps=5",
                 "data.task=file", f"data.path={tmp_path / 'data.jsonl'}", "reward.name=[arithmetic,parity]",
                 "data.eval_size=10", *placement]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        rows = [row for g in range(loop.recipe.data.prompts_per_step) for row in _group_or_none(loop, g)]
        tried = loop.try_prompt("2+3=", "5", level=1)
        held_out = [p.prompt for p in loop.task.held_out[:10]]
    assert {row["rewards"]["parity"] == level[row["prompt"]] for row in rows} == {True}
    assert {0.0, 1.0} <= {row["rewards"]["parity"] for row in rows}
    assert [row["rewards"]["parity"] for row in tried] == [1.0] * len(tried)
    evals = [r for r in loop.history if "eval/accuracy" in r]
    expected = sum(level[p] for p in held_out) / len(held_out)
    assert evals and all(r["eval/reward_mean"] == pytest.approx(r["eval/accuracy"] + expected) for r in evals)


def test_a_reward_needing_a_field_the_records_lack_is_refused_before_anything_runs(
    cluster, tmp_path, monkeypatch
):
    from rlnb.algorithms.rewards import REWARDS, register_reward
    from rlnb.config import load_recipe

    monkeypatch.setattr(REWARDS, "_items", dict(REWARDS._items))
    register_reward("parity")(parity)
    with pytest.raises(
        rlnb.ConfigError, match=r"reward 'parity' needs input\(s\) level .*these records have none"
    ):
        load_recipe("grpo_arith", ["reward.name=parity"])  # procedural arithmetic: no fields
    data = tmp_path / "data.jsonl"
    data.write_text(
        "\n".join(json.dumps({"question": f"{a}+1=", "answer": str(a + 1), "src": "x"}) for a in range(20))
    )
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "data.task=file", f"data.path={data}",
                 "reward.name=parity", "actor.sft_steps=0"]  # fmt: skip
    recipe = load_recipe("grpo_arith", overrides)  # the file's columns are not known yet: checked at build
    with pytest.raises(rlnb.ConfigError, match=r"needs input\(s\) level .*these records have src"):
        GRPOLoop(recipe, cluster=cluster, run_dir=tmp_path / "run")


def test_grpo_raises_a_learned_reward_models_score_on_workers(cluster, tmp_path):
    """``reward.model_path``: a sequence-classification reward model (TRL's model in ``reward_funcs``), loaded
    on the workers, scores prompt + completion in batches; GRPO raises its score, and a completion's reward on
    the worker is the model's score of it here."""
    from rlnb.algorithms import RewardModel
    from rlnb.models import build_tiny_reward_model

    rm = build_tiny_reward_model(tmp_path / "rm", seed=0)
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=30", "actor.sft_steps=40",
                 "data.eval_size=20", "reward.name=[]", f"reward.model_path={rm}", "reward.model_batch_size=5",
                 "rollout.max_new_tokens=6"]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        rows = loop.sample_group(0)
    rewards = [r["reward/mean"] for r in loop.history if "reward/mean" in r]
    assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.04, rewards
    here = RewardModel(rm).score_batch([r["completion"] for r in rows], [r["prompt"] for r in rows])
    assert [r["reward"] for r in rows] == pytest.approx(here, abs=1e-5)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["reward.model_path=/no/such/rm"], r"reward.model_path: '/no/such/rm' has no config.json"),
        (["reward.model_path={rm}", "reward.weights=[1]"], r"reward.weights: expected a list of 2 number\(s\), one "
         r"per reward in \['arithmetic', 'reward_model'\]"),
        (["reward.model_path={rm}", "reward.model_batch_size=0"], r"reward.model_batch_size: expected an integer >= 1"),
    ],
)  # fmt: skip
def test_bad_reward_model_settings_are_refused_naming_the_key(tmp_path, overrides, message):
    from rlnb.config import load_recipe
    from rlnb.models import build_tiny_reward_model

    rm = build_tiny_reward_model(tmp_path / "rm")
    with pytest.raises(rlnb.ConfigError, match=message):
        load_recipe("grpo_arith", [o.format(rm=rm) for o in overrides])


def test_a_batched_reward_that_raises_scores_zero_on_a_worker(cluster, tmp_path):
    """A reward scored a batch at a time (``score_batch``) that raises on the worker (here, a reward model
    whose directory is gone) scores the batch 0.0, logged once, as a reward scored one by one does."""
    from rlnb.algorithms import RewardModel

    reward = rlnb.RewardWorker.launch(cluster, "1", fn=["arithmetic", RewardModel(tmp_path / "gone")])
    try:
        scored = reward.score_terms(["4", "5"], ["4", "4"]).result()[0]
    finally:
        reward.shutdown()
    assert scored == {"rewards": [1.0, 0.0], "terms": {"arithmetic": [1.0, 0.0], "reward_model": [0.0, 0.0]}}


@pytest.mark.parametrize("placement", SCORING_PATHS, ids=SCORING_PATH_IDS)
def test_truncated_completions_are_marked_for_the_actor_on_workers(cluster, tmp_path, placement):
    """Completions cut at ``rollout.max_new_tokens`` reach the actor marked (``truncated``, what
    ``algorithm.mask_truncated_completions`` leaves out of the loss), through every hand-off, and their share
    is logged as ``rollout/truncated_frac``."""
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=2", "actor.sft_steps=5",
                 "rollout.max_new_tokens=2", "algorithm.mask_truncated_completions=true", *placement]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        rows = [row for g in range(loop.recipe.data.prompts_per_step) for row in _group_or_none(loop, g)]
        shares = [r["rollout/truncated_frac"] for r in loop.history if "rollout/truncated_frac" in r]
    assert len(shares) == 2 and 0 < shares[-1] <= 1
    assert {row["truncated"] for row in rows} <= {True, False} and any(row["truncated"] for row in rows)
    if "actor,rollout,reward" in placement[0]:  # one rank holds the whole batch
        assert sum(row["truncated"] for row in rows) / len(rows) == pytest.approx(shares[-1])


def test_completions_are_logged_every_interval_and_resume_drops_later_ones(cluster, tmp_path):
    """``runner.completions_interval`` (TRL's log_completions): the group actor rank 0 trained on, written on
    the driver every N steps to completions.jsonl; a resume from an earlier checkpoint drops the rows of the
    steps it recomputes, as it drops their metrics."""
    from rlnb.metrics import read_table

    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=4", "actor.sft_steps=5",
                 "runner.completions_interval=2", "runner.save_interval=2"]  # fmt: skip
    run_dir = tmp_path / "run"
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=run_dir) as loop:
        loop.run(progress=False)
        group_size = loop.recipe.algorithm.group_size
    rows = read_table(run_dir)
    assert [r["step"] for r in rows] == [2] * group_size + [4] * group_size
    assert {"prompt", "completion", "reward", "advantage"} <= set(rows[0])
    assert len({r["prompt"] for r in rows if r["step"] == 2}) == 1  # one prompt's group
    import shutil

    shutil.rmtree(run_dir / "checkpoints" / "step_000004")  # as if the run died after step 4's rows
    with GRPOLoop.resume(run_dir) as loop:
        assert loop.step == 2
        assert [r["step"] for r in read_table(run_dir)] == [2] * group_size
        loop.run(progress=False)
    assert [r["step"] for r in read_table(run_dir)] == [2] * group_size + [4] * group_size


def test_completions_interval_is_refused_for_an_env_recipe():
    from rlnb.config import load_recipe

    with pytest.raises(rlnb.ConfigError, match=r"runner.completions_interval: 2 logs an LM's completions"):
        load_recipe("ppo_cartpole", ["runner.completions_interval=2"])


def odd_length_if_mixed(completion: str, mixed: int) -> float:
    """A learning signal only for records with ``mixed=1``: their groups' completions score 0 or 1 by length;
    a ``mixed=0`` record's group scores 0 throughout."""
    return float(mixed and len(completion) % 2)


@pytest.mark.parametrize(
    "placement", [*SCORING_PATHS[:2], []], ids=[*SCORING_PATH_IDS[:2], "two-rollout-ranks-data-parallel"]
)
def test_dynamic_sampling_fills_the_batch_with_groups_that_have_a_signal(
    cluster, tmp_path, monkeypatch, placement
):
    """``algorithm.dynamic_sampling`` (DAPO; veRL's filter_groups), on workers: half the records can give a
    learning signal; the trained batch holds only their groups, after more than one round of sampling."""
    from rlnb.algorithms.rewards import REWARDS, register_reward

    monkeypatch.setattr(REWARDS, "_items", dict(REWARDS._items))
    register_reward("odd_length_if_mixed")(odd_length_if_mixed)
    rows = [
        {"question": f"{a}+{b}=", "answer": str(a + b), "mixed": (a + b) % 2}
        for a in range(10)
        for b in range(10)
    ]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    mixed = {r["question"]: r["mixed"] for r in rows}
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=2", "actor.sft_steps=0",
                 "data.task=file", f"data.path={tmp_path / 'data.jsonl'}", "reward.name=odd_length_if_mixed",
                 "rollout.max_new_tokens=6", "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=6",
                 *placement]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        groups = [g for i in range(loop.recipe.data.prompts_per_step) if (g := _group_or_none(loop, i))]
    steps = [r for r in loop.history if "rollout/sampling_rounds" in r]
    assert len(steps) == 2 and all(r["rollout/sampling_rounds"] >= 2 for r in steps), steps
    assert all(r["rollout/informative_frac"] == 1.0 and r["rollout/signal_frac"] < 0.8 for r in steps), steps
    assert groups and all(mixed[g[0]["prompt"]] == 1 for g in groups)
    assert all(len({row["reward"] for row in g}) == 2 for g in groups)  # each with a signal


@pytest.mark.parametrize(
    "recipe,overrides,message",
    [
        ("grpo_arith", ["algorithm.dynamic_sampling=true", "algorithm.max_staleness=1",
                        "cluster.component_placement={'rollout,reward': 0, actor: 1}"],
         r"algorithm.dynamic_sampling: .*with algorithm.max_staleness=1 \(asynchronous\)"),
        ("grpo_arith", ["algorithm.max_sampling_rounds=0"], r"algorithm.max_sampling_rounds: expected an integer >= 1"),
        ("ppo_cartpole", ["algorithm.dynamic_sampling=true"], r"algorithm.dynamic_sampling: it filters an LM's groups"),
    ],
)  # fmt: skip
def test_dynamic_sampling_misfits_are_refused_naming_the_key(recipe, overrides, message):
    from rlnb.config import load_recipe

    with pytest.raises(rlnb.ConfigError, match=message):
        load_recipe(recipe, overrides)


CONVERSATIONS = [
    {
        "prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{a}+{b}="}],
        "answer": str(a + b),
    }
    for a in range(8)
    for b in range(8)
]


def test_conversational_records_train_through_the_chat_template_on_workers(cluster, tmp_path):
    """TRL's conversational records (``prompt``: a list of messages) in a data file: each conversation goes
    through the model's chat template, its own system turn included; without data.chat_template it is refused."""
    data = tmp_path / "conversations.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in CONVERSATIONS))
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=2", "actor.sft_steps=5",
                 "data.task=file", f"data.path={data}", "data.question_key=prompt"]  # fmt: skip
    with pytest.raises(rlnb.ConfigError, match=r"data.chat_template: 64 record\(s\) of .* are conversations"):
        GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "refused")
    with GRPOLoop.from_recipe(
        "grpo_arith", [*overrides, "data.chat_template=true"], cluster=cluster, run_dir=tmp_path / "run"
    ) as loop:
        loop.run(progress=False)
        row = loop.sample_group(0)[0]
        tried = loop.try_prompt([{"role": "user", "content": "2+3="}], "5")
    # the tiny template: <bos>, a system line, "Q: " user turns, the assistant's "A: " opened
    assert row["prompt_tokens"].startswith("<bos>Add.\nQ: ") and row["prompt_tokens"].endswith("=\nA: "), row
    assert len(tried) == loop.recipe.algorithm.group_size


def test_conversational_records_from_objects_use_the_rollouts_template(cluster, tmp_path):
    from rlnb.models import build_tiny_lm

    model = str(build_tiny_lm(tmp_path / "tiny", hidden_size=32, num_layers=1, num_heads=2))
    rollout = rlnb.HFRollout.launch(cluster, "0", model_path=model, max_new_tokens=2)
    actor = rlnb.LMActor.launch(cluster, "1", model_path=model, group_size=4)
    with GRPOLoop(
        rollout=rollout, actor=actor, reward="arithmetic", prompts=CONVERSATIONS, prompts_per_step=4,
        runner={"tensorboard": False}, run_dir=tmp_path / "run",
    ) as loop:  # fmt: skip
        assert all(
            p.prompt.startswith("<bos>Add.\nQ: ") and p.prompt.endswith("=\nA: ") for p in loop.task.train
        )
        record = loop.step_once()
    assert math.isfinite(record["train/loss"])


def test_a_multi_turn_run_answers_again_after_a_wrong_answer_and_trains_on_the_models_turns_on_workers(
    cluster, tmp_path, monkeypatch
):
    """``rollout.max_turns=3`` with ``arithmetic_retry`` on workers: a wrong answer is told `` no. `` and the
    model answers again, up to three times; a right one ends the transcript. The reward scores the whole
    transcript, the model's own turns are what the actor's recomputed log-probs match (the first epoch's ratio
    is 1: the replies are out of the mask), and evaluation runs the same turns greedily."""
    import re

    from rlnb.algorithms.rewards import REWARDS, register_reward

    monkeypatch.setattr(REWARDS, "_items", dict(REWARDS._items))
    register_reward("last_answer")(last_answer)
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=2", "actor.sft_steps=40",
                 "rollout.max_turns=3", "rollout.interaction=arithmetic_retry", "reward.name=last_answer",
                 "runner.eval_interval=2", "data.eval_size=8",
                 "cluster.component_placement={'actor,rollout,reward': 0}"]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        rows = [row for g in range(loop.recipe.data.prompts_per_step) for row in _group_or_none(loop, g)]
        history, evaluated = loop.history, loop.last_samples
    assert len(rows) == 16 * 8
    replies = [row["completion"].count(" no. ") for row in rows]
    assert max(replies) == 2 and 0 in replies and 1 in replies  # retried, up to max_turns - 1 times
    for row, n in zip(rows, replies):
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", row["prompt"]).groups())
        assert row["reward"] == last_answer(row["completion"], str(a + b))
        if n < 2:  # the transcript ended early: its last answer was right
            assert row["reward"] == 1.0
    trained = [r for r in history if "train/ratio_mean" in r]
    assert len(trained) == 2 and all(abs(r["train/ratio_mean"] - 1) < 1e-4 for r in trained)
    # the model's turns: one more than the replies; the step's mean over all 128 transcripts
    assert trained[-1]["rollout/turns_mean"] == pytest.approx(1 + sum(replies) / len(replies))
    assert all(abs(r["train/approx_kl"]) < 1e-6 for r in trained)
    assert {r["eval/size"] for r in history if "eval/size" in r} == {8}
    for (
        _,
        text,
        answer,
    ) in evaluated:  # greedy transcripts: told `` no. `` exactly when the first answer is wrong
        assert text.count(" no. ") <= 2 and (" no. " in text) == (
            last_answer(text.split(" no. ")[0], answer) < 1
        )


@pytest.mark.parametrize(
    "recipe, overrides, message",
    [
        ("grpo_arith", ["rollout.max_turns=0"], "rollout.max_turns: expected an integer >= 1"),
        ("grpo_arith", ["rollout.max_turns=2"], "rollout.interaction: with rollout.max_turns=2 something must"),
        ("grpo_arith", ["rollout.interaction=arithmetic_retry"], "rollout.interaction: it answers between"),
        ("grpo_arith", ["rollout.max_turns=2", "rollout.interaction=arithmetic_retyr"],
         "rollout.interaction: unknown interaction 'arithmetic_retyr'.*Did you mean 'arithmetic_retry'"),
        ("ppo_cartpole", ["rollout.max_turns=2", "rollout.interaction=arithmetic_retry"],
         "rollout.max_turns: turns of an LM's conversation"),
    ],
)  # fmt: skip
def test_multi_turn_misfits_are_refused_naming_the_key(recipe, overrides, message):
    with pytest.raises(rlnb.ConfigError, match=message):
        rlnb.config.load_recipe(recipe, overrides)


def test_grpo_with_a_retry_raises_the_final_answers_reward_on_workers(cluster, tmp_path, monkeypatch):
    """Two turns (``arithmetic_retry``), rewarded on the transcript's last answer, over two data-parallel ranks:
    seeded, 80 steps take the reward's mean from 0.49 to 0.59 (first and last ten steps); threshold +0.05."""
    from rlnb.algorithms.rewards import REWARDS, register_reward

    monkeypatch.setattr(REWARDS, "_items", dict(REWARDS._items))
    register_reward("last_answer")(last_answer)
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=80", "rollout.max_turns=2",
                 "rollout.interaction=arithmetic_retry", "reward.name=last_answer"]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        rewards = [r["reward/mean"] for r in loop.history if "reward/mean" in r]
        accuracy = loop.evaluate()["eval/accuracy"]
    assert len(rewards) == 80
    assert sum(rewards[-10:]) / 10 >= sum(rewards[:10]) / 10 + 0.05, rewards
    assert accuracy >= 0.5


def hinted(completion: str, turn: int, hint: str) -> str | None:
    """An interaction reading a field of each prompt record (as a notebook cell would define it)."""
    return f" {hint}{turn}:" if turn < 3 else None


def test_an_interaction_function_reads_each_records_fields_on_the_objects_path(cluster, tmp_path):
    """``HFRollout.launch(..., max_turns=3, interaction=fn)``: a plain function travels to the worker and is
    given each completion's own record's field and its turn; the loop evaluates with the same turns."""
    from rlnb.models import build_tiny_lm

    model = str(build_tiny_lm(tmp_path / "tiny", hidden_size=32, num_layers=1, num_heads=2))
    records = [
        {"question": f"{a}+{b}=", "answer": str(a + b), "hint": "xy"[a % 2]}
        for a in range(6)
        for b in range(3)
    ]
    rollout = rlnb.HFRollout.launch(
        cluster, "0", model_path=model, max_new_tokens=2, max_turns=3, interaction=hinted
    )
    actor = rlnb.LMActor.launch(cluster, "1", model_path=model, group_size=4)
    with GRPOLoop(
        rollout=rollout, actor=actor, reward="arithmetic", prompts=records, prompts_per_step=4,
        runner={"tensorboard": False}, run_dir=tmp_path / "run",
    ) as loop:  # fmt: skip
        record = loop.step_once()
        rows = loop.sample_group(0) + loop.sample_group(1)
        loop.evaluate(4)
        evaluated = loop.last_samples
        tried = loop.try_prompt("3+1=", "4", hint="z")  # as training samples it: the same turns
    assert math.isfinite(record["train/loss"]) and abs(record["train/ratio_mean"] - 1) < 1e-4
    for row in rows:
        hint = "xy"[int(row["prompt"].split("+")[0]) % 2]
        assert f" {hint}1:" in row["completion"] and f" {hint}2:" in row["completion"], row
    assert all(f" {'xy'[int(p.split('+')[0]) % 2]}2:" in text for p, text, _ in evaluated)
    assert len(tried) == 4 and all(" z1:" in r["completion"] and " z2:" in r["completion"] for r in tried)


def final_answer(completion: str, answer: str) -> float:
    """A tool-use reward: 1.0 if what the transcript says after the tool's last result is the answer."""
    return 1.0 if completion.rsplit(";", 1)[-1].strip() == answer else 0.0


def test_grpo_learns_to_call_the_calculator_right_on_workers(cluster, tmp_path):
    """Agentic RL with a tool on workers: two-digit products the tiny model cannot compute, a ``calculator``
    interaction on the rollout ranks, and a warm start from a teacher that calls it wrong (``calc(a+b)``) 65 %
    of the time and copies its result after. Held-out greedy accuracy: 0.0 after the warm start, the model
    calling the wrong expression; seeded, 60 GRPO steps on two data-parallel ranks take it to 0.99 (threshold
    0.8), the reward rewarding only the final answer."""
    import random

    from rlnb.models import build_tiny_lm

    problems = [(a, b) for a in range(10, 40) for b in range(10, 40)]
    random.Random(0).shuffle(problems)
    records = [{"question": f"{a}*{b}=", "answer": str(a * b)} for a, b in problems[:800]]
    model = str(build_tiny_lm(tmp_path / "tiny", hidden_size=64, num_layers=2, num_heads=4, seed=0))
    rollout = rlnb.HFRollout.launch(
        cluster, "0-1", model_path=model, max_new_tokens=12, max_turns=2, interaction="calculator"
    )
    actor = rlnb.LMActor.launch(cluster, "0-1", model_path=model, group_size=8, lr=2e-4)
    with GRPOLoop(
        rollout=rollout, actor=actor, reward=final_answer, prompts=records, prompts_per_step=16, eval_size=100,
        runner={"tensorboard": False, "eval_interval": 0}, run_dir=tmp_path / "run",
    ) as loop:  # fmt: skip
        train = [tuple(map(int, p.prompt[:-1].split("*"))) for p in loop.task.train]
        # the warm start: the call (right or wrong), then the answer after the tool's result
        calls = [f"{a}*{b}=" for a, b in train]
        copies = [f"{a}*{b}=calc({a}*{b})<eos> = {a * b};" for a, b in train]
        right = [f"calc({a}*{b})" for a, b in train] + [str(a * b) for a, b in train]
        wrong = [f"calc({a}+{b})" for a, b in train] + [str(a * b) for a, b in train]
        actor.sft(calls + copies, right, 300, 32, 3e-3, wrong, 0.65).result()
        before = loop.evaluate()["eval/accuracy"]
        wrong_calls = sum("+" in text for _, text, _ in loop.last_samples)
        loop.run(60, progress=False)
        after = loop.evaluate()["eval/accuracy"]
        samples = loop.last_samples
    assert before <= 0.2 and wrong_calls >= 6, (before, wrong_calls)  # it calls calc(a+b)
    assert after >= 0.8, after
    for prompt, text, answer in samples:  # each through the tool: the call, its result, the answer copied
        if final_answer(text, answer):
            assert text == f"calc({prompt[:-1]}) = {answer};{answer}", text


def test_the_calculator_recipe_warm_starts_on_tool_transcripts_and_grpo_learns_the_right_call_on_workers(
    cluster, tmp_path
):
    """``grpo_calculator``: the warm start's rows are each problem's conversation turn by turn, the calculator
    replying between them as in training (``data.sft_turns``); the imperfect teacher's call is ``calc(a+b)`` on
    65 % of the first turns and the second turn copies the right result. Held-out greedy accuracy: 0.0 after
    the warm start (it calls the wrong expression), at least 0.8 after the recipe's 60 steps (runs here: 1.0)."""
    overrides = [
        f"actor.model_path={tmp_path / 'model'}",
        "runner.tensorboard=false",
        "runner.eval_interval=0",
    ]
    with GRPOLoop.from_recipe(
        "grpo_calculator", overrides, cluster=cluster, run_dir=tmp_path / "run"
    ) as loop:
        contexts, targets, wrong_contexts, wrong_targets = turn_demonstrations(loop.task, loop.recipe)
        n = len(loop.task.train)
        assert len(contexts) == len(wrong_contexts) == 2 * n
        (first, call), (after, answer) = zip(contexts[:2], targets[:2])
        a, b = map(int, first[:-1].split("*"))
        assert call == f"calc({a}*{b})" and answer == str(a * b)
        assert after == [first, call, f" = {a * b};"]  # the calculator's own reply, as in training
        assert wrong_targets[0] == f"calc({a}+{b})" and (wrong_contexts[1], wrong_targets[1]) == (
            after,
            answer,
        )
        loop.sft()
        before = loop.evaluate()["eval/accuracy"]
        shown = loop.last_samples  # (the first few of the evaluation's transcripts)
        wrong_calls = sum(f"calc({p[:-1].replace('*', '+')})" in text for p, text, _ in shown)
        loop.run(progress=False)
        after = loop.evaluate()["eval/accuracy"]
        samples = loop.last_samples
    assert before <= 0.2 and wrong_calls >= len(shown) / 2, (before, wrong_calls, len(shown))
    assert after >= 0.8, after
    right = [(p, t, a) for p, t, a in samples if t.rsplit(";", 1)[-1] == a]
    assert all(t == f"calc({p[:-1]}) = {a};{a}" for p, t, a in right)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.sft_turns=['calc({expresion})', '{answer}']"],
         r"data.sft_turns: 'calc\({expresion}\)' names {expresion}; .*Did you mean 'expression'"),
        (["data.sft_noise_turns=['calc({a}+{b})']"],
         r"data.sft_noise_turns: expected a list of 2 format strings or nulls"),
        (["data.sft_noise_turns=null"], r"data.sft_noise: 0.65 of a multi-turn warm start's demonstrations"),
        (["rollout.max_turns=1", "rollout.interaction=null"], r"data.sft_turns: 2 turns, and the rollout takes"),
        (["data.min_operand=40"], r"data.min_operand: expected an integer from 0 to data.max_operand \(39\), got 40"),
        (["data.sft_turns=null"], r"data.sft_noise_turns: the imperfect teacher's turns need data.sft_turns"),
    ],
)  # fmt: skip
def test_the_calculator_recipes_warm_start_settings_are_checked_naming_the_key(overrides, message):
    with pytest.raises(rlnb.ConfigError, match=message):
        rlnb.config.load_recipe("grpo_calculator", overrides)

"""The command line: options, overrides, installed wheels, remote servers, the GPU check's dry run."""

import json
import os
import re
import subprocess
import sys

import pytest

import rlnb
from rlnb.loop import Loop, complete_checkpoints

RLNB = [sys.executable, "-m", "rlnb.cli"]


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
    # (every environment left out: .venv-vllm's gigabytes took this test past its 300 s in CI)
    shutil.copytree(
        Path(__file__).resolve().parents[1], root, symlinks=True,
        ignore=shutil.ignore_patterns(".git", ".venv*", "runs", "build", "*.egg-info", "__pycache__", "site"),
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
        names = zf.namelist()
    # the license travels with it, and type checkers read rlnb's annotations (PEP 561)
    assert "rlnb/py.typed" in names and any(n.endswith(("/LICENSE", "licenses/LICENSE")) for n in names), (
        names
    )
    assert "Classifier: License :: OSI Approved :: Apache Software License" in metadata
    assert "Requires-Dist: cryptography" in metadata  # (the embedded cluster's TLS)
    # dask-cuda (which pins dask to its release) only for GPU machines, on Linux, its one platform
    (cuda,) = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: dask-cuda")]
    assert 'extra == "cuda"' in cuda and 'sys_platform == "linux"' in cuda, cuda
    for needed in ("pandas", "tensorboard", "distributed"):  # imported by rlnb: declared
        assert re.search(rf"^Requires-Dist: {needed}[<>=]", metadata, flags=re.M), needed
    notebooks = sorted(Path(n).name for n in names if n.startswith("rlnb/notebooks/"))
    assert notebooks == sorted(
        p.name for p in (Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb")
    )
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
    # a pip user gets the notebooks: `rlnb notebooks DIR` copies them, and keeps what is there
    copy = [str(python), "-m", "rlnb.cli", "notebooks", "mine"]
    out = subprocess.run(copy, capture_output=True, text=True, cwd=elsewhere, timeout=120)
    assert out.returncode == 0 and "jupyter lab mine" in out.stdout, out.stderr
    assert sorted(p.name for p in (elsewhere / "mine").iterdir()) == notebooks
    out = subprocess.run(copy, capture_output=True, text=True, cwd=elsewhere, timeout=120)
    assert out.returncode == 2 and "already holds" in out.stderr and "--force" in out.stderr, out.stderr
    out = subprocess.run([*copy, "--force"], capture_output=True, text=True, cwd=elsewhere, timeout=120)
    assert out.returncode == 0, out.stderr


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
        timeout=600,  # (its ManiSkill recipe's check imports ManiSkill in a child process: 8 CPU-s)
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(report.read_text())
    assert (
        plan["dry_run"] and plan["plan"][0] == "environment" and "nccl_broadcast_two_groups" in plan["plan"]
    )
    assert plan["imports"]["rlnb.loop"] == "ok" and sorted(plan["recipes"]) == [
        "grpo_arith",
        "ppo_cartpole",
        "ppo_maniskill_gpu",
        "vla_pixelreach",
    ]
    bad = subprocess.run(
        [sys.executable, "-m", "rlnb.gpu_check", "--only", "clustr"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "unknown check(s) ['clustr']" in bad.stderr


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
    # the warm start has a bar of its own before the run's (it used to run silent for tens of seconds)
    warm = [line for line in out.stderr.replace("\r", "\n").splitlines() if "grpo_arith warm start" in line]
    assert warm and "5/5" in warm[-1] and "loss" in warm[-1], out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward/format/mean" in r and "reward/arithmetic/mean" in r] == [
        1,
        2,
    ]


def test_version_info_recipes_and_the_tensorboard_hint(tmp_path):
    """Issue 39's CLI: `--version`; `rlnb info` lists the packages' versions and the GPUs; `rlnb recipes` shows
    whole descriptions; `rlnb run` says how to open TensorBoard on its run. No dashboard address for the embedded
    cluster `rlnb info` starts and ends."""
    from rlnb.cli import recipe_description

    version = subprocess.run([*RLNB, "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.strip() == f"rlnb {rlnb.__version__}"
    info = subprocess.run([*RLNB, "info", "--slots", "1"], capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr[-2000:]
    for name in ("python", "rlnb", "torch", "transformers", "gymnasium", "dask", "distributed", "dask-cuda",
                 "vllm", "gpus"):  # fmt: skip
        assert any(line.split()[:1] == [name] for line in info.stdout.splitlines()), (name, info.stdout)
    # an embedded cluster's dashboard is gone once `rlnb info` has ended: no address of it printed
    assert "rlnb Cluster (embedded)" in info.stdout and "dashboard:" not in info.stdout, info.stdout
    env = {**os.environ, "COLUMNS": "80"}
    listed = subprocess.run([*RLNB, "recipes"], capture_output=True, text=True, timeout=60, env=env)
    flat = " ".join(listed.stdout.split())
    from rlnb.config import bundled_recipes

    for path in bundled_recipes().values():
        assert " ".join(recipe_description(path.read_text()).split()) in flat  # whole, not cut mid-sentence
    assert "GRPO must learn to call the right one." in flat
    run = subprocess.run([*RLNB, "run", "ppo_cartpole", "runner.steps=1", "--run-dir", str(tmp_path / "r"),
                          "--no-progress"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"tensorboard --logdir {tmp_path / 'r' / 'tensorboard'}" in run.stderr

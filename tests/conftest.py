import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


requires_gpu = pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU; this machine has none")


WALL_CLOCK = ("wall_time", "rollout/steps_per_s", "rollout/tokens_per_s", "rollout/overlap_frac")


def without_wall_clock(record: dict) -> dict:
    """A metric record without wall-clock quantities (they differ run to run; everything else must not)."""
    return {k: v for k, v in record.items() if not k.startswith("time/") and k not in WALL_CLOCK}


@pytest.fixture(scope="session")
def cluster():
    """One embedded 2-slot CPU cluster shared by the runtime tests that do not break it."""
    import rlnb

    c = rlnb.Cluster(slots=2, gpus=False)
    yield c
    c.close()


KILLED_DRIVER = """
import sys
import rlnb
from rlnb.loop import {loop}

address, run_dir, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
with rlnb.Cluster(address) as cluster:
    with {loop}.from_recipe("{recipe}", overrides, cluster=cluster, run_dir=run_dir) as loop:
        loop.run(progress=False)
"""


def kill_driver_after_a_checkpoint(
    cluster, loop: str, recipe: str, overrides, run_dir: Path, timeout_s=180
) -> int:
    """Run ``recipe`` with ``loop`` in a driver process on ``cluster``, SIGKILL it as soon as a checkpoint is
    complete (mid-run, work in flight most likely); the step of the last complete checkpoint."""
    from rlnb.loop import complete_checkpoints

    script = run_dir.parent / f"{run_dir.name}-driver.py"
    script.write_text(KILLED_DRIVER.format(loop=loop, recipe=recipe))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    driver = subprocess.Popen(
        [sys.executable, str(script), cluster.address, str(run_dir), *overrides], env=env
    )
    deadline = time.monotonic() + timeout_s
    while not complete_checkpoints(run_dir) and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    driver.send_signal(signal.SIGKILL)
    driver.wait(30)
    return int(complete_checkpoints(run_dir)[-1].name.split("_")[1])


def pytest_sessionfinish(session, exitstatus):
    """Remove shared-memory segments of processes the tests SIGKILLed (drivers, workers): a killed process
    cannot unlink its own, and workers sweep them only when the next one starts."""
    from rlnb.runtime.shm import sweep_dead_segments

    sweep_dead_segments()


def assert_metrics_documented(run_dir) -> None:
    """Every key a run logged is explained in the metrics glossary (rlnb.metrics.GLOSSARY)."""
    import json

    from rlnb.metrics import undocumented

    keys = set()
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        keys |= set(json.loads(line))
    assert keys and not undocumented(keys), f"metrics missing from the glossary: {undocumented(keys)}"

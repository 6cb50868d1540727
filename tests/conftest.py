import os

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

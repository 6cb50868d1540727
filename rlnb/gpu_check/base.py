"""What every GPU check shares: :class:`Skip` (a check that cannot run on this machine, with the reason), the
environment report, the embedded cluster's worker start, and a PPO run on the GPU (:func:`_ppo`)."""

from __future__ import annotations

import importlib
import importlib.util
import platform
import sys
import time
from pathlib import Path


class Skip(Exception):
    """A check that cannot run here, with the reason."""


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "?")
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------- checks
def check_environment(work: Path) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            f"torch {torch.__version__} sees no CUDA GPU (torch.version.cuda={torch.version.cuda})"
        )
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    packages = {
        m: _version(m)
        for m in (
            "dask",
            "distributed",
            "dask_cuda",
            "gymnasium",
            "transformers",
            "vllm",
            "mani_skill",
            "pynvml",
            "peft",
        )
    }
    missing = [m for m in ("dask", "distributed", "dask_cuda", "gymnasium", "peft") if packages[m] is None]
    if missing:
        raise RuntimeError(
            f"required packages missing: {missing}; bring their wheels (README: 'GPU check') and pass WHEELS=dir"
        )
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": gpus,
        "python": platform.python_version(),
        "packages": packages,
    }


def _worker_start_probe() -> dict:
    """On a fresh worker: whether it forked from the preloaded server, and the GPU it then sees."""

    preloaded = "rlnb.components" in sys.modules  # nothing else has run on this worker yet
    import torch

    x = torch.ones(1, device="cuda") * 2  # CUDA works after the fork (the server never initialised it)
    return {"preloaded": preloaded, "device": f"{x.device} {torch.cuda.get_device_name()}"}


def _ppo(
    work: Path,
    name: str,
    compile_: bool,
    cluster=None,
    placement=None,
    steps=None,
    extra=(),
    device: str = "cuda",
) -> dict:
    import rlnb
    from rlnb.config import load_recipe

    overrides = [
        f"actor.device={device}",
        f"rollout.device={device}",
        f"actor.compile={str(compile_).lower()}",
        *extra,
    ]
    if steps:
        overrides += [f"runner.steps={steps}", "runner.stop_return=null"]
    recipe = load_recipe("ppo_cartpole", overrides)
    if placement:
        recipe.cluster.component_placement = placement
    loop = rlnb.Loop.from_recipe(recipe, cluster=cluster, run_dir=work / name)
    try:
        t0 = time.perf_counter()
        loop.run(progress=False)
        wall = time.perf_counter() - t0
        stats = loop.episode_stats()
        compile_stats = loop.groups["actor"].compile_stats().result()[0]
        step_s = [r["time/step_s"] for r in loop.history if "time/step_s" in r]
        out = {
            "steps": loop.step,
            "env_steps": loop.step * recipe.rollout.steps_per_rollout * recipe.env.num_envs,
            "episode_return_mean": round(stats["episode_return_mean"], 1),
            "wall_s": round(wall, 1),
            "startup_s": round(loop.startup_s, 1),
            "step_s_median": round(sorted(step_s)[len(step_s) // 2], 4) if step_s else None,
            "compiled": compile_stats.get("compiled"),
            "compile_s": compile_stats.get("compile_s"),
            "compile_fallback": compile_stats.get("fallback"),
        }
        obs = loop.groups["rollout"].sample(2).result()[0]["obs"]
        out["batch_obs_device"] = str(obs.device)
        for name_, ch in loop.channels.items():
            out[f"channel_{name_}"] = ch.stats()
        if steps is None and stats["episode_return_mean"] < recipe.runner.stop_return:
            raise RuntimeError(f"not solved: {out}")
        if compile_ and not compile_stats.get("compiled"):
            raise RuntimeError(f"actor.compile=true trained eager: {compile_stats.get('fallback')}")
        return out
    finally:
        loop.close()

"""``make gpu-check``: every GPU path of rlnb, run in order on a machine with NVIDIA GPUs and no internet.

Each check prints one ``PASS``/``FAIL``/``SKIP`` line with its time and what it measured; the run ends
with a JSON report (``--report``, default ``gpu-check.json``) and exits 1 if any check failed.

The checks run in the order of ``CHECKS`` (``--dry-run`` prints it); each function's docstring says what
it checks. In short: the environment; algorithm code on CUDA; the embedded ``LocalCUDACluster`` with NCCL;
PPO on the GPU (eager, compiled, a simulator on the GPU); GRPO on the GPU (one turn, multi-turn, shared
prompt prefill, asynchronous chunks, a reward model); CUDA IPC channels and weight sync between processes;
NCCL between two groups; a remote cluster started with ``dask scheduler`` and ``dask cuda worker``; GRPO in
bf16, with LoRA in bf16 and with FSDP2's CPU offload; the LM update compiled; the static-cache compiled decode
(:mod:`rlnb.gpu_check.scale`); vLLM and ManiSkill where installed; the tiny VLA's warm start and PPO. A check
that cannot run on the machine says why in its ``SKIP`` line.

Usage:
    python -m rlnb.gpu_check [--dry-run] [--only NAME ...] [--report PATH]

``--dry-run`` (``make gpu-check DRY_RUN=1``) checks the plan and the imports on any machine, runs nothing
on a GPU and exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

from rlnb.gpu_check.base import Skip, check_environment
from rlnb.gpu_check.embodied import (  # PPO, the cluster and the runtime on the GPU
    check_algorithms_on_cuda,
    check_cluster,
    check_cuda_ipc_channel,
    check_maniskill_pickcube,
    check_maniskill_pickcube_rgb,
    check_nccl_broadcast_two_groups,
    check_ppo_cartpole_cuda,
    check_ppo_cartpole_cuda_compiled,
    check_ppo_gpu_env_obs_stay_on_gpu,
    check_vla_pixelreach_cuda,
    check_weight_sync_cuda_disaggregated,
    vla_cuda_overrides,
)
from rlnb.gpu_check.lm import (  # GRPO on the GPU and vLLM
    check_async_chunks_cuda,
    check_grpo_tiny_lm_cuda,
    check_multi_turn_cuda,
    check_reward_model_cuda,
    check_shared_prompt_prefill_cuda,
    check_vllm_rollout,
)
from rlnb.gpu_check.scale import (  # checks toward real model sizes and deployments
    check_lm_bf16_cuda,
    check_lm_compile_cuda,
    check_lm_offload_cuda,
    check_lora_bf16_cuda,
    check_remote_dask_cuda_scheduler,
    check_static_cache_decode_cuda,
)

__all__ = ["CHECKS", "Skip", "dry_run", "main"]


CHECKS = [
    ("environment", check_environment),
    ("algorithms_on_cuda", check_algorithms_on_cuda),
    ("cluster", check_cluster),
    ("ppo_cartpole_cuda", check_ppo_cartpole_cuda),
    ("ppo_cartpole_cuda_compiled", check_ppo_cartpole_cuda_compiled),
    ("ppo_gpu_env_obs_stay_on_gpu", check_ppo_gpu_env_obs_stay_on_gpu),
    ("grpo_tiny_lm_cuda", check_grpo_tiny_lm_cuda),
    ("multi_turn_cuda", check_multi_turn_cuda),
    ("shared_prompt_prefill_cuda", check_shared_prompt_prefill_cuda),
    ("async_chunks_cuda", check_async_chunks_cuda),
    ("reward_model_cuda", check_reward_model_cuda),
    ("cuda_ipc_channel", check_cuda_ipc_channel),
    ("weight_sync_cuda_disaggregated", check_weight_sync_cuda_disaggregated),
    ("nccl_broadcast_two_groups", check_nccl_broadcast_two_groups),
    ("remote_dask_cuda_scheduler", check_remote_dask_cuda_scheduler),
    ("lm_bf16_cuda", check_lm_bf16_cuda),
    ("lora_bf16_cuda", check_lora_bf16_cuda),
    ("lm_offload_cuda", check_lm_offload_cuda),
    ("lm_compile_cuda", check_lm_compile_cuda),
    ("static_cache_decode_cuda", check_static_cache_decode_cuda),
    ("vllm_rollout", check_vllm_rollout),
    ("maniskill_pickcube", check_maniskill_pickcube),
    ("maniskill_pickcube_rgb", check_maniskill_pickcube_rgb),
    ("vla_pixelreach_cuda", check_vla_pixelreach_cuda),
]

# what a dry run imports: every module a check uses (GPU-only packages are reported, not required)
DRY_RUN_IMPORTS = (
    "rlnb.cluster",
    "rlnb.loop",
    "rlnb.components.lm",
    "rlnb.demo",
    "rlnb.runtime",
    "rlnb.runtime.shm",
)
GPU_ONLY = ("dask_cuda", "vllm", "mani_skill")  # reported, not required, on a machine without a GPU


def dry_run() -> dict:
    """The plan and the imports, on any machine: every recipe a check loads validates with its overrides."""
    from rlnb.config import load_recipe

    imports = {}
    for module in (*DRY_RUN_IMPORTS, *GPU_ONLY):
        try:
            importlib.import_module(module)
            imports[module] = "ok"
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            imports[module] = f"not importable here ({reason})" if module in GPU_ONLY else reason
    recipes = {
        "ppo_cartpole": load_recipe(
            "ppo_cartpole", ["actor.device=cuda", "rollout.device=cuda", "actor.compile=true"]
        ),
        "grpo_arith": load_recipe(
            "grpo_arith", ["actor.device=cuda", "rollout.device=cuda", "runner.steps=150"]
        ),
        "ppo_maniskill_gpu": load_recipe("ppo_maniskill_gpu", ["runner.steps=3"]),
        "vla_pixelreach": load_recipe("vla_pixelreach", vla_cuda_overrides(Path("gpu-check"))),
    }
    failed = [m for m, v in imports.items() if v != "ok" and m not in GPU_ONLY]
    if failed:
        raise RuntimeError(f"imports failed: { {m: imports[m] for m in failed} }")
    return {"plan": [name for name, _ in CHECKS], "imports": imports, "recipes": sorted(recipes)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlnb.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="check the plan and the imports; run nothing")
    parser.add_argument("--only", nargs="*", default=None, help="run only these checks (names as listed)")
    parser.add_argument("--report", default="gpu-check.json", help="where the JSON report goes")
    args = parser.parse_args(argv)
    names = [n for n, _ in CHECKS]
    unknown = [n for n in args.only or [] if n not in names]
    if unknown:
        parser.error(f"--only: unknown check(s) {unknown}; the checks are {names}")
    report: dict = {"host": platform.node(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "checks": []}
    if args.dry_run:
        plan = dry_run()
        print(f"DRY RUN: would run {', '.join(plan['plan'])}")
        for module, state in plan["imports"].items():
            print(f"  import {module}: {state}")
        report.update(dry_run=True, **plan)
        Path(args.report).write_text(json.dumps(report, indent=2))
        return 0
    failed = False
    with tempfile.TemporaryDirectory(prefix="rlnb-gpu-check-") as tmp:
        for name, fn in CHECKS:
            if args.only is not None and name not in args.only:
                continue
            t0 = time.perf_counter()
            row: dict = {"name": name}
            try:
                row.update(status="PASS", details=fn(Path(tmp)))
            except Skip as e:
                row.update(status="SKIP", reason=str(e))
            except Exception as e:
                failed = True
                row.update(status="FAIL", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            row["seconds"] = round(time.perf_counter() - t0, 1)
            report["checks"].append(row)
            what = row.get("details") or row.get("reason") or row.get("error")
            print(
                f"{row['status']:<4} {name:<32} {row['seconds']:>7.1f} s  {json.dumps(what, default=str)[:600]}"
            )
            sys.stdout.flush()
            if name == "environment" and row["status"] == "FAIL":
                break  # nothing else can run
    report["passed"] = not failed
    Path(args.report).write_text(json.dumps(report, indent=2, default=str))
    print(f"report: {os.path.abspath(args.report)}; {'all checks passed' if not failed else 'FAILED'}")
    return 1 if failed else 0

"""``make gpu-check``: every GPU path of rlnb, run in order on a machine with NVIDIA GPUs and no internet.

Each check prints one ``PASS``/``FAIL``/``SKIP`` line with its time and what it measured; the run ends
with a JSON report (``--report``, default ``gpu-check.json``) and exits 1 if any check failed.

The checks run in the order of ``CHECKS`` (``--dry-run`` prints it); each function's docstring says what
it checks. In short: the environment; algorithm code on CUDA; the embedded ``LocalCUDACluster`` with NCCL;
PPO on the GPU (eager, compiled, a simulator on the GPU); GRPO on the GPU (one turn, multi-turn, shared
prompt prefill, asynchronous chunks, a reward model); CUDA IPC channels and weight sync between processes;
NCCL between two groups; a remote cluster started with ``dask scheduler`` and ``dask cuda worker``; GRPO in
bf16, with LoRA in bf16 and with FSDP2's CPU offload; the LM update compiled; the static-cache compiled decode
(:mod:`rlnb.gpu_check_scale`); vLLM and ManiSkill where installed. A check that cannot run on the machine says
why in its ``SKIP`` line.

Usage:
    python -m rlnb.gpu_check [--dry-run] [--only NAME ...] [--report PATH]

``--dry-run`` (``make gpu-check DRY_RUN=1``) checks the plan and the imports on any machine, runs nothing
on a GPU and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
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

from rlnb.gpu_check_lm import (  # GRPO on the GPU and vLLM
    check_async_chunks_cuda,
    check_grpo_tiny_lm_cuda,
    check_multi_turn_cuda,
    check_reward_model_cuda,
    check_shared_prompt_prefill_cuda,
    check_vllm_rollout,
)
from rlnb.gpu_check_scale import (  # checks toward real model sizes and deployments
    check_lm_bf16_cuda,
    check_lm_compile_cuda,
    check_lm_offload_cuda,
    check_lora_bf16_cuda,
    check_remote_dask_cuda_scheduler,
    check_static_cache_decode_cuda,
)


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


def _algorithm_inputs(device: str) -> dict:
    """One set of inputs covering both layouts: ``[T, N]`` trajectories and ``[B, L]`` sequences."""
    import torch

    g = torch.Generator().manual_seed(0)
    T, N, B, L = 16, 4, 8, 6

    def r(*shape):
        return torch.randn(*shape, generator=g)

    mask = (torch.arange(L)[None, :] < torch.tensor([6, 5, 4, 3, 6, 2, 1, 6])[:, None]).float()
    traj = {
        "rewards": r(T, N),
        "values": r(T, N),
        "dones": (torch.rand(T, N, generator=g) < 0.1).float(),
        "last_values": r(N),
        "gamma": 0.99,
        "gae_lambda": 0.95,
    }
    seq = {
        "rewards": (torch.rand(B, generator=g) < 0.5).float(),
        "response_mask": mask,
        "group_size": 4,
        "scale": "group",
        "kl": r(B, L).abs() * 0.1,
        "kl_coef": 0.05,
        "gamma": 1.0,
    }
    loss = {
        "logprobs": r(B, L) * 0.1 - 1,
        "old_logprobs": r(B, L) * 0.1 - 1,
        "prox_logprobs": r(B, L) * 0.1 - 1,
        "advantages": r(B, L),
        "values": r(B, L),
        "old_values": r(B, L),
        "returns": r(B, L),
        "entropy": r(B, L).abs(),
        "mask": mask,
        "clip_coef": 0.2,
        "clip_coef_high": 0.28,
        "dual_clip": 3.0,
        "vf_coef": 0.5,
        "ent_coef": 0.01,
        "clip_vloss": True,
        "norm_adv": True,
        "behave_weight_cap": 5.0,
        "agg": "token-mean",
    }

    def to(d):
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in d.items()}

    return {"trajectory": to(traj), "sequence": to(seq), "loss": to(loss)}


def _tensors(out) -> list:
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _tensors(v)]
    return []


def check_algorithms_on_cuda(work: Path) -> dict:
    import torch

    from rlnb.algorithms import ADVANTAGES, POLICY_LOSSES

    cpu, cuda = _algorithm_inputs("cpu"), _algorithm_inputs("cuda")
    checked, wrong = [], []
    for registry, kind in ((ADVANTAGES, "advantage"), (POLICY_LOSSES, "loss")):
        for name in registry.names():
            entry = registry.entry(name)
            layouts = (
                [kind]
                if kind == "loss"
                else [x for x in ("trajectory", "sequence") if entry.serves(cpu[x], x)]
            )
            for layout in layouts:
                if kind == "loss" and entry.missing(cpu["loss"]):
                    continue
                key = "loss" if kind == "loss" else layout
                want, got = entry(**cpu[key]), entry(**cuda[key])
                for a, b in zip(_tensors(want), _tensors(got)):
                    if b.device.type != "cuda":
                        wrong.append(f"{kind} {name}: an output on {b.device}")
                    elif not torch.allclose(a.float(), b.float().cpu(), atol=1e-4, rtol=1e-4):
                        wrong.append(
                            f"{kind} {name}: CUDA differs from CPU by {(a - b.cpu()).abs().max():.2e}"
                        )
                checked.append(f"{kind}:{name}")
    if wrong:
        raise RuntimeError("; ".join(wrong))
    return {"checked": len(checked), "entries": checked}


def check_cluster(work: Path) -> dict:
    import torch

    import rlnb
    from rlnb._dask import _fork_server_wanted
    from rlnb.demo import Collective

    t0 = time.perf_counter()
    with rlnb.Cluster() as cluster:
        start_s = time.perf_counter() - t0
        kind = type(cluster._local).__name__
        if kind != "LocalCUDACluster":
            raise RuntimeError(f"the embedded cluster is a {kind}, expected dask-cuda's LocalCUDACluster")
        # workers fork from the server that preloaded torch (rlnb's default) yet each sees its own GPU
        started = cluster.client.run(_worker_start_probe)
        if _fork_server_wanted() and not all(p["preloaded"] for p in started.values()):
            raise RuntimeError(f"GPU workers did not start from the preloaded fork server: {started}")
        n = torch.cuda.device_count()
        if len(cluster.slots) != n or not all(s.device == "cuda:0" for s in cluster.slots):
            raise RuntimeError(
                f"{len(cluster.slots)} slot(s) {[s.device for s in cluster.slots]} for {n} GPU(s)"
            )
        g = rlnb.Group.launch(Collective, cluster, "all", name="actor")
        backend = g.init_process_group()
        got = g.all_reduce().result(120)
        want = [float(sum(range(1, n + 1))), 10.0 * sum(range(1, n + 1))]
        if backend != "nccl" or got != [want] * n:
            raise RuntimeError(f"all-reduce over {backend}: {got}, expected {[want] * n}")
        g.shutdown()
        return {
            "cluster": kind,
            "slots": [f"{s.address} {s.device} {s.gpu_name}" for s in cluster.slots],
            "start_s": round(start_s, 2),
            "process_group": backend,
            "worker_start": sorted(
                {"fork server, preloaded" if p["preloaded"] else "spawn" for p in started.values()}
            ),
            "worker_devices": sorted(p["device"] for p in started.values()),
        }


def _worker_start_probe() -> dict:
    """On a fresh worker: whether it forked from the preloaded server, and the GPU it then sees."""
    import sys

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


def check_ppo_cartpole_cuda(work: Path) -> dict:
    return _ppo(work, "ppo", False)


def check_ppo_cartpole_cuda_compiled(work: Path) -> dict:
    return _ppo(work, "ppo_compiled", True)


def check_ppo_gpu_env_obs_stay_on_gpu(work: Path) -> dict:
    """A simulator on the GPU (rlnb/TorchCartPole-v1, as ManiSkill would be): observations stay there."""
    out = _ppo(
        work, "ppo_gpu_env", False, extra=("env.id=rlnb/TorchCartPole-v1", "env.kwargs={device: cuda}")
    )
    if not out["batch_obs_device"].startswith("cuda"):
        raise RuntimeError(f"the rollout's batch holds observations on {out['batch_obs_device']}: {out}")
    return out


@contextlib.contextmanager
def _two_processes_on_gpus():
    """Two worker processes: one per GPU with two or more GPUs, else both on GPU 0."""
    import torch

    import rlnb

    if torch.cuda.device_count() >= 2:
        with rlnb.Cluster(slots=2) as cluster:
            yield cluster, "two GPUs"
        return
    import dask
    from distributed import LocalCluster

    dask.config.set({"distributed.worker.daemon": False})
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as local,
        rlnb.Cluster(local) as cluster,
    ):
        yield cluster, "one GPU, two processes"


def check_cuda_ipc_channel(work: Path) -> dict:
    import rlnb
    from rlnb.demo import CudaProbe

    with _two_processes_on_gpus() as (cluster, where):
        producer = rlnb.Group.launch(CudaProbe, cluster, "0", name="producer")
        consumer = rlnb.Group.launch(CudaProbe, cluster, "1", name="consumer")
        ch = rlnb.Channel.create(cluster, "ipc", maxsize=0, max_bytes=0)
        size_mib = 256
        producer.put(ch, size_mib, 1.0).result(120)
        first = consumer.take(ch).result(120)[0]
        producer.fill(2.0).result(60)  # written after the consumer took it: seen only through shared memory
        seen = consumer.read().result(60)[0]
        timing = {}
        for how in ("ipc", "host"):
            producer.put(ch, size_mib, 3.0, how).result(120)
            timing[how] = consumer.take(ch).result(120)[0]["seconds"]
        stats = ch.stats()
        ch.close()
        out = {
            "where": where,
            "first": first,
            "after_producer_write": seen,
            "cuda_ipc_tensors": stats.get("cuda_ipc_tensors"),
            f"{size_mib}MiB_ipc_s": round(timing["ipc"], 4),
            f"{size_mib}MiB_host_round_trip_s": round(timing["host"], 4),
        }
        if first["device"] != "cuda" or first["value"] != 1.0 or seen != 2.0:
            raise RuntimeError(f"the consumer's tensor is not the producer's GPU memory: {out}")
        return out


def check_weight_sync_cuda_disaggregated(work: Path) -> dict:
    with _two_processes_on_gpus() as (cluster, where):
        out = _ppo(
            work, "ppo_apart", False, cluster, {"actor": "0", "rollout,env": "1"}, steps=60,
            extra=("env.id=rlnb/TorchCartPole-v1", "env.kwargs={device: cuda}"),
        )  # fmt: skip
    out["where"] = where
    if out["episode_return_mean"] < 100:
        raise RuntimeError(f"PPO with weights synced GPU to GPU did not learn: {out}")
    for channel in ("channel_weights", "channel_batches"):
        if not out.get(channel, {}).get("cuda_ipc_tensors"):
            raise RuntimeError(f"{channel}: no tensor travelled by CUDA IPC: {out}")
    return out


def check_nccl_broadcast_two_groups(work: Path) -> dict:
    import rlnb
    from rlnb.demo import Collective

    with _two_processes_on_gpus() as (cluster, where):
        a = rlnb.Group.launch(Collective, cluster, "0", name="actor")
        b = rlnb.Group.launch(Collective, cluster, "1", name="rollout")
        try:
            backend = rlnb.init_collective([a, b], backend="nccl", name="weights", timeout_s=60)
            a.set_weights(7.0).result(60)
            sending, receiving = a.broadcast_weights(0), b.broadcast_weights(0)  # both sides at once
            got = [sending.result(120)[0], receiving.result(120)[0]]
        except Exception as e:
            if where.startswith("one GPU") and "uplicate GPU" in str(e):
                raise Skip(
                    f"NCCL refuses two ranks on one GPU ({where}): {str(e).splitlines()[0][:300]}"
                ) from e
            raise
        if got[1] != got[0] or got[1]["weight"][0][0] != 7.0:
            raise RuntimeError(
                f"broadcast over {backend}: the rollout group holds {got[1]}, expected {got[0]}"
            )
        return {"where": where, "backend": backend}


def check_maniskill_pickcube(work: Path) -> dict:
    if importlib.util.find_spec("mani_skill") is None:
        raise Skip(
            "mani-skill is not installed (its wheel, 101 MB, and SAPIEN's, 51 MB, exceed what a call can bring)"
        )
    import rlnb
    from rlnb.config import load_recipe
    from rlnb.envs.gym_envs import _check_physx_gpu_library

    overrides = ["runner.steps=3", "runner.eval_interval=0", "runner.save_interval=0"]
    try:
        _check_physx_gpu_library()  # the env's own check: SAPIEN's PhysX GPU library, or GitHub to fetch it
        overrides.append("env.num_envs=64")
        sim = "physx_cuda"
    except RuntimeError as e:
        # offline: PhysX on the CPU (in SAPIEN's wheel), one env a process, GPU rendering
        overrides += ["env.kwargs.sim_backend=physx_cpu", "env.num_envs=1"]
        sim = f"physx_cpu ({e})"[:200]
    recipe = load_recipe("ppo_maniskill", overrides)
    out: dict = {"sim_backend": sim}
    loop = rlnb.Loop.from_recipe(recipe, run_dir=work / "maniskill")
    try:
        t0 = time.perf_counter()
        loop.run(progress=False)
        out.update(
            steps=loop.step, wall_s=round(time.perf_counter() - t0, 1), startup_s=round(loop.startup_s, 1)
        )
        out["batch_obs_device"] = str(loop.groups["rollout"].sample(2).result()[0]["obs"].device)
        # ManiSkill says whether each episode succeeded (final_info["success"]): env/success_rate, once one ended
        out["success_rate_logged"] = any("env/success_rate" in r for r in loop.history)
        path = loop.save()  # the simulator's state through its own API, never pickled
        out["checkpoint"] = path.name
    finally:
        loop.close()
    resumed = rlnb.Loop.resume(work / "maniskill")
    try:
        resumed.run(steps=1, progress=False)
        out["resumed_to_step"] = resumed.step
    finally:
        resumed.close()
    return out


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
        "ppo_maniskill": load_recipe("ppo_maniskill", ["runner.steps=3"]),
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


if __name__ == "__main__":
    sys.exit(main())

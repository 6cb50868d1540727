"""The embodied and runtime GPU checks: algorithm code on CUDA, the embedded ``LocalCUDACluster`` with NCCL, PPO on
the GPU (eager, compiled, a simulator whose observations stay on the GPU), CUDA IPC channels and weight sync
between processes, NCCL between two groups, and ManiSkill where it is installed."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import time
from pathlib import Path

from rlnb.gpu_check.base import Skip, _ppo, _worker_start_probe


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
    recipe = load_recipe("ppo_maniskill_gpu", overrides)
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


def check_maniskill_pickcube_rgb(work: Path) -> dict:
    """PickCube with camera images and state (``obs_mode=rgb+state``): on ``physx_cuda`` the dict observations are
    packed on the GPU and stay there; offline (no PhysX GPU library), the CPU simulation renders on the GPU."""
    if importlib.util.find_spec("mani_skill") is None:
        raise Skip("mani-skill is not installed")
    import rlnb
    from rlnb.config import load_recipe
    from rlnb.envs.gym_envs import _check_physx_gpu_library

    overrides = ["runner.steps=2", "runner.eval_interval=0", "runner.save_interval=0",
                 "env.kwargs.obs_mode=rgb+state", "env.kwargs.sensor_configs={width: 64, height: 64}",
                 "algorithm.num_minibatches=4"]  # fmt: skip
    try:
        _check_physx_gpu_library()
        overrides.append("env.num_envs=32")
        sim = "physx_cuda"
    except RuntimeError as e:
        overrides += ["env.kwargs.sim_backend=physx_cpu", "env.num_envs=2", "env.vector_mode=async"]
        sim = f"physx_cpu ({e})"[:200]
    loop = rlnb.Loop.from_recipe(load_recipe("ppo_maniskill_gpu", overrides), run_dir=work / "maniskill_rgb")
    try:
        t0 = time.perf_counter()
        loop.run(progress=False)
        obs = loop.sample(1)["obs"]
        return {
            "sim_backend": sim,
            "steps": loop.step,
            "wall_s": round(time.perf_counter() - t0, 1),
            "rgb_shape": list(obs["rgb"].shape),
            "state_shape": list(obs["state"].shape),
            "rendered": bool(obs["rgb"].float().std() > 0),
        }
    finally:
        loop.close()


def vla_cuda_overrides(work: Path) -> list[str]:
    """The VLA check's settings over ``vla_pixelreach`` (the dry run validates them too)."""
    return [
        "actor.device=cuda", "rollout.device=cuda", f"actor.model.vla.path={work / 'tiny-vla'}",
        "actor.warm_start.episodes=20", "actor.warm_start.epochs=2", "runner.steps=3", "runner.eval_interval=0",
        "runner.tensorboard=false", "actor.dtype=bfloat16", "actor.lora.rank=8",
    ]  # fmt: skip


def check_vla_pixelreach_cuda(work: Path) -> dict:
    """The tiny VLA (``vla_pixelreach``: a PaliGemma with action tokens, built here) on the GPU: a short warm start
    on the actor, PPO steps in bf16 (autocast, float32 master weights) with LoRA adapters, the rollout sampling
    action tokens on CUDA with the merged weights synced actor -> rollout each step; the actor's weights on CUDA."""
    import torch

    import rlnb

    if not torch.cuda.is_available():
        raise Skip("no CUDA GPU")
    with rlnb.Loop.from_recipe("vla_pixelreach", vla_cuda_overrides(work), run_dir=work / "vla") as loop:
        t0 = time.perf_counter()
        loop.run(progress=False)
        wall = time.perf_counter() - t0
        state = loop.groups["actor"].on(0).policy_state().result()[0]
        devices = sorted({str(v.device) for v in state.values()})
        warm = next(r for r in loop.history if "warm_start/nll" in r)
        last = loop.history[-1]
    if devices != ["cuda:0"]:
        raise RuntimeError(f"the VLA actor's weights are on {devices}, expected cuda:0")
    if not (last.get("train/approx_kl", 0) > 0 and warm["warm_start/nll"] < warm["warm_start/nll_first"]):
        raise RuntimeError(f"the VLA did not train: warm start {warm}, last step {last}")
    return {
        "steps": loop.step, "wall_s": round(wall, 1), "warm_start_nll": round(warm["warm_start/nll"], 3),
        "step_s": round(last["time/step_s"], 3), "actor_devices": devices,
    }  # fmt: skip

"""``make gpu-check``'s checks of the paths toward real model sizes and real deployments.

- ``remote_dask_cuda_scheduler``: ``dask scheduler`` and ``dask cuda worker`` started from the command line,
  ``rlnb.Cluster("tcp://...")`` by address, a PPO and a GRPO run on it with the GPU as the slot.
- ``lm_bf16_cuda``: GRPO with ``actor.dtype=bfloat16`` (bf16 autocast over float32 master weights, the rollout
  model in bf16) lifts held-out accuracy as the float32 run does, and logs ``memory/*``.
- ``lora_bf16_cuda``: GRPO with LoRA and ``actor.dtype=bfloat16``: the frozen base in bf16, float32 adapters,
  under a fifth of a whole float32 actor's state.
- ``lm_offload_cuda``: GRPO with ``actor.offload=params`` (FSDP2's CPU offload, one GPU) trains; the GPU peak
  with and without it.
- ``lm_compile_cuda``: the LM update compiled (``actor.compile=true``) against eager, in bf16: the compile time
  and the train step's speed-up.
- ``static_cache_decode_cuda``: ``rollout.static_cache`` (``generate`` on a static KV cache, its decoding step
  compiled) samples the tokens and log-probs of rlnb's decoding loop, and how many tokens/s each makes.

Each takes ``device`` so that the tests run it on CPU too (``dask worker`` instead of ``dask cuda worker``).
"""

from __future__ import annotations

import time
from pathlib import Path


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _last_training_record(history: list[dict]) -> dict:
    """The last record of a training step (a run's last record may be its final evaluation's)."""
    return next(r for r in reversed(history) if "train/loss" in r)


def _grpo(work: Path, name: str, device: str, overrides=(), cluster=None):
    """A ``grpo_arith`` loop on ``device``, actor, rollout and reward collocated on slot 0."""
    import rlnb
    from rlnb.config import load_recipe

    recipe = load_recipe(
        "grpo_arith",
        [f"actor.device={device}", f"rollout.device={device}", f"actor.model_path={work / 'tiny-arith-qwen2'}",
         "runner.save_interval=0", *overrides],
    )  # fmt: skip
    recipe.cluster.component_placement = {"actor,rollout,reward": "0"}
    return rlnb.GRPOLoop.from_recipe(recipe, cluster=cluster, run_dir=work / name)


def check_remote_dask_cuda_scheduler(work: Path, device: str = "cuda") -> dict:
    """A cluster as users deploy one: ``dask scheduler`` and ``dask cuda worker`` (``dask worker`` on CPU) from
    the command line, non-daemonic workers, ``rlnb.Cluster(address)``; PPO CartPole and GRPO on its slot."""
    import rlnb
    from rlnb.cluster import DaskProcesses
    from rlnb.gpu_check.base import _ppo

    gpu = device == "cuda"
    env = {"DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
    t0 = time.perf_counter()
    procs = DaskProcesses(1, timeout_s=120, env=env, gpu=gpu)
    with procs, rlnb.Cluster(procs.address, min_slots=1, timeout_s=120) as cluster:  # (procs started first)
        up_s = time.perf_counter() - t0
        slots = [f"{s.device} {s.gpu_name}".strip() for s in cluster.slots]
        if cluster.embedded or (gpu and not all(s.device.startswith("cuda") for s in cluster.slots)):
            raise RuntimeError(f"expected the command-line workers' GPU slots, got {slots}")
        ppo = _ppo(work, "remote_ppo", False, cluster=cluster, steps=20, device=device)
        loop = _grpo(work, "remote_grpo", device, ["runner.steps=10", "runner.eval_interval=0"], cluster)
        try:
            loop.run(progress=False)
            last = _last_training_record(loop.history)
        finally:
            loop.close()
        grpo = {
            "steps": loop.step,
            "loss": last.get("train/loss"),
            "actor_state_bytes": last.get("memory/actor_state_bytes"),
            "cuda_peak_bytes": last.get("memory/cuda_peak_bytes"),
        }
    if loop.step != 10 or grpo["actor_state_bytes"] is None or (gpu and not grpo["cuda_peak_bytes"]):
        raise RuntimeError(f"GRPO on the command-line cluster: {grpo}")
    return {"address": procs.address, "worker": "dask cuda worker" if gpu else "dask worker",
            "slots": slots, "up_s": round(up_s, 1), "ppo": ppo, "grpo": grpo}  # fmt: skip


def check_lm_bf16_cuda(
    work: Path,
    device: str = "cuda",
    steps: int = 150,
    lift: float = 0.1,
    overrides: tuple = ("actor.dtype=bfloat16",),
) -> dict:
    """GRPO with ``actor.dtype=bfloat16``: the rollout holds its model in bf16, the actor's state stays float32
    and is logged, held-out accuracy rises by ``lift`` over the warm start at an evaluation and ends above the
    warm start."""
    loop = _grpo(work, "grpo_bf16", device, [f"runner.steps={steps}", *overrides])
    try:
        loop.run(progress=False)
        rollout = loop.groups["rollout"].memory_stats().result()[0]
        evals = [r["eval/accuracy"] for r in loop.history if "eval/accuracy" in r]
        last = _last_training_record(loop.history)
        out = {
            "steps": loop.step,
            "accuracy_after_sft": evals[0],
            "accuracy_final": evals[-1],
            "accuracy_evals": [round(a, 3) for a in evals],
            "rollout_model_dtype": rollout["model_dtype"],
            "actor_state_bytes": last.get("memory/actor_state_bytes"),
            "cuda_peak_bytes": last.get("memory/cuda_peak_bytes"),
            "first_ratio_mean": next(r["train/ratio_mean"] for r in loop.history if "train/ratio_mean" in r),
        }
    finally:
        loop.close()
    want = loop.recipe.actor.dtype if loop.recipe.rollout.dtype == "auto" else loop.recipe.rollout.dtype
    if rollout["model_dtype"] != want or out["actor_state_bytes"] is None:
        raise RuntimeError(f"the rollout model is not in {want}, or memory is not logged: {out}")
    if device == "cuda" and not out["cuda_peak_bytes"]:
        raise RuntimeError(f"memory/cuda_peak_bytes not logged on the GPU: {out}")
    # the best evaluation after the warm start, and no collapse below it by the end: the tiny model's bf16 actor
    # peaks mid-run with some seeds, then loses part of the gain (measured on an H200 in docs/gpu.md)
    if max(evals[1:]) < out["accuracy_after_sft"] + lift or out["accuracy_final"] < out["accuracy_after_sft"]:
        raise RuntimeError(
            f"bf16 GRPO did not lift held-out accuracy by {lift} over the warm start, or fell below it: {out}"
        )
    return out


def check_lora_bf16_cuda(
    work: Path, device: str = "cuda", steps: int = 20, sft_steps: int | None = None
) -> dict:
    """GRPO with LoRA adapters (``actor.lora.rank=8``) and ``actor.dtype=bfloat16``: the losses stay finite, the
    rollout gets the merged weights in bf16, and the actor rank holds the frozen base in bf16 with float32
    adapters: under a fifth of the state a float32 actor training the whole model would hold (weights, gradients
    and AdamW's two moments); ``memory/cuda_peak_bytes`` logged on the GPU. ``sft_steps``: the warm start's
    (default the recipe's; bf16 on a CPU without bf16 arithmetic takes seven times float32's time for it)."""
    from rlnb.components.lm.shard_load import weight_count

    overrides = [f"runner.steps={steps}", "actor.lora.rank=8", "actor.lora.alpha=16", "actor.dtype=bfloat16",
                 "actor.lr=1e-3", "runner.eval_interval=0"]  # fmt: skip
    if sft_steps is not None:
        overrides.append(f"actor.sft_steps={sft_steps}")
    loop = _grpo(work, "grpo_lora_bf16", device, overrides)
    try:
        records = loop.run(progress=False)
        rollout = loop.groups["rollout"].memory_stats().result()[0]
        last = _last_training_record(loop.history)
    finally:
        loop.close()
    weights = weight_count([work / "tiny-arith-qwen2" / "model.safetensors"])
    out = {
        "steps": len(records),
        "losses_finite": all(r["train/loss"] == r["train/loss"] for r in records if "train/loss" in r),
        "rollout_model_dtype": rollout["model_dtype"],
        "actor_state_bytes": last.get("memory/actor_state_bytes"),
        "full_float32_state_bytes": 16 * weights,
        "cuda_peak_bytes": last.get("memory/cuda_peak_bytes"),
    }
    if not out["losses_finite"] or rollout["model_dtype"] != "bfloat16":
        raise RuntimeError(f"LoRA in bf16 did not train, or the rollout is not in bf16: {out}")
    if not out["actor_state_bytes"] or out["actor_state_bytes"] > out["full_float32_state_bytes"] / 5:
        raise RuntimeError(f"the LoRA actor holds more than a fifth of a whole float32 actor's state: {out}")
    if device == "cuda" and not out["cuda_peak_bytes"]:
        raise RuntimeError(f"memory/cuda_peak_bytes not logged on the GPU: {out}")
    return out


def check_lm_offload_cuda(work: Path, device: str = "cuda", steps: int = 10) -> dict:
    """GRPO with ``actor.strategy=fsdp2`` and ``actor.offload=params`` on one GPU: FSDP2 wraps the model on its one
    rank with its shards, gradients and AdamW state in pinned host memory; the steps train (finite losses and
    gradient norms: clipping reduces on the CPU through gloo beside NCCL). Reports the process's GPU peak with and
    without offload; the run without it trains the whole model on the GPU."""
    peaks, out = {}, {}
    for offload in ("none", "params"):
        overrides = [f"runner.steps={steps}", "actor.strategy=fsdp2", f"actor.offload={offload}",
                     "actor.sft_steps=20", "runner.eval_interval=0"]  # fmt: skip
        loop = _grpo(work, f"grpo_offload_{offload}", device, overrides)
        try:
            records = [r for r in loop.run(progress=False) if "train/loss" in r]
        finally:
            loop.close()
        finite = all(
            r["train/loss"] == r["train/loss"] and r["train/grad_norm"] < float("inf") for r in records
        )
        peaks[offload] = records[-1].get("memory/cuda_peak_bytes")
        out[f"steps_{offload}"], out[f"finite_{offload}"] = len(records), finite
    out.update(cuda_peak_bytes_without=peaks["none"], cuda_peak_bytes_offloaded=peaks["params"])
    if not (out["finite_params"] and out["steps_params"] == steps):
        raise RuntimeError(f"GRPO with actor.offload=params did not train: {out}")
    return out


def check_lm_compile_cuda(
    work: Path, device: str = "cuda", hidden: int = 1024, layers: int = 8, steps: int = 8
) -> dict:
    """The LM update compiled (``actor.compile=true``) against eager, bf16, on a ``hidden`` x ``layers`` model: both
    train (finite losses), and the compile time and the median train phase of the steps after the first (compile
    excluded) of each, with their ratio. On one GPU the whole micro-batch objective compiles; sharded over
    several (``actor.strategy=fsdp2``), each decoder layer (that mode is tested on two CPU ranks)."""
    import statistics

    from rlnb.models.lm import build_tiny_lm

    model = build_tiny_lm(work / f"compile-{hidden}x{layers}", hidden_size=hidden, num_layers=layers,
                          num_heads=max(2, hidden // 64))  # fmt: skip
    out = {"model": f"{hidden}x{layers}"}
    for setting in ("false", "true"):
        overrides = [f"runner.steps={steps}", f"actor.compile={setting}",
                     "actor.dtype=bfloat16", "actor.sft_steps=0", "runner.eval_interval=0",
                     "actor.skip_zero_advantage=false", f"actor.model_path={model}"]  # fmt: skip
        loop = _grpo(work, f"grpo_compile_{setting}", device, overrides)
        try:
            records = [r for r in loop.run(progress=False) if "train/loss" in r]
            stats = loop.groups["actor"].compile_stats().result()[0]
        finally:
            loop.close()
        if len(records) != steps or not all(r["train/loss"] == r["train/loss"] for r in records):
            raise RuntimeError(f"GRPO with actor.compile={setting} (fsdp2) did not train: {records[-1:]}")
        which = "compiled" if setting == "true" else "eager"
        out[f"train_s_{which}"] = statistics.median(r["time/train_s"] for r in records[1:])
        if setting == "true":
            if not stats.get("compiled"):
                raise RuntimeError(f"the update did not compile: {stats}")
            out.update(compiled=stats["what"], compile_s=stats["compile_s"])
    out["speedup"] = out["train_s_eager"] / out["train_s_compiled"]
    return out


def tokens_per_s(rollout, prompts: list[str], n: int, device: str) -> tuple[float, dict]:
    """Tokens generated a second by ``rollout`` for ``n`` completions of each prompt (the second of two calls,
    the first warming up or compiling), and that call's batch."""
    for _ in range(2):
        _sync(device)
        t0 = time.perf_counter()
        batch, _ = rollout._generate(prompts, n, greedy=False)
        _sync(device)
        seconds = time.perf_counter() - t0
    return float(batch["response_mask"].sum()) / seconds, batch


def check_static_cache_decode_cuda(
    work: Path, device: str = "cuda", hidden: int = 512, layers: int = 8
) -> dict:
    """``rollout.static_cache`` against rlnb's decoding loop on one model: greedy float32 completions are the same
    tokens with the same log-probs (compiled kernels round differently: a row may part at a near tie, so 95 %
    of rows must match); then sampled bf16 tokens/s of each, 16 prompts x 8, up to 64 new tokens."""
    from rlnb.components.lm import HFRollout
    from rlnb.models.lm import build_tiny_lm

    path = str(
        build_tiny_lm(work / "tiny-static", hidden_size=hidden, num_layers=layers, num_heads=8, seed=0)
    )
    prompts = [f"{a}+{a * 7 % 50}=" for a in range(16)]
    greedy = {}
    for static in (False, True):
        rollout = HFRollout(path, max_new_tokens=32, seed=0, device=device, static_cache=static)
        rollout._generate(prompts, 1, greedy=True)  # (compiles)
        greedy[static] = rollout._generate(prompts, 1, greedy=True)[0]
    same = (greedy[True]["input_ids"] == greedy[False]["input_ids"]).all(1)
    drift = (greedy[True]["logprobs"] - greedy[False]["logprobs"])[same].abs().max()
    out = {"same_rows": f"{int(same.sum())}/{len(same)}", "logprob_max_diff": float(drift)}
    speed = {}
    for name, kwargs in (("loop", {}), ("static", {"static_cache": True})):
        rollout = HFRollout(path, max_new_tokens=64, seed=0, device=device, dtype="bfloat16", **kwargs)
        speed[name], _ = tokens_per_s(rollout, prompts, 8, device)
        out[f"tokens_per_s_{name}_bf16"] = round(speed[name])
    out["static_over_loop"] = round(speed["static"] / speed["loop"], 2)
    if float(same.float().mean()) < 0.95 or drift > 1e-3:
        raise RuntimeError(f"the static-cache decode sampled other tokens or log-probs than the loop: {out}")
    return out

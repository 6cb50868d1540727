"""The LM actor's update at growing model sizes and memory setups: time, tokens/s, share of the matmul peak, memory.

Run: ``.venv/bin/python bench/lm_scale.py [--sizes 256x4 512x8] [--setups ddp fsdp2 fsdp2+bf16 ...]`` (prints a
table; not a timed test). On a GPU: ``--sizes 1024x24 2048x24`` (0.4B and 1.6B with the tiny-LM factory's
character vocabulary), and a 7B-class model with LoRA: ``--sizes 3584x32 --setups fsdp2+bf16+lora``.

A setup is a strategy (``ddp``: every rank holds the whole state; ``fsdp2``: each holds a shard) and what is added
to it with ``+``: ``bf16`` (``actor.dtype=bfloat16``), ``ckpt`` (``actor.gradient_checkpointing``), ``lora``
(``actor.lora.rank=8``), ``offload`` (``actor.offload=params``, GPUs only). For each model size (``HIDDENxLAYERS``,
built locally, in bf16 from 1B parameters up, as real checkpoints are published) and setup, an ``LMActor`` group
of ``--ranks`` ranks (default: the GPUs, or 2 on CPU; a fresh embedded cluster each, so that memory one setup
freed does not hide the next one's) trains on a GRPO batch of ``--sequences`` rows a rank (groups of 8 whose
rewards alternate, so every row has an advantage) of ``--prompt-tokens`` + ``--response-tokens`` tokens, in
micro-batches of ``--micro-batch``: one epoch, one minibatch, AdamW. The second of two updates is timed.

Per rank, the slowest rank's figures: the update's seconds (the driver's call) and tokens/s; its FLOPs, counted as ``(4 x parameters +
2 x trainable parameters) x tokens`` (forward, the backward through the activations, and the weight gradients
of what trains: ``6 x parameters x tokens`` without LoRA; recomputation and attention's own FLOPs left out),
against the peak of a large bf16 matmul measured in the same run, with a rank's threads (MFU); ``memory/actor_state_bytes`` (the
parameters, gradients and optimizer state a rank holds); and its peak memory: on a GPU, ``memory/cuda_peak_bytes``
of the timed update; on CPU, how far the rank's peak resident memory (``VmHWM``) rose above what it held before
the actor launched. Then the state against the first setup's, and what ``rlnb plan`` said it would be (from the
model's config on the meta device, before anything started) against what the rank held.
"""

from __future__ import annotations

import argparse
import time

import torch
from _scaled import (
    best_seconds,
    import_what_loading_imports,
    peak_mib,
    reset_peak,
    resident_mib,
    scaled_models,
)

import rlnb
from rlnb.components.lm import LMActor
from rlnb.config import ActorConfig
from rlnb.models.lm import load_tokenizer

STRATEGIES = ("ddp", "fsdp2")
ADDED = {
    "bf16": {"dtype": "bfloat16"},
    "ckpt": {"gradient_checkpointing": True},
    "lora": {"lora": {"rank": 8, "alpha": 16}},
    "offload": {"offload": "params"},
}


def actor_settings(setup: str) -> dict:
    """The ``actor`` section of ``setup`` (``fsdp2+bf16+lora``...), or ``ValueError`` naming what is unknown."""
    strategy, *added = setup.split("+")
    if strategy not in STRATEGIES or any(a not in ADDED for a in added):
        raise ValueError(
            f"setup {setup!r}: expected one of {STRATEGIES} then +{'/+'.join(ADDED)} (any of them)"
        )
    settings = {"strategy": strategy}
    for a in added:
        settings.update(ADDED[a])
    return settings


def matmul_flops_per_s(device: str, threads: int) -> float:
    """The best of 10 square bf16 matmuls (8192 on a GPU, 1024 on CPU with an actor rank's ``threads``)."""
    n = 8192 if device == "cuda" else 1024
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    pair = [torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2)]
    flops = 2 * n**3 / best_seconds(device, lambda: pair[0] @ pair[1], repeats=10)
    torch.set_num_threads(was)
    pair.clear()
    if device == "cuda":
        torch.cuda.empty_cache()  # (the ranks, in their own processes, get the GPU's memory)
    return flops


def grpo_batch(sequences: int, prompt: int, response: int, vocab: int) -> dict:
    """A rollout batch of random tokens: ``[B, P+R]`` with every response token in the mask."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (sequences, prompt + response), generator=g)
    mask = torch.cat([torch.zeros(sequences, prompt), torch.ones(sequences, response)], 1).long()
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "response_mask": mask,
        "logprobs": torch.zeros(sequences, prompt + response),
        "rewards": torch.tensor([float(i % 2) for i in range(sequences)]),
        "version": 0,
    }


def planned_state_bytes(path: str, setup: str, ranks: int) -> int:
    """What ``rlnb plan`` says an actor rank of ``setup`` will hold (weights, gradients, AdamW state), from the
    model's config on the meta device, before anything starts."""
    from rlnb.config import load_recipe
    from rlnb.loop.families.grpo.plan import plan_recipe

    overrides = [f"actor.model_path={path}", f"cluster.component_placement={{'actor,rollout,reward': 0-{ranks - 1}}}",
                 f"cluster.slots={ranks}"]  # fmt: skip
    for key, value in actor_settings(setup).items():
        if isinstance(value, dict):
            overrides += [f"actor.{key}.{k}={v}" for k, v in value.items()]
        else:
            overrides.append(f"actor.{key}={str(value).lower() if isinstance(value, bool) else value}")
    return plan_recipe(load_recipe("grpo_arith", overrides, check=False)).actor_state_bytes


def one(path: str, vocab: int, setup: str, peak_flops: float, args) -> dict:
    """The slowest rank's update and the largest state and peak of ``setup``'s ranks, on a fresh cluster."""
    gpu = torch.cuda.is_available()
    with rlnb.Cluster(slots=args.ranks, gpus=gpu) as cluster:
        cluster.client.run(import_what_loading_imports)
        before = cluster.client.run(resident_mib)
        cluster.client.run(reset_peak)
        actor = LMActor.launch(
            cluster, f"0-{args.ranks - 1}", model_path=path, actor=actor_settings(setup), group_size=8,
            micro_batch_size=args.micro_batch, update_epochs=1, num_minibatches=1, lr=1e-5, name="bench_actor",
        )  # fmt: skip
        actor.init_process_group()
        actor.setup_data_parallel().result(600)
        counts = actor.parameter_counts().result(60)[0]
        batch = grpo_batch(args.sequences, args.prompt_tokens, args.response_tokens, vocab)
        for _ in range(2):
            actor.set_batch([batch]).result(600)
            actor.compute_advantages().result(600)
            t0 = time.perf_counter()
            out = actor.train().result(3600)
            seconds = time.perf_counter() - t0  # (the slowest rank's, and a call's round trip: milliseconds)
        peaks = cluster.client.run(peak_mib)
        actor.shutdown()
    tokens = args.sequences * (args.prompt_tokens + args.response_tokens)
    flops = (4 * counts["parameters"] + 2 * counts["trainable"]) * tokens / seconds
    if gpu:
        peak = max(o["memory/cuda_peak_bytes"] for o in out) / 2**30
    else:
        peak = max(peaks[a] - before[a] for a in peaks) / 1024
    return {
        **counts, "update_s": seconds, "tokens_per_s": tokens / seconds, "flops_per_s": flops,
        "mfu": flops / peak_flops, "state_bytes": max(o["memory/actor_state_bytes"] for o in out), "peak_gib": peak,
    }  # fmt: skip


def main() -> None:
    gpus = torch.cuda.device_count()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", nargs="+", default=["256x4", "512x8"], help="HIDDENxLAYERS models to build"
    )
    parser.add_argument("--setups", nargs="+", default=["ddp", "fsdp2", "fsdp2+bf16", "fsdp2+bf16+ckpt",
                        "fsdp2+bf16+lora"], help="strategy[+bf16][+ckpt][+lora][+offload]")  # fmt: skip
    parser.add_argument("--ranks", type=int, default=gpus or 2, help="actor ranks (default: the GPUs, or 2)")
    parser.add_argument("--sequences", type=int, default=128, help="rows each rank trains on")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=32)
    args = parser.parse_args()
    for setup in args.setups:
        try:
            actor_settings(setup)
        except ValueError as e:
            parser.error(str(e))
    where = f"{gpus} x {torch.cuda.get_device_name()}" if gpus else "CPU"
    # (here, before any cluster: with the threads of one actor rank on CPU, ActorConfig.torch_threads)
    peak_flops = matmul_flops_per_s("cuda" if gpus else "cpu", ActorConfig.torch_threads)
    print(f"{where}, {args.ranks} actor rank(s): {args.sequences} sequences a rank of {args.prompt_tokens} + "
          f"{args.response_tokens} tokens, micro-batches of {args.micro_batch}; the slowest rank's update; "
          f"bf16 matmul peak of a rank measured here: {peak_flops / 1e12:.2f} TFLOP/s")  # fmt: skip
    peak = "GPU peak" if gpus else "peak RSS rise"
    print(f"| model | params | trainable | setup | update s | tokens/s a rank | TFLOP/s a rank | MFU (bf16) "
          f"| state / rank | {peak} / rank | state / first setup's | rlnb plan / state |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size, path in scaled_models(args.sizes, big_in_bf16=True):
        vocab = len(load_tokenizer(path))
        first = None
        for setup in args.setups:
            started = time.perf_counter()
            try:
                r = one(path, vocab, setup, peak_flops, args)
            except (
                Exception
            ) as e:  # (out of memory, a setup this machine refuses: the other setups still run)
                print(f"| {size} | | | {setup} | failed: {type(e).__name__}: {str(e)[:300]} |", flush=True)
                continue
            first = first or r["state_bytes"]
            print(f"| {size} | {r['parameters'] / 1e6:,.2f} M | {r['trainable'] / 1e6:,.2f} M | {setup} | "
                  f"{r['update_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['flops_per_s'] / 1e12:.2f} | {r['mfu']:.1%} | "
                  f"{r['state_bytes'] / 2**30:.3f} GiB | {r['peak_gib']:.2f} GiB | "
                  f"{r['state_bytes'] / first:.2f} | "
                  f"{planned_state_bytes(path, setup, args.ranks) / r['state_bytes']:.3f} |", flush=True)  # fmt: skip
            print(
                f"  ({setup}: {time.perf_counter() - started:.0f} s with the cluster and the load)",
                flush=True,
            )


if __name__ == "__main__":
    main()

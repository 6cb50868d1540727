"""The LM actor's update at growing model sizes: time, tokens/s, share of the matmul peak measured beside it, memory.

Run: ``.venv/bin/python bench/lm_scale.py [--sizes 256x4 512x8] [--dtypes float32 bfloat16]`` (prints a table;
not a timed test). On a GPU: ``--sizes 1024x24 2048x24`` (0.4B and 1.6B with the tiny-LM factory's
character vocabulary).

For each model size (``HIDDENxLAYERS``, built locally) and ``actor.dtype``, one ``LMActor`` in this process
trains on a GRPO batch of ``--sequences`` rows (groups of 8 whose rewards alternate, so every row has an
advantage) of ``--prompt-tokens`` + ``--response-tokens`` tokens, in micro-batches of ``--micro-batch``:
one epoch, one minibatch, AdamW. The second of two ``train()`` calls is timed. Its work is counted as
``6 x parameters x tokens`` FLOPs (forward and backward; attention's own FLOPs left out), over the
time, against the peak of a large bf16 (and float32) matmul measured in the same run (MFU). Memory: the actor's
parameters, gradients and optimizer state (``memory/actor_state_bytes``) and, on a GPU, the peak allocated.
"""

from __future__ import annotations

import argparse
import time

import torch
from _scaled import best_seconds, scaled_models

from rlnb.components.lm import LMActor
from rlnb.models.lm import DTYPES

# the components set their own thread count (one a slot); the benches keep the process's, as the peaks use
THREADS = torch.get_num_threads()


def matmul_flops_per_s(device: str, dtype: torch.dtype) -> float:
    """The best of 5 square matmuls (8192 on a GPU, 1024 on CPU): FLOPs a second."""
    n = 8192 if device == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / best_seconds(device, lambda: a @ b)


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


def one(path: str, device: str, dtype: str, args) -> dict:
    actor = LMActor(path, device=device, dtype=dtype, micro_batch_size=args.micro_batch, group_size=8,
                    update_epochs=1, num_minibatches=1, lr=1e-5, torch_threads=THREADS)  # fmt: skip
    params = sum(p.numel() for p in actor.policy.parameters())
    batch = grpo_batch(args.sequences, args.prompt_tokens, args.response_tokens, len(actor.tok))
    for _ in range(2):
        actor.set_batch([batch])
        actor.compute_advantages()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = actor.train()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    tokens = args.sequences * (args.prompt_tokens + args.response_tokens)
    result = {"params": params, "update_s": seconds, "tokens_per_s": tokens / seconds,
              "flops_per_s": 6 * params * tokens / seconds, "state_bytes": out["memory/actor_state_bytes"],
              "peak_bytes": out.get("memory/cuda_peak_bytes")}  # fmt: skip
    del actor
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", nargs="+", default=["256x4", "512x8"], help="HIDDENxLAYERS models to build"
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    parser.add_argument("--sequences", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    name = (
        torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
    )
    peak = {d: matmul_flops_per_s(args.device, DTYPES[d]) for d in DTYPES}
    print(f"{name}: matmul peak measured here {peak['bfloat16'] / 1e12:.1f} TFLOP/s bf16, "
          f"{peak['float32'] / 1e12:.1f} float32; {args.sequences} sequences of {args.prompt_tokens} + "
          f"{args.response_tokens} tokens, micro-batches of {args.micro_batch}")  # fmt: skip
    print("| model | params | dtype | update s | tokens/s | TFLOP/s | of bf16 peak | of its dtype's peak "
          "| state / rank | GPU peak |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size, path in scaled_models(args.sizes):
        for dtype in args.dtypes:
            r = one(path, args.device, dtype, args)
            gpu = f"{r['peak_bytes'] / 2**30:.1f} GiB" if r["peak_bytes"] else "-"
            print(f"| {size} | {r['params'] / 1e6:.0f} M | {dtype} | {r['update_s']:.3f} | "
                  f"{r['tokens_per_s']:,.0f} | {r['flops_per_s'] / 1e12:.2f} | "
                  f"{r['flops_per_s'] / peak['bfloat16']:.1%} | {r['flops_per_s'] / peak[dtype]:.1%} | "
                  f"{r['state_bytes'] / 2**30:.2f} GiB | {gpu} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

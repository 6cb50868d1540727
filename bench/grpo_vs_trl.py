"""GRPO step time: rlnb vs TRL's GRPOTrainer (no vLLM), same model, prompts and sizes, in one run.

Both train the same locally built causal LM (a few million parameters) on the same arithmetic
prompts: 16 prompts per step, 8 completions each (group size 8), completions of up to 32 tokens,
one PPO-clip update per step, no KL term. Prints seconds per step, generated tokens/s and the ratio
rlnb/TRL, and where rlnb's step time goes.

``--warm-start-steps N`` (default 150) first fine-tunes the model (supervised, in this process, not timed)
to answer with a ~20-token check (``23 (check: 23-18=5)``) on sums of numbers up to 20, and both sides
train from that checkpoint: some completions are right, so most groups carry a learning signal, and some
(all wrong, or all right) do not, as in real reasoning RL. ``--warm-start-steps 0``: the untrained model,
whose completions all score 0 (every group alike: TRL computes a zero update, and rlnb leaves every row
out, ``actor.skip_zero_advantage``). rlnb runs once more with ``actor.skip_zero_advantage=false``, every
row computed as TRL does, to show what leaving them out saves.

``--instruction-chars N`` puts the same N-character instruction before every prompt, on both sides:
real tasks' prompts (a chat template, a system prompt, a worked example) are far longer than ``12+34=``.

Run: ``.venv/bin/python bench/grpo_vs_trl.py [--steps 12] [--warm-start-steps 150] [--instruction-chars 100]``
(needs ``pip install trl``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rlnb.algorithms import get_reward
from rlnb.data import ArithmeticTask
from rlnb.models.lm import build_tiny_lm

GROUP, PROMPTS, TOKENS = 8, 16, 32
INSTRUCTION = (
    "You are a careful calculator. Add the two numbers, check the sum twice, answer with the number only. "
)


def instruction(chars: int) -> str:
    """The first ``chars`` characters of the instruction repeated."""
    return (INSTRUCTION * (chars // len(INSTRUCTION) + 1))[:chars]


MAX_OPERAND = {True: 20, False: 99}  # by whether the model was warm-started: sums it can sometimes get right


def problems(seed: int, n: int, prefix: str, warm: bool) -> list[dict]:
    """The arithmetic problems both sides train on, each prompt behind ``prefix``."""
    task = ArithmeticTask(max_operand=MAX_OPERAND[warm], seed=seed)
    return [{"prompt": prefix + p.prompt, "answer": p.answer} for p in task.train[:n]]


def warm_start(path: str, out: str, steps: int, seed: int, prefix: str) -> float:
    """Supervised fine-tuning of the model at ``path`` to answer with a check (``23 (check: 23-18=5)``),
    saved to ``out``; returns the last loss. The reward reads the leading number only."""
    from rlnb.components.lm import LMActor

    rows = problems(seed + 1, 2000, prefix, warm=True)

    def answer(row):
        a, b = row["prompt"][len(prefix) :].rstrip("=").split("+")
        return f"{row['answer']} (check: {row['answer']}-{b}={a})"

    actor = LMActor(path, seed=seed)
    losses = actor.sft([r["prompt"] for r in rows], [answer(r) for r in rows], steps, 64, 3e-3)
    actor.export_hf(out)
    return losses[-1]


def trl_run(
    model_path: str, steps: int, seed: int, processes: int = 1, prefix: str = "", warm: bool = True
) -> tuple[float, float, float]:
    """TRL's ``GRPOTrainer`` in this process, or one of ``processes`` DDP ranks (``torchrun`` sets the
    rank: each takes ``PROMPTS * GROUP / processes`` completions of every step)."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = problems(seed, PROMPTS * (steps + 2), prefix, warm)
    reward = get_reward("arithmetic")

    def arithmetic(completions, answer, **_):
        return [reward(c, a) for c, a in zip(completions, answer)]

    times: list[float] = []
    lengths: list[float] = []
    alike: list[float] = []  # share of groups whose completions all scored alike

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])
                alike.append(logs["frac_reward_zero_std"])

    tok = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, per_device_train_batch_size=PROMPTS * GROUP // processes, num_generations=GROUP,
            max_completion_length=TOKENS, max_steps=steps, learning_rate=2e-4, beta=0.0, num_iterations=1,
            temperature=1.0, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
            seed=seed, disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip
        trainer = GRPOTrainer(
            model=model_path, reward_funcs=arithmetic, args=args, train_dataset=Dataset.from_list(rows),
            processing_class=tok, callbacks=[Clock()],
        )  # fmt: skip
        trainer.train()
    step_s = statistics.median(times[1:])
    tokens = (statistics.mean(lengths) if lengths else TOKENS) * PROMPTS * GROUP
    return step_s, tokens / step_s, statistics.mean(alike) if alike else float("nan")


TRL_DDP = """
import json, sys, torch
sys.path.insert(0, {bench!r})
from grpo_vs_trl import trl_run
torch.set_num_threads(1)
if __name__ == "__main__":
    step_s, tps, alike = trl_run({path!r}, {steps}, {seed}, processes=2, prefix={prefix!r}, warm={warm!r})
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps([step_s, tps, alike]))
"""


def trl_ddp_run(
    model_path: str, steps: int, seed: int, prefix: str = "", warm: bool = True
) -> tuple[float, float, float]:
    """TRL on two CPU processes with DDP (``torchrun``, gloo): the peer of rlnb's two-slot figure."""
    import json
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "trl_ddp.py"
        bench = str(Path(__file__).resolve().parent)
        script.write_text(
            TRL_DDP.format(bench=bench, path=model_path, steps=steps, seed=seed, prefix=prefix, warm=warm)
        )
        # (torchrun leaves its torchelastic_* directory in the temporary directory: here, in this one)
        env = {**__import__("os").environ, "TMPDIR": d}
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
            capture_output=True, text=True, timeout=1800, env=env,
        )  # fmt: skip
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"TRL with DDP failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    step_s, tps, alike = json.loads(line[len("RESULT ") :])
    return step_s, tps, alike


def rlnb_run(
    model_path: str,
    steps: int,
    seed: int,
    placement: str,
    prefix: str = "",
    warm: bool = True,
    skip: bool = True,
    extra: tuple[str, ...] = (),
) -> tuple[float, float, dict]:
    import json

    from rlnb.loop import GRPOLoop

    overrides = [
        f"seed={seed}", f"actor.model_path={model_path}", "actor.sft_steps=0", f"runner.steps={steps}",
        "runner.eval_interval=0", "runner.save_interval=0", "runner.tensorboard=false", f"algorithm.group_size={GROUP}",
        f"data.prompts_per_step={PROMPTS}", f"rollout.max_new_tokens={TOKENS}", f"data.max_operand={MAX_OPERAND[warm]}",
        "actor.lr=0.0002", "actor.micro_batch_size=128", f"cluster.component_placement={{'actor,rollout,reward': {placement}}}",
        f"actor.skip_zero_advantage={str(skip).lower()}", *extra,
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as run_dir:
        if prefix:  # the same prompts as TRL's, from a file
            path = Path(run_dir) / "problems.jsonl"
            rows = problems(seed, PROMPTS * (steps + 2) * 2, prefix, warm)
            path.write_text(
                "".join(json.dumps({"question": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows)
            )
            overrides += ["data.task=file", f"data.path={path}"]
        loop = GRPOLoop.from_recipe("grpo_arith", overrides, run_dir=run_dir)
        try:
            recs = [loop.step_once() for _ in range(steps)]
        finally:
            loop.close()
    recs = recs[1:]
    step_s = statistics.median(r["time/step_s"] for r in recs)
    tokens = statistics.mean(r["rollout/response_len_mean"] for r in recs) * PROMPTS * GROUP
    phases = {
        k: statistics.median(r[k] for r in recs)
        for k in ("time/sync_s", "time/rollout_s", "time/advantages_s", "time/train_s")
    }
    phases["alike"] = statistics.mean(r["advantages/zero_advantage_frac"] for r in recs)
    phases["computed"] = statistics.mean(r["train/rows_computed_frac"] for r in recs)
    return step_s, tokens / step_s, phases


def matmul_flops(hidden: int = 256, tokens: int = 4096, reps: int = 20) -> float:
    """Single-thread float32 matmul throughput at the model's width (FLOP/s): the floor's unit."""
    a, b = torch.randn(tokens, hidden), torch.randn(hidden, 4 * hidden)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * tokens * hidden * 4 * hidden * reps / (time.perf_counter() - t0)


def packing(path: str, args, prefix: str, warm: bool) -> None:
    """rlnb on 1 slot with every row computed, its micro-batches padded rows (``micro_batch_size``) or rows packed
    by a token budget with no padding (``actor.max_tokens_per_micro_batch``): the update's time (``time/train_s``)
    at the mixed lengths the warm-started model's completions have."""
    runs, budget = {}, args.pack_tokens
    for label, extra in (("padded rows", ()), (f"packed, {budget} tokens a micro-batch",
                                                (f"actor.max_tokens_per_micro_batch={budget}",))):  # fmt: skip
        _, _, phases = rlnb_run(path, args.steps, args.seed, "0", prefix, warm, False, extra)
        runs[label] = phases["time/train_s"]
        print(f"rlnb update, {label}: {runs[label]:.3f} s (median time/train_s)", flush=True)
    padded, packed = runs.values()
    print(f"packed / padded update time: {packed / padded:.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--instruction-chars", type=int, default=0, help="an instruction this long before each prompt"
    )
    ap.add_argument(
        "--warm-start-steps",
        type=int,
        default=150,
        help="supervised steps before RL (0: the untrained model)",
    )
    ap.add_argument(
        "--packing-only",
        action="store_true",
        help="only rlnb's packed micro-batches (actor.max_tokens_per_micro_batch) against its padded ones",
    )
    ap.add_argument("--pack-tokens", type=int, default=256, help="the packed micro-batches' token budget")
    args = ap.parse_args()
    prefix = instruction(args.instruction_chars) if args.instruction_chars else ""
    warm = args.warm_start_steps > 0
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        path = str(build_tiny_lm(Path(d) / "lm", hidden_size=256, num_layers=4, num_heads=4, seed=args.seed))
        from rlnb.models.lm import load_lm

        model, tok = load_lm(path)
        n_params = sum(p.numel() for p in model.parameters())
        prefix_tokens = len(tok(prefix).input_ids) if prefix else 0
        print(
            f"model: Qwen2, {n_params / 1e6:.2f} M parameters; {PROMPTS} prompts x {GROUP} completions of <= {TOKENS} tokens"
        )
        if prefix:
            print(f"every prompt starts with a {len(prefix)}-character instruction: {prefix[:60]!r}...")
        if warm:
            t0 = time.perf_counter()
            loss = warm_start(path, str(Path(d) / "warm"), args.warm_start_steps, args.seed, prefix)
            path = str(Path(d) / "warm")
            print(f"warm start: {args.warm_start_steps} supervised steps in {time.perf_counter() - t0:.0f} s "
                  f"(not timed below), last loss {loss:.2f}; sums of numbers up to {MAX_OPERAND[warm]}")  # fmt: skip
        else:
            print("no warm start: every completion scores 0, so every group is alike")
        packing(path, args, prefix, warm)
        if args.packing_only:
            return
        trl_step, trl_tps, trl_alike = trl_run(path, args.steps, args.seed, prefix=prefix, warm=warm)
        print(
            f"TRL  GRPOTrainer, 1 process: {trl_step:.3f} s/step  {trl_tps:8.0f} generated tokens/s  "
            f"groups alike {trl_alike:.2f}",
            flush=True,
        )
        trl_ddp_step, trl_ddp_tps, _ = trl_ddp_run(path, args.steps, args.seed, prefix, warm)
        print(
            f"TRL  GRPOTrainer, 2 processes, DDP: {trl_ddp_step:.3f} s/step  {trl_ddp_tps:8.0f} generated tokens/s",
            flush=True,
        )
        for placement, skip, label, peer in (
            ("0", False, "1 slot, every row computed (vs TRL in 1 process)", trl_step),
            ("0", True, "1 slot (vs TRL in 1 process)", trl_step),
            ("0-1", True, "2 slots, DDP (vs TRL on 2 processes, DDP)", trl_ddp_step),
        ):
            our_step, our_tps, phases = rlnb_run(path, args.steps, args.seed, placement, prefix, warm, skip)
            alike, computed = phases.pop("alike"), phases.pop("computed")
            print(f"rlnb GRPOLoop, {label}: {our_step:.3f} s/step  {our_tps:8.0f} generated tokens/s  "
                  f"ratio rlnb/TRL {our_step / peer:.2f}")  # fmt: skip
            print(
                "  step breakdown (median s): "
                + ", ".join(f"{k.split('/')[1][:-2]} {v:.3f}" for k, v in phases.items())
                + f"; groups alike {alike:.2f}, rows the update computed {computed:.2f}"
            )
            if not skip:
                every_row = (our_step, our_tps)
        # the update's floor: forward + backward ~ 6 x parameters x tokens of matmul (prompt ~8 tokens, plus
        # the instruction's), over every sequence's tokens, or with each prompt once per group (as rlnb does)
        flops = matmul_flops()
        response = every_row[1] * every_row[0] / (PROMPTS * GROUP)  # mean generated tokens a sequence
        for what, tokens in (
            ("every sequence's tokens", PROMPTS * GROUP * (8 + prefix_tokens + response)),
            ("each prompt once per group", PROMPTS * (8 + prefix_tokens) + PROMPTS * GROUP * response),
        ):
            floor_s = 6 * n_params * tokens / flops
            print(
                f"update floor at {flops / 1e9:.0f} GFLOP/s (1 thread), every row, {what}: {floor_s:.2f} s for "
                f"{tokens:.0f} tokens, i.e. {floor_s / 2:.2f} s a rank on 2 slots"
            )


if __name__ == "__main__":
    main()

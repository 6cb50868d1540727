"""Asynchronous RL (``algorithm.max_staleness``) against synchronous training, same recipe, one run.

Run: ``.venv/bin/python bench/async_vs_sync.py [--part ppo grpo longtail] [--seeds 1 2 3]`` (prints figures;
not a timed test).

``ppo``: settings, each on the same 2-slot embedded cluster, to CartPole's solved mark (mean return of the
last 20 training episodes >= 475):
- synchronous, env and rollout on slot 0 and the actor on slot 1 (the placement asynchrony needs);
- synchronous, everything on slot 0 (the best synchronous placement on this machine: no transfers);
- asynchronous with N = 1, 2, 4 on the apart placement.
For each: median wall-clock to the mark (loop only, cluster already up), steps, env steps/s, the final
return, and the ratio to each synchronous baseline.

``grpo``: ``grpo_arith`` after its SFT warm start, to a held-out accuracy of ``--target`` (evaluated every
10 steps on 200 held-out problems), synchronous apart (rollout and reward on slot 0, actor on slot 1),
synchronous data-parallel on both slots (the recipe's placement), and asynchronous N = 1, 2, 4 apart.

``longtail``: the same settings on a task whose completions vary from 2 to 41 tokens (repeat a digit
``k`` times, ``k`` heavy-tailed): 30 GRPO steps each, tokens/s and wall-clock per step, where a
synchronous batch waits for its longest completion.

``multiturn``: the same settings on ``grpo_arith`` with up to three turns (``arithmetic_retry``: a wrong answer
is told `` no. `` and the model answers again), rewarded on the transcript's last answer: 30 GRPO steps each,
where a synchronous batch waits for its longest conversation, turn after turn, and an asynchronous one
starts each conversation's next turn in the next chunk.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import rlnb
from rlnb.loop import GRPOLoop, Loop

APART = "cluster.component_placement={'env,rollout': 0, actor: 1}"
TOGETHER = "cluster.component_placement={'actor,rollout,env': 0}"
SETTINGS = {
    "sync, apart": [APART, "algorithm.max_staleness=0"],
    "sync, collocated": [TOGETHER, "algorithm.max_staleness=0"],
    "async N=1": [APART, "algorithm.max_staleness=1"],
    "async N=2": [APART, "algorithm.max_staleness=2"],
    "async N=4": [APART, "algorithm.max_staleness=4"],
}


def one_run(cluster, overrides: list[str], seed: int) -> dict:
    base = ["runner.tensorboard=false", "runner.stop_return=475", f"seed={seed}"]
    with (
        tempfile.TemporaryDirectory() as run_dir,
        Loop.from_recipe("ppo_cartpole", [*base, *overrides], cluster=cluster, run_dir=run_dir) as loop,
    ):
        t0 = time.perf_counter()
        loop.run(progress=False)
        wall = time.perf_counter() - t0
        return {
            "wall_s": wall,
            "steps": loop.step,
            "env_steps_per_s": loop.global_step / wall,
            "return": loop.episode_stats()["episode_return_mean"] or 0.0,
            "solved": loop._solved(),
        }


LM_APART = "cluster.component_placement={'rollout,reward': 0, actor: 1}"
LM_SETTINGS = {
    "sync, apart": [LM_APART, "algorithm.max_staleness=0"],
    "sync, data-parallel": ["algorithm.max_staleness=0"],  # the recipe's: all three on both slots
    "async N=1": [LM_APART, "algorithm.max_staleness=1"],
    "async N=2": [LM_APART, "algorithm.max_staleness=2"],
    "async N=4": [LM_APART, "algorithm.max_staleness=4"],
}


def grpo_run(cluster, overrides: list[str], seed: int, work: Path, target: float | None, steps: int) -> dict:
    """SFT (not timed), then GRPO for ``steps`` steps or until held-out accuracy reaches ``target``."""
    base = ["runner.tensorboard=false", f"seed={seed}", "runner.eval_interval=0", "runner.save_interval=0",
            f"actor.model_path={work / f'model-{seed}'}", f"runner.steps={steps}"]  # fmt: skip
    with (
        tempfile.TemporaryDirectory() as run_dir,
        GRPOLoop.from_recipe("grpo_arith", [*base, *overrides], cluster=cluster, run_dir=run_dir) as loop,
    ):
        per_step = loop.recipe.data.prompts_per_step * loop.recipe.algorithm.group_size  # sequences
        loop.sft()
        first = loop.evaluate()["eval/accuracy"]
        wall = tokens = 0.0
        acc = first
        trained: list[dict] = []
        while loop.step < steps and (target is None or acc < target):
            t0 = time.perf_counter()
            records = loop.run(10 if target is not None else steps, progress=False)
            wall += time.perf_counter() - t0
            tokens += sum(r["rollout/response_len_mean"] * per_step for r in records)
            trained += [r for r in records if "time/train_s" in r]
            acc = loop.evaluate()["eval/accuracy"]  # not timed: the same for every setting

        def median(key: str) -> float:  # over the steps after the first
            return statistics.median(r.get(key, 0.0) or 0.0 for r in trained[1:] or trained)

        return {"wall_s": wall, "steps": loop.step, "s_per_step": wall / max(1, loop.step), "tokens_per_s": tokens / wall, "first": first, "accuracy": acc,
                "reached": target is None or acc >= target,
                # where the actor's time goes: the update, the old log-probs' recompute (stale batches), and
                # the share of sequences the update computed (actor.skip_zero_advantage)
                "train_ms": 1e3 * median("time/train_s"), "advantages_ms": 1e3 * median("time/advantages_s"),
                "computed": median("train/rows_computed_frac")}  # fmt: skip


def long_tail_file(path: Path, n: int = 600, seed: int = 0) -> Path:
    """Problems ``"dxk="`` -> ``d`` repeated ``k`` times, ``P(k) ~ k^-1.5`` on 1..40: most completions are
    short, a few are long."""
    rng = random.Random(seed)
    weights = [k**-1.5 for k in range(1, 41)]
    with path.open("w") as f:
        for _ in range(n):
            d, k = rng.randint(1, 9), rng.choices(range(1, 41), weights)[0]
            f.write(json.dumps({"question": f"{d}x{k}=", "answer": str(d) * k}) + "\n")
    return path


def report(
    results: dict[str, list[dict]], base_a: str, base_b: str, columns: list[tuple[str, str, str]]
) -> None:
    med = {n: statistics.median(r["wall_s"] for r in rs) for n, rs in results.items()}
    print(f"{'setting':<20} {'wall':>9} " + " ".join(f"{h:>{w}}" for h, _, w in columns)
          + f" {'vs ' + base_a:>16} {'vs ' + base_b:>24}")  # fmt: skip
    for name, rs in results.items():
        cells = " ".join(f"{statistics.median(r[k] for r in rs):>{w}.3g}" for _, k, w in columns)
        print(
            f"{name:<20} {med[name]:>7.1f} s {cells} {med[base_a] / med[name]:>15.2f}x {med[base_b] / med[name]:>23.2f}x"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part",
        nargs="+",
        default=["ppo", "grpo", "longtail", "multiturn"],
        choices=["ppo", "grpo", "longtail", "multiturn"],
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--target", type=float, default=0.8, help="grpo: held-out accuracy to reach")
    args = parser.parse_args()
    with rlnb.Cluster(slots=2, gpus=False) as cluster, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "ppo" in args.part:
            ppo(cluster, args.seeds)
        if "grpo" in args.part:
            results = lm_comparison(cluster, args.seeds, [], work, args.target, 200)
            print(
                f"\ngrpo_arith to held-out accuracy {args.target} (after SFT; wall excludes SFT and evaluation)"
            )
            report(results, "sync, apart", "sync, data-parallel", [
                ("steps", "steps", 6), ("s/step", "s_per_step", 7), ("tokens/s", "tokens_per_s", 9), ("acc SFT", "first", 8),
                ("acc end", "accuracy", 8), ("reached", "reached", 8), ("train ms", "train_ms", 8), ("computed", "computed", 8)])  # fmt: skip
        if "longtail" in args.part:
            data = long_tail_file(work / "long_tail.jsonl")
            task = ["data.task=file", f"data.path={data}", "rollout.max_new_tokens=48", "data.eval_size=50",
                    "actor.sft_steps=300", "data.sft_noise=0"]  # fmt: skip
            results = lm_comparison(cluster, args.seeds, task, work / "lt", None, 30)
            print("\nlong-tail completions (2-41 tokens), 30 GRPO steps (wall excludes SFT)")
            report(results, "sync, apart", "sync, data-parallel", [
                ("steps", "steps", 6), ("s/step", "s_per_step", 7), ("tokens/s", "tokens_per_s", 9), ("acc end", "accuracy", 8),
                ("train ms", "train_ms", 8), ("adv ms", "advantages_ms", 7), ("computed", "computed", 8)])  # fmt: skip
        if "multiturn" in args.part:
            from rlnb.algorithms.rewards import register_reward

            register_reward("last_answer")(last_answer)  # (travels to the workers by value)
            turns = ["rollout.max_turns=3", "rollout.interaction=arithmetic_retry", "reward.name=last_answer",
                     "actor.sft_steps=100"]  # fmt: skip
            results = lm_comparison(cluster, args.seeds, turns, work / "mt", None, 30)
            print("\nmulti-turn (up to 3 turns, arithmetic_retry), 30 GRPO steps (wall excludes SFT)")
            report(results, "sync, apart", "sync, data-parallel", [
                ("steps", "steps", 6), ("s/step", "s_per_step", 7), ("tokens/s", "tokens_per_s", 9), ("acc end", "accuracy", 8),
                ("train ms", "train_ms", 8), ("computed", "computed", 8)])  # fmt: skip


def lm_comparison(
    cluster, seeds: list[int], task: list[str], work: Path, target: float | None, steps: int
) -> dict[str, list[dict]]:
    """:func:`grpo_run` of each of ``LM_SETTINGS`` with the ``task``'s overrides, the settings interleaved seed by
    seed (a slow minute of the VM falls on all of them alike)."""
    results = {name: [] for name in LM_SETTINGS}
    for seed in seeds:
        for name, overrides in LM_SETTINGS.items():
            results[name].append(grpo_run(cluster, [*task, *overrides], seed, work, target, steps))
    return results


def last_answer(completion: str, answer: str) -> float:
    """The multi-turn part's reward: 1.0 if the transcript's last answer (after its last `` no. ``) is right."""
    from rlnb.algorithms.rewards import arithmetic_reward

    return arithmetic_reward(completion.rsplit(" no. ", 1)[-1], answer)


def ppo(cluster, seeds: list[int]) -> None:
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for seed in seeds:  # interleaved, so drift over the run hits every setting alike
        for name, overrides in SETTINGS.items():
            results[name].append(one_run(cluster, overrides, seed))
    med = {n: statistics.median(r["wall_s"] for r in rs) for n, rs in results.items()}
    print(f"{'setting':<18} {'wall to 475':>12} {'steps':>6} {'env steps/s':>12} {'return':>7} {'solved':>7} "
          f"{'vs sync apart':>14} {'vs sync collocated':>19}")  # fmt: skip
    for name, rs in results.items():
        print(
            f"{name:<18} {med[name]:>10.1f} s {statistics.median(r['steps'] for r in rs):>6.0f} "
            f"{statistics.median(r['env_steps_per_s'] for r in rs):>12.0f} "
            f"{statistics.median(r['return'] for r in rs):>7.1f} {sum(r['solved'] for r in rs)}/{len(rs):<5} "
            f"{med['sync, apart'] / med[name]:>13.2f}x {med['sync, collocated'] / med[name]:>18.2f}x"
        )


if __name__ == "__main__":
    main()

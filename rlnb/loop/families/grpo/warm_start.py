"""The GRPO family's supervised warm start on the training answers (``actor.sft_steps``), and the callback that runs
it, with a first evaluation, before a run's first step."""

from __future__ import annotations

import time

from rlnb.loop.families.grpo.data import turn_demonstrations
from rlnb.loop.runner import Callback
from rlnb.metrics import format_value


class WarmStartFirst(Callback):
    """Before a run's first step: the SFT warm start (``actor.sft_steps``, unless done) and ``eval/accuracy`` at step
    0, the baseline GRPO's gain is read against."""

    def on_run_start(self, loop, steps: int) -> None:
        if loop.step == 0 and not loop.sft_done:
            if loop.recipe.actor.sft_steps > 0:
                loop.sft(progress=loop.runner.progress)
            loop.evaluate()


PROGRESS_UPDATES = 20
"""How many calls a warm start with a progress bar is made in (each a few steps; one call without a bar)."""


def sft(family, steps: int | None = None, progress: bool = False) -> dict:
    """Supervised warm start on the training answers; exports ``<run_dir>/sft_model``. Returns the logged record.
    ``progress``: a text progress bar (``tqdm``) with the latest loss."""
    t0 = time.perf_counter()
    s = family.session
    recipe = s.recipe
    steps = recipe.actor.sft_steps if steps is None else steps
    wrong_prompts = None
    if recipe.data.sft_turns:  # a multi-turn warm start: a row per turn of each problem's conversation
        prompts, answers, wrong_prompts, wrong = turn_demonstrations(family.task, recipe, family.model_path)
    else:
        prompts = [p.prompt for p in family.task.train]
        answers = [p.answer for p in family.task.train]
        # data.sft_noise > 0: an imperfect teacher, off by one on a fraction of its demonstrations
        noisy = recipe.data.sft_noise
        wrong = [str(int(a) + 1) if a.lstrip("-").isdigit() else a for a in answers] if noisy else None
    actor = s.groups["actor"]
    per_rank = max(1, recipe.actor.sft_batch_size // actor.world_size)
    noise, lr = recipe.data.sft_noise, recipe.actor.sft_lr
    if not progress:
        losses = actor.sft(prompts, answers, steps, per_rank, lr, wrong, noise, wrong_prompts).result()[0]
    else:
        from tqdm.auto import tqdm

        actor.sft_begin(prompts, answers, steps, per_rank, lr, wrong, noise, wrong_prompts).result()
        losses, chunk = [], max(1, -(-steps // PROGRESS_UPDATES))
        with tqdm(total=steps, desc=f"{recipe.name} warm start", unit="step") as bar:
            while len(losses) < steps:
                done = actor.sft_steps(chunk).result()[0]
                if not done:  # (the actor's warm start ended early: never loop on nothing)
                    break
                losses += done
                bar.set_postfix_str(f"loss {format_value(done[-1])}", refresh=False)
                bar.update(len(done))
    family.paths.export_actor(str(s.run_dir / "sft_model"))
    family.sft_done = True
    out = {
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "steps": steps,
    }
    record = {f"sft/{k}": v for k, v in out.items() if v is not None}
    record["time/sft_s"] = time.perf_counter() - t0
    s.logger.log(s.step, record)
    return record

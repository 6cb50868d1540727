"""The GRPO family's sampling: ``data.prompts_per_step`` problems shared over the rollout ranks, each sampled
``algorithm.group_size`` times, scored next to the rollout or on the reward's own slots, and (``algorithm.
dynamic_sampling``, DAPO) sampled again in rounds until each rank has its share of groups with a learning signal.
Every schedule's rollout phase ends in :func:`rollout_summary`."""

from __future__ import annotations

from rlnb.data.prompts import Problem
from rlnb.loop.families.grpo.data import shard
from rlnb.loop.phase import Phase
from rlnb.runtime.group import Group


def collect(family, phase: Phase) -> None:
    """The synchronous rollout phase: generate, score, hand the batches to the actor ranks."""
    s = family.session
    rollout, extra = s.groups["rollout"], {}
    if s.recipe.algorithm.dynamic_sampling:
        summaries, extra = sample_with_signal(family, rollout)
    else:
        summaries = generate_scored(family, rollout, family.task.sample(s.recipe.data.prompts_per_step))
    family.paths.hand_batches()
    if family.paths.batch_local and s.cluster.has_gpus and s.recipe.rollout.device != "cpu":
        rollout.offload().result()  # frees GPU memory for the collocated actor's training
    rollout_summary(family, phase, summaries, extra)


def start_generate(family, rollout: Group, problems: list[Problem]):
    """Start ``rollout.generate`` on ``problems`` shared over its ranks, each ``algorithm.group_size`` times; the
    pending call."""
    s = family.session
    reward, G = s.groups["reward"], s.recipe.algorithm.group_size
    # the reward's name where it scores next to the rollout, and the records' other fields where there are any:
    # only then (a rollout class of one's own may take neither)
    with_fields = any(p.fields for p in problems)
    calls = []
    for part in shard(problems, rollout.world_size):
        args = ([p.prompt for p in part], [p.answer for p in part], G)
        if family.reward_local or with_fields:
            args += (reward.name if family.reward_local else None,)
        calls.append(args + (([p.fields for p in part],) if with_fields else ()))
    return rollout.call_each("generate", calls)


def generate_scored(family, rollout: Group, problems: list[Problem]) -> list[dict]:
    """``problems`` shared over the ranks of ``rollout`` (the group or a view of some of its ranks), each sampled
    ``algorithm.group_size`` times and scored; each rank keeps its batch. Returns their summaries."""
    reward = family.session.groups["reward"]
    summaries = start_generate(family, rollout, problems).result()
    if not family.reward_local:  # score on the reward's own slots
        n_rew = reward.world_size
        scored = [
            reward.on(k % n_rew).score_terms(s["texts"], s["answers"], s["prompts"], s.get("fields"))
            for k, s in enumerate(summaries)
        ]
        scores = [res.result()[0] for res in scored]
        stats = rollout.call_each("set_rewards", [(x["rewards"], x["terms"]) for x in scores]).result()
        for summary, st in zip(summaries, stats):
            summary.update(st)
    return summaries


def sample_with_signal(family, rollout: Group) -> tuple[list[dict], dict]:
    """DAPO's dynamic sampling (``algorithm.dynamic_sampling``): rounds of generation on the rollout ranks still
    short of their share of groups with a learning signal, each round a full share of new prompts, at most
    ``algorithm.max_sampling_rounds``; then each rank assembles its batch from the groups it kept (topped up with
    groups set aside). Returns every round's summaries and the rounds' metrics."""
    recipe = family.session.recipe
    algorithm, G = recipe.algorithm, recipe.algorithm.group_size
    share = recipe.data.prompts_per_step // rollout.world_size
    kept = dict.fromkeys(rollout.ranks, 0)
    summaries, rounds, groups, informative = [], 0, 0, 0
    while rounds < algorithm.max_sampling_rounds and min(kept.values()) < share:
        rounds += 1
        short = rollout.on([k for k in rollout.ranks if kept[k] < share])
        summaries += generate_scored(family, short, family.task.sample(share * short.world_size))
        for k, got in zip(short.ranks, short.keep_groups(G, rounds == 1).result()):
            kept[k], groups, informative = (
                got["kept"],
                groups + got["groups"],
                informative + got["informative"],
            )
    batches = rollout.assemble_kept(share, G).result()
    return summaries, {
        "sampling_rounds": rounds,
        "signal_frac": informative / groups,  # of every group sampled
        "informative_frac": sum(b["informative"] for b in batches) / sum(b["groups"] for b in batches),
    }


def rollout_summary(family, phase: Phase, summaries: list[dict], extra: dict) -> None:
    """The rollout phase's metrics into ``phase``, from the ranks' summaries (``extra``: the schedule's own; an
    asynchronous schedule's says how long generating took, beside training)."""
    dt = phase.elapsed_s()
    n = sum(s["sequences"] for s in summaries)
    if (
        "staleness_mean" in extra
    ):  # tokens made while generating, which overlapped training (none: not logged)
        tokens = sum(s["tokens"] for s in summaries)
        tokens_per_s = tokens / max(s["generate_s"] for s in summaries) if tokens else None
    else:
        tokens_per_s = sum(s["tokens"] for s in summaries) / dt

    def mean(key: str) -> float:  # over every sequence of every summary
        return sum(s[key] * s["sequences"] for s in summaries) / n

    out = {
        "tokens_per_s": tokens_per_s,
        "response_len_mean": mean("response_len_mean"),
        "reward_mean": mean("reward_mean"),
        "accuracy": mean("accuracy"),
        **extra,
    }
    if all("truncated_frac" in s for s in summaries):
        out["truncated_frac"] = mean("truncated_frac")
    if all("turns_mean" in s for s in summaries):  # multi-turn rollouts
        out["turns_mean"] = mean("turns_mean")
    for name in summaries[0].get("reward_terms", ()):  # several rewards: each one's mean
        out[f"reward_term/{name}"] = sum(s["reward_terms"][name] * s["sequences"] for s in summaries) / n
    phase.metrics.update(out)

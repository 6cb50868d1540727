"""The reward worker: one reward, or several summed with weights, applied to completions."""

from __future__ import annotations

from rlnb.algorithms.contract import check_rewards
from rlnb.algorithms.rewards import SafeReward
from rlnb.components.launch import launcher
from rlnb.runtime.rank import RankInfo


class RewardWorker:
    """Applies a reward, or several summed with weights, to completions; may sit on its own slot or next to
    the rollout.

    Args:
        name: a registered reward (``math``, ``arithmetic``...), or a list of them.
        fn: instead, a function (e.g. defined in a notebook cell) taking some of ``completion``,
            ``answer`` and ``prompt`` by keyword and returning a float, or a registered name
            (``RewardWorker.launch(cluster, "0", fn="math")``), or a list of either (TRL's ``reward_funcs``).
        weights: with several rewards, one weight each (default 1.0 each; TRL's ``reward_weights``). A
            completion's reward is the weighted sum; each reward is also kept apart (:meth:`score_terms`),
            and the first is the one accuracy counts (a score >= 1): put the correctness reward first.
        fields: the prompt records' fields the rewards may read by name besides ``completion``, ``answer``
            and ``prompt`` (e.g. a coding task's ``tests``), as TRL passes a dataset's columns; a loop passes
            those every record has.

    Example:
        >>> RewardWorker(fn=lambda completion, answer: float(completion.strip() == answer)).score(["4"], ["4"])
        [1.0]
        >>> RewardWorker(fn=["arithmetic", "format"], weights=[1.0, 0.5]).score_terms(["4 #### 4"], ["4"])
        {'rewards': [1.5], 'terms': {'arithmetic': [1.0], 'format': [1.0]}}
    """

    launch = launcher("reward")

    @classmethod
    def prepare_launch(cls, kwargs: dict) -> dict:
        """On the driver: resolve the rewards into registry entries (they travel by value) or refuse them."""
        kwargs = dict(kwargs)
        fn, name = kwargs.pop("fn", None), kwargs.pop("name", "arithmetic")
        kwargs["fields"] = tuple(kwargs.get("fields", ()))
        kwargs["fn"], kwargs["weights"] = check_rewards(
            fn if fn is not None else name, kwargs.get("weights"), kwargs["fields"]
        )
        return kwargs

    def __init__(
        self, name="arithmetic", fn=None, weights=None, fields=(), rank_info: RankInfo | None = None,
        sandbox=None,
    ):  # fmt: skip
        # refuses a function the loop cannot call, a repeated name, or weights that do not fit
        entries, self.weights = check_rewards(fn if fn is not None else name, weights, tuple(fields))
        self.fields = tuple(fields)
        # the limits code a model wrote runs under (``reward.sandbox``), offered to rewards that take ``sandbox``
        self.sandbox = sandbox
        self.rewards = [SafeReward(e.name, e) for e in entries]
        self.names = [e.name for e in entries]
        self.name = "+".join(self.names)
        self.fn = self.rewards[0]

    def score(
        self,
        completions: list[str],
        answers: list[str],
        prompts: list[str] | None = None,
        fields: list[dict] | None = None,
    ) -> list[float]:
        """Each completion's reward: the weighted sum of the rewards. ``fields``: each completion's prompt
        record's other fields (``None``: none)."""
        return self._score_terms(completions, answers, prompts, fields)["rewards"]

    def score_terms(
        self,
        completions: list[str],
        answers: list[str],
        prompts: list[str] | None = None,
        fields: list[dict] | None = None,
    ) -> dict:
        """``{"rewards": [weighted sum per completion], "terms": {reward name: [its score per completion]}}``
        (what the loop logs apart). A subclass overriding :meth:`score` alone has its scores as one term."""
        if type(self).score is not RewardWorker.score:
            scored = (  # (a subclass's score may predate fields)
                self.score(completions, answers, prompts, fields)
                if fields and any(fields)
                else self.score(completions, answers, prompts)
            )
            rewards = [float(r) for r in scored]
            return {"rewards": rewards, "terms": {self.name: rewards}}
        return self._score_terms(completions, answers, prompts, fields)

    def _score_terms(self, completions, answers, prompts, fields) -> dict:
        n = len(completions)
        records = [{**f, "sandbox": self.sandbox} for f in (fields or [{}] * n)]
        inputs = (list(completions), list(answers), list(prompts or [None] * n), records)
        terms = {r.name: r.many(*inputs) for r in self.rewards}
        if len(terms) == 1 and self.weights[0] == 1.0:
            return {"rewards": terms[self.names[0]], "terms": terms}
        per_completion = zip(*(terms[name] for name in self.names))
        rewards = [sum(w * s for w, s in zip(self.weights, each)) for each in per_completion]
        return {"rewards": rewards, "terms": terms}

    def state_dict(self) -> dict:  # stateless; kept so every component checkpoints the same way
        return {"name": self.name}

    def load_state_dict(self, state: dict) -> None:
        self.name = state["name"]

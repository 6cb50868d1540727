"""Dynamic sampling (DAPO): a step's batch is made of groups whose completions did not all score alike,
sampled over rounds until enough are kept, topped up with groups set aside if sampling stops short."""

from __future__ import annotations

import torch

from rlnb.components.lm.layout import batch_rows, join_batches


class DynamicSampling:
    """A mixin of :class:`rlnb.components.lm.LMRollout` (it holds the ``batch`` just scored and ``tok``)."""

    # this step's rounds so far: the groups kept, and those set aside (LMRollout.__init__ sets them)
    kept_groups: list[dict]
    aside_groups: list[dict]

    def keep_groups(self, group_size: int, first: bool = False) -> dict:
        """Dynamic sampling: of the batch just scored, keep the groups whose completions did not all score
        alike for this step's batch, and set the others aside (to top the batch up with if sampling stops
        short); ``first``: the step's first round (what an earlier step left, had it failed midway, goes).
        Returns this batch's ``groups``, how many had a learning signal (``informative``), and the groups kept
        so far (``kept``)."""
        if first:
            self.kept_groups, self.aside_groups = [], []
        kept, aside = self.kept_groups, self.aside_groups
        rewards = self.batch["rewards"].view(-1, group_size)
        signal = (rewards != rewards[:, :1]).any(1)  # [G]
        rows = signal.repeat_interleave(group_size)
        kept.append(batch_rows(self.batch, rows))
        aside.append(batch_rows(self.batch, ~rows))
        return {
            "groups": len(signal),
            "informative": int(signal.sum()),
            "kept": sum(len(b["texts"]) for b in kept) // group_size,
        }

    def assemble_kept(self, groups: int, group_size: int) -> dict:
        """Dynamic sampling: this step's batch, the first ``groups`` groups kept (:meth:`keep_groups`), topped up
        with groups set aside where fewer were kept; returns how many of its ``groups`` are ``informative``."""
        parts, have, informative = [], 0, 0
        for source, informative_source in ((self.kept_groups, True), (self.aside_groups, False)):
            for part in source:
                take = min(len(part["texts"]) // group_size, groups - have)
                if take:
                    parts.append(batch_rows(part, torch.arange(take * group_size)))
                    have += take
                    informative += take if informative_source else 0
        self.kept_groups, self.aside_groups = [], []
        batch = join_batches(parts, self.tok.pad_token_id)
        batch["group_index"] = torch.arange(have).repeat_interleave(group_size)
        self.batch = batch
        return {"groups": have, "informative": informative}

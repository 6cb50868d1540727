"""Multi-turn rollouts: between two of the model's turns an interaction answers (a tool, an environment, a
judge: :mod:`rlnb.algorithms.interactions`), and only the model's own tokens are trained on. Both modes live
here: synchronous (:meth:`MultiTurn._generate_turns`, turn by turn over the batch) and asynchronous
(:meth:`MultiTurn._next_turn`, each sequence's next turn going on in the streaming pool's next chunks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlnb.components.lm.layout import pad_left, pad_right
from rlnb.models.lm import first_response_column

if TYPE_CHECKING:
    from rlnb.components.lm.streaming import PoolGroup, PoolSequence


class MultiTurn:
    """A mixin of :class:`rlnb.components.lm.LMRollout`: ``max_turns`` and ``interaction`` are set by its
    ``__init__``; ``_generate`` samples one turn."""

    max_turns, interaction = 1, None  # one turn, unless told
    turns_cut = 0  # transcripts ended because their next turn would not fit in the model's positions

    def _multi_turn(self) -> bool:
        return self.max_turns > 1 and self.interaction is not None

    def _generate_turns(self, prompts: list, n: int, greedy: bool, answers, fields) -> tuple[dict, list[str]]:
        """:meth:`_generate`, then, up to ``max_turns``, the interaction's reply to each transcript and the
        model's next turn after it (one completion each, from the transcript's token ids: nothing is tokenized
        again). The batch holds each whole transcript after its prompt, the interaction's tokens in context
        (attended to) but out of the response mask, with no log-prob; ``texts`` are the transcripts."""
        batch, texts = self._generate(prompts, n, greedy)
        if not self._multi_turn():
            return batch, texts
        pad, start = self.tok.pad_token_id, first_response_column(batch["response_mask"])
        rows = range(len(texts))
        heads = [
            batch["input_ids"][i, :start][batch["attention_mask"][i, :start].bool()].tolist() for i in rows
        ]
        # each row's turns after its prompt: (token ids, log-probs, the model's own)
        parts: list[list[tuple[list[int], list[float], bool]]] = [[] for _ in rows]

        def take(i: int, b: dict, j: int) -> None:  # row j of a turn's batch b: row i's model turn
            mask = b["response_mask"][j].bool()
            parts[i].append((b["input_ids"][j][mask].tolist(), b["logprobs"][j][mask].tolist(), True))

        for i in rows:
            take(i, batch, i)
        answers = answers or [""] * len(prompts)
        fields = fields or [{}] * len(prompts)
        live, last = list(rows), list(texts)  # (each row's latest model turn, as text)
        for turn in range(1, self.max_turns):
            going = []
            for i in live:
                g = i // n
                reply = self.interaction(texts[i], turn, answers[g], prompts[g], last[i], **fields[g])
                if reply is not None:
                    ids = self._reply_ids(reply, len(heads[i]) + sum(len(p[0]) for p in parts[i]))
                    if ids is None:
                        continue
                    parts[i].append((ids, [0.0] * len(ids), False))
                    texts[i] += reply
                    going.append(i)
            if not going:
                break
            contexts = [heads[i] + [t for ids, _, _ in parts[i] for t in ids] for i in going]
            nxt, more = self._generate(contexts, 1, greedy)
            for j, i in enumerate(going):
                take(i, nxt, j)
                texts[i] += more[j]
                last[i] = more[j]
            live = going
        out = self._transcripts(heads, parts, pad)
        out["turns"] = torch.tensor([sum(p[2] for p in row) for row in parts])  # the model's turns, [B]
        return out, texts

    def _reply_ids(self, reply: str, length: int) -> list[int] | None:
        """The interaction's ``reply`` as the token ids that follow a transcript of ``length`` tokens (its prompt's
        included); or ``None``, counted in ``turns_cut``, where the model's next turn after it would not fit in
        the model's positions: the transcript then ends before that reply (in both modes, turn by turn)."""
        ids = self.tok(reply, add_special_tokens=False)["input_ids"]
        limit = self._context_limit()
        if limit is not None and length + len(ids) + self.max_new_tokens > limit:
            self.turns_cut += 1
            return None
        return ids

    def _context_limit(self) -> int | None:
        """The model's positions (``max_position_embeddings``), or ``None`` where not known."""
        return getattr(getattr(getattr(self, "model", None), "config", None), "max_position_embeddings", None)

    @staticmethod
    def _transcripts(heads: list[list[int]], parts: list[list[tuple]], pad: int) -> dict:
        """The batch of whole transcripts: prompts left-padded, every turn after them right-padded; the response
        mask and log-probs on the model's own tokens only, the attention mask on every real token."""
        prompt = pad_left(heads, pad)
        ids = [[t for p in row for t in p[0]] for row in parts]
        own = [[int(p[2]) for p in row for _ in p[0]] for row in parts]
        logp = [[x for p in row for x in p[1]] for row in parts]
        zeros = torch.zeros(len(ids), prompt.shape[1])
        return {
            "input_ids": torch.cat([prompt, pad_right(ids, pad)], 1),
            "attention_mask": torch.cat(
                [pad_left([[1] * len(h) for h in heads], 0), pad_right([[1] * len(r) for r in ids], 0)], 1
            ),
            "response_mask": torch.cat([zeros.long(), pad_right(own, 0)], 1),
            "logprobs": torch.cat([zeros, pad_right(logp, 0.0)], 1),
        }

    def _next_turn(self, g: PoolGroup, s: PoolSequence) -> None:
        """Asynchronous multi-turn: sequence ``s`` of group ``g`` ended a turn. The interaction answers its
        transcript, and the reply's tokens follow as context for the next turn; or the transcript is done: at
        ``max_turns``, when the interaction ends it, or when the next turn would not fit the model's positions
        (:meth:`_reply_ids`, as in :meth:`_generate_turns`)."""
        last = self.tok.decode(s.ids[s.turn_start :], skip_special_tokens=True)
        s.text += last
        if s.turn >= self.max_turns:
            s.done = True
            return
        reply = self.interaction(s.text, s.turn, g.answer, g.prompt, last, **g.fields)
        ids = None if reply is None else self._reply_ids(reply, len(g.prompt_ids) + len(s.ids))
        if ids is None:
            s.done = True
            return
        s.ids += ids
        s.logprobs += [0.0] * len(ids)
        s.versions += [-1] * len(ids)
        s.own += [0] * len(ids)
        s.text += reply
        s.turn += 1
        s.turn_start = len(s.ids)

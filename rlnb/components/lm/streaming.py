"""Asynchronous generation (AReaL's partial rollouts): a pool of groups in progress, generated a chunk of
tokens at a time across weight updates, every token keeping the policy version that produced it."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from rlnb.components.lm.decoding import Decoding
from rlnb.components.lm.layout import pad_left, same_objects
from rlnb.errors import ConfigError
from rlnb.models.lm import prompt_ids
from rlnb.runtime.rank import local_peer

log = logging.getLogger("rlnb")


# (compared by identity: the decoding state kept across chunks is of these rows)
@dataclasses.dataclass(eq=False)
class PoolSequence:
    """One completion in progress: its tokens so far after the prompt, their log-probs and the policy version
    of each (-1 on an interaction's reply), and, in a multi-turn rollout, which tokens are the model's own
    (``own``), the transcript's text, the turn it is in and where that turn starts in ``ids``."""

    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    done: bool = False
    own: list[int] | None = None  # multi-turn only
    text: str = ""
    turn: int = 1
    turn_start: int = 0


@dataclasses.dataclass(eq=False)
class PoolGroup:
    """One problem's ``n`` completions in progress: ``start`` is the policy version its first tokens were
    generated with (``None`` until then); ``serial`` orders problems as the loop admitted them."""

    serial: int
    prompt: str
    answer: str
    fields: dict
    prompt_ids: list[int]
    seqs: list[PoolSequence]
    start: int | None = None

    @property
    def done(self) -> bool:
        return all(s.done for s in self.seqs)

    def state(self) -> dict:
        """Plain types, for a checkpoint that loads without running code."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> PoolGroup:
        return cls(**{**state, "seqs": [PoolSequence(**s) for s in state["seqs"]]})


class StreamingPool:
    """A mixin of :class:`rlnb.components.lm.HFRollout`: generation in chunks over a pool of groups."""

    KEEP_CACHE_ACROSS_CHUNKS = True  # a chunk goes on from the last one's KV cache
    # stream() generates chunks of tokens (a subclass with its own engine, generating whole completions, cannot)
    CHUNKED_GENERATION = True
    _carried: tuple | None = None
    _said_static = False  # the static-cache warning was logged (once a rank)
    pool: list[PoolGroup]  # groups admitted and not yet handed over (HFRollout.__init__ sets it)

    # ------------------------------------------------------------------ asynchronous generation
    def stream(
        self, problems: list[tuple[int, str, str]], n: int, train_version: int, groups: int, max_staleness: int,
        weights, weights_key: str, batches, batch_key: str, reward: str, shards: int = 1, chunk_tokens: int = 8,
        puts: list[tuple[str, int]] | None = None,
    ) -> dict:  # fmt: skip
        """Partial-rollout generation for asynchronous training (AReaL): admit ``problems``
        (``(serial, prompt, answer)`` or ``(serial, prompt, answer, fields)``, ``n`` completions each) to the
        pool of groups in progress, then generate ``chunk_tokens`` at a time for every unfinished sequence until
        ``groups`` groups are done. The loop admits them at version ``train_version - 1``: the call first waits (up to the channel's
        deadline) for those weights if they have not arrived yet.

        Between chunks it takes the newest weights the actor published under ``weights_key``: a
        generation interrupted by a weight update goes on with the new weights, and every token keeps
        the version that produced it (``versions [B, L]``). A group is trained at ``train_version``;
        one started at version ``v`` with ``train_version - v >= max_staleness`` must be in this batch
        (it would be too stale for the next), so the call goes on until such groups are done. It also
        goes on generating the pool's other groups until the actor publishes ``train_version`` (it is
        then ready for the batch), so the rollout does not idle while the actor trains. The
        finished groups, oldest first, are scored by the collocated ``reward`` and put in ``batches``
        under ``batch_key`` (or ``shards`` parts); groups still unfinished stay in the pool for the next
        call, and in this rank's checkpoint. ``puts``: an elastic run's shares of the batch this rank makes,
        ``(key, shards)`` each, ``groups`` groups a share (instead of ``batch_key`` and ``shards``).

        With ``max_turns > 1``, a sequence whose turn ends (EOS, or ``max_new_tokens`` of that turn) gets the
        interaction's reply at once and its next turn goes on in the next chunks, beside the other sequences'
        tokens, across weight updates as any other: a long conversation does not hold up the batch's others.
        The replies are context, out of the response mask, with no log-prob and version -1, as the prompt.
        """
        if not self.CHUNKED_GENERATION:  # (the loop refuses this before anything starts; a direct call, here)
            raise ConfigError(
                f"{type(self).__name__} generates whole completions (its own engine): asynchronous generation "
                "takes new weights between chunks of tokens, with HFRollout's own decoding",
                "max_staleness",
            )
        # a recipe refuses a static cache with asynchronous training; an object given to the loop says so once
        if getattr(self, "static_cache", False) and not self._said_static:
            self._said_static = True
            log.warning(
                "rollout[%d]: static_cache serves synchronous generation; asynchronous chunks decode with rlnb's "
                "own loop", self.rank,
            )  # fmt: skip
        t0 = time.perf_counter()
        puts = puts or [(batch_key, shards)]
        groups *= len(puts)
        self._admit(problems, n)
        swaps, tokens, chunks = 0, 0, 0
        # the loop admitted these problems once it had published version train_version - 1, but a put does
        # not wait for delivery: generating them with older weights would put them N + 1 versions behind
        while self.version < train_version - 1:
            self.load_from_channel(weights, weights_key)
            swaps += 1
        last_due = train_version - max_staleness  # groups started at or before it must be in this batch
        while True:
            if self.poll_weights(weights, weights_key) is not None:
                swaps += 1
            done = [g for g in self.pool if g.done]
            busy = len(done) < len(self.pool)
            overdue = busy and any(
                g.start is not None and g.start <= last_due and not g.done for g in self.pool
            )
            # enough groups done, none overdue, and the actor is ready for them (it publishes version
            # train_version before it takes the batch): until then, keep generating for the next batches
            if len(done) >= groups and not overdue and (self.version >= train_version or not busy):
                break
            if not busy:
                raise RuntimeError(
                    f"rollout rank {self.rank}: {len(done)} group(s) in the pool, {groups} needed; the loop "
                    "admits too few problems"
                )
            tokens += self._chunk(chunk_tokens)
            chunks += 1
        taken = sorted(done, key=lambda g: (g.start, g.serial))[:groups]
        taken_ids = {id(g) for g in taken}
        self.pool = [g for g in self.pool if id(g) not in taken_ids]
        self.batch = self._pool_batch(taken)
        self.batch["truncated"] = self._truncated(self.batch)
        summary = {
            "sequences": len(self.batch["texts"]),
            "tokens": tokens,
            "response_len_mean": float(self.batch["response_mask"].sum(-1).float().mean()),
            "truncated_frac": float(self.batch["truncated"].float().mean()),
            "staleness": [train_version - g.start for g in taken],
            "interrupted": sum(len({v for v in s.versions if v >= 0}) > 1 for g in taken for s in g.seqs),
            "serials": [g.serial for g in taken],
            "swaps": swaps,
            "chunks": chunks,
            "pool": len(self.pool),
            "version": self.version,
        }
        if "turns" in self.batch:  # multi-turn: the model's turns per transcript
            summary["turns_mean"] = float(self.batch["turns"].float().mean())
        b = self.batch
        scored = local_peer(reward, self.rank).score_terms(
            b["texts"], b["answers"], b["prompts"], b["fields"]
        )
        summary.update(self.set_rewards(scored["rewards"], scored["terms"]))
        self.put_shares(batches, puts)
        summary["generate_s"] = time.perf_counter() - t0
        return summary

    def release(self, n: int) -> list[int]:
        """An elastic run moving a share of the batch to another rank: the ``n`` groups admitted last (those not
        started first, then the latest started) leave this rank's pool; their serials, admitted again there."""
        young = sorted(self.pool, key=lambda g: (g.start is not None, -(g.start or 0), -g.serial))[:n]
        gone = {id(g) for g in young}
        self.pool = [g for g in self.pool if id(g) not in gone]
        self._carried = None
        return [g.serial for g in young]

    def _admit(self, problems: list[tuple[int, str, str]], n: int) -> None:
        """Add ``problems`` (``(serial, prompt, answer)``, and the record's other ``fields``) to the pool,
        ``n`` empty sequences each."""
        for serial, prompt, answer, *fields in problems:
            # multi-turn: each sequence marks the model's own tokens apart from the interaction's replies
            seqs = [PoolSequence(own=[] if self._multi_turn() else None) for _ in range(n)]
            group = PoolGroup(
                serial, prompt, answer, fields[0] if fields else {}, prompt_ids(self.tok, prompt), seqs
            )
            self.pool.append(group)

    @torch.no_grad()
    def _chunk(self, chunk_tokens: int) -> int:
        """Up to ``chunk_tokens`` more tokens for every unfinished sequence of the pool, with the weights
        loaded now. Sampled by rlnb's decoding loop (:meth:`_decode_from`: a sequence that ends, or makes the
        tokens it has left, leaves the batch), which goes on from the last chunk's KV cache while the
        weights and the sequences are the same (:attr:`KEEP_CACHE_ACROSS_CHUNKS`), and otherwise prefills
        them again; or by ``generate`` with ``drop_finished=False``, prefilling every chunk."""
        self.onload()
        rows = [(g, s) for g in self.pool for s in g.seqs if not s.done]
        budget = [self.max_new_tokens - len(s.ids) + s.turn_start for _, s in rows]
        seed, steps = self.seed * 1_000_003 + self.calls, min(chunk_tokens, max(budget))
        self.calls += 1
        carried, self._carried = self._carried, None
        sampled = None
        if self.drop_finished and self.decode_fallback is None:
            torch.manual_seed(seed)
            try:
                if (
                    carried is not None
                    and carried[0] == self.version
                    and same_objects(carried[1], [s for _, s in rows])
                ):
                    state = carried[2]  # the same sequences with the same weights: their KV cache holds
                else:
                    ids, attn = self._contexts(rows)
                    state = Decoding.start(ids, attn, self._prefill(ids, attn))
                left = torch.tensor(budget, device=self.device)
                sampled = self._decode_from(state, steps, False, left, going_on=self.KEEP_CACHE_ACROSS_CHUNKS)
            except Exception as e:
                self._decoding_failed(e)
        if sampled is None:
            torch.manual_seed(seed)
            ids, attn = self._contexts(rows)
            out = self.model.generate(
                input_ids=ids, attention_mask=attn, do_sample=True, temperature=self.temperature, top_p=self.top_p,
                top_k=self.top_k or None, max_new_tokens=steps, pad_token_id=self.tok.pad_token_id,
                eos_token_id=self.tok.eos_token_id, return_dict_in_generate=True, output_scores=True,
            )  # fmt: skip
            scores = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
            sampled = out.sequences[:, ids.shape[1] :], scores, None
        new, logp, going = sampled[0].tolist(), sampled[1].tolist(), sampled[2]
        made = 0
        for (g, s), toks, lps, left in zip(rows, new, logp, budget):
            if g.start is None:
                g.start = self.version
            toks, lps = toks[:left], lps[:left]
            ended = self.tok.eos_token_id in toks
            if ended:  # keep up to and including the first EOS
                cut = toks.index(self.tok.eos_token_id) + 1
                toks, lps = toks[:cut], lps[:cut]
            s.ids += toks
            s.logprobs += lps
            s.versions += [self.version] * len(toks)
            made += len(toks)
            if s.own is not None:  # multi-turn: the turn over, the interaction answers or the transcript ends
                s.own += [1] * len(toks)
                if ended or len(toks) >= left:
                    self._next_turn(g, s)
            else:
                s.done = ended or len(s.ids) >= self.max_new_tokens
        if going is not None:  # the rows still running (not done) go on from this chunk's KV cache
            running = [rows[i][1] for i in going.rows.tolist()]
            if all(not seq.done for seq in running):
                self._carried = (self.version, running, going)
        return made

    def _contexts(self, rows: list[tuple[PoolGroup, PoolSequence]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool ``rows``' prompts and tokens so far, left-padded ``[N, C]``, and their mask."""
        contexts = [g.prompt_ids + s.ids for g, s in rows]
        ids = pad_left(contexts, self.tok.pad_token_id).to(self.device)
        return ids, pad_left([[1] * len(c) for c in contexts], 0).to(self.device)

    def _pool_batch(self, taken: list[PoolGroup]) -> dict:
        """Finished groups as a batch in the layout of :meth:`generate`, plus per-token ``versions``."""
        seqs = [(g, s) for g in taken for s in g.seqs]
        pad = self.tok.pad_token_id
        prompt = pad_left([g.prompt_ids for g, _ in seqs], pad)  # [B, P]
        width = max(len(s.ids) for _, s in seqs)

        def right(key, fill, dtype):  # [B, R], right-padded
            rows = [getattr(s, key) for _, s in seqs]
            return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=dtype)

        multi_turn = all(s.own is not None for _, s in seqs)
        attended = torch.tensor([[1] * len(s.ids) + [0] * (width - len(s.ids)) for _, s in seqs])
        resp_mask = right("own", 0, torch.long) if multi_turn else attended
        zeros = torch.zeros_like(prompt)
        if multi_turn:
            texts = [s.text for _, s in seqs]
        else:
            texts = self.tok.batch_decode([s.ids for _, s in seqs], skip_special_tokens=True)
        n = len(taken[0].seqs)
        extra = {"turns": torch.tensor([s.turn for _, s in seqs])} if multi_turn else {}
        return {
            "input_ids": torch.cat([prompt, right("ids", pad, torch.long)], dim=1),
            "attention_mask": torch.cat(
                [pad_left([[1] * len(g.prompt_ids) for g, _ in seqs], 0), attended], 1
            ),
            "response_mask": torch.cat([zeros, resp_mask], dim=1),
            "logprobs": torch.cat([zeros.float(), right("logprobs", 0.0, torch.float32)], dim=1),
            "versions": torch.cat([zeros - 1, right("versions", -1, torch.long)], dim=1),
            "group_index": torch.arange(len(taken)).repeat_interleave(n),
            "answers": [g.answer for g, _ in seqs],
            "prompts": [g.prompt for g, _ in seqs],
            "fields": [g.fields for g, _ in seqs],
            "texts": texts,
            "version": min(g.start for g in taken),
            **extra,
        }

    def pool_state(self) -> list[dict]:
        """The pool in plain types, for this rank's checkpoint."""
        return [g.state() for g in self.pool]

    def load_pool_state(self, state: list[dict]) -> None:
        self.pool = [PoolGroup.from_state(g) for g in state]
        self._carried = None

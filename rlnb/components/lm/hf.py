"""The HF rollout: a ``transformers`` causal LM held in the worker, sampled by the samplers of
:mod:`.decoding`, synchronously (:meth:`LMRollout.generate`) or a chunk of tokens at a time across weight
updates (:mod:`.streaming`)."""

from __future__ import annotations

import torch

from rlnb.components.lm.decoding import Decoder
from rlnb.components.lm.rollout import LMRollout
from rlnb.components.lm.streaming import StreamingPool
from rlnb.models.lm import cache_kwarg, check_dtype, encode_prompts, load_lm, prompt_ids
from rlnb.runtime.rank import RankInfo


class HFRollout(StreamingPool, Decoder, LMRollout):
    """Batched sampling from a ``transformers`` causal LM; ``HFRollout.launch(cluster, "0", model_path=...)``.

    Args:
        model_path: a ``save_pretrained`` directory.
        max_new_tokens, temperature, top_p, top_k: sampling parameters (``top_k=0``: all tokens), applied
            as ``transformers``' ``generate`` applies them: temperature, then top-k, then top-p.
        seed: rank ``r`` seeds each call from ``rlnb.seeding.rank_seed(seed, r, "lm_rollout")`` and a call
            counter (reproducible).
        share_prompt_prefill: compute each prompt's KV cache once for its ``n`` completions and repeat
            it, where ``generate`` would compute it ``n`` times (same tokens and log-probs). If a model's
            cache cannot be shared this way, the rollout says why once and prefills per completion.
        drop_finished: decode with rlnb's own sampling loop, from which a sequence leaves once it has
            ended (EOS): ``generate`` goes on computing every ended sequence until the longest ends,
            which in a batch of long-tailed lengths is most of its work. It samples each token from
            the model's distribution at ``temperature`` (and ``top_p``), as ``generate`` does with the
            same seed while no sequence has ended. If a model cannot be decoded this way, the rollout
            says why once and uses ``generate``; ``False`` always uses ``generate``.
        max_turns: turns the model takes per completion at most (multi-turn rollouts); between two of them
            ``interaction`` answers (:mod:`rlnb.algorithms.interactions`), and only the model's own tokens
            are trained on.
        interaction: a registered interaction's name or a function: ``(completion, turn, answer, prompt,
            fields...) -> str | None``, the text that follows the model's turn, or ``None`` to end there.
        dtype: ``float32`` or ``bfloat16``: the precision the model is held and run in (the actor's
            ``dtype``; weights synced from a float32 actor are cast as they load).
        static_cache: sample with ``generate`` on a static KV cache, its decoding step compiled on a GPU
            (CUDA graphs); prompts left-padded to a multiple of ``STATIC_PROMPT_MULTIPLE`` tokens so that a
            run compiles a few shapes. Ended rows are computed to the end and each completion prefills its
            prompt. Synchronous generation only (asynchronous chunks decode with rlnb's loop).

    Example:
        >>> rollout = HFRollout(path, max_new_tokens=16, dtype="bfloat16")  # doctest: +SKIP
        >>> rollout.generate(["1+2="], ["3"], n=4)["response_len_mean"]  # doctest: +SKIP
    """

    def __init__(
        self, model_path: str, max_new_tokens: int = 8, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
        device: str = "auto", torch_threads: int = 1, rank_info: RankInfo | None = None,
        share_prompt_prefill: bool = True, drop_finished: bool = True, top_k: int = 0, max_turns: int = 1,
        interaction=None, dtype: str = "float32", static_cache: bool = False,
    ):  # fmt: skip
        super().__init__(
            max_new_tokens, temperature, top_p, top_k, seed, device, max_turns, interaction, rank_info
        )
        self.dtype, self.static_cache = check_dtype(dtype), bool(static_cache)
        torch.set_num_threads(torch_threads)
        self.share_prompt_prefill = share_prompt_prefill
        self.drop_finished = drop_finished
        self.decode_fallback: str | None = None  # why rlnb's decoding loop gave way to generate, if it did
        self.prefill_fallback: str | None = None  # why prompts could not share their prefill, if so
        self.shared_prefills = 0  # generate calls whose prompts were prefilled once for all completions
        self.model_path = model_path
        self.model, self.tok = load_lm(model_path, self.device, dtype=self.dtype)
        self.model.eval().requires_grad_(False)
        self.pool = []  # asynchronous mode: groups admitted and not yet handed over
        # asynchronous mode: (version, the sequences still running, their decoding state) after a chunk
        self._carried = None
        # rollout.static_cache: ((rows, columns), the StaticCache reused while they match)
        self._static = None

    def inspect(self, prompt: str, top_k: int = 5, max_new_tokens: int | None = None) -> list[dict]:
        """``prompt``'s greedy completion token by token (a rollout inspector): each token with its log-probability
        and the entropy (nats) of the distribution the rollout samples from (``temperature`` applied), and the
        ``top_k`` most likely tokens with their probabilities. Nothing of the run changes (no sampling draws)."""
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= len(self.tok):
            raise ValueError(
                f"top_k: expected an integer in [1, {len(self.tok)}] (the vocabulary), got {top_k!r}"
            )
        steps = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 4096:
            raise ValueError(f"max_new_tokens: expected an integer in [1, 4096], got {steps!r}")
        ids = torch.tensor([prompt_ids(self.tok, prompt)], device=self.device)
        rows, past = [], None
        with torch.no_grad():
            for _ in range(steps):
                out = self.model(
                    ids if past is None else ids[:, -1:], use_cache=True, **cache_kwarg(self.model, past)
                )
                past = out.past_key_values
                logp = torch.log_softmax(out.logits[0, -1].float() / max(self.temperature, 1e-6), -1)  # [V]
                token = int(logp.argmax())
                top = logp.topk(top_k)
                rows.append({
                    "token": self.tok.decode([token]), "id": token, "logprob": float(logp[token]),
                    "entropy": float(-(logp.exp() * logp).sum()),
                    "top": [(self.tok.decode([int(i)]), float(p)) for p, i in zip(top.values.exp(), top.indices)],
                })  # fmt: skip
                if token == self.tok.eos_token_id:
                    break
                ids = torch.cat([ids, torch.tensor([[token]], device=self.device)], dim=1)
        return rows

    def load_weights(self, state_dict: dict, version: int) -> int:
        self.model.load_state_dict(state_dict)
        self.version = version
        self._carried = None  # a KV cache of the old weights
        return version

    def load_some_weights(self, state_dict: dict, version: int) -> int:
        own = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in state_dict.items():
                own[name].copy_(tensor)
        self.version = version
        self._carried = None  # a KV cache of the old weights
        return version

    def load_weights_in_parts(self, parts, version: int) -> int:
        """A sharded actor's weights, bucket by bucket: each tensor copied into the model as it comes (no second
        copy of the model); every one of the model's tensors must come, and only those."""
        own, seen = self.model.state_dict(), set()
        with torch.no_grad():
            for part in parts:
                for name, tensor in part.items():
                    if name not in own:
                        raise KeyError(
                            f"rollout: the actor sent {name!r}, which the rollout's model does not have"
                        )
                    own[name].copy_(tensor)
                    seen.add(name)
        missing = sorted(set(own) - seen)
        if missing:
            raise KeyError(f"rollout: the actor's weights lacked {missing[:5]} ({len(missing)} in all)")
        self.version = version
        self._carried = None
        return version

    # GPU memory for collocated training: park the rollout model on the CPU while the actor trains
    def offload(self) -> bool:
        if self.device.type == "cuda" and not self.offloaded:
            self.model.to("cpu")
            self._carried = self._static = None  # their KV caches would hold GPU memory the actor needs
            torch.cuda.empty_cache()
            self.offloaded = True
        return self.offloaded

    def onload(self) -> bool:
        if self.offloaded:
            self.model.to(self.device)
            self.offloaded = False
        return not self.offloaded

    def memory_stats(self) -> dict:
        """Where the model is (``offloaded`` while a collocated actor trains) and this process's GPU memory."""
        cuda = self.device.type == "cuda"
        return {
            "device": str(self.device),
            "model_device": next(self.model.parameters()).device.type,
            "model_dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "offloaded": self.offloaded,
            "cuda_allocated_bytes": torch.cuda.memory_allocated(self.device) if cuda else 0,
        }

    @torch.no_grad()
    def _generate(self, prompts: list[str], n: int, greedy: bool):
        self.onload()
        enc = encode_prompts(self.tok, prompts).to(self.device)
        seed = self.seed * 1_000_003 + self.calls
        if not greedy:  # greedy decoding draws nothing: evaluating does not shift training's sampling seeds
            self.calls += 1

        def seeded(sampler):  # both samplers draw from the same per-call seed
            if not greedy:
                torch.manual_seed(seed)
            return sampler(enc, n, greedy)

        sampled = seeded(self._static_generate) if self.static_cache else None
        if sampled is None and self.drop_finished and self.decode_fallback is None:
            prefills = self.shared_prefills
            try:
                sampled = seeded(self._decode)
            except Exception as e:  # a model this loop cannot drive (its forward needs generate's inputs)
                self.shared_prefills = prefills  # generate prefills again: count the call once
                self._decoding_failed(e)
        if sampled is None:
            sampled = seeded(self._hf_generate)
        seqs, logp = sampled  # (B*n, P+R), (B*n, R)
        prompt_len = enc["input_ids"].shape[1]
        response = seqs[:, prompt_len:]  # (B*n, R)
        # response mask: tokens up to and including the first EOS
        is_eos = response == self.tok.eos_token_id
        after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0
        resp_mask = (~after_eos).long()
        logp = torch.where(resp_mask.bool(), logp, torch.zeros_like(logp)).float()
        attn = torch.cat([enc["attention_mask"].repeat_interleave(n, 0), resp_mask], dim=1)
        zeros = torch.zeros(seqs.shape[0], prompt_len, dtype=torch.long, device=seqs.device)
        texts = self.tok.batch_decode(
            response * resp_mask + self.tok.pad_token_id * (1 - resp_mask), skip_special_tokens=True
        )
        return {
            "input_ids": seqs.cpu(),
            "attention_mask": attn.cpu(),
            "response_mask": torch.cat([zeros, resp_mask], dim=1).cpu(),
            "logprobs": torch.cat([zeros.float(), logp], dim=1).cpu(),
        }, texts

    def generation_stats(self) -> dict:
        """How this rank generated: whether ended rows leave the batch (``drop_finished``), calls whose prompts
        shared one prefill, why sharing or the decoding loop stopped, if they did, and how many multi-turn
        transcripts ended because their next turn would not fit in the model's positions (``turns_cut``)."""
        return {
            "drop_finished": self.drop_finished,
            "shared_prefills": self.shared_prefills,
            "prefill_fallback": self.prefill_fallback,
            "decode_fallback": self.decode_fallback,
            **super().generation_stats(),
        }

    def state_dict(self) -> dict:
        return {**super().state_dict(), "pool": self.pool_state()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.load_pool_state(state.get("pool", []))

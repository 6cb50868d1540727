"""Toward real model sizes: ``actor.dtype=bfloat16``, ``rollout.static_cache``, the memory metrics, and the GPU
checks for them and for a command-line cluster, run here on CPU (``device="cpu"``)."""

import json

import pytest
import torch

from rlnb.components.lm import HFRollout, LMActor
from rlnb.config import RecipeError, load_recipe
from rlnb.errors import ConfigError
from rlnb.models.lm import build_tiny_lm

PROMPTS = [f"{a}+{a * 7 % 50}=" for a in range(8)]
ANSWERS = [str(a + a * 7 % 50) for a in range(8)]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return str(build_tiny_lm(tmp_path_factory.mktemp("lm") / "m", hidden_size=64, num_layers=2, seed=0))


@pytest.mark.parametrize("greedy", [True, False])
def test_static_cache_samples_the_tokens_and_logprobs_of_the_other_samplers(lm, greedy):
    """``generate`` on a static KV cache, prompts left-padded to a multiple of 32 columns (taken off again):
    greedy, the batch of rlnb's decoding loop; sampled from one seed, the batch of ``generate`` with a dynamic
    cache (the loop draws other random numbers once rows have ended and left its batch). Each prompt is prefilled
    once into the static cache for its completions, or per completion (``share_prompt_prefill=False``): the same
    batch; the static cache is reused by the next call of the same shape."""
    other = HFRollout(lm, max_new_tokens=16, seed=3, drop_finished=greedy)
    static = HFRollout(lm, max_new_tokens=16, seed=3, static_cache=True)
    apart = HFRollout(lm, max_new_tokens=16, seed=3, static_cache=True, share_prompt_prefill=False)
    (a, _), (b, _), (c, _) = (r._generate(PROMPTS, 4, greedy=greedy) for r in (other, static, apart))
    assert static.shared_prefills == 1 and apart.shared_prefills == 0
    assert a["input_ids"].shape == b["input_ids"].shape and a["input_ids"].shape[1] < 32
    for x in (b, c):
        assert torch.equal(a["input_ids"], x["input_ids"]) and torch.equal(
            a["response_mask"], x["response_mask"]
        )
        assert torch.allclose(a["logprobs"], x["logprobs"], atol=1e-5)
    cache = static._static[1]
    static._generate(PROMPTS, 4, greedy=greedy)
    assert static._static[1] is cache and static.shared_prefills == 2


def test_bf16_rollout_and_actor_compute_in_bf16_and_keep_float32_state(lm):
    rollout = HFRollout(lm, max_new_tokens=8, seed=0, dtype="bfloat16")
    assert rollout.memory_stats()["model_dtype"] == "bfloat16"
    rollout.generate(PROMPTS, ANSWERS, n=4)
    rollout.set_rewards([float(i % 2) for i in range(32)])
    half, full = LMActor(lm, dtype="bfloat16", group_size=4), LMActor(lm, group_size=4)
    logps = []
    for actor in (half, full):
        actor.set_batch([rollout.batch])
        logps.append(actor._logprobs(actor.policy, actor.batch))
    assert logps[0].dtype == torch.float32  # log-probs in float32 from bf16 compute
    mask = rollout.batch["response_mask"].bool()
    assert 0 < (logps[0] - logps[1])[mask].abs().max() < 0.05  # bf16 rounding, not another model
    before = {k: v.clone() for k, v in half.policy.state_dict().items()}
    out = half.train()
    assert any(not torch.equal(before[k], v) for k, v in half.policy.state_dict().items())
    assert all(p.dtype == torch.float32 for p in half.policy.parameters())  # master weights
    param_bytes = sum(p.numel() * 4 for p in half.policy.parameters())
    # parameters, gradients and AdamW's two moments (plus its step counters)
    assert 4 * param_bytes <= out["memory/actor_state_bytes"] < 4.01 * param_bytes
    assert {v.dtype for v in half.policy_state().values() if v.is_floating_point()} == {torch.bfloat16}
    rollout.load_weights(half.policy_state(), 1)  # bf16 weights into the bf16 rollout


def test_a_model_built_in_bf16_is_saved_in_bf16_and_trains_from_float32_master_weights(tmp_path):
    """build_tiny_lm(dtype="bfloat16"), as large checkpoints are published: the files hold bf16 weights (half the
    bytes), the config says so, and a float32 actor upcasts them as it loads; another dtype is refused by name."""
    from safetensors.torch import load_file

    path = build_tiny_lm(tmp_path / "half", hidden_size=64, num_layers=2, seed=0, dtype="bfloat16")
    assert {t.dtype for t in load_file(path / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    actor = LMActor(str(path), group_size=4, seed=0)
    assert {p.dtype for p in actor.policy.parameters()} == {torch.float32}
    whole = build_tiny_lm(tmp_path / "whole", hidden_size=64, num_layers=2, seed=0)
    assert {t.dtype for t in load_file(whole / "model.safetensors").values()} == {torch.float32}
    with pytest.raises(ConfigError, match="dtype: expected one of .*'float16'"):
        build_tiny_lm(tmp_path / "other", dtype="float16")


def test_dtype_and_static_cache_refused_where_they_cannot_work(lm):
    with pytest.raises(ConfigError, match=r"dtype: expected one of \['bfloat16', 'float32'\], got 'float16'"):
        LMActor(lm, dtype="float16")
    with pytest.raises(ConfigError, match="dtype: expected one of"):
        HFRollout(lm, dtype="half")
    with pytest.raises(RecipeError, match="actor.dtype"):
        load_recipe("grpo_arith", ["actor.dtype=float16"])
    with pytest.raises(RecipeError, match="rollout.dtype"):
        load_recipe("grpo_arith", ["rollout.dtype=half"])
    with pytest.raises(RecipeError, match="rollout.static_cache: a static KV cache for the hf backend"):
        load_recipe("grpo_arith", ["rollout.backend=vllm", "rollout.static_cache=true"])
    # asynchronous chunks decode with rlnb's loop: the setting would go unused, so it is said before anything starts
    with pytest.raises(
        RecipeError, match=r"rollout.static_cache: .* with algorithm.max_staleness=2 .* chunks"
    ):
        load_recipe("grpo_arith", ["rollout.static_cache=true", "algorithm.max_staleness=2"])


def test_bf16_grpo_learns_on_workers_and_logs_memory(tmp_path):
    """``make gpu-check``'s ``lm_bf16_cuda`` on CPU: the recipe's GRPO with ``actor.dtype=bfloat16`` on a worker
    lifts held-out accuracy by 0.1 over the warm start in 60 steps (0.55 -> 0.81 here), the rollout's model
    in bf16 and ``memory/actor_state_bytes`` logged."""
    from rlnb.gpu_check.scale import check_lm_bf16_cuda

    out = check_lm_bf16_cuda(tmp_path, device="cpu", steps=60, lift=0.1)
    assert out["rollout_model_dtype"] == "bfloat16" and out["actor_state_bytes"] > 0


def test_command_line_cluster_check_runs_ppo_and_grpo(tmp_path):
    """``make gpu-check``'s ``remote_dask_cuda_scheduler`` with ``dask worker`` on CPU: the scheduler and worker
    from the command line (``python -m dask`` where no script is installed), a PPO and a GRPO run by address."""
    from rlnb.gpu_check.scale import check_remote_dask_cuda_scheduler

    out = check_remote_dask_cuda_scheduler(tmp_path, device="cpu")
    assert out["slots"] == ["cpu"] and out["ppo"]["steps"] == 20 and out["grpo"]["steps"] == 10


def test_static_cache_check_runs_on_cpu(tmp_path):
    from rlnb.gpu_check.scale import check_static_cache_decode_cuda

    out = check_static_cache_decode_cuda(tmp_path, device="cpu", hidden=64, layers=2)
    assert out["same_rows"] == "16/16" and out["tokens_per_s_static_bf16"] > 0


def test_lora_bf16_check_runs_on_cpu(tmp_path):
    from rlnb.gpu_check.scale import check_lora_bf16_cuda

    # (no warm start: this CPU's bf16 arithmetic made it most of the test, and the check is of the GRPO steps)
    out = check_lora_bf16_cuda(tmp_path, device="cpu", steps=3, sft_steps=0)
    assert out["steps"] == 3 and out["rollout_model_dtype"] == "bfloat16"
    assert out["actor_state_bytes"] < out["full_float32_state_bytes"] / 5


@pytest.mark.timeout(900)
def test_compiled_update_check_runs_on_cpu(tmp_path):
    """``make gpu-check``'s ``lm_compile_cuda`` on CPU at a small size: both runs train and the update compiles
    (the GPU's speed-up is measured there). One layer, two steps: compiling is most of it (5 minutes of a loaded
    machine with two layers and three)."""
    from rlnb.gpu_check.scale import check_lm_compile_cuda

    out = check_lm_compile_cuda(tmp_path, device="cpu", hidden=64, layers=1, steps=2)
    assert out["compiled"] == "the objective" and out["compile_s"] > 0 and out["speedup"] > 0

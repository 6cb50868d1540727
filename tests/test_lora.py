"""LoRA on the LM actor (``actor.lora.rank``, PEFT): only the adapters train, the reference is the model with them
off, the rollout and exports get the merged weights."""

import math

import pytest
import torch

from rlnb.components.lm import HFRollout, LMActor
from rlnb.config import RecipeError, load_recipe
from rlnb.loop import GRPOLoop
from rlnb.models.lm import build_tiny_lm, load_lm
from tests.test_lm import GRPO_SMALL, _two_rollout_batches


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return str(
        build_tiny_lm(tmp_path_factory.mktemp("lora") / "tiny", hidden_size=32, num_layers=1, num_heads=2)
    )


def test_only_the_adapters_train_and_the_merged_weights_are_base_plus_their_update(tiny_lm):
    actor = LMActor(
        tiny_lm, group_size=4, seed=0, lr=1e-2, actor={"lora": {"rank": 4, "alpha": 8}}, kl_coef=0.1
    )
    base = {k: v.clone() for k, v in load_lm(tiny_lm)[0].state_dict().items()}
    trained = [n for n, p in actor.policy.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)
    actor.set_batch(_two_rollout_batches(tiny_lm))
    metrics = actor.train()
    assert math.isfinite(metrics["loss"])
    # the optimizer holds state for the adapters alone
    assert {id(p) for p in actor.optimizer.state} <= {
        id(p) for p in actor.policy.parameters() if p.requires_grad
    }
    merged = actor.policy_state()
    assert set(merged) == set(base)  # the base model's own names: what an HF rollout loads
    changed = [k for k in base if not torch.equal(merged[k], base[k])]
    assert changed and all(k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj") for k in changed), (
        changed
    )
    frozen = actor.policy.get_base_model().model.embed_tokens.weight
    assert torch.equal(frozen, base["model.embed_tokens.weight"])  # the base weights never change in place
    # the KL reference: the same model with the adapters off, i.e. the base model, not a second copy
    b = actor.batch
    ref = actor._logprobs(actor.ref, b)
    plain = HFRollout(tiny_lm)  # (the untouched base)
    with torch.no_grad():
        logits = plain.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, b["input_ids"][:, 1:, None]).squeeze(2)
    mask = b["response_mask"][:, 1:].bool()
    assert torch.allclose(ref[:, 1:][mask], logp[mask], atol=1e-5)
    assert actor.state_dict()["ref"] == {}  # nothing of its own to checkpoint


@pytest.mark.parametrize("warm_start", ["full", "adapters"])
def test_the_warm_start_fine_tunes_the_whole_base_then_rl_trains_the_adapters_alone(tiny_lm, warm_start):
    """actor.lora.warm_start: ``full`` (the default) trains every base weight in the supervised warm start, as a
    model is fine-tuned before LoRA RL, and freezes it again for RL; ``adapters`` leaves the base as it was."""
    actor = LMActor(tiny_lm, group_size=4, seed=0, lr=1e-2,
                    actor={"lora": {"rank": 4, "alpha": 8, "warm_start": warm_start}})  # fmt: skip
    base = {n: p.detach().clone() for n, p in actor.policy.named_parameters() if ".lora_" not in n}
    losses = actor.sft(["1+1=", "2+2="] * 4, ["2", "4"] * 4, steps=10, batch_size=4, lr=3e-3)
    assert losses[-1] < losses[0]
    after = {n: p.detach().clone() for n, p in actor.policy.named_parameters() if ".lora_" not in n}
    moved = [n for n in base if not torch.equal(base[n], after[n])]
    if warm_start == "full":
        assert "base_model.model.model.embed_tokens.weight" in moved and len(moved) > len(base) // 2, moved
    else:
        assert moved == []
    trained = [n for n, p in actor.policy.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)  # frozen again for RL
    actor.set_batch(_two_rollout_batches(tiny_lm))
    actor.train()
    assert all(torch.equal(p, after[n]) for n, p in actor.policy.named_parameters() if ".lora_" not in n)


def test_with_bf16_compute_a_lora_actor_holds_its_frozen_base_in_bf16_and_trains_float32_adapters(tiny_lm):
    """actor.dtype=bfloat16 with LoRA: the frozen base model is held in bf16 (2 bytes a weight fewer than the
    float32 actor's, exactly), the adapters, their gradients and AdamW state in float32; it trains, the base
    never changes, and the rollout gets the merged weights in bf16."""
    actors = {}
    for dtype in ("float32", "bfloat16"):
        actor = LMActor(
            tiny_lm, group_size=4, seed=0, lr=1e-2, actor={"lora": {"rank": 4, "alpha": 8}}, dtype=dtype
        )
        actor.set_batch(_two_rollout_batches(tiny_lm))
        assert math.isfinite(actor.train()["loss"]), dtype
        actors[dtype] = actor
    half = actors["bfloat16"]
    base = [p for n, p in half.policy.named_parameters() if ".lora_" not in n]
    assert {p.dtype for p in base} == {torch.bfloat16}
    assert {p.dtype for p in half.policy.parameters() if p.requires_grad} == {torch.float32}
    held = {d: a.memory_stats()["memory/actor_state_bytes"] for d, a in actors.items()}
    assert held["float32"] - held["bfloat16"] == 2 * sum(p.numel() for p in base), held
    frozen = half.policy.get_base_model().model.embed_tokens.weight
    assert torch.equal(frozen, load_lm(tiny_lm, dtype="bfloat16")[0].model.embed_tokens.weight)
    merged = half.policy_state()
    assert (
        set(merged) == set(load_lm(tiny_lm)[0].state_dict())
        and merged["lm_head.weight"].dtype == torch.bfloat16
    )


def test_a_checkpointed_lora_actor_counts_what_trains_and_prints_no_library_warnings(tiny_lm):
    """LoRA with gradient checkpointing: ``parameter_counts`` gives the whole model and the adapters alone; neither
    transformers' "use_cache=True is incompatible with gradient checkpointing" (the update asked for a KV cache
    it never used) nor PEFT's FutureWarning over transformers' deprecated ``is_gradient_checkpointing`` shows."""
    import logging
    import warnings

    logging.Logger.warning_once.cache_clear()  # (transformers warns once a process: another test may have)
    said = []
    heard = logging.Handler()
    heard.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("transformers").addHandler(heard)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            actor = LMActor(
                tiny_lm, group_size=4, seed=0, actor={"lora": {"rank": 4}, "gradient_checkpointing": True},
                share_prompt_forward=False,
            )  # fmt: skip
            actor.set_batch(_two_rollout_batches(tiny_lm))
            assert math.isfinite(actor.train()["loss"])
    finally:
        logging.getLogger("transformers").removeHandler(heard)
    shown = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert not shown and not [s for s in said if "gradient checkpointing" in s], (shown, said)
    counts = actor.parameter_counts()
    adapters = sum(p.numel() for n, p in actor.policy.named_parameters() if ".lora_" in n)
    whole = sum(p.numel() for p in load_lm(tiny_lm)[0].parameters())
    assert counts == {"parameters": whole + adapters, "trainable": adapters}, counts


def test_grpo_with_lora_on_a_worker_feeds_the_rollout_merged_weights_and_exports_both(cluster, tmp_path):
    overrides = [
        *GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "actor.lora.rank=8", "actor.lora.alpha=16",
        "actor.lr=1e-2", "actor.sft_lr=1e-2", "runner.steps=3", "data.prompts_per_step=4", "algorithm.group_size=4",
        "rollout.max_new_tokens=3", "cluster.component_placement={'actor,rollout,reward': 0}",
    ]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        records = loop.run(progress=False)
        state = loop.groups["actor"].on(0).policy_state().result()[0]
        loop.sync_weights()
        served = loop.groups["rollout"].on(0).complete(["3+4=", "5+1="]).result()[0]
        exported = loop.export(tmp_path / "merged")
        adapter = loop.groups["actor"].on(0).export_adapter(str(tmp_path / "adapter")).result()[0]
    assert all(math.isfinite(r["train/loss"]) for r in records) and loop.recipe.actor.lora.rank == 8
    mine = HFRollout(str(tmp_path / "model"), max_new_tokens=3)
    mine.load_weights(state, 1)
    assert served == mine.complete(["3+4=", "5+1="])  # the rollout samples from base + adapters
    merged, _ = load_lm(str(exported))
    assert all(torch.equal(merged.state_dict()[k], state[k]) for k in state)
    assert (tmp_path / "adapter" / "adapter_config.json").exists() and adapter


def test_grpo_arith_with_lora_learns_on_two_data_parallel_ranks(cluster, tmp_path):
    """``rlnb run grpo_arith actor.lora.rank=8``, made small: the warm start fine-tunes the whole base on both DDP
    ranks (its gradients averaged by hand: DDP's reducer holds the adapters alone), then RL on the adapters raises
    held-out accuracy by at least 0.10 (seen: 0.33 -> 0.93; with the adapters alone in the warm start 0.10 ->
    0.03, the issue's report), and the two ranks' weights stay equal."""
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "actor.lora.rank=8", "runner.steps=60",
                 "data.eval_size=100", "runner.eval_interval=60"]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        assert loop.groups["actor"].world_size == 2
        loop.run(progress=False)
        evals = [r["eval/accuracy"] for r in loop.history if "eval/accuracy" in r]
        rank0, rank1 = loop.groups["actor"].policy_state().result(60)
    assert evals[-1] >= evals[0] + 0.10, evals
    assert all(torch.equal(w, rank1[name]) for name, w in rank0.items())


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_rollout_apart_gets_the_adapters_alone_once_it_holds_the_base(cluster, tmp_path, staleness):
    """actor.lora.sync=adapters with the rollout on another slot (a channel), synchronous and asynchronous: the
    first sync and the one after the full warm start send merged weights and the base, every later one the
    adapters alone (a small share of the bytes), and the rollout's merged weights are the actor's bit for bit."""
    overrides = [
        *GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "actor.lora.rank=4", "actor.sft_steps=20",
        "runner.steps=4", "data.prompts_per_step=4", "algorithm.group_size=4", "rollout.max_new_tokens=3",
        "cluster.component_placement={'rollout,reward': 0, actor: 1}", f"algorithm.max_staleness={staleness}",
    ]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        assert loop.paths.adapter_sync
        loop.evaluate(
            2
        )  # (its sync comes before the warm start: the rollout holds the base the warm start changes)
        first = loop.groups["actor"].on(0).sync_stats().result()[0]
        assert first["kind"] == "merged" and first["bytes"] > 0, first
        records = loop.run(progress=False)
        loop.sync_weights()
        merged = loop.groups["actor"].on(0).policy_state().result()[0]
        served = loop.groups["rollout"].on(0).complete(["3+4=", "5+1="]).result()[0]
        last = loop.groups["actor"].on(0).sync_stats().result()[0]
    assert last["kind"] == "adapters" and 0 < last["bytes"] < 0.2 * sum(v.nbytes for v in merged.values()), (
        last
    )
    # (the merged syncs came before the steps: the first evaluation's, after the warm start); running ahead, a
    # sync is logged with the step whose rollout phase ran it
    # (the merged one after the warm start in step 1's)
    synced = [r for r in records if "sync/bytes" in r]
    flags = [r["sync/adapters_only"] for r in synced]
    assert (
        flags == [1.0] * 4 if staleness == 0 else (len(flags) >= 2 and flags[1:] == [1.0] * (len(flags) - 1))
    ), records
    assert all(r["sync/bytes"] == last["bytes"] for r in synced if r["sync/adapters_only"]), records
    assert all(r["sync/bytes"] > 10 * last["bytes"] for r in synced if not r["sync/adapters_only"]), records
    mine = HFRollout(str(tmp_path / "model"), max_new_tokens=3)
    mine.load_weights(merged, 1)
    assert served == mine.complete(["3+4=", "5+1="])


def test_lora_misfits_are_refused_naming_the_key(tiny_lm):
    with pytest.raises(RecipeError, match=r"actor.lora.rank: expected an integer in \[0, 65536\]"):
        load_recipe("grpo_arith", ["actor.lora.rank=-1"])
    with pytest.raises(RecipeError, match="actor.lora.warm_start: full fine-tunes the base model's weights, which "
                                          "FSDP2 shards"):  # fmt: skip
        load_recipe("grpo_arith", ["actor.lora.rank=4", "actor.strategy=fsdp2"])
    load_recipe("grpo_arith", ["actor.lora.rank=4", "actor.strategy=fsdp2", "actor.lora.warm_start=adapters"])
    # vLLM's own LoRA takes ranks up to 512; merging into its weights takes any
    with pytest.raises(
        RecipeError, match="actor.lora.rank: vLLM's own LoRA takes adapters of rank 512 at most"
    ):
        load_recipe("grpo_arith", ["rollout.backend=vllm", "actor.lora.rank=1024"])
    load_recipe("grpo_arith", ["rollout.backend=vllm", "actor.lora.rank=1024", "rollout.vllm.lora=merge"])
    with pytest.raises(RecipeError, match="actor.lora.rank: LoRA adapts an LM actor"):
        load_recipe("ppo_cartpole", ["actor.lora.rank=4"])
    with pytest.raises(Exception, match="actor.lora.target_modules: \\['qkv'\\] are not modules"):
        LMActor(tiny_lm, actor={"lora": {"rank": 4, "target_modules": ["qkv"]}})

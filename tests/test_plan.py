"""``rlnb plan`` and ``loop.plan()``: the bytes each slot will hold, from the model's config on the meta device,
against what an actor holds once it trains (the sharded setups on two ranks: tests/test_sharding.py)."""

import json
import math

import pytest
import torch

from rlnb import cli
from rlnb.components.lm import LMActor
from rlnb.config import load_recipe
from rlnb.loop.families.grpo.plan import _saved_bytes, parse_bytes, plan_recipe
from rlnb.models.lm import build_tiny_lm, load_lm
from tests.test_lm import _two_rollout_batches

ONE_SLOT = "cluster.component_placement={'actor,rollout,reward': 0}"


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return str(
        build_tiny_lm(tmp_path_factory.mktemp("plan") / "tiny", hidden_size=32, num_layers=2, num_heads=2)
    )


@pytest.mark.parametrize(
    "overrides",
    [[], ["actor.lora.rank=4"], ["actor.lora.rank=4", "actor.dtype=bfloat16"], ["algorithm.kl_coef=0.1"],
     ["actor.dtype=bfloat16", "algorithm.kl_coef=0.1"], ["algorithm.advantage=token_gae"]],
    ids=["float32", "lora", "lora-bf16", "reference", "reference-bf16", "critic"],
)  # fmt: skip
def test_the_plan_of_an_actor_is_within_15_percent_of_what_it_holds_once_it_trains(tiny_lm, overrides):
    recipe = load_recipe("grpo_arith", [f"actor.model_path={tiny_lm}", ONE_SLOT, *overrides])
    plan = plan_recipe(recipe)
    actor = LMActor(tiny_lm, actor=recipe.actor, group_size=4, seed=0, kl_coef=recipe.algorithm.kl_coef,
                    advantage=recipe.algorithm.advantage)  # fmt: skip
    actor.set_batch(_two_rollout_batches(tiny_lm))
    assert math.isfinite(actor.train()["loss"])
    held = actor.memory_stats()
    assert abs(plan.actor_state_bytes / held["memory/actor_state_bytes"] - 1) < 0.15, (plan, held)
    reference = plan.slots[0].parts["reference"]
    if "memory/ref_bytes" in held:
        assert abs(reference / held["memory/ref_bytes"] - 1) < 0.15, (plan, held)
    else:
        assert reference == 0  # (none, or LoRA's: the model with its adapters off)
    critic = plan.slots[0].parts["critic"]  # PPO's value model: counted beside the policy
    if "memory/critic_bytes" in held:
        assert abs(critic / held["memory/critic_bytes"] - 1) < 0.05, (plan, held)
    else:
        assert critic == 0


def test_the_activations_traced_on_the_meta_device_are_those_a_real_forward_keeps(tiny_lm):
    """The plan's probe runs the model's own forward on fake tensors over the meta device; on real weights and
    inputs the same forward keeps the same bytes for its backward. Checkpointing keeps less; bf16 about half."""
    model, _ = load_lm(tiny_lm)
    seen = {}

    def pack(t):
        base = t._base if t._base is not None else t
        seen[base.data_ptr()] = base.numel() * base.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.log_softmax(
            model(input_ids=torch.ones(8, 24, dtype=torch.long), use_cache=False).logits.float(), -1
        )
    real = sum(seen.values())
    with torch.device("meta"):
        meta = type(model)(model.config)
    assert abs(_saved_bytes(meta, 8, 24) / real - 1) < 0.15, (_saved_bytes(meta, 8, 24), real)
    plain, ckpt, half = (
        plan_recipe(load_recipe("grpo_arith", [f"actor.model_path={tiny_lm}", ONE_SLOT, *o])).slots[0].parts
        for o in ([], ["actor.gradient_checkpointing=true"], ["actor.dtype=bfloat16"])
    )
    assert ckpt["activations"] < 0.8 * plain["activations"]
    assert 0.4 < half["activations"] / plain["activations"] < 0.75


def test_rlnb_plan_prints_each_slot_and_refuses_a_slot_too_small_naming_the_levers_that_fit(tmp_path, capsys):
    """A 100M-parameter model (its config only: nothing is built) on 2 slots of 2 GiB: too big in float32 with
    DDP, the levers that fit named; the table and --json say the same."""
    big = [f"actor.model_path={tmp_path / 'none'}", "actor.tiny_lm.hidden_size=1024",
           "actor.tiny_lm.num_layers=6", "actor.tiny_lm.num_heads=8", "--slot-memory", "2GiB"]  # fmt: skip
    assert cli.main(["plan", "grpo_arith", *big]) == 2
    out, err = capsys.readouterr()
    assert "100,783,104 parameters" in out and "DOES NOT FIT" in out, out
    assert "cluster.component_placement: slot 0" in err and "These would fit: actor.strategy=fsdp2" in err, (
        err
    )
    assert cli.main(["plan", "grpo_arith", *big, "actor.lora.rank=8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and len(plan["slots"]) == 2 and plan["trainable"] < plan["parameters"] / 100
    assert plan["actor_state_bytes"] == sum(plan["slots"][0]["parts"][k] for k in ("weights", "gradients",
                                                                                   "optimizer"))  # fmt: skip
    assert cli.main(["plan", "ppo_cartpole"]) == 2
    assert "family: a plan sizes the grpo family" in capsys.readouterr().err
    assert cli.main(["plan", "grpo_arith", "--slot-memory", "lots"]) == 2
    assert "--slot-memory: expected a size" in capsys.readouterr().err
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("24GiB") == parse_bytes("24G") == 24 * 2**30

"""Every recipe key whose value is a choice (a Literal, a bool, a registry name) runs each documented
choice for one step on an embedded cluster, or is refused before any step with a message naming the key.

A choice key added to the schema without an entry in ``SWEEP`` fails ``test_the_sweep_covers_every_choice_key``.
"""

import dataclasses
import math
import types
import typing

import pytest

from rlnb.algorithms import REWARDS
from rlnb.config import load_recipe
from rlnb.config.schema import Recipe
from rlnb.errors import RlnbError
from rlnb.loop import loop_class

PPO = ("ppo_cartpole", ["env.num_envs=4", "rollout.steps_per_rollout=16", "algorithm.update_epochs=1"])
GRPO = ("grpo_arith", ["actor.sft_steps=5", "data.prompts_per_step=4", "algorithm.group_size=4",
                       "data.eval_size=8", "rollout.max_new_tokens=3", "actor.tiny_lm.hidden_size=32"])  # fmt: skip
SAC = ("sac_pendulum", ["sac.hidden_sizes=[16,16]", "sac.learning_starts=32", "sac.batch_size=32",
                        "rollout.steps_per_rollout=16", "algorithm.max_staleness=0"])  # fmt: skip
COMMON = [
    "runner.tensorboard=false",
    "runner.stop_return=100000",
    "cluster.component_placement={'actor,rollout,env': 0}",
]

# key -> (recipe and its small settings, extra overrides); advantage and policy_loss: every combination
# is covered on workers in tests/test_build.py
SWEEP = {
    "runner.tensorboard": (PPO, []),
    "runner.run_ahead": (PPO, []),  # (what it changes in run() is in tests/test_ppo.py)
    "algorithm.clip_vloss": (PPO, []),
    "algorithm.norm_adv": (PPO, []),
    "algorithm.scale": (GRPO, []),
    "algorithm.kl_estimator": (GRPO, ["algorithm.kl_coef=0.01"]),
    "algorithm.agg": (GRPO, []),
    "algorithm.preset": (GRPO, []),
    "algorithm.mismatch_correction": (GRPO, []),  # (weights, hand-computed: tests/test_algorithms.py)
    "algorithm.mismatch_level": (
        GRPO,
        ["algorithm.mismatch_correction=tis"],
    ),  # (each preset's loss, hand-computed: tests/test_algorithms.py)
    "algorithm.mask_truncated_completions": (GRPO, ["rollout.max_new_tokens=2"]),
    "algorithm.dynamic_sampling": (GRPO, []),
    "actor.model.kind": (PPO, []),
    "actor.model.activation": (PPO, []),
    "actor.model.shared_trunk": (PPO, []),
    "actor.model.vla.build_if_missing": (PPO, []),  # (the VLA on workers: tests/test_vla.py)
    "actor.model.vla.head": (PPO, []),
    "actor.model.vla.critic_detached": (PPO, []),  # (both ways on a VLA: tests/test_vla.py)
    "actor.model.vla.proprio": (PPO, []),  # (both ways on a VLA: tests/test_vla.py)
    "actor.anneal_lr": (PPO, []),
    "actor.compile": (PPO, []),
    "actor.fused_step": (PPO, []),
    "actor.device": (PPO, []),
    "actor.build_if_missing": (GRPO, []),
    "actor.tiny_lm.arch": (GRPO, []),
    "actor.skip_zero_advantage": (GRPO, []),
    "rollout.drop_finished": (GRPO, []),
    "actor.dtype": (GRPO, []),
    "rollout.dtype": (GRPO, []),
    "rollout.static_cache": (GRPO, []),
    "rollout.vllm.dtype": (GRPO, []),
    "rollout.vllm.enforce_eager": (GRPO, []),
    "rollout.vllm.lora": (GRPO, []),
    "actor.strategy": (GRPO, []),  # (one actor rank here: the two-rank runs are tests/test_sharding.py)
    "actor.gradient_checkpointing": (GRPO, []),
    "actor.lora.warm_start": (GRPO, ["actor.lora.rank=4"]),
    "actor.lora.sync": (GRPO, ["actor.lora.rank=4"]),  # (apart, both ways: tests/test_lora.py)
    "actor.offload": (GRPO, ["actor.strategy=fsdp2"]),
    "rollout.backend": (None, []),  # policy -> PPO, hf and vllm -> GRPO
    "family": (None, []),  # ppo and auto -> PPO, grpo -> GRPO, sac -> SAC
    "sac.kernel": (SAC, []),
    "sac.variant": (SAC, []),  # (discrete SAC on CartPole: tests/test_sac_loop.py)
    "buffer.in_checkpoint": (SAC, []),  # (what each leaves in a checkpoint: tests/test_sac_loop.py)
    "rollout.device": (PPO, []),
    "rollout.weight_sync": (PPO, ["cluster.component_placement={'env,rollout': 0, actor: 1}"]),
    "env.vector_mode": (PPO, []),
    "env.normalize_obs": (PPO, []),
    "env.normalize_reward": (PPO, []),
    "reward.name": (GRPO, []),
    "data.task": (GRPO, ["data.path=missing.jsonl"]),
    "data.chat_template": (GRPO, []),
}
COVERED_ELSEWHERE = {
    "algorithm.advantage",
    "algorithm.policy_loss",
    "runner.overwrite",  # tests/test_trust.py (a run directory holding a run)
    "runner.resume_fallback",  # tests/test_isolation.py (an unreadable latest checkpoint)
    "runner.control",  # read by rlnb run: tests/test_hosts.py (network, across hosts), test_operations.py (loopback)
    "cluster.elastic",  # tests/test_elastic.py, test_elastic_lm.py (three slots: a worker killed, closed, added)
}
# the choices refused on this machine (no GPU, no vLLM): each must be refused naming its key before any step;
# every other choice must train a step
REFUSED = {
    ("rollout.backend", "vllm"),  # needs a CUDA GPU on every rollout slot (and the vllm package)
    ("actor.device", "cuda"),
    ("actor.offload", "params"),  # FSDP2's CPU offload of GPU memory: the actor is on CPU here
    ("rollout.device", "cuda"),
    ("reward.name", "code_tests"),  # it reads each record's tests, which arithmetic problems have none of
    ("data.task", "file"),  # data.path=missing.jsonl: refused as missing
    ("data.task", "arithmetic"),  # with data.path set, which it would ignore
    ("actor.model.kind", "cnn"),  # CartPole's observations are vectors, not (C, H, W) images
    ("actor.model.kind", "vla"),  # nor camera images with an instruction
    # a VLA's settings, with the MLP policy: nothing would read them
    ("actor.model.vla.build_if_missing", False),
    ("actor.model.vla.head", "chunk"),
    ("actor.model.vla.critic_detached", True),
    ("actor.model.vla.proprio", "token"),
    ("actor.build_if_missing", False),  # ./model is not there and nothing may build it
    # the vllm engine's settings, with the hf backend: nothing would read them (tests/test_vllm.py runs them)
    *(("rollout.vllm.dtype", d) for d in ("float32", "bfloat16", "float16")),
    ("rollout.vllm.enforce_eager", False),
    ("rollout.vllm.lora", "merge"),
    ("sac.variant", "discrete"),  # Pendulum's actions are a box
}
GRPO_CHOICES = {"hf", "vllm", "grpo"}  # of rollout.backend and family, the choices the GRPO recipe runs


def choice_keys(cls=Recipe, prefix="") -> dict[str, list]:
    """Dotted key -> its documented choices, for every Literal and bool field of the schema, and the
    registry-backed names."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, tp = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(choice_keys(tp, key + "."))
        elif typing.get_origin(tp) is typing.Literal:
            out[key] = list(typing.get_args(tp))
        elif tp is bool:
            out[key] = [True, False]
        elif typing.get_origin(tp) in (typing.Union, types.UnionType):  # e.g. bool | Literal["auto"]
            choices = [c for a in typing.get_args(tp) for c in _choices(a)]
            if choices:
                out[key] = choices
    out.update({"reward.name": REWARDS.names()} if not prefix else {})
    return out


def _choices(tp) -> list:
    if tp is bool:
        return [True, False]
    return list(typing.get_args(tp)) if typing.get_origin(tp) is typing.Literal else []


CASES = [(key, value) for key, values in choice_keys().items() if key in SWEEP for value in values]


def test_the_sweep_covers_every_choice_key():
    keys = set(choice_keys()) | COVERED_ELSEWHERE
    ignored = {"runner.wandb_project"}  # not a choice
    assert keys - ignored - COVERED_ELSEWHERE == set(SWEEP), sorted((keys - COVERED_ELSEWHERE) ^ set(SWEEP))


@pytest.mark.parametrize("key,value", CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_every_choice_steps_or_is_refused_naming_its_key(cluster, tmp_path, monkeypatch, key, value):
    monkeypatch.chdir(tmp_path)  # data.path=missing.jsonl, model directories
    base, extra = SWEEP[key]
    if base is None:
        base = GRPO if value in GRPO_CHOICES else SAC if value == "sac" else PPO
    recipe_name, small = base
    overrides = [*small, *COMMON, *extra, f"{key}={str(value).lower() if isinstance(value, bool) else value}"]
    if recipe_name == "grpo_arith":
        overrides = [o for o in overrides if "component_placement" not in o]
        overrides += ["cluster.component_placement={'actor,rollout,reward': 0}", "actor.model_path=./model"]
    if recipe_name == "sac_pendulum":
        overrides = [o for o in overrides if "component_placement" not in o]
        overrides += ["cluster.component_placement={'actor,rollout,env,buffer': 0}"]
    try:
        recipe = load_recipe(recipe_name, overrides)
        with loop_class(recipe).from_recipe(recipe, cluster=cluster, run_dir=tmp_path / "run") as loop:
            record = loop.step_once()
    except RlnbError as e:  # refused: the message names the key
        assert (key, value) in REFUSED, f"{key}={value} must train a step here, and was refused: {e}"
        assert key in str(e), f"{key}={value} refused without naming the key: {e}"
        return
    assert (key, value) not in REFUSED, f"{key}={value} must be refused on this machine, and trained"
    loss = record.get("train/q_loss" if recipe.family == "sac" else "train/loss")
    assert loss is not None and math.isfinite(loss), (key, value, record)

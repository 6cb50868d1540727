"""Vision-language-action policies: a tiny PaliGemma built and loaded as a released VLA is, its two action heads,
and PPO training it on workers from camera images and an instruction."""

import json
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

import rlnb.envs.pixel  # noqa: F401  (registers rlnb/PixelReach-v0)
from rlnb.envs.obs import PackedBox, PackObservation
from rlnb.errors import ConfigError
from rlnb.loop import Loop
from rlnb.models.policies import check_policy
from rlnb.models.vla import (
    VLA_FILE,
    ActionBins,
    VLAPolicy,
    build_tiny_vla,
    check_vla,
    load_vla,
    preprocess_images,
    vla_spec,
)
from tests.conftest import assert_resume_is_exact

RLNB = [sys.executable, "-m", "rlnb.cli"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny VLA for PixelReach's 20 px camera: a patch of 4 px is one cell of its grid."""
    return str(build_tiny_vla(tmp_path_factory.mktemp("vla") / "tiny", image_size=20, patch_size=4))


@pytest.fixture(scope="module")
def env():
    return PackObservation(gym.make("rlnb/PixelReach-v0"))


def observations(env, n=6):
    return torch.as_tensor(np.stack([env.reset(seed=i)[0] for i in range(n)]))


def test_a_tiny_vla_is_a_real_vlm_saved_with_its_processor_and_loads_through_the_auto_classes(tiny):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(tiny)
    processor = AutoProcessor.from_pretrained(tiny)
    assert type(model).__name__ == "PaliGemmaForConditionalGeneration"
    assert type(processor).__name__ == "PaliGemmaProcessor"
    assert json.loads(Path(tiny, VLA_FILE).read_text())["action_bins"] == 256
    spec = vla_spec(model.config, processor)
    assert spec.image_seq_length == 25 and spec.image_size == (20, 20) and len(spec.action_token_ids) == 256
    tok = processor.tokenizer
    assert tok.convert_ids_to_tokens(spec.action_token_ids[7]) == "<act7>"
    # the processor's own prompt for an image: the same image tokens the policy writes
    inputs = processor(text="pick", images=np.zeros((20, 20, 3), np.uint8), return_tensors="pt")
    assert (inputs["input_ids"] == spec.image_token_id).sum() == 25


def test_images_are_preprocessed_in_torch_as_the_processor_does(tiny):
    _, processor = load_vla(tiny, weights=False)
    spec = vla_spec(load_vla(tiny, weights=False)[0], processor)
    rng = np.random.default_rng(0)
    same = rng.integers(
        0, 256, (2, 20, 20, 3), dtype=np.uint8
    )  # the processor's size: rescaled and normalised
    want = processor.image_processor(list(same), return_tensors="pt")["pixel_values"]
    got = preprocess_images(torch.as_tensor(same)[:, None], spec)
    assert got.shape == (2, 3, 20, 20) and torch.allclose(got, want, atol=1e-5)
    smooth = np.kron(rng.integers(0, 256, (1, 10, 10, 3)), np.ones((1, 4, 4, 1))).astype(np.uint8)  # 40 px
    want = processor.image_processor(list(smooth), return_tensors="pt")["pixel_values"]
    got = preprocess_images(torch.as_tensor(smooth)[:, None], spec)
    # resized from 40 to 20 px: PIL's and torch's antialiased bilinear filters differ by rounding only
    assert got.shape == want.shape and (got - want).abs().mean() < 0.02


def test_the_token_heads_log_prob_is_the_sum_over_the_actions_tokens(tiny, env):
    """A Box action of 4 dimensions is 4 tokens decoded in turn (with the KV cache); forward scores them
    teacher-forced in one pass and gets the same log-probability, the sum of each token's log-softmax over the
    bins."""
    box = gym.spaces.Box(-1, 1, (4,), np.float32)
    policy = VLAPolicy(env.observation_space, box, tiny)
    check_policy(policy, env.observation_space, box, "rollout", "vla")
    obs = observations(env)
    with torch.no_grad():
        actions, logprob, value = policy.act(obs, torch.Generator().manual_seed(0))
        again, entropy, value2 = policy(obs, actions)
    assert (
        actions.shape == (6, 4)
        and torch.allclose(logprob, again, atol=1e-5)
        and torch.allclose(value, value2)
    )
    assert ((actions >= -1) & (actions <= 1)).all() and (entropy > 0).all()
    # by hand: the prompt and the action's tokens, each token's log-softmax over the 256 bin tokens
    bins = policy.bins.to_bins(actions)
    ids, _, pixels, _ = policy._inputs(obs)
    full = torch.cat([ids, policy.action_ids[bins]], 1)
    with torch.no_grad():
        logits = policy.vla(
            input_ids=full,
            attention_mask=torch.ones_like(full),
            pixel_values=pixels,
            token_type_ids=(torch.arange(full.shape[1]) >= ids.shape[1]).long().expand_as(full),
        ).logits
    per_token = [
        torch.log_softmax(logits[:, ids.shape[1] - 1 + d, policy.action_ids], -1).gather(
            1, bins[:, d : d + 1]
        )[:, 0]
        for d in range(4)
    ]
    assert torch.allclose(sum(per_token), logprob, atol=1e-4)
    # a bin's centre maps back to its bin: actions taken are actions scored
    assert torch.equal(policy.bins.to_bins(policy.bins.to_actions(bins)), bins)
    greedy, _, _ = policy.act(obs, deterministic=True)
    assert torch.equal(greedy, policy.act(obs, deterministic=True)[0])


def test_a_checkpoint_laid_out_as_a_released_openvla_scores_its_vocabularys_last_tokens_as_actions(
    tmp_path, env
):
    """OpenVLA names no action tokens: its config's ``n_action_bins`` says the vocabulary's last 256 tokens are the
    bins. A checkpoint laid out so (no ``<act0>``..., no rlnb file beside it) loads through the same path, its
    action ids are those last tokens, and a Box action is scored over them as the named tokens are."""
    path = build_tiny_vla(tmp_path / "openvla", image_size=20, patch_size=4, action_tokens="last")
    assert not (path / VLA_FILE).exists()
    config, processor = load_vla(path, weights=False)
    assert config.n_action_bins == 256 and "<act0>" not in processor.tokenizer.get_vocab()
    spec = vla_spec(config, processor)
    size = config.get_text_config().vocab_size
    assert spec.action_token_ids == tuple(range(size - 256, size))
    box = gym.spaces.Box(-1, 1, (2,), np.float32)
    policy = VLAPolicy(env.observation_space, box, str(path))
    obs = observations(env)
    with torch.no_grad():
        actions, logprob, _ = policy.act(obs, torch.Generator().manual_seed(0))
        again, entropy, _ = policy(obs, actions)
    assert actions.shape == (6, 2) and torch.allclose(logprob, again, atol=1e-5) and (entropy > 0).all()
    assert policy.action_ids.tolist() == list(spec.action_token_ids)


def test_the_proprio_token_is_read_by_the_decoder_and_scored_as_it_is_decoded(tiny, env):
    """``proprio="token"`` (OpenVLA-OFT's proprio projector): the state, projected, is one input embedding at the
    prompt's end; the action decoded with the KV cache and scored teacher-forced get the same log-probability, the
    state changes the action tokens' distribution through the decoder (there is no linear logits' term), and the
    loss's gradient reaches the projector and the decoder's layers. Another value is refused naming the key."""
    box = gym.spaces.Box(-1, 1, (4,), np.float32)
    policy = VLAPolicy(env.observation_space, box, tiny, proprio="token")
    assert policy.state_logits is None and policy.proprio_proj is not None
    assert policy.config["proprio"] == "token"
    obs = observations(env)
    with torch.no_grad():
        actions, logprob, value = policy.act(obs, torch.Generator().manual_seed(0))
        again, _, value2 = policy(obs, actions)
    assert torch.allclose(logprob, again, atol=1e-5) and torch.allclose(value, value2, atol=1e-5)
    # the same images and instruction with another state: another distribution over the action's tokens
    other = obs.clone()
    state = policy.layout.unpack(other)[policy.layout.vectors[0].key]  # (a view into the rows)
    state.copy_(1.0 - state)
    with torch.no_grad():
        assert not torch.allclose(policy(other, actions)[0], logprob, atol=1e-4)
    lp, _, _ = policy(obs, actions)
    lp.mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.proprio_proj.parameters())
    layer = policy.vla.model.language_model.layers[0].self_attn.q_proj.weight
    assert layer.grad is not None and layer.grad.abs().sum() > 0
    with pytest.raises(
        ConfigError, match=r"actor.model.vla.proprio: expected one of logits, token, got 'mlp'"
    ):
        VLAPolicy(env.observation_space, box, tiny, proprio="mlp")


@pytest.mark.parametrize("detached", [False, True])
def test_a_detached_critic_trains_its_head_alone_and_never_moves_the_vla(tiny, env, detached):
    """``actor.model.vla.critic_detached``: the value's gradient reaches the value head and stops at the VLA's
    hidden state; shared (the default), it reaches the VLA's layers too."""
    policy = VLAPolicy(env.observation_space, env.action_space, tiny, critic_detached=detached)
    _, _, value = policy(observations(env, 2), torch.zeros(2, dtype=torch.long))
    value.sum().backward()
    reached = [
        n
        for n, p in policy.named_parameters()
        if n.startswith("vla.") and p.grad is not None and p.grad.any()
    ]
    assert all(p.grad is not None and p.grad.any() for p in policy.value_head.parameters())
    assert (not reached) == detached, reached[:3]


def test_a_discrete_action_is_one_token_and_the_chunk_head_a_gaussian_over_k_actions(tiny, env):
    policy = VLAPolicy(env.observation_space, env.action_space, tiny)
    assert policy.bins.discrete and policy.bins.dims == 1 and len(policy.action_ids) == 4
    obs = observations(env)
    with torch.no_grad():
        actions, logprob, _ = policy.act(obs)
        assert actions.shape == (6,) and actions.dtype == torch.long
        assert torch.allclose(policy(obs, actions)[0], logprob, atol=1e-5)
    chunk = gym.spaces.Box(-1, 1, (3, 4), np.float32)  # K = 3 future actions of 4 dimensions
    policy = VLAPolicy(env.observation_space, chunk, tiny, head="chunk")
    check_policy(policy, env.observation_space, chunk, "rollout", "vla")
    with torch.no_grad():
        actions, logprob, _ = policy.act(obs)
        mean = policy.act(obs, deterministic=True)[0]
        assert actions.shape == (6, 3, 4) and torch.allclose(policy(obs, actions)[0], logprob, atol=1e-5)
    # the Gaussian's log-density, by hand
    std = policy.log_std.exp()
    by_hand = (
        -((actions - mean).reshape(6, -1) ** 2) / (2 * std**2) - std.log() - 0.5 * np.log(2 * np.pi)
    ).sum(-1)
    assert torch.allclose(by_hand, logprob, atol=1e-4)
    # gradients reach the VLA's own weights through the head and the value
    lp, _, value = policy(obs, actions)
    (lp.mean() + value.mean()).backward()
    assert policy.vla.get_input_embeddings().weight.grad.abs().sum() > 0


def test_what_a_vla_cannot_take_is_refused_naming_the_key(tiny, env, tmp_path):
    config, processor = load_vla(tiny, weights=False)
    spec = vla_spec(config, processor)
    obs, act = env.observation_space, env.action_space
    flat = gym.spaces.Box(-1, 1, (4,), np.float32)
    cases = [
        (lambda: check_vla(flat, act, spec), "actor.model.kind: vla reads camera images"),
        (
            lambda: check_vla(obs, act, spec, cameras=["wrist"]),
            r"actor.model.vla.cameras: .*\(rgb\), got \['wrist'\]",
        ),
        (
            lambda: check_vla(obs, gym.spaces.MultiDiscrete([2, 3]), spec),
            "env.id: a VLA's action tokens take",
        ),
        (lambda: check_vla(obs, gym.spaces.Discrete(300), spec), "env.id: the VLA has 256 action tokens"),
        (lambda: check_vla(obs, act, spec, head="chunk"), "actor.model.vla.head: the chunk head takes a Box"),
        (
            lambda: check_vla(obs, act, spec, instruction="goal"),
            "actor.model.vla.instruction: expected a text part",
        ),
    ]
    no_text = PackedBox(gym.spaces.Dict({"rgb": gym.spaces.Box(0, 255, (20, 20, 3), np.uint8)}))
    cases.append(
        (lambda: check_vla(no_text, act, spec), "actor.model.vla.instruction: the observations have no text")
    )
    for call, message in cases:
        with pytest.raises(ConfigError, match=message):
            call()
    check_vla(no_text, act, spec, default_instruction="reach the red square")  # (a fixed instruction instead)
    from rlnb.models.lm import build_tiny_lm

    lm = build_tiny_lm(tmp_path / "lm", hidden_size=32, num_layers=1, num_heads=2)
    with pytest.raises(ConfigError, match="actor.model.vla.path: expected a vision-language model"):
        load_vla(lm, weights=False)
    with pytest.raises(ConfigError, match=r"patch_size: expected a divisor of image_size, got 7") as e:
        build_tiny_vla(tmp_path / "odd", image_size=20, patch_size=7)
    assert e.value.key == "actor.model.vla.tiny.patch_size"
    assert ActionBins(flat, 8).to_bins(torch.tensor([[-1.0, -0.74, 0.99, 1.0]])).tolist() == [[0, 1, 7, 7]]


def test_rlnb_run_refuses_a_camera_the_env_has_not_before_anything_starts(tiny):
    r = subprocess.run(
        [*RLNB, "run", "ppo_pixelreach", "actor.model.kind=vla", f"actor.model.vla.path={tiny}",
         "actor.model.vla.cameras=[wrist]", "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert (
        r.returncode == 2
        and "actor.model.vla.cameras: expected image parts of the observations (rgb)" in r.stderr
    )
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


def vla_overrides(tiny, *more):
    """``ppo_pixelreach`` with the tiny VLA, small enough for a test's few steps."""
    return ["actor.model.kind=vla", f"actor.model.vla.path={tiny}", "runner.eval_interval=0",
            "runner.tensorboard=false", "env.num_envs=4", "rollout.steps_per_rollout=8", "algorithm.update_epochs=1",
            "algorithm.num_minibatches=2", *more]  # fmt: skip


def test_ppo_trains_the_vla_on_workers_and_a_cut_run_resumes_exactly(cluster, tmp_path, tiny):
    """The VLA as the rollout's and the actor's policy on workers (collocated): a step samples action tokens,
    scores them on the actor, updates; weights reach the rollout; a run cut after its checkpoint and resumed
    logs what the uncut one did. (With the proprio token: the export carries its projector.)"""
    overrides = vla_overrides(
        tiny, "runner.steps=3", "runner.save_interval=1", "actor.model.vla.proprio=token"
    )
    with Loop.from_recipe("ppo_pixelreach", overrides, cluster=cluster, run_dir=tmp_path / "one") as loop:
        loop.run(2, progress=False)
        row = loop.history[-1]
        actor = loop.groups["actor"].on(0).policy_state().result()[0]
        exported = loop.export(tmp_path / "export" / "policy.pt")
    # the export: the VLA in save_pretrained's layout beside the policy file (the heads), reloaded both ways
    from transformers import AutoModelForImageTextToText

    from rlnb.export import load_policy

    vla = AutoModelForImageTextToText.from_pretrained(exported.with_name("policy.vla"))
    assert torch.equal(vla.state_dict()["lm_head.weight"], actor["vla.lm_head.weight"])
    policy = load_policy(exported)
    obs, _ = gym.make("rlnb/PixelReach-v0").reset(seed=0)
    assert type(policy.module).__name__ == "VLAPolicy" and policy.predict(obs) in range(4)
    assert torch.equal(policy.module.state_dict()["value_head.0.weight"], actor["value_head.0.weight"])
    assert torch.equal(policy.module.state_dict()["proprio_proj.0.weight"], actor["proprio_proj.0.weight"])
    assert row["global_step"] == 64 and np.isfinite(row["train/policy_loss"]) and row["train/approx_kl"] > 0
    assert any(k.startswith("vla.model.vision_tower.") for k in actor) and "value_head.0.weight" in actor
    assert_resume_is_exact("ppo_pixelreach", overrides, cluster, tmp_path / "resume", cut_at=1)


def test_the_env_apart_from_the_vla_steps_in_pipeline_stages(cluster, tmp_path, tiny):
    """Disaggregated (env on one slot, the VLA's rollout and actor on the other) with the env's batch in two
    stages: one stage's envs step while the VLA infers the other's actions (RLinf's pipelining), the env's and
    the inference's seconds logged and the share of one hidden behind the other."""
    overrides = vla_overrides(tiny, "runner.steps=2", "env.pipeline_stages=2",
                              "cluster.component_placement={env: 0, 'actor,rollout': 1}")  # fmt: skip
    with Loop.from_recipe("ppo_pixelreach", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        loop.run(progress=False)
        row = loop.history[-1]
    assert row["global_step"] == 64 and np.isfinite(row["train/loss"]) and row["time/rollout_s"] > 0
    # each side's own work, timed where it runs, and how much of the shorter the other hid
    assert (
        0 < row["time/env_s"] < row["time/rollout_s"] and 0 < row["time/inference_s"] < row["time/rollout_s"]
    )
    assert 0 <= row["rollout/pipeline_overlap_frac"] <= 1


def test_lora_on_the_vla_trains_its_adapters_and_the_heads_and_the_rollout_gets_the_merged_weights(
    cluster, tmp_path, tiny
):
    """``actor.lora.rank`` with ``actor.model.kind=vla``: PEFT's adapters on the VLA's projections and the heads
    train, the VLA's base weights stay; the rollout samples with the merged weights (``W + B A * alpha / r``); the
    export is a plain VLA (merged) that from_pretrained reads; ``rlnb eval`` reads the run's checkpoint."""
    from transformers import AutoModelForImageTextToText

    overrides = vla_overrides(tiny, "runner.steps=2", "runner.save_interval=2", "actor.lr=0.01", "actor.lora.rank=4",
                              "actor.gradient_checkpointing=true")  # fmt: skip
    with Loop.from_recipe("ppo_pixelreach", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        actor = loop.groups["actor"].on(0).policy_state().result()[0]  # (what the rollout gets: merged)
        exported = loop.export(tmp_path / "export" / "policy.pt")
    base = AutoModelForImageTextToText.from_pretrained(tiny).state_dict()
    q = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not any("lora_" in k for k in actor) and not torch.equal(
        actor[f"vla.{q}"], base[q]
    )  # merged, moved
    emb = "model.language_model.embed_tokens.weight"
    assert torch.equal(actor[f"vla.{emb}"], base[emb])  # (not a target: frozen)
    merged = AutoModelForImageTextToText.from_pretrained(exported.with_name("policy.vla")).state_dict()
    assert torch.allclose(merged[q], actor[f"vla.{q}"])
    r = subprocess.run([*RLNB, "eval", str(tmp_path / "run"), "--episodes", "2"], capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0 and "at step 2: eval/return_mean=" in r.stdout, r.stderr[-2000:]


def test_bf16_compute_on_the_vla_actor_autocasts_its_forwards_and_keeps_float32_weights(tiny, env):
    """``actor.dtype=bfloat16`` with ``actor.model.kind=vla`` (refused for the built-in policies): the warm start's
    and PPO's forwards run the VLA's matmuls in bf16, the loss and the master weights stay float32."""
    from rlnb.components.actor import PPOActor
    from rlnb.config.loader import load_recipe

    model = {"kind": "vla", "vla": {"path": tiny}}
    actor = PPOActor({"model": model, "dtype": "bfloat16"}, {"update_epochs": 1}, env.observation_space,
                     env.action_space)  # fmt: skip
    seen = []
    q = actor.policy.vla.model.language_model.layers[0].self_attn.q_proj
    q.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    obs = observations(env, 8)
    result = actor.behaviour_clone(obs, torch.arange(8) % 4, epochs=1, minibatch_size=8)
    assert seen[0] == torch.bfloat16 and np.isfinite(
        result["nll"]
    )  # (its training forward; then a greedy check)
    with torch.no_grad():
        actions, logprobs, values = actor.policy.act(obs)
    mb = {"obs": obs, "actions": actions, "logprobs": logprobs, "values": values,
          "advantages": torch.randn(8), "returns": torch.randn(8)}  # fmt: skip
    seen.clear()
    loss, _ = actor._objective(mb)
    assert set(seen) == {torch.bfloat16} and loss.dtype == torch.float32 and torch.isfinite(loss)
    assert q.weight.dtype == torch.float32
    with pytest.raises(Exception, match="actor.dtype"):  # the built-in policies train in float32
        load_recipe("ppo_pixelreach", ["actor.dtype=bfloat16"])


@pytest.mark.timeout(
    900
)  # (ManiSkill's subprocesses importing it and starting renderers on a loaded machine)
@pytest.mark.parametrize(
    "recipe, model, small",
    [
        ("vla_maniskill", "tiny-vla-maniskill", ["rollout.steps_per_rollout=10"]),
        # embodied GRPO: one group of both envs, a rollout of one whole 25-step episode each
        ("vla_maniskill_grpo", "tiny-vla-maniskill-16", ["algorithm.group_size=2"]),
    ],
    ids=["ppo", "grpo"],
)
def test_rlnb_run_vla_maniskill_warm_starts_on_the_scripted_expert_and_trains_from_the_command_line(
    tmp_path, recipe, model, small
):
    """The recipes as shipped, made small: ManiSkill's PushCube on its CPU simulation (two envs, each in a
    subprocess, rendering its 32 px camera), a tiny VLA built where the recipe says, behaviour cloning on rlnb's
    scripted expert for PushCube (which succeeds), two PPO (or embodied GRPO) steps, the final evaluation, all from
    ``rlnb run``."""
    from rlnb.envs.gym_envs import maniskill_problem

    reason = maniskill_problem("PushCube-v1")
    if reason is not None:
        pytest.skip(reason)
    overrides = ["env.num_envs=2", "runner.steps=2", "runner.eval_episodes=1", "runner.tensorboard=false",
                 "actor.warm_start.episodes=3", "actor.warm_start.epochs=2", "algorithm.num_minibatches=2",
                 *small]  # fmt: skip
    done = subprocess.run([*RLNB, "run", recipe, *overrides, "--no-progress", "--run-dir", "run"],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / f"runs/models/{model}/config.json").exists()  # built where the recipe says
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    warm = rows[0]
    assert warm["warm_start/expert_success_rate"] == 1.0 and warm["warm_start/samples"] >= 3 * 5
    # (actions in [-1, 1]: a difference of 2 at most; 2 epochs on 3 episodes leave it about 1.3)
    assert (
        warm["warm_start/nll"] < warm["warm_start/nll_first"]
        and 0 < warm["warm_start/expert_action_error"] < 2
    )
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2] and all(np.isfinite(r["train/loss"]) for r in trained)
    assert "eval/success_rate" in rows[-1], rows[-1]


@pytest.mark.parametrize("lora", [[], ["actor.lora.rank=4", "actor.lr=0.01"]], ids=["whole", "lora"])
def test_fsdp2_shards_the_vla_over_two_actor_ranks_and_the_rollout_and_the_export_get_it_whole(
    cluster, tmp_path, tiny, lora
):
    """``actor.strategy=fsdp2`` with ``actor.model.kind=vla``: each actor rank holds a shard of the VLA's layers
    (FSDP2 over gloo here), trains its rollout ranks' batches, and the rollout samples with the whole weights
    gathered bucket by bucket; a checkpoint goes through DCP and resumes; the export is the whole VLA. With LoRA
    the adapters are sharded with their layers, and the rollout and the export get them merged."""
    from transformers import AutoModelForImageTextToText

    overrides = vla_overrides(tiny, "runner.steps=2", "runner.save_interval=1", "actor.strategy=fsdp2",
                              "cluster.component_placement={'actor,rollout,env': 0-1}", *lora)  # fmt: skip
    with Loop.from_recipe("ppo_pixelreach", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        row = loop.history[-1]
        actor = loop.groups["actor"]
        held = actor.held_bytes().result()
        params = actor.parameter_counts().result()[0]["parameters"]
        whole = actor.policy_state().result()[0]  # (every rank gathers together)
        loop.sync_weights()  # (the run's last sync was before its last update)
        rollout = loop.groups["rollout"].on(0).state_dict().result()[0]["policy"]
        exported = loop.export(tmp_path / "export" / "policy.pt")
    assert row["global_step"] == 128 and np.isfinite(row["train/loss"]) and row["train/approx_kl"] > 0
    # parameters, gradients and Adam's two moments: 16 bytes a parameter whole, about half of them a rank
    assert len(held) == 2 and all(b < 0.6 * 16 * params for b in held), (held, params)
    q = "vla.model.language_model.layers.0.self_attn.q_proj.weight"
    base = AutoModelForImageTextToText.from_pretrained(tiny).state_dict()
    assert torch.equal(rollout[q], whole[q]) and not torch.equal(
        whole[q], base[q[4:]]
    )  # trained, and sampled with
    vla = AutoModelForImageTextToText.from_pretrained(exported.with_name("policy.vla"))
    assert torch.equal(vla.state_dict()[q[4:]], whole[q])
    with Loop.resume(
        tmp_path / "run", cluster=cluster, overrides=["runner.steps=3"]
    ) as loop:  # (through DCP)
        assert [r["step"] for r in loop.run(progress=False)] == [3]


def test_embodied_grpo_trains_the_vla_on_workers_with_group_relative_advantages(cluster, tmp_path, tiny):
    """``algorithm.advantage=episode_grpo`` with the VLA: 8 envs in groups of 4 starting each episode alike, a
    20-step episode per env a step; each step's advantages are centred within their groups (mean 0), the value
    head idle (``vf_coef=0``), every episode the time limit long."""
    overrides = vla_overrides(tiny, "env.num_envs=8", "rollout.steps_per_rollout=20", "runner.steps=2",
                              "algorithm.advantage=episode_grpo", "algorithm.group_size=4", "algorithm.vf_coef=0",
                              "algorithm.norm_adv=false")  # fmt: skip
    with Loop.from_recipe("ppo_pixelreach", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        records = loop.run(progress=False)
        batch = loop.groups["actor"].on(0).sample(20).result()[0]
    assert len(records) == 2 and all(np.isfinite(r["train/loss"]) for r in records), records
    assert all(abs(r["advantages/advantage_mean"]) < 1e-5 for r in records), records
    assert all(r["env/episode_len_mean"] == 20 for r in records), records
    adv, done = batch["advantages"], batch["dones"]  # [20, 8]
    assert done[-1].all() and not done[:-1].any()  # one whole episode an env, ended together
    assert torch.allclose(adv.view(20, 2, 4).sum(-1), torch.zeros(20, 2), atol=1e-5)  # centred in each group
    assert (adv == adv[:1]).all()  # an episode's advantage at each of its steps

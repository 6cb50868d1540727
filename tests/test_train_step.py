"""The PPO actor's train step: clipping and the Adam update called straight (``ClipAndStep``), bit for bit
what torch's own functions give, on the worker too; and the MLPs' ``Tanh``, equal to ``torch.tanh``."""

import copy

import pytest
import torch
from torch import nn

import rlnb
from rlnb.components.env import Env
from rlnb.components.optim import ClipAndStep
from rlnb.loop import Loop
from rlnb.models.policies import Tanh
from tests.conftest import collocated_loop


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _train(model, optimizer, step, scales, max_grad_norm=0.5):
    """A few steps on fixed data whose gradients are scaled by ``scales`` (some clipped, some not), with
    ``step`` doing clip-and-update (``None``: torch's clip_grad_norm_ and optimizer.step())."""
    g = torch.Generator().manual_seed(1)
    norms = []
    for scale in scales:
        x, y = torch.randn(32, 4, generator=g), torch.randn(32, 3, generator=g)
        loss = scale * ((model(x) - y) ** 2).mean()
        if step is None:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
            optimizer.step()
        else:
            step.zero_grad()
            loss.backward()
            norms.append(step(max_grad_norm))
    return norms


OPTIMIZERS = {
    "adam fused": lambda p: torch.optim.Adam(p, lr=1e-2, eps=1e-5, fused=True),
    "adamw fused, weight decay": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adam fused, decoupled decay": lambda p: torch.optim.Adam(
        p, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, fused=True
    ),
    "adam fused, l2 decay": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, fused=True),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_direct_step_is_bit_for_bit_torchs_clip_and_step(name):
    make = OPTIMIZERS[name]
    scales = [0.01, 5.0, 1.0, 50.0, 0.1, 3.0]  # norms below and above max_grad_norm
    reference = _model()
    ref_opt = make(reference.parameters())
    ref_norms = _train(reference, ref_opt, None, scales)
    model = _model()
    optimizer = make(model.parameters())
    step = ClipAndStep(optimizer)
    norms = _train(model, optimizer, step, scales)
    # every step is direct, the first too: it creates the optimizer's state as torch's first step() would
    assert step.direct_steps == len(scales)
    assert [float(n) for n in norms] == [float(n) for n in ref_norms]
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    state = optimizer.state_dict()["state"]  # the optimizer's steps and moments too
    for k, s in ref_opt.state_dict()["state"].items():
        for key, value in s.items():
            assert torch.equal(state[k][key], value), (k, key)


@pytest.mark.parametrize(
    "make, hook",
    [
        (lambda p: torch.optim.Adam(p, lr=1e-2), False),  # foreach, not fused
        (lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9), False),
        (lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, fused=True), False),
        (lambda p: torch.optim.Adam(p, lr=1e-2, fused=True), True),  # a step hook must run
    ],
    ids=["adam foreach", "sgd", "amsgrad", "hooked"],
)
def test_anything_else_takes_torchs_own_step_with_the_same_result(make, hook):
    scales = [0.01, 5.0, 50.0]
    reference = _model()
    _train(reference, make(reference.parameters()), None, scales)
    model = _model()
    optimizer = make(model.parameters())
    calls = []
    if hook:
        optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(1))
    step = ClipAndStep(optimizer)
    _train(model, optimizer, step, scales)
    assert step.direct_steps == 0
    assert len(calls) == (len(scales) if hook else 0)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_a_resumed_optimizer_state_is_read_afresh():
    """``load_state_dict`` replaces the optimizer's state tensors: the direct step must use the new ones."""
    scales = [1.0, 5.0, 0.5, 2.0]
    reference = _model()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, fused=True)
    _train(reference, ref_opt, None, scales)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    step = ClipAndStep(optimizer)
    _train(model, optimizer, step, scales[:2])
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    _train(model, optimizer, step, [100.0, 100.0])  # moves away from the saved state
    model.load_state_dict(saved_model)
    optimizer.load_state_dict(saved_opt)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # the data _train saw in its first two steps, then the last two
        torch.randn(32, 4, generator=g), torch.randn(32, 3, generator=g)
    for scale in scales[2:]:
        x, y = torch.randn(32, 4, generator=g), torch.randn(32, 3, generator=g)
        step.zero_grad()
        (scale * ((model(x) - y) ** 2).mean()).backward()
        step(0.5)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


class StepCountingActor(rlnb.PPOActor):
    """The built-in actor, saying how many of its steps took the direct path."""

    def direct_steps(self) -> int:
        return self.clip_and_step.direct_steps


def test_the_ppo_actor_takes_the_direct_step_on_its_worker(cluster, tmp_path):
    env = Env.launch(cluster, "0", make_env="CartPole-v1", num_envs=4)
    rollout = rlnb.PolicyRollout.launch(cluster, "0")
    actor = rlnb.launch(StepCountingActor, cluster, "0", name="actor", update_epochs=3, num_minibatches=2)
    runner = {"tensorboard": False, "steps": 2}
    with Loop(
        env=env, rollout=rollout, actor=actor, steps_per_rollout=16, runner=runner, run_dir=tmp_path
    ) as loop:
        records = loop.run(progress=False)
        direct = loop.groups["actor"].direct_steps().result()[0]
    assert len(records) == 2 and all(r["train/loss"] == r["train/loss"] for r in records)
    assert direct == 2 * 3 * 2  # every minibatch step, the first too (it creates Adam's state as torch would)


class DynamoWatchingActor(StepCountingActor):
    def dynamo_imported(self) -> bool:
        import sys

        return "torch._dynamo" in sys.modules


def test_a_worker_trains_and_checkpoints_without_importing_dynamo(tmp_path):
    """``torch._dynamo`` (~1 s to import here) is not on an embodied run's path: the workers' fork server does
    not preload it, and building Adam, its first step, and a checkpoint saved and loaded do not import it."""
    with (
        rlnb.Cluster(slots=1, gpus=False) as cluster,  # fresh workers
        collocated_loop(
            cluster, tmp_path, actor_cls=DynamoWatchingActor, update_epochs=2, num_minibatches=2
        ) as loop,
    ):
        loop.run(progress=False)  # saves a checkpoint at the end
        loop.load_checkpoint()
        loop.run(1, progress=False)
        assert loop.groups["actor"].dynamo_imported().result() == [False]
        assert loop.groups["actor"].direct_steps().result() == [3 * 2 * 2]  # every one of them


class WeightShowingRollout(rlnb.PolicyRollout):
    def weights(self) -> dict:
        return {k: v.clone() for k, v in self.policy.state_dict().items()}


class CopyingActor(rlnb.PPOActor):
    """The built-in actor, saying whether it copied its weights straight into a collocated rollout's."""

    def copied(self) -> bool:
        return getattr(self, "_copy_pairs", (None,))[0] is not None


class HalvingActor(CopyingActor):
    """Hands the rollout half its weights, through its own ``policy_state``."""

    def policy_state(self) -> dict:
        return {k: v / 2 for k, v in super().policy_state().items()}


@pytest.mark.parametrize("actor_cls", [CopyingActor, HalvingActor])
def test_a_collocated_sync_copies_what_the_actors_policy_state_gives(cluster, tmp_path, actor_cls):
    """The built-in pair copies tensor for tensor (one ``_foreach_copy_``); an actor with its own
    ``policy_state`` goes through it."""
    env = Env.launch(cluster, "0", make_env="CartPole-v1", num_envs=4)
    rollout = rlnb.launch(WeightShowingRollout, cluster, "0", name="showing")
    actor = rlnb.launch(actor_cls, cluster, "0", name="actor", update_epochs=2)
    runner = {"tensorboard": False, "steps": 2}
    with Loop(
        env=env, rollout=rollout, actor=actor, steps_per_rollout=16, runner=runner, run_dir=tmp_path
    ) as loop:
        loop.step_once()
        loop.sync_weights()
        given = loop.groups["actor"].policy_state().result()[0]
        held = loop.groups["rollout"].weights().result()[0]
        copied = loop.groups["actor"].copied().result()[0]
    assert given.keys() == held.keys() and all(torch.equal(given[k], held[k]) for k in given)
    assert copied == (actor_cls is CopyingActor)


@pytest.mark.parametrize("shape", [(256, 64), (2048, 64), (7, 3000)])
def test_tanh_matches_torch_tanh_in_value_and_gradient(shape):
    x = torch.randn(*shape, dtype=torch.float32) * 4
    x.requires_grad_(True)
    y = Tanh()(x)
    ref = torch.tanh(x.detach())
    assert (y.detach() - ref).abs().max() <= 2.5e-7
    with torch.no_grad():
        assert torch.equal(Tanh()(x), y.detach())  # the same values with and without autograd
    grad = torch.randn(*shape)
    y.backward(grad)
    x_ref = x.detach().clone().requires_grad_(True)
    torch.tanh(x_ref).backward(grad)
    # tanh's own backward from the output: off by 2 * y * (its 2e-7) * grad at most
    assert (x.grad - x_ref.grad).abs().max() <= 1e-6 * grad.abs().max()


def test_tanh_of_few_elements_or_not_on_the_cpu_is_torch_tanh():
    small = torch.randn(8, 64)  # a rollout's few envs
    assert torch.equal(Tanh()(small), torch.tanh(small))
    assert torch.equal(Tanh()(small.double()), torch.tanh(small.double()))
    mid = torch.randn(128, 64, requires_grad=True)  # under autograd the identity pays from 16384 elements
    assert torch.equal(Tanh()(mid), torch.tanh(mid))
    if torch.cuda.is_available():
        big = torch.randn(256, 64, device="cuda")
        assert torch.equal(Tanh()(big), torch.tanh(big))


def test_the_batch_statistics_read_in_one_go_are_those_of_the_batch_trained_on():
    """compute_advantages() reads the advantages' mean and std, the returns' mean and the explained variance's
    two variances in one reduction; train() reports the explained variance of the batch it trains on, also when
    it computes the advantages itself or a new batch came since."""
    from rlnb.components.actor import PPOActor

    env = Env(make_env="CartPole-v1", num_envs=4)
    torch.manual_seed(0)
    actor = PPOActor(None, {"update_epochs": 1}, env.observation_space, env.action_space)
    g = torch.Generator().manual_seed(2)

    def batch(scale: float) -> dict:
        return {
            "obs": torch.randn(8, 4, 4, generator=g), "actions": torch.randint(0, 2, (8, 4), generator=g),
            "logprobs": torch.full((8, 4), -0.69), "values": scale * torch.randn(8, 4, generator=g),
            "rewards": torch.rand(8, 4, generator=g), "dones": (torch.rand(8, 4, generator=g) < 0.2).float(),
            "last_values": torch.randn(4, generator=g), "version": 0,
        }  # fmt: skip

    def explained(b: dict) -> float:
        return float(1 - (b["returns"] - b["values"]).var() / b["returns"].var())

    for scale, compute_first in ((1.0, True), (5.0, False), (0.1, True)):
        actor.set_batch([batch(scale)])
        if compute_first:
            stats = actor.compute_advantages()
            b = actor.batch
            assert stats["advantage_mean"] == pytest.approx(float(b["advantages"].mean()), abs=1e-6)
            assert stats["advantage_std"] == pytest.approx(float(b["advantages"].std()), rel=1e-5)
            assert stats["return_mean"] == pytest.approx(float(b["returns"].mean()), abs=1e-6)
        out = actor.train()
        assert out["explained_variance"] == pytest.approx(explained(actor.batch), rel=1e-5, abs=1e-6)
    # a batch put in place by hand, its advantages computed already: its own explained variance
    actor.compute_advantages()
    other = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in actor.batch.items()}
    other["values"] = other["returns"] + 0.5 * torch.randn(8, 4, generator=g)
    actor.batch = other
    assert actor.train()["explained_variance"] == pytest.approx(explained(other), rel=1e-5, abs=1e-6)


def _cartpole_batch() -> dict:
    """A rollout batch of CartPole's shapes, 8 steps of 4 envs, random but seeded (random old values too)."""
    g = torch.Generator().manual_seed(3)
    return {
        "obs": torch.randn(8, 4, 4, generator=g), "actions": torch.randint(0, 2, (8, 4), generator=g),
        "logprobs": torch.full((8, 4), -0.69), "values": torch.randn(8, 4, generator=g),
        "rewards": torch.rand(8, 4, generator=g), "dones": (torch.rand(8, 4, generator=g) < 0.2).float(),
        "last_values": torch.randn(4, generator=g), "version": 0,
    }  # fmt: skip


def test_a_critic_warm_up_fits_the_value_function_alone_for_its_steps_then_the_policy_trains():
    """algorithm.critic_warmup_steps=2: the first two updates leave the policy exactly as it was (no advantage, no
    surrogate: its trunk gets no gradient) while the value function moves; the third trains both."""
    from rlnb.components.actor import PPOActor

    env = Env(make_env="CartPole-v1", num_envs=4)
    torch.manual_seed(0)
    settings = {"update_epochs": 2, "critic_warmup_steps": 2, "clip_vloss": False}  # (random old values)
    actor = PPOActor({"anneal_lr": False}, settings, env.observation_space, env.action_space)
    batch = _cartpole_batch()

    def parts() -> tuple[dict, dict]:
        named = {k: v.detach().clone() for k, v in actor.policy.named_parameters()}
        return ({k: v for k, v in named.items() if k.startswith("actor")},
                {k: v for k, v in named.items() if k.startswith("critic")})  # fmt: skip

    for step, warming in ((1, True), (2, True), (3, False)):
        policy, value = parts()
        actor.set_batch([dict(batch)])  # (a batch's dict is the actor's once set)
        out = actor.train()
        now_policy, now_value = parts()
        assert out["critic_warmup"] == float(warming)
        assert any(not torch.equal(v, now_value[k]) for k, v in value.items()), step
        assert all(torch.equal(v, now_policy[k]) for k, v in policy.items()) == warming, step


def test_the_value_function_trains_at_its_own_learning_rate_annealed_with_the_policys():
    """actor.critic_lr: Adam's first step moves each weight by about its group's learning rate, so the critic's
    weights move ~100x farther than the policy's at critic_lr=1e-2, lr=1e-4; both rates anneal together, and a
    policy of the user's own (no known value weights) is refused naming the key."""
    from rlnb.components.actor import PPOActor
    from rlnb.config.loader import load_recipe
    from rlnb.errors import ConfigError

    env = Env(make_env="CartPole-v1", num_envs=4)
    settings = {"update_epochs": 1, "num_minibatches": 1, "clip_vloss": False}
    actor = PPOActor({"lr": 1e-4, "critic_lr": 1e-2, "anneal_lr": True}, settings,
                     env.observation_space, env.action_space)  # fmt: skip
    actor.total_steps = 4
    batch = _cartpole_batch()
    before = {k: v.detach().clone() for k, v in actor.policy.named_parameters()}
    actor.set_batch([batch])
    actor.train()
    moved = {k: float((v.detach() - before[k]).abs().max()) for k, v in actor.policy.named_parameters()}
    critic = max(v for k, v in moved.items() if k.startswith("critic"))
    policy = max(v for k, v in moved.items() if k.startswith("actor"))
    assert 5e-3 < critic < 2e-2 and 5e-5 < policy < 2e-4, (critic, policy)
    actor.step = 2  # half way: each group at half its own rate
    actor.set_batch([batch])
    actor.train()
    assert sorted(group["lr"] for group in actor.optimizer.param_groups) == pytest.approx([5e-5, 5e-3])
    assert actor.set_hyperparameters(lr=2e-4)["lr"] == pytest.approx(
        2e-4
    )  # (the critic's rate stays its own)
    assert sorted(group["lr"] for group in actor.optimizer.param_groups) == pytest.approx([2e-4, 1e-2])

    own = nn.Sequential(nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="actor.critic_lr") as err:
        from rlnb.models.policies import critic_parameters

        critic_parameters(own, "actor.critic_lr")
    assert err.value.key == "actor.critic_lr"
    with pytest.raises(
        ConfigError, match="actor.critic_lr: 0.001 is a value model's learning rate; algorithm.adv"
    ):
        load_recipe("grpo_arith", ["actor.critic_lr=0.001"])
    load_recipe("grpo_arith", ["actor.critic_lr=0.001", "algorithm.advantage=token_gae"])  # (an LM's critic)
    load_recipe("grpo_arith", ["algorithm.advantage=token_gae", "actor.strategy=fsdp2"])  # (sharded alike)

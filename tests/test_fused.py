"""The hand-derived PPO step (``rlnb.components.fused``): autograd's loss, metrics and gradients, for both
action kinds, both value losses and both activations; used where it fits, on the worker too, and nowhere else."""

import gymnasium as gym
import pytest
import torch
from torch import nn

import rlnb
from rlnb.algorithms.losses import ppo, ppo_clip_value_entropy
from rlnb.components import fused as fused_module
from rlnb.components.fused import FusedAct, FusedPPOStep, fused_act, fused_ppo_step, unfit, walk
from rlnb.loop import Loop
from rlnb.models.policies import ActorCritic
from tests.conftest import collocated_loop

DISCRETE = gym.spaces.Discrete(3)
CONTINUOUS = gym.spaces.Box(-1.0, 1.0, (2,))
OBS = gym.spaces.Box(-1.0, 1.0, (5,))


def _policy(act_space, hidden=(64, 64), activation="tanh"):
    torch.manual_seed(0)
    policy = ActorCritic(OBS, act_space, hidden_sizes=hidden, activation=activation)
    if not policy.discrete:
        with torch.no_grad():
            policy.log_std.copy_(torch.tensor([-0.3, 0.2]))
    return policy


def _minibatch(policy, m: int, shift: float, seed: int = 1) -> dict:
    """``m`` samples whose old log-probs are the policy's own moved by up to ``shift`` (ratios away from 1, so
    some clip), and old values near the current ones (some value errors clip too)."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(m, 5, generator=g)
    with torch.no_grad():
        if policy.discrete:
            actions = torch.randint(0, 3, (m,), generator=g).float()
        else:
            actions = torch.randn(m, 2, generator=g)
        logprobs, _, values = policy(obs, actions)
    return {
        "obs": obs,
        "actions": actions,
        "logprobs": logprobs + shift * (2 * torch.rand(m, generator=g) - 1),
        "values": values + 0.3 * torch.randn(m, generator=g),
        "advantages": torch.randn(m, generator=g),
        "returns": values + torch.randn(m, generator=g),
    }


def _autograd(policy, mb, **coefs):
    logprob, entropy, value = policy(mb["obs"], mb["actions"])
    loss, metrics = ppo_clip_value_entropy(
        logprob, mb["logprobs"], mb["advantages"], value, mb["values"], mb["returns"], entropy, **coefs
    )
    for p in policy.parameters():
        p.grad = None
    loss.backward()
    return loss.detach(), metrics, [p.grad.clone() for p in policy.parameters()]


@pytest.mark.parametrize("act_space", [DISCRETE, CONTINUOUS], ids=["discrete", "continuous"])
@pytest.mark.parametrize("clip_vloss", [False, True])
@pytest.mark.parametrize(
    "hidden,activation,m", [((64, 64), "tanh", 256), ((32,), "relu", 8), ((16, 24, 8), "tanh", 33)]
)
def test_loss_metrics_and_gradients_are_autograds(act_space, clip_vloss, hidden, activation, m):
    policy = _policy(act_space, hidden, activation)
    for shift, ent_coef, norm_adv in ((0.0, 0.0, True), (0.6, 0.01, True), (0.6, 0.05, False)):
        mb = _minibatch(policy, m, shift)
        coefs = dict(clip_coef=0.2, vf_coef=0.5, ent_coef=ent_coef, clip_vloss=clip_vloss, norm_adv=norm_adv)
        loss, metrics, grads = _autograd(policy, mb, **coefs)
        if shift:  # the clipped branches are exercised
            assert 0 < metrics["clip_frac"] < 1
        fused_loss, fused_metrics = FusedPPOStep(policy)(mb, **coefs)
        torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-7)
        assert fused_metrics.keys() == metrics.keys()
        for key, value in metrics.items():
            torch.testing.assert_close(fused_metrics[key], value, rtol=1e-5, atol=1e-7, msg=key)
        for (name, p), expected in zip(policy.named_parameters(), grads):
            torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-7, msg=name)


class MyActorCritic(ActorCritic):
    """A subclass: its forward may differ from the built-in's."""


@pytest.mark.parametrize(
    "change,reason",
    [
        (lambda p: {"compiled": True}, "actor.compile is on"),
        (
            lambda p: {"model": nn.Sequential(p)},
            "calls Sequential, not the policy or DistributedDataParallel",
        ),
        (lambda p: {"loss_fn": ppo}, "the policy loss is 'ppo'"),
        (lambda p: {"policy": ActorCritic(OBS, DISCRETE, shared_trunk=True)}, "shared or convolutional"),
        (lambda p: {"policy": MyActorCritic(OBS, DISCRETE)}, "the policy is MyActorCritic"),
        (lambda p: {"policy": ActorCritic(OBS, DISCRETE, activation="relu").requires_grad_(False)}, "frozen"),
        (lambda p: p.actor_head.register_forward_hook(lambda *a: None) and {}, "hooks"),
        (lambda p: p.critic_trunk[0].weight.register_hook(lambda g: g) and {}, "hooks"),
    ],
)
def test_anything_it_does_not_compute_as_autograd_would_is_left_to_autograd(change, reason):
    policy = _policy(DISCRETE)
    assert unfit(policy, policy, ppo_clip_value_entropy, False) is None
    args = {"policy": policy, "model": policy, "loss_fn": ppo_clip_value_entropy, "compiled": False}
    args.update(change(policy))
    if args["model"] is policy:
        args["model"] = args["policy"]
    assert reason in unfit(**args)


def test_a_step_made_for_the_same_modules_is_used_again_until_anything_it_assumed_changes(monkeypatch):
    """The actor keeps its fused step from one update to the next; a swapped module, a new parameter, a hook or
    a frozen parameter since is seen at the next update, as a fresh check would see it."""
    policy = _policy(DISCRETE)
    modules, params, buffers = walk(policy)
    assert modules == list(policy.modules()) and params == list(policy.parameters())
    assert buffers == list(policy.buffers())
    shared = torch.nn.Linear(
        2, 2
    )  # a module met twice and a tied parameter: listed once, where torch lists them
    tied = torch.nn.Sequential(shared, torch.nn.Sequential(torch.nn.Tanh(), shared), torch.nn.Linear(2, 2))
    tied[2].weight = shared.weight
    assert walk(tied) == (list(tied.modules()), list(tied.parameters()), [])
    check = {"model": policy, "loss_fn": ppo_clip_value_entropy, "compiled": False}
    step, why = fused_ppo_step(policy, **check)
    assert why is None and fused_ppo_step(policy, **check, previous=step) == (step, None)
    scans = []
    monkeypatch.setattr(fused_module, "_hooked", lambda *a: scans.append(a) or False)
    fused_ppo_step(policy, **check, previous=step)
    assert scans == []  # no hook registered anywhere since: the policy's modules are not scanned again
    torch.nn.Linear(1, 1).register_forward_hook(lambda *a: None)  # (a hook anywhere: scanned again)
    fused_ppo_step(policy, **check, previous=step)
    assert len(scans) == 1
    monkeypatch.undo()
    assert fused_ppo_step(policy, **{**check, "compiled": True}, previous=step) == (
        None,
        "actor.compile is on",
    )
    handle = policy.critic_head.register_forward_pre_hook(lambda *a: None)
    assert fused_ppo_step(policy, **check, previous=step) == (None, "hooks are registered on the policy")
    handle.remove()
    policy.actor_head.bias.requires_grad_(False)
    assert fused_ppo_step(policy, **check, previous=step) == (None, "some parameters are frozen")
    policy.actor_head.bias.requires_grad_(True)
    policy.actor_trunk[1] = torch.nn.ReLU()  # one trunk with two kinds of activation
    assert "the trunks are not" in fused_ppo_step(policy, **check, previous=step)[1]
    policy.actor_trunk[3] = torch.nn.ReLU()  # a relu trunk: a new step, computing with relu
    relu_step, why = fused_ppo_step(policy, **check, previous=step)
    assert why is None and relu_step is not step and relu_step.actor_act[0] is torch.relu_
    policy.critic_head.weight = torch.nn.Parameter(policy.critic_head.weight.detach().clone())
    fresh, _ = fused_ppo_step(policy, **check, previous=relu_step)
    assert fresh is not relu_step and any(p is policy.critic_head.weight for p in fresh.params)


def test_the_actor_trains_through_it_on_its_worker_as_it_would_through_autograd(cluster, tmp_path):
    """The recipe's actor takes every minibatch through the fused step on its worker; with
    ``actor.fused_step=false`` none, and the two runs' losses agree."""
    base = ["runner.tensorboard=false", "runner.steps=3", "runner.eval_interval=0", "env.num_envs=4"]
    runs = {}
    for fused in (True, False):
        with Loop.from_recipe(
            "ppo_cartpole", [*base, f"actor.fused_step={str(fused).lower()}"], cluster=cluster,
            run_dir=tmp_path / str(fused),
        ) as loop:  # fmt: skip
            records = loop.run(progress=False)
            stats = loop.groups["actor"].fused_stats().result()[0]
        runs[fused] = ([r["train/loss"] for r in records], [r["train/approx_kl"] for r in records], stats)
    assert runs[True][2] == {"fused_steps": 3 * 20, "unfit": None}
    assert runs[False][2] == {"fused_steps": 0, "unfit": "actor.fused_step is off"}
    for a, b in zip(runs[True][0] + runs[True][1], runs[False][0] + runs[False][1]):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-6)


def test_data_parallel_ranks_train_through_it_as_ddp_would(cluster, tmp_path):
    """Two DDP ranks: the fused step averages the gradients in one all-reduce itself; the ranks stay identical
    and the losses are those of autograd through DDP."""
    base = [
        "runner.tensorboard=false", "runner.steps=2", "runner.eval_interval=0", "env.num_envs=4",
        "algorithm.update_epochs=4", "cluster.component_placement={'actor,rollout,env': 0-1}",
    ]  # fmt: skip
    runs = {}
    for fused in (True, False):
        overrides = [*base, f"actor.fused_step={str(fused).lower()}"]
        with Loop.from_recipe(
            "ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path / str(fused)
        ) as loop:
            records = loop.run(progress=False)
            stats = loop.groups["actor"].fused_stats().result()
            weights = loop.groups["actor"].policy_state().result()
        for name in weights[0]:
            assert torch.equal(weights[0][name], weights[1][name]), name
        runs[fused] = ([r["train/loss"] for r in records], stats)
    assert runs[True][1] == [{"fused_steps": 2 * 4, "unfit": None}] * 2
    assert runs[False][1] == [{"fused_steps": 0, "unfit": "actor.fused_step is off"}] * 2
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-3, abs=1e-6)


def test_a_subclass_with_its_own_objective_trains_through_autograd(cluster, tmp_path):
    class HalfLoss(rlnb.PPOActor):
        def _objective(self, mb):
            loss, metrics = super()._objective(mb)
            return 0.5 * loss, metrics

    with collocated_loop(cluster, tmp_path, actor_cls=HalfLoss, steps=1, update_epochs=2) as loop:
        loop.run(progress=False)
        stats = loop.groups["actor"].fused_stats().result()[0]
    assert stats == {"fused_steps": 0, "unfit": "a subclass replaced the objective"}


@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize("batch", [8, 256])  # 256 x 64: the tanh computed through sigmoid
def test_fused_act_is_the_policys_act_bit_for_bit(activation, batch):
    policy = _policy(DISCRETE, activation=activation).requires_grad_(False)
    act = fused_act(policy)
    assert isinstance(act, FusedAct)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    obs = torch.randn(5, batch, 5, generator=torch.Generator().manual_seed(4))
    for deterministic in (False, True, False):
        for o in obs:
            for a, b in zip(policy.act(o, g1, deterministic), act(o, g2, deterministic)):
                assert torch.equal(a, b)
    assert torch.equal(g1.get_state(), g2.get_state())  # the same draws
    for o in obs:  # bootstrap and last values: the critic's kernels alone, the values act gives
        value = policy.value(o)
        assert torch.equal(value, act.value(o)) and torch.equal(value, policy.act(o, g1)[2])


class ScaledFeatures(ActorCritic):
    """A subclass with features of its own: observations scaled before both trunks."""

    def _features(self, obs):
        return super()._features(obs * 3.0)


def test_a_subclass_with_its_own_features_gets_values_from_them():
    policy = ScaledFeatures(OBS, DISCRETE).requires_grad_(False)
    obs = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(policy.value(obs), policy.act(obs)[2])  # (the built-in's critic path skipped them)


def test_fused_act_is_used_only_where_it_computes_what_act_would():
    for policy in (
        _policy(CONTINUOUS).requires_grad_(False),
        MyActorCritic(OBS, DISCRETE).requires_grad_(False),
        ActorCritic(OBS, DISCRETE, shared_trunk=True).requires_grad_(False),
        _policy(DISCRETE),  # not frozen: its act records for autograd
    ):
        assert fused_act(policy) == policy.act
    hooked = _policy(DISCRETE).requires_grad_(False)
    hooked.critic_head.register_forward_hook(lambda *a: None)
    assert fused_act(hooked) == hooked.act


class ActWatchingRollout(rlnb.PolicyRollout):
    """Says which function its collection called the policy through."""

    def act(self, obs, deterministic: bool = False):
        self.through = type(self._policy_act).__name__
        return super().act(obs, deterministic)

    def _values(self, obs):
        self.valued_through = type(getattr(self._policy_value, "__self__", None)).__name__
        return super()._values(obs)

    def acted_through(self) -> tuple[str, str]:
        return self.through, self.valued_through


def test_the_checks_register_nothing_with_torch_and_see_a_parameter_replaced_behind_its_back():
    """The fused act's and step's checks walk the policy at each call and compare by identity: nothing is
    registered with torch process-wide (its global registration hooks stay as they were), and a parameter
    swapped through a module's private dict, which no registration hook sees, is seen all the same."""
    from torch.nn.modules import module as module_globals

    registries = ("_global_module_registration_hooks", "_global_parameter_registration_hooks",
                  "_global_buffer_registration_hooks")  # fmt: skip
    before = [dict(getattr(module_globals, name)) for name in registries]
    policy = _policy(DISCRETE)
    check = {"model": policy, "loss_fn": ppo_clip_value_entropy, "compiled": False}
    step, _ = fused_ppo_step(policy, **check)
    frozen = _policy(DISCRETE).requires_grad_(False)
    act = fused_act(frozen)
    assert fused_ppo_step(policy, **check, previous=step) == (step, None) and fused_act(frozen, act) is act
    assert [dict(getattr(module_globals, name)) for name in registries] == before
    policy.actor_head._parameters["bias"] = torch.nn.Parameter(policy.actor_head.bias.detach().clone())
    frozen.critic_head._parameters["bias"] = torch.nn.Parameter(
        frozen.critic_head.bias.detach().clone(), False
    )
    again, why = fused_ppo_step(policy, **check, previous=step)
    assert why is None and again is not step and any(p is policy.actor_head.bias for p in again.params)
    assert fused_act(frozen, act) is not act


def test_the_next_collection_uses_the_same_fused_act_while_the_policy_still_fits_it(monkeypatch):
    policy = _policy(DISCRETE).requires_grad_(False)
    act = fused_act(policy)
    assert isinstance(act, FusedAct) and fused_act(policy, act) is act
    scans = []
    monkeypatch.setattr(fused_module, "_hooked", lambda *a: scans.append(a) or False)
    assert fused_act(policy, act) is act and scans == []
    monkeypatch.undo()
    handle = policy.actor_head.register_forward_hook(lambda *a: None)
    assert fused_act(policy, act) == policy.act
    handle.remove()
    policy.critic_head.bias.requires_grad_(True)
    assert fused_act(policy, act) == policy.act
    policy.critic_head.bias.requires_grad_(False)
    policy.actor_trunk[1] = torch.nn.ReLU()  # a trunk with two kinds of activation
    assert fused_act(policy, act) == policy.act
    policy.actor_trunk[3] = torch.nn.ReLU()
    relu = fused_act(policy, act)
    assert isinstance(relu, FusedAct) and relu is not act and relu.actor_act[0] is torch.relu_


def test_a_collection_on_a_worker_calls_the_policy_through_fused_act(cluster, tmp_path):
    with collocated_loop(
        cluster, tmp_path, ActWatchingRollout, steps=1, steps_per_rollout=8, update_epochs=1
    ) as loop:
        loop.run(progress=False)
        assert loop.groups["rollout"].acted_through().result() == [("FusedAct", "FusedAct")]

"""A family is the unit of extension (issue 51): REINFORCE without a critic, defined the way a notebook cell would
define it (a policy, an actor, a family, nothing of ``rlnb/loop`` touched), trains CartPole on workers with the
synchronous schedule and with whole batches ahead; and the loop's composition holds its promises."""

import math

import pytest
import torch

import rlnb
from rlnb.loop import Loop
from rlnb.loop.families.ppo import PPO
from rlnb.loop.phase import mean_dicts


# ---------------------------------------------------------------------------- the cell: REINFORCE, 80 lines
class ReinforcePolicy(torch.nn.Module):
    """Logits of a small MLP; no critic (its value is zero)."""

    def __init__(self, obs_space, act_space):
        super().__init__()
        n_obs, n_act = obs_space.shape[0], act_space.n
        self.net = torch.nn.Sequential(
            torch.nn.Linear(n_obs, 64), torch.nn.Tanh(), torch.nn.Linear(64, n_act)
        )

    def forward(self, obs):
        return torch.distributions.Categorical(logits=self.net(obs.float())), torch.zeros(len(obs))


class ReinforceActor(rlnb.PPOActor):
    """REINFORCE's update: returns to go (no baseline but their mean), the log-likelihood ratio's gradient."""

    def returns_to_go(self) -> dict:
        b, gamma = self.batch, self.algo.gamma
        returns, running = torch.zeros_like(b["rewards"]), torch.zeros(b["rewards"].shape[1])
        for t in reversed(range(len(returns))):  # [T, N]: an episode's end cuts the sum
            running = b["rewards"][t] + gamma * running * (1.0 - b["dones"][t])
            returns[t] = running
        b["returns"] = returns
        return {"return_mean": float(returns.mean())}

    def train(self) -> dict:
        b = self.batch
        logprob, entropy, _ = self.policy(b["obs"].flatten(0, 1), b["actions"].flatten(0, 1))
        returns = b["returns"].flatten()
        loss = -(logprob * (returns - returns.mean()) / (returns.std() + 1e-8)).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.step += 1
        return {"loss": float(loss), "entropy": float(entropy.mean())}


class Reinforce(PPO):
    """PPO's collection and evaluation, REINFORCE's advantages and update."""

    name = "reinforce"

    def advantages(self, phase):
        phase.metrics.update(mean_dicts(self.session.groups["actor"].returns_to_go().result()))


# ---------------------------------------------------------------------------- it trains, both schedules
@pytest.mark.parametrize("schedule", ["sync", "ahead"])
def test_a_family_defined_in_a_cell_trains_on_workers_with_either_schedule(cluster, tmp_path, schedule):
    ahead = schedule == "ahead"
    env = rlnb.Env.launch(cluster, "0", make_env="CartPole-v1", num_envs=8)
    rollout = rlnb.PolicyRollout.launch(cluster, "0", policy=ReinforcePolicy, seed=3)
    actor = ReinforceActor.launch(cluster, "1" if ahead else "0", policy=ReinforcePolicy, lr=1e-2, seed=3,
                                  max_staleness=1 if ahead else 0, gamma=0.99)  # fmt: skip
    runner = {"steps": 40, "tensorboard": False}
    with Loop(env=env, rollout=rollout, actor=actor, family=Reinforce, steps_per_rollout=64, runner=runner,
              run_dir=tmp_path) as loop:  # fmt: skip
        assert type(loop.schedule).__name__ == ("Ahead" if ahead else "Sync")
        first = loop.evaluate(8)["eval/return_mean"]
        records = loop.run(progress=False)
        last = loop.evaluate(8)["eval/return_mean"]
    assert all(math.isfinite(r["train/loss"]) for r in records)
    if ahead:  # the next batch was collected while the actor trained, one version behind at most
        assert {r["rollout/staleness_max"] for r in records[1:]} <= {0, 1} and loop.rollout_status()[
            "max_staleness"
        ] == 1
    assert last >= first + 100 and last >= 150, (
        first,
        last,
    )  # REINFORCE learns CartPole (here: 29 -> 370, 500)


# ---------------------------------------------------------------------------- the composition's promises
def test_the_loop_is_a_thin_facade_over_four_objects():
    """Loop's MRO is at most three classes: no stack of mixins sharing one self."""
    from rlnb.loop import GRPOLoop, LoopBase

    assert len(Loop.__mro__) <= 3 and len(GRPOLoop.__mro__) <= 3 and LoopBase in Loop.__mro__


def test_a_component_lacking_a_role_method_is_refused_naming_it(cluster):
    from rlnb.errors import ComponentError

    class NoCollect:  # a rollout class with nothing of PolicyRollout's
        def __init__(self, rank_info=None):
            pass

    env = rlnb.Env.launch(cluster, "0", make_env="CartPole-v1", num_envs=2)
    rollout = rlnb.launch(NoCollect, cluster, "0", name="odd")
    actor = rlnb.PPOActor.launch(cluster, "0")
    with pytest.raises(
        ComponentError, match=r"odd: NoCollect.bind_spaces: lacks method\(s\) bind_spaces, collect"
    ):
        Loop(env=env, rollout=rollout, actor=actor)
    for g in (env, rollout, actor):
        g.shutdown()

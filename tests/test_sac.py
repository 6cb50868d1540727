"""SAC's parts (issue 56): the losses against hand-computed values, the replay buffer (ring, n-step sums, exact
resume, its bound in bytes), and the learner learning Pendulum in one process."""

import copy
import math

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlnb.algorithms import sac
from rlnb.components.replay import ReplayBuffer, transition_bytes
from rlnb.components.sac import SACLearner
from rlnb.errors import ConfigError

BOX1 = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)


def test_the_soft_targets_and_losses_are_the_papers_by_hand():
    r, term, disc = torch.tensor([1.0, 2.0]), torch.tensor([False, True]), torch.tensor([0.9, 0.9])
    nq1, nq2, nlogp = torch.tensor([3.0, 5.0]), torch.tensor([4.0, 1.0]), torch.tensor([-1.0, 2.0])
    y = sac.soft_target(r, term, disc, nq1, nq2, nlogp, alpha=0.5)
    # row 0: 1 + 0.9 (min(3, 4) - 0.5 (-1)) = 1 + 0.9 * 3.5; row 1 terminated: its reward alone
    assert torch.allclose(y, torch.tensor([1 + 0.9 * 3.5, 2.0]))
    probs = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    logp = probs.log()
    q1, q2 = torch.tensor([[1.0, 2.0], [0.0, 4.0]]), torch.tensor([[2.0, 1.0], [1.0, 3.0]])
    y = sac.discrete_soft_target(r, torch.tensor([False, False]), disc, q1, q2, probs, logp, alpha=0.1)
    v0 = 0.25 * (1.0 - 0.1 * math.log(0.25)) + 0.75 * (1.0 - 0.1 * math.log(0.75))
    v1 = 0.5 * (0.0 - 0.1 * math.log(0.5)) + 0.5 * (3.0 - 0.1 * math.log(0.5))
    assert torch.allclose(y, torch.tensor([1 + 0.9 * v0, 2 + 0.9 * v1]))
    loss, m = sac.q_loss(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 2.0]), torch.tensor([1.0, 1.0]))
    assert float(loss) == pytest.approx((0 + 1) / 2 + (1 + 1) / 2) and float(m["q1_mean"]) == 1.5
    loss, m = sac.actor_loss(
        torch.tensor([-1.0, 0.5]), torch.tensor([2.0, 1.0]), torch.tensor([1.0, 3.0]), 0.2
    )
    assert float(loss) == pytest.approx(((-0.2 - 1.0) + (0.1 - 1.0)) / 2) and float(m["entropy"]) == 0.25
    loss, _ = sac.discrete_actor_loss(probs, logp, q1, q2, alpha=0.1)
    by_hand = [sum(p * (0.1 * math.log(p) - q) for p, q in zip(ps, qs))
               for ps, qs in (([0.25, 0.75], [1.0, 1.0]), ([0.5, 0.5], [0.0, 3.0]))]  # fmt: skip
    assert float(loss) == pytest.approx(sum(by_hand) / 2)
    log_alpha = torch.tensor(0.3, requires_grad=True)
    loss, m = sac.alpha_loss(log_alpha, torch.tensor([-1.0, 0.0]), target_entropy=-1.0)
    assert float(loss.detach()) == pytest.approx(-0.3 * ((-2.0) + (-1.0)) / 2)
    loss.backward()  # entropy (0.5) above the target (-1): alpha is lowered (a positive gradient on log alpha)
    assert float(log_alpha.grad) == pytest.approx(1.5) and float(m["alpha"]) == pytest.approx(math.exp(0.3))
    assert sac.target_entropy(gym.spaces.Box(-1, 1, (3,))) == -3.0
    assert sac.target_entropy(gym.spaces.Discrete(4)) == pytest.approx(0.89 * math.log(4))
    with pytest.raises(ConfigError, match=r"next_q2: has shape \(3,\), expected \(2,\)"):
        sac.soft_target(r, term, disc, nq1, torch.zeros(3), nlogp, 0.5)


def test_a_collectors_action_is_the_sampled_one_without_its_log_probability():
    from rlnb.models.sac import make_policy

    space = gym.spaces.Box(-2.0, 2.0, (2,), np.float32)
    policy = make_policy(gym.spaces.Box(-1.0, 1.0, (3,), np.float32), space, (16, 16))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    obs = torch.randn(5, 3)
    with torch.no_grad():
        sampled, _ = policy.sample(obs, g1)
        acted = policy.act(obs, g2)
    assert torch.equal(sampled, acted)  # the same noise, the same action: a run's trajectories are unchanged
    assert torch.equal(g1.get_state(), g2.get_state())
    assert (acted.abs() <= 2.0).all() and not torch.equal(acted, policy.deterministic(obs))


def test_polyak_moves_the_targets_a_tau_of_the_way():
    src, tgt = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    before = tgt.weight.detach().clone()
    sac.polyak_(tgt, src, 0.25)
    assert torch.allclose(tgt.weight, 0.75 * before + 0.25 * src.weight)


def _fill(buf: ReplayBuffer, steps: list[tuple[float, bool, bool]]):
    """One env: observation t is [t], the action t too; ``steps``: (reward, terminated, truncated)."""
    for t, (r, term, trunc) in enumerate(steps):
        buf.add(np.array([[t]], np.float32), np.array([[t]], np.float32), [r], [term], [trunc],
                np.array([[t + 1]], np.float32))  # fmt: skip


def test_the_buffer_is_a_ring_and_its_n_step_sums_stop_where_an_episode_ends():
    space = gym.spaces.Box(-100, 100, (1,), np.float32)
    ring = ReplayBuffer(space, BOX1, capacity=3, seed=0)
    _fill(ring, [(float(t), False, False) for t in range(5)])
    assert len(ring) == 3 and ring.added == 5
    assert ring.last(3)["obs"][:, 0].tolist() == [2.0, 3.0, 4.0]  # the oldest overwritten first
    n3 = ReplayBuffer(space, BOX1, capacity=10, n_step=3, gamma=0.5, seed=0)
    # rewards 1, 2, 4, 8 then the episode terminates at step 3; then a step of a new episode
    _fill(
        n3,
        [
            (1.0, False, False),
            (2.0, False, False),
            (4.0, False, False),
            (8.0, True, False),
            (16.0, False, False),
        ],
    )
    got = n3.last(4)
    assert got["obs"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert got["rewards"].tolist() == [1 + 0.5 * 2 + 0.25 * 4, 2 + 0.5 * 4 + 0.25 * 8, 4 + 0.5 * 8, 8.0]
    assert got["next_obs"][:, 0].tolist() == [3.0, 4.0, 4.0, 4.0]  # three steps on, or the episode's last
    assert got["discount"].tolist() == [0.125, 0.125, 0.25, 0.5] and got["terminated"].tolist() == [
        0,
        1,
        1,
        1,
    ]
    assert len(n3) == 4  # (the new episode's step waits for the two after it)


def test_a_cut_ends_an_envs_n_step_sums_bootstrapped_where_they_stop_and_leaves_the_others():
    space = gym.spaces.Box(-100, 100, (1,), np.float32)
    buf = ReplayBuffer(space, BOX1, capacity=10, num_envs=2, n_step=3, gamma=0.5, seed=0)
    for t, (r0, r1) in enumerate(
        [(1.0, 10.0), (2.0, 20.0)]
    ):  # two steps: neither env's first sum is complete
        buf.add(np.array([[t], [t]], np.float32), np.array([[t], [t]], np.float32), [r0, r1], [False, False],
                [False, False], np.array([[t + 1], [t + 1]], np.float32))  # fmt: skip
    assert len(buf) == 0
    assert buf.cut([1]) == 2  # (env 1's share is stepped by other envs from here: its sums end now)
    got = buf.last(2)
    assert got["rewards"].tolist() == [10 + 0.5 * 20, 20.0]
    assert got["next_obs"][:, 0].tolist() == [2.0, 2.0]  # bootstrapped from the last step they have
    assert got["discount"].tolist() == [0.25, 0.5] and got["terminated"].tolist() == [0, 0]
    assert len(buf.windows[0]) == 2 and not buf.windows[1]  # env 0's sums go on


def test_the_buffer_resumes_exactly_and_refuses_more_bytes_than_allowed(tmp_path):
    space = gym.spaces.Box(-1, 1, (3,), np.float32)
    a = ReplayBuffer(space, BOX1, capacity=50, num_envs=2, n_step=2, seed=3)
    rng = np.random.default_rng(0)

    def step(buf):
        buf.add(rng.random((2, 3)), rng.random((2, 1)), rng.random(2), rng.random(2) < 0.1, [False, False],
                rng.random((2, 3)))  # fmt: skip

    for _ in range(30):
        step(a)
    torch.save(a.state_dict(), tmp_path / "buffer.pt")  # as a checkpoint's rank file holds it
    from rlnb.files import torch_load_safe

    saved = torch_load_safe(tmp_path / "buffer.pt")  # (read without running code)
    b = ReplayBuffer(space, BOX1, capacity=50, num_envs=2, n_step=2, seed=99)
    b.load_state_dict(saved)
    state = rng.bit_generator.state
    step(a)
    rng.bit_generator.state = state
    step(b)
    x, y = a.sample(8), b.sample(8)
    assert all(torch.equal(x[k], y[k]) for k in x) and len(a) == len(b)
    per = transition_bytes(space, BOX1)
    assert per == 2 * 3 * 4 + 4 + 4 + 1 + 1 + 4
    with pytest.raises(
        ConfigError, match=r"buffer.capacity: 1,000 transitions take .* lower buffer.capacity to at most 100"
    ):
        ReplayBuffer(space, BOX1, capacity=1000, max_bytes=100 * per)
    with pytest.raises(ConfigError, match="buffer.n_step: expected an integer >= 1, got 0"):
        ReplayBuffer(space, BOX1, capacity=10, n_step=0)


def _pendulum_returns(learner: SACLearner, steps: int, learning_starts: int = 100) -> list[float]:
    env = gym.make("Pendulum-v1")
    buf = ReplayBuffer(env.observation_space, env.action_space, capacity=steps, seed=0)
    obs, _ = env.reset(seed=0)
    env.action_space.seed(0)
    returns, ret = [], 0.0
    for t in range(steps):
        a = env.action_space.sample() if t < learning_starts else learner.act(obs[None])[0]
        nxt, r, term, trunc, _ = env.step(a)
        buf.add(obs[None], a[None], [r], [term], [trunc], nxt[None])
        ret += r
        obs = nxt
        if term or trunc:
            returns.append(ret)
            ret = 0.0
            obs, _ = env.reset()
        if t >= learning_starts:
            learner.update(buf.sample(256))
    return returns


def test_sac_learns_pendulum_in_one_process():
    """SB3's defaults with rl-zoo's Pendulum learning rate (1e-3) and smaller networks: the return of the first
    episodes (a random policy, about -1500) rises by 600 at least within 4,000 steps (seen: -1485 -> -93)."""
    env = gym.make("Pendulum-v1")
    learner = SACLearner(
        env.observation_space, env.action_space, hidden=(64, 64), lr=1e-3, seed=0, torch_threads=1
    )
    returns = _pendulum_returns(learner, 4000)
    first, last = np.mean(returns[:2]), np.mean(returns[-3:])
    assert last > first + 600, returns
    assert learner.alpha < 1.0  # (tuned down from 1 as the policy's entropy fell to its target)


def _batches(n: int, size: int = 64) -> list[dict]:
    """Pendulum-shaped transitions, some of them terminal."""
    rng = np.random.default_rng(0)
    f32 = {"dtype": torch.float32}
    return [
        {
            "obs": torch.as_tensor(rng.normal(size=(size, 3)), **f32),
            "next_obs": torch.as_tensor(rng.normal(size=(size, 3)), **f32),
            "actions": torch.as_tensor(rng.uniform(-2, 2, (size, 1)), **f32),
            "rewards": torch.as_tensor(rng.normal(size=size), **f32),
            "terminated": torch.as_tensor(rng.random(size) < 0.1),
            "discount": torch.full((size,), 0.99),
        }
        for _ in range(n)
    ]


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"alpha": 0.2, "policy_delay": 2, "target_every": 2, "tau": 0.5, "hidden": (32,)},
        {"hidden": (16, 24, 8)},
    ],
    ids=["sb3", "fixed-alpha-delayed", "three-layers"],
)
def test_the_fused_update_moves_every_weight_as_autograds_does(settings):
    """``sac.kernel=fused`` writes SAC's gradients out (the twin Q-networks batched, Adam over flat tensors): the
    same update, so after 12 updates from the same weights and noise the two learners hold the same weights, to
    float rounding, and logged the same figures."""
    env = gym.make("Pendulum-v1")
    ref = SACLearner(env.observation_space, env.action_space, seed=0, **settings)
    fused = SACLearner(env.observation_space, env.action_space, seed=0, kernel="fused", **settings)
    parts = ("policy", "q", "q_target")
    start = {part: copy.deepcopy(list(getattr(ref, part).parameters())) for part in parts}
    for i, b in enumerate(_batches(12)):
        torch.manual_seed(i)
        want = ref.update(b)
        torch.manual_seed(i)
        got = fused.update(b)
        assert got.keys() == want.keys()
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5), i
    for part in parts:  # how far each weight moved (Adam's steps are about lr each: 1e-3 and less)
        named = zip(getattr(ref, part).named_parameters(), getattr(fused, part).parameters(), start[part])
        for (name, w), g, w0 in named:
            torch.testing.assert_close(g - w0, w - w0, rtol=1e-3, atol=1e-7, msg=f"{part}.{name}")
    torch.testing.assert_close(fused.log_alpha.detach(), ref.log_alpha.detach())
    assert fused.updates == ref.updates == 12


def test_the_fused_update_takes_only_continuous_actions_and_resumes_only_its_own_checkpoints():
    box = gym.make("Pendulum-v1")
    cartpole = gym.make("CartPole-v1")
    with pytest.raises(ConfigError, match=r"sac.kernel: the fused update is written for continuous actions, .*"
                                          r"Discrete\(2\); use sac.kernel=autograd"):  # fmt: skip
        SACLearner(cartpole.observation_space, cartpole.action_space, kernel="fused")
    with pytest.raises(ConfigError, match="sac.kernel: expected one of autograd, fused, got 'jit'"):
        SACLearner(box.observation_space, box.action_space, kernel="jit")
    autograd = SACLearner(box.observation_space, box.action_space, hidden=(8,))
    fused = SACLearner(box.observation_space, box.action_space, hidden=(8,), kernel="fused")
    with pytest.raises(
        ConfigError, match="written by the autograd update and this learner runs the fused one"
    ):
        fused.load_state_dict(autograd.state_dict())


@pytest.mark.parametrize("kernel", ["autograd", "fused"])
def test_a_learner_resumed_from_its_state_takes_the_same_steps(kernel):
    env = gym.make("Pendulum-v1")
    buf = ReplayBuffer(env.observation_space, env.action_space, capacity=500, seed=0)
    rng = np.random.default_rng(0)
    for _ in range(300):
        buf.add(
            rng.random((1, 3)),
            rng.uniform(-2, 2, (1, 1)),
            rng.random(1),
            [False],
            [False],
            rng.random((1, 3)),
        )
    a = SACLearner(env.observation_space, env.action_space, hidden=(16, 16), seed=1, kernel=kernel)
    for _ in range(5):
        a.update(buf.sample(32))
    saved, buf_state = (
        copy.deepcopy(a.state_dict()),
        copy.deepcopy(buf.state_dict()),
    )  # (as a file holds them)
    b = SACLearner(env.observation_space, env.action_space, hidden=(16, 16), seed=7, kernel=kernel)
    b.load_state_dict(saved)
    first = [a.update(buf.sample(32)) for _ in range(3)]
    buf.load_state_dict(buf_state)
    b.load_state_dict(saved)  # (the torch RNG again: the policy's samples are the same)
    second = [b.update(buf.sample(32)) for _ in range(3)]
    assert first == second
    assert all(
        torch.equal(x, y) for x, y in zip(a.policy.state_dict().values(), b.policy.state_dict().values())
    )


def test_discrete_sac_takes_cartpoles_actions_and_continuous_spaces_are_checked():
    env = gym.make("CartPole-v1")
    learner = SACLearner(env.observation_space, env.action_space, hidden=(16, 16), seed=0)
    buf = ReplayBuffer(env.observation_space, env.action_space, capacity=100, seed=0)
    obs, _ = env.reset(seed=0)
    for _ in range(40):
        a = learner.act(obs[None])
        nxt, r, term, trunc, _ = env.step(int(a[0]))
        buf.add(obs[None], a, [r], [term], [trunc], nxt[None])
        obs = nxt if not (term or trunc) else env.reset()[0]
    m = learner.update(buf.sample(16))
    assert {"q_loss", "actor_loss", "alpha", "entropy"} <= set(m) and all(
        math.isfinite(v) for v in m.values()
    )
    assert learner.target_entropy == pytest.approx(0.89 * math.log(2))
    with pytest.raises(ConfigError, match="unbounded"):
        SACLearner(env.observation_space, gym.spaces.Box(-np.inf, np.inf, (2,), np.float32))
    with pytest.raises(ConfigError, match="env.observation_space: SAC's MLPs take flat vector observations"):
        SACLearner(gym.spaces.Box(0, 255, (8, 8, 3), np.uint8), BOX1)


def test_the_buffer_and_the_learner_placed_on_workers_take_transitions_and_train(cluster):
    """Plain classes placed with launch: the buffer on one slot, the learner on the other; transitions added from
    the driver, batches sampled on the buffer's worker and trained on the learner's."""
    env = gym.make("Pendulum-v1")
    buffer = ReplayBuffer.launch(cluster, "0", obs_space=env.observation_space, action_space=env.action_space,
                                 capacity=500, seed=0)  # fmt: skip
    learner = SACLearner.launch(cluster, "1", obs_space=env.observation_space, action_space=env.action_space,
                                hidden=(16, 16), seed=0)  # fmt: skip
    try:
        obs, _ = env.reset(seed=0)
        for _ in range(64):
            a = learner.on(0).act(obs[None]).result()[0]
            nxt, r, term, trunc, _ = env.step(a[0])
            buffer.on(0).add(obs[None], a, [r], [term], [trunc], nxt[None]).result()
            obs = nxt
        assert buffer.on(0).stats().result()[0]["size"] == 64
        for _ in range(3):
            batch = buffer.on(0).sample(32).result()[0]
            metrics = learner.on(0).update(batch).result()[0]
        assert batch["obs"].shape == (32, 3) and all(math.isfinite(v) for v in metrics.values()), metrics
        assert learner.on(0).state_dict().result()[0]["updates"] == 3
    finally:
        buffer.shutdown()
        learner.shutdown()

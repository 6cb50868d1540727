"""The Env component in-process: autoreset, truncation bootstrap inputs, statistics, exact state."""

import re

import gymnasium as gym
import numpy as np
import pytest
import torch

import rlnb
from rlnb.components import Env
from rlnb.config import EnvConfig
from rlnb.errors import ConfigError
from rlnb.seeding import rank_seed
from tests.conftest import assert_resume_is_exact, set_spaces


def test_truncation_returns_final_obs_and_stats():
    env = Env(EnvConfig(id="CartPole-v1", num_envs=2, kwargs={"max_episode_steps": 5}), seed=0)
    obs = env.reset()[0]
    assert obs.shape == (2, 4) and obs.dtype == np.float32
    for _ in range(4):
        out = env.step(0, np.zeros(2, dtype=np.int64) + np.array([0, 1]))
        if out["terminated"].any():
            break
    # a 5-step time limit truncates unless the pole fell first
    out = env.step(0, np.array([1, 0]))
    done = out["terminated"] | out["truncated"]
    assert done.all()
    trunc_only = np.flatnonzero(out["truncated"] & ~out["terminated"])
    assert list(out["final_idx"]) == list(trunc_only)
    if len(trunc_only):
        assert out["final_obs"].shape == (len(trunc_only), 4)
        assert not np.allclose(out["final_obs"], out["obs"][trunc_only])  # obs is already the reset obs
    eps = env.pop_episodes()
    assert len(eps) == 2 and all(length == 5 for _, length in eps) and all(ret == 5.0 for ret, _ in eps)
    assert env.pop_episodes() == []


def test_an_env_class_runs_in_an_async_vector_env():
    """An env given as a class (not a registered id) in subprocesses: the choice of a fork server for the
    simulators named by id must not read a class as a name."""
    from gymnasium.envs.classic_control.cartpole import CartPoleEnv

    from rlnb.envs.gym_envs import make_vector_env

    vec = make_vector_env(CartPoleEnv, 2, "async")
    try:
        obs, _ = vec.reset(seed=0)
        assert obs.shape == (2, 4) and vec.step(np.zeros(2, dtype=np.int64))[0].shape == (2, 4)
    finally:
        vec.close()


def test_state_dict_continues_exactly():
    a = Env(EnvConfig(id="CartPole-v1", num_envs=3, pipeline_stages=1), seed=5)
    a.reset()
    rng = np.random.default_rng(0)
    for _ in range(30):
        a.step(0, rng.integers(0, 2, size=3))
    state = a.state_dict()
    b = Env(EnvConfig(id="CartPole-v1", num_envs=3), seed=99)
    b.load_state_dict(state)
    for _ in range(40):
        act = rng.integers(0, 2, size=3)
        oa, ob = a.step(0, act), b.step(0, act)
        assert np.array_equal(oa["obs"], ob["obs"]) and np.array_equal(oa["reward"], ob["reward"])
    assert a.pop_episodes() == b.pop_episodes()


def test_pipeline_stages_split_envs_and_seeds_differ():
    env = Env(EnvConfig(id="CartPole-v1", num_envs=4, pipeline_stages=2), seed=1)
    obs = env.reset()
    assert len(obs) == 2 and obs[0].shape == (2, 4)
    assert not np.allclose(obs[0], obs[1])
    same_rank = Env(EnvConfig(id="CartPole-v1", num_envs=4, pipeline_stages=2), seed=1, rank_info=None)
    assert np.allclose(same_rank.reset()[0], obs[0])  # same seed, same rank -> same start


def test_env_ranks_on_workers_start_apart_and_reproducibly(cluster):
    config = EnvConfig(id="CartPole-v1", num_envs=4)
    starts = []
    for _ in range(2):
        envs = Env.launch(cluster, "0-1", config=config, seed=1)
        try:
            starts.append([np.concatenate(o) for o in envs.current_obs().result(timeout=60)])
        finally:
            envs.shutdown()
    (rank0, rank1), again = starts
    assert not np.allclose(rank0, rank1)  # another rank, on another worker: other seeds
    assert np.allclose(rank0, again[0]) and np.allclose(rank1, again[1])  # the same seed: the same starts


def test_policies_cnn_gaussian_and_shared_trunk():
    import gymnasium as gym
    import torch

    from rlnb.config import ModelConfig
    from rlnb.models import build_policy

    images = gym.spaces.Box(0, 255, (3, 64, 64), dtype=np.uint8)
    cnn = build_policy(ModelConfig(kind="cnn"), images, gym.spaces.Discrete(5))
    obs = torch.randint(0, 255, (2, 3, 64, 64), dtype=torch.uint8)
    actions, logp, value = cnn.act(obs, torch.Generator().manual_seed(0))
    assert actions.shape == (2,) and logp.shape == (2,) and value.shape == (2,)
    lp, ent, v = cnn(obs, actions)
    assert torch.allclose(lp, logp) and (ent > 0).all() and torch.allclose(v, value)
    box = gym.spaces.Box(-1, 1, (3,), dtype=np.float32)
    gauss = build_policy(ModelConfig(shared_trunk=True), gym.spaces.Box(-np.inf, np.inf, (4,)), box)
    a, lp, _ = gauss.act(torch.zeros(5, 4), torch.Generator().manual_seed(0))
    assert a.shape == (5, 3) and torch.allclose(gauss(torch.zeros(5, 4), a)[0], lp, atol=1e-5)
    from rlnb.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'cnn' needs \(C, H, W\) observations"):
        build_policy(ModelConfig(kind="cnn"), gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(2))


class TimeLimitedVectorEnv(gym.vector.VectorEnv):
    """``obs[i] = (t, i)``; every episode is truncated after 3 steps (never terminated), reward 1 a step,
    with same-step autoreset: the returned obs is the reset one, the last one is in ``info["final_obs"]``."""

    def __init__(self, num_envs: int = 4):
        set_spaces(self, num_envs)
        self.t = 0

    def _obs(self, t):
        return np.stack(
            [np.full(self.num_envs, t, np.float32), np.arange(self.num_envs, dtype=np.float32)], 1
        )

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return self._obs(0), {}

    def step(self, actions):
        self.t += 1
        ones, no = np.ones(self.num_envs), np.zeros(self.num_envs, bool)
        if self.t < 3:
            return self._obs(self.t), ones, no, no, {}
        final = self._obs(self.t)
        self.t = 0
        info = {"final_obs": list(final), "_final_obs": ~no}
        return self._obs(0), ones, no, ~no, info


def test_a_collection_adds_the_discounted_value_of_the_last_observation_to_a_truncated_step(tmp_path):
    """Truncated, not terminated: the step's reward is 1 + gamma * V(the episode's last observation), its
    done flag is set, and the episodes count as finished with their length."""
    from rlnb.components.rollout import PolicyRollout
    from rlnb.runtime import rank as rank_mod

    env = Env(make_env=TimeLimitedVectorEnv, num_envs=4)
    rollout = PolicyRollout(None, env.observation_space, env.action_space, gamma=0.9, seed=0)
    host = type("Host", (), {"obj": env})()  # as the worker's registry of rank hosts holds it
    rank_mod._HOSTS[("", "env-truncating", 0)] = host
    rollout.collect(6, "env-truncating")
    batch = rollout.batch
    final = torch.tensor([[3.0, i] for i in range(4)])
    with torch.no_grad():
        bootstrap = 1 + 0.9 * rollout.policy.value(final)
    for t in range(6):
        expected = bootstrap if t in (2, 5) else torch.ones(4)
        assert torch.allclose(batch["rewards"][t], expected), t
        assert batch["dones"][t].tolist() == [float(t in (2, 5))] * 4
    assert batch["obs"][:, 0, 0].tolist() == [0, 1, 2, 0, 1, 2]
    assert env.pop_episodes() == [(3.0, 3)] * 8


class UnpickledFloat64VectorEnv(gym.vector.VectorEnv):
    """Float64 observations and rewards whose dtype is not numpy's own float64 object, as arrays unpickled from
    a checkpoint (a restored MuJoCo env) have it."""

    def __init__(self, num_envs: int = 4):
        set_spaces(self, num_envs)

    def _obs(self):
        import pickle

        return pickle.loads(pickle.dumps(np.ones((self.num_envs, 2))))

    def reset(self, *, seed=None, options=None):
        return self._obs(), {}

    def step(self, actions):
        import pickle

        no = np.zeros(self.num_envs, bool)
        return self._obs(), pickle.loads(pickle.dumps(np.ones(self.num_envs))), no, no, {}


def test_float64_observations_become_float32_whatever_their_dtype_object():
    """An env's float64 observations reach the policy as float32, also where their dtype is an equal but other
    numpy dtype object (unpickled: a resumed MuJoCo run's collection failed on a float64 batch)."""
    from rlnb.components.rollout import PolicyRollout
    from rlnb.runtime import rank as rank_mod

    env = Env(make_env=UnpickledFloat64VectorEnv, num_envs=4)
    assert (
        env.reset()[0].dtype == np.float32 and env.step(0, np.zeros(4, np.int64))["obs"].dtype == np.float32
    )
    rollout = PolicyRollout(None, env.observation_space, env.action_space, seed=0)
    host = type("Host", (), {"obj": env})()
    rank_mod._HOSTS[("", "env-unpickled", 0)] = host
    rollout.collect(3, "env-unpickled")
    assert (
        rollout.batch["obs"].dtype == torch.float32 and rollout.batch["rewards"].tolist() == [[1.0] * 4] * 3
    )


class _OwnStep(Env):
    """An env whose ``step`` is its own (here: Env's, called through it)."""

    def step(self, stage, actions):
        return super().step(stage, actions)


@pytest.mark.parametrize(
    "make_env", ["CartPole-v1", TimeLimitedVectorEnv], ids=["terminations", "truncations"]
)
def test_a_collection_through_the_host_loop_records_what_the_generic_loop_records(make_env, monkeypatch):
    """One stage of host observations stepped by Env.step itself takes collect()'s own loop, which writes the
    records straight into their buffers; an env with its own step takes the generic one. Same seeds, the very
    same batch and episodes, over episodes that end (terminated, or truncated and bootstrapped)."""
    from rlnb.components.rollout import PolicyRollout
    from rlnb.runtime import rank as rank_mod

    host_loops = []
    real = PolicyRollout._collect_host
    monkeypatch.setattr(PolicyRollout, "_collect_host", lambda *a: host_loops.append(1) or real(*a))
    results, hosts = [], []
    for env_class in (Env, _OwnStep):
        env = env_class(make_env=make_env, num_envs=4, seed=3)
        torch.manual_seed(0)  # (the same initial weights)
        rollout = PolicyRollout(None, env.observation_space, env.action_space, gamma=0.9, seed=5)
        hosts.append(type("Host", (), {"obj": env})())
        rank_mod._HOSTS[("", f"env-{env_class.__name__}", 0)] = hosts[-1]
        batches = []
        for _ in range(3):
            rollout.collect(20, f"env-{env_class.__name__}")
            batches.append(rollout.batch)
        results.append((batches, env.pop_episodes()))
    assert len(host_loops) == 3  # the built-in env's collections only
    (host, host_episodes), (generic, generic_episodes) = results
    assert len(host_episodes) >= 8 and host_episodes == generic_episodes
    for a, b in zip(host, generic):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
            else:
                assert a[key] == b[key], key


class EvalObsRollout(__import__("rlnb").PolicyRollout):
    """Keeps the first observations its evaluation acts on (the only deterministic ``act`` of a run)."""

    eval_obs = None

    def act(self, obs, deterministic: bool = False):
        if deterministic and self.eval_obs is None:
            self.eval_obs = np.array(obs)
        return super().act(obs, deterministic)

    def first_eval_obs(self):
        return self.eval_obs


def test_evaluation_normalises_observations_with_the_training_statistics_on_a_worker(cluster, tmp_path):
    import rlnb
    from rlnb.loop import Loop

    env = rlnb.Env.launch(cluster, "0", make_env="CartPole-v1", num_envs=4, normalize_obs=True)
    rollout = rlnb.launch(EvalObsRollout, cluster, "0", name="rollout")
    actor = rlnb.launch(rlnb.PPOActor, cluster, "0", name="actor")
    runner = {"tensorboard": False, "steps": 3, "eval_episodes": 2}
    with Loop(
        env=env, rollout=rollout, actor=actor, steps_per_rollout=16, runner=runner, run_dir=tmp_path
    ) as loop:
        loop.run(progress=False)
        loop.evaluate()
        trained = env.obs_normalization().result()[0]
        seen = rollout.first_eval_obs().result()[0]
        seed = loop.recipe.seed + 1_000_003
    # the evaluation's fresh envs, reset as it resets them, normalised with what training had learnt (frozen)
    raw = Env(EnvConfig(id="CartPole-v1", num_envs=2, pipeline_stages=1), seed=seed).reset()[0]
    assert trained.count > 3 * 16 * 4  # (training's statistics, not a fresh normaliser's)
    np.testing.assert_allclose(seen, trained.normalize(raw), rtol=1e-6)
    assert Env(EnvConfig(id="CartPole-v1", num_envs=2), normalize_obs=False).obs_normalization() is None


class SeededLength(__import__("gymnasium").Env):
    """Episodes of 1 step for an even reset seed, 10 for an odd one (kept across autoresets), reward 1 a step."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)
    length = 1

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self.length = 1 if seed % 2 == 0 else 10
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(2, np.float32), 1.0, self.t >= self.length, False, {}


def test_evaluation_counts_episodes_evenly_over_its_envs_not_the_first_to_end_on_a_worker(cluster, tmp_path):
    import rlnb
    from rlnb.loop import Loop

    env = rlnb.Env.launch(cluster, "0", make_env=SeededLength, num_envs=4)
    rollout = rlnb.PolicyRollout.launch(cluster, "0")
    actor = rlnb.PPOActor.launch(cluster, "0")
    runner = {"tensorboard": False, "steps": 1}
    with Loop(
        env=env, rollout=rollout, actor=actor, steps_per_rollout=8, runner=runner, run_dir=tmp_path
    ) as loop:
        # 4 envs (consecutive seeds), 4 episodes: one each, two of 1 step and two of 10 (the first 4 episodes
        # to end were all of 1 step)
        assert loop.evaluate(4)["eval/return_mean"] == pytest.approx(5.5)
        for bad in (0, -2, 2.5, True):  # refused before anything runs (-2 was an IndexError on the worker)
            with pytest.raises(
                ConfigError,
                match=rf"episodes: expected an integer in \[1, 1000000\].*, got {re.escape(repr(bad))}",
            ):
                loop.evaluate(bad)
        # 12 episodes over 8 envs: one each for the first four, two each for the others (as SB3's
        # evaluate_policy shares them)
        twelve = loop.evaluate(12)["eval/return_mean"]
        first = rank_seed(loop.recipe.seed + 1_000_003, 0, "env")
    lengths = [1 if (first + i) % 2 == 0 else 10 for i in range(8)]
    assert twelve == pytest.approx(sum(n * length for n, length in zip([1] * 4 + [2] * 4, lengths)) / 12)


class Choice(gym.Env):
    """One-step episodes: action 1 succeeds (``info["is_success"]``, as SB3 reads it) and earns 1.0, action 0
    fails and earns 0.0, so an episode's return is its success."""

    observation_space = gym.spaces.Box(0.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.zeros(2, np.float32), float(action == 1), True, False, {"is_success": bool(action == 1)}


def test_success_rate_is_logged_for_envs_that_report_it_on_workers(cluster, tmp_path):
    """``env/success_rate`` over the same episodes as ``env/episode_return_mean`` (here equal, episode by
    episode), through two pipeline stages (each stage's ended envs numbered apart), and ``eval/success_rate``."""
    import rlnb

    env = rlnb.Env.launch(cluster, "0", make_env=Choice, num_envs=6, pipeline_stages=2)
    rollout = rlnb.PolicyRollout.launch(cluster, "0")
    actor = rlnb.PPOActor.launch(cluster, "1", num_minibatches=2)
    runner = {"steps": 6, "tensorboard": False}
    with rlnb.Loop(
        env=env, rollout=rollout, actor=actor, steps_per_rollout=8, runner=runner, run_dir=tmp_path
    ) as loop:
        loop.run(progress=False)
        evaluation = loop.evaluate(8)
    rates = [
        (r["env/success_rate"], r["env/episode_return_mean"]) for r in loop.history if "env/success_rate" in r
    ]
    assert len(rates) == 6 and all(s == pytest.approx(ret) for s, ret in rates), rates
    assert 0 < rates[0][0] < 1  # a policy that has not learnt yet: some of each
    assert evaluation["eval/success_rate"] == pytest.approx(evaluation["eval/return_mean"])


def test_envs_that_do_not_report_success_log_no_success_rate():
    env = Env({"id": "CartPole-v1", "num_envs": 2}, seed=0)
    env.reset()
    while not env.finished:
        env.step(0, np.zeros(2, dtype=np.int64))
    assert all(len(e) == 2 for e in env.finished)  # (return, length): no success to say
    assert "success_rate" not in env.run_episodes(lambda obs: np.zeros(len(obs), dtype=np.int64), 2)


class TupleObservations(Choice):
    observation_space = gym.spaces.Tuple([gym.spaces.Discrete(2), gym.spaces.Discrete(3)])


class MultiBinaryActions(Choice):
    action_space = gym.spaces.MultiBinary(2)


@pytest.mark.parametrize(
    "make_env, member, expected",
    [
        (
            TupleObservations,
            "observation_space",
            "observations that are one array (a Box space) or a dict of vectors, images and texts (a Dict space), "
            "got Tuple(",
        ),
        (MultiBinaryActions, "action_space", "a Discrete or Box action space, got MultiBinary(2)"),
    ],
)
def test_an_env_class_with_spaces_the_component_cannot_take_is_refused_naming_the_space(
    make_env, member, expected
):
    """The env component and the built-in policy share one rule on spaces (``space_problem``): the component
    names the env class and the space."""
    from rlnb.errors import ComponentError

    with pytest.raises(ComponentError) as info:
        Env(make_env=make_env, num_envs=2)
    assert str(info.value).startswith(f"env: {make_env.__name__}.{member}: expected {expected}")
    assert info.value.key == member


def _maniskill_skip_reason() -> str | None:
    from rlnb.envs.gym_envs import maniskill_problem

    return maniskill_problem("PickCube-v1")


# ManiSkill's CPU simulation, on the workers here: state observations, one env to a subprocess
MANISKILL_CPU = [
    "env.kwargs.sim_backend=physx_cpu", "env.vector_mode=async", "env.num_envs=2", "actor.device=cpu",
    "rollout.device=cpu", "rollout.steps_per_rollout=25", "algorithm.num_minibatches=2", "runner.steps=2",
    "runner.eval_interval=0", "runner.tensorboard=false", "actor.model.hidden_sizes=[64,64]",
]  # fmt: skip


def test_maniskills_cpu_simulation_with_more_than_one_env_a_process_is_refused_naming_the_key():
    """ManiSkill's CPU simulation (physx_cpu: a machine without SAPIEN's GPU PhysX library) runs one env in a
    process: more than one in the env rank's own process is refused naming env.vector_mode, by the recipe before
    anything starts and by the env builder before ManiSkill is imported; a subprocess each (async), one env, or
    the GPU simulation is not refused."""
    from rlnb.config.loader import RecipeError
    from rlnb.envs.gym_envs import make_vector_env

    def problems(overrides) -> str:
        try:
            rlnb.config.load_recipe("ppo_maniskill", overrides)
        except RecipeError as e:
            return str(e)
        return ""

    cpu = "env.kwargs.sim_backend=physx_cpu"
    assert re.search(
        r"env.vector_mode: ManiSkill's CPU simulation .*physx_cpu.* got env.num_envs=8",
        problems([cpu, "env.num_envs=8", "env.vector_mode=sync"]),
    )
    for fits in (
        [cpu, "env.num_envs=1", "env.vector_mode=sync"],
        [cpu, "env.num_envs=8", "env.vector_mode=async"],
        ["env.kwargs.sim_backend=physx_cuda", "env.num_envs=8", "env.vector_mode=sync"],
    ):
        assert "env.vector_mode" not in problems(fits)  # (ManiSkill missing here is another problem)
    with pytest.raises(ConfigError, match="env.vector_mode: ManiSkill's CPU simulation"):
        make_vector_env("maniskill:PickCube-v1", 4, "sync", {"sim_backend": "cpu"})


def test_a_maniskill_camera_on_a_machine_without_cuda_renders_on_the_cpu_without_a_warning_from_each_env():
    """Every env process of a camera recipe warned that ManiSkill's CUDA renderer was asked for and not found
    (sixteen lines for sixteen envs) before falling back to the CPU one: on a machine without CUDA it is asked
    for the CPU renderer."""
    reason = _maniskill_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    import subprocess
    import sys

    code = (
        "from rlnb.envs.gym_envs import make_maniskill_cpu_env\n"
        "env = make_maniskill_cpu_env('PushCube-v1', {'obs_mode': 'rgb+state', 'sim_backend': 'physx_cpu',"
        " 'sensor_configs': {'width': 16, 'height': 16}})\n"
        "obs, _ = env.reset(seed=0)\n"
        "print(sorted(obs))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rgb" in done.stdout and "CUDA device was not found" not in done.stderr, done.stderr[-3000:]


def test_maniskill_envs_in_groups_take_their_episodes_length_from_the_recipe():
    """Embodied GRPO on ManiSkill's CPU simulation: the recipe's env.kwargs.max_episode_steps, which the
    pre-launch check accepted, is the groups' episode length on the worker too (the env's own spec does not
    carry it: the env's creation was refused there)."""
    reason = _maniskill_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    from rlnb.envs.gym_envs import make_vector_env

    kwargs = {"sim_backend": "physx_cpu", "obs_mode": "state", "max_episode_steps": 3}
    envs = make_vector_env("maniskill:PushCube-v1", 1, "sync", kwargs, group_horizon=0)
    try:
        envs.reset(seed=1)
        ends = [bool(envs.step(envs.action_space.sample())[2][0]) for _ in range(3)]
        assert ends == [False, False, True]
    finally:
        envs.close()


def test_a_maniskill_envs_later_episodes_follow_its_seed_not_the_processs_torch_rng_and_resume_with_it():
    """ManiSkill's task draws an unseeded reset's initial state (every episode after the first) from the process's
    torch RNG, which torch seeds at random in each process: the same seeds gave other episodes in every run, and
    one policy's greedy evaluation 9/48 in one process and 13/48 in another. With ManiSkill's
    ``enhanced_determinism`` (rlnb's default) the env's own RNG, set by the first reset's seed, draws them; an
    env's state (``sim_state``, what checkpoints hold) carries that RNG, so a restored env draws the same next
    episode as the one it was saved from."""
    reason = _maniskill_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    import torch

    from rlnb.envs.gym_envs import make_maniskill_cpu_env

    kwargs = {"sim_backend": "physx_cpu", "control_mode": "pd_ee_delta_pos"}
    a, b = make_maniskill_cpu_env("PushCube-v1", kwargs), make_maniskill_cpu_env("PushCube-v1", kwargs)
    try:
        first_a, first_b = a.reset(seed=5)[0], b.reset(seed=5)[0]
        np.testing.assert_array_equal(first_a, first_b)
        torch.manual_seed(1)
        second_a = a.reset()[0]
        torch.manual_seed(2)
        second_b = b.reset()[0]
        assert not np.array_equal(second_a, first_a)  # (a new episode, the cube elsewhere)
        np.testing.assert_array_equal(second_a, second_b)
        b.reset(seed=99)
        b.sim_state = a.sim_state  # (b restored from a's state mid-run: their next episodes are one)
        torch.manual_seed(3)
        third_a = a.reset()[0]
        torch.manual_seed(4)
        np.testing.assert_array_equal(third_a, b.reset()[0])
    finally:
        a.close()
        b.close()


def test_a_maniskill_task_that_cannot_run_here_is_refused_before_launch_saying_what_to_do():
    """An unknown task (with the nearest one named), and ManiSkill missing or without a Vulkan driver SAPIEN
    accepts: each refused by the recipe's checks, before any worker starts."""
    from rlnb.config.loader import RecipeError

    reason = _maniskill_skip_reason()
    if reason is not None:
        with pytest.raises(RecipeError, match="env.id: maniskill:PickCube-v1") as info:
            rlnb.config.load_recipe("ppo_maniskill", [])
        assert reason in str(info.value)
        pytest.skip(reason)
    with pytest.raises(RecipeError, match=r"ManiSkill has no task 'PickCub-v1'. Did you mean 'PickCube-v1'"):
        rlnb.config.load_recipe("ppo_maniskill", ["env.id=maniskill:PickCub-v1"])


def test_ppo_learns_to_push_a_cube_on_maniskills_cpu_simulation_on_the_workers(cluster, tmp_path):
    """The ``ppo_maniskill`` recipe as shipped (PushCube from its state, eight envs in subprocesses of an env rank
    on a Dask worker), cut to 8,000 env steps: the episodes' return rises and the first pushes succeed, read from
    ManiSkill's own ``success``. (The whole recipe's figures are in docs/benchmarks.md.)"""
    reason = _maniskill_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    from rlnb.loop import Loop

    overrides = ["runner.steps=20", "runner.eval_interval=0", "runner.tensorboard=false"]
    with Loop.from_recipe("ppo_maniskill", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        records = loop.run(progress=False)
        assert loop.env_spec["config"].id == "maniskill:PushCube-v1"
    assert len(records) == 20 and all(np.isfinite(r["train/loss"]) for r in records), records
    returns = [r["env/episode_return_mean"] for r in records]
    gain = np.mean(returns[-5:]) - np.mean(returns[:3])
    successes = [r["env/success_rate"] for r in records[-10:]]
    assert all(0.0 <= s <= 1.0 for s in successes)
    assert gain >= 0.8 and max(successes) > 0, (returns, successes)


def test_a_resumed_maniskill_run_continues_its_episodes_on_the_cpu_simulation(cluster, tmp_path):
    """Two PushCube envs in subprocesses, cut mid-episode (30 of 50 steps) and resumed: the envs' state comes
    back through ManiSkill's own state API (poses, velocities, step counters, RNGs), so the episodes end where
    the uncut run's did and the metrics after the cut are its own (to within PhysX's solver caches, which the
    state leaves out), rather than every episode starting again."""
    if _maniskill_skip_reason() is not None:
        pytest.skip(_maniskill_skip_reason())
    overrides = ["env.num_envs=2", "rollout.steps_per_rollout=15", "runner.steps=4", "runner.save_interval=2",
                 "runner.eval_interval=0", "runner.tensorboard=false", "actor.model.hidden_sizes=[64,64]",
                 "algorithm.num_minibatches=2"]  # fmt: skip
    assert_resume_is_exact("ppo_maniskill", overrides, cluster, tmp_path, tolerance=1e-3)


def test_ppo_steps_a_maniskill_task_from_camera_images_and_state_on_the_workers(cluster, tmp_path):
    """``ppo_maniskill_rgb`` (``obs_mode=rgb+state``) on ManiSkill's CPU simulation (rendered by the Vulkan software driver here): a dict
    of the camera's image and the flat state, packed at the env, read by the built-in CNN + MLP policy, and shown
    by name in ``loop.sample()``; a mode the CPU env cannot give refused naming the key."""
    reason = _maniskill_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    from rlnb.config.loader import RecipeError
    from rlnb.loop import Loop

    with pytest.raises(RecipeError, match="env.kwargs.obs_mode: expected one of state, rgb, rgb\\+state"):
        rlnb.config.load_recipe("ppo_maniskill", [*MANISKILL_CPU, "env.kwargs.obs_mode=pointcloud"])
    overrides = [*MANISKILL_CPU, "rollout.steps_per_rollout=10"]  # (the recipe's 32 px camera)
    with Loop.from_recipe("ppo_maniskill_rgb", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        records = loop.run(progress=False)
        obs = loop.sample(2)["obs"]
    assert len(records) == 2 and all(np.isfinite(r["train/loss"]) for r in records), records
    assert obs["rgb"].shape == (2, 2, 32, 32, 3) and obs["rgb"].float().std() > 0  # a rendered scene
    assert obs["state"].shape[:2] == (2, 2) and obs["state"].shape[2] > 9

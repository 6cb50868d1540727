"""Bad input is refused before anything starts (issue 40): exit 2 and one line naming the key, what was expected
and what was given; never a traceback, a hang or silent success. A fuzz over every key of the schema."""

import dataclasses
import random
import subprocess
import sys
import time
import types
import typing
from typing import Literal

import pytest

import rlnb
from rlnb.cluster.cluster import listed_workers
from rlnb.config import load_recipe
from rlnb.config.loader import RecipeError, _hints
from rlnb.config.schema import Recipe
from rlnb.errors import ConfigError
from rlnb.loop import GRPOLoop, Loop

RLNB = [sys.executable, "-m", "rlnb.cli"]


def schema_keys(cls=Recipe, prefix=""):
    """``(dotted key, type)`` of every leaf field of the recipe schema."""
    for f in dataclasses.fields(cls):
        tp, key = _hints(cls)[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            yield from schema_keys(tp, key + ".")
        else:
            yield key, tp


def bad_values(tp) -> list:
    """Values of the wrong type, out of range, not finite, empty, huge or with control characters."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return bad_values(inner[0]) if len(inner) == 1 else ["x", [1], {"a": 1}]
    if origin is Literal:
        return ["zzz", 3, [], ""]
    if origin is list:
        return ["x", [None], [{}], 3]
    if origin is dict:
        return ["x", [1], 3]
    if tp is int:
        return ["x", 1.5, -(10**30), 10**30, -1, 0, True, [], {}]
    if tp is float:
        return ["x", float("nan"), float("inf"), -float("inf"), -1e308, 1e308, -1.0, 0.0, [], {}]
    if tp is str:
        return ["", 5, [], "\x00", "a" * 5000]
    if tp is bool:
        return ["maybe", 2, []]
    return ["x", 3]


def fuzz(recipe: str) -> list[tuple[str, object]]:
    """Load ``recipe`` with each bad value of each key: a :class:`RecipeError` naming the key, or accepted
    (returned); anything else fails the test."""
    accepted = []
    for key, tp in schema_keys():
        for value in bad_values(tp):
            try:
                load_recipe(recipe, {key: value})
            except RecipeError as e:
                assert key in str(e), (key, value, str(e))
            except Exception as e:
                pytest.fail(f"{recipe} {key}={value!r:.60}: {type(e).__name__}: {e}")
            else:
                accepted.append((key, value))
    return accepted


def test_every_key_of_the_schema_refuses_bad_values_naming_the_key_or_runs_a_step(cluster, tmp_path):
    """The values the loader accepts (e.g. an LM field in a PPO recipe, which no component reads, or a huge
    but representable count) must then run: a seeded sample of them runs one step each, on real workers."""
    accepted = fuzz("ppo_cartpole")
    assert len(fuzz("grpo_arith")) < 250  # (most bad values are refused there too)
    # keys the embodied loop reads, whose accepted values must still run a step
    read = ("runner.", "algorithm.", "env.", "seed", "name", "rollout.steps_per_rollout", "actor.lr")
    sample = random.Random(0).sample([a for a in accepted if a[0].startswith(read)], 8)
    quiet = {"runner.tensorboard": False, "env.num_envs": 4, "rollout.steps_per_rollout": 16, "runner.steps": 1,
             "cluster.component_placement": {"actor,rollout,env": 0}}  # fmt: skip
    for i, (key, value) in enumerate(sample):
        overrides = {**quiet, key: value}
        if key in (
            "runner.run_dir",
            "runner.resume",
            "cluster.address",
            "runner.wandb_project",
            "cluster.slots",
        ):
            continue  # (checked by their own tests: a path, an address, a service)
        try:
            recipe = load_recipe("ppo_cartpole", overrides)
            with Loop(recipe, cluster, tmp_path / f"r{i}") as loop:
                loop.run(1, progress=False)
        except ConfigError as e:
            assert key.split(".")[-1] in str(e), (key, value, e)


@pytest.mark.parametrize(
    "args,expected",
    [
        (["/tmp"], "recipe: expected a recipe file, got '/tmp', which is a directory"),
        ([""], "recipe: expected a recipe file or bundled name, got ''"),
        (["ppo_cartpole", "actor.lr=inf"], "actor.lr: expected a finite number, got inf"),
        (["ppo_cartpole", "algorithm.vf_coef=nan"], "algorithm.vf_coef: expected a finite number, got nan"),
        (["grpo_arith", "rollout.temperature=nan"], "rollout.temperature: expected a finite number, got nan"),
        (["ppo_cartpole", "seed=-1"], "seed: expected an integer in [0, 2147483647] (what derives from it stays within numpy's 32 bits), got -1"),
        (["ppo_cartpole", "cluster.slots=0"], "cluster.slots: expected an integer in [1, 1024] (worker processes; a bigger cluster is started apart and given by address), got 0"),
        (["ppo_cartpole", "env.kwargs={sutton_barto: true}"], "env.kwargs: CartPole-v1 takes no argument 'sutton_barto'"),
        (["ppo_cartpole", "runner.eval_interval=-1"], "runner.eval_interval: expected an integer in [0, 1000000000], got -1"),
        (["ppo_cartpole", "env.kwargs={max_episode_steps: '100'}"],
         "env.kwargs: CartPole-v1 with {'max_episode_steps': '100'} does not build: TypeError: Expect the "),
        (["ppo_cartpole", "runner.run_dir=''"], "runner.run_dir: expected a directory"),
    ],
)  # fmt: skip
def test_bad_input_from_the_command_line_exits_2_naming_the_key(tmp_path, args, expected):
    done = subprocess.run([*RLNB, "run", *args, "--no-progress"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2 and expected in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


@pytest.mark.parametrize(
    "text,expected",
    [
        (b"seed: 1\nseed: 2\n", "duplicate key 'seed' at line 2"),
        (b"a: &x [1, 2]\nb: *x\n", "a YAML alias (*name) at line 2"),
        (b"\xff\xfe\x00", "expected UTF-8 text (a YAML file), got byte 0xff at offset 0"),
    ],
)
def test_a_recipe_file_with_duplicate_keys_aliases_or_not_text_is_refused(tmp_path, text, expected):
    path = tmp_path / "r.yaml"
    path.write_bytes(text)
    with pytest.raises(
        RecipeError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")
    ):
        load_recipe(path)


def test_a_billion_laughs_recipe_is_refused_at_once(tmp_path):
    """A 612-byte recipe of nested aliases used to hang the run expanding them."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i, name in enumerate("bcdefghi"):
        prev = "abcdefghi"[i]
        lines.append(f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]")
    path = tmp_path / "laughs.yaml"
    path.write_text("\n".join(lines) + "\n")
    done = subprocess.run([*RLNB, "run", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "a YAML alias (*name)" in done.stderr, done.stderr


def test_a_mistyped_model_path_beside_a_model_is_refused_not_built(cluster, tmp_path):
    from rlnb.models import build_tiny_lm

    build_tiny_lm(tmp_path / "tiny-arith-qwen2", 32, 1, 2)
    overrides = [f"actor.model_path={tmp_path / 'tiny-arith-qwen'}", "runner.tensorboard=false"]
    with pytest.raises(
        ConfigError,
        match=r"actor.model_path: no model at .*tiny-arith-qwen, .*Did you mean 'tiny-arith-qwen2'",
    ):
        GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run")
    assert not (tmp_path / "tiny-arith-qwen").exists()


def test_an_env_whose_observations_are_not_one_array_is_refused_naming_env_id(tmp_path):
    done = subprocess.run(
        [*RLNB, "run", "ppo_cartpole", "env.id=Blackjack-v1", "cluster.slots=1", "--run-dir", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (
        done.returncode == 2
        and "env.id: the built-in policy (actor.model) takes observations that are one array (a Box space) or a "
        "dict of vectors, images and texts (a Dict space), got Tuple("
        in done.stderr
        and "Traceback" not in done.stderr
    ), done.stderr
    assert not (tmp_path / "r").exists()  # refused before the run directory, let alone the cluster


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["env.id=Blackjack-v1"], r"env.id: the built-in policy \(actor.model\) takes .*got Tuple\("),
        (["env.id=InvertedPendulum-v5", "env.kwargs={reset_noise_scale: x}"],
         r"env.kwargs: InvertedPendulum-v5 with \{'reset_noise_scale': 'x'\} fails in its reset: TypeError"),
        (["env.id=InvertedPendulum-v5", "env.kwargs={frame_skip: 2.5}"],
         r"env.kwargs: InvertedPendulum-v5 with \{'frame_skip': 2.5\} fails in its first step: TypeError"),
        (["env.kwargs={max_episode_steps: 1.5}"], r"env.kwargs: CartPole-v1 with .* does not build: TypeError"),
    ],
)  # fmt: skip
def test_an_env_the_recipe_cannot_run_is_refused_before_a_cluster_starts(
    monkeypatch, tmp_path, overrides, expected
):
    """One env of the recipe is built, reset and stepped on the driver first: an ``env.kwargs`` value of the wrong
    type, or observations the built-in policy cannot take, are refused before any cluster or worker starts."""
    import rlnb.loop.session

    def no_cluster(*args, **kwargs):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(rlnb.loop.session, "Cluster", no_cluster)
    with pytest.raises(ConfigError, match=expected):
        Loop.from_recipe("ppo_cartpole", overrides, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_scale_down_that_takes_a_components_worker_is_warned_at_once_naming_what_it_holds(caplog):
    """Issue 57: `cluster.scale(n)` (or adapt()) on a cluster object can close the worker an actor lives on (Dask
    cannot retire it gracefully, and a SpecCluster closes it anyway); nothing said so until the run's next call
    failed. Now the driver warns as the scheduler retires it, naming the components, and the next call is a typed
    error."""
    from distributed import LocalCluster

    from rlnb.errors import RlnbError

    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as dask_cluster,
        rlnb.Cluster(dask_cluster, timeout_s=60, min_slots=2) as cluster,
    ):
        names = {a: w["name"] for a, w in listed_workers(cluster.client).items()}
        gone = next(s for s in cluster.slots if names[s.address] == 1)  # (scale(1) closes worker 1)
        stays = next(s for s in cluster.slots if s is not gone)
        env = rlnb.Env.launch(cluster, str(gone.rank), make_env="CartPole-v1", num_envs=2)
        keep = rlnb.Env.launch(cluster, str(stays.rank), make_env="CartPole-v1", num_envs=2, name="kept")
        leaving = gone.address
        with caplog.at_level("WARNING", logger="rlnb"):
            dask_cluster.scale(1)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and "env[0]" not in caplog.text:
                time.sleep(0.1)
        said = [r.getMessage() for r in caplog.records if leaving in r.getMessage()]
        assert said and f"(slot {gone.rank})" in said[0] and "while it holds env[0]" in said[0], caplog.text
        assert "loop.recover()" in said[0] and "kept[0]" not in " ".join(said)
        with pytest.raises(RlnbError):
            env.on(0).spaces().result()
        assert keep.on(0).spaces().result()  # (the other worker's component goes on)


def test_a_dask_cluster_object_that_is_closed_or_has_no_workers_is_refused_saying_what_to_do():
    """rlnb.Cluster(a LocalCluster, SLURMCluster...): a closed one raised Dask's RuntimeError; one with no workers
    said to start `dask worker` by hand. Now a ClusterError each, the second naming scale() and adapt()."""
    from distributed import Client, LocalCluster

    from rlnb.errors import ClusterError

    closed = LocalCluster(n_workers=0, processes=False, dashboard_address=None)
    closed.close()
    with pytest.raises(ClusterError, match="the LocalCluster given is closed; start a new one"):
        rlnb.Cluster(closed, timeout_s=10)
    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as empty:
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match=r"has 0 worker\(s\); waited 1 s for 1. Scale it first: "
                                               r"LocalCluster.scale\(1\) \(or .adapt\(minimum=1\)\)"):  # fmt: skip
            rlnb.Cluster(empty, timeout_s=1)
        assert time.monotonic() - t0 < 30
        client = Client(empty)
        client.close()
        with pytest.raises(ClusterError, match="the distributed.Client given is closed; pass an open one"):
            rlnb.Cluster(client, timeout_s=1)

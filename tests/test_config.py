"""Recipes: loading, overrides, round trip, and errors that name the file, key, expectation and value."""

import dataclasses

import pytest
import yaml

from rlnb.config import Recipe, RecipeError, field_docs, load_recipe, to_dict, to_yaml
from rlnb.config.loader import recipe_path
from rlnb.errors import ConfigError


def test_bundled_recipe_and_overrides():
    r = load_recipe(
        "ppo_cartpole",
        ["seed=3", "env.num_envs=16", "algorithm.clip_coef=0.1", "cluster.component_placement.actor=0-1"],
    )
    assert (r.seed, r.env.num_envs, r.algorithm.clip_coef) == (3, 16, 0.1)
    # actor moved out of the joined key, the others stay together
    assert r.cluster.component_placement == {"rollout,env": 0, "actor": "0-1"}
    assert r.name == "ppo_cartpole"


def test_yaml_round_trip(tmp_path):
    r = load_recipe("ppo_cartpole", ["actor.model.hidden_sizes=[32, 16]", "actor.lr=3e-4"])
    path = tmp_path / "again.yaml"
    path.write_text(to_yaml(r))
    again = load_recipe(path)
    assert to_dict(again) == to_dict(r)
    assert again.actor.model.hidden_sizes == [32, 16] and again.actor.lr == 3e-4


def test_every_field_is_documented():
    def walk(cls):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
            if dataclasses.is_dataclass(f.type) or isinstance(f.default_factory, type):
                pass
        for f in dataclasses.fields(cls):
            sub = getattr(cls(), f.name)
            if dataclasses.is_dataclass(sub):
                walk(type(sub))

    walk(Recipe)


def test_all_errors_at_once_with_file_and_keys(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "env": {"num_envs": -2, "id": "CartPol-v1", "num_env": 3},
                "algorithm": {"advantage": "gea", "gamma": "high"},
                "runer": {"steps": 3},
            }
        )
    )
    with pytest.raises(RecipeError) as e:
        load_recipe(bad)
    msg = str(e.value)
    assert str(bad) in msg
    assert "env.num_env: unknown key" in msg and "Did you mean 'num_envs'?" in msg
    assert "runer: unknown key" in msg and "Did you mean 'runner'?" in msg
    assert "algorithm.gamma: expected a number, got str 'high'" in msg
    assert "env.num_envs: expected an integer in [1, 65536] (envs of one env rank), got -2" in msg
    assert (
        "env.id: 'CartPol-v1' is not a registered gymnasium environment. Did you mean 'CartPole-v1'?" in msg
    )
    assert "algorithm.advantage: unknown advantage 'gea'" in msg and "Did you mean 'gae'?" in msg
    assert len(e.value.errors) == 6


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("env.num_envs=abc", "env.num_envs: expected an integer, got str 'abc'"),
        ("env.num_envs=true", "env.num_envs: expected an integer, got bool True"),
        (
            "env.vector_mode=asink",
            "env.vector_mode: expected one of 'sync', 'async', got 'asink'. Did you mean 'async'?",
        ),
        ("algorithm.gamma=1.5", "algorithm.gamma: expected a number in [0, 1], got 1.5"),
        ("algorithm.policy_loss=ppo2", "algorithm.policy_loss: unknown policy loss 'ppo2'"),
        ("env.pipeline_stages=3", "env.pipeline_stages: 3 stages must divide env.num_envs=8"),
        (
            "actor.model.hidden_sizes=64",
            "actor.model.hidden_sizes: expected a list of integers, got int 64",
        ),
        ("actor.modle.kind=cnn", "actor.modle: unknown key"),
        (
            "runner.steps=-1",
            "runner.steps: expected an integer in [0, 1000000000] (a billion steps is no run that ends), got -1",
        ),
        ("algorithm.dual_clip=0.5", "algorithm.dual_clip: expected a number in (1, 1000000], got 0.5"),
    ],
)
def test_override_errors(override, fragment):
    with pytest.raises(RecipeError) as e:
        load_recipe("ppo_cartpole", [override])
    assert fragment in str(e.value)


def test_malformed_yaml_and_missing_recipe(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("env:\n  id: [CartPole\n")
    with pytest.raises(RecipeError, match=r"malformed YAML at line \d+, column \d+"):
        load_recipe(bad)
    with pytest.raises(
        Exception, match=r"recipe 'ppo_cartpol' not found; bundled recipes: .*Did you mean 'ppo_cartpole'\?"
    ):
        load_recipe("ppo_cartpol")
    with pytest.raises(Exception, match="expected key=value"):
        load_recipe("ppo_cartpole", ["env.num_envs"])


def test_env_ids_in_module_form_import_their_module_and_are_checked():
    """`module:id` (gymnasium's form): the module registers the id; rlnb's package import registers no test env."""
    import subprocess
    import sys

    code = "import gymnasium as gym, rlnb.envs, rlnb.loop; print('rlnb-test/NaNReward-v0' in gym.registry)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
    load_recipe("ppo_cartpole", ["env.id=rlnb.testing:rlnb-test/NaNReward-v0"])
    with pytest.raises(
        ConfigError, match=r"rlnb.testing registers no gymnasium environment 'rlnb-test/NaNRewrd-v0'"
    ):
        load_recipe("ppo_cartpole", ["env.id=rlnb.testing:rlnb-test/NaNRewrd-v0"])
    with pytest.raises(ConfigError, match=r"module 'no_such_module' does not import"):
        load_recipe("ppo_cartpole", ["env.id=no_such_module:Env-v0"])


def test_a_recipe_names_its_family_and_older_recipes_are_read_as_the_family_they_ran(tmp_path, caplog):
    old = tmp_path / "old.yaml"  # written before families: `loop:` named the loop class
    old.write_text("loop: embodied\nenv:\n  num_envs: 4\n")
    assert load_recipe(old).family == "ppo"
    bundled = recipe_path("grpo_arith").read_text()
    assert "family: grpo\n" in bundled
    old.write_text(bundled.replace("family: grpo\n", "loop: grpo\n"))
    assert load_recipe(old).family == "grpo"
    silent = tmp_path / "silent.yaml"  # no family at all: inferred once from the rollout's backend, and said
    silent.write_text(bundled.replace("family: grpo\n", ""))
    with caplog.at_level("WARNING", logger="rlnb"):
        assert load_recipe(silent).family == "grpo"
    assert "names no family; rollout.backend=hf runs family: grpo" in caplog.text
    with pytest.raises(RecipeError, match=r"loop: expected one of .* got 'ppo2'"):
        load_recipe(silent, ["loop=ppo2"])
    with pytest.raises(RecipeError, match=r"rollout.backend: family: grpo samples an LM"):
        load_recipe("ppo_cartpole", ["family=grpo"])


def test_a_section_of_another_family_is_refused_naming_its_key_not_ignored(tmp_path):
    """A PPO recipe setting ``data.*`` (GRPO's prompts) would run with it ignored without a word."""
    with pytest.raises(
        RecipeError, match=r"data.prompts_per_step: the data section is read by family grpo only"
    ):
        load_recipe("ppo_cartpole", ["data.prompts_per_step=8"])
    with pytest.raises(RecipeError, match=r"env.num_envs: the env section is read by family ppo or sac only"):
        load_recipe("grpo_arith", ["env.num_envs=3"])
    with pytest.raises(
        RecipeError, match=r"reward.name: the reward section .* \(remove it, or set family: grpo\)"
    ):
        load_recipe("ppo_mujoco", ["reward.name=math"])
    for name in (
        "ppo_cartpole",
        "grpo_arith",
    ):  # a run directory's recipe.yaml holds every section: read back
        written = tmp_path / f"{name}.yaml"
        written.write_text(to_yaml(load_recipe(name)))
        assert to_dict(load_recipe(written)) == to_dict(load_recipe(name))

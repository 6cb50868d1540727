"""Loading models: hub ids through from_pretrained, never replaced by a random model."""

import subprocess
import sys

import pytest

import rlnb
from rlnb.loop import GRPOLoop


def test_a_hub_id_is_never_replaced_by_a_random_model(cluster, tmp_path, monkeypatch):
    """`actor.model_path=org/name` used to build a random tiny LM in ./org/name (build_if_missing)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a machine without internet
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    overrides = ["actor.model_path=rlnb-test/not-cached", "runner.tensorboard=false"]
    placed = [cluster.placed_on(s) for s in range(cluster.num_slots)]
    with pytest.raises(
        rlnb.ConfigError, match="actor.model_path: 'rlnb-test/not-cached' is not a local directory"
    ) as e:
        GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run")
    assert e.value.key == "actor.model_path" and "huggingface-cli download" in str(e.value)
    assert not (tmp_path / "rlnb-test").exists()
    assert [cluster.placed_on(s) for s in range(cluster.num_slots)] == placed  # nothing was launched


def test_a_hub_id_in_the_local_cache_loads_through_from_pretrained(tmp_path):
    import os

    from rlnb.models.lm import build_tiny_lm, is_hub_id

    # the Hugging Face cache layout, made locally: hub/models--org--name/{refs/main, snapshots/<rev>/}
    revision = "0" * 40
    repo = tmp_path / "hf" / "hub" / "models--rlnb-test--tiny"
    build_tiny_lm(repo / "snapshots" / revision, 32, 1, 2, seed=0)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    assert (
        is_hub_id("rlnb-test/tiny") and not is_hub_id("./models/tiny") and not is_hub_id("runs/models/tiny")
    )
    # a fresh process: huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when imported
    code = (
        "from rlnb.models.lm import load_lm; m, t = load_lm('rlnb-test/tiny'); "
        "print(m.config.model_type, t.pad_token_id is not None)"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.split() == ["qwen2", "True"], out.stderr[-2000:]

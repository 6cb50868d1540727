"""The LM actor sharded with FSDP2 (``actor.strategy: fsdp2``) over two CPU ranks (gloo) on Dask workers."""

import math

import pytest
import torch

from rlnb.config import load_recipe
from rlnb.config.loader import RecipeError
from rlnb.loop import GRPOLoop
from tests.test_lm import GRPO_SMALL

TWO_RANKS = [
    *GRPO_SMALL, "actor.sft_steps=30", "runner.steps=3", "data.prompts_per_step=4", "algorithm.group_size=4",
    "algorithm.update_epochs=2", "rollout.max_new_tokens=3", "cluster.component_placement={'actor,rollout,reward': 0-1}",
]  # fmt: skip


def _run(cluster, tmp_path, name: str, extra: list[str]) -> tuple[list[dict], int]:
    overrides = [*TWO_RANKS, f"actor.model_path={tmp_path / 'model'}", *extra]
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / name) as loop:
        records = loop.run(progress=False)
        state_bytes = records[-1]["memory/actor_state_bytes"]
        planned = loop.plan().actor_state_bytes  # (rlnb plan's estimate, from the config on the meta device)
    assert abs(planned / state_bytes - 1) < 0.15, (name, planned, state_bytes)
    return records, state_bytes


def test_fsdp2_on_two_cpu_ranks_trains_as_ddp_does_with_a_shard_of_the_state_each(cluster, tmp_path):
    """The same warm start and GRPO steps, sharded or not: the same losses (float32: to rounding), each rank
    holding about half the parameters, gradients and AdamW state; in bf16 (FSDP2's mixed precision) finite."""
    ddp, ddp_bytes = _run(cluster, tmp_path, "ddp", ["actor.strategy=ddp"])
    fsdp, fsdp_bytes = _run(cluster, tmp_path, "fsdp2", ["actor.strategy=fsdp2"])
    losses = [(a["train/loss"], b["train/loss"]) for a, b in zip(ddp, fsdp)]
    assert len(losses) == 3 and all(a == pytest.approx(b, rel=1e-3, abs=1e-4) for a, b in losses), losses
    assert 0.4 < fsdp_bytes / ddp_bytes < 0.6, (fsdp_bytes, ddp_bytes)
    bf16, _ = _run(cluster, tmp_path, "bf16", ["actor.strategy=fsdp2", "actor.dtype=bfloat16"])
    assert all(math.isfinite(r["train/loss"]) for r in bf16), bf16


def test_a_sharded_actor_compiles_each_decoder_layer_and_trains_as_eager_does(cluster, tmp_path):
    """actor.compile=true with fsdp2: each decoder layer's forward is compiled (FSDP2's hooks between layers stay
    outside, where a whole-objective graph broke at every one and recompiled for each new length), timed as
    time/compile_s; the losses are eager's."""
    eager, _ = _run(cluster, tmp_path, "eager", ["actor.strategy=fsdp2", "actor.skip_zero_advantage=false"])
    overrides = [*TWO_RANKS, f"actor.model_path={tmp_path / 'model'}", "actor.strategy=fsdp2",
                 "actor.skip_zero_advantage=false", "actor.compile=true"]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "layers") as loop:
        compiled = loop.run(progress=False)
        stats = loop.groups["actor"].compile_stats().result()
    layers = load_recipe("grpo_arith", TWO_RANKS).actor.tiny_lm.num_layers
    assert all(s["compiled"] and s["what"] == f"{layers} layers" and s["fallback"] is None for s in stats), (
        stats
    )
    assert (
        min(s["compile_s"] for s in stats)
        <= compiled[0]["time/compile_s"]
        <= max(s["compile_s"] for s in stats)
    )
    losses = [(a["train/loss"], b["train/loss"]) for a, b in zip(eager, compiled)]
    assert len(losses) == 3 and all(a == pytest.approx(b, rel=1e-3, abs=1e-4) for a, b in losses), losses
    # a backend that cannot compile: the layers get their eager forward back, and train as eager does
    from tests.test_compile import _failing_backend

    cluster.client.run(_failing_backend, "rlnb_test_fails")
    try:
        with GRPOLoop.from_recipe(
            "grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "fell"
        ) as loop:
            fell = loop.run(progress=False)
            stats = loop.groups["actor"].compile_stats().result()
    finally:
        cluster.client.run(_failing_backend, None)
    assert all(not s["compiled"] and "cannot compile anything" in s["fallback"] for s in stats), stats
    assert all(
        a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-3, abs=1e-4) for a, b in zip(eager, fell)
    )


def test_hsdp_replicas_of_a_sharded_model_train_as_ddp_does(cluster, tmp_path):
    """actor.hsdp_replicas=2 on two ranks: two replicas, each sharded over one rank (a 2-D device mesh), so each
    rank holds the whole state, as under DDP, and the losses are DDP's; a count that does not divide the actor
    ranks, or replicas without fsdp2, are refused naming the key."""
    ddp, ddp_bytes = _run(cluster, tmp_path, "ddp", ["actor.strategy=ddp"])
    hsdp, hsdp_bytes = _run(cluster, tmp_path, "hsdp", ["actor.strategy=fsdp2", "actor.hsdp_replicas=2"])
    losses = [(a["train/loss"], b["train/loss"]) for a, b in zip(ddp, hsdp)]
    assert len(losses) == 3 and all(a == pytest.approx(b, rel=1e-3, abs=1e-4) for a, b in losses), losses
    assert 0.95 < hsdp_bytes / ddp_bytes < 1.05, (hsdp_bytes, ddp_bytes)
    from rlnb.errors import PlacementError

    overrides = [
        *TWO_RANKS,
        f"actor.model_path={tmp_path / 'model'}",
        "actor.strategy=fsdp2",
        "actor.hsdp_replicas=3",
    ]
    with pytest.raises(PlacementError, match=r"actor.hsdp_replicas=3 must divide the 2 actor rank\(s\)"):
        GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "three")
    with pytest.raises(
        RecipeError, match="actor.hsdp_replicas: 2 replicas of a sharded model need actor.strategy=fsdp2"
    ):
        load_recipe("grpo_arith", ["actor.hsdp_replicas=2"])
    with pytest.raises(RecipeError, match=r"actor.hsdp_replicas: expected an integer in \[1, 65536\], got 0"):
        load_recipe("grpo_arith", ["actor.strategy=fsdp2", "actor.hsdp_replicas=0"])


def test_the_kl_reference_is_sharded_too_and_gives_the_same_kl_as_ddp(cluster, tmp_path):
    """With a KL term the reference model is sharded like the policy (about half its bytes a rank, no whole
    copy), set from the warm-started policy shard to shard, and the KL and losses are DDP's."""
    fsdp = _sharded_as_ddp(
        cluster, tmp_path, ["algorithm.kl_coef=0.1"], ("train/kl", "train/loss"), "ref_bytes"
    )
    assert any(r["train/kl"] > 0 for r in fsdp)  # (the policy moved away from the reference)


def _sharded_as_ddp(cluster, tmp_path, extra: list[str], keys: tuple[str, ...], memory: str) -> list[dict]:
    """The same run under DDP and FSDP2: ``keys`` agree step by step, and ``memory/<memory>`` is about half a rank
    sharded. Returns the FSDP2 run's records."""
    ddp, _ = _run(cluster, tmp_path, "ddp", ["actor.strategy=ddp", *extra])
    fsdp, _ = _run(cluster, tmp_path, "fsdp2", ["actor.strategy=fsdp2", *extra])
    for key in keys:
        pairs = [(a[key], b[key]) for a, b in zip(ddp, fsdp)]
        assert len(pairs) == 3 and all(a == pytest.approx(b, rel=1e-3, abs=1e-5) for a, b in pairs), (
            key,
            pairs,
        )
    ratio = fsdp[-1][f"memory/{memory}"] / ddp[-1][f"memory/{memory}"]
    assert 0.4 < ratio < 0.6, ratio
    return fsdp


def test_ppos_value_model_is_sharded_like_the_policy_trains_as_ddp_does_and_resumes_exactly(
    cluster, tmp_path
):
    """algorithm.advantage=token_gae under FSDP2: the value model is sharded over the actor's ranks as the policy
    is (about half its bytes a rank), its value losses are DDP's, and a run cut at step 2 resumes to step 3's."""
    gae = [
        "algorithm.advantage=token_gae",
        "algorithm.gamma=1.0",
        "actor.critic_lr=0.001",
        "runner.save_interval=1",
    ]
    fsdp = _sharded_as_ddp(cluster, tmp_path, gae, ("train/value_loss", "train/loss"), "critic_bytes")
    from rlnb.loop.families.grpo.plan import plan_recipe

    recipe = load_recipe(
        "grpo_arith", [*TWO_RANKS, f"actor.model_path={tmp_path / 'model'}", "actor.strategy=fsdp2", *gae]
    )
    planned = plan_recipe(recipe, cluster.slots)  # rlnb plan counts the shard too
    critic = next(s for s in planned.slots if "actor" in s.components).parts["critic"]
    assert abs(critic / fsdp[-1]["memory/critic_bytes"] - 1) < 0.1, (critic, fsdp[-1]["memory/critic_bytes"])
    overrides = [
        *TWO_RANKS,
        f"actor.model_path={tmp_path / 'model'}",
        "actor.strategy=fsdp2",
        *gae,
        "runner.steps=2",
    ]
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "cut") as loop:
        loop.run(progress=False)
    with GRPOLoop.resume(tmp_path / "cut", cluster=cluster, overrides=["runner.steps=3"]) as loop:
        last = loop.run(progress=False)[-1]
    assert last["train/value_loss"] == pytest.approx(fsdp[-1]["train/value_loss"], rel=1e-5, abs=1e-7)
    assert last["train/loss"] == pytest.approx(fsdp[-1]["train/loss"], rel=1e-5, abs=1e-7)


def test_a_sharded_run_checkpoints_and_resumes_exactly_and_exports_the_whole_model(cluster, tmp_path):
    extra = [
        "actor.strategy=fsdp2",
        "runner.save_interval=1",
        "algorithm.kl_coef=0.1",
    ]  # (the sharded reference too)
    whole, _ = _run(cluster, tmp_path, "whole", extra)
    overrides = [*TWO_RANKS, f"actor.model_path={tmp_path / 'model'}", *extra, "runner.steps=2"]
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "cut") as loop:
        loop.run(progress=False)
    # the weights and AdamW state in DCP shards, one file a rank, written with no gather; the rank files the rest
    step = tmp_path / "cut" / "checkpoints" / "step_000002"
    shards = sorted(p.name for p in (step / "actor_dcp").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"], shards
    from rlnb.files import torch_load_safe

    rest = torch_load_safe(step / "actor_rank0.pt")
    assert rest["shards"] == "dcp" and "policy" not in rest and "optimizer" not in rest
    resumed = GRPOLoop.resume(tmp_path / "cut", cluster=cluster, overrides=["runner.steps=3"])
    with resumed as loop:
        assert loop.step == 2
        last = loop.run(progress=False)[-1]
        exported = loop.export(tmp_path / "exported")
    assert last["train/loss"] == pytest.approx(whole[-1]["train/loss"], rel=1e-5, abs=1e-7)
    from rlnb.models.lm import load_lm

    model, _ = load_lm(str(exported))  # a whole model in Hugging Face format, not a shard
    assert sum(p.numel() for p in model.parameters()) > 0


def test_a_sharded_actors_weights_reach_the_rollout_bucket_by_bucket(cluster, tmp_path):
    """A sharded actor gathers its whole tensors one at a time and sends them in buckets of at most
    actor.gather_bucket_bytes (here 64 KiB: several), each loaded into the rollout's model as it comes, to a
    rollout on other slots (through the weights channel) and to one in its own processes (collocated): the same
    losses as DDP's in each placement, and no bucket over the bound. An export writes a file a bucket (and their
    index), which ``from_pretrained`` loads as the actor's weights."""
    from transformers import AutoModelForCausalLM

    small = ["actor.gather_bucket_bytes=65536"]
    apart = [*small, "cluster.component_placement={actor: 0-1, 'rollout,reward': 0}"]
    for name, extra in (("apart", apart), ("together", small)):
        ddp, _ = _run(cluster, tmp_path, f"ddp-{name}", ["actor.strategy=ddp", *extra])
        overrides = [*TWO_RANKS, f"actor.model_path={tmp_path / 'model'}", "actor.strategy=fsdp2", *extra]
        with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / name) as loop:
            fsdp = loop.run(progress=False)
            reports = loop.groups["actor"].sync_report().result()
            exported = loop.export(tmp_path / f"exported-{name}")
            gathered = loop.groups["actor"].full_state().result()[0]
        files = sorted(p.name for p in exported.glob("model-*.safetensors"))
        assert len(files) > 2 and (exported / "model.safetensors.index.json").is_file(), files
        model = AutoModelForCausalLM.from_pretrained(exported)
        assert all(torch.equal(v, gathered[k]) for k, v in model.state_dict().items()), name
        losses = [(a["train/loss"], b["train/loss"]) for a, b in zip(ddp, fsdp)]
        assert len(losses) == 3 and all(a == pytest.approx(b, rel=1e-3, abs=1e-4) for a, b in losses), (
            name,
            losses,
        )
        for report in reports:  # (every rank gathers; rank 0 sends)
            assert report["buckets"] > 2 and report["largest_bucket_bytes"] <= 65536, (name, report)


@pytest.mark.parametrize("arch, max_shard_size, kl", [("qwen2", None, False), ("llama", "40KB", True)])
def test_each_sharded_rank_reads_only_its_shards_of_the_checkpoint(
    cluster, tmp_path, arch, max_shard_size, kl
):
    """actor.strategy=fsdp2 over two ranks: the model is built with no storage and each rank reads its own shard
    of every tensor from the safetensors file(s) (one file, or several named by an index), about half the
    weights' bytes (every byte once over the ranks, no rank the whole model); gathered, the weights are the
    checkpoint's exactly. With a KL term in bf16 the reference model is read too, into bf16 from the float32
    file: the first step's KL is 0 (the policy computes in bf16 from the same weights). (The rotary
    frequencies, in no checkpoint, are checked by the tests above: their losses are DDP's, whose ranks load the
    model whole.)"""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlnb.models.lm import build_tiny_lm, load_tokenizer

    model = build_tiny_lm(tmp_path / "built", hidden_size=64, arch=arch)
    if max_shard_size is not None:  # a large checkpoint's layout: shards and model.safetensors.index.json
        saved_as = AutoModelForCausalLM.from_pretrained(model)
        saved_as.save_pretrained(tmp_path / "sharded", max_shard_size=max_shard_size)
        load_tokenizer(str(model)).save_pretrained(tmp_path / "sharded")
        model = tmp_path / "sharded"
    files = sorted(model.glob("*.safetensors"))
    assert (len(files) == 1) == (max_shard_size is None), files
    overrides = [*TWO_RANKS, f"actor.model_path={model}", "actor.strategy=fsdp2", "actor.sft_steps=0",
                 *(["algorithm.kl_coef=0.1", "actor.dtype=bfloat16"] if kl else [])]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        actor = loop.groups["actor"]
        reports = actor.load_report().result()
        gathered = actor.full_state().result()[0]
        first = loop.step_once() if kl else None
    saved = {k: v for f in files for k, v in load_file(str(f)).items()}
    total = sum(t.numel() * t.element_size() for t in saved.values()) * (
        2 if kl else 1
    )  # (the reference too)
    assert all(r["rank_by_rank"] for r in reports), reports
    assert sum(r["read_bytes"] for r in reports) == total, (reports, total)
    assert all(0.4 < r["read_bytes"] / total < 0.6 for r in reports), (reports, total)
    for name, tensor in saved.items():
        assert torch.equal(gathered[name], tensor), name
    if kl:
        assert first["train/kl"] == pytest.approx(0.0, abs=1e-6), first


def test_checkpoint_headers_count_the_weights_and_an_oversized_one_is_refused(tmp_path):
    """The weights of a checkpoint in several files are counted from their headers alone; a header claiming more
    than safetensors' limit is refused naming the file before anything is allocated for it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlnb.components.lm.shard_load import checkpoint_files, unmatched, weight_count
    from rlnb.models.lm import build_tiny_lm

    built = build_tiny_lm(tmp_path / "built", hidden_size=32, num_layers=2, num_heads=2)
    AutoModelForCausalLM.from_pretrained(built).save_pretrained(tmp_path / "parts", max_shard_size="20KB")
    files = checkpoint_files(str(tmp_path / "parts"))
    assert len(files) > 1
    assert weight_count(files) == sum(t.numel() for f in files for t in load_file(str(f)).values())
    hostile = tmp_path / "hostile.safetensors"
    hostile.write_bytes((2**62).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match=r"hostile.safetensors: a safetensors header of \d+ bytes"):
        weight_count([hostile])
    with pytest.raises(ValueError, match="hostile"):
        unmatched(torch.nn.Linear(1, 1), [hostile])


def test_a_rank_by_rank_actor_used_before_it_is_sharded_says_so(tmp_path):
    """Built to read its shards (fsdp2, two ranks), an actor holds no weights until setup_data_parallel(): a
    warm start or a batch before it is refused saying what to call, not computed on the meta device."""
    from rlnb.components.lm import LMActor
    from rlnb.models.lm import build_tiny_lm
    from rlnb.runtime.rank import RankInfo

    model = str(build_tiny_lm(tmp_path / "tiny", hidden_size=32, num_layers=1, num_heads=2))
    info = RankInfo("actor", 0, 2, 0, 2, 0, "cpu", "inproc://", "localhost")
    actor = LMActor(model, group_size=4, actor={"strategy": "fsdp2"}, rank_info=info)
    assert actor.load_report() == {"rank_by_rank": True, "read_bytes": None}
    assert next(actor.policy.parameters()).is_meta
    for call in (lambda: actor.sft(["1+1="], ["2"], 1, 1, 1e-3), lambda: actor.set_batch([])):
        with pytest.raises(RuntimeError, match=r"actor\[0\]: with actor.strategy=fsdp2 over 2 ranks .*"
                           r"setup_data_parallel\(\)"):  # fmt: skip
            call()


def test_fsdp2_with_one_actor_rank_says_there_is_nothing_to_shard(cluster, tmp_path, caplog):
    overrides = [*TWO_RANKS, f"actor.model_path={tmp_path / 'model'}", "actor.strategy=fsdp2", "actor.sft_steps=0",
                 "cluster.component_placement={'actor,rollout,reward': 0}"]  # fmt: skip
    with (
        caplog.at_level("WARNING", logger="rlnb"),
        GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop,
    ):
        assert loop.groups["actor"].world_size == 1
    said = [r.getMessage() for r in caplog.records if "nothing to shard" in r.getMessage()]
    assert said and said[0].startswith("actor.strategy=fsdp2 with one actor rank"), said


def test_fsdp2_misfits_are_refused_naming_the_key():
    from rlnb.config import RecipeError

    with pytest.raises(RecipeError, match="actor.strategy: fsdp2 shards a transformer"):
        load_recipe("ppo_cartpole", ["actor.strategy=fsdp2"])
    with pytest.raises(RecipeError, match="actor.strategy: fsdp2 gathers the weights"):
        load_recipe("grpo_arith", ["actor.strategy=fsdp2", "rollout.weight_sync=broadcast"])
    with pytest.raises(RecipeError, match=r"actor.offload: params is FSDP2's CPU offload, .* \(it is ddp\)"):
        load_recipe("grpo_arith", ["actor.offload=params"])
    with pytest.raises(RecipeError, match="actor.offload: params moves the actor's state from GPU memory"):
        load_recipe("grpo_arith", ["actor.strategy=fsdp2", "actor.offload=params", "actor.device=cpu"])


def test_cpu_offload_on_cpu_slots_is_refused_before_anything_launches(cluster, tmp_path, monkeypatch):
    """actor.offload=params moves GPU memory to the host: on CPU slots (device auto) it is refused naming the key
    before any component launches, and an actor built in-process on CPU refuses it too."""
    from rlnb.components.lm import LMActor
    from rlnb.errors import ConfigError
    from rlnb.models.lm import build_tiny_lm

    def no_launch(*args, **kwargs):
        raise AssertionError("launched")

    monkeypatch.setattr(LMActor, "launch", no_launch)
    overrides = [
        *TWO_RANKS,
        f"actor.model_path={tmp_path / 'model'}",
        "actor.strategy=fsdp2",
        "actor.offload=params",
    ]
    with pytest.raises(
        ConfigError, match=r"actor.offload=params .* actor slots \[0, 1\] are CPU-only"
    ) as info:
        GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run")
    assert info.value.key == "actor.offload"
    model = str(build_tiny_lm(tmp_path / "tiny", hidden_size=32, num_layers=1, num_heads=2))
    with pytest.raises(ConfigError, match=r"actor.offload=params .* a GPU \(this actor is on cpu\)"):
        LMActor(model, group_size=4, actor={"strategy": "fsdp2", "offload": "params"})


class _RunsCode:
    """What a hostile checkpoint would pickle: unpickling it calls ``_mark`` (here: writes a file)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (_mark, (str(self.path),))


def _mark(path: str):
    open(path, "w").close()
    return {}


def test_a_dcp_index_or_value_naming_code_is_refused_before_it_runs(tmp_path):
    """DCP's own reader unpickles the index with pickle.load and the optimizer's values with
    torch.load(weights_only=False); rlnb's reads both restricted: a crafted checkpoint runs nothing."""
    import io
    import pickle

    import torch

    from rlnb.components.lm.dcp import SafeLoadPlanner, SafeReader
    from rlnb.files import UnsafeFileError

    ran = tmp_path / "ran"
    hostile = tmp_path / "ckpt"
    hostile.mkdir()
    (hostile / ".metadata").write_bytes(pickle.dumps(_RunsCode(ran)))
    with pytest.raises(UnsafeFileError, match=r"DCP index names tests.test_sharding._mark"):
        SafeReader(str(hostile)).read_metadata()
    value = io.BytesIO()
    torch.save(_RunsCode(ran), value)
    value.seek(0)

    class Item:  # (the one field load_bytes reads of DCP's ReadItem)
        class dest_index:
            fqn = "optim.param_groups.0.lr"

    planner = SafeLoadPlanner()
    planner.flatten_state_dict, planner.state_dict = False, {}
    with pytest.raises(UnsafeFileError, match=r"DCP value 'optim.param_groups.0.lr' names code to run"):
        planner.load_bytes(Item, value)
    assert not ran.exists()
    value = io.BytesIO()
    torch.save(0.25, value)  # a plain value loads
    value.seek(0)
    planner.load_bytes(Item, value)
    assert planner.state_dict == {"optim.param_groups.0.lr": 0.25}


def test_lora_adapters_on_a_sharded_model_train_checkpoint_and_resume_exactly(cluster, tmp_path):
    """LoRA with FSDP2: only the adapters train, sharded with the frozen base; a DCP checkpoint holds both and a
    resumed run continues exactly, with a KL term against the model with its adapters off."""
    extra = ["actor.strategy=fsdp2", "actor.lora.rank=4", "actor.lora.alpha=8", "algorithm.kl_coef=0.1",
             "runner.save_interval=1", "actor.lora.warm_start=adapters"]  # fmt: skip
    whole, _ = _run(cluster, tmp_path, "whole", extra)
    assert all(math.isfinite(r["train/loss"]) for r in whole) and "memory/ref_bytes" not in whole[-1]
    overrides = [*TWO_RANKS, f"actor.model_path={tmp_path / 'model'}", *extra, "runner.steps=2"]
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "cut") as loop:
        loop.run(progress=False)
    assert (tmp_path / "cut" / "checkpoints" / "step_000002" / "actor_dcp" / ".metadata").is_file()
    with GRPOLoop.resume(tmp_path / "cut", cluster=cluster, overrides=["runner.steps=3"]) as loop:
        last = loop.run(progress=False)[-1]
    assert last["train/loss"] == pytest.approx(whole[-1]["train/loss"], rel=1e-5, abs=1e-7)
    # in bf16 the frozen base is held in bf16 (about half the bytes a rank), the adapters in float32
    half, half_bytes = _run(cluster, tmp_path, "bf16", [*extra, "actor.dtype=bfloat16"])
    assert all(math.isfinite(r["train/loss"]) for r in half)
    assert 0.4 < half_bytes / whole[-1]["memory/actor_state_bytes"] < 0.7, (half_bytes, whole[-1])


def test_asynchronous_generation_takes_a_sharded_actors_weights_bucket_by_bucket_between_chunks(tmp_path):
    """algorithm.max_staleness=1 with a sharded actor on two slots and the rollout on a third: the rollout takes
    each version's buckets between chunks of tokens as they come (partial rollouts), within the staleness bound."""
    import rlnb

    overrides = [*TWO_RANKS, f"actor.model_path={tmp_path / 'model'}", "actor.strategy=fsdp2",
                 "actor.gather_bucket_bytes=65536", "algorithm.max_staleness=1", "rollout.chunk_tokens=1",
                 "runner.steps=4", "cluster.component_placement={'rollout,reward': 0, actor: 1-2}"]  # fmt: skip
    with (
        rlnb.Cluster(slots=3, gpus=False) as cluster,
        GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop,
    ):
        records = loop.run(progress=False)
        reports = loop.groups["actor"].sync_report().result()
    stale = [r["rollout/staleness_max"] for r in records]
    assert len(records) == 4 and max(stale) == 1, stale  # across weight updates, never past the bound
    assert all(math.isfinite(r["train/loss"]) for r in records)
    assert all(r["buckets"] > 2 for r in reports), reports

"""GPU-only paths: dask-cuda's LocalCUDACluster, NCCL process groups, ManiSkill's GPU simulator.

They run on machines with a CUDA GPU (and, for ManiSkill, Vulkan); elsewhere they skip with the reason.
"""

import copy
import importlib.util

import numpy as np
import pytest

from tests.conftest import requires_gpu


@requires_gpu
def test_embedded_cluster_uses_dask_cuda_and_nccl():
    import rlnb
    from rlnb.testing import Collective

    with rlnb.Cluster() as cluster:  # LocalCUDACluster: one worker per GPU
        assert cluster.has_gpus and all(s.device == "cuda:0" for s in cluster.slots)
        g = rlnb.Group.launch(Collective, cluster, "all", name="actor")
        assert g.init_process_group() == "nccl"
        n = g.world_size
        expected = [float(sum(range(1, n + 1))), 10.0 * sum(range(1, n + 1))]
        assert g.all_reduce().result(120) == [expected] * n
        g.shutdown()


@requires_gpu
@pytest.mark.skipif(
    importlib.util.find_spec("mani_skill") is None, reason="mani-skill not installed (extra `maniskill`)"
)
def test_maniskill_env_steps_on_gpu():
    from rlnb.components import Env
    from rlnb.envs.gym_envs import _check_physx_gpu_library

    try:
        _check_physx_gpu_library()
    except RuntimeError as e:  # an offline machine without SAPIEN's PhysX GPU library
        pytest.skip(str(e))
    from rlnb.config import EnvConfig

    env = Env(
        EnvConfig(id="maniskill:PickCube-v1", num_envs=4, kwargs={"control_mode": "pd_ee_delta_pos"}), seed=0
    )
    obs = env.reset()[0]
    assert obs.shape[0] == 4
    out = env.step(0, np.zeros((4, *env.action_space.shape), dtype=np.float32))
    assert out["obs"].shape == obs.shape and out["reward"].shape == (4,)
    assert out["obs"].device.type == "cuda"  # observations stay on the GPU
    state = env.state_dict()  # through ManiSkill's state API, not by pickling the simulator
    assert state["envs"] is None and "sim" in state["vector_state"][0]
    env.load_state_dict(state)
    env.close()


@requires_gpu
def test_ppo_trains_on_cuda_with_a_cpu_env():
    """The env's batches are CPU tensors; the actor on `cuda` takes them onto its GPU (it failed with
    'mat1 is on cpu' before)."""
    import rlnb

    loop = rlnb.Loop.from_recipe(
        "ppo_cartpole", ["actor.device=cuda", "rollout.device=cuda", "runner.steps=3", "actor.compile=false"]
    )
    try:
        loop.run(progress=False)
        assert loop.step == 3
    finally:
        loop.close()


@requires_gpu
def test_cuda_tensors_cross_a_channel_by_cuda_ipc():
    """Two worker processes on one node: the consumer maps the producer's GPU memory (it sees a write the
    producer makes after the hand-off), and the channel counts a CUDA IPC tensor, not a host copy."""
    from rlnb.gpu_check import check_cuda_ipc_channel

    out = check_cuda_ipc_channel(None)
    assert out["first"]["device"] == "cuda" and out["after_producer_write"] == 2.0
    assert out["cuda_ipc_tensors"] >= 1


@requires_gpu
def test_a_simulator_on_the_gpu_keeps_its_observations_there():
    import torch

    from rlnb.components import Env

    env = Env(make_env="rlnb/TorchCartPole-v1", num_envs=4, kwargs={"device": "cuda"}, normalize_obs=True)
    assert env.reset()[0].device.type == "cuda"
    for _ in range(30):
        out = env.step(0, np.zeros(4, dtype=np.int64))
        assert out["obs"].device.type == "cuda" and out["reward"].shape == (4,)
    state = copy.deepcopy(env.state_dict())  # as a checkpoint holds it: nothing shared with `env`
    twin = Env(make_env="rlnb/TorchCartPole-v1", num_envs=4, kwargs={"device": "cuda"}, normalize_obs=True)
    twin.load_state_dict(state)
    a, b = env.step(0, np.ones(4, dtype=np.int64)), twin.step(0, np.ones(4, dtype=np.int64))
    assert torch.equal(a["obs"], b["obs"])


@requires_gpu
def test_fsdp2_cpu_offload_trains_grpo_on_one_gpu(tmp_path):
    """actor.offload=params (FSDP2's CPU offload, gloo beside NCCL for the gradients' norm) on one GPU trains."""
    from rlnb.gpu_check.scale import check_lm_offload_cuda

    out = check_lm_offload_cuda(tmp_path, steps=3)
    assert out["finite_params"] and out["steps_params"] == 3

"""The rollout-to-actor batch layouts (``rlnb.components.batches``): each is checked where an actor takes a
batch, so a rollout of one's own that gets one wrong is told which key, what was expected and what it gave,
on its worker, before the update reads it."""

import pytest
import torch

import rlnb
from rlnb.components.batches import EMBODIED_BATCH, LM_BATCH, LM_OPTIONAL, check_batch
from rlnb.errors import ComponentError, RemoteError
from rlnb.loop import GRPOLoop
from tests.conftest import collocated_loop


def _embodied(T=8, N=2) -> dict:
    return {
        "obs": torch.zeros(T, N, 4),
        "actions": torch.zeros(T, N),
        "logprobs": torch.zeros(T, N),
        "values": torch.zeros(T, N),
        "rewards": torch.zeros(T, N),
        "dones": torch.zeros(T, N),
        "last_values": torch.zeros(N),
        "version": 3,
    }


def _lm(B=4, L=6) -> dict:
    batch = {k: torch.zeros(B, L) for k in ("input_ids", "attention_mask", "response_mask", "logprobs")}
    return {**batch, "rewards": torch.zeros(B), "version": 0, "texts": [""] * B}


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda b: b.pop("dones"), r"rollout: batch\.dones: missing; a batch has \['actions', "),
        (lambda b: b.update(rewards=[0.0] * 8), r"batch\.rewards: expected a tensor \[T, N\], got list"),
        (lambda b: b.update(values=torch.zeros(8)), r"batch\.values: expected a tensor \[T, N\], got one of shape \[8\]"),
        (lambda b: b.update(last_values=torch.zeros(3)), r"batch\.last_values: .* with N=2 \(as in 'obs'\), got one of shape \[3\]"),
        (lambda b: b.update(logprobs=torch.zeros(7, 2)), r"batch\.logprobs: .* with T=8, N=2 .*got one of shape \[7, 2\]"),
        (lambda b: b.update(version=torch.tensor(3)), r"batch\.version: expected an int, got tensor\(3\)"),
        (lambda b: b.update(obs=torch.zeros(8)), r"batch\.obs: expected a tensor \[T, N, \.\.\.\], got one of shape \[8\]"),
    ],
)  # fmt: skip
def test_a_batch_off_its_layout_is_refused_naming_the_key_what_was_expected_and_what_came(change, match):
    check_batch(_embodied(), EMBODIED_BATCH)  # as the built-in rollout makes it
    check_batch(
        {**_embodied(), "actions": torch.zeros(8, 2, 3)}, EMBODIED_BATCH
    )  # continuous actions [T, N, A]
    batch = _embodied()
    change(batch)
    with pytest.raises(ComponentError, match=match):
        check_batch(batch, EMBODIED_BATCH)


def test_optional_lm_columns_are_checked_where_present():
    check_batch(_lm(), LM_BATCH, LM_OPTIONAL)
    check_batch({**_lm(), "truncated": torch.zeros(4, dtype=torch.bool)}, LM_BATCH, LM_OPTIONAL)
    with pytest.raises(ComponentError, match=r"batch\.truncated: .* with B=4 .*got one of shape \[5\]"):
        check_batch({**_lm(), "truncated": torch.zeros(5)}, LM_BATCH, LM_OPTIONAL)
    with pytest.raises(ComponentError, match=r"batch\.versions: .* with B=4, L=6 .*shape \[4, 5\]"):
        check_batch({**_lm(), "versions": torch.zeros(4, 5)}, LM_BATCH, LM_OPTIONAL)
    with pytest.raises(ComponentError, match=r"batch\.<batch>: expected a dict of tensors keyed"):
        check_batch([1, 2], LM_BATCH)


class RewardSlicingRollout(rlnb.PolicyRollout):
    """A rollout of one's own whose batch loses its last env's rewards."""

    def _finish(self, traj, last_obs):
        out = super()._finish(traj, last_obs)
        self.batch["rewards"] = self.batch["rewards"][:, :-1]
        return out


def test_a_rollouts_wrong_batch_is_refused_by_the_actor_on_its_worker(cluster, tmp_path):
    wrong = r"rollout: batch\.rewards: expected a tensor \[T, N\] with T=16, N=4 \(as in 'obs'\), got .* \[16, 3\]"
    loop = collocated_loop(cluster, tmp_path, RewardSlicingRollout, steps=1)
    with loop, pytest.raises(RemoteError, match=wrong):
        loop.step_once()


class MaskDroppingRollout(rlnb.HFRollout):
    def generate(self, *args, **kwargs) -> dict:
        out = super().generate(*args, **kwargs)
        del self.batch["response_mask"]
        return out


def test_an_lm_rollouts_batch_without_its_response_mask_is_refused_naming_it(cluster, tmp_path):
    from rlnb import LMActor
    from rlnb.models import build_tiny_lm

    model = str(build_tiny_lm(tmp_path / "tiny", hidden_size=32, num_layers=1, num_heads=2))
    records = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(6) for b in range(6)]
    rollout = MaskDroppingRollout.launch(cluster, "0", model_path=model, max_new_tokens=3)
    actor = LMActor.launch(cluster, "0", model_path=model, group_size=4)
    loop = GRPOLoop(
        rollout=rollout, actor=actor, reward="arithmetic", prompts=records, prompts_per_step=4, run_dir=tmp_path / "run"
    )  # fmt: skip
    with loop, pytest.raises(RemoteError, match=r"rollout: batch\.response_mask: missing"):
        loop.step_once()

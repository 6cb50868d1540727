"""Actor component for embodied PPO: owns the policy and optimizer, computes advantages, trains.

Data-parallel over its ranks with ``DistributedDataParallel`` on the group's default process group
(gloo on CPU, NCCL on GPU); each rank trains on the batch of its own rollout ranks.
"""

from __future__ import annotations

import torch

from rlnb.algorithms import get_advantage, get_policy_loss
from rlnb.components.rollout import _model_config, resolve_device
from rlnb.config.schema import ActorConfig, AlgorithmConfig
from rlnb.models.policies import build_policy
from rlnb.runtime.rank import RankInfo, local_peer


def _cfg(cls, value):
    if isinstance(value, cls):
        return value
    value = dict(value)
    if cls is ActorConfig and isinstance(value.get("model"), dict):
        value["model"] = _model_config(value["model"])
    return cls(**value)


class ActorBase:
    """What every actor component shares: data-parallel set-up, weight publishing, batch intake.

    A subclass has ``self.policy`` (the trained module), ``self.model`` (what its train step calls),
    ``self.device``, ``self.cfg`` (an :class:`ActorConfig`), ``world_size``, ``optimizer``,
    ``generator``, ``step``, and implements ``policy_state()`` and ``set_batch(batches)``.
    """

    def setup_data_parallel(self) -> str:
        """Wrap the policy in DDP over the default process group (call after ``init_process_group``)."""
        from torch.nn.parallel import DistributedDataParallel

        from rlnb.runtime.rank import process_group

        ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(self.policy, device_ids=ids, process_group=process_group("default"))
        self.model = torch.compile(ddp) if getattr(self.cfg, "compile", False) else ddp
        return "ddp"

    def publish_weights(self, channel, keys: list[str], version: int) -> int:
        """Disaggregated weight sync: put the weights once per rollout rank key (worker to worker)."""
        state = self.policy_state()
        for k in keys:
            channel.put({"state": state, "version": version}, key=k)
        return version

    def take_local_batches(self, rollout: str, ranks: list[int]) -> dict:
        """Collocated hand-off: the batches of rollout ranks in this process, no copy."""
        return self.set_batch([local_peer(rollout, r).take_batch() for r in ranks])

    def take_channel_batches(self, channel, keys: list[str]) -> dict:
        """Disaggregated hand-off: one batch per key from a channel."""
        return self.set_batch([channel.get(key=k) for k in keys])

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Weights, optimizer, both RNGs and the step: what an exact resume needs."""
        return {
            "policy": self.policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "step": self.step,
        }

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        self.step = state["step"]

    def _mean_over_ranks(self, value: float) -> float:
        if self.world_size == 1:
            return value
        from rlnb.runtime.collective import all_reduce_
        from rlnb.runtime.rank import process_group

        return float(
            all_reduce_(torch.tensor([value], device=self.device), process_group("default"), average=True)
        )


class PPOActor(ActorBase):
    """PPO (CleanRL's ``ppo.py`` update) as a component.

    Args:
        actor: :class:`rlnb.config.ActorConfig` (model, lr, compile...).
        algorithm: :class:`rlnb.config.AlgorithmConfig` (advantage, loss, coefficients).
        obs_space, act_space: gymnasium spaces of one env.
        total_steps: training steps of the run (for learning-rate annealing).
        seed: seed of the minibatch shuffling (rank ``r`` uses ``seed + r``) and of the initial weights.
    """

    def __init__(
        self,
        actor,
        algorithm,
        obs_space,
        act_space,
        total_steps: int = 1,
        seed: int = 0,
        advantage_fn=None,
        loss_fn=None,
        rank_info: RankInfo | None = None,
    ):
        self.cfg, self.algo = _cfg(ActorConfig, actor), _cfg(AlgorithmConfig, algorithm)
        torch.set_num_threads(self.cfg.torch_threads)
        self.rank = rank_info.rank if rank_info else 0
        self.world_size = rank_info.world_size if rank_info else 1
        torch.manual_seed(seed)  # identical initial weights on every rank
        self.device = resolve_device(self.cfg.device, rank_info)
        self.policy = build_policy(self.cfg.model, obs_space, act_space).to(self.device)
        # fused Adam: one kernel for all parameters (the default on CPU loops over tensors in Python)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=self.cfg.lr, eps=1e-5, fused=True)
        self.generator = torch.Generator().manual_seed(seed + 104729 * (self.rank + 1))
        self.total_steps = max(1, total_steps)
        self.step = 0
        self.model = self.policy  # what the train step calls: DDP and/or compiled wrappers of policy
        # functions resolved by the driver travel with the call, so ones registered in a notebook work here
        self.advantage_fn = advantage_fn or get_advantage(self.algo.advantage)
        self.loss_fn = loss_fn or get_policy_loss(self.algo.policy_loss)
        self.batch: dict | None = None
        if self.cfg.compile:
            self.model = torch.compile(self.model)

    def policy_state(self) -> dict[str, torch.Tensor]:
        """Weights for the rollout (a detached CPU copy)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.policy.state_dict().items()}

    def set_batch(self, batches: list[dict]) -> dict:
        """Take one or more rollout batches (concatenated along the env axis)."""
        keys = ("obs", "actions", "logprobs", "values", "rewards", "dones")
        batch = {k: torch.cat([b[k] for b in batches], dim=1) for k in keys}
        batch["last_values"] = torch.cat([b["last_values"] for b in batches])
        batch["version"] = min(b["version"] for b in batches)
        self.batch = batch
        return {"steps": int(batch["rewards"].numel()), "version": batch["version"]}

    # ------------------------------------------------------------------ phases
    def compute_advantages(self) -> dict:
        """Run the advantage estimator on the current batch."""
        b = self.batch
        adv, ret = self.advantage_fn(
            rewards=b["rewards"], values=b["values"], dones=b["dones"], last_values=b["last_values"],
            gamma=self.algo.gamma, gae_lambda=self.algo.gae_lambda,
        )  # fmt: skip
        b["advantages"], b["returns"] = adv, ret  # [T, N]
        return {
            "advantage_mean": float(adv.mean()),
            "advantage_std": float(adv.std()),
            "return_mean": float(ret.mean()),
        }

    def train(self) -> dict:
        """``update_epochs`` passes of ``num_minibatches`` minibatches over the batch; returns mean metrics."""
        a, b = self.algo, self.batch
        if "advantages" not in b:
            self.compute_advantages()
        if self.cfg.anneal_lr:
            frac = 1.0 - self.step / self.total_steps
            for g in self.optimizer.param_groups:
                g["lr"] = frac * self.cfg.lr
        flat = {
            k: b[k].reshape(-1, *b[k].shape[2:])
            for k in ("obs", "actions", "logprobs", "values", "advantages", "returns")
        }
        n = flat["logprobs"].shape[0]  # T * N of this rank
        # each rank takes num_minibatches steps per epoch: DDP then averages gradients over ranks,
        # so a step sees (ranks x mb_size) samples, as one rank would with the whole batch
        mb_size = max(1, n // a.num_minibatches)
        sums: dict[str, float] = {}
        count, epochs_run = 0, 0
        for _ in range(a.update_epochs):
            perm = torch.randperm(n, generator=self.generator)
            for start in range(0, n - mb_size + 1, mb_size):
                idx = perm[start : start + mb_size]
                metrics = self._train_minibatch({k: v[idx] for k, v in flat.items()})
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
            epochs_run += 1
            if a.target_kl is not None and self._mean_over_ranks(metrics["approx_kl"]) > a.target_kl:
                break
        self.step += 1
        out = {k: v / max(count, 1) for k, v in sums.items()}
        out.update(epochs=epochs_run, lr=self.optimizer.param_groups[0]["lr"])
        with torch.no_grad():
            var = b["returns"].var()
            out["explained_variance"] = (
                float("nan") if var == 0 else float(1 - (b["returns"] - b["values"]).var() / var)
            )
        return out

    def _train_minibatch(self, mb: dict) -> dict:
        logprob, entropy, value = self.model(mb["obs"], mb["actions"])  # (M,), (M,), (M,)
        a = self.algo
        loss, metrics = self.loss_fn(
            logprobs=logprob, old_logprobs=mb["logprobs"], advantages=mb["advantages"], values=value,
            old_values=mb["values"], returns=mb["returns"], entropy=entropy, clip_coef=a.clip_coef,
            vf_coef=a.vf_coef, ent_coef=a.ent_coef, clip_vloss=a.clip_vloss, norm_adv=a.norm_adv,
        )  # fmt: skip
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"non-finite loss {loss.item()} at training step {self.step}; metrics {metrics}"
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.policy.parameters(), a.max_grad_norm)
        self.optimizer.step()
        metrics["loss"] = float(loss.detach())
        return metrics

"""SAC's learner: the policy, twin Q-networks and their targets, the entropy coefficient and three Adam optimizers,
with one gradient step per :meth:`SACLearner.update` (CleanRL's ``sac_continuous_action.py`` and ``sac_atari.py``;
SB3's defaults). Continuous actions (a box) or discrete ones, chosen by the action space. A plain class: it works
in-process, and placing it on a slot is ``SACLearner.launch``."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch

from rlnb.algorithms import sac
from rlnb.components.launch import launcher
from rlnb.errors import ConfigError
from rlnb.models.sac import CategoricalActor, SquashedGaussianActor, TwinQ, flat_dim, target_copy


class SACLearner:
    """Args (SB3's defaults):
    obs_space, action_space: one env's spaces (a 1-D box of observations; a bounded box or discrete actions).
    lr: Adam's learning rate of the policy, the Q-networks and the entropy coefficient (SB3: 3e-4).
    tau: Polyak averaging of the targets a step (0.005). The discount is each transition's own ``discount``
    (``gamma^n``, from the :class:`~rlnb.components.replay.ReplayBuffer`'s ``gamma`` and ``n_step``).
    alpha: a fixed entropy coefficient, or ``None`` to tune it towards ``target_entropy`` (SB3's ``auto``).
    target_entropy: ``None``: ``-dim(A)`` (continuous), 0.89 ``log K`` (discrete).
    hidden: the MLPs' hidden widths ([256, 256]). policy_delay: policy (and alpha) steps every this many Q steps
    (CleanRL's ``policy_frequency``; 1 for SB3). target_every: target updates every this many Q steps.
    """

    launch = launcher("learner")

    def __init__(self, obs_space: gym.Space, action_space: gym.Space, lr: float = 3e-4,
                 tau: float = 0.005, alpha: float | None = None, target_entropy: float | None = None,
                 hidden: tuple[int, ...] = (256, 256), policy_delay: int = 1, target_every: int = 1,
                 seed: int = 0, device: str = "cpu", torch_threads: int | None = None):  # fmt: skip
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.device = torch.device(device)
        torch.manual_seed(seed)
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        obs_dim = flat_dim(obs_space, "env.observation_space")
        if self.discrete:
            self.policy = CategoricalActor(obs_dim, int(action_space.n), hidden)
        elif isinstance(action_space, gym.spaces.Box):
            self.policy = SquashedGaussianActor(obs_dim, action_space, hidden)
        else:
            raise ConfigError(f"env.id: SAC takes a box or discrete actions; got {action_space}", "env.id")
        self.q = TwinQ(obs_dim, action_space, hidden)
        self.policy.to(self.device)
        self.q.to(self.device)
        self.q_target = target_copy(self.q)
        self.tau, self.policy_delay, self.target_every = float(tau), policy_delay, target_every
        self.auto_alpha = alpha is None
        self.target_entropy = (
            sac.target_entropy(action_space) if target_entropy is None else float(target_entropy)
        )
        self.log_alpha = torch.zeros((), device=self.device, requires_grad=self.auto_alpha)
        if not self.auto_alpha:
            self.log_alpha.data.fill_(float(np.log(alpha)))
        self.q_opt = torch.optim.Adam(self.q.parameters(), lr=lr)
        self.policy_opt = torch.optim.Adam(self.policy.parameters(), lr=lr)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=lr) if self.auto_alpha else None
        self.updates = 0

    @property
    def alpha(self) -> torch.Tensor:
        return self.log_alpha.detach().exp()

    # ------------------------------------------------------------------ acting
    @torch.no_grad()
    def act(self, obs, deterministic: bool = False) -> np.ndarray:
        """Actions for observations ``[N, D]`` (sampled, or the policy's mode)."""
        o = torch.as_tensor(np.asarray(obs), dtype=torch.float32, device=self.device)
        if deterministic:
            a = self.policy.deterministic(o)
        elif self.discrete:
            a = self.policy.sample(o)
        else:
            a, _ = self.policy.sample(o)
        return a.cpu().numpy()

    # ------------------------------------------------------------------ learning
    def update(self, batch: dict) -> dict:
        """One gradient step of the Q-networks on a sampled ``batch`` (:meth:`ReplayBuffer.sample`), of the policy
        and alpha every ``policy_delay`` of them, the targets every ``target_every``. Returns float metrics."""
        b = {k: v.to(self.device) for k, v in batch.items()}
        obs, next_obs = b["obs"].float(), b["next_obs"].float()
        alpha = self.alpha
        with torch.no_grad():
            if self.discrete:
                probs, logp = self.policy.probs_logp(next_obs)
                nq1, nq2 = self.q_target(next_obs)
                y = sac.discrete_soft_target(b["rewards"], b["terminated"], b["discount"], nq1, nq2, probs, logp,
                                             alpha)  # fmt: skip
            else:
                na, nlogp = self.policy.sample(next_obs)
                nq1, nq2 = self.q_target(next_obs, na)
                y = sac.soft_target(b["rewards"], b["terminated"], b["discount"], nq1, nq2, nlogp, alpha)
        if self.discrete:
            q1_all, q2_all = self.q(obs)
            a = b["actions"].long()[:, None]
            q1, q2 = q1_all.gather(1, a).squeeze(1), q2_all.gather(1, a).squeeze(1)
        else:
            q1, q2 = self.q(obs, b["actions"].float())
        loss, metrics = sac.q_loss(q1, q2, y)
        self.q_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.q_opt.step()
        self.updates += 1
        if self.updates % self.policy_delay == 0:
            for _ in range(self.policy_delay):  # (CleanRL: as many policy steps as Q steps skipped)
                metrics.update(self._policy_step(obs))
        if self.updates % self.target_every == 0:
            sac.polyak_(self.q_target, self.q, self.tau)
        return {k: float(v) for k, v in metrics.items()}

    def _policy_step(self, obs: torch.Tensor) -> dict:
        alpha = self.alpha
        for p in self.q.parameters():  # (the policy's loss moves the policy only)
            p.requires_grad_(False)
        try:
            if self.discrete:
                probs, logp = self.policy.probs_logp(obs)
                q1, q2 = self.q(obs)
                loss, metrics = sac.discrete_actor_loss(probs, logp, q1, q2, alpha)
            else:
                a, logp = self.policy.sample(obs)
                q1, q2 = self.q(obs, a)
                loss, metrics = sac.actor_loss(logp, q1, q2, alpha)
        finally:
            for p in self.q.parameters():
                p.requires_grad_(True)
        self.policy_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.policy_opt.step()
        if self.auto_alpha:
            if self.discrete:
                a_loss, a_metrics = sac.discrete_alpha_loss(self.log_alpha, probs, logp, self.target_entropy)
            else:
                a_loss, a_metrics = sac.alpha_loss(self.log_alpha, logp, self.target_entropy)
            self.alpha_opt.zero_grad(set_to_none=True)
            a_loss.backward()
            self.alpha_opt.step()
            metrics.update(a_metrics)
        else:
            metrics["alpha"] = alpha
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {
            "policy": self.policy.state_dict(), "q": self.q.state_dict(), "q_target": self.q_target.state_dict(),
            "log_alpha": self.log_alpha.detach().clone(), "q_opt": self.q_opt.state_dict(),
            "policy_opt": self.policy_opt.state_dict(),
            "alpha_opt": self.alpha_opt.state_dict() if self.alpha_opt is not None else None,
            "updates": self.updates, "torch_rng": torch.get_rng_state(),
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state["policy"])
        self.q.load_state_dict(state["q"])
        self.q_target.load_state_dict(state["q_target"])
        self.log_alpha.data.copy_(state["log_alpha"])
        self.q_opt.load_state_dict(state["q_opt"])
        self.policy_opt.load_state_dict(state["policy_opt"])
        if self.alpha_opt is not None and state["alpha_opt"] is not None:
            self.alpha_opt.load_state_dict(state["alpha_opt"])
        self.updates = int(state["updates"])
        torch.set_rng_state(state["torch_rng"])


__all__ = ["SACLearner"]

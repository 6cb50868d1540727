"""SAC's learner: the policy, twin Q-networks and their targets, the entropy coefficient and three Adam optimizers,
with one gradient step per :meth:`SACLearner.update` (CleanRL's ``sac_continuous_action.py`` and ``sac_atari.py``;
SB3's defaults). Continuous actions (a box) or discrete ones, chosen by the action space. A plain class: it works
in-process, and placing it on a slot is ``SACLearner.launch``."""

from __future__ import annotations

import time
import typing

import gymnasium as gym
import numpy as np
import torch

from rlnb.algorithms import sac
from rlnb.components.env import Env
from rlnb.components.launch import launcher
from rlnb.components.rollout import CollectsShares, RolloutBase
from rlnb.config.sections_sac import SACKernel, batch_over_warm_up
from rlnb.errors import ConfigError
from rlnb.models.sac import TwinQ, agent_weights, flat_dim, make_policy, target_copy
from rlnb.runtime.rank import current_rank, local_peer
from rlnb.seeding import rank_seed

KERNELS = typing.get_args(SACKernel)


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
    kernel: ``autograd``, or ``fused`` (continuous actions): the same update with its gradients written out, over
    flat parameters (:class:`rlnb.components.sac_fused.FusedSAC`).
    """

    launch = launcher("learner")

    def __init__(self, obs_space: gym.Space, action_space: gym.Space, lr: float = 3e-4,
                 tau: float = 0.005, alpha: float | None = None, target_entropy: float | None = None,
                 hidden: tuple[int, ...] = (256, 256), policy_delay: int = 1, target_every: int = 1,
                 seed: int = 0, device: str = "cpu", torch_threads: int | None = None,
                 kernel: str = "autograd"):  # fmt: skip
        if kernel not in KERNELS:
            raise ConfigError(
                f"sac.kernel: expected one of {', '.join(KERNELS)}, got {kernel!r}", "sac.kernel"
            )
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.device = torch.device(device)
        torch.manual_seed(seed)
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        self.policy = make_policy(obs_space, action_space, hidden)
        self.q = TwinQ(flat_dim(obs_space, "env.observation_space"), action_space, hidden)
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
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=lr) if self.auto_alpha else None
        self.updates = 0
        self.kernel, self.fused = kernel, None
        if kernel == "fused":
            if (misfit := variant_misfit("auto", action_space, kernel)) is not None:
                raise ConfigError(misfit[1], misfit[0])
            from rlnb.components.sac_fused import FusedSAC

            self.fused = FusedSAC(self, lr)  # (it builds the Q and policy optimizers, over flat parameters)
        else:
            self.q_opt = torch.optim.Adam(self.q.parameters(), lr=lr)
            self.policy_opt = torch.optim.Adam(self.policy.parameters(), lr=lr)

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
            a = self.policy.act(o)
        return a.cpu().numpy()

    # ------------------------------------------------------------------ learning
    def update(self, batch: dict) -> dict:
        """One gradient step of the Q-networks on a sampled ``batch`` (:meth:`ReplayBuffer.sample`), of the policy
        and alpha every ``policy_delay`` of them, the targets every ``target_every``. Returns float metrics."""
        b = {k: v.to(self.device) for k, v in batch.items()}
        if self.fused is not None:
            return self.fused.update(b)
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
            "updates": self.updates, "torch_rng": torch.get_rng_state(), "kernel": self.kernel,
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        written = state.get("kernel", "autograd")
        if written != self.kernel:  # (their optimizers hold one state a parameter, or one a flat tensor)
            raise ConfigError(
                f"sac.kernel: this checkpoint was written by the {written} update and this learner runs the "
                f"{self.kernel} one; resume with sac.kernel={written}",
                "sac.kernel",
            )
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


def variant_misfit(variant: str, action_space: gym.Space, kernel: str = "autograd") -> tuple[str, str] | None:
    """The key (``sac.variant``, or else ``sac.kernel``) that cannot take ``action_space``, and why (``None``:
    both can)."""
    discrete = isinstance(action_space, gym.spaces.Discrete)
    if variant == "discrete" and not discrete:
        return (
            "sac.variant",
            f"sac.variant: discrete SAC picks one of K actions, and this env's actions are {action_space}; use continuous (or auto)",
        )
    if variant == "continuous" and discrete:
        return (
            "sac.variant",
            f"sac.variant: continuous SAC squashes a Gaussian into a box, and this env's actions are {action_space}; use discrete (or auto)",
        )
    if kernel == "fused" and discrete:
        return "sac.kernel", (
            f"sac.kernel: the fused update is written for continuous actions, and this env's are {action_space}; "
            "use sac.kernel=autograd"
        )
    return None


class SACActor:
    """SAC's learner as a loop's ``actor``: a :class:`SACLearner` built once the env's spaces are known
    (:meth:`bind_spaces`), training on the replay buffer placed on its slot (:meth:`attach_buffer`, in-process).

    Each batch of transitions the collectors hand over (:meth:`set_batch`) goes into the buffer; each
    :meth:`train` then makes ``utd_ratio`` gradient updates for every transition added since the last, once
    the buffer has seen ``learning_starts`` of them (none before: SB3's warm-up).

    Args: the :class:`rlnb.config.SACConfig` settings by name (``variant``, ``lr``, ``batch_size``,
    ``learning_starts``, ``utd_ratio``, ``tau``, ``alpha``, ``target_entropy``, ``hidden_sizes``, ``policy_delay``,
    ``target_every``, ``kernel``), ``seed``, ``device``, ``torch_threads``.
    """

    launch = launcher("actor")

    def __init__(self, variant: str = "auto", lr: float = 3e-4, batch_size: int = 256, learning_starts: int = 1000,
                 utd_ratio: float = 1.0, tau: float = 0.005, alpha: float | None = None,
                 target_entropy: float | None = None, hidden_sizes=(256, 256), policy_delay: int = 1,
                 target_every: int = 1, seed: int = 0, device: str = "cpu", torch_threads: int = 1,
                 kernel: str = "autograd"):  # fmt: skip
        if not isinstance(utd_ratio, (int, float)) or isinstance(utd_ratio, bool) or not utd_ratio > 0:
            raise ConfigError(
                f"sac.utd_ratio: expected updates per transition > 0, got {utd_ratio!r}", "sac.utd_ratio"
            )
        misfit = batch_over_warm_up(batch_size, learning_starts)
        if misfit:
            raise ConfigError(misfit, "sac.batch_size")
        self.settings = {
            "variant": variant, "lr": lr, "batch_size": batch_size, "learning_starts": learning_starts,
            "utd_ratio": float(utd_ratio), "tau": tau, "alpha": alpha, "target_entropy": target_entropy,
            "hidden_sizes": list(hidden_sizes), "policy_delay": policy_delay, "target_every": target_every,
            "kernel": kernel,
        }  # fmt: skip
        info = current_rank()
        self.rank = info.rank if info is not None else 0
        self.seed, self.torch_threads = seed, torch_threads
        self.device = (
            "cuda"
            if device == "auto" and torch.cuda.is_available()
            else ("cpu" if device == "auto" else device)
        )
        self.learner: SACLearner | None = None
        self.buffer_name: str | None = None
        self.owed = 0.0  # updates owed but not made yet (a fraction of one carried over)

    def bind_spaces(self, obs_space: gym.Space, action_space: gym.Space) -> dict:
        """Build the learner for one env's spaces; a variant those actions do not fit is refused."""
        s = self.settings
        misfit = variant_misfit(s["variant"], action_space, s["kernel"])
        if misfit is not None:
            raise ConfigError(misfit[1], misfit[0])
        self.learner = SACLearner(
            obs_space, action_space, lr=s["lr"], tau=s["tau"], alpha=s["alpha"], target_entropy=s["target_entropy"],
            hidden=tuple(s["hidden_sizes"]), policy_delay=s["policy_delay"], target_every=s["target_every"],
            seed=rank_seed(self.seed, self.rank, "actor"), device=self.device, torch_threads=self.torch_threads,
            kernel=s["kernel"],
        )  # fmt: skip
        return {}

    def attach_buffer(self, name: str) -> int:
        """The replay buffer group ``name``, whose rank on this slot the learner fills and samples in-process."""
        local_peer(name, self.rank)  # (refused here, naming it, if it is not on this slot)
        self.buffer_name = name
        return len(self.buffer)

    @property
    def buffer(self):
        return local_peer(self.buffer_name, self.rank)

    def describe(self) -> dict:
        return {"sac": dict(self.settings)}

    def set_total_steps(self, total_steps: int) -> int:
        """The run's length (a loop sets it); SAC's learning rate is constant, so nothing depends on it."""
        return max(1, int(total_steps))

    # ------------------------------------------------------------------ batches
    def set_batch(self, batches: list[dict]) -> dict:
        """Transitions ``[T, N, ...]`` of one or more collectors (joined along the env axis), time step by time
        step into the buffer (each env's n-step sums stay its own)."""
        if len(batches) == 1:
            b = batches[0]
        else:
            b = {k: np.concatenate([x[k] for x in batches], axis=1) for k in TRANSITION_KEYS}
        buf, added = self.buffer, 0
        for t in range(len(b["rewards"])):
            added += buf.add(*(b[k][t] for k in TRANSITION_KEYS))
        self._owe(added)
        return {"transitions": added}

    def cut_envs(self, envs: list[int]) -> int:
        """An elastic run: the buffer's n-step sums in progress of ``envs`` end here (their share of the batch is
        stepped by other envs from now on); the transitions this stores. (Nothing to end with ``n_step=1``.)"""
        stored = self.buffer.cut(envs)
        self._owe(stored)
        return stored

    def _owe(self, added: int) -> None:
        buf = self.buffer
        if buf.added >= self.settings["learning_starts"]:  # (the warm-up's transitions owe no updates)
            counted = min(added, buf.added - self.settings["learning_starts"])
            self.owed += self.settings["utd_ratio"] * max(counted, 0)

    def take_local_batches(self, rollout: str, ranks: list[int]) -> dict:
        """Collocated hand-off: the batches of collector ranks in this process."""
        return self.set_batch([local_peer(rollout, r).take_batch() for r in ranks])

    def take_channel_batches(self, channel, keys: list[str]) -> dict:
        """Apart: one batch per key from a channel."""
        return self.set_batch([channel.get(key=k) for k in keys])

    def compute_advantages(self) -> dict:
        """Nothing to estimate: SAC's targets are computed inside each update."""
        return {}

    # ------------------------------------------------------------------ training
    def train(self) -> dict:
        """The updates owed (``utd_ratio`` a transition added since the last call), each on a fresh batch of
        ``batch_size`` transitions sampled from the buffer; their mean metrics, ``updates`` made and
        ``compute_s`` (the updates alone)."""
        n = int(self.owed)
        self.owed -= n
        t0 = time.perf_counter()
        sums: dict[str, float] = {}
        buf, learner, size = self.buffer, self.learner, self.settings["batch_size"]
        for _ in range(n):
            for k, v in learner.update(buf.sample(size)).items():
                sums[k] = sums.get(k, 0.0) + v
        out = {k: v / n for k, v in sums.items()}
        out.update(updates=n, updates_total=learner.updates, buffer_size=len(buf), alpha=float(learner.alpha),
                   compute_s=time.perf_counter() - t0)  # fmt: skip
        return out

    # ------------------------------------------------------------------ weights
    def policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's weights for the collectors (a detached copy)."""
        return {k: v.detach().clone() for k, v in self.learner.policy.state_dict().items()}

    def agent_state(self) -> dict[str, torch.Tensor]:
        """The policy's and the Q-networks' weights (:class:`rlnb.models.sac.SACPolicy`'s, what an export holds)."""
        return agent_weights(self.learner.policy.state_dict(), self.learner.q.state_dict())

    def publish_weights(self, channel, keys: list[str], version: int) -> int:
        """Apart: the policy's weights once per collector key."""
        state = {k: v.cpu() for k, v in self.policy_state().items()}
        for k in keys:
            channel.put({"state": state, "version": version}, key=k)
        return version

    def act(self, obs, deterministic: bool = True) -> np.ndarray:
        return self.learner.act(obs, deterministic)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"learner": self.learner.state_dict(), "owed": self.owed}

    def load_state_dict(self, state: dict) -> None:
        self.learner.load_state_dict(state["learner"])
        self.owed = float(state["owed"])


TRANSITION_KEYS = (
    "obs",
    "actions",
    "rewards",
    "terminated",
    "truncated",
    "next_obs",
)  # ReplayBuffer.add's order


class SACCollector(CollectsShares, RolloutBase):
    """SAC's collector as a loop's ``rollout``: the policy (synced from the learner) stepping the env rank on its
    slot in-process, uniformly random actions for its share of ``learning_starts`` first (SB3's warm-up). Each
    :meth:`collect` keeps ``steps`` transitions of every env ``[T, N, ...]`` as its batch: ``obs``, ``actions``,
    ``rewards``, ``terminated`` and ``truncated`` apart, and ``next_obs`` (an ended episode's real last
    observation, not the reset one).

    Args:
        hidden_sizes: the policy's hidden widths (the learner's).
        random_steps: env steps (over its envs) of random actions this rank takes first.
        seed, torch_threads: as every component's.
    """

    launch = launcher("rollout")

    def __init__(self, hidden_sizes=(256, 256), random_steps: int = 0, seed: int = 0, torch_threads: int = 1):
        info = current_rank()
        self.rank = info.rank if info is not None else 0
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.hidden = tuple(hidden_sizes)
        self.random_left = int(random_steps)
        seed = rank_seed(seed, self.rank, "rollout")
        self.generator = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.policy: torch.nn.Module | None = None
        self.version = 0

    def bind_spaces(self, obs_space: gym.Space, action_space: gym.Space) -> dict:
        self.spaces = (obs_space, action_space)
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        self.policy = make_policy(obs_space, action_space, self.hidden).eval()
        return {}

    def load_weights(self, state_dict: dict, version: int) -> int:
        self.policy.load_state_dict(state_dict)
        self.version = version
        return version

    def warm_up_left(self, steps: int) -> int:
        """Random env steps left to take (an elastic run's joining collector: the warm-up the others have left,
        not a whole one of its own); returns it."""
        self.random_left = min(self.random_left, max(0, int(steps)))
        return self.random_left

    @torch.no_grad()
    def actions(self, obs: np.ndarray, deterministic: bool = False) -> np.ndarray:
        """Actions for observations ``[N, D]``: random during the warm-up, else the policy's (sampled, or its
        mode)."""
        n = len(obs)
        if not deterministic and self.random_left > 0:
            self.random_left -= n
            space = self.spaces[1]
            if self.discrete:
                return self.rng.integers(0, int(space.n), size=n)
            return self.rng.uniform(space.low, space.high, size=(n, *space.shape)).astype(space.dtype)
        o = torch.as_tensor(obs, dtype=torch.float32)
        if deterministic:
            return self.policy.deterministic(o).numpy()
        if self.discrete:
            return self.policy.sample(o, self.generator).numpy()
        return self.policy.act(o, self.generator).numpy()

    def collect(self, steps: int, env: str, actor: str | None = None) -> dict:
        """Step the env rank in this process ``steps`` times; with ``actor``, hand the transitions to that
        learner rank in this process. Returns the summary (``steps``, ``version``, ``env_s``, ``inference_s``,
        the env's finished ``episodes``)."""
        env_obj = local_peer(env, self.rank)
        if env_obj.stages != 1:
            raise ConfigError(f"env.pipeline_stages: SAC's collectors step one stage, got {env_obj.stages}",
                              "env.pipeline_stages")  # fmt: skip
        obs = env_obj.current_obs()[0]
        cols: dict[str, list] = {k: [] for k in TRANSITION_KEYS}
        env_obj.pop_sim_s()
        inference_s = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            a = self.actions(obs)
            inference_s += time.perf_counter() - t0
            out = env_obj.step(0, a)
            nxt = out["obs"]
            if len(out["final_idx"]):  # truncated episodes: their real last observation, for bootstrapping
                nxt = nxt.copy()
                nxt[out["final_idx"]] = out["final_obs"]
            for k, v in zip(
                TRANSITION_KEYS, (obs, a, out["reward"], out["terminated"], out["truncated"], nxt)
            ):
                cols[k].append(v)
            obs = out["obs"]
        self.batch = {k: np.stack(v) for k, v in cols.items()}
        self.batch["version"] = self.version
        summary = {"steps": steps * len(obs), "version": self.version, "env_s": env_obj.pop_sim_s(),
                   "inference_s": inference_s, "episodes": env_obj.pop_episodes()}  # fmt: skip
        if actor is not None:
            local_peer(actor, self.rank).set_batch([self.batch])
        return summary

    def evaluate(self, env_spec: dict, episodes: int, seed: int) -> dict:
        """Deterministic episodes on fresh envs built from ``env_spec`` (:meth:`Env.spec`)."""
        env = Env(env_spec["config"], seed=seed, make_env=env_spec.get("make_env"), num_envs=min(episodes, 8),
                  pipeline_stages=1)  # fmt: skip
        try:
            return env.run_episodes(lambda obs: self.actions(obs, deterministic=True), episodes)
        finally:
            env.close()

    def sample(self, n: int = 4) -> dict:
        """The first ``n`` time steps of the last batch (``[n, N, ...]``)."""
        return {k: v[:n] for k, v in (self.batch or {}).items() if k != "version"}

    def state_dict(self) -> dict:
        return {"policy": self.policy.state_dict(), "version": self.version, "random_left": self.random_left,
                "generator": self.generator.get_state(), "rng": self.rng.bit_generator.state}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state["policy"])
        self.version, self.random_left = int(state["version"]), int(state["random_left"])
        self.generator.set_state(state["generator"])
        self.rng.bit_generator.state = state["rng"]


__all__ = ["SACActor", "SACCollector", "SACLearner"]

"""Rollout component for MLP/CNN policies: runs the policy on observations and records trajectories.

Batch layout (all tensors, T = steps, N = envs of the rank)::

    obs [T, N, *obs_shape]  actions [T, N, *act_shape]  logprobs [T, N]  values [T, N]
    rewards [T, N]  (truncated steps already include gamma * V(final_obs))
    dones [T, N]    (1 where the episode ended at t: terminated or truncated)
    last_values [N] version (policy version that produced it)
"""

from __future__ import annotations

import contextlib
import time

import gymnasium as gym
import numpy as np
import torch

from rlnb.components.env import Env
from rlnb.components.fused import FusedAct, fused_act
from rlnb.components.launch import launcher
from rlnb.envs.obs import layout_of
from rlnb.models.policies import make_policy
from rlnb.runtime.collective import broadcast_state_dict
from rlnb.runtime.rank import RankInfo, current_rank, local_peer, process_group
from rlnb.seeding import rank_seed


def resolve_device(device: str, rank_info: RankInfo | None) -> torch.device:
    """``auto`` -> the rank's slot device (``cuda:0`` under dask-cuda, else ``cpu``)."""
    if device == "auto":
        device = rank_info.device if rank_info else ("cuda:0" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class _Trajectory:
    """A collection's records, ``[T, n, ...]`` per stage, side by side along N in the batch.

    Numpy records (the observations, rewards and done flags of an env on the host) are copied at once into
    their buffers: an env that reuses its arrays cannot change what was recorded, and nothing is stacked at the
    end. Tensor records (the policy's outputs, a GPU simulator's observations) are kept and stacked at the end,
    one op per column.
    """

    def __init__(self, steps: int, stages: int):
        self.steps = steps
        self.obs: list = [None] * stages  # per stage: a numpy buffer [T, n, ...] or a list of tensors
        # per stage: the actions, log-probs and values of each step, a list each
        self.acted: list[tuple[list, list, list]] = [([], [], []) for _ in range(stages)]
        self.rewards: list = [None] * stages  # per stage: float32 [T, n]
        self.dones: list = [None] * stages  # per stage: float32 [T, n], 1.0 where an episode ended
        self.held: list = [None] * stages  # per stage: bool [T, n] once its env said which steps were held

    def act(self, stage: int, t: int, obs, actions, logprobs, values) -> None:
        """Record what the policy saw and did at step ``t`` (a stage's steps in order)."""
        buffer = self.obs[stage]
        if buffer is None:  # (the stage's first step)
            buffer = self.obs[stage] = (
                np.empty((self.steps, *obs.shape), obs.dtype) if type(obs) is np.ndarray else []
            )
        if type(buffer) is np.ndarray:
            buffer[t] = obs
        else:
            buffer.append(torch.as_tensor(obs))
        acted = self.acted[stage]
        acted[0].append(actions)
        acted[1].append(logprobs)
        acted[2].append(values)

    def outcome(self, stage: int, t: int, reward: np.ndarray, done: np.ndarray, held=None) -> None:
        """Record step ``t``'s rewards and done flags (terminated or truncated), and which of its steps were held
        (``held [n]``, where the env says)."""
        rewards = self.rewards[stage]
        if rewards is None:
            rewards = self.rewards[stage] = np.empty((self.steps, len(reward)), np.float32)
            self.dones[stage] = np.empty((self.steps, len(reward)), np.float32)
        rewards[t] = reward
        self.dones[stage][t] = done
        if held is not None:
            self.record_held(stage, t, held)

    def record_held(self, stage: int, t: int, held: np.ndarray) -> None:
        if self.held[stage] is None:
            self.held[stage] = np.zeros((self.steps, len(held)), np.bool_)
        self.held[stage][t] = held

    def batch(self) -> dict[str, torch.Tensor]:
        """Every column, ``[T, N, ...]`` (the stages side by side along N)."""
        stages = range(len(self.obs))
        acted = [[_stack(column) for column in self.acted[s]] for s in stages]
        columns = {
            "obs": [torch.from_numpy(o) if type(o) is np.ndarray else torch.stack(o) for o in self.obs],
            "actions": [a[0] for a in acted],
            "logprobs": [a[1] for a in acted],
            "values": [a[2] for a in acted],
            "rewards": [torch.from_numpy(self.rewards[s]) for s in stages],
            "dones": [torch.from_numpy(self.dones[s]) for s in stages],
        }
        if any(h is not None for h in self.held):  # 0.0 on held steps, left out of the loss (GroupedEpisodes)
            columns["loss_mask"] = [
                torch.ones(self.dones[s].shape) if h is None else torch.from_numpy(~h).float()
                for s, h in zip(stages, self.held)
            ]
        return {k: v[0] if len(v) == 1 else torch.cat(v, dim=1) for k, v in columns.items()}


def _stack(records: list | torch.Tensor) -> torch.Tensor:
    """``[T, n, ...]`` from a stage's records: tensors, or numpy arrays (a subclass's ``act`` may return those
    for log-probs and values); a column written whole (one ``[T, n, ...]`` tensor) as it is."""
    if isinstance(records, torch.Tensor):
        return records
    return torch.from_numpy(np.stack(records)) if isinstance(records[0], np.ndarray) else torch.stack(records)


def _parts(channel, key: str, first: dict):
    """The buckets of one version of a sharded actor's weights under ``key``, ``first`` (taken already) and those
    that follow it, to the last (``more`` false)."""
    msg = first
    yield msg["state"]
    while msg["more"]:
        msg = channel.get(key=key)
        if msg["version"] != first["version"]:
            raise RuntimeError(
                f"weights: a bucket of version {msg['version']} came among those of version {first['version']}"
            )
        if msg["state"]:
            yield msg["state"]


class RolloutBase:
    """What every rollout component shares: weight intake (in-process or by channel) and batch hand-off.

    A subclass implements ``load_weights(state_dict, version)`` and fills ``self.batch``.
    """

    version: int = 0
    batch: dict | None = None

    def load_from_local_actor(self, actor: str, rank: int, version: int) -> int:
        """Collocated weight sync: copy from the actor rank in this process (a memcpy, no transfer); from a
        sharded actor, bucket by bucket as its ranks gather them together."""
        peer = local_peer(actor, rank)
        if getattr(peer, "sharded", False):
            return self.load_weights_in_parts(peer.state_buckets(), version)
        return self.load_weights(peer.policy_state(), version)

    def load_from_channel(self, channel, key: str) -> int:
        """Disaggregated weight sync: take the weights the actor published under ``key`` (waiting for
        them); when several versions are queued (asynchronous mode), the newest. A sharded actor's come bucket
        by bucket, each loaded as it arrives."""
        msg = channel.get(key=key)
        if msg.get("more"):
            return self.load_weights_in_parts(_parts(channel, key, msg), msg["version"])
        return self._load_messages([msg, *self._queued(channel, key)])

    def load_message(self, msg: dict) -> int:
        """One weight-sync message: ``{"state", "version"}`` loaded whole (a subclass may take other kinds)."""
        return self.load_weights(msg["state"], msg["version"])

    def _load_messages(self, msgs: list[dict]) -> int:
        """Of several queued messages, the newest whole weights and, after them, the newest adapters-only one
        (an adapters message needs the base the whole one before it brought)."""
        plan: list[dict] = []
        for msg in msgs:
            plan = [*[m for m in plan if "adapters" not in m], msg] if "adapters" in msg else [msg]
        version = self.version
        for msg in plan:
            version = self.load_message(msg)
        return version

    def _queued(self, channel, key: str) -> list[dict]:
        """Every message queued under ``key`` now, without waiting (a sharded actor's buckets are loaded as they
        come, and leave the list)."""
        import queue

        msgs = []
        while True:
            try:
                msg = channel.get_nowait(key=key)
            except queue.Empty:
                return msgs
            if msg.get("more"):  # a sharded actor's buckets, the rest following: loaded as they arrive
                self.load_weights_in_parts(_parts(channel, key, msg), msg["version"])
                msgs = []  # (older ones are superseded)
            else:
                msgs.append(msg)

    def load_weights_in_parts(self, parts, version: int) -> int:
        """Weights that come in parts (a sharded actor's buckets, dicts of some of the tensors), then this is
        ``version``. Here the parts are joined and given to :meth:`load_weights`; the built-in LM rollouts
        load each part as it comes instead."""
        whole: dict = {}
        for part in parts:
            whole.update(part)
        return self.load_weights(whole, version)

    def receive_weights(self, version: int, group: str) -> int:
        """Collective weight sync: receive actor rank 0's weights over process group ``group`` (NCCL on
        GPUs: straight into this rank's GPU memory) and load them as ``version``."""
        module = self.weights_module()
        device = getattr(self, "device", None) or next(module.parameters()).device
        template = {k: torch.empty_like(v, device=device) for k, v in module.state_dict().items()}
        return self.load_weights(broadcast_state_dict(template, 0, process_group(group)), version)

    def weights_module(self) -> torch.nn.Module:
        """The module whose ``state_dict`` the actor's weights load into (a subclass may say otherwise)."""
        for name in ("policy", "model"):
            if isinstance(getattr(self, name, None), torch.nn.Module):
                return getattr(self, name)
        raise AttributeError(
            f"{type(self).__name__} has no torch module in .policy or .model; override weights_module() "
            "for rollout.weight_sync=broadcast"
        )

    def poll_weights(self, channel, key: str) -> int | None:
        """Without waiting: the newest weights queued under ``key`` loaded (older ones are dropped), their version;
        ``None`` when nothing is queued. Asynchronous generation calls it between chunks, so weights arrive while
        it runs. A sharded actor's buckets are loaded as they come."""
        before = self.version
        msgs = self._queued(channel, key)
        if msgs:
            return self._load_messages(msgs)
        return self.version if self.version != before else None

    def take_batch(self) -> dict:
        """The last collected batch (in-process hand-off to a collocated actor)."""
        return self.batch

    def put_batch(self, channel, key: str, shards: int = 1) -> int:
        """Send the last batch to actor ranks through a channel (worker to worker): whole under ``key``,
        or split into ``shards`` equal parts under ``key.0``, ``key.1``... (more actor than rollout ranks)."""
        self.put_shares(channel, [(key, shards)])
        return self.batch["version"]

    def put_shares(self, channel, puts: list[tuple[str, int]]) -> None:
        """The last batch in ``len(puts)`` equal parts, each put as :meth:`put_batch` puts a whole one under its
        ``(key, shards)`` (an elastic run's rank making several shares of a step's batch at once)."""
        parts = [self.batch] if len(puts) == 1 else self.split_batch(self.batch, len(puts))
        for (key, shards), part in zip(puts, parts):
            if shards == 1:
                channel.put(part, key=key)
            else:
                for j, piece in enumerate(self.split_batch(part, shards)):
                    channel.put(piece, key=f"{key}.{j}")

    @staticmethod
    def split_batch(batch: dict, shards: int) -> list[dict]:
        """``batch`` in ``shards`` equal parts along its sample axis (a subclass says which axis)."""
        raise NotImplementedError


class CollectsShares:
    """A mixin of the embodied collectors (:class:`PolicyRollout`, :class:`rlnb.components.SACCollector`): an
    elastic run's collection of several shares of a step's batch."""

    def collect_into(self, steps: int, env: str, channel, puts: list[tuple[str, int]]) -> list[dict]:
        """An elastic run's collection: one ``collect`` of ``steps`` per ``(key, shards)`` of ``puts`` (the
        shares of a step's batch this rank runs: its own, or a lost rank's), each batch put into ``channel``
        (:meth:`put_batch`) as soon as it is made. Their summaries, in order."""
        summaries = []
        for key, shards in puts:
            summaries.append(self.collect(steps, env))
            self.put_batch(channel, key, shards)
        return summaries


class PolicyRollout(CollectsShares, RolloutBase):
    """Runs an actor-critic policy: ``act``, ``collect`` (collocated env) or ``serve`` (env over channels).

    Args:
        model: :class:`rlnb.config.ModelConfig` (or dict) of the built-in policy (default ``ModelConfig()``).
        obs_space, act_space: gymnasium spaces of one env; without them the policy is built by
            :meth:`bind_spaces`, which a loop calls with its env's spaces.
        gamma: discount, for bootstrapping truncated episodes.
        seed: the run's seed; rank ``r`` samples from ``rlnb.seeding.rank_seed(seed, r, "rollout")``.
        policy: instead of ``model``, an ``nn.Module`` class or factory (see
            :func:`rlnb.models.make_policy`), e.g. defined in a notebook cell.

    Override :meth:`act` in a subclass to change how actions are chosen (e.g. exploration noise).
    """

    launch = launcher("rollout")
    _policy_act = None  # within a collection: the policy's act, fused where it can be (see _collecting)
    _fused_act = None  # the last collection's FusedAct, used again while the policy fits it
    _policy_value = None  # within a collection: the FusedAct's values, where it has one (see _collecting)

    def __init__(
        self,
        model=None,
        obs_space=None,
        act_space=None,
        gamma: float = 0.99,
        seed: int = 0,
        torch_threads: int = 1,
        device: str = "auto",
        rank_info: RankInfo | None = None,
        *,
        policy=None,
    ):
        rank_info = rank_info or current_rank()  # subclasses need not pass it on
        torch.set_num_threads(torch_threads)
        self.rank = rank_info.rank if rank_info else 0
        self.name = rank_info.component if rank_info else "rollout"
        self.device = resolve_device(device, rank_info)
        self.policy_spec = model if policy is None else policy
        self.policy = None
        self.layout = None  # dict observations: where their parts lie (bind_spaces)
        self.gamma = gamma
        self.seed = rank_seed(seed, self.rank, "rollout")
        self.generator = torch.Generator(self.device).manual_seed(self.seed)
        self.version = 0
        self.batch: dict | None = None
        self.stage_obs: dict[str, list] = {}  # channel mode: latest obs per env key and stage
        if obs_space is not None and act_space is not None:
            self.bind_spaces(obs_space, act_space)

    def bind_spaces(self, obs_space, act_space) -> dict:
        """Build the policy for these spaces (once; later calls keep it)."""
        if self.policy is None:
            self.policy = make_policy(self.policy_spec, obs_space, act_space, self.name).to(self.device)
            self.policy.requires_grad_(False)
            torch.manual_seed(self.seed)  # policies sampling from torch.distributions use the global RNG
        self.discrete = isinstance(act_space, gym.spaces.Discrete)
        self.layout = layout_of(obs_space)  # dict observations: where their parts lie
        # continuous actions are sampled unbounded (their log-prob is of that sample) and clipped for the env
        self.low = getattr(act_space, "low", None)
        self.high = getattr(act_space, "high", None)
        return {"policy": type(getattr(self.policy, "module", self.policy)).__name__}

    # ------------------------------------------------------------------ weights
    def load_weights(self, state_dict: dict, version: int) -> int:
        self.policy.load_state_dict(state_dict)
        self.version = version
        return version

    def load_from_local_actor(self, actor: str, rank: int, version: int) -> int:
        """Collocated weight sync. From the built-in actor into this class's own ``load_weights``: one
        ``torch._foreach_copy_`` over the two modules' tensors (far cheaper than through a cloned ``state_dict``
        for a small MLP), the same weights; otherwise :meth:`RolloutBase.load_from_local_actor`."""
        copy_into = getattr(local_peer(actor, rank), "copy_policy_into", None)
        if type(self).load_weights is PolicyRollout.load_weights and copy_into and copy_into(self.policy):
            self.version = version
            return version
        return super().load_from_local_actor(actor, rank, version)

    def act(self, obs, deterministic: bool = False):
        """``(actions [n, ...], logprobs [n], values [n])``, CPU tensors, for a batch of observations
        (a subclass may return log-probs and values as numpy arrays)."""
        obs_t = torch.as_tensor(obs, device=self.device)
        actions, logprob, value = (self._policy_act or self.policy.act)(obs_t, self.generator, deterministic)
        return actions.cpu(), logprob.cpu(), value.cpu()

    @contextlib.contextmanager
    def _collecting(self):
        """For one collection, ``act`` calls the policy through :func:`rlnb.components.fused.fused_act`:
        the built-in MLP policy's own kernels without its module calls, the same values bit for bit; its
        bootstrap and last values likewise."""
        self._policy_act = fused_act(self.policy, self._fused_act)
        self._fused_act = self._policy_act if isinstance(self._policy_act, FusedAct) else None
        self._policy_value = self._fused_act.value if self._fused_act is not None else None
        try:
            yield
        finally:
            self._policy_act = self._policy_value = None

    def _values(self, obs) -> torch.Tensor:
        """``value [n]`` of a batch of observations, a CPU tensor."""
        with torch.no_grad():
            return (self._policy_value or self.policy.value)(torch.as_tensor(obs, device=self.device)).cpu()

    def env_actions(self, actions: torch.Tensor) -> np.ndarray:
        a = actions.numpy()
        return np.clip(a, self.low, self.high) if self.low is not None and not self.discrete else a

    def _record_step(self, traj: _Trajectory, stage: int, t: int, out: dict) -> float:
        """Rewards/dones of step ``t``; truncated episodes get ``gamma * V(final_obs)`` added to their reward.
        Returns the seconds of that value forward (inference)."""
        done = out.get("done")
        if done is None:  # (an env's own step() that does not say)
            done = np.logical_or(out["terminated"], out["truncated"])
        traj.outcome(stage, t, out["reward"], done, out.get("held"))
        if out["final_obs"] is None or not len(out["final_idx"]):
            return 0.0
        return self._bootstrap(traj.rewards[stage][t], out)

    def _bootstrap(self, rewards: np.ndarray, out: dict) -> float:
        """Add ``gamma * V(final_obs)`` to the ``rewards [n]`` of a step's truncated episodes; the seconds of
        that value forward (inference)."""
        t0 = time.perf_counter()
        v = self._values(out["final_obs"]).numpy()
        seconds = time.perf_counter() - t0
        rewards[out["final_idx"]] += self.gamma * v
        return seconds

    def _check_batch_obs(self, source: str) -> None:
        """Refuse a collected batch whose observations hold NaN or inf (``source``'s: an env's overflow), before
        anything trains on them."""
        obs = self.batch["obs"]
        bad_part = self.layout.nonfinite(obs) if self.layout is not None else None
        if bad_part is not None:
            key, row = bad_part
            t, i = divmod(row, obs.shape[1])
            raise ValueError(
                f"env.id {source!r}: observations hold NaN or infinite values in their part {key!r} (first at step "
                f"{t} of this rollout, env {i})"
            )
        if obs.is_floating_point() and not bool(torch.isfinite(obs).all()):
            t, i = (int(x) for x in torch.nonzero(~torch.isfinite(obs))[0][:2])
            raise ValueError(
                f"env.id {source!r}: observations hold NaN or infinite values (first at step {t} of this rollout, "
                f"env {i}; a value beyond float32's range overflows to inf)"
            )

    def _finish(self, traj: _Trajectory, last_obs: list) -> tuple[dict, float]:
        """The batch (``self.batch``) and its summary, and the seconds of the last values' forward."""
        batch = traj.batch()
        t0 = time.perf_counter()
        values = [self._values(o) for o in last_obs]
        batch["last_values"] = values[0] if len(values) == 1 else torch.cat(values)
        seconds = time.perf_counter() - t0
        batch["version"] = self.version
        self.batch = batch
        summary = {
            "steps": int(batch["rewards"].numel()),
            "version": self.version,
            "reward_sum": float(batch["rewards"].sum()),
        }
        return summary, seconds

    def collect(self, steps: int, env: str, actor: str | None = None) -> dict:
        """Collocated rollout: step the env rank living in this process for ``steps`` steps.

        With ``actor``, also hand the batch to that collocated actor rank and return the env's
        finished episodes (``"episodes"``): the whole rollout phase in one call.
        """
        env_obj: Env = local_peer(env, self.rank)
        obs = env_obj.current_obs()
        try:
            summary = self._collect_from(env_obj, obs, steps)
        except (RuntimeError, ValueError):
            for stage_obs in env_obj.obs:  # observations the policy could not take: said naming the env
                env_obj.check_obs(stage_obs)
            raise
        if actor is not None:
            local_peer(actor, self.rank).set_batch([self.batch])
            summary["episodes"] = env_obj.pop_episodes()
        return summary

    def _collect_from(self, env_obj: Env, obs: list, steps: int) -> dict:
        """:meth:`collect`'s collection: the batch (``self.batch``) and its summary."""
        traj = _Trajectory(steps, env_obj.stages)
        env_obj.pop_sim_s()
        inference_s = 0.0  # every forward of the policy: actions, bootstrap values, last values
        perf_counter = time.perf_counter
        with self._collecting():
            act, env_step, record = self.act, env_obj.step, self._record_step
            # discrete actions of the built-in act() go to the env as their tensor's numpy view, as
            # env_actions() sends them, without its call
            plain = (
                type(self).act is PolicyRollout.act and type(self).env_actions is PolicyRollout.env_actions
            )
            env_actions = torch.Tensor.numpy if plain and self.discrete else self.env_actions
            if env_obj.stages == 1 and type(obs[0]) is np.ndarray and type(env_obj).step is Env.step:
                # the built-in act() through the fused kernels on the CPU: they sample into the batch's buffer
                into = self._fused_act is not None and plain and self.device.type == "cpu"
                inference_s = self._collect_host(traj, steps, obs, act, env_step, env_actions, into)
            else:
                stages = range(env_obj.stages)
                for t in range(steps):
                    for s in stages:
                        t0 = perf_counter()
                        actions, logprob, value = act(obs[s])
                        inference_s += perf_counter() - t0
                        traj.act(s, t, obs[s], actions, logprob, value)
                        out = env_step(s, env_actions(actions))
                        inference_s += record(traj, s, t, out)
                        obs[s] = out["obs"]
            summary, last_values_s = self._finish(traj, obs)
            self._check_batch_obs(env_obj.label)
        # the work, timed where it ran; the rest of the call is the loop's overhead
        summary.update(env_s=env_obj.pop_sim_s(), inference_s=inference_s + last_values_s)
        return summary

    def _collect_host(
        self, traj: _Trajectory, steps: int, obs: list, act, env_step, env_actions, into: bool
    ) -> float:
        """:meth:`collect`'s loop for the common case, one stage of host (numpy) observations stepped by
        :meth:`Env.step` itself: the same records, written straight into their buffers (a step's Python
        less than through :meth:`_Trajectory.act` and :meth:`_record_step`). Returns the seconds of inference.

        ``into``: the policy is the fused act (:meth:`FusedAct.into`) on the CPU. It then reads each step's
        observations from the batch's buffer and samples the actions into the batch's own, whose rows go to the
        env as they are: the same draws, without a tensor made from each observation and a numpy array from
        each action."""
        o = obs[0]
        n = len(o)
        obs_buf = traj.obs[0] = np.empty((steps, *o.shape), o.dtype)
        rewards = traj.rewards[0] = np.empty((steps, n), np.float32)
        dones = traj.dones[0] = np.empty((steps, n), np.float32)
        actions_taken, logprobs, values = traj.acted[0]
        bootstrap = self._bootstrap
        inference_s, perf_counter = 0.0, time.perf_counter
        if into:
            fused, generator = self._fused_act.into, self.generator
            taken = np.empty((steps, n, 1), np.int64)  # [T, n, 1]: multinomial's own shape
            taken_rows, obs_rows = torch.from_numpy(taken).unbind(0), torch.from_numpy(obs_buf).unbind(0)
        for t in range(steps):
            obs_buf[t] = o
            t0 = perf_counter()
            if into:
                logprob, value = fused(obs_rows[t], generator, taken_rows[t])
            else:
                actions, logprob, value = act(o)
            inference_s += perf_counter() - t0
            logprobs.append(logprob)
            values.append(value)
            if into:
                to_env = taken[t, :, 0]
            else:
                actions_taken.append(actions)
                to_env = env_actions(actions)
            out = env_step(0, to_env)
            rewards[t] = out["reward"]
            dones[t] = out["done"]
            if out["held"] is not None:
                traj.record_held(0, t, out["held"])
            if out["final_obs"] is not None:  # (Env.step gives them only for truncated episodes)
                inference_s += bootstrap(rewards[t], out)
            o = out["obs"]
        if into:  # (the actions' column written whole, [T, n])
            traj.acted[0] = (torch.from_numpy(taken).squeeze(-1), logprobs, values)
        obs[0] = o
        return inference_s

    def serve(self, steps: int, obs_channel, act_channel, env_keys: list[str], stages: int) -> dict:
        """Disaggregated/hybrid rollout: env ranks send observations through channels.

        For each step, stage by stage: act on the latest obs and put the actions, then take the
        step's result. While an env steps stage ``s``, this rank already infers stage ``s + 1``.
        """
        with self._collecting():
            return self._serve(steps, obs_channel, act_channel, env_keys, stages)

    def _serve(self, steps: int, obs_channel, act_channel, env_keys: list[str], stages: int) -> dict:
        keys = [f"{k}/{s}" for k in env_keys for s in range(stages)]
        for k in keys:
            if k not in self.stage_obs:
                self.stage_obs[k] = obs_channel.get(key=k)["obs"]
        traj = _Trajectory(steps, len(keys))
        inference_s, perf_counter = 0.0, time.perf_counter
        for t in range(steps):
            for i, k in enumerate(keys):
                if t > 0:
                    out = obs_channel.get(key=k)
                    self._record_step(traj, i, t - 1, out)
                    self.stage_obs[k] = out["obs"]
                obs = self.stage_obs[k]
                t0 = perf_counter()
                actions, logprob, value = self.act(obs)
                inference_s += perf_counter() - t0
                traj.act(i, t, obs, actions, logprob, value)
                act_channel.put(self.env_actions(actions), key=k)
        for i, k in enumerate(keys):
            out = obs_channel.get(key=k)
            self._record_step(traj, i, steps - 1, out)
            self.stage_obs[k] = out["obs"]
        summary, last_values_s = self._finish(traj, [self.stage_obs[k] for k in keys])
        self._check_batch_obs(f"env ranks {', '.join(keys)}")
        summary["inference_s"] = inference_s + last_values_s  # (what the env's stepping may overlap)
        return summary

    # ------------------------------------------------------------------ batch hand-off
    @staticmethod
    def split_batch(batch: dict, shards: int) -> list[dict]:
        """Split along the env axis: ``[T, N, ...]`` tensors on dim 1, ``last_values [N]`` on dim 0."""
        parts = [{"version": batch["version"]} for _ in range(shards)]
        for k, v in batch.items():
            if isinstance(v, torch.Tensor):
                for part, chunk in zip(parts, v.chunk(shards, dim=0 if k == "last_values" else 1)):
                    part[k] = chunk.contiguous()
        return parts

    def sample(self, n: int = 4) -> dict:
        """The first ``n`` steps of the last batch, small enough to look at in a notebook."""
        return {
            k: (v[:n].clone() if isinstance(v, torch.Tensor) and v.dim() > 1 else v)
            for k, v in (self.batch or {}).items()
        }

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, env_spec: dict, episodes: int, seed: int, obs_normalization=None) -> dict:
        """Deterministic episodes on fresh envs built from ``env_spec`` (:meth:`Env.spec`), ``episodes`` shared
        evenly over up to 8 of them (:meth:`Env.run_episodes`); returns ``return_mean``, ``return_std``,
        ``len_mean``. ``obs_normalization``: a training env's :meth:`Env.obs_normalization`, which these envs
        then normalise with, frozen."""
        env = Env(
            env_spec["config"],
            seed=seed,
            make_env=env_spec.get("make_env"),
            num_envs=min(episodes, 8),
            pipeline_stages=1,
        )
        if obs_normalization is not None:
            env.normalize_obs_with(obs_normalization)
        try:
            return env.run_episodes(
                lambda obs: self.env_actions(self.act(obs, deterministic=True)[0]), episodes
            )
        finally:
            env.close()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {
            "generator": self.generator.get_state(),
            "version": self.version,
            "stage_obs": self.stage_obs,
            "policy": self.policy.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.version, self.stage_obs = state["version"], state["stage_obs"]
        self.policy.load_state_dict(state["policy"])

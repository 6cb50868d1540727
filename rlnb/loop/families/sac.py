"""SAC: collectors (env and rollout ranks) fill a replay buffer that the learner (the actor rank) samples, at a set
update-to-data ratio (``sac.utd_ratio``).

One step collects ``rollout.steps_per_rollout`` env steps of every env with the collectors' policy version, adds the
transitions to the buffer and makes ``utd_ratio`` updates for each; the collectors take the learner's weights at the
start of a step, so weights are synced every ``utd_ratio x steps_per_rollout x envs`` updates. The schedule is
chosen as for every family: synchronous (``algorithm.max_staleness: 0``, one phase after another), or whole
batches ahead (``max_staleness >= 1``: the collectors, on slots of their own, collect the next batch while the
learner trains on this one, Ape-X's and RLinf's shape; the staleness is logged as ``rollout/staleness_*``).

Placement: env and rollout on the same slots (the collector steps its env rank in-process), the buffer on the
actor's slot (sampled in-process), one actor rank.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Protocol

from rlnb.components.env import Env
from rlnb.components.replay import ReplayBuffer, transition_bytes
from rlnb.components.sac import SACActor, SACCollector, variant_misfit
from rlnb.envs.gym_envs import probe_env
from rlnb.errors import ConfigError, PlacementError
from rlnb.loop.families.env import EnvFamily
from rlnb.loop.phase import Phase, count_or_default
from rlnb.loop.roles import ActorRole, EnvRole
from rlnb.models.sac import flat_dim

log = logging.getLogger("rlnb")


class CollectorRole(Protocol):
    """A collector rank (:class:`rlnb.components.SACCollector`): steps its env rank in-process with the policy."""

    def bind_spaces(self, obs_space, act_space) -> dict: ...
    def collect(self, steps: int, env: str, actor: str | None = None) -> dict: ...
    def load_weights(self, state_dict: dict, version: int) -> int: ...
    def load_from_local_actor(self, actor: str, rank: int, version: int) -> int: ...
    def load_from_channel(self, channel, key: str) -> int: ...
    def put_batch(self, channel, key: str, shards: int = 1) -> int: ...
    def take_batch(self) -> dict: ...
    def evaluate(self, env_spec: dict, episodes: int, seed: int) -> dict: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class BufferRole(Protocol):
    """A replay buffer rank (:class:`rlnb.components.ReplayBuffer`), on the learner's slot."""

    def add(self, obs, actions, rewards, terminated, truncated, next_obs) -> int: ...
    def sample(self, batch_size: int, device="cpu") -> dict: ...
    def peek(self, n: int, seed: int = 0) -> dict: ...
    def last(self, n: int) -> dict: ...
    def stats(self) -> dict: ...
    def describe(self) -> dict: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class LearnerRole(ActorRole, Protocol):
    """The learner rank (:class:`rlnb.components.SACActor`)."""

    def bind_spaces(self, obs_space, act_space) -> dict: ...
    def attach_buffer(self, name: str) -> int: ...
    def agent_state(self) -> dict: ...
    def cut_envs(self, envs: list[int]) -> int: ...
    def set_total_steps(self, total_steps: int) -> int: ...


class SAC(EnvFamily):
    """SAC's phases (see the module's docstring)."""

    name = "sac"
    ROLES = {
        "env": (EnvRole, "rlnb.Env"),
        "rollout": (CollectorRole, "rlnb.components.SACCollector"),
        "buffer": (BufferRole, "rlnb.components.ReplayBuffer"),
        "actor": (LearnerRole, "rlnb.components.SACActor"),
    }
    SUMMARY_KEYS = ("env/episode_return_mean", "train/q_loss", "train/alpha", "rollout/steps_per_s")
    _probed: tuple | None = None

    # ------------------------------------------------------------------ set-up
    @classmethod
    def check_layout(cls, slots) -> None:
        """The collector steps its env rank in-process, and the learner samples its buffer in-process."""
        for a, b, why in (("env", "rollout", "a collector steps its env rank in-process"),
                          ("buffer", "actor", "the learner samples the buffer in-process, a batch per update")):  # fmt: skip
            if sorted(slots[a]) != sorted(slots[b]):
                raise PlacementError(
                    f"component_placement: {a} {sorted(slots[a])} and {b} {sorted(slots[b])} must share their slots "
                    f"in family sac ({why}); place them together, e.g. {{'env,rollout': 0, 'actor,buffer': 1}}",
                    "component_placement",
                )

    def check_here(self) -> None:
        """One env built here: its spaces fit SAC (``sac.variant``), and the settings SAC cannot take."""
        r = self.session.recipe
        env = r.env
        for key, on in (
            ("env.normalize_obs", env.normalize_obs),
            ("env.normalize_reward", env.normalize_reward),
        ):
            if on:
                raise ConfigError(
                    f"{key}: the replay buffer keeps transitions for many updates, and running statistics that move "
                    "would make old ones mean something else; set it to false (SB3's SAC does not normalise)", key,
                )  # fmt: skip
        if env.pipeline_stages != 1:
            raise ConfigError(f"env.pipeline_stages: SAC's collectors step one stage, got {env.pipeline_stages}",
                              "env.pipeline_stages")  # fmt: skip
        spaces = probe_env(env.id, env.kwargs) if isinstance(env.id, str) else None
        if spaces is not None:
            flat_dim(spaces[0], "env.id")  # (an image or a dict of parts: refused here, not on a worker)
            misfit = variant_misfit(r.sac.variant, spaces[1], r.sac.kernel)
            if misfit is not None:
                raise ConfigError(misfit[1], misfit[0])
        self._probed = spaces

    def check_placement(self) -> None:
        p = self.session.placement
        self.check_layout(p.slots)
        if len(p["actor"]) != 1:
            raise PlacementError(
                f"component_placement: SAC's learner trains on one rank, got {len(p['actor'])} actor slots; place "
                "more collectors (env,rollout) instead", "component_placement",
            )  # fmt: skip
        if self._probed is not None:
            self.check_buffer_fits(transition_bytes(*self._probed))
        shared = sorted(set(p["rollout"]) & set(p["actor"]))
        if self.session.recipe.cluster.elastic and shared:
            raise PlacementError(
                f"cluster.elastic: collectors that come and go need slots apart from the learner's, whose slots stay "
                f"fixed; env and rollout share slot(s) {shared} with it (e.g. component_placement={{'actor,buffer': "
                "0, 'env,rollout': 1-2})", "cluster.elastic",
            )  # fmt: skip

    def check_buffer_fits(self, per_transition: int) -> None:
        """A buffer of ``buffer.capacity`` transitions fits its slot's memory (the worker's limit), else refused
        before launch."""
        b = self.session.recipe.buffer
        limit = self.buffer_limit_bytes()
        need = b.capacity * per_transition
        if limit and need > limit:
            raise PlacementError(
                f"buffer.capacity: {b.capacity:,} transitions of {per_transition} bytes take {need / 2**30:.2f} GiB, "
                f"more than the {limit / 2**30:.2f} GiB of memory its slot's worker has; lower buffer.capacity to "
                f"at most {limit // per_transition:,}, or place the actor and buffer on a bigger worker",
                "buffer.capacity",
            )

    def buffer_limit_bytes(self) -> int:
        """The memory limit of the buffer's worker (0: none known)."""
        s = self.session
        return s.cluster.slots[s.placement["buffer"][0]].memory_limit_bytes

    def launch(self) -> None:
        """The recipe path: the same public ``launch`` calls a notebook makes."""
        s = self.session
        r, cl, p = s.recipe, s.cluster, s.placement
        deadlines = r.cluster.deadlines()
        sac, b = r.sac, r.buffer
        if self._probed is None:
            raise ConfigError(
                f"env.id: family sac builds its buffer from the env's spaces, probed here; {r.env.id} could not be "
                "(a ManiSkill or batched simulator: build the components yourself, rlnb.SACLoop(env=..., ...))",
                "env.id",
            )
        n_env = len(p["env"])
        s.groups["env"] = Env.launch(
            cl, p["env"], config=r.env, seed=r.seed, gamma=r.algorithm.gamma, **deadlines
        )
        s.groups["rollout"] = SACCollector.launch(
            cl, p["rollout"], hidden_sizes=sac.hidden_sizes, random_steps=-(-sac.learning_starts // n_env),
            seed=r.seed, torch_threads=1, **deadlines,  # (one env step's inference: a thread more only contends)
        )  # fmt: skip
        s.groups["buffer"] = ReplayBuffer.launch(
            cl, p["buffer"], obs_space=self._probed[0], action_space=self._probed[1], capacity=b.capacity,
            num_envs=r.env.num_envs * n_env, n_step=b.n_step, gamma=r.algorithm.gamma,
            max_bytes=self.buffer_limit_bytes(), seed=r.seed, in_checkpoint=b.in_checkpoint, **deadlines,
        )  # fmt: skip
        s.groups["actor"] = SACActor.launch(
            cl, p["actor"], variant=sac.variant, lr=sac.lr, batch_size=sac.batch_size,
            learning_starts=sac.learning_starts, utd_ratio=sac.utd_ratio, tau=sac.tau, alpha=sac.alpha,
            target_entropy=sac.target_entropy, hidden_sizes=sac.hidden_sizes, policy_delay=sac.policy_delay,
            target_every=sac.target_every, seed=r.seed, device=r.actor.device, torch_threads=r.actor.torch_threads,
            kernel=sac.kernel, **deadlines,
        )  # fmt: skip

    def bind(self) -> None:
        """Both paths: the learner and the collectors take the env's spaces; the learner its buffer."""
        s = self.session
        env, rollout, buffer, actor = (s.groups[k] for k in self.ROLES)
        self.spaces = env.on(0).spaces().result()[0]
        self.env_spec = env.on(0).spec().result()[0]
        s.bind_checked([rollout.bind_spaces(*self.spaces), actor.bind_spaces(*self.spaces)])
        s.bind_checked([actor.attach_buffer(buffer.name)])

    def record_components(self) -> None:
        """Objects path: the recipe records the env, SAC's settings and the buffer's, and the placement."""
        import dataclasses

        from rlnb.config.sections_sac import BufferConfig, SACConfig

        s = self.session
        sac = s.groups["actor"].on(0).describe().result()[0]["sac"]
        buffer = s.groups["buffer"].on(0).describe().result()[0]
        s.recipe = dataclasses.replace(
            s.recipe, env=self.env_spec["config"], sac=SACConfig(**sac), buffer=BufferConfig(**buffer)
        )
        s.recipe.cluster.component_placement = {
            k: ",".join(map(str, v)) for k, v in s.placement.slots.items()
        }

    def compose(self, asynchronous: bool) -> None:
        super().compose(asynchronous)
        self.compose_ranks("rlnb.components.SACCollector")

    def prepare_joining(self, rank: int) -> None:
        """A joining collector takes the random warm-up the others have left (each launched with its part of
        ``sac.learning_starts``), not a whole one of its own."""
        s = self.session
        per_collector = -(-s.recipe.sac.learning_starts // len(self.ranks.shares))
        done = s.step * s.recipe.rollout.steps_per_rollout * s.recipe.env.num_envs
        s.groups["rollout"].on(rank).warm_up_left(per_collector - done).result()

    # ------------------------------------------------------------------ phases
    def start_ranks(self, T: int) -> list:
        s = self.session
        env, rollout = s.groups["env"], s.groups["rollout"]
        if (
            self.paths.batch_local
        ):  # collocated with the learner: the transitions go into its buffer in-process
            return [rollout.collect(T, env.name, s.groups["actor"].name)]
        return [rollout.collect(T, env.name)]

    def finish_collection(self, pending: list, batches: list | None = None) -> list[dict]:
        summaries = pending[0].result()
        for summary in summaries:
            self.episodes.extend(tuple(e) for e in summary.pop("episodes"))
        # a share stepped by other envs than its last batch's: its envs' n-step sums end before it is added
        n = self.session.recipe.env.num_envs
        cut = [k * n + i for k in self.ranks.broken_shares() for i in range(n)]
        if cut:
            self.session.groups["actor"].cut_envs(cut).result()
        # (collocated, the collectors put into the learner's buffer themselves)
        if not self.paths.batch_local:
            self.ranks.take(batches)
        return summaries

    def rollout_metrics(self, phase: Phase, summaries: list[dict], extra: dict) -> None:
        steps = sum(x["steps"] for x in summaries)
        self.global_step += steps
        out = {"steps": steps, "steps_per_s": steps / phase.elapsed_s(), "version": summaries[0]["version"],
               "episodes_finished": len(self.episodes), **extra}  # fmt: skip
        for key in ("env_s", "inference_s"):
            out[key] = max(x[key] for x in summaries)
        out.update(self.episode_stats())
        phase.metrics.update(out)

    def advantages(self, phase: Phase) -> None:
        """Nothing: SAC's targets are computed inside each update."""

    def evaluate(self, n: int | None = None) -> dict:
        """Deterministic episodes (the policy's mean action) on fresh envs seeded apart from training, with the
        learner's current weights; logs ``eval/return_mean``."""
        from rlnb.config.schema import RunnerConfig

        s = self.session
        n = count_or_default(n, "episodes", s.recipe.runner.eval_episodes, (RunnerConfig, "eval_episodes"))
        t0 = time.perf_counter()
        res = s.groups["rollout"].on(0).evaluate(self.env_spec, n, s.recipe.seed + 1_000_003).result()[0]
        record = {f"eval/{k}": v for k, v in res.items()}
        record["time/eval_s"] = time.perf_counter() - t0
        s.logger.log(s.step, record)
        return record

    def log_step(self, sequential: bool) -> None:
        s = self.session
        p = s.pending
        record = self.episode_record()
        work = {
            "buffer/size": p.pop("train/buffer_size", None),
            "time/env_s": p.pop("rollout/env_s", None),
            "time/inference_s": p.pop("rollout/inference_s", None),
            "time/train_compute_s": p.pop("train/compute_s", None),
        }
        record.update({k: v for k, v in work.items() if v is not None})
        for key in ("staleness_mean", "staleness_max", "overlap_frac"):
            if f"rollout/{key}" in p:
                record[f"rollout/{key}"] = p[f"rollout/{key}"]
        record.update(self.ranks.metrics())
        s.log_record(record)

    def trained_policy(self):
        """The learner's policy and Q-networks as they are now, with the env's spaces: a
        :class:`rlnb.export.TrainedPolicy` in this process (what :meth:`export` writes)."""
        from rlnb.export import TrainedPolicy
        from rlnb.models.sac import SACPolicy

        s = self.session
        module = SACPolicy(
            *self.spaces, s.recipe.sac.hidden_sizes
        )  # (objects path: recorded from the learner)
        module.load_state_dict(s.groups["actor"].on(0).agent_state().result()[0])
        return TrainedPolicy(
            module, *self.spaces, None, step=s.step, source=str(s.run_dir), env_spec=self.env_spec
        )

    def export(self, path=None) -> Path:
        """Write the trained agent to ``path`` (default ``<run_dir>/policy.pt``): see :meth:`rlnb.SACLoop.export`."""
        s = self.session
        return self.trained_policy().save(Path(path) if path is not None else s.run_dir / "policy.pt")

    def sample(self, n: int = 4) -> dict:
        """The first ``n`` time steps of collector rank 0's last batch (``[n, N, ...]``)."""
        n = count_or_default(n, "n", 4)
        return self.session.groups["rollout"].on(0).sample(n).result()[0]

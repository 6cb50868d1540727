"""Embodied PPO: env, rollout and actor ranks; a batch of ``rollout.steps_per_rollout`` env steps per env, GAE and
the PPO update on the actor ranks; deterministic evaluation episodes on fresh envs.

Placement decides the data paths: env and rollout on the same slots step in-process (the fast path); otherwise
observations and actions flow through channels, with ``env.pipeline_stages`` stages interleaved.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import gymnasium as gym

from rlnb.algorithms.contract import EMBODIED, check_algorithm
from rlnb.components.actor import PPOActor
from rlnb.components.env import Env
from rlnb.components.rollout import PolicyRollout
from rlnb.envs.gym_envs import probe_env
from rlnb.envs.obs import layout_of
from rlnb.errors import ConfigError, PlacementError
from rlnb.loop.families.env import EnvFamily
from rlnb.loop.phase import Phase, count_or_default
from rlnb.loop.roles import EnvRole, PolicyRolloutRole, PPOActorRole
from rlnb.loop.runner import Callback
from rlnb.models.policies import check_spaces
from rlnb.runtime.channel import Channel

log = logging.getLogger("rlnb")


class WarmStartFirst(Callback):
    """Before a run's first step: behaviour cloning (``actor.warm_start.episodes`` > 0), unless a cell did it."""

    def on_run_start(self, loop, steps: int) -> None:
        if loop.step == 0 and not loop.family.warm_started and loop.recipe.actor.warm_start.episodes > 0:
            loop.warm_start()


class PPO(EnvFamily):
    """Embodied PPO (see the module's docstring)."""

    name = "ppo"
    STATE = EnvFamily.STATE
    _probed: tuple | None = None  # the env's spaces, probed here on the recipe path (check_here)
    ROLES = {
        "env": (EnvRole, "rlnb.Env"),
        "rollout": (PolicyRolloutRole, "rlnb.PolicyRollout"),
        "actor": (PPOActorRole, "rlnb.PPOActor"),
    }
    SUMMARY_KEYS = (
        "env/episode_return_mean",
        "train/policy_loss",
        "train/value_loss",
        "train/approx_kl",
        "rollout/steps_per_s",
    )

    # ------------------------------------------------------------------ set-up
    @classmethod
    def check_layout(cls, slots) -> None:
        """Env and rollout sharing some slots but not all would put two blocking calls (``Env.run`` and
        ``PolicyRollout.serve``, which wait on each other through channels) on one worker's single actor thread."""
        env, rollout = set(slots["env"]), set(slots["rollout"])
        shared = sorted(env & rollout)
        if shared and env != rollout:
            raise PlacementError(
                f"component_placement: env {sorted(env)} and rollout {sorted(rollout)} share slot(s) {shared} but "
                "not all their slots; when they differ they step through channels, and two blocking calls on "
                "one worker would wait on each other. Place env and rollout on the same slots (stepped "
                "in-process) or on disjoint ones",
                "component_placement",
            )

    def check_here(self) -> None:
        """One env of the recipe built, reset and stepped here (:func:`rlnb.envs.gym_envs.probe_env`): an
        ``env.kwargs`` value of the wrong type, or spaces the built-in policy cannot take, is refused before the
        cluster starts, not where a worker builds the env."""
        env = self.session.recipe.env
        spaces = probe_env(env.id, env.kwargs) if isinstance(env.id, str) else None
        if spaces is not None:
            check_spaces(*spaces)
        self._probed = spaces
        if spaces is not None and isinstance(spaces[0], gym.spaces.Dict) and env.normalize_obs:
            raise ConfigError(
                f"env.normalize_obs: {env.id} gives dict observations ({', '.join(spaces[0].spaces)}), which are not "
                "normalised: set env.normalize_obs=false (the policy scales images to [0, 1] itself)",
                "env.normalize_obs",
            )

    def check_placement(self) -> None:
        super().check_placement()
        placement, recipe = self.session.placement, self.session.recipe
        n_env, n_roll, n_act = len(placement["env"]), len(placement["rollout"]), len(placement["actor"])
        if n_env % n_roll:
            raise PlacementError(
                f"component_placement: {n_env} env rank(s) cannot be shared evenly by {n_roll} rollout rank(s); "
                "use a multiple", "component_placement"
            )  # fmt: skip
        self.check_layout(placement.slots)
        self.check_groups()
        envs_per_rollout = recipe.env.num_envs * n_env // n_roll
        if n_act > n_roll and envs_per_rollout % (n_act // n_roll):
            raise PlacementError(
                f"component_placement: each of the {n_roll} rollout rank(s) steps {envs_per_rollout} envs, which "
                f"cannot be split evenly over {n_act // n_roll} actor ranks; make env.num_envs a multiple",
                "component_placement",
            )
        if recipe.cluster.elastic:
            self.check_elastic()
        per_actor = recipe.rollout.steps_per_rollout * recipe.env.num_envs * n_env // n_act
        if per_actor < recipe.algorithm.num_minibatches:
            raise ConfigError(
                f"algorithm.num_minibatches: {recipe.algorithm.num_minibatches} minibatches of a {per_actor}-sample batch "
                "per actor rank; lower it or raise rollout.steps_per_rollout x env.num_envs", "algorithm.num_minibatches"
            )  # fmt: skip

    def check_elastic(self) -> None:
        """``cluster.elastic`` takes env and rollout ranks on the same slots (stepped in-process), none of them
        the actor's (whose slots stay fixed), no more actor than rollout ranks (a share is one actor rank's), and
        envs that keep no statistics of their own (a joining rank would start without them)."""
        p, r = self.session.placement, self.session.recipe
        env, rollout, actor = set(p["env"]), set(p["rollout"]), set(p["actor"])
        example = "{actor: 0, 'env,rollout': 1-2}"
        if env != rollout:
            why = f"env {sorted(env)} and rollout {sorted(rollout)} on the same slots"
        elif rollout & actor:
            why = f"rollout {sorted(rollout)} apart from the actor {sorted(actor)}, whose slots stay fixed"
        elif len(actor) > len(rollout):
            why = f"at most as many actor ranks as rollout ranks (each takes whole shares); got {len(actor)} and {len(rollout)}"
        elif r.env.normalize_obs:
            why = "env.normalize_obs=false: each env rank keeps its own statistics, which a joining rank has not"
        else:
            return
        raise PlacementError(
            f"cluster.elastic: env and rollout ranks that come and go need {why} (e.g. component_placement={example})",
            "cluster.elastic",
        )

    def env_group_size(self, advantage=None) -> int:
        """``algorithm.group_size`` where the advantage (its registry entry; default the recipe's) compares a group's
        episodes (it takes ``group_size``: ``episode_grpo``), so the envs make such groups; else 1."""
        a = self.session.recipe.algorithm
        if advantage is None:
            advantage, _ = check_algorithm(EMBODIED, a.advantage, a.policy_loss)
        return a.group_size if "group_size" in advantage.needs else 1

    def check_groups(self) -> None:
        """Embodied GRPO's groups fit before launch: whole groups in each pipeline stage, and whole episodes in
        each rollout."""
        r = self.session.recipe
        size = self.env_group_size()
        if size == 1:
            return
        from rlnb.envs.groups import episode_horizon, group_misfit

        misfit = group_misfit(r.env.num_envs, r.env.pipeline_stages, size)
        if misfit is not None:
            raise ConfigError(misfit, "env.num_envs")

        horizon = episode_horizon(env_id=r.env.id, kwargs=r.env.kwargs)
        if horizon is None and isinstance(r.env.id, str):
            raise ConfigError(
                f"algorithm.advantage: {r.algorithm.advantage} compares episodes of one fixed length, and {r.env.id} "
                "has none; give one with env.kwargs.max_episode_steps", "algorithm.advantage",
            )  # fmt: skip
        if horizon and r.rollout.steps_per_rollout % horizon:
            raise ConfigError(
                f"rollout.steps_per_rollout: {r.rollout.steps_per_rollout} is not a multiple of the episodes' "
                f"{horizon} steps; {r.algorithm.advantage} needs whole episodes in each rollout",
                "rollout.steps_per_rollout",
            )

    def prepare(self) -> None:
        """The recipe path with ``actor.model.kind: vla``: the VLA built where none is (``build_if_missing``), its
        path made absolute for the workers, and the env's spaces checked against it before anything launches."""
        recipe = self.session.recipe
        if recipe.actor.model.kind != "vla":
            return
        from rlnb.envs.obs import PackedBox
        from rlnb.models.lm import is_hub_id, resolve_model
        from rlnb.models.vla import build_tiny_vla, check_vla, load_vla, vla_spec

        v, key = recipe.actor.model.vla, "actor.model.vla.path"
        spaces = self._probed
        if spaces is not None:
            obs_space, act_space = spaces
            spaces = (
                PackedBox(obs_space) if isinstance(obs_space, gym.spaces.Dict) else obs_space,
                act_space,
            )
            # (what needs no model first: nothing is built for an env a VLA cannot read)
            check_vla(*spaces, None, v.head, v.cameras, v.instruction, v.default_instruction)
        if v.build_if_missing and not is_hub_id(v.path) and not (Path(v.path) / "config.json").exists():
            t = v.tiny
            log.warning(
                "%s: no model at %s; building an untrained tiny VLA there (actor.model.vla.tiny: %d px images, "
                "hidden %d, %d layers; actor.model.vla.build_if_missing=false refuses instead)",
                key, v.path, t.image_size, t.hidden_size, t.num_layers,
            )  # fmt: skip
            build_tiny_vla(
                Path(v.path).resolve(), t.image_size, t.patch_size, t.hidden_size, t.num_layers, t.num_heads,
                t.action_bins, seed=recipe.seed,
            )  # fmt: skip
        v.path = resolve_model(v.path, key)
        if spaces is not None:
            config, processor = load_vla(v.path, key=key, weights=False)
            check_vla(*spaces, vla_spec(config, processor, key), v.head, v.cameras, v.instruction,
                      v.default_instruction)  # fmt: skip

    def launch(self) -> None:
        """The recipe path: the same public ``launch`` calls a notebook makes."""
        s = self.session
        r, cl, p = s.recipe, s.cluster, s.placement
        deadlines = r.cluster.deadlines()
        # registry entries resolved here travel by value: ones registered in a notebook cell work too
        advantage, loss = check_algorithm(EMBODIED, r.algorithm.advantage, r.algorithm.policy_loss)
        s.groups["env"] = Env.launch(
            cl, p["env"], config=r.env, seed=r.seed, gamma=r.algorithm.gamma, group_size=self.env_group_size(advantage),
            **deadlines,
        )  # fmt: skip
        s.groups["rollout"] = PolicyRollout.launch(
            cl, p["rollout"], model=r.actor.model, gamma=r.algorithm.gamma, seed=r.seed,
            torch_threads=r.actor.torch_threads, device=r.rollout.device, **deadlines,
        )  # fmt: skip
        s.groups["actor"] = PPOActor.launch(
            cl, p["actor"], actor=r.actor, algorithm=r.algorithm, total_steps=r.runner.steps, seed=r.seed,
            advantage=advantage, policy_loss=loss, **deadlines,
        )  # fmt: skip

    def bind(self) -> None:
        """Both paths, before the recipe is recorded: the actor and rollout take the env's spaces."""
        s = self.session
        env, rollout, actor = (s.groups[k] for k in self.ROLES)
        self.spaces = env.on(0).spaces().result()[0]
        self.env_spec = env.on(0).spec().result()[0]
        s.bind_checked([rollout.bind_spaces(*self.spaces), actor.bind_spaces(*self.spaces)])

    def record_components(self) -> None:
        self.session.record_components(env=self.env_spec["config"])

    def compose(self, asynchronous: bool) -> None:
        s = self.session
        actor, p = s.groups["actor"], s.placement
        actor.set_total_steps(s.recipe.runner.steps).result()
        timeout = actor.call_timeout_s
        self.env_local = p["env"] == p["rollout"]  # the rollout steps its env rank in-process
        if actor.world_size > 1:
            actor.init_process_group(timeout_s=min(timeout, 300))
            actor.setup_data_parallel().result()
        if not self.env_local:
            slot = p["rollout"][0]  # on the rollout's worker: its gets/puts skip the network
            # (no byte bound: the loop's own protocol bounds them, one step of observations in flight per stage)
            for name in ("obs", "actions"):
                s.channels[name] = Channel.create(s.cluster, name, slot=slot, timeout_s=timeout, max_bytes=0)
        super().compose(asynchronous)
        self.compose_ranks("rlnb.PolicyRollout")

    def reset_state(self) -> None:
        super().reset_state()
        self.warm_started = False  # (run() warm-starts at step 0 unless a cell did)

    def warm_start(self, demos: dict | None = None, episodes: int | None = None, epochs: int | None = None,
                   lr: float | None = None) -> dict:  # fmt: skip
        """Behaviour cloning on every actor rank (see :meth:`rlnb.Loop.warm_start`); logs ``warm_start/*``."""
        from rlnb.config.schema import WarmStartConfig
        from rlnb.envs.demos import collect_demos

        s = self.session
        w = s.recipe.actor.warm_start
        episodes = count_or_default(episodes, "episodes", w.episodes, (WarmStartConfig, "episodes"))
        epochs = count_or_default(epochs, "epochs", w.epochs, (WarmStartConfig, "epochs"))
        t0 = time.perf_counter()
        if demos is None:
            if not episodes:
                raise ConfigError(
                    "actor.warm_start.episodes: 0 expert episodes to learn from; give loop.warm_start(episodes=N) "
                    "or demos={'obs': ..., 'actions': ...}",
                    "actor.warm_start.episodes",
                )
            env = s.recipe.env
            demos = collect_demos(env.id, env.kwargs, episodes, seed=s.recipe.seed + 2_000_003)
        elif not (
            isinstance(demos, dict)
            and {"obs", "actions"} <= set(demos)
            and len(demos["obs"]) == len(demos["actions"]) > 0
        ):
            raise ConfigError(
                "demos: expected {'obs': [N, ...], 'actions': [N, ...]} with N > 0 steps of the env's observations and "
                f"the expert's actions, got {type(demos).__name__}",
                "demos",
            )
        res = s.groups["actor"].behaviour_clone(
            demos["obs"], demos["actions"], epochs, w.minibatch_size, lr if lr is not None else w.lr, s.recipe.seed
        ).result()[0]  # fmt: skip
        self.warm_started = True
        record = {f"warm_start/{k}": v for k, v in res.items()}
        if "success_rate" in demos:
            record["warm_start/expert_success_rate"] = demos["success_rate"]
        record["time/warm_start_s"] = time.perf_counter() - t0
        s.logger.log(s.step, record)
        return record

    # ------------------------------------------------------------------ phases
    def start_ranks(self, T: int) -> list:
        """Start collecting on fixed ranks (the pending calls); the batches stay on the rollout ranks."""
        s = self.session
        env, rollout = s.groups["env"], s.groups["rollout"]
        if self.env_local and self.paths.batch_local:  # the fast path: one call per rank does it all
            return [rollout.collect(T, env.name, s.groups["actor"].name)]
        if self.env_local:
            return [rollout.collect(T, env.name)]
        obs_ch, act_ch = s.channels["obs"], s.channels["actions"]
        n_roll = rollout.world_size
        env_run = env.call_each("run", [(T, obs_ch, act_ch, f"env{e}") for e in env.ranks])
        served = rollout.call_each(
            "serve",
            [(T, obs_ch, act_ch, [f"env{e}" for e in env.ranks if e % n_roll == k], s.recipe.env.pipeline_stages)
             for k in rollout.ranks],
        )  # fmt: skip
        return [served, env_run]

    def finish_collection(self, pending: list, batches: list | None = None) -> list[dict]:
        summaries = pending[0].result()
        for other in pending[1:]:
            other.result()
        if self.env_local and self.paths.batch_local:  # (the collection handed its batch over itself)
            for summary in summaries:
                self.episodes.extend(summary.pop("episodes"))
            return summaries
        env = self.session.groups["env"]
        live = self.ranks.settle
        for finished in live(env.pop_episodes()):
            self.episodes.extend(finished)
        env_s = max(live(env.pop_sim_s()))  # (the env ranks stepped apart: the slowest one's)
        for summary in summaries:
            summary["env_s"] = env_s
        self.ranks.take(batches)
        return summaries

    def rollout_metrics(self, phase: Phase, summaries: list[dict], extra: dict) -> None:
        steps = sum(s["steps"] for s in summaries)
        self.global_step += steps
        dt = phase.elapsed_s()
        out = {
            "steps": steps,
            "steps_per_s": steps / dt,
            "version": summaries[0]["version"],
            "episodes_finished": len(self.episodes),
            **extra,
        }
        for key in ("env_s", "inference_s"):  # each path times its work (the slowest rank's)
            if all(key in s for s in summaries):
                out[key] = max(s[key] for s in summaries)
        env_s, inference_s = out.get("env_s"), out.get("inference_s")
        if not self.env_local and env_s and inference_s:  # the env apart: how much of one the other hid
            hidden = (env_s + inference_s - dt) / min(env_s, inference_s)
            out["pipeline_overlap_frac"] = min(1.0, max(0.0, hidden))
        out.update(self.episode_stats())
        phase.metrics.update(out)

    def chain_calls(self, version: int) -> list:
        """The calls of one whole step on one worker (env, rollout and actor collocated on one slot), as
        :func:`rlnb.runtime.chain.chain` takes them: weights in, collection, advantages, update."""
        s = self.session
        env, rollout, actor = s.groups["env"], s.groups["rollout"], s.groups["actor"]
        return [
            (rollout, "load_from_local_actor", (actor.name, 0, version)),
            (rollout, "collect", (s.recipe.rollout.steps_per_rollout, env.name, actor.name)),
            (actor, "compute_advantages", ()),
            (actor, "train", ()),
        ]

    def evaluate(self, n: int | None = None) -> dict:
        """Deterministic episodes on fresh envs (seeded apart from training) with the rollout's weights (the loop
        sends it the current ones first); logs ``eval/return_mean``."""
        s = self.session
        from rlnb.config.schema import RunnerConfig

        n = count_or_default(n, "episodes", s.recipe.runner.eval_episodes, (RunnerConfig, "eval_episodes"))
        t0 = time.perf_counter()
        args = (self.env_spec, n, s.recipe.seed + 1_000_003)
        # observations normalised as in training: with env rank 0's statistics as they are now, frozen (not
        # passed without them, so a rollout's own evaluate of three arguments goes on working)
        normalization = self.obs_normalization()
        if normalization is not None:
            args += (normalization,)
        rollout = s.groups["rollout"]
        res = rollout.on(rollout.ranks[0]).evaluate(*args).result()[0]
        record = {f"eval/{k}": v for k, v in res.items()}
        record["time/eval_s"] = time.perf_counter() - t0
        s.logger.log(s.step, record)
        return record

    def export(self, path=None) -> Path:
        """Write the trained policy to ``path`` (default ``<run_dir>/policy.pt``) with what acts on an env's raw
        observations (see :meth:`rlnb.Loop.export`)."""
        s = self.session
        return self.trained_policy().save(Path(path) if path is not None else s.run_dir / "policy.pt")

    def trained_policy(self):
        """Actor rank 0's policy as it is now, with the env's spaces and observation statistics: a
        :class:`rlnb.export.TrainedPolicy` in this process (what :meth:`export` writes, what
        :meth:`record_episode` plays)."""
        from rlnb.export import TrainedPolicy

        s = self.session
        actor = s.groups["actor"]
        if self.paths.actor_gathers():  # (sharded: every rank gathers the whole; rank 0's copy is taken)
            module = actor.policy_module().result()[0]
        else:
            module = actor.on(0).policy_module().result()[0]
        return TrainedPolicy(
            module,
            *self.spaces,
            self.obs_normalization(),
            step=s.step,
            source=str(s.run_dir),
            env_spec=self.env_spec,
        )

    def default_callbacks(self) -> list:
        """The warm start (``actor.warm_start.episodes``) before a run's first step; an evaluation episode's video
        every ``runner.video_interval`` steps."""
        from rlnb.loop.runner import RecordEvery

        return [WarmStartFirst(), RecordEvery()]

    def capture(self) -> dict:
        """Actor rank 0's batch as plain CPU tensors (:meth:`rlnb.Loop.capture`)."""
        return self.session.bind_checked([self._replaying_actor().captured_batch()])[0][0]

    def replay(self, batch: dict, overrides: dict) -> dict:
        """Actor rank 0's update re-run on ``batch`` as the run would and under ``overrides``
        (:meth:`rlnb.Loop.replay`)."""
        if not isinstance(batch, dict) or "rewards" not in batch:
            raise ConfigError(
                f"replay: batch expected the dict loop.capture() gives, got {type(batch).__name__}", "batch"
            )
        return self.session.bind_checked([self._replaying_actor().replay(batch, overrides)])[0][0]

    def _replaying_actor(self):
        from rlnb.errors import ComponentError
        from rlnb.loop.roles import Replays, missing

        actor = self.session.groups["actor"]
        lacking = missing(actor.cls, Replays)
        if lacking:
            raise ComponentError(
                f"cannot capture or replay a batch: its class has no {', '.join(lacking)}; subclass the built-in "
                "rlnb.components.PPOActor", actor.name, actor.cls.__name__, lacking[0],
            )  # fmt: skip
        return actor.on(0)

    def inspect_episode(self, seed: int | None = None, max_steps: int = 1000):
        """One deterministic episode with actor rank 0's weights, on a fresh env in the driver's process, step by
        step (:meth:`rlnb.export.TrainedPolicy.inspect_episode`)."""
        seed = self.session.recipe.seed + 1_000_003 if seed is None else seed  # (as record_episode's)
        return self.trained_policy().inspect_episode(seed=seed, max_steps=max_steps)

    def record_episode(self, path=None, seed: int | None = None, max_steps: int = 1000, fps: int = 20):
        """One deterministic episode with actor rank 0's weights, on a fresh env in the driver's process, written
        as MP4 to ``path`` (default ``<run_dir>/videos/step_<step>.mp4``); an :class:`rlnb.video.EpisodeVideo`."""
        from rlnb.files import check_inside

        s = self.session
        policy = self.trained_policy()
        if path is None:
            path = s.run_dir / "videos" / f"step_{s.step:06d}.mp4"
            if (
                path.parent.exists()
            ):  # (a link planted there must not lead the video out of the run directory)
                check_inside(path.parent, s.run_dir)
        seed = s.recipe.seed + 1_000_003 if seed is None else seed  # as evaluate's envs: apart from training
        video = policy.record_episode(path, seed=seed, max_steps=max_steps, fps=fps)
        s.logger.log_video(s.step, "eval/video", video.path, fps)  # (TensorBoard's and W&B's video panels)
        where = Path(video.path).resolve()
        inside = where.is_relative_to(Path(s.run_dir).resolve())
        # the dashboard's record of it: the file, relative to the run directory where it is inside
        s.logger.log(s.step, {"eval/video": str(where.relative_to(Path(s.run_dir).resolve()) if inside else where),
                              "eval/video_return": video.episode_return, "eval/video_len": video.length})  # fmt: skip
        return video

    def obs_normalization(self):
        """Env rank 0's observation statistics as they are now (``env.normalize_obs``), else ``None``: what an
        evaluation and an exported policy normalise with."""
        if not self.env_spec["config"].normalize_obs:
            return None
        env = self.session.groups["env"]
        return env.on(env.ranks[0]).obs_normalization().result()[0]

    # ------------------------------------------------------------------ metrics
    def log_step(self, sequential: bool) -> None:
        s = self.session
        p = s.pending
        record = self.episode_record()
        work = {  # seconds of the work itself inside the phases, timed where it runs (wall clock: time/)
            "time/env_s": p.pop("rollout/env_s", None),
            "time/inference_s": p.pop("rollout/inference_s", None),
            "time/advantages_compute_s": p.pop("advantages/compute_s", None),
            "time/train_compute_s": p.pop("train/compute_s", None),
        }
        record.update({k: v for k, v in work.items() if v is not None})
        if None not in work.values() and sequential:  # collocated: one phase after another
            step_s = sum(v for k, v in p.items() if k.startswith("time/") and k != "time/compile_s")
            record["time/overhead_frac"] = max(0.0, 1.0 - sum(work.values()) / step_s) if step_s > 0 else None
        for key in ("staleness_mean", "staleness_max", "overlap_frac", "pipeline_overlap_frac"):
            if f"rollout/{key}" in p:
                record[f"rollout/{key}"] = p[f"rollout/{key}"]
        record.update(self.ranks.metrics())
        s.log_record(record)

    def sample(self, n: int = 4) -> dict:
        """The first ``n`` time steps of the batch actor rank 0 trains on (``[n, N, ...]``); rollout rank 0's batch
        where the actor does not show its own."""
        n = count_or_default(n, "n", 4)
        groups = self.session.groups
        got = groups["actor"].on(0).sample(n).result()[0] if self.capabilities.actor_samples else None
        got = got or groups["rollout"].on(groups["rollout"].ranks[0]).sample(n).result()[0]
        layout = layout_of(self.spaces[0]) if got and "obs" in got else None
        if layout is not None:  # dict observations: their parts by name, [n, N, ...] each
            got["obs"] = layout.unpack(got["obs"])
        return got

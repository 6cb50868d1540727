"""Actor component for embodied PPO: owns the policy and optimizer, computes advantages, trains.

Data-parallel over its ranks with ``DistributedDataParallel`` on the group's default process group
(gloo on CPU, NCCL on GPU); each rank trains on the batch of its own rollout ranks.

Example (in-process; ``PPOActor.launch(cluster, "1", ...)`` places the same on a cluster):
    >>> import gymnasium as gym
    >>> actor = PPOActor(policy_loss="ppo", lr=1e-3)
    >>> actor.bind_spaces(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(2))["policy"]
    'ActorCritic'
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time

import torch

from rlnb.algorithms.contract import check_algorithm
from rlnb.algorithms.losses import entropy_bonus, value_loss
from rlnb.components.actor_base import ActorBase, with_settings
from rlnb.components.batches import EMBODIED_BATCH, EMBODIED_OPTIONAL, check_batch
from rlnb.components.compile import StepCompiler
from rlnb.components.fused import FusedPPOStep, fused_ppo_step, same_walk, walk
from rlnb.components.launch import launcher
from rlnb.components.optim import ClipAndStep, build_optimizer
from rlnb.components.rollout import resolve_device
from rlnb.components.strategy import Strategy
from rlnb.config.schema import ActorConfig
from rlnb.errors import ConfigError
from rlnb.models.policies import critic_parameters, make_policy
from rlnb.models.vla import VLAPolicy
from rlnb.runtime.rank import RankInfo, current_rank
from rlnb.seeding import rank_seed


class PPOActor(ActorBase):
    """PPO (CleanRL's ``ppo.py`` update) as a component.

    Args:
        actor: :class:`rlnb.config.ActorConfig` (model, lr, compile...); default ``ActorConfig()``.
        algorithm: :class:`rlnb.config.AlgorithmConfig` (advantage, loss, coefficients).
        obs_space, act_space: gymnasium spaces of one env; without them the policy is built by
            :meth:`bind_spaces`, which a loop calls with its env's spaces.
        total_steps: training steps of the run (for learning-rate annealing).
        seed: seed of the initial weights and of the minibatch shuffling (rank ``r``:
            ``rlnb.seeding.rank_seed(seed, r, "actor")``).
        policy: the policy (see :func:`rlnb.models.make_policy`): an ``nn.Module`` class or factory
            defined anywhere, a notebook cell included; default ``actor.model`` (the built-in MLP/CNN).
        advantage, policy_loss: registered names or functions; override ``algorithm``'s.
        **settings: any field of ``ActorConfig`` or ``AlgorithmConfig`` by name (``lr=1e-3``, ``clip_coef=0.1``).

    The loss is called with every input of :data:`rlnb.algorithms.contract.EMBODIED` it accepts. A loss
    that takes no ``values`` (e.g. ``ppo``) is the policy term only: the actor then adds
    ``vf_coef * value_loss - ent_coef * entropy`` itself, so the value head still learns.
    """

    launch = launcher("actor")

    def __init__(
        self,
        actor=None,
        algorithm=None,
        obs_space=None,
        act_space=None,
        total_steps: int = 1,
        seed: int = 0,
        advantage_fn=None,
        loss_fn=None,
        rank_info: RankInfo | None = None,
        *,
        policy=None,
        advantage=None,
        policy_loss=None,
        **settings,
    ):
        rank_info = rank_info or current_rank()  # subclasses need not pass it on
        actor = actor if isinstance(actor, ActorConfig) else ActorConfig(**(actor or {}))
        algorithm = self.algorithm_config(algorithm)
        self.cfg, self.algo = with_settings(actor, algorithm, settings, "actor")
        torch.set_num_threads(self.cfg.torch_threads)
        self.rank = rank_info.rank if rank_info else 0
        self.world_size = rank_info.world_size if rank_info else 1
        self.name = rank_info.component if rank_info else "actor"
        self.seed = seed
        self.device = resolve_device(self.cfg.device, rank_info)
        self.strategy = Strategy(self.cfg, self.device, self.rank, self.world_size)
        self.policy_spec = self.cfg.model if policy is None else policy
        self.generator = torch.Generator().manual_seed(rank_seed(seed, self.rank, "actor"))
        self.total_steps = max(1, total_steps)
        self.step = 0
        # names resolve here; functions (and registry entries resolved by the driver) travel by value,
        # so ones registered in a notebook cell work on workers exactly like the built-ins
        self.advantage, self.loss = check_algorithm(
            self.CONTRACT,
            advantage_fn or advantage or self.algo.advantage,
            loss_fn or policy_loss or self.algo.policy_loss,
        )
        self.batch: dict | None = None
        # (batch, Var[returns], Var[returns - values]) of compute_advantages(): train()'s explained variance
        self._explained: tuple | None = None
        self.policy = None
        self.step_compiler: StepCompiler | None = None
        self.fused_steps = 0  # minibatches trained through the hand-derived step (actor.fused_step)
        self.fused_unfit: str | None = None  # why the last update could not use it
        self._fused_now: FusedPPOStep | None = None
        if obs_space is not None and act_space is not None:
            self.bind_spaces(obs_space, act_space)

    def bind_spaces(self, obs_space, act_space) -> dict:
        """Build the policy and its optimizer for these spaces (once; later calls keep them)."""
        if self.policy is None:
            self.spaces = (obs_space, act_space)
            torch.manual_seed(self.seed)  # identical initial weights on every rank
            self.policy = make_policy(self.policy_spec, obs_space, act_space, self.name).to(self.device)
            if isinstance(self.policy, VLAPolicy):  # LoRA and checkpointing apply to the transformer inside
                self.policy.adapt(self.cfg.lora, self.cfg.gradient_checkpointing is True)
            # fused Adam: one kernel for all parameters (the default on CPU loops over tensors in Python)
            self.optimizer = build_optimizer(
                torch.optim.Adam, self._param_groups(), lr=self.cfg.lr, eps=1e-5, fused=True
            )
            self.apply_lr()
            self.clip_and_step = ClipAndStep(self.optimizer)  # clip_grad_norm_ + step(), minus their Python
            self.model = self.policy  # what the train step calls (DDP wraps it)
            self.step_compiler = StepCompiler.for_device(self.cfg.compile, self.device, "actor")
        return {"policy": type(getattr(self.policy, "module", self.policy)).__name__}

    def _param_groups(self) -> list[dict]:
        """The optimizer's groups: one, or with ``actor.critic_lr`` the value function's weights apart."""
        if self.cfg.critic_lr is None:
            return [{"params": list(self.policy.parameters())}]
        critic = {id(p) for p in critic_parameters(self.policy, "actor.critic_lr")}
        return [
            {"params": [p for p in self.policy.parameters() if id(p) not in critic]},
            {"params": [p for p in self.policy.parameters() if id(p) in critic], "critic": True},
        ]

    def behaviour_clone(self, obs, actions, epochs: int = 20, minibatch_size: int = 64, lr: float = 3e-4,
                        seed: int = 0) -> dict:  # fmt: skip
        """A warm start before RL: ``epochs`` passes of supervised learning on demonstrations (``obs [N, ...]``,
        ``actions [N, ...]``), maximising the policy's log-probability of the expert's actions (for a VLA: the
        sum over an action's tokens, OpenVLA's loss) with Adam at ``lr``, in minibatches shuffled by ``seed`` (every
        rank the same data and order: data-parallel ranks stay identical). Returns the first and last epoch's
        mean negative log-likelihood, and how often the policy's most likely action is the expert's (discrete actions) or
        how far it is from it on average (continuous)."""
        obs = torch.as_tensor(obs, device=self.device)
        actions = torch.as_tensor(actions, device=self.device)
        optimizer = torch.optim.Adam([p for p in self.policy.parameters() if p.requires_grad], lr=lr)
        g = torch.Generator().manual_seed(seed)
        n, losses = obs.shape[0], []
        self.policy.train()
        for _ in range(epochs):
            total = 0.0
            for idx in torch.randperm(n, generator=g).split(minibatch_size):
                idx = idx.to(self.device)
                with self.strategy.precision():
                    logprob, _, _ = self.model(obs[idx], actions[idx])
                loss = -logprob.float().mean()
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.algo.max_grad_norm)
                optimizer.step()
                total += loss.item() * len(idx)
            losses.append(total / n)
        with torch.no_grad():
            greedy = torch.cat(
                [self.policy.act(obs[i : i + 256], deterministic=True)[0] for i in range(0, n, 256)]
            )
        greedy, expert = greedy.reshape(n, -1), actions.reshape(n, -1)
        if expert.is_floating_point():  # continuous: how far off, in its units (binned: never equal)
            fit = {"expert_action_error": float((greedy.float() - expert.float()).abs().mean())}
        else:
            fit = {"expert_match": float((greedy == expert.to(greedy.dtype)).all(-1).float().mean())}
        return {"nll_first": losses[0], "nll": losses[-1], **fit, "epochs": epochs, "samples": n}

    def policy_state(self) -> dict[str, torch.Tensor]:
        """Weights for the rollout: a detached copy on the actor's device (on a GPU they reach the rollout
        by CUDA IPC on one node, with no host round trip); a VLA with LoRA's merged into its base."""
        if self.sharded:  # (every actor rank calls it together: each gathers the whole)
            return {k: v.detach().clone() for k, v in self.full_state().items()}
        state = self.policy.plain_state() if isinstance(self.policy, VLAPolicy) else self.policy.state_dict()
        return {k: v.detach().clone() for k, v in state.items()}

    def policy_module(self) -> torch.nn.Module:
        """A copy of the policy on the CPU, in eval mode, without gradients (what ``Loop.export`` saves); of a sharded
        one, a whole copy built anew from the gathered weights (every actor rank calls it together)."""
        if not self.sharded:
            return copy.deepcopy(self.policy).cpu().eval().requires_grad_(False)
        whole = {k: v.detach().cpu() for k, v in self.full_state().items()}
        module = make_policy(self.policy_spec, *self.spaces, self.name)
        module.load_state_dict(whole)
        return module.eval().requires_grad_(False)

    def copy_policy_into(self, module: torch.nn.Module) -> bool:
        """Copy the policy's weights into ``module`` in this process (a collocated rollout's copy of the same
        architecture) with one ``torch._foreach_copy_``; False, copying nothing, where that would not be
        what :meth:`policy_state` gives (a subclass's own ``policy_state``, other names, shapes or devices)."""
        if type(self).policy_state is not PPOActor.policy_state or self.sharded:
            return False
        cached, walks = getattr(self, "_copy_pairs", None), (walk(module), walk(self.policy))
        # the tensors to copy, found again once a layer, parameter or buffer was replaced in either module
        if cached is None or not all(same_walk(now, then) for now, then in zip(walks, cached[1])):
            ours, theirs = self.policy.state_dict(), module.state_dict()
            same = list(ours) == list(theirs) and all(
                a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                for a, b in zip(ours.values(), theirs.values())
            )
            pairs = (list(theirs.values()), list(ours.values())) if same else None
            cached = self._copy_pairs = (pairs, walks)
        if cached[0] is None:
            return False
        with torch.no_grad():
            torch._foreach_copy_(*cached[0])
        return True

    def set_batch(self, batches: list[dict]) -> dict:
        """Take one or more rollout batches (concatenated along the env axis) onto this rank's device, each
        checked against :data:`~rlnb.components.batches.EMBODIED_BATCH` first; a ``loss_mask`` where one of them has
        it (the others' steps all count)."""
        for b in batches:
            check_batch(b, EMBODIED_BATCH, EMBODIED_OPTIONAL)
        keys = ("obs", "actions", "logprobs", "values", "rewards", "dones")
        if any("loss_mask" in b for b in batches):
            batches = [
                b if "loss_mask" in b else {**b, "loss_mask": torch.ones_like(b["rewards"])} for b in batches
            ]
            keys += ("loss_mask",)
        dev = self.device
        # the collocated hand-off: the rollout's tensors as they are, no copy on its device
        if len(batches) == 1:
            batch = {k: batches[0][k].to(dev, non_blocking=True) for k in (*keys, "last_values")}
        else:
            batch = {k: torch.cat([b[k].to(dev, non_blocking=True) for b in batches], dim=1) for k in keys}
            batch["last_values"] = torch.cat([b["last_values"].to(dev, non_blocking=True) for b in batches])
        batch["version"] = min(b["version"] for b in batches)
        self.batch, self._explained = batch, None
        return {"steps": int(batch["rewards"].numel()), "version": batch["version"]}

    def sample(self, n: int = 4) -> dict:
        """The first ``n`` time steps of this rank's batch (``[n, N, ...]``, on the CPU): what the rollout
        collected and, once :meth:`compute_advantages` ran, ``advantages`` and ``returns`` beside them."""
        if self.batch is None:
            return {}
        return {
            k: (v[:n].detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) and v.dim() > 1 else v)
            for k, v in self.batch.items()
            if k != "last_values"
        }

    def captured_batch(self) -> dict:
        """This rank's whole batch as plain CPU tensors (``loop.capture()``): what the rollout collected, with
        ``last_values`` and the policy ``version``, without the advantages (:meth:`replay` computes them again)."""
        if self.batch is None:
            raise RuntimeError("capture: the actor holds no batch yet; run the rollout phase first")
        keep = (*EMBODIED_BATCH, *EMBODIED_OPTIONAL)
        return {
            k: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v)
            for k, v in self.batch.items()
            if k in keep
        }

    REPLAY_SETTINGS = ("lr",)
    """The actor settings :meth:`replay` may change beside the algorithm's (its other fields build the model)."""

    def replay(self, batch: dict, overrides: dict) -> dict:
        """The update on ``batch`` (:meth:`captured_batch`) run twice from this rank's state now, as the run would
        (``as_run``) and under ``overrides`` (fields of the algorithm section: ``clip_coef``, ``ent_coef``,
        ``policy_loss``, ``update_epochs``...; and ``lr``): each one's metrics (loss, gradient norm, KL, clip
        fraction...) and ``param_change_norm``, how far it moved the policy, and their ``difference``. Nothing of
        the run changes: weights, optimizer, RNGs, step, settings and batch are what they were."""
        from rlnb.config.checks import bounds_errors

        if self.world_size > 1:
            raise ConfigError(
                f"replay: runs one actor rank's update, and this actor has {self.world_size} (data-parallel ranks "
                "train together)", "actor",
            )  # fmt: skip
        actor_fields = {f.name for f in dataclasses.fields(ActorConfig)}
        fixed = sorted(k for k in overrides if k in actor_fields and k not in self.REPLAY_SETTINGS)
        if fixed:
            raise ConfigError(
                f"replay: {fixed[0]} is not an update setting; replay changes the algorithm's fields and "
                f"{', '.join(self.REPLAY_SETTINGS)}", fixed[0],
            )  # fmt: skip
        cfg, algo = with_settings(self.cfg, self.algo, overrides, "replay")
        errors = bounds_errors(algo, "algorithm.") + bounds_errors(cfg, "actor.")
        if errors:
            raise ConfigError(f"replay: {errors[0]}", errors[0].split(":")[0])
        advantage, loss = check_algorithm(self.CONTRACT, algo.advantage, algo.policy_loss)
        saved = copy.deepcopy(self.state_dict())  # weights, optimizer, RNGs, step
        kept = (self.cfg, self.algo, self.advantage, self.loss, self.batch, self._explained, self.fused_steps)
        start = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
        out = {}
        try:
            for name, settings in (("as_run", kept[:4]), ("replayed", (cfg, algo, advantage, loss))):
                self.load_state_dict(copy.deepcopy(saved))  # (the optimizer would share, and update, saved's)
                self.cfg, self.algo, self.advantage, self.loss = settings
                self.apply_lr()
                self.set_batch([batch])
                metrics = self.train()
                moved = sum(
                    float((v - start[k]).float().pow(2).sum()) for k, v in self.policy.state_dict().items()
                )
                out[name] = {**metrics, "param_change_norm": math.sqrt(moved)}
        finally:
            self.cfg, self.algo, self.advantage, self.loss = kept[:4]
            self.load_state_dict(saved)
            self.batch, self._explained, self.fused_steps = kept[4:]
        out["difference"] = {
            k: out["replayed"][k] - v
            for k, v in out["as_run"].items()
            if isinstance(v, (int, float)) and isinstance(out["replayed"].get(k), (int, float))
        }
        return out

    # ------------------------------------------------------------------ phases
    def compute_advantages(self) -> dict:
        """Run the advantage estimator on the current batch (every input of the contract it accepts)."""
        b, algo = self.batch, self.algo
        t0 = time.perf_counter()
        advantages, returns = self.advantage(
            rewards=b["rewards"], values=b["values"], dones=b["dones"], last_values=b["last_values"],
            gamma=algo.gamma, gae_lambda=algo.gae_lambda, group_size=algo.group_size, scale=algo.scale,
        )  # fmt: skip
        compute_s = time.perf_counter() - t0
        for key, x in (("advantages", advantages), ("returns", returns)):
            if not isinstance(x, torch.Tensor) or x.shape != b["rewards"].shape:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ConfigError(
                    f"algorithm.advantage {self.advantage.name!r}: expected (advantages, returns) of shape "
                    f"{tuple(b['rewards'].shape)} ([T, N], like rewards); {key} has {got}",
                    "algorithm.advantage",
                )
        b["advantages"], b["returns"] = advantages, returns  # [T, N]
        # the batch's statistics in one reduction and one read: those reported here, and the two variances of
        # the explained variance train() reports, 1 - Var[returns - values] / Var[returns]
        with torch.no_grad():
            var, mean = torch.var_mean(
                torch.stack((advantages, returns, returns - b["values"])).flatten(1), 1
            )
            (var_advantages, var_returns, var_residual), (mean_advantages, mean_returns, _) = torch.stack(
                (var, mean)
            ).tolist()
        self._explained = (b, var_returns, var_residual)
        return {
            "advantage_mean": mean_advantages,
            "advantage_std": math.sqrt(var_advantages),
            "return_mean": mean_returns,
            "compute_s": compute_s,
        }

    def train(self) -> dict:
        """``update_epochs`` passes of ``num_minibatches`` minibatches over the batch; returns mean metrics."""
        algo, b = self.algo, self.batch
        if "advantages" not in b:
            self.compute_advantages()
        if self.cfg.anneal_lr:
            self.apply_lr(max(0.0, 1.0 - self.step / self.total_steps))
        flat = {
            k: b[k].reshape(-1, *b[k].shape[2:])
            for k in ("obs", "actions", "logprobs", "values", "advantages", "returns")
        }
        if "loss_mask" in b:  # steps held after an episode's end did nothing: they leave the loss
            keep = b["loss_mask"].reshape(-1) > 0
            flat = {k: v[keep] for k, v in flat.items()}
        warming = self.step < algo.critic_warmup_steps  # the value function alone: no advantage, no surrogate
        if warming:
            flat["advantages"] = torch.zeros_like(flat["advantages"])
        self._fused_now = self._fused_step()
        if "prox_logprobs" in self.loss.needs:  # the policy at the start of this update (decoupled PPO)
            with torch.no_grad():
                flat["prox_logprobs"] = self.policy(flat["obs"], flat["actions"])[0]
        n = flat["logprobs"].shape[0]  # T * N of this rank
        # each rank takes num_minibatches steps per epoch: DDP then averages gradients over ranks,
        # so a step sees (ranks x mb_size) samples, as one rank would with the whole batch
        mb_size = max(1, n // algo.num_minibatches)
        history: list[dict] = []  # each minibatch's metrics
        epochs_run, compute_s = 0, 0.0
        perf_counter, train_minibatch = time.perf_counter, self._train_minibatch
        for _ in range(algo.update_epochs):
            # one minibatch of the whole batch: every term is a mean over samples, so no shuffle
            perm = None if mb_size == n else torch.randperm(n, generator=self.generator)
            # (num_minibatches of them on every rank, as DDP needs, whatever each rank's batch left out)
            for start in range(0, mb_size * min(algo.num_minibatches, n), mb_size):
                mb = flat if perm is None else {k: v[perm[start : start + mb_size]] for k, v in flat.items()}
                t0 = perf_counter()
                history.append(train_minibatch(mb))
                compute_s += perf_counter() - t0
            epochs_run += 1
            if (
                algo.target_kl is not None
                and self._mean_over_ranks(history[-1]["approx_kl"]) > algo.target_kl
            ):
                break
        self.step += 1
        out = {k: sum(m[k] for m in history) / len(history) for k in (history[0] if history else ())}
        out.update(epochs=epochs_run, lr=self.optimizer.param_groups[0]["lr"], compute_s=compute_s)
        if algo.critic_warmup_steps:
            out["critic_warmup"] = float(warming)
        if self.step_compiler is not None:
            out.update(self.step_compiler.report())  # compile time, once, apart from training time
        # 1 - Var[returns - values] / Var[returns], its variances read with the batch's other statistics where
        # compute_advantages() ran on this very batch
        explained = self._explained
        if explained is None or explained[0] is not b:
            with torch.no_grad():
                explained = (
                    b,
                    *torch.stack((b["returns"], b["returns"] - b["values"])).flatten(1).var(1).tolist(),
                )
        _, var_returns, var_residual = explained
        out["explained_variance"] = float("nan") if var_returns == 0 else 1 - var_residual / var_returns
        return out

    def _fused_step(self) -> FusedPPOStep | None:
        """The hand-derived step (``actor.fused_step``) if it can stand in for autograd in this update; else
        ``None``, with the reason in ``fused_unfit``. The last update's step is used again where it was made
        for the same modules and parameters."""
        step, self.fused_unfit = (
            (None, "actor.fused_step is off")
            if not self.cfg.fused_step
            else (None, "a subclass replaced the objective")
            if type(self)._objective is not PPOActor._objective
            else fused_ppo_step(
                self.policy, self.model, self.loss.fn, self.step_compiler is not None, self._fused_now
            )
        )
        return step

    def fused_stats(self) -> dict:
        """How this rank's updates ran: minibatches through the hand-derived step (``actor.fused_step``) and,
        if the last update could not use it, why."""
        return {"fused_steps": self.fused_steps, "unfit": self.fused_unfit}

    def _train_minibatch(self, mb: dict) -> dict:
        # every tensor is one minibatch, [M]
        fused, algo = self._fused_now, self.algo
        if fused is not None:  # loss and gradients at once (.grad set), no autograd graph
            loss, metrics = fused(
                mb, clip_coef=algo.clip_coef, vf_coef=algo.vf_coef, ent_coef=algo.ent_coef,
                clip_vloss=algo.clip_vloss, norm_adv=algo.norm_adv,
            )  # fmt: skip
            self.fused_steps += 1
        else:
            if self.step_compiler is not None and not self.step_compiler.ready:
                self.step_compiler.warm_up(self._objective, mb, self.policy)
            objective = self.step_compiler.fn if self.step_compiler is not None else self._objective
            loss, metrics = objective(mb)
        if not self.sharded and self.clip_and_step.optimizer is not self.optimizer:  # a subclass replaced it
            self.clip_and_step = ClipAndStep(self.optimizer)
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise FloatingPointError(
                f"non-finite loss {loss_value} at training step {self.step}; metrics {metrics}"
            )
        if fused is None:
            self.strategy.zero_grad(self.optimizer, self.clip_and_step)
            loss.backward()
        # (sharded, actor.strategy=fsdp2: the norm over every rank's shards, the optimizer over them)
        self.strategy.clip_and_step(self.policy, self.optimizer, self.clip_and_step, algo.max_grad_norm)
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics["loss"] = loss_value
        return metrics

    def _objective(self, mb: dict) -> tuple[torch.Tensor, dict]:
        """Forward and loss of one minibatch: what ``actor.compile`` compiles (its backward with it)."""
        with self.strategy.precision():  # (actor.dtype: bf16 autocast for a VLA, float32 master weights)
            logprob, entropy, value = self.model(mb["obs"], mb["actions"])
        if logprob.dtype != torch.float32:  # the loss in float32
            logprob, entropy, value = logprob.float(), entropy.float(), value.float()
        algo, loss_fn = self.algo, self.loss
        advantages = mb["advantages"]
        full_objective = "values" in loss_fn.needs  # the loss has its own value and entropy terms
        if not full_objective and algo.norm_adv and advantages.numel() > 1:
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        loss, metrics = loss_fn(
            logprobs=logprob, old_logprobs=mb["logprobs"], prox_logprobs=mb.get("prox_logprobs"),
            advantages=advantages, values=value, old_values=mb["values"], returns=mb["returns"],
            entropy=entropy, clip_coef=algo.clip_coef, clip_coef_high=algo.clip_coef_high,
            dual_clip=algo.dual_clip, vf_coef=algo.vf_coef, ent_coef=algo.ent_coef,
            clip_vloss=algo.clip_vloss, norm_adv=algo.norm_adv, behave_weight_cap=algo.behave_weight_cap,
        )  # fmt: skip
        if not full_objective:  # a policy-only loss: the value head and the entropy bonus are added here
            v_loss = value_loss(
                value, mb["values"], mb["returns"], None, algo.clip_coef if algo.clip_vloss else None
            )
            ent = entropy_bonus(entropy)
            metrics = {**metrics, "policy_loss": loss.detach(), "value_loss": v_loss.detach(),
                       "entropy": ent.detach()}  # fmt: skip
            loss = loss - algo.ent_coef * ent + algo.vf_coef * v_loss
        return loss, metrics

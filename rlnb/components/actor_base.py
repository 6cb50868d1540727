"""What every actor component shares: its settings (:func:`with_settings`), data-parallel set-up through its
parallel strategy (:class:`rlnb.components.strategy.Strategy`), weight publishing and the whole model's weights,
batch intake, and checkpoints (a sharded actor's through DCP)."""

from __future__ import annotations

import dataclasses
import inspect

import torch

from rlnb.algorithms.contract import EMBODIED, check_algorithm
from rlnb.components.optim import without_dynamo_import
from rlnb.components.strategy import for_each_bucket
from rlnb.config.schema import ActorConfig, AlgorithmConfig
from rlnb.errors import ConfigError, did_you_mean
from rlnb.files import nonfinite
from rlnb.runtime.collective import broadcast_state_dict
from rlnb.runtime.rank import NonFiniteState, local_peer, process_group


def constructor_parameters(cls) -> set[str]:
    """The named arguments ``cls(...)`` takes, through subclasses' ``__init__(self, *args, **kwargs)`` that
    pass them on to a base class's ``__init__``."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        params = inspect.signature(init).parameters.values()
        names |= {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} - {"self"}
        if not any(p.kind is p.VAR_KEYWORD for p in params):  # passes no further names on
            break
    return names


def with_settings(actor: ActorConfig, algorithm: AlgorithmConfig, settings: dict, owner: str):
    """``actor`` and ``algorithm`` with ``settings`` (field names of either) applied; unknown names refused."""
    actor_fields = {f.name for f in dataclasses.fields(ActorConfig)}
    algo_fields = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    for name in settings:
        if name not in actor_fields | algo_fields:
            raise ConfigError(
                f"{owner}: unknown setting {name!r}; settings are fields of ActorConfig or AlgorithmConfig."
                + did_you_mean(name, actor_fields | algo_fields),
                name,
            )
    actor = dataclasses.replace(actor, **{k: v for k, v in settings.items() if k in actor_fields})
    algorithm = dataclasses.replace(algorithm, **{k: v for k, v in settings.items() if k in algo_fields})
    return actor, algorithm


class ActorBase:
    """What every actor component shares: data-parallel set-up, weight publishing, batch intake.

    A subclass has ``self.policy`` (the trained module), ``self.model`` (what its train step calls),
    ``self.device``, ``self.cfg`` (an :class:`ActorConfig`), ``world_size``, ``optimizer``,
    ``generator``, ``step``, and implements ``policy_state()`` and ``set_batch(batches)``.
    """

    CONTRACT = EMBODIED  # what this actor offers the algorithm registries
    DEFAULT_ALGORITHM: dict = {}  # AlgorithmConfig fields that differ for this actor when none is given
    DEFAULT_ACTOR: dict = {}  # ActorConfig fields likewise
    # DDP sends rank 0's buffers (e.g. normalisation statistics) to every rank at each forward: one
    # collective per call, so every rank must call the model as many times a step
    DDP_BROADCAST_BUFFERS = True

    @classmethod
    def algorithm_config(cls, algorithm) -> AlgorithmConfig:
        """``algorithm`` (an :class:`AlgorithmConfig`, a dict or ``None``) as a config, with this actor's defaults."""
        if isinstance(algorithm, AlgorithmConfig):
            return algorithm
        return AlgorithmConfig(**{**cls.DEFAULT_ALGORITHM, **(algorithm or {})})

    @classmethod
    def actor_config(cls, actor) -> ActorConfig:
        """``actor`` (an :class:`ActorConfig`, a dict or ``None``) as a config, with this actor's defaults."""
        if isinstance(actor, ActorConfig):
            return actor
        return ActorConfig(**{**cls.DEFAULT_ACTOR, **(actor or {})})

    @classmethod
    def prepare_launch(cls, kwargs: dict) -> dict:
        """On the driver, before launch: resolve the advantage and policy loss into registry entries,
        which travel by value (so ones registered in a notebook cell reach the workers), and refuse a
        combination this actor cannot serve before anything starts."""
        kwargs = dict(kwargs)
        algorithm = cls.algorithm_config(kwargs.get("algorithm"))
        params = constructor_parameters(cls)
        settings = {k: v for k, v in kwargs.items() if k not in params}
        with_settings(ActorConfig(), algorithm, settings, "actor")  # unknown names refused here
        advantage = kwargs.pop("advantage_fn", None) or kwargs.get("advantage") or algorithm.advantage
        loss = kwargs.pop("loss_fn", None) or kwargs.get("policy_loss") or algorithm.policy_loss
        kwargs["advantage"], kwargs["policy_loss"] = check_algorithm(cls.CONTRACT, advantage, loss)
        return kwargs

    ref = None  # a frozen reference model (an LM actor's KL), sharded alike where the policy is

    def setup_data_parallel(self) -> str:
        """Data-parallel over the actor's ranks (call after ``init_process_group``), as its strategy says
        (:class:`rlnb.components.strategy.Strategy`): DDP, or FSDP2 with its own optimizer over the shards."""
        model, optimizer = self.strategy.wrap(
            self.policy, self.ref, self.step_compiler, self.DDP_BROADCAST_BUFFERS
        )
        self.model = model
        if optimizer is not None:
            self.optimizer = optimizer
        return self.strategy.describe()

    @property
    def sharded(self) -> bool:
        """FSDP2 in force: each rank holds a shard of the model; its whole weights are gathered by every rank."""
        return self.strategy.sharded

    def full_state(self) -> dict[str, torch.Tensor]:
        """The model's whole state dict: gathered from every rank's shards when sharded (every actor rank must call
        it together), else the module's own."""
        return self.strategy.full_state(self.policy)

    def state_buckets(self, for_rollout: bool = True, tied: bool = True):
        """The whole model's weights in buckets, gathered one tensor at a time (see
        :meth:`rlnb.components.strategy.Strategy.state_buckets`)."""
        return self.strategy.state_buckets(self.policy, for_rollout, tied)

    def sync_report(self) -> dict:
        """The last weight sync of a sharded actor: how many buckets, the largest one's bytes (what a rank held of
        whole tensors at once) and the bytes sent in all."""
        return dict(self.strategy.last_sync)

    def load_report(self) -> dict:
        """How this rank got its weights (see :meth:`rlnb.components.strategy.Strategy.load_report`)."""
        return self.strategy.load_report()

    def save_state_to(self, path: str) -> int:
        """The actor's part of a checkpoint. Sharded, the model and optimizer state go through DCP, every actor rank
        writing its own shards into one directory beside the rank files together (:mod:`rlnb.components.lm.dcp`),
        and the rank file ``path`` holds the rest (RNGs, step, reference model); else all of ``state_dict()`` goes
        into ``path``. Returns the bytes this rank wrote."""
        from rlnb.runtime.rank import process_group, save_state_file

        if not self.sharded:
            return save_state_file(self, self.state_dict(), path)
        from rlnb.components.lm.dcp import save_sharded, shard_dir

        directory = shard_dir(path)
        save_sharded(self.policy, self.optimizer, directory, process_group("default"))
        ours = sum(f.stat().st_size for f in directory.glob(f"__{self.rank}_*.distcp"))
        return save_state_file(self, {**self._rest_state(), "shards": "dcp"}, path) + ours

    def load_state_from(self, path: str) -> None:
        """Restore what :meth:`save_state_to` wrote (or a rank file holding the whole state, as checkpoints of an
        unsharded actor, and sharded ones before DCP, do); nothing in the files runs."""
        from rlnb.files import torch_load_safe

        state = torch_load_safe(path)
        if state.get("shards") != "dcp":
            return self.load_state_dict(state)
        if not self.sharded:
            raise ValueError(
                "this checkpoint was written by a sharded actor (actor.strategy: fsdp2, its weights in DCP shards): "
                "resume it with actor.strategy=fsdp2"
            )
        from rlnb.components.lm.dcp import load_sharded, shard_dir
        from rlnb.runtime.rank import process_group

        load_sharded(self.policy, self.optimizer, shard_dir(path), process_group("default"))
        self._load_rest(state)
        return None

    def describe(self) -> dict:
        """The settings a loop reads from its actor (algorithm choices and coefficients)."""
        return {
            "advantage": self.advantage.name,
            "policy_loss": self.loss.name,
            "algorithm": dataclasses.asdict(self.algo),
            "actor": self.cfg,
        }

    def held_bytes(self) -> int:
        """The bytes of parameters, gradients and optimizer state this rank holds (sharded: its shards)."""
        return self.strategy.held_bytes(self.policy, self.optimizer)

    def parameter_counts(self) -> dict:
        """The policy's ``parameters`` and, of them, the ``trainable`` ones (LoRA: the adapters), whole-model
        counts on every rank, sharded or not.

        Example:
            >>> actor.parameter_counts()  # doctest: +SKIP
            {'parameters': 4218432, 'trainable': 4218432}
        """
        params = list(self.policy.parameters())
        return {
            "parameters": sum(p.numel() for p in params),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
        }

    def compile_stats(self) -> dict:
        """Whether this rank's train step runs compiled (``actor.compile``), its compile time, why it fell
        back to eager if it did, and dynamo's counters in this process."""
        compiler = getattr(self, "step_compiler", None)
        return (
            compiler.stats()
            if compiler is not None
            else {"compiled": False, "compile_s": None, "fallback": None}
        )

    def apply_lr(self, frac: float = 1.0) -> None:
        """Every parameter group's learning rate to ``frac`` of its base: ``actor.lr``, or ``actor.critic_lr``
        for the group of the value function's weights (marked ``critic`` where it was built)."""
        critic_lr = self.cfg.critic_lr
        for group in self.optimizer.param_groups:
            group["lr"] = frac * (critic_lr if group.get("critic") and critic_lr is not None else self.cfg.lr)

    def set_hyperparameters(self, **values: float) -> dict:
        """Change ``lr`` (the optimizer's now, and the base of its annealing), ``ent_coef`` or ``clip_coef``
        between steps; the loop checks the values first. Returns the values now in force."""
        for key, value in values.items():
            if key == "lr":
                self.cfg = dataclasses.replace(self.cfg, lr=value)
                self.apply_lr()
            else:
                self.algo = dataclasses.replace(self.algo, **{key: value})
        return {
            "lr": self.optimizer.param_groups[0]["lr"],
            "ent_coef": self.algo.ent_coef,
            "clip_coef": self.algo.clip_coef,
        }

    def set_total_steps(self, total_steps: int) -> int:
        """The run's length in training steps, for schedules such as ``anneal_lr`` (a loop sets it)."""
        self.total_steps = max(1, int(total_steps))
        return self.total_steps

    def publish_weights(self, channel, keys: list[str], version: int) -> int:
        """Disaggregated weight sync: put the weights once per rollout rank key (worker to worker). Sharded, bucket
        by bucket (:meth:`state_buckets`), every actor rank gathering and rank 0 (the one given ``keys``) putting
        each: ``{"state": bucket, "version", "more": True}``, then ``{"state": {}, "more": False}`` (the rollout
        loads each as it comes, :meth:`rlnb.components.rollout.RolloutBase.load_weights_in_parts`)."""
        if not self.sharded:
            state = self.policy_state()
            for k in keys:
                channel.put({"state": state, "version": version}, key=k)
            return version

        def put(_, bucket: dict) -> None:
            for k in keys:
                channel.put({"state": bucket, "version": version, "more": True}, key=k)

        for_each_bucket(self.state_buckets(), put if keys else None)
        for k in keys:
            channel.put({"state": {}, "version": version, "more": False}, key=k)
        return version

    def broadcast_weights(self, version: int, group: str) -> int:
        """Collective weight sync: send this rank's weights, as rank 0 of process group ``group``, to the
        rollout ranks in it (each calls :meth:`RolloutBase.receive_weights` at the same time)."""
        broadcast_state_dict(self.policy.state_dict(), 0, process_group(group))
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
        with without_dynamo_import():  # a first checkpoint need not import it (~1 s)
            optimizer = self.optimizer.state_dict()
        return {"policy": self.policy.state_dict(), "optimizer": optimizer, **self._rest_state()}

    def _rest_state(self) -> dict:
        """What :meth:`state_dict` holds besides the weights and the optimizer (:meth:`_load_rest` restores it):
        RNGs and the step. A sharded actor writes the weights and optimizer through DCP and this apart."""
        return {
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "step": self.step,
        }

    def load_state_dict(self, state: dict) -> None:
        # a diverged or damaged checkpoint: refused, not evaluated, trained on or exported
        bad = nonfinite(state["policy"], "policy")
        if bad is not None:
            raise NonFiniteState(f"{bad} holds NaN or inf values")
        self.policy.load_state_dict(state["policy"])
        with without_dynamo_import():
            self.optimizer.load_state_dict(state["optimizer"])
        self._load_rest(state)

    def _load_rest(self, state: dict) -> None:
        """What :meth:`load_state_dict` restores besides the weights and the optimizer: RNGs and the step."""
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

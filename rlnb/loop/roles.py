"""What a loop calls on each role's component, as typed protocols: one per role, checked once when a loop is
composed (the error names the missing method and the built-in to subclass), and the optional capabilities a
schedule or a family asks for (streaming generation, steering...), read once into :class:`Capabilities`.

A component is any class with these methods: a built-in, a subclass of one, or a class of your own defined in a
notebook cell. Nothing here is a base class to inherit from; a protocol only says what is called.

Example:
    >>> from rlnb.components import PPOActor
    >>> missing(PPOActor, PPOActorRole)
    []
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from rlnb.errors import ComponentError


# ---------------------------------------------------------------------------- embodied roles
class EnvRole(Protocol):
    """An env rank (:class:`rlnb.Env`): vector envs stepped in-process by a collocated rollout, or through
    channels."""

    def spaces(self) -> tuple: ...
    def spec(self) -> dict: ...
    def run(self, steps: int, obs_channel, act_channel, key: str) -> int: ...
    def pop_episodes(self) -> list[tuple]: ...
    def pop_sim_s(self) -> float: ...
    def current_obs(self) -> list: ...
    def step(self, stage: int, actions) -> dict: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class PolicyRolloutRole(Protocol):
    """A rollout rank of a policy (:class:`rlnb.PolicyRollout`): collects batches from env ranks."""

    def bind_spaces(self, obs_space, act_space) -> dict: ...
    def collect(self, steps: int, env: str, actor: str | None = None) -> dict: ...
    def serve(self, steps: int, obs_channel, act_channel, env_keys: list[str], stages: int) -> dict: ...
    def load_weights(self, state_dict: dict, version: int) -> int: ...
    def load_from_local_actor(self, actor: str, rank: int, version: int) -> int: ...
    def load_from_channel(self, channel, key: str) -> int: ...
    def put_batch(self, channel, key: str, shards: int = 1) -> int: ...
    def take_batch(self) -> dict: ...
    def evaluate(self, env_spec: dict, episodes: int, seed: int, *normalization) -> dict: ...
    def sample(self, n: int = 4) -> dict: ...


class ElasticRolloutRole(Protocol):
    """A rollout rank of an elastic run (``cluster.elastic``): collects a step's shares and puts them itself."""

    def collect_into(self, steps: int, env: str, channel, puts: list[tuple[str, int]]) -> list[dict]: ...


class ActorRole(Protocol):
    """What every actor rank does, whatever its family: take batches, estimate advantages, train, publish its
    weights, checkpoint. :class:`PPOActorRole` and :class:`LMActorRole` add their family's calls."""

    def describe(self) -> dict: ...
    def set_batch(self, batches: list[dict]) -> dict: ...
    def take_local_batches(self, rollout: str, ranks: list[int]) -> dict: ...
    def take_channel_batches(self, channel, keys: list[str]) -> dict: ...
    def compute_advantages(self) -> dict: ...
    def train(self) -> dict: ...
    def policy_state(self) -> dict: ...
    def publish_weights(self, channel, keys: list[str], version: int) -> int: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class PPOActorRole(ActorRole, Protocol):
    """An actor rank of embodied PPO (:class:`rlnb.PPOActor`)."""

    def bind_spaces(self, obs_space, act_space) -> dict: ...
    def set_total_steps(self, total_steps: int) -> int: ...


# ---------------------------------------------------------------------------- LM roles
class LMRolloutRole(Protocol):
    """A rollout rank of an LM (:class:`rlnb.components.HFRollout`, ``VLLMRollout``)."""

    def generate(self, prompts: list, answers: list, n: int, *more) -> dict: ...
    def set_rewards(self, rewards: list, terms: dict | None = None) -> dict: ...
    def complete(self, prompts: list, *records) -> list[str]: ...
    def load_weights(self, state_dict: dict, version: int) -> int: ...
    def load_from_local_actor(self, actor: str, rank: int, version: int) -> int: ...
    def load_from_channel(self, channel, key: str) -> int: ...
    def put_batch(self, channel, key: str, shards: int = 1) -> int: ...
    def take_batch(self) -> dict: ...
    def offload(self) -> bool: ...


class LMActorRole(ActorRole, Protocol):
    """An actor rank of an LM (:class:`rlnb.components.LMActor`)."""

    def sft(self, prompts: list, answers: list, steps: int, batch_size: int, lr: float, *noise) -> list: ...
    def sft_begin(
        self, prompts: list, answers: list, steps: int, batch_size: int, lr: float, *noise
    ) -> None: ...
    def sft_steps(self, steps: int) -> list: ...
    def export_hf(self, path: str) -> str: ...


class RewardRole(Protocol):
    """A reward rank (:class:`rlnb.components.RewardWorker`): scores completions."""

    def score(self, texts: list, answers: list, *records) -> list: ...
    def score_terms(self, texts: list, answers: list, *records) -> dict: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


# ---------------------------------------------------------------------------- optional capabilities
class Steerable(Protocol):
    """An actor whose hyperparameters change between steps (``loop.set_hyperparameters``, the dashboard)."""

    def set_hyperparameters(self, **values: float) -> dict: ...


class BroadcastsWeights(Protocol):
    """An actor that sends its weights over a process group (``rollout.weight_sync=broadcast``)."""

    def broadcast_weights(self, version: int, group: str) -> int: ...


class ReceivesWeights(Protocol):
    """A rollout that takes weights over a process group (``rollout.weight_sync=broadcast``)."""

    def receive_weights(self, version: int, group: str) -> int: ...


class SamplesBatch(Protocol):
    """An actor that shows the batch it trains on (``loop.sample()``)."""

    def sample(self, n: int = 4) -> dict: ...


class StreamsGeneration(Protocol):
    """An LM rollout generating a chunk of tokens at a time, taking new weights between chunks (asynchronous
    GRPO's partial rollouts)."""

    CHUNKED_GENERATION: ClassVar[bool]

    def stream(self, problems: list, n: int, train_version: int, groups: int, **links: Any) -> list: ...


class ElasticStreamsGeneration(StreamsGeneration, Protocol):
    """An LM rollout of an elastic run (``cluster.elastic``): makes several shares of a step's batch at once
    (``stream(..., puts=[(key, shards), ...])``) and gives up groups of its pool when a share moves away."""

    def release(self, n: int) -> list[int]: ...


class Replays(Protocol):
    """An actor that gives its batch as plain data and re-runs an update on one under other settings
    (``loop.capture()``, ``loop.replay()``)."""

    def captured_batch(self) -> dict: ...
    def replay(self, batch: dict, overrides: dict) -> dict: ...


class InspectsTokens(Protocol):
    """An LM rollout that shows a greedy completion token by token (``loop.inspect``)."""

    def inspect(self, prompt: str, top_k: int = 5, max_new_tokens: int | None = None) -> list: ...


class TakesRecords(Protocol):
    """An LM rollout whose ``complete`` and ``sample_completions`` take each prompt's answer and record fields after
    the prompts (a class that does not declare it is given the prompts only)."""

    TAKES_RECORDS: ClassVar[bool]


class MergesAdapters(Protocol):
    """An LM rollout that takes a LoRA actor's adapters alone and merges them into the base it keeps
    (``load_message``: ``actor.lora.sync: adapters``)."""

    MERGES_ADAPTERS: ClassVar[bool]


class SamplesCompletions(Protocol):
    """An LM rollout whose ``complete`` takes, after the prompts and records, ``n``: that many sampled completions
    a prompt instead of the greedy one (evaluation's pass@k, ``data.eval_samples``)."""

    SAMPLES_COMPLETIONS: ClassVar[bool]


# ---------------------------------------------------------------------------- checks
def members(protocol: type) -> dict[str, str]:
    """The members of ``protocol``: name -> ``"method"`` or ``"attribute"`` (its annotations)."""
    found: dict[str, str] = {}
    for layer in reversed(protocol.__mro__):  # a role's own members after those of the roles it extends
        if layer is Protocol or not getattr(layer, "_is_protocol", False):
            continue
        found.update(
            (name, "method")
            for name, value in vars(layer).items()
            if inspect.isfunction(value) and not name.startswith("_")
        )
        found.update(dict.fromkeys(vars(layer).get("__annotations__", {}), "attribute"))
    return found


def missing(cls: type, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``cls`` lacks: a method it cannot call, an attribute it does not declare."""
    out = []
    for name, kind in members(protocol).items():
        if kind == "method":
            if not callable(inspect.getattr_static(cls, name, None)):
                out.append(name)
        elif inspect.getattr_static(cls, name, _ABSENT) is _ABSENT:
            out.append(name)
    return out


_ABSENT = object()


def implements(cls: type, protocol: type) -> bool:
    """Whether ``cls`` has every member of ``protocol`` (declared attributes true)."""
    if missing(cls, protocol):
        return False
    return all(bool(getattr(cls, name)) for name, kind in members(protocol).items() if kind == "attribute")


def check_role(group, role: str, protocol: type, builtin: str, why: str = "") -> None:
    """Refuse ``group`` (a launched group) for ``role`` if its class lacks a method of ``protocol``.

    Raises:
        ComponentError: naming the group, the class, the first missing method and the built-in to subclass.
    """
    lacking = missing(group.cls, protocol)
    if lacking:
        raise ComponentError(
            f"lacks method(s) {', '.join(lacking)} that the {role} {why or 'of this loop'} calls; subclass the "
            f"built-in {builtin} and override what you change",
            group.name, group.cls.__name__, lacking[0],
        )  # fmt: skip


@dataclass(frozen=True)
class Capabilities:
    """What the composed components can do beyond their roles, read once when the loop is composed."""

    steerable: bool = False
    """The actor takes ``set_hyperparameters``."""
    actor_samples: bool = False
    """The actor shows its batch (``loop.sample()``); else rollout rank 0's is shown."""
    streaming: bool = False
    """The rollout generates in chunks across weight updates (``stream``)."""
    whole_completions: bool = False
    """The rollout's engine generates whole completions (vLLM): asynchronous mode runs whole batches ahead."""
    takes_records: bool = False
    """The LM rollout takes answers and record fields beside the prompts."""
    inspects_tokens: bool = False
    """The LM rollout shows a completion token by token (``loop.inspect``)."""
    samples_completions: bool = False
    """The LM rollout samples several completions a prompt for evaluation (pass@k)."""
    merges_adapters: bool = False
    """The LM rollout merges a LoRA actor's adapters sent alone (adapters-only weight sync)."""

    @classmethod
    def of(cls, groups: dict) -> Capabilities:
        actor, rollout = groups.get("actor"), groups.get("rollout")
        chunked = rollout is not None and bool(
            inspect.getattr_static(rollout.cls, "CHUNKED_GENERATION", True)
        )
        return cls(
            steerable=actor is not None and implements(actor.cls, Steerable),
            actor_samples=actor is not None and implements(actor.cls, SamplesBatch),
            streaming=rollout is not None and chunked and not missing(rollout.cls, StreamsGeneration),
            whole_completions=rollout is not None and not chunked,
            takes_records=rollout is not None and implements(rollout.cls, TakesRecords),
            inspects_tokens=rollout is not None and implements(rollout.cls, InspectsTokens),
            samples_completions=rollout is not None and implements(rollout.cls, SamplesCompletions),
            merges_adapters=rollout is not None and implements(rollout.cls, MergesAdapters),
        )

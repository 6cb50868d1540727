"""The batches a rollout hands to an actor, each layout written down once and checked where it is taken.

A layout maps each key to the shape its tensor must have, in named dimensions (the same name is the same size
everywhere in the batch; ``...`` takes any trailing dimensions), or to ``int`` for a plain number::

    EMBODIED_BATCH   T steps x N envs (``rollout.steps_per_rollout`` x the rank's envs)
    LM_BATCH         B sequences x L tokens (see :mod:`rlnb.components.lm.layout`)

The actor's ``set_batch`` checks every batch it is given, so a rollout of one's own that leaves a key out or
gets a shape wrong is told which key, what was expected and what it gave, instead of failing later inside the
update with an index error.

Example:
    >>> import torch
    >>> batch = {"rewards": torch.zeros(8, 2), "dones": torch.zeros(8, 3)}
    >>> check_batch(batch, {"rewards": ("T", "N"), "dones": ("T", "N")})
    Traceback (most recent call last):
    ...
    rlnb.errors.ComponentError: rollout: batch.dones: expected a tensor [T, N] with T=8, N=2 (as in 'rewards'), got one of shape [8, 3]
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rlnb.errors import ComponentError

EMBODIED_BATCH = {
    "obs": ("T", "N", ...),
    "actions": ("T", "N", ...),
    "logprobs": ("T", "N"),
    "values": ("T", "N"),
    "rewards": ("T", "N"),
    "dones": ("T", "N"),
    "last_values": ("N",),  # V(s_T), the value after the last step, for bootstrapping
    "version": int,  # the policy version that collected it
}
EMBODIED_OPTIONAL = {
    "loss_mask": ("T", "N")
}  # 0.0 on steps the loss leaves out (held after an episode's end)

LM_BATCH = {
    "input_ids": ("B", "L"),
    "attention_mask": ("B", "L"),
    "response_mask": ("B", "L"),
    "logprobs": ("B", "L"),
    "rewards": ("B",),
    "version": int,
}
LM_OPTIONAL = {"truncated": ("B",), "reward_terms": ("B", "K"), "versions": ("B", "L")}


def _shape(dims: tuple) -> str:
    return "[" + ", ".join("..." if d is ... else str(d) for d in dims) + "]"


def check_batch(batch, layout: Mapping, optional: Mapping = (), source: str = "rollout") -> None:
    """Raise :class:`~rlnb.errors.ComponentError` naming the first key of ``batch`` that does not fit
    ``layout`` (every key required) or ``optional`` (checked where present): missing, not a tensor, or of
    another shape; sizes named alike must agree across keys. ``source``: the component that made it."""

    def fail(key: str, message: str):
        raise ComponentError(message, source, "batch", key)

    if not isinstance(batch, Mapping):
        fail("<batch>", f"expected a dict of tensors keyed {sorted(layout)}, got {type(batch).__name__}")
    sizes: dict[str, tuple[int, str]] = {}  # name -> (size, the key it was first read from)
    for key, spec in (*layout.items(), *((k, v) for k, v in dict(optional).items() if k in batch)):
        if key not in batch:
            fail(key, f"missing; a batch has {sorted(layout)} (it has {sorted(batch)})")
        value = batch[key]
        if spec is int:
            if isinstance(value, bool) or not isinstance(value, int):
                fail(key, f"expected an int, got {value!r} ({type(value).__name__})")
            continue
        fixed = [d for d in spec if d is not ...]
        if not isinstance(value, torch.Tensor):
            fail(key, f"expected a tensor {_shape(spec)}, got {type(value).__name__}")
        shape = tuple(value.shape)
        if len(shape) < len(fixed) or (... not in spec and len(shape) != len(fixed)):
            fail(key, f"expected a tensor {_shape(spec)}, got one of shape {list(shape)}")
        for name, size in zip(fixed, shape):
            known = sizes.setdefault(name, (size, key))
            if known[0] != size:
                bound = ", ".join(f"{n}={sizes[n][0]}" for n in fixed if n in sizes)
                fail(key, f"expected a tensor {_shape(spec)} with {bound} (as in {known[1]!r}), got one of shape "
                     f"{list(shape)}")  # fmt: skip

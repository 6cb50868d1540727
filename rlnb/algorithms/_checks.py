"""Shape checks whose errors name the argument, the expected and the given shape, and a fix."""

from __future__ import annotations

import torch

from rlnb.errors import ConfigError


def check_tensor(name: str, x, ndim: int | tuple[int, ...], shape_doc: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ConfigError(f"{name}: expected a torch.Tensor {shape_doc}, got {type(x).__name__}", name)
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if x.dim() not in dims:
        raise ConfigError(f"{name}: expected shape {shape_doc}, got {tuple(x.shape)}", name)
    return x


def check_same_shape(names: list[str], tensors: list[torch.Tensor]) -> None:
    ref = tensors[0].shape
    for n, t in zip(names[1:], tensors[1:]):
        if t is not None and t.shape != ref:
            hint = "; try .unsqueeze(-1)" if t.dim() + 1 == len(ref) else ""
            raise ConfigError(
                f"{n}: has shape {tuple(t.shape)}, expected {tuple(ref)} like {names[0]}{hint}", n
            )


def check_positive(name: str, value, allow_zero: bool = False):
    ok = value >= 0 if allow_zero else value > 0
    if not ok:
        raise ConfigError(
            f"{name}: expected a {'non-negative' if allow_zero else 'positive'} number, got {value}", name
        )


def check_choice(name: str, value, choices):
    from rlnb.errors import did_you_mean

    if value not in choices:
        raise ConfigError(
            f"{name}: expected one of {list(choices)}, got {value!r}.{did_you_mean(str(value), choices)}",
            name,
        )

"""The end of a train step, gradient clipping and the Adam update, at the cost of its kernels.

For the small policies of embodied RL a whole train step takes well under a millisecond on a CPU core,
and ``clip_grad_norm_(module.parameters(), ...)`` followed by ``Adam(fused=True).step()`` spent most of its
time in Python: walking the modules for their parameters, grouping tensors by device, hooks and profiling
wrappers, around kernels several times faster (figures: ``docs/benchmarks.md``). :class:`ClipAndStep` calls the same kernels
(``torch._foreach_norm``, ``torch._foreach_mul_``, ``torch._fused_adam_``) on lists it keeps, so the
result is bit for bit what torch's own functions give, and falls back to them wherever its conditions do
not hold (another optimizer, hooks, several devices...). It creates Adam's state itself on the first step, as
``Adam._init_group`` does for a fused group: torch's first ``step()`` would import ``torch._dynamo`` (a second
of a core), which nothing else in an embodied run needs. :func:`build_optimizer` builds the optimizer without that
import either.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    >>> step = ClipAndStep(optimizer)
    >>> model(torch.randn(8, 4)).pow(2).mean().backward()
    >>> step(max_grad_norm=0.5) > 0
    tensor(True)
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.optim import optimizer as optimizer_module

_DIRECT = (torch.optim.Adam, torch.optim.AdamW)


_DYNAMO_DISABLED = ("add_param_group", "state_dict", "load_state_dict", "zero_grad")


@contextlib.contextmanager
def without_dynamo_import():
    """Within, ``torch.optim.Optimizer``'s ``add_param_group``, ``state_dict``, ``load_state_dict`` and
    ``zero_grad`` run without importing ``torch._dynamo``.

    torch wraps them in ``torch._disable_dynamo``, which imports ``torch._dynamo`` on the first call (~1 s
    here, on a worker's start-up path or its first checkpoint) to disable compilation of them, and caches the
    disabled function on the wrapped one as ``__dynamo_disable``. While ``torch._dynamo`` is not imported
    nothing can be compiling, so the plain function is cached for the duration and the cache is emptied
    after: once something imports ``torch._dynamo``, the wrappers disable it as torch intends.

    Example:
        >>> import torch
        >>> with without_dynamo_import():
        ...     optimizer = torch.optim.Adam(torch.nn.Linear(2, 1).parameters())
        ...     state = optimizer.state_dict()
    """
    seeded = []
    if "torch._dynamo" not in sys.modules:
        for name in _DYNAMO_DISABLED:
            wrapped = getattr(getattr(optimizer_module.Optimizer, name, None), "__wrapped__", None)
            if wrapped is not None and not hasattr(wrapped, "__dynamo_disable"):
                wrapped.__dynamo_disable = wrapped
                seeded.append(wrapped)
    try:
        yield
    finally:
        for wrapped in seeded:
            del wrapped.__dynamo_disable


def build_optimizer(cls: type[torch.optim.Optimizer], params, **kwargs) -> torch.optim.Optimizer:
    """``cls(params, **kwargs)`` (``torch.optim.Adam``, ``AdamW``...), built without importing
    ``torch._dynamo`` where it is not imported yet (see :func:`without_dynamo_import`)."""
    with without_dynamo_import():
        return cls(params, **kwargs)


class ClipAndStep:
    """``clip_grad_norm_(params, max_grad_norm)`` then ``optimizer.step()``, for one optimizer.

    Args:
        optimizer: any ``torch.optim`` optimizer. The direct path applies to ``Adam``/``AdamW`` with
            ``fused=True`` and one parameter group on one device and dtype; anything else takes torch's
            own functions, so behaviour never depends on which path ran.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.direct_steps = 0  # steps taken on the direct path (what the tests look at)
        self._direct = self._direct_possible()

    def _direct_possible(self) -> bool:
        opt = self.optimizer
        if type(opt) not in _DIRECT or len(opt.param_groups) != 1 or not hasattr(torch, "_fused_adamw_"):
            return False
        group = opt.param_groups[0]
        flags = ("amsgrad", "maximize", "capturable", "differentiable")
        return (
            bool(group.get("fused"))
            and not any(group.get(flag) for flag in flags)
            and not isinstance(group["betas"][0], torch.Tensor)
            and len({(p.device, p.dtype) for p in self.params}) == 1
        )

    def zero_grad(self) -> None:
        """Drop the gradients (``optimizer.zero_grad(set_to_none=True)``)."""
        for p in self.params:
            p.grad = None

    def __call__(self, max_grad_norm: float) -> torch.Tensor:
        """Clip the gradients to a global 2-norm of ``max_grad_norm`` and take an optimizer step; returns the
        norm before clipping (a 0-d tensor), as ``clip_grad_norm_`` does."""
        with_grad = [p for p in self.params if p.grad is not None]
        grads = [p.grad for p in with_grad]
        if not grads:
            self.optimizer.step()
            return torch.zeros(())
        # torch.nn.utils.clip_grad_norm_'s foreach path, op for op
        norms = torch._foreach_norm(grads, 2.0)
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        torch._foreach_mul_(grads, torch.clamp(max_grad_norm / (total + 1e-6), max=1.0))
        if not self._direct_ready(with_grad):
            self.optimizer.step()
            return total
        group = self.optimizer.param_groups[0]
        state = self.optimizer.state
        steps = [state[p]["step"] for p in with_grad]
        torch._foreach_add_(steps, 1)
        beta1, beta2 = group["betas"]
        # torch.optim.adam._fused_adam's kernels (AdamW is Adam with decoupled_weight_decay=True)
        kernel = torch._fused_adamw_ if group.get("decoupled_weight_decay") else torch._fused_adam_
        kernel(
            with_grad, grads, [state[p]["exp_avg"] for p in with_grad],
            [state[p]["exp_avg_sq"] for p in with_grad], [], steps,
            amsgrad=False, lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=False, grad_scale=None, found_inf=None,
        )  # fmt: skip
        self.direct_steps += 1
        return total

    def _direct_ready(self, with_grad: list) -> bool:
        opt = self.optimizer
        if not self._direct or isinstance(opt.param_groups[0]["lr"], torch.Tensor):
            return False
        if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
            return False
        if optimizer_module._global_optimizer_pre_hooks or optimizer_module._global_optimizer_post_hooks:
            return False
        state = opt.state
        for p in with_grad:
            if p not in state or not state[p]:  # its first step: the state Adam._init_group creates (fused)
                state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
            elif "exp_avg" not in state[p]:
                return False
        return True

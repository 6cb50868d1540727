"""A hand-derived PPO train step for the built-in MLP actor-critic: forward, loss and gradients without autograd.

A ``ppo_cartpole`` minibatch (256 samples through two 64 x 64 tanh MLPs) through autograd on a CPU core is
mostly not matrix multiplication: it is dispatch, the autograd graph and its engine, one small kernel at a time.
:class:`FusedPPOStep` computes the same loss, metrics and gradients in about half the time
(``docs/benchmarks.md``): the
forward keeps what the backward needs, and the backward is written out, layer by layer, from the loss's own
derivative (CleanRL's PPO loss, :func:`rlnb.algorithms.losses.ppo_clip_value_entropy`, including its tie
rules: where ``torch.max`` or ``clamp`` would split or stop the gradient, so does this).

It runs only where everything it assumes holds (:func:`unfit` names what does not, else ``None``): the built-in
:class:`rlnb.models.policies.ActorCritic` with separate MLP trunks (``tanh`` or ``relu``), discrete or
continuous actions; the built-in ``ppo_clip_value_entropy`` loss; one rank, or data-parallel ranks under
``DistributedDataParallel`` as the actor sets it up (the fused step then averages the gradients in one
all-reduce itself); no ``torch.compile``; no hooks on the modules or parameters. Anywhere
else the actor trains through autograd, and ``actor.fused_step: false`` makes it always do so. The gradients
are autograd's up to float rounding (``tests/test_fused.py`` compares them, both action kinds, both value
losses).

:class:`FusedAct` does the same for a rollout's forward: the built-in discrete MLP policy's own kernels without
its module calls, the same values and random draws bit for bit.

Example:
    >>> import gymnasium as gym, torch
    >>> from rlnb.models.policies import ActorCritic
    >>> policy = ActorCritic(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(2))
    >>> step = FusedPPOStep(policy)
    >>> mb = {"obs": torch.randn(8, 4), "actions": torch.randint(0, 2, (8,)).float(),
    ...       "logprobs": torch.full((8,), -0.7), "values": torch.zeros(8),
    ...       "advantages": torch.randn(8), "returns": torch.randn(8)}
    >>> loss, metrics = step(mb, clip_coef=0.2, vf_coef=0.5, ent_coef=0.0, clip_vloss=False, norm_adv=True)
    >>> policy.actor_head.weight.grad.shape
    torch.Size([2, 64])
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from rlnb.algorithms.losses import ppo_clip_value_entropy
from rlnb.models.policies import ActorCritic, Tanh, tanh_without_grad

_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


_ACTIVATIONS = {  # module type -> (forward, backward from the output), as the module computes them
    Tanh: (tanh_without_grad, torch.ops.aten.tanh_backward),
    nn.ReLU: (torch.relu_, lambda grad, y: torch.ops.aten.threshold_backward(grad, y, 0)),
}


def _layers(trunk: nn.Module, head: nn.Linear):
    """``([(weight, bias), ...], (activation, its backward))`` of ``Sequential(Linear, act, ..., Linear, act)``
    followed by ``head``, or ``None`` if the trunk is anything else."""
    if not isinstance(trunk, nn.Sequential) or len(trunk) % 2:
        return None
    linears, acts = list(trunk)[0::2], list(trunk)[1::2]
    kinds = {type(a) for a in acts}
    if not all(type(m) is nn.Linear for m in linears) or len(kinds) != 1 or kinds.pop() not in _ACTIVATIONS:
        return None
    return [(m.weight, m.bias) for m in [*linears, head]], _ACTIVATIONS[type(acts[0])]


def _trunks(policy: ActorCritic):
    """The :func:`_layers` of an ``ActorCritic``'s actor and critic MLPs, or ``None`` unless both fit."""
    actor, critic = (
        _layers(policy.actor_trunk, policy.actor_head),
        _layers(policy.critic_trunk, policy.critic_head),
    )
    return None if actor is None or critic is None else (actor, critic)


def walk(module: nn.Module) -> tuple[list[nn.Module], list[nn.Parameter], list[torch.Tensor]]:
    """``list(module.modules())``, ``list(module.parameters())`` and ``list(module.buffers())``, in their order,
    without their generators (a fraction of their cost for the built-in policy: these checks run at every update
    and collection). Two walks list the very same objects (:func:`same_walk`) unless a layer, parameter or buffer
    was replaced between them: telling needs no hook on torch's registrations."""
    modules, params, buffers, seen, seen_tensors = [], [], [], set(), set()

    # pre-order, each module and tensor once, as torch's modules() walks
    def visit(m: nn.Module) -> None:
        seen.add(id(m))
        modules.append(m)
        for into, tensors in ((params, m._parameters), (buffers, m._buffers)):
            for t in tensors.values():
                if t is not None and id(t) not in seen_tensors:
                    seen_tensors.add(id(t))
                    into.append(t)
        for c in m._modules.values():
            if c is not None and id(c) not in seen:
                visit(c)

    visit(module)
    return modules, params, buffers


def same_walk(walked: tuple, before: tuple) -> bool:
    """Whether two :func:`walk` results list the very same modules, parameters and buffers, in the same order."""
    return all(
        len(now) == len(then) and all(a is b for a, b in zip(now, then)) for now, then in zip(walked, before)
    )


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")  # fmt: skip


def _hooked(module: nn.Module, walked: tuple | None = None) -> bool:
    """Whether anything would observe or change the module's forward or backward (hooks of any kind);
    ``walked``: its :func:`walk`, if at hand."""
    from torch.nn.modules import module as module_globals

    if any(getattr(module_globals, name, None) for name in _GLOBAL_HOOKS):
        return True
    modules, params, _ = walked or walk(module)
    for m in modules:
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return True
    return any(
        getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None) for p in params
    )


def data_parallel_group(model: nn.Module, policy: nn.Module):
    """The process group of ``DistributedDataParallel`` wrapping ``policy`` as the actor sets it up (no
    communication hook, gradients averaged), whose all-reduce the fused step does itself; else ``None``."""
    from torch.nn.parallel import DistributedDataParallel

    if type(model) is not DistributedDataParallel or model.module is not policy:
        return None
    if getattr(model, "_comm_hooks", None):  # a registered communication hook (compression, ...)
        return None
    return model.process_group


def unfit(policy: nn.Module, model: nn.Module, loss_fn, compiled: bool) -> str | None:
    """Why the fused step cannot stand in for autograd here, or ``None`` if it can.

    Args:
        policy: the actor's policy module; ``model``: what its train step calls (``policy`` itself, or
            ``DistributedDataParallel`` around it).
        loss_fn: the registered policy loss's function. ``compiled``: whether ``torch.compile`` runs the step.
    """
    why = _unfit_as_called(policy, model, loss_fn, compiled)
    if why is not None:
        return why
    walked = walk(policy)
    return _unfit_trunks(policy) or _unfit_now(policy, walked)


def _unfit_as_called(policy: nn.Module, model: nn.Module, loss_fn, compiled: bool) -> str | None:
    """:func:`unfit`'s checks of how the step is called: compile, the model around the policy, its type, the loss."""
    if compiled:
        return "actor.compile is on"
    if model is not policy and data_parallel_group(model, policy) is None:
        return (
            f"the train step calls {type(model).__name__}, not the policy or DistributedDataParallel "
            "around it with its defaults"
        )
    if type(policy) is not ActorCritic:
        return f"the policy is {type(policy).__name__}, not the built-in ActorCritic"
    if not isinstance(policy.trunk, nn.Flatten):
        return "the policy's trunk is shared or convolutional"
    if loss_fn is not ppo_clip_value_entropy:
        return f"the policy loss is {getattr(loss_fn, '__name__', loss_fn)!r}, not ppo_clip_value_entropy"
    return None


def _unfit_trunks(policy: ActorCritic) -> str | None:
    """:func:`unfit`'s check of the MLPs' layers (fixed for given modules and parameters)."""
    if _trunks(policy) is None:
        return "the trunks are not Linear layers with tanh or relu between them"
    return None


def _unfit_now(policy: ActorCritic, walked: tuple, hooks_unchanged: bool = False) -> str | None:
    """:func:`unfit`'s checks of what may change on the same modules at any time: frozen parameters and hooks
    (``walked``: the policy's :func:`walk`; ``hooks_unchanged``: no hook was registered in this process since
    the policy was last found without any, see :func:`_hooks_registered`)."""
    if not all(p.requires_grad for p in walked[1]):
        return "some parameters are frozen"
    if not hooks_unchanged and _hooked(policy, walked):
        return "hooks are registered on the policy"
    return None


def _hooks_registered() -> int:
    """How many hooks this process has registered: every public ``register_*hook`` of torch (modules,
    tensors, the global module hooks) advances ``RemovableHandle.next_id``. While it stays as it was when a
    policy was found without hooks, the policy has none still (only fewer), and the scan is skipped."""
    return RemovableHandle.next_id


def fused_ppo_step(
    policy: nn.Module, model: nn.Module, loss_fn, compiled: bool, previous: FusedPPOStep | None = None
) -> tuple[FusedPPOStep | None, str | None]:
    """``(step, None)`` where the fused step can stand in for autograd, else ``(None, why)`` (:func:`unfit`'s
    checks, in its order). ``previous``, a step made for these very modules and parameters, is used again: what
    it holds still applies, and its hooks were checked already unless a hook was registered since (these checks
    run at each update)."""
    why = _unfit_as_called(policy, model, loss_fn, compiled)
    if why is not None:
        return None, why
    hooks = _hooks_registered()  # (read first: a hook registered during the checks is seen next time)
    walked = walk(policy)
    if previous is None or not previous.made_for(policy, model, walked):
        why = _unfit_trunks(policy)
        previous = None
    why = why or _unfit_now(policy, walked, previous is not None and previous.hooks_seen == hooks)
    if why is not None:
        return None, why
    step = previous or FusedPPOStep(policy, data_parallel_group(model, policy), walked)
    step.hooks_seen = hooks
    return step, None


class FusedPPOStep:
    """Loss and gradients of ``ppo_clip_value_entropy`` on an :class:`ActorCritic`, written into ``.grad``.

    Args:
        policy: an :class:`ActorCritic` that :func:`unfit` accepts.
        process_group: data-parallel ranks (:func:`data_parallel_group`): the gradients are then averaged over
            them in one all-reduce, as ``DistributedDataParallel`` averages them.
    """

    def __init__(self, policy: ActorCritic, process_group=None, walked: tuple | None = None):
        (self.actor_layers, self.actor_act), (self.critic_layers, self.critic_act) = _trunks(policy)
        self.discrete = policy.discrete
        self.log_std = None if self.discrete else policy.log_std
        self.process_group = process_group
        self.walked = walked or walk(policy)  # (held: none of their ids can come back)
        self.params = self.walked[1]  # (the same order on every rank)
        self.hooks_seen = -1  # _hooks_registered() when last found without hooks

    def made_for(self, policy: nn.Module, model: nn.Module, walked: tuple) -> bool:
        """Whether this step was made for ``policy`` as it is now (the very modules and parameters, the same
        data-parallel group): then it can be used again, given :func:`unfit`'s checks of hooks and frozen
        parameters."""
        return same_walk(walked, self.walked) and (data_parallel_group(model, policy) is self.process_group)

    @staticmethod
    def _forward(layers, activation, x):
        """The MLP's output and every layer's input (what the backward reads)."""
        inputs = []
        for weight, bias in layers[:-1]:
            inputs.append(x)
            x = activation[0](torch.addmm(bias, x, weight.t()))
        inputs.append(x)
        weight, bias = layers[-1]
        return torch.addmm(bias, x, weight.t()), inputs

    @staticmethod
    def _backward(layers, activation, inputs, grad):
        """Gradients of the MLP's parameters from the gradient of its output, layer by layer."""
        for i in range(len(layers) - 1, -1, -1):
            weight, bias = layers[i]
            weight.grad = grad.t() @ inputs[i]
            bias.grad = grad.sum(0)
            if i:
                grad = activation[1](grad @ weight, inputs[i])  # inputs[i] is layer i-1's activation output

    @torch.no_grad()
    def __call__(
        self, mb: dict, clip_coef: float, vf_coef: float, ent_coef: float, clip_vloss: bool, norm_adv: bool
    ) -> tuple[torch.Tensor, dict]:
        """``(loss, metrics)`` as ``ppo_clip_value_entropy`` returns them, with every parameter's ``.grad``
        set to the loss's gradient. Shapes: every tensor of ``mb`` is one minibatch, ``[M]`` (``obs``
        ``[M, ...]``, continuous ``actions`` ``[M, A]``)."""
        obs = mb["obs"].flatten(1)
        m = obs.shape[0]
        head, actor_inputs = self._forward(self.actor_layers, self.actor_act, obs)  # [M, A]
        value_out, critic_inputs = self._forward(self.critic_layers, self.critic_act, obs)
        values = value_out.squeeze(-1)  # [M]

        # the policy's log-probs and entropy: categorical over logits, or a diagonal Normal
        if self.discrete:
            actions = mb["actions"].long()[:, None]  # [M, 1]
            logp_all = torch.log_softmax(head, -1)  # [M, A]
            probs = logp_all.exp()
            logprobs = logp_all.gather(1, actions).squeeze(1)
            entropy = -(probs * logp_all).sum(-1)
        else:
            log_std = self.log_std
            std = log_std.exp()
            z = (mb["actions"] - head) / std  # [M, A]
            logprobs = (-0.5 * z.square() - log_std - _LOG_SQRT_2PI).sum(-1)
            entropy = (0.5 + _LOG_SQRT_2PI + log_std).sum().expand(m)

        # ppo_clip_value_entropy, as it reads
        logratio = logprobs - mb["logprobs"]
        ratio = logratio.exp()
        approx_kl = ((ratio - 1) - logratio).mean()
        clip_frac = ((ratio - 1.0).abs() > clip_coef).float().mean()
        advantages = mb["advantages"]
        if norm_adv and advantages.numel() > 1:
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        pg_loss1 = -advantages * ratio
        pg_loss2 = -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
        pg_loss = torch.max(pg_loss1, pg_loss2).mean()
        value_error = values - mb["returns"]
        if clip_vloss:
            old_values = mb["values"]
            v_clipped = old_values + torch.clamp(values - old_values, -clip_coef, clip_coef)
            clipped_error = v_clipped - mb["returns"]
            unclipped_sq, clipped_sq = value_error.square(), clipped_error.square()
            v_loss = 0.5 * torch.max(unclipped_sq, clipped_sq).mean()
        else:
            v_loss = 0.5 * value_error.square().mean()
        entropy_loss = entropy.mean()
        loss = pg_loss - ent_coef * entropy_loss + vf_coef * v_loss

        # d loss / d logprobs: the unclipped term's where it is the max (ties in range: the same value);
        # the clipped term's gradient is 0 outside the clip range
        grad_logprobs = torch.where(pg_loss1 >= pg_loss2, pg_loss1, 0.0).div_(m)  # [M]
        if self.discrete:
            # d logp_a / d z = onehot(a) - p;  d H / d z = -p * (log p + H)
            grad_head = probs * -grad_logprobs[:, None]
            grad_head.scatter_add_(1, actions, grad_logprobs[:, None])
            if ent_coef:
                grad_head.addcmul_(probs, logp_all + entropy[:, None], value=ent_coef / m)
        else:
            # d logp / d mean = z / std;  d logp / d log_std = z^2 - 1;  d H / d log_std = 1
            grad_head = (z / std).mul_(grad_logprobs[:, None])
            self.log_std.grad = (z.square() - 1).mul_(grad_logprobs[:, None]).sum(0) - ent_coef
        if clip_vloss:
            # torch.max splits a tie evenly; clamp passes the gradient inside its bounds, inclusive
            in_range = ((values - old_values).abs() <= clip_coef).to(values.dtype)
            tie = (unclipped_sq == clipped_sq).to(values.dtype) * 0.5
            grad_values = value_error * ((unclipped_sq > clipped_sq).to(values.dtype) + tie)
            grad_values += clipped_error * in_range * ((clipped_sq > unclipped_sq).to(values.dtype) + tie)
        else:
            grad_values = value_error
        grad_values = grad_values.mul(vf_coef / m)[:, None]  # [M, 1]

        self._backward(self.actor_layers, self.actor_act, actor_inputs, grad_head)
        self._backward(self.critic_layers, self.critic_act, critic_inputs, grad_values)
        if self.process_group is not None:  # DDP's average over ranks, in one all-reduce
            from rlnb.runtime.collective import all_reduce_

            flat = all_reduce_(torch.cat([p.grad.reshape(-1) for p in self.params]), self.process_group, True)
            for p, grad in zip(self.params, flat.split([p.numel() for p in self.params])):
                p.grad = grad.view_as(p)
        metrics = {
            "policy_loss": pg_loss,
            "value_loss": v_loss,
            "entropy": entropy_loss,
            "approx_kl": approx_kl,
            "clip_frac": clip_frac,
            "ratio_mean": ratio.mean(),
        }
        return loss, metrics


class FusedAct:
    """``ActorCritic.act`` of the built-in MLP policy with discrete actions, without module calls: the same
    kernels on the same values, so the same actions, log-probs and values bit for bit, and the same draws from
    the generator, with less dispatch (``docs/benchmarks.md``).

    Made by :func:`fused_act` at the start of a collection, where nothing can register a hook or unfreeze the
    policy until it ends, and used again by the next collection if the policy still fits.
    """

    def __init__(self, policy: ActorCritic, walked: tuple | None = None):
        self.walked = walked or walk(policy)  # (held: none of their ids can come back)
        self.hooks_seen = -1  # _hooks_registered() when last found without hooks
        (actor_layers, self.actor_act), (critic_layers, self.critic_act) = _trunks(policy)
        # transposed views, made once: weight syncs copy into the parameters in place, so they stay current
        self.actor_layers = [(w.t(), b) for w, b in actor_layers]
        self.critic_layers = [(w.t(), b) for w, b in critic_layers]

    @staticmethod
    def _mlp(layers, activation, x):
        for weight_t, bias in layers[:-1]:
            x = activation[0](torch.addmm(bias, x, weight_t))
        weight_t, bias = layers[-1]
        return torch.addmm(bias, x, weight_t)

    def __call__(
        self, obs: torch.Tensor, generator: torch.Generator | None = None, deterministic: bool = False
    ):
        """``(actions [B], logprob [B], value [B])``, as ``ActorCritic.act`` returns them."""
        x = obs.flatten(1)
        logp_all = torch.log_softmax(self._mlp(self.actor_layers, self.actor_act, x), dim=-1)  # (B, n)
        if deterministic:
            actions = logp_all.argmax(-1)
        else:
            actions = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(-1)
        logprob = logp_all.gather(-1, actions[:, None]).squeeze(-1)
        return actions, logprob, self._mlp(self.critic_layers, self.critic_act, x).squeeze(-1)

    def into(self, obs: torch.Tensor, generator: torch.Generator | None, actions: torch.Tensor):
        """``(logprob [B], value [B])`` of a sampling ``__call__``, its actions written into ``actions [B, 1]``
        (int64, multinomial's own shape): the same kernels and draws, into a buffer of the caller's."""
        x = obs.flatten(1)
        logp_all = torch.log_softmax(self._mlp(self.actor_layers, self.actor_act, x), dim=-1)  # (B, n)
        torch.multinomial(logp_all.exp(), 1, generator=generator, out=actions)
        logprob = logp_all.gather(-1, actions).squeeze(-1)
        return logprob, self._mlp(self.critic_layers, self.critic_act, x).squeeze(-1)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """``value [B]``, as ``ActorCritic.value`` returns it (the critic's kernels only)."""
        return self._mlp(self.critic_layers, self.critic_act, obs.flatten(1)).squeeze(-1)


def fused_act(policy: nn.Module, previous: FusedAct | None = None):
    """A :class:`FusedAct` for ``policy`` where it computes exactly what ``policy.act`` would (the built-in
    MLP ``ActorCritic`` with discrete actions, no hooks, frozen as a rollout's copy is: nothing to record for
    autograd), else ``policy.act`` itself. ``previous``, made for the very same modules and parameters, is used
    again, its hooks checked already unless a hook was registered since (see :func:`_hooks_registered`)."""
    if type(policy) is not ActorCritic or not policy.discrete or not isinstance(policy.trunk, nn.Flatten):
        return policy.act
    hooks = _hooks_registered()
    walked = walk(policy)
    if previous is not None and not same_walk(walked, previous.walked):
        previous = None
    if any(p.requires_grad for p in walked[1]):
        return policy.act
    if (previous is None or previous.hooks_seen != hooks) and _hooked(policy, walked):
        return policy.act
    act = previous or (FusedAct(policy, walked) if _trunks(policy) is not None else None)
    if act is None:
        return policy.act
    act.hooks_seen = hooks
    return act

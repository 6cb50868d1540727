"""SAC's continuous update with its gradients written out (``sac.kernel: fused``): the same update as
:meth:`rlnb.components.sac.SACLearner.update` (the same losses, noise draws and Adam steps; a test holds the
weights equal to autograd's within float rounding), over parameters kept in one flat tensor per optimizer.

Why: a 256-wide update on a CPU core is a few large matmuls and about 300 small ops, autograd's bookkeeping and
Adam's per-parameter loops. Here the twin Q-networks run as one batched matmul a layer, each ReLU's backward is one
op, and Adam is one fused step over each flat tensor (measured in ``docs/benchmarks.md``).

Shapes: ``B`` transitions, ``D`` observation and ``A`` action dims, ``[2, B, .]`` the twin Q-networks side by side.
A network's layers are ``(W [out, in], b [out])`` views into its flat tensor (and, made once, the views the
matmuls take: ``W`` transposed, the twins' ``b [2, 1, out]``); ``acts[i]`` is layer ``i``'s input.

Why few ops: beyond its 16 large matmuls, an update's time is mostly the dispatch of its small ops, whatever their
size (``docs/benchmarks.md``); so the policy's two forwards of an update (on the next observations for the target,
on the observations for its own step: the same weights) run as one.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rlnb.models.sac import LOG_STD_MAX, LOG_STD_MIN

LOG_2PI = math.log(2 * math.pi)


def _linears(module: nn.Module) -> list[nn.Linear]:
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


def _flatten(groups: list[list[nn.Parameter]], device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One flat tensor holding every parameter of ``groups`` in order, each parameter's data rebound to a view of
    it (so ``state_dict``, weight syncs and checkpoints see the same tensors); per group, a view over the whole
    group, shaped ``[len(group), *shape]`` (the group's parameters share a shape)."""
    params = [p for g in groups for p in g]
    flat = torch.empty(sum(p.numel() for p in params), device=device)
    spans, i = [], 0
    for g in groups:
        start = i
        for p in g:
            k = p.numel()
            flat[i : i + k].copy_(p.data.reshape(-1))
            p.data = flat[i : i + k].view_as(p)
            i += k
        spans.append(flat[start:i].view(len(g), *g[0].shape))
    return flat, spans


def _twin_layers(twin: nn.Module, device) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The twin Q-networks' parameters flat, each layer's two weights (and two biases) side by side: ``[(W [2,
    out, in], b [2, out])]``."""
    groups = []
    for l1, l2 in zip(_linears(twin.q1), _linears(twin.q2)):
        groups += [[l1.weight, l2.weight], [l1.bias, l2.bias]]
    flat, spans = _flatten(groups, device)
    return flat, list(zip(spans[0::2], spans[1::2]))


def _policy_layers(policy: nn.Module, device) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The squashed Gaussian's parameters flat: its trunk's layers, then the mean and log-std heads as one layer
    ``(W [2A, H], b [2A])`` (the mean's rows first)."""
    trunk = _linears(policy.trunk)
    groups = [[p] for lin in trunk for p in (lin.weight, lin.bias)]
    groups += [[policy.mean.weight, policy.log_std.weight], [policy.mean.bias, policy.log_std.bias]]
    flat, spans = _flatten(groups, device)
    layers = [(w[0], b[0]) for w, b in zip(spans[0:-2:2], spans[1:-2:2])]
    w, b = spans[-2], spans[-1]
    return flat, [*layers, (w.reshape(-1, w.shape[-1]), b.reshape(-1))]


def _adam_step(opt: torch.optim.Adam) -> None:
    """``opt.step()`` for an Adam over one parameter, as one fused op: torch's ``step()`` spends several times the
    op itself in Python (its grouping by device and dtype, a hook check), a tenth of an update here. The first
    step is ``opt.step()`` itself, which makes the state (the same tensors, so ``state_dict`` is unchanged)."""
    group = opt.param_groups[0]
    (p,) = group["params"]
    state = opt.state[p]
    if not state:
        opt.step()
        return
    beta1, beta2 = group["betas"]
    state["step"].add_(1)
    torch._fused_adam_(
        [p], [p.grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]],
        lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
        amsgrad=False, maximize=False, grad_scale=None, found_inf=None,
    )  # fmt: skip


def _relu_backward(grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``grad`` where the ReLU's output ``out`` is positive, else 0 (autograd's own op for a ReLU's backward)."""
    return torch.ops.aten.threshold_backward(grad, out, 0)


class FusedSAC:
    """The update of ``learner`` (a continuous :class:`~rlnb.components.sac.SACLearner`, built and not yet
    trained) with its gradients written out. Rebinds the learner's parameters to flat tensors and gives the learner
    its Q and policy optimizers: fused Adam over them at learning rate ``lr``."""

    def __init__(self, learner, lr: float):
        L = self.learner = learner
        dev = L.device
        self.q_flat, self.q_layers = _twin_layers(L.q, dev)
        self.qt_flat, self.qt_layers = _twin_layers(L.q_target, dev)
        self.p_flat, self.p_layers = _policy_layers(L.policy, dev)
        self.q_param = nn.Parameter(self.q_flat, requires_grad=False)
        self.p_param = nn.Parameter(self.p_flat, requires_grad=False)
        self.q_param.grad, self.p_param.grad = torch.zeros_like(self.q_flat), torch.zeros_like(self.p_flat)
        self.q_grads = self._grad_views(self.q_param.grad, self.q_flat, self.q_layers)
        self.p_grads = self._grad_views(self.p_param.grad, self.p_flat, self.p_layers)
        L.q_opt = torch.optim.Adam([self.q_param], lr=lr, fused=True)
        L.policy_opt = torch.optim.Adam([self.p_param], lr=lr, fused=True)
        self.act_dim = L.policy.mean.out_features
        self.scale, self.bias = L.policy.scale, L.policy.bias
        self.one = torch.ones((), device=dev)
        # the views the forwards take, made once (the flat tensors are updated in place, so they stay valid)
        self.q_fwd = [(w.transpose(1, 2), b.unsqueeze(1)) for w, b in self.q_layers]
        self.qt_fwd = [(w.transpose(1, 2), b.unsqueeze(1)) for w, b in self.qt_layers]
        self.p_fwd = [(w.t(), b) for w, b in self.p_layers]

    @staticmethod
    def _grad_views(
        grad: torch.Tensor, flat: torch.Tensor, layers
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``layers``' views moved from ``flat`` onto ``grad`` (the same offsets and strides)."""

        def same(t: torch.Tensor) -> torch.Tensor:
            return grad.as_strided(t.shape, t.stride(), t.storage_offset() - flat.storage_offset())

        return [(same(w), same(b)) for w, b in layers]

    # ------------------------------------------------------------------ networks
    @staticmethod
    def _twin(fwd, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Both Q-networks (their layers' :attr:`q_fwd` views) on ``x [B, D+A]``: ``q [2, B, 1]`` and each layer's
        input."""
        h, acts = x.expand(2, *x.shape), []
        last = len(fwd) - 1
        for i, (w_t, b) in enumerate(fwd):
            acts.append(h)
            h = torch.baddbmm(b, h, w_t)
            if i < last:
                h = h.relu_()
        return h, acts

    @staticmethod
    def _twin_backward(layers, acts, g: torch.Tensor, grads=None) -> torch.Tensor | None:
        """Back through both Q-networks from ``g = dL/dq [2, B, 1]``: into ``grads`` (their weights' gradients),
        or, with none, to the input: ``dL/dx [B, D+A]`` summed over the twins."""
        for i in range(len(layers) - 1, -1, -1):
            if grads is not None:
                torch.bmm(g.transpose(1, 2), acts[i], out=grads[i][0])
                torch.sum(g, 1, out=grads[i][1])
                if i == 0:
                    return None
            g = torch.bmm(g, layers[i][0])
            if i > 0:
                g = _relu_backward(g, acts[i])
        return g.sum(0)

    def _policy(self, obs: torch.Tensor, eps: torch.Tensor):
        """The squashed Gaussian on ``obs [B, D]`` with noise ``eps [B, A]``: the action ``[B, A]``, ``log pi
        [B]`` (as :meth:`~rlnb.models.sac.SquashedGaussianActor.sample`), and what the backward pass needs."""
        h, acts = obs, []
        for w_t, b in self.p_fwd[:-1]:
            acts.append(h)
            h = torch.addmm(b, h, w_t).relu_()
        acts.append(h)
        w_t, b = self.p_fwd[-1]
        head = torch.addmm(b, h, w_t)  # [B, 2A]
        half = 0.5 * (LOG_STD_MAX - LOG_STD_MIN)
        mean, t = head[:, : self.act_dim], torch.tanh(head[:, self.act_dim :])
        log_std = t.mul(half).add_(LOG_STD_MIN + half)  # LOG_STD_MIN + half (t + 1)
        std = log_std.exp()
        y = torch.addcmul(mean, std, eps).tanh_()  # u = mean + std eps, squashed
        ys = y * self.scale
        # tanh's and the rescaling's Jacobian, scale (1 - y^2) + 1e-6, rounded as the policy's own (the 1e-6 is
        # most of it where y is near +-1, so it is added last)
        jac = torch.addcmul(self.one, y, y, value=-1.0).mul_(self.scale).add_(1e-6)
        # Normal(mean, std).log_prob(u): its z = (u - mean) / std is eps
        logp = (eps * eps).mul_(-0.5).sub_(log_std).sub_(jac.log()).sum(-1).sub_(0.5 * LOG_2PI * self.act_dim)
        return ys.add_(self.bias), logp, (acts, t, std, y, jac, eps)

    @staticmethod
    def _rows(saved, rows: slice):
        """The policy's saved forward (``_policy``'s third value) for the batch's ``rows``."""
        acts, *rest = saved
        return ([a[rows] for a in acts], *(x[rows] for x in rest))

    def _policy_backward(self, d_action: torch.Tensor, d_logp: float, saved) -> None:
        """Into the policy's gradients, from ``dL/da [B, A]`` and ``dL/dlog pi`` (the same for every sample).
        Through the reparameterisation, ``log pi``'s Gaussian term depends on ``log_std`` only (its ``z`` is
        ``eps``), so ``d log pi / d log_std = -1`` and ``d log pi / dy = 2 scale y / jac``."""
        acts, t, std, y, jac, eps = saved
        dy = d_action * self.scale + d_logp * 2 * self.scale * y / jac
        du = dy * (1 - y * y)
        d_log_std = du * eps * std - d_logp
        d_head = torch.cat([du, d_log_std * (0.5 * (LOG_STD_MAX - LOG_STD_MIN)) * (1 - t * t)], -1)  # [B, 2A]
        g = d_head
        for i in range(len(self.p_layers) - 1, -1, -1):
            gw, gb = self.p_grads[i]
            torch.mm(g.t(), acts[i], out=gw)
            torch.sum(g, 0, out=gb)
            if i > 0:
                g = _relu_backward(torch.mm(g, self.p_layers[i][0]), acts[i])

    # ------------------------------------------------------------------ the update
    @torch.no_grad()
    def update(self, b: dict) -> dict:
        """One Q step, the policy (and alpha) steps and the target update, as :meth:`SACLearner.update`."""
        L = self.learner
        obs, next_obs = b["obs"].float(), b["next_obs"].float()
        n = obs.shape[0]
        alpha = L.alpha
        first_step = None
        if (L.updates + 1) % L.policy_delay == 0:
            # the target's next actions and the policy step's actions in one forward: the policy's weights are
            # the same for both (the noise drawn in the same order as two forwards draw it)
            eps = torch.cat([self._noise(n), self._noise(n)])
            act, logp, saved = self._policy(torch.cat([next_obs, obs]), eps)
            na, nlogp = act[:n], logp[:n]
            first_step = (act[n:], logp[n:], self._rows(saved, slice(n, None)))
        else:
            na, nlogp, _ = self._policy(next_obs, self._noise(n))
        nq, _ = self._twin(self.qt_fwd, torch.cat([next_obs, na], -1))
        soft_v = torch.minimum(nq[0, :, 0], nq[1, :, 0]).sub_(alpha * nlogp)
        y = (1.0 - b["terminated"].float()).mul_(b["discount"]).mul_(soft_v).add_(b["rewards"])
        q, acts = self._twin(self.q_fwd, torch.cat([obs, b["actions"].float()], -1))
        diff = q[:, :, 0] - y  # [2, B]
        self._twin_backward(self.q_layers, acts, (2.0 / n) * diff.unsqueeze(-1), self.q_grads)
        _adam_step(L.q_opt)
        q1_mean, q2_mean = q.mean((1, 2))
        # MSE(Q1, y) + MSE(Q2, y) and each Q's mean, as 0-d tensors: the figures are read out together at the end
        metrics = {"q_loss": (diff * diff).mean(1).sum(), "q1_mean": q1_mean, "q2_mean": q2_mean}
        L.updates += 1
        if L.updates % L.policy_delay == 0:
            for i in range(L.policy_delay):  # (CleanRL: as many policy steps as Q steps skipped)
                metrics.update(self._policy_step(obs, first_step if i == 0 else None))
        if L.updates % L.target_every == 0:
            self.qt_flat.lerp_(self.q_flat, L.tau)
        return dict(zip(metrics, torch.stack(list(metrics.values())).tolist()))

    def _noise(self, n: int) -> torch.Tensor:
        return torch.randn((n, self.act_dim), device=self.q_flat.device)

    def _policy_step(self, obs: torch.Tensor, forward=None) -> dict:
        """The policy's (and alpha's) step on ``obs``, from its ``forward`` already made (``_policy``'s values for
        ``obs``) or a fresh one. Returns its figures as 0-d tensors."""
        L = self.learner
        alpha = L.alpha
        n = obs.shape[0]
        a, logp, saved = forward if forward is not None else self._policy(obs, self._noise(n))
        qa, acts = self._twin(self.q_fwd, torch.cat([obs, a], -1))
        q1, q2 = qa[0, :, 0], qa[1, :, 0]
        actor_loss = (alpha * logp - torch.minimum(q1, q2)).mean()
        # torch.minimum's gradient: to the smaller, halved on a tie
        first = (q1 < q2).float() + 0.5 * (q1 == q2).float()
        d_q = torch.stack([first, 1 - first]).unsqueeze(-1) * (-1.0 / n)
        d_x = self._twin_backward(self.q_layers, acts, d_q)
        self._policy_backward(d_x[:, obs.shape[1] :], float(alpha) / n, saved)
        _adam_step(L.policy_opt)
        metrics = {"actor_loss": actor_loss, "entropy": -logp.mean()}
        if L.auto_alpha:
            shifted = logp + L.target_entropy
            metrics.update(alpha_loss=-(L.log_alpha * shifted).mean(), alpha=L.log_alpha.exp())
            L.log_alpha.grad = -shifted.mean().reshape(())
            _adam_step(L.alpha_opt)
        else:
            metrics["alpha"] = alpha.reshape(())
        return metrics


__all__ = ["FusedSAC"]

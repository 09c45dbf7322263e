"""ELLISAdam's formula as a plain single-tensor step, the reference the fused step is held to: tests/test_train_optim.py
(weights within 1e-6 after 10 steps) and bench/gpu_check.py's optimizer row (its time against the new step's).

Written for reading, not speed: about 30 tensor-sized passes per tensor, one host read per tensor (the clip).
Not in the package: the training has one step, huginn_ray.train.optim.ELLISAdam."""

from __future__ import annotations

import math

import torch


class ReferenceState:
    """One tensor's moments and step count."""

    def __init__(self, p: torch.Tensor):
        self.m = torch.zeros_like(p)
        self.v = torch.zeros_like(p)
        self.step = 0


@torch.no_grad()
def reference_step(group: dict, states: list[ReferenceState]) -> None:
    """One step of every tensor of `group` (an ELLISAdam param group: params, lr, init_lr, betas, eps,
    weight_decay and the four switches) that has a gradient; `states` in the order of its params."""
    lr, init_lr = group["lr"], group["init_lr"]
    beta1, beta2 = group["betas"]
    eps, wd = group["eps"], group["weight_decay"]
    for p, state in zip(group["params"], states):
        g = p.grad
        if g is None:
            continue
        if group["running_init"] and state.step == 0:
            state.m.copy_(g)
            state.v.copy_(g * g)
        state.m.lerp_(g, 1.0 - beta1)
        state.v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        step_size = lr
        if group["update_clipping"]:
            state.v.clamp_(min=eps * eps)
            step_size = lr / max(g.square().div(state.v).mean().sqrt().item(), 1.0)
        state.step += 1
        step_size /= 1.0 - beta1**state.step
        denom = state.v.sqrt().div_(math.sqrt(1.0 - beta2**state.step))
        if wd != 0.0:
            p.mul_(1.0 - (lr / init_lr) * wd if group["decouple_wd"] else 1.0 - lr * wd)
        update = torch.atan2(state.m, denom) if group["atan_adam"] else state.m / denom.add_(eps)
        p.add_(update, alpha=-step_size)

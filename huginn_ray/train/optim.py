"""Optimizers, parameter groups and the learning-rate schedule of the Huginn run (reference §3.5-§3.6).

Every parameter group carries a `base_lr` multiplier; the training loop writes `lr = schedule(step) * base_lr`
into every group before every step, so all groups follow the schedule, also after an optimizer state was
loaded from a checkpoint (loading replaces the group dicts, which is how the reference lost its schedule).
"""

from __future__ import annotations

import math

import torch
from torch import nn

EMBEDDING_MARKERS = ("wte", "embedding", "abacus", "lm_head")
NO_DECAY_MARKERS = ("ln_f", "norm", "bias", "diff_lmb")
MATRIX_MARKERS = ("proj", "qkv", "fc")


class ELLISAdam(torch.optim.Optimizer):
    """Adam with the options of the Huginn run: atan2 update, running init, update clipping, decoupled decay.

    Per tensor with gradient g (state `exp_avg` m, `exp_avg_sq` v, `step` t):
      first step: m = g, v = g^2 with `running_init` (else zeros);
      m <- m + (1 - b1)(g - m);  v <- b2 v + (1 - b2) g^2;
      `update_clipping`: v <- max(v, eps^2) in place, eta = lr / max(sqrt(mean(g^2 / v)), 1), else eta = lr
                         (the RMS stays on the device: no host sync per tensor);
      t <- t + 1;  eta <- eta / (1 - b1^t);
      decay: p <- p (1 - (lr / init_lr) wd) with `decouple_wd` (the schedule fraction, not the lr magnitude),
             p <- p (1 - lr wd) without it;
      `atan_adam`: u = atan2(m, sqrt(v) / sqrt(1 - b2^t)), else u = m / (sqrt(v) / sqrt(1 - b2^t) + eps);
      p <- p - eta u.
    `init_lr` is the constructor lr, kept in every group so that it survives `load_state_dict`.
    """

    def __init__(
        self,
        params,
        lr: float = 4e-5,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        update_clipping: bool = False,
        atan_adam: bool = False,
        running_init: bool = False,
        decouple_wd: bool = False,
        foreach: bool | None = None,
    ):
        if lr <= 0:
            raise ValueError(f"ELLISAdam: lr must be positive (it is also init_lr), got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"ELLISAdam: betas must lie in [0, 1), got {betas}")
        defaults = dict(
            lr=lr,
            init_lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            update_clipping=update_clipping,
            atan_adam=atan_adam,
            running_init=running_init,
            decouple_wd=decouple_wd,
        )
        super().__init__(params, defaults)
        self.foreach = foreach

    foreach: bool | None = None
    """True: the multi-tensor step (torch._foreach_* over each group); False: one tensor at a time; None
    (default): multi-tensor where it is faster, i.e. when the parameters live on a GPU (on CPU the foreach ops
    are loops over the same kernels). Both give the same result; it is an attribute, not a group option,
    so param_groups and state_dict keep their layout."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            foreach = self.foreach if self.foreach is not None else params[0].device.type != "cpu"
            if foreach:
                self._update_group(params, group)
            else:
                for p in params:
                    self._update(p, group)
        return loss

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if not state:
            g = p.grad
            state["step"] = torch.zeros((), dtype=torch.int64)
            if group["running_init"]:
                state["exp_avg"] = g.detach().clone()
                state["exp_avg_sq"] = g.detach().square()
            else:
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
        return state

    def _update(self, p: torch.Tensor, group: dict) -> None:
        """The single-tensor step. No host sync: the update-clipping RMS stays a device tensor."""
        g = p.grad
        lr, init_lr = float(group["lr"]), float(group["init_lr"])
        beta1, beta2 = group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        state = self._init_state(p, group)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)

        clip = None
        if group["update_clipping"]:
            v.clamp_(min=eps * eps)
            clip = g.square().div(v).mean().sqrt().clamp(min=1.0)  # the step is divided by max(rms, 1)
        state["step"] += 1
        t = int(state["step"])  # a CPU tensor: no device sync
        step_size = lr / (1.0 - beta1**t)
        denom = v.sqrt().div_(math.sqrt(1.0 - beta2**t))

        if wd != 0.0:
            p.mul_(1.0 - (lr / init_lr) * wd if group["decouple_wd"] else 1.0 - lr * wd)
        update = torch.atan2(m, denom) if group["atan_adam"] else m / denom.add_(eps)
        if clip is not None:
            update.div_(clip)
        p.add_(update, alpha=-step_size)

    def _update_group(self, params: list[torch.Tensor], group: dict) -> None:
        """The multi-tensor step: the same operations as `_update`, each over all tensors of the group at once."""
        lr, init_lr = float(group["lr"]), float(group["init_lr"])
        beta1, beta2 = group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        states = [self._init_state(p, group) for p in params]
        grads = [p.grad for p in params]
        ms = [state["exp_avg"] for state in states]
        vs = [state["exp_avg_sq"] for state in states]
        torch._foreach_lerp_(ms, grads, 1.0 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, grads, grads, value=1.0 - beta2)

        clips = None
        if group["update_clipping"]:
            torch._foreach_clamp_min_(vs, eps * eps)
            ratios = torch._foreach_div(torch._foreach_mul(grads, grads), vs)
            clips = [r.mean().sqrt().clamp(min=1.0) for r in ratios]
            del ratios
        steps = [state["step"] for state in states]
        torch._foreach_add_(steps, 1)
        ts = [int(step) for step in steps]  # CPU tensors: no device sync
        denoms = torch._foreach_sqrt(vs)
        torch._foreach_div_(denoms, [math.sqrt(1.0 - beta2**t) for t in ts])

        if wd != 0.0:
            torch._foreach_mul_(params, 1.0 - (lr / init_lr) * wd if group["decouple_wd"] else 1.0 - lr * wd)
        if group["atan_adam"]:
            updates = [torch.atan2(m, d) for m, d in zip(ms, denoms)]
        else:
            torch._foreach_add_(denoms, eps)
            updates = torch._foreach_div(ms, denoms)
        del denoms
        if clips is not None:
            torch._foreach_div_(updates, clips)
        step_sizes = [lr / (1.0 - beta1**t) for t in ts]
        if all(size == step_sizes[0] for size in step_sizes):  # the usual case: every tensor at the same step
            torch._foreach_add_(params, updates, alpha=-step_sizes[0])
        else:
            for p, update, size in zip(params, updates, step_sizes):
                p.add_(update, alpha=-size)


def param_groups(model: nn.Module, weight_decay: float, no_decay_for_bias_and_norm: bool = True) -> list[dict]:
    """The three groups of the reference: 0 weights (decayed), 1 embedding (decayed), 2 norms/biases (no decay).

    Membership is by lower-cased parameter name; tied parameters appear once (named_parameters deduplicates).
    """
    weights, embedding, scales = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        lname = name.lower()
        if any(m in lname for m in EMBEDDING_MARKERS):
            embedding.append(p)
        elif any(m in lname for m in NO_DECAY_MARKERS):
            scales.append(p)
        elif p.ndim >= 2 or any(m in lname for m in MATRIX_MARKERS):
            weights.append(p)
        else:
            raise ValueError(f"param_groups: parameter {name!r} (shape {tuple(p.shape)}) fits no group")
    scale_decay = 0.0 if no_decay_for_bias_and_norm else weight_decay
    groups = [
        dict(name="weights", params=weights, base_lr=1.0, weight_decay=weight_decay),
        dict(name="embedding", params=embedding, base_lr=1.0, weight_decay=weight_decay),
        dict(name="scale_norm", params=scales, base_lr=1.0, weight_decay=scale_decay),
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg, keep=None) -> torch.optim.Optimizer:
    """`cfg` is an `OptimConfig` (huginn_ray.train.config). `keep(param)`, if given, selects the parameters this
    optimizer steps (node-local sharding, huginn_ray.train.sharding); the three groups stay, possibly empty."""
    groups = param_groups(model, cfg.weight_decay, cfg.no_weight_decay_for_bias_and_norm)
    if keep is not None:
        groups = [dict(g, params=[p for p in g["params"] if keep(p)]) for g in groups]
    if cfg.name == "ELLISAdam":
        return ELLISAdam(
            groups,
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            update_clipping=cfg.update_clipping,
            atan_adam=cfg.atan_adam,
            running_init=cfg.running_init,
            decouple_wd=cfg.decouple_wd,
            foreach=cfg.foreach,
        )
    if cfg.name == "AdamW":
        # foreach=False: the single-tensor path gives the same bits on every run on CPU.
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=False)
    raise ValueError(f"optim.name: unknown optimizer {cfg.name!r}")


def trapezoid_lr(step: int, max_lr: float, warmup_steps: int, cooldown_steps: int, max_steps: int, min_lr: float) -> float:
    """Linear warmup from 0, constant `max_lr`, linear cooldown to `min_lr` over the last `cooldown_steps`.

    `step` is the 1-based micro-batch step (reference §3.6).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return max_lr * step / warmup_steps
    if cooldown_steps > 0 and step > max_steps - cooldown_steps:
        return max(max_lr * (max_steps - step) / cooldown_steps, min_lr)
    return max_lr


def set_lr(optimizer: torch.optim.Optimizer, lr: float, reference_quirk: bool = False, resumed: bool = False) -> None:
    """Write the scheduled lr (times each group's base_lr) into every group.

    `reference_quirk` reproduces, for forensic comparison, what the reference's ZeRO wrapper did (§3.5): the
    weight matrices keep the constructor lr from the first step on, and after a resume no group follows the
    schedule any more (each keeps the lr stored in the checkpoint)."""
    if reference_quirk and resumed:
        return
    for group in optimizer.param_groups:
        if reference_quirk and group.get("name") == "weights":
            group["lr"] = group.get("init_lr", group["lr"])
            continue
        group["lr"] = lr * group.get("base_lr", 1.0)

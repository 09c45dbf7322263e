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
      `update_clipping`: v <- max(v, eps^2) in place, eta = lr / max(sqrt(mean(g^2 / v)), 1), else eta = lr;
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

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        g = p.grad
        lr, init_lr = float(group["lr"]), float(group["init_lr"])
        beta1, beta2 = group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.int64)
            if group["running_init"]:
                state["exp_avg"] = g.detach().clone()
                state["exp_avg_sq"] = g.detach().square()
            else:
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)

        step_size = lr
        if group["update_clipping"]:
            v.clamp_(min=eps * eps)
            rms = g.square().div(v).mean().sqrt().item()
            step_size = lr / max(rms, 1.0)
        state["step"] += 1
        t = int(state["step"])
        step_size /= 1.0 - beta1**t
        denom = v.sqrt().div_(math.sqrt(1.0 - beta2**t))

        if wd != 0.0:
            p.mul_(1.0 - (lr / init_lr) * wd if group["decouple_wd"] else 1.0 - lr * wd)
        if group["atan_adam"]:
            p.add_(torch.atan2(m, denom), alpha=-step_size)
        else:
            p.add_(m / denom.add_(eps), alpha=-step_size)


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

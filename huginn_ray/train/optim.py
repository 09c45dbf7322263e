"""Optimizers, parameter groups and the learning-rate schedule of the Huginn run (reference §3.5-§3.6).

Every parameter group carries a `base_lr` multiplier; the training loop writes `lr = schedule(step) * base_lr`
into every group before every step, so all groups follow the schedule, also after an optimizer state was
loaded from a checkpoint (loading replaces the group dicts, which is how the reference lost its schedule).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from huginn_ray.train.parallel import local, shard_group

EMBEDDING_MARKERS = ("wte", "lm_head")
"""Names of the embedding group (the head only when untied): the reference's markers that name a parameter here."""
NO_DECAY_MARKERS = ("ln_f", "norm", "bias")
"""Names of the norm/bias group: every norm weight, `qk_bias`, `ln_f.weight`."""


def step_scratch_bytes(tensor_bytes_by_group: list[list[int]], update_clipping: bool, scalar_bytes: int) -> int:
    """Peak bytes ELLISAdam's eager step allocates beyond the parameters, gradients and state, for groups of
    tensors of `tensor_bytes` (this rank's parts, every tensor with a gradient), each small tensor a
    `scalar_bytes` allocation (4 on the CPU; 512, the CUDA caching allocator's smallest block, on GPUs). It peaks
    in the largest tensor's update: its denominator (the update is written over it), and with update clipping
    one sum of g^2 / v per tensor (kept for the whole step) and three scalars of the clip's chain. The compiled step
    holds no tensor-sized scratch: there the plan errs safe."""
    tensors = sum(len(sizes) for sizes in tensor_bytes_by_group)
    largest = max((max(sizes) for sizes in tensor_bytes_by_group if sizes), default=0)
    return largest + ((tensors + 3) * scalar_bytes if update_clipping else 0)


def moments_(g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, beta1: float, beta2: float, eps_sq: float,
             update_clipping: bool) -> torch.Tensor | None:
    """One tensor's moments in place; with update clipping v floored at eps^2 and the sum of g^2 / v returned
    (a device scalar). Eager: 8 passes over the tensor (lerp 3, mul 2, addcmul 3), with update clipping 14 (lerp
    3, g^2 2, lerp 3, floor 2, divide 3, sum 1); compiled, one kernel: 5 (reads g, m, v, writes m, v)."""
    m.lerp_(g, 1.0 - beta1)
    if not update_clipping:
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        return None
    squares = g * g
    v.lerp_(squares, 1.0 - beta2).clamp_(min=eps_sq)
    return squares.div_(v).sum()


def update_(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, total: torch.Tensor | None, numel: int,
            step_size: float, bias_correction2: float, decay: float, eps: float, atan_adam: bool,
            decays: bool) -> None:
    """One tensor's step in place: p <- p decay - step_size / clip * u, u = atan2(m, sqrt(v) / sqrt(1 - b2^t))
    (or m / (sqrt(v) / sqrt(1 - b2^t) + eps); `bias_correction2` is sqrt(1 - b2^t)), clip = max(sqrt(total /
    numel), 1) with update clipping (`total` the sum of g^2 / v over the whole tensor of `numel` elements, also
    when this rank holds a shard). The floats become arguments of the compiled kernel, not constants: a new lr
    does not recompile. Eager: 12 passes with decay (sqrt 2, bias correction 2, atan2 3 into the denominator,
    decay 2, add 3; the division form 2 more), 10 without; compiled, one kernel: 4 (reads p, m, v, writes p)."""
    denom = v.sqrt().div_(bias_correction2)
    update = torch.atan2(m, denom, out=denom) if atan_adam else torch.div(m, denom.add_(eps), out=denom)
    if decays:  # a flag, not a test of `decay`: a branch on a float argument would recompile at each new lr
        p.mul_(decay)
    if total is None:
        p.add_(update, alpha=-step_size)
    else:  # the clip stays on the device: no host sync
        p.addcmul_(update, -step_size / total.div(numel).sqrt().clamp(min=1.0))


@functools.cache
def compiled_kernels() -> tuple:
    """`moments_` and `update_` compiled (torch.compile, shape-generic over flat tensors): each one fused kernel
    per tensor. Compiled at the first step that takes them, once per process."""
    return (torch.compile(moments_, dynamic=True, fullgraph=True),
            torch.compile(update_, dynamic=True, fullgraph=True))


class ELLISAdam(torch.optim.Optimizer):
    """Adam with the options of the Huginn run: atan2 update, running init, update clipping, decoupled decay.

    Per tensor with gradient g (state `exp_avg` m, `exp_avg_sq` v, `step` t):
      first step: m = g, v = g^2 with `running_init` (else zeros);
      m <- m + (1 - b1)(g - m);  v <- v + (1 - b2)(g^2 - v) (b2 v + (1 - b2) g^2 without update clipping);
      `update_clipping`: v <- max(v, eps^2) in place, eta = lr / max(sqrt(mean(g^2 / v)), 1), else eta = lr
                         (the RMS stays on the device: no host sync per tensor; the mean is over the whole
                         tensor also when it is sharded: the step sums every sharded tensor's local part in one
                         all-reduce over the shard group, so sharded ELLISAdam equals whole ELLISAdam);
      t <- t + 1;  eta <- eta / (1 - b1^t);
      decay: p <- p (1 - (lr / init_lr) wd) with `decouple_wd` (the schedule fraction, not the lr magnitude),
             p <- p (1 - lr wd) without it;
      `atan_adam`: u = atan2(m, sqrt(v) / sqrt(1 - b2^t)), else u = m / (sqrt(v) / sqrt(1 - b2^t) + eps);
      p <- p - eta u.
    `init_lr` is the constructor lr, kept in every group so that it survives `load_state_dict`.

    The step runs two functions per tensor, `moments_` (then one all-reduce of the sharded tensors' sums) and
    `update_`, in place on this rank's part. Passes over memory per tensor (a pass: one tensor-sized read or
    write), with the Huginn options (update clipping, atan2, decay): compiled (`compiled`, the default on GPUs)
    9, one kernel reading g, m, v and writing m, v, one reading p, m, v and writing p (fused AdamW: 7); eager
    26 (14 + 12; the step it replaced took 30, with more launches). `running_init` adds 3 passes at the first step.
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
        compiled: bool | None = None,
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
        self.compiled = compiled
        for group in self.param_groups:  # the state exists from the start (see `_init_state`)
            for p in group["params"]:
                self._init_state(p)

    compiled: bool | None = None
    """True: the step's two functions compiled (`compiled_kernels`), one fused kernel each per tensor; False:
    eager; None (default): compiled when the parameters live on a GPU, eager on the CPU (where compiling costs
    seconds at every worker's start). It is an attribute, not a group option, so param_groups and state_dict keep
    their layout. Both give the same result to rounding."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(group, [p for p in group["params"] if p.grad is not None]) for group in self.param_groups]
        work = [(group, params) for group, params in work if params]
        if not work:
            return loss
        compiled = self.compiled if self.compiled is not None else local(work[0][1][0]).device.type != "cpu"
        moments, update = compiled_kernels() if compiled else (moments_, update_)
        # 1. moments, and per tensor the sum of g^2 / v over this rank's part (update clipping)
        sums = [[self._moments(moments, p, group) for p in params] for group, params in work]
        # 2. whole-tensor sums of sharded tensors: one all-reduce over the shard group for every tensor of the step
        self._sum_over_shards(work, sums)
        # 3. the update, each tensor scaled down by max(RMS(g / sqrt(v)), 1) of the whole tensor
        for (group, params), group_sums in zip(work, sums):
            lr, init_lr = float(group["lr"]), float(group["init_lr"])
            beta1, beta2 = group["betas"]
            wd = group["weight_decay"]
            decay = 1.0 - (lr / init_lr) * wd if group["decouple_wd"] else 1.0 - lr * wd
            for p, total in zip(params, group_sums):
                state = self.state[p]
                state["step"] += 1
                t = int(state["step"])  # a host tensor: no device sync
                update(flat(p), flat(state["exp_avg"]), flat(state["exp_avg_sq"]), total, p.numel(),
                       lr / (1.0 - beta1**t), math.sqrt(1.0 - beta2**t), decay, group["eps"], group["atan_adam"],
                       wd != 0.0)
        return loss

    def _init_state(self, p: torch.Tensor) -> None:
        """Zero moments shaped and placed like the parameter (sharded like it under hsdp), `step` 0 on the host.

        Created with the optimizer, not at the first step: a checkpoint (torch.distributed.checkpoint) written or
        read before the first step then finds the state in place. DCP would otherwise create it with a fake
        step on zero gradients, which would take ELLISAdam's running init from a zero gradient and count a step.
        `running_init` is applied at the first real step instead (`_moments`)."""
        self.state[p] = {"step": torch.zeros((), dtype=torch.int64), "exp_avg": torch.zeros_like(p.detach()),
                         "exp_avg_sq": torch.zeros_like(p.detach())}

    def _moments(self, moments, p: torch.Tensor, group: dict) -> torch.Tensor | None:
        """`moments` (eager or compiled `moments_`) over one tensor's local part; `running_init` before its
        first update sets the moments to the first gradient and its square."""
        state = self.state[p]
        g, m, v = flat(p.grad), flat(state["exp_avg"]), flat(state["exp_avg_sq"])
        if group["running_init"] and int(state["step"]) == 0:  # a host tensor: no device sync
            m.copy_(g)
            torch.mul(g, g, out=v)
        beta1, beta2 = group["betas"]
        return moments(g, m, v, beta1, beta2, group["eps"] ** 2, group["update_clipping"])

    @staticmethod
    def _sum_over_shards(work: list, sums: list[list]) -> None:
        """Replace each sharded tensor's local sum by the sum over its shard group, in place, with one
        all-reduce for all of them (whole tensors keep theirs)."""
        sharded = [(i, j) for i, (_, params) in enumerate(work) for j, p in enumerate(params)
                   if isinstance(p, DTensor) and sums[i][j] is not None]
        if not sharded:
            return
        group = shard_group([work[i][1][j] for i, j in sharded])
        totals = torch.stack([sums[i][j] for i, j in sharded])
        dist.all_reduce(totals, group=group)
        for (i, j), total in zip(sharded, totals):
            sums[i][j] = total


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor as a flat view (the step's functions write through it): one compiled graph
    serves every shape."""
    return local(tensor).view(-1)


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
        elif p.ndim >= 2:
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


def adamw_fused(device: torch.device) -> bool:
    """AdamW's step as one fused kernel (torch's `fused=True`) on an accelerator that has it (CUDA, ROCm); on the
    CPU the single-tensor step, which gives the same bits on every run (the exact tests' path)."""
    return device.type != "cpu" and device.type in _get_fused_kernels_supported_devices()


def build_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """`cfg` is an `OptimConfig` (huginn_ray.train.config)."""
    groups = param_groups(model, cfg.weight_decay, cfg.no_weight_decay_for_bias_and_norm)
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
            compiled=cfg.compile_step,
        )
    if cfg.name == "AdamW":
        device = local(groups[0]["params"][0]).device
        fused = adamw_fused(device)
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused,
                                      foreach=None if fused else False)
        # the state AdamW's first step would create (see ELLISAdam._init_state for why it must exist from the
        # start); the fused kernel keeps its step counts on the parameters' device
        for group in optimizer.param_groups:
            for p in group["params"]:
                step = torch.zeros((), dtype=torch.float32, device=device if fused else "cpu")
                optimizer.state[p] = {"step": step, "exp_avg": torch.zeros_like(p.detach()),
                                      "exp_avg_sq": torch.zeros_like(p.detach())}
        return optimizer
    raise ValueError(f"optim.name: unknown optimizer {cfg.name!r}")


def optimizer_of(group: dict) -> str:
    """Which optimizer made a param group: only ELLISAdam's carry `atan_adam` (AdamW's loading adds its own keys
    to any group, so its keys tell nothing)."""
    return "ELLISAdam" if "atan_adam" in group else "AdamW"


def configured_group_options(cfg) -> dict[str, dict]:
    """Every hyperparameter the config (`OptimConfig`) puts into each param group, by group name, the lr aside
    (set_lr writes it before every step)."""
    shared = {"betas": tuple(cfg.betas), "eps": cfg.eps}
    if cfg.name == "ELLISAdam":
        shared |= {"init_lr": cfg.lr, "update_clipping": cfg.update_clipping, "atan_adam": cfg.atan_adam,
                   "running_init": cfg.running_init, "decouple_wd": cfg.decouple_wd}
    scale_decay = 0.0 if cfg.no_weight_decay_for_bias_and_norm else cfg.weight_decay
    return {"weights": {**shared, "weight_decay": cfg.weight_decay},
            "embedding": {**shared, "weight_decay": cfg.weight_decay},
            "scale_norm": {**shared, "weight_decay": scale_decay}}


def config_field(group: str, key: str) -> str:
    """The config field a param-group hyperparameter comes from."""
    if key == "init_lr":
        return "optim.lr"
    if group == "scale_norm" and key == "weight_decay":
        return "optim.weight_decay of norms and biases (optim.no_weight_decay_for_bias_and_norm)"
    return f"optim.{key}"


def apply_config_on_resume(optimizer: torch.optim.Optimizer, cfg, verbose: bool = False) -> list[str]:
    """Right after a checkpoint's optimizer state was loaded, which brings the checkpoint's param groups: write
    every hyperparameter the config gives (configured_group_options) into every group, so that the run trains
    with what its config says. Returns, and with `verbose` prints, one line per config field whose value differs
    from the checkpoint's. Raises ValueError naming the field when the change cannot be honoured: another
    optimizer (`optim.name`: the moments mean something else), or a group the config does not make."""
    wanted = configured_group_options(cfg)
    changes: dict[tuple, None] = {}  # (field, checkpoint's value, config's value), in order, each once
    for group in optimizer.param_groups:
        if optimizer_of(group) != cfg.name:
            raise ValueError(f"optim.name={cfg.name}, but the checkpoint's optimizer state is {optimizer_of(group)}'s: "
                             "its moments do not carry over")
        name = group.get("name")
        if name not in wanted:
            raise ValueError(f"the checkpoint's parameter group {name!r} is none of the config's ({', '.join(wanted)})")
        for key, value in wanted[name].items():
            stored = tuple(group[key]) if isinstance(group.get(key), list) else group.get(key)
            if stored != value:
                changes[(config_field(name, key), stored, value)] = None
            group[key] = value
    lines = [f"[huginn] resume: {field} {stored} -> {value} (config)" for field, stored, value in changes]
    if verbose:
        for line in lines:
            print(line, flush=True)
    return lines


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

"""Optimizers, parameter groups and the learning-rate schedule of the Huginn run (reference §3.5-§3.6).

Every parameter group carries a `base_lr` multiplier; the training loop writes `lr = schedule(step) * base_lr`
into every group before every step, so all groups follow the schedule, also after an optimizer state was
loaded from a checkpoint (loading replaces the group dicts, which is how the reference lost its schedule).
"""

from __future__ import annotations

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
STEP_BUCKET_BYTES = 64 * 2**20
"""ELLISAdam's multi-tensor step covers a group in buckets of consecutive tensors of at most this many bytes (a
larger tensor is a bucket of its own): its scratch is one bucket's size instead of a group's."""


def step_buckets(tensor_bytes: list[int], foreach: bool) -> list[range]:
    """The tensors (of a group, by their bytes) ELLISAdam's step treats together: consecutive runs of at most
    STEP_BUCKET_BYTES, a larger tensor alone, with `foreach`; one tensor at a time without."""
    buckets, start, size = [], 0, 0
    for i, nbytes in enumerate(tensor_bytes):
        if i > start and (not foreach or size + nbytes > STEP_BUCKET_BYTES):
            buckets.append(range(start, i))
            start, size = i, 0
        size += nbytes
    if tensor_bytes:
        buckets.append(range(start, len(tensor_bytes)))
    return buckets


def step_scratch_bytes(tensor_bytes_by_group: list[list[int]], foreach: bool, update_clipping: bool,
                       scalar_bytes: int) -> int:
    """Peak bytes ELLISAdam's step allocates beyond the parameters, gradients and state, for groups of tensors of
    `tensor_bytes` (this rank's parts, every tensor with a gradient). It peaks where a bucket's update begins:
    the bucket's denominators (its bytes; the update is written over them), and with update clipping one scalar
    per tensor (the sum of g^2 / v, kept for the whole step) and one per tensor of the bucket (its clip
    factor), each a `scalar_bytes` allocation (4 on the CPU; 512, the CUDA caching allocator's smallest block,
    on GPUs). The moments' g^2 / v scratch before it is one bucket too, with fewer scalars."""
    tensors = sum(len(sizes) for sizes in tensor_bytes_by_group)
    peak = 0
    for sizes in tensor_bytes_by_group:
        for bucket in step_buckets(sizes, foreach):
            scalars = (tensors + len(bucket)) * scalar_bytes if update_clipping else 0
            peak = max(peak, sum(sizes[i] for i in bucket) + scalars)
    return peak


class ELLISAdam(torch.optim.Optimizer):
    """Adam with the options of the Huginn run: atan2 update, running init, update clipping, decoupled decay.

    Per tensor with gradient g (state `exp_avg` m, `exp_avg_sq` v, `step` t):
      first step: m = g, v = g^2 with `running_init` (else zeros);
      m <- m + (1 - b1)(g - m);  v <- b2 v + (1 - b2) g^2;
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
        for group in self.param_groups:  # the state exists from the start (see `_init_state`)
            for p in group["params"]:
                self._init_state(p)

    foreach: bool | None = None
    """True: the multi-tensor step (torch._foreach_* over buckets of each group); False: one tensor at a time; None
    (default): multi-tensor when the parameters live on a GPU, where it saves a launch per small tensor (on CPU
    the foreach ops are loops over the same kernels). A bucket of one tensor takes the single-tensor ops either
    way. Both give the same result; it is an attribute, not a group option,
    so param_groups and state_dict keep their layout. Either way the step's scratch is bounded: the
    multi-tensor ops run over buckets of at most STEP_BUCKET_BYTES (`step_buckets`), each op in place where
    the maths allows, and each update is written over its denominator (`step_scratch_bytes` counts it)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(group, [p for p in group["params"] if p.grad is not None]) for group in self.param_groups]
        work = [(group, params) for group, params in work if params]
        foreach = self.foreach if self.foreach is not None else any(local(ps[0]).device.type != "cpu" for _, ps in work)
        # each multi-tensor op covers one bucket (bounded bytes): its scratch is a bucket's, not a group's
        work = [(group, [params[i] for i in bucket]) for group, params in work
                for bucket in step_buckets([local(p).numel() * local(p).element_size() for p in params], foreach)]
        # 1. moments, and per tensor the sum of g^2 / v over this rank's part (update clipping)
        # a bucket of one (large) tensor takes the single-tensor ops: a foreach kernel over one large tensor is
        # slower than the plain kernel (BENCHMARKS.md "GPU check": 0.90x over nebel-width's tensors on an H100)
        sums = [self._moments_group(params, group) if len(params) > 1 else [self._moments(params[0], group)]
                for group, params in work]
        # 2. whole-tensor sums of sharded tensors: one all-reduce over the shard group for every tensor of the step
        self._sum_over_shards(work, sums)
        # 3. the update, each tensor scaled down by max(RMS(g / sqrt(v)), 1) of the whole tensor
        for (group, params), group_sums in zip(work, sums):
            clips = [None if total is None else total.div(p.numel()).sqrt().clamp(min=1.0)
                     for p, total in zip(params, group_sums)]
            if len(params) > 1:
                self._apply_group(params, group, clips)
            else:
                self._apply(params[0], group, clips[0])
        return loss

    def _init_state(self, p: torch.Tensor) -> None:
        """Zero moments shaped and placed like the parameter (sharded like it under hsdp), `step` 0 on the host.

        Created with the optimizer, not at the first step: a checkpoint (torch.distributed.checkpoint) written or
        read before the first step then finds the state in place. DCP would otherwise create it with a fake
        step on zero gradients, which would take ELLISAdam's running init from a zero gradient and count a step.
        `running_init` is applied at the first real step instead (`_first_moments`)."""
        self.state[p] = {"step": torch.zeros((), dtype=torch.int64), "exp_avg": torch.zeros_like(p.detach()),
                         "exp_avg_sq": torch.zeros_like(p.detach())}

    @staticmethod
    def _first_moments(state: dict, g: torch.Tensor, group: dict) -> None:
        """`running_init`: before the first update the moments are the first gradient and its square."""
        if group["running_init"] and int(state["step"]) == 0:  # a host tensor: no device sync
            local(state["exp_avg"]).copy_(g)
            torch.mul(g, g, out=local(state["exp_avg_sq"]))

    def _moments(self, p: torch.Tensor, group: dict) -> torch.Tensor | None:
        """Single tensor: m and v updated in place (this rank's part); with update clipping, v floored at eps^2
        and the sum of g^2 / v returned as a device scalar (no host sync)."""
        beta1, beta2 = group["betas"]
        g = local(p.grad)
        state = self.state[p]
        self._first_moments(state, g, group)
        m, v = local(state["exp_avg"]), local(state["exp_avg_sq"])
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        if not group["update_clipping"]:
            return None
        v.clamp_(min=group["eps"] ** 2)
        return g.square().div_(v).sum()

    def _apply(self, p: torch.Tensor, group: dict, clip: torch.Tensor | None) -> None:
        """Single tensor: bias corrections, weight decay and the (clipped) step."""
        lr, init_lr = float(group["lr"]), float(group["init_lr"])
        beta1, beta2 = group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        state = self.state[p]
        m, v, param = local(state["exp_avg"]), local(state["exp_avg_sq"]), local(p)
        state["step"] += 1
        t = int(state["step"])  # a host tensor: no device sync
        step_size = lr / (1.0 - beta1**t)
        denom = v.sqrt().div_(math.sqrt(1.0 - beta2**t))
        if wd != 0.0:
            param.mul_(1.0 - (lr / init_lr) * wd if group["decouple_wd"] else 1.0 - lr * wd)
        # the update is written over denom: one tensor of scratch
        update = torch.atan2(m, denom, out=denom) if group["atan_adam"] else torch.div(m, denom.add_(eps), out=denom)
        if clip is not None:
            update.div_(clip)
        param.add_(update, alpha=-step_size)

    def _moments_group(self, params: list[torch.Tensor], group: dict) -> list[torch.Tensor | None]:
        """Multi-tensor `_moments`: the same operations, each over all tensors of the group at once."""
        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in params]
        grads = [local(p.grad) for p in params]
        for state, g in zip(states, grads):
            self._first_moments(state, g, group)
        ms = [local(state["exp_avg"]) for state in states]
        vs = [local(state["exp_avg_sq"]) for state in states]
        torch._foreach_lerp_(ms, grads, 1.0 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, grads, grads, value=1.0 - beta2)
        if not group["update_clipping"]:
            return [None] * len(params)
        torch._foreach_clamp_min_(vs, group["eps"] ** 2)
        ratios = torch._foreach_mul(grads, grads)
        torch._foreach_div_(ratios, vs)
        return [ratio.sum() for ratio in ratios]

    def _apply_group(self, params: list[torch.Tensor], group: dict, clips: list[torch.Tensor | None]) -> None:
        """Multi-tensor `_apply`."""
        lr, init_lr = float(group["lr"]), float(group["init_lr"])
        beta1, beta2 = group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        states = [self.state[p] for p in params]
        ms = [local(state["exp_avg"]) for state in states]
        vs = [local(state["exp_avg_sq"]) for state in states]
        tensors = [local(p) for p in params]
        steps = [state["step"] for state in states]
        torch._foreach_add_(steps, 1)
        ts = [int(step) for step in steps]  # host tensors: no device sync
        denoms = torch._foreach_sqrt(vs)
        torch._foreach_div_(denoms, [math.sqrt(1.0 - beta2**t) for t in ts])
        if wd != 0.0:
            torch._foreach_mul_(tensors, 1.0 - (lr / init_lr) * wd if group["decouple_wd"] else 1.0 - lr * wd)
        # each update is written over its denominator (no multi-tensor op writes m / d into d): one bucket of scratch
        if group["atan_adam"]:
            updates = [torch.atan2(m, d, out=d) for m, d in zip(ms, denoms)]
        else:
            torch._foreach_add_(denoms, eps)
            updates = [torch.div(m, d, out=d) for m, d in zip(ms, denoms)]
        if clips[0] is not None:
            torch._foreach_div_(updates, clips)
        step_sizes = [lr / (1.0 - beta1**t) for t in ts]
        if all(size == step_sizes[0] for size in step_sizes):  # the usual case: every tensor at the same step
            torch._foreach_add_(tensors, updates, alpha=-step_sizes[0])
        else:
            for param, update, size in zip(tensors, updates, step_sizes):
                param.add_(update, alpha=-size)

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
            foreach=cfg.foreach,
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

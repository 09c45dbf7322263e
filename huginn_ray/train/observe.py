"""Seeing inside a run, at the log interval: per-phase time, per-module gradient and update norms, stragglers.

Everything here is measured every step on the device (or the host clock on CPU) and read by the host once per
log interval, together with the model's latent telemetry and the validation losses, in one all-reduce and one
read (`read_interval`). Between log steps nothing here waits for the device.

- `PhaseClock`: the time of each phase of the steps (data, forward, backward, comm, optimizer, validation,
  checkpoint). On CPU the host clock (the host runs the ops); on GPUs CUDA events on the current stream, read
  once per interval: the stream time between a phase's boundaries.
- `ModuleNorms`: L2 norms of the gradients (before clipping) and of the optimizer's update of each part of the
  model (embeddings, prelude, core, coda), global over the ranks: each rank adds the squares of what it holds,
  weighted by 1/(the ranks holding the same values), and the interval's all-reduce sums them.
- `stragglers`: each rank's own time per step (data + forward + backward + optimizer: the phases without the
  step's collectives, where a rank waits for the others) travels in the same all-reduce (rank r's at slot r); the
  ranks above `observe.straggler_ratio` x the median are named with their hosts.
- `LogWindow`: the steps since the last log line, whose time, tokens and model FLOPs give tokens/s and MFU, and
  the progress line (`progress_line`) rank 0 prints from them.
"""

from __future__ import annotations

import math
import resource
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from huginn_ray.train.parallel import local

PHASES = ("data", "forward", "backward", "comm", "optimizer", "validation", "checkpoint")
"""What a step's time is spent on: `data` waiting for the step's batches (read ahead by the prefetcher), `forward`
and `backward` the micro-batches' passes (with the inputs' copy to the device and the rows' initial noise;
under hsdp FSDP's gathers and reduce-scatters, and with an overlapped exchange its launches, run inside them),
`comm` the step's collectives outside the passes (the supervised-token count, the gradient exchange's wait after
backward, the step's agreement: where a rank waits for a slower one), `optimizer` clipping and the optimizer
step, `validation` and `checkpoint` on their intervals (divided over the interval's steps)."""

OWN_PHASES = ("data", "forward", "backward", "optimizer")
"""The phases in which a rank works on its own (without the step's collectives): their time is the rank's
step time for straggler detection."""

MODULES = ("embeddings", "prelude", "core", "coda")
"""The parts of the model whose gradient and update norms are logged."""


def module_of(name: str) -> str:
    """Which part of the model a parameter belongs to: the embedding (tied with the head), the prelude, the core
    (the adapter and the core blocks) or the coda (with the final norm)."""
    part = name.split(".")[1] if name.startswith("transformer.") else name
    if part == "wte":
        return "embeddings"
    if part == "prelude":
        return "prelude"
    if part in ("adapter", "core_block"):
        return "core"
    if part in ("coda", "ln_f"):
        return "coda"
    raise ValueError(f"parameter {name}: not in any of {MODULES}")


class PhaseClock:
    """Time per phase over the steps since the last `read`. `start` sets the origin, each `lap(phase)` adds the
    time since the previous boundary to `phase`. On GPUs every boundary is a CUDA event (recording one does not
    wait for the device); `read` waits once for the last one and sums the intervals."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.intervals: list[tuple[str, object, object]] = []  # CUDA: (phase, start event, end event)
        self.last = None

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.last = self._now()

    def lap(self, phase: str) -> None:
        now = self._now()
        if self.cuda:
            self.intervals.append((phase, self.last, now))
        else:
            self.totals[phase] += now - self.last
        self.last = now

    def read(self) -> dict[str, float]:
        """Seconds per phase since the last read; starts the next interval."""
        if self.intervals:
            self.intervals[-1][2].synchronize()
            for phase, start, end in self.intervals:
                self.totals[phase] += start.elapsed_time(end) / 1000.0
        totals, self.totals, self.intervals = self.totals, dict.fromkeys(PHASES, 0.0), []
        return totals


class _NoClock(PhaseClock):
    """For callers that time nothing (tests, benchmarks calling train_step alone)."""

    def __init__(self):
        super().__init__(torch.device("cpu"))

    def start(self) -> None:
        pass

    def lap(self, phase: str) -> None:
        pass


NO_CLOCK = _NoClock()


NORM_CHUNK = 2**22
"""Elements squared and summed in fp64 at a time: the chunk's fp64 copy and its square (64 MiB) bound what a
norm allocates, not the largest tensor (the tied 65536 x 5280 embedding would take 5.5 GB)."""


def square_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The fp64 sum of the squares of a tensor's elements, NORM_CHUNK elements at a time."""
    flat = tensor.reshape(-1)
    return sum(chunk.double().square().sum() for chunk in flat.split(NORM_CHUNK))


class ModuleNorms:
    """Squared gradient and update norms of each part of the model (MODULES), as this rank's share of the global
    sums: a value held by h ranks (a replicated parameter, or one shard of a DTensor held by its replicas)
    counts 1/h on each, so the all-reduce's sum is the global square. `snapshot` keeps a copy of this rank's
    parameters (its shards under hsdp) until `updates`, which frees it tensor by tensor: on log steps only, the
    memory of one more copy of them, plus one tensor's update and a norm chunk (the memory plan counts them)."""

    def __init__(self, model: torch.nn.Module, world_size: int):
        self.groups = []  # (module index, parameter, 1 / holders)
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.groups.append((MODULES.index(module_of(name)), p, 1.0 / holders(p, world_size)))
        self.before: list[torch.Tensor] | None = None

    def _squares(self, tensors) -> torch.Tensor:
        device = self.groups[0][1].device
        sums = torch.zeros(len(MODULES), dtype=torch.float64, device=device)
        for (module, _, weight), tensor in zip(self.groups, tensors):
            if tensor is not None:
                sums[module] += square_sum(local(tensor)) * weight
            del tensor  # an update made for this sum is freed before the next one is made
        return sums

    def grads(self) -> torch.Tensor:
        """This rank's share of each module's squared gradient norm (call before clipping)."""
        return self._squares([p.grad for _, p, _ in self.groups])

    def snapshot(self) -> None:
        self.before = [local(p).detach().clone() for _, p, _ in self.groups]

    def updates(self) -> torch.Tensor:
        """This rank's share of each module's squared update norm since `snapshot`."""
        before, self.before = self.before, None

        def differences():
            for index, (_, p, _) in enumerate(self.groups):
                difference = local(p).detach() - before[index]
                before[index] = None  # each copy freed once used: one tensor's update exists at a time
                yield difference
                del difference

        return self._squares(differences())


def holders(p: torch.Tensor, world_size: int) -> int:
    """How many ranks hold the same values of `p`: every rank for a plain tensor; for a DTensor the world size
    divided by the shards (the product of the mesh dimensions it is sharded over)."""
    if not hasattr(p, "placements"):
        return world_size
    shards = 1
    for dim, placement in enumerate(p.placements):
        if placement.is_shard():
            shards *= p.device_mesh.size(dim)
    return world_size // shards


def read_interval(summed: dict[str, torch.Tensor], from_rank0: dict[str, torch.Tensor], rank: int,
                  device: torch.device) -> dict[str, list[float]]:
    """The log interval's one all-reduce and one device-to-host read: every `summed` tensor summed over the
    ranks, every `from_rank0` tensor as rank 0 has it. Every rank passes the same names and shapes."""
    parts = [(name, t.reshape(-1).to(device, torch.float64)) for name, t in summed.items()]
    parts += [(name, t.reshape(-1).to(device, torch.float64) if rank == 0 else
               torch.zeros(t.numel(), dtype=torch.float64, device=device)) for name, t in from_rank0.items()]
    flat = torch.cat([t for _, t in parts]) if parts else torch.zeros(0, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flat)
    values, out, start = flat.tolist(), {}, 0
    for name, t in parts:
        out[name] = values[start: start + t.numel()]
        start += t.numel()
    return out


def own_time_slot(seconds: float, rank: int, world_size: int) -> torch.Tensor:
    """This rank's own time per step at slot `rank` of a W-vector (zeros elsewhere): summed over the ranks in
    the interval's all-reduce, it is everybody's (an all-gather without a collective of its own)."""
    slots = torch.zeros(world_size, dtype=torch.float64)
    slots[rank] = seconds
    return slots


@dataclass
class Stragglers:
    """The ranks whose own step time exceeds `ratio` x the median."""

    median_s: float
    slowest_ratio: float
    """The slowest rank's own time over the median (1.0 when the median is 0)."""
    ranks: list[tuple[int, float]]
    """(rank, its own seconds per step) above the threshold, slowest first."""

    def describe(self, hosts: list[str]) -> str:
        named = ", ".join(f"rank {r} on {hosts[r]} {s:.3f} s ({s / self.median_s:.2f}x)" for r, s in self.ranks)
        return f"{named}; the median rank's own time is {self.median_s:.3f} s per step"


def find_stragglers(own_seconds: list[float], ratio: float) -> Stragglers:
    """The ranks of `own_seconds` (own time per step, by rank) above `ratio` x the median (the lower median for
    an even count: with two ranks the slower is compared with the faster)."""
    median = statistics.median_low(own_seconds)
    slowest = max(own_seconds)
    slowest_ratio = slowest / median if median > 0 else 1.0
    above = [(r, s) for r, s in enumerate(own_seconds) if median > 0 and s > ratio * median]
    return Stragglers(median, slowest_ratio, sorted(above, key=lambda item: -item[1]))


class LogWindow:
    """Steps since the last log line: their time, tokens and model FLOPs give tokens/s and MFU."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.steps, self.tokens, self.flops, self.loss_sum = 0, 0, 0.0, 0.0

    def add(self, loss: float, flops: float, tokens: int) -> None:
        self.steps += 1
        self.tokens += tokens
        self.flops += flops
        self.loss_sum += loss

    def metrics(self, loss: float, lr: float, grad_norm: float, depth: tuple[int, int], total_tokens: int,
                world_size: int, peak_flops: float, device) -> dict:
        """The log line's metrics: the last step's `loss`, `lr`, `grad_norm` and `depth` (n, k), the window's
        means and rates, and the device's peak memory since the last log line (then reset)."""
        seconds = time.perf_counter() - self.t0
        n, k = depth
        metrics = {
            "loss": loss,
            "ppl": math.exp(min(loss, 50.0)),
            "loss_window_mean": self.loss_sum / self.steps,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_second": self.tokens / seconds,
            "seconds_per_step": seconds / self.steps,
            "mfu": self.flops / seconds / world_size / peak_flops,
            "total_tokens": total_tokens,
            "recurrence_n": n,
            "recurrence_k": k,
        }
        if device.type == "cuda":
            metrics["max_mem_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
        else:
            metrics["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        return metrics


def progress_line(step: int, max_steps: int, m: dict) -> str:
    return (
        f"[huginn] step {step}/{max_steps} loss {m['loss']:.4f} ppl {m['ppl']:.1f} lr {m['lr']:.3g} "
        f"grad_norm {m['grad_norm']:.3f} tok/s {m['tokens_per_second']:.0f} MFU {m['mfu']:.2%} "
        f"depth ({m['recurrence_n']},{m['recurrence_k']}) ETA {eta(m['seconds_per_step'] * (max_steps - step))}"
    )


def eta(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"

"""The warm-up all-reduce before training (reference §3.3 step 15): fail fast, naming the rank that is missing.

All ranks all-reduce growing prefixes (1/8 ... 8/8) of a random fp32 buffer (128 MiB in the reference). Before
each stage every rank checks in at the process group's key-value store: it marks its own key, adds one to the
stage's counter, and waits for the stage's "all in" key, which the rank whose addition completes the count sets.
That is four store operations per rank and stage whatever the world size (waiting on every rank's key instead
would be W look-ups per rank and stage: 150 million for the 9 stages at W = 4,096). Only when the wait times out
are the per-rank keys read, to name the ranks that did not check in, with their nodes, in the error (the store,
unlike a collective, can tell who is missing). Every rank
registers its node name right after the process group is up (`register_node`), so a rank that hangs while
setting up (loading data, building the model) is named with its node too. A rank that checks in but whose
network cannot carry the messages makes the collective fail at the process-group timeout.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

PREFIX = "huginn_warmup"


class WarmupError(RuntimeError):
    """A rank did not take part in the warm-up all-reduce in time."""


def _check_in(store, key: str, rank: int, world_size: int, timeout_s: float, what: str) -> None:
    store.set(f"{PREFIX}/{key}/{rank}", "1")  # read only to name the missing ranks after a timeout
    if store.add(f"{PREFIX}/{key}/count", 1) == world_size:
        store.set(f"{PREFIX}/{key}/all", "1")
    try:
        store.wait([f"{PREFIX}/{key}/all"], timedelta(seconds=timeout_s))
    except Exception:  # the store raises a backend-specific timeout error; we report who is missing instead
        missing = [r for r in range(world_size) if not store.check([f"{PREFIX}/{key}/{r}"])]
        hosts = []
        for r in missing:
            host_key = f"{PREFIX}/host/{r}"
            hosts.append(store.get(host_key).decode() if store.check([host_key]) else "unknown node")
        named = ", ".join(f"rank {r} (node {h})" for r, h in zip(missing, hosts))
        raise WarmupError(
            f"warm-up all-reduce: {named} did not answer within {timeout_s:g} s {what}; "
            f"rank {rank} on {socket.gethostname()} gives up"
        ) from None


def register_node() -> None:
    """Record this rank's node name in the process group's store; call right after the process group is up."""
    distributed_c10d._get_default_store().set(f"{PREFIX}/host/{dist.get_rank()}", socket.gethostname())


def warmup_allreduce(device: torch.device, mib: float = 128, stages: int = 8, timeout_s: float = 300) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    store = distributed_c10d._get_default_store()
    register_node()
    _check_in(store, "hello", rank, world_size, timeout_s, "before the first stage")
    numel = int(mib * 1024 * 1024) // 4
    generator = torch.Generator().manual_seed(rank)
    buffer = torch.rand(numel, generator=generator).to(device)
    for stage in range(1, stages + 1):
        size = numel * stage // stages
        _check_in(store, f"stage{stage}", rank, world_size, timeout_s, f"at stage {stage}/{stages} ({size * 4 / 2**20:.1f} MiB)")
        dist.all_reduce(buffer[:size])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    dist.barrier()

"""Small collectives that checkpointing, the worker's startup and the profiler share: how many ranks raised each
flag (`count_ranks`), rank 0's value on every rank (`from_rank0`), every rank's value on every rank (`all_ranks`).
They run on the training device (NCCL needs device tensors); without a process group each returns this process's
own value."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def world_size() -> int:
    """Ranks of the process group; 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def count_ranks(flags: list[bool], device) -> list[int]:
    """For each flag, the number of ranks that raised it: one all-reduce of len(flags) integers, whatever the
    world size. Without a process group: this process's flags."""
    counts = torch.tensor([int(flag) for flag in flags], dtype=torch.int64, device=device)
    if world_size() > 1:
        dist.all_reduce(counts)
    return [int(count) for count in counts.tolist()]


def from_rank0(value, device):
    """Rank 0's `value` (anything JSON can hold; other ranks pass None) on every rank: two broadcasts (the length,
    then the JSON bytes) on the training device. Without a process group: `value`."""
    if world_size() == 1:
        return value
    data = json.dumps(value).encode() if dist.get_rank() == 0 else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=0)
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8)
    if data:
        buffer[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buffer = buffer.to(device)
    dist.broadcast(buffer, src=0)
    return json.loads(bytes(buffer.cpu().tolist()))


def all_ranks(value, device) -> list:
    """`value` (anything JSON can hold) of every rank, in rank order: one all-gather of its JSON bytes on the
    training device (NCCL needs device tensors, and torch's object collectives pick the device by
    torch.cuda.current_device(), which nothing here sets). Every rank receives W values: a failure path's tool,
    for messages that name every failing rank. Without a process group: this process's value."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    data = json.dumps(value).encode()
    world_size = dist.get_world_size()
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64, device=device))
    lengths = [int(length.item()) for length in lengths]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty(max(lengths), dtype=torch.uint8, device=device) for _ in range(world_size)]
    dist.all_gather(gathered, padded.to(device))
    return [json.loads(bytes(g[:n].cpu().tolist())) for g, n in zip(gathered, lengths)]

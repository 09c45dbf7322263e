"""Gradient exchange across data-parallel ranks: every rank ends with the fp32 mean of all ranks' gradients.

Three interchangeable exchanges (config `grad_sync.kind`):

- `chunk_stream` (the reference's, §4.2): after backward, the gradients of all trainable parameters are packed,
  in registration order, into fixed-size fp32 chunks (64 MiB by default); each chunk is all-reduced (sum, then
  divided by the world size in fp32) and unpacked. Chunks span parameter boundaries; every message has the same
  size, the last chunk is zero-padded.
- `chunk_stream_overlap`: the same fixed-size chunks, laid out in the order backward makes gradients final
  (`gradient_order`) and filled by `register_post_accumulate_grad_hook`; a chunk's all-reduce is launched
  asynchronously as soon as all of its parameters' gradients are final, so communication overlaps backward.
  Chunks are always launched in index order, so every rank issues the same collectives in the same order.
- `ddp`: torch DistributedDataParallel (gradients as views into its buckets).

Under `parallelism.mode: hsdp` the chunk stream runs between shard groups over each rank's gradient shard, after
FSDP2 has reduce-scattered the sums within the group (huginn_ray.train.parallel): `chunk_stream` after backward,
`chunk_stream_overlap` from the hooks FSDP2 calls on the sharded parameters once a unit's reduce-scatter has
written their gradients, so a chunk goes out while the units before it are still in backward. With bf16 gathers
(`parallelism.param_dtype`) FSDP2 leaves the blocks' fp32 norm weights and qk_bias whole; a second stream of the
same kind sums those over all ranks (`build_hsdp_grad_sync`).

The layout covers every trainable parameter whether or not it received a gradient this step; a parameter without
gradient contributes zeros, and gets the averaged gradient of the others. This keeps the collectives identical
on every rank even if one rank's graph skipped a parameter.

Gradient accumulation: wrap every micro-batch's forward+backward in `sync.micro_batch(last=...)`, and call
`sync.finish()` after the last one.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from huginn_ray.train.parallel import local


@dataclass(frozen=True)
class Segment:
    """`count` elements of parameter `param_index`'s flat gradient from `grad_offset` live at `chunk_offset`."""

    param_index: int
    grad_offset: int
    chunk_offset: int
    count: int


def chunk_layout(numels: list[int], chunk_numel: int) -> list[list[Segment]]:
    """Pack flat tensors of the given sizes, in order, into chunks of `chunk_numel` elements."""
    chunks: list[list[Segment]] = [[]]
    used = 0
    for index, numel in enumerate(numels):
        offset = 0
        while offset < numel:
            if used == chunk_numel:
                chunks.append([])
                used = 0
            count = min(numel - offset, chunk_numel - used)
            chunks[-1].append(Segment(index, offset, used, count))
            offset += count
            used += count
    return [c for c in chunks if c]


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _grad_or_zeros(p: nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
    return p.grad


class ChunkStream:
    """Synchronous fixed-size chunk all-reduce after backward (reference §4.2, zero-padded).

    Streams this rank's part of every gradient (the local shard of a sharded one) over `group`, sums, and divides
    by `divide_by` (default: the group's size). Under hsdp the group is the rank's "replicate" column and the
    divisor the world size, since the reduce-scatter before it summed the shard group without dividing."""

    def __init__(self, model: nn.Module, chunk_numel: int, group=None, divide_by: int | None = None,
                 params: list[nn.Parameter] | None = None):
        self.module = model
        self.params = trainable_parameters(model) if params is None else params
        self.chunks = chunk_layout([local(p).numel() for p in self.params], chunk_numel)
        self.group = group
        self.world_size = divide_by or dist.get_world_size(group)
        self.group_size = dist.get_world_size(group)
        device = local(self.params[0]).device
        # one buffer reused for every chunk: the exchange is sequential
        self.buffer = torch.zeros(chunk_numel, dtype=torch.float32, device=device)

    def micro_batch(self, last: bool):
        return contextlib.nullcontext()

    def finish(self) -> None:
        for chunk in self.chunks:
            self.buffer.zero_()
            for s in chunk:
                grad = self.params[s.param_index].grad
                if grad is not None:
                    self.buffer[s.chunk_offset : s.chunk_offset + s.count].copy_(
                        local(grad).reshape(-1)[s.grad_offset : s.grad_offset + s.count]
                    )
            if self.group_size > 1:
                dist.all_reduce(self.buffer, op=dist.ReduceOp.SUM, group=self.group)
            self.buffer.div_(self.world_size)
            for s in chunk:
                grad = local(_grad_or_zeros(self.params[s.param_index]))
                grad.view(-1)[s.grad_offset : s.grad_offset + s.count].copy_(
                    self.buffer[s.chunk_offset : s.chunk_offset + s.count]
                )


def gradient_order(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters in the order backward makes their gradients final.

    Whole parameters: reverse registration order (autograd accumulates a leaf's gradient when its last use in the
    forward has been differentiated). FSDP2-sharded ones: a shard's gradient is final when its unit's
    reduce-scatter has written it, which happens unit by unit in the reverse of the units' forward order, and
    the root unit's (the embedding, adapter, final norm) last, at the end of backward: the root's parameters
    come last although they are registered first and last."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    if not units:
        return list(reversed(trainable_parameters(model)))
    order = [p for unit in reversed(units) for p in reversed(trainable_parameters(unit))]
    placed = set(order)
    return order + [p for p in reversed(trainable_parameters(model)) if p not in placed]


class ChunkStreamOverlap:
    """Fixed-size chunks all-reduced asynchronously while backward is still running.

    Chunks are laid out in `gradient_order` and filled from post-accumulate-grad hooks: a whole parameter's
    fires when autograd has accumulated its gradient; FSDP2 calls a sharded parameter's after its unit's
    reduce-scatter has written the shard's gradient (under hsdp this stream runs over the "replicate" dimension
    and divides by `divide_by`, the world size, as `ChunkStream` does). At most `max_in_flight` chunk buffers
    exist: a chunk is packed from the parameters' gradients when all of them are final and a buffer is free;
    when none is free, the oldest all-reduce is waited for and unpacked first. The extra memory is
    `max_in_flight` chunks, not a second copy of the gradients. The sums are those of `ChunkStream`, element by
    element, so the result is bitwise the same."""

    def __init__(self, model: nn.Module, chunk_numel: int, group=None, max_in_flight: int = 4,
                 divide_by: int | None = None, params: list[nn.Parameter] | None = None):
        self.module = model
        self.params = gradient_order(model) if params is None else params
        self.chunks = chunk_layout([local(p).numel() for p in self.params], chunk_numel)
        self.group = group
        self.world_size = divide_by or dist.get_world_size(group)
        self.group_size = dist.get_world_size(group)
        device = local(self.params[0]).device
        self.buffers = [torch.zeros(chunk_numel, dtype=torch.float32, device=device)
                        for _ in range(min(max_in_flight, len(self.chunks)))]
        self.chunks_of: list[list[int]] = [[] for _ in self.params]
        for chunk_index, chunk in enumerate(self.chunks):
            for s in chunk:
                self.chunks_of[s.param_index].append(chunk_index)
        self._syncing = False
        self._reset()
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)
        ]

    def _reset(self) -> None:
        self.fired = [False] * len(self.params)
        self.missing = [len({s.param_index for s in chunk}) for chunk in self.chunks]
        self.launched = 0
        self.in_flight: collections.deque = collections.deque()
        self.free = list(self.buffers)

    @contextlib.contextmanager
    def micro_batch(self, last: bool):
        # hooks fire on every backward; only the last micro-batch's (accumulated) gradients are exchanged
        self._syncing = last
        if last:
            self._reset()
        yield

    def _make_hook(self, index: int):
        def hook(p: torch.Tensor) -> None:
            if not self._syncing:
                return
            if self.fired[index]:
                # Autograd runs a leaf's AccumulateGrad once per backward, after all uses are summed; a second
                # call would mean this parameter's chunk may already be on the wire with a partial gradient.
                raise RuntimeError(
                    f"chunk_stream_overlap: gradient hook of parameter #{index} ({tuple(p.shape)}) fired twice "
                    "in one backward (reentrant checkpointing or a second backward?); use chunk_stream instead"
                )
            self._mark_final(index)
            self._launch_ready()

        return hook

    def _mark_final(self, index: int) -> None:
        self.fired[index] = True
        for chunk_index in self.chunks_of[index]:
            self.missing[chunk_index] -= 1

    def _launch_ready(self) -> None:
        # strictly in chunk order, so that all ranks issue the same sequence of collectives
        while self.launched < len(self.chunks) and self.missing[self.launched] == 0:
            if not self.free:
                self._complete_oldest()
            buf = self.free.pop()
            buf.zero_()
            for s in self.chunks[self.launched]:
                grad = self.params[s.param_index].grad
                if grad is not None:
                    buf[s.chunk_offset : s.chunk_offset + s.count].copy_(
                        local(grad).reshape(-1)[s.grad_offset : s.grad_offset + s.count]
                    )
            work = (dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                    if self.group_size > 1 else None)
            self.in_flight.append((self.launched, buf, work))
            self.launched += 1

    def _complete_oldest(self) -> None:
        chunk_index, buf, work = self.in_flight.popleft()
        if work is not None:
            work.wait()
        buf.div_(self.world_size)
        for s in self.chunks[chunk_index]:
            grad = local(_grad_or_zeros(self.params[s.param_index]))
            grad.view(-1)[s.grad_offset : s.grad_offset + s.count].copy_(buf[s.chunk_offset : s.chunk_offset + s.count])
        self.free.append(buf)

    def finish(self) -> None:
        # parameters whose hook never fired got no gradient: their zero slots are complete now
        for index, fired in enumerate(self.fired):
            if not fired:
                self._mark_final(index)
        self._launch_ready()
        while self.in_flight:
            self._complete_oldest()
        self._syncing = False

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()


class DDPSync:
    """torch DistributedDataParallel; `find_unused_parameters` is needed only if some parameter may get no grad.

    The recurrence depth changes every step, so the autograd graph changes too: `static_graph` stays off.
    """

    def __init__(self, model: nn.Module, group=None, find_unused_parameters: bool = False, bucket_mb: int = 25):
        device_ids = [model_device.index] if (model_device := next(model.parameters()).device).type == "cuda" else None
        self.module = nn.parallel.DistributedDataParallel(
            model,
            device_ids=device_ids,
            process_group=group,
            find_unused_parameters=find_unused_parameters,
            bucket_cap_mb=bucket_mb,
            gradient_as_bucket_view=True,  # the gradients live in DDP's buckets: no second copy
        )

    def micro_batch(self, last: bool):
        return contextlib.nullcontext() if last else self.module.no_sync()

    def finish(self) -> None:
        """DDP has reduced during backward."""


class Streams:
    """Exchanges over disjoint sets of parameters, run as one (each with its own hooks and buffers)."""

    def __init__(self, module: nn.Module, streams: list):
        self.module = module
        self.streams = streams

    @contextlib.contextmanager
    def micro_batch(self, last: bool):
        with contextlib.ExitStack() as stack:
            for stream in self.streams:
                stack.enter_context(stream.micro_batch(last))
            yield

    def finish(self) -> None:
        for stream in self.streams:
            stream.finish()

    def remove_hooks(self) -> None:
        for stream in self.streams:
            if hasattr(stream, "remove_hooks"):
                stream.remove_hooks()


def build_hsdp_grad_sync(kind: str, model: nn.Module, chunk_mib: float, replicate_group, world_size: int,
                         max_chunks_in_flight: int = 4):
    """hsdp's exchange: every sharded gradient (FSDP2 has summed it over the shard group) streamed over
    `replicate_group`, divided by the world size. Parameters FSDP2 leaves whole (the blocks' fp32 norm weights and
    qk_bias under bf16 gathers) hold this rank's gradient alone: a second stream of their own size sums them over
    all ranks."""
    chunk_numel = int(chunk_mib * 1024 * 1024) // 4
    ordered = trainable_parameters(model) if kind == "chunk_stream" else gradient_order(model)
    sharded = [p for p in ordered if isinstance(p, DTensor)]
    whole = [p for p in ordered if not isinstance(p, DTensor)]

    def stream(params, numel, group, divide_by):
        if kind == "chunk_stream":
            return ChunkStream(model, numel, group, divide_by, params=params)
        if kind == "chunk_stream_overlap":
            return ChunkStreamOverlap(model, numel, group, max_chunks_in_flight, divide_by, params=params)
        raise ValueError(f"grad_sync.kind: under hsdp chunk_stream or chunk_stream_overlap, not {kind!r}")

    streams = [stream(sharded, chunk_numel, replicate_group, world_size)]
    if whole:
        streams.append(stream(whole, min(chunk_numel, sum(p.numel() for p in whole)), None, world_size))
    return streams[0] if len(streams) == 1 else Streams(model, streams)


def build_grad_sync(kind: str, model: nn.Module, chunk_mib: float = 64, group=None, find_unused_parameters=False,
                    max_chunks_in_flight: int = 4):
    chunk_numel = int(chunk_mib * 1024 * 1024) // 4
    if kind == "chunk_stream":
        return ChunkStream(model, chunk_numel, group)
    if kind == "chunk_stream_overlap":
        return ChunkStreamOverlap(model, chunk_numel, group, max_in_flight=max_chunks_in_flight)
    if kind == "ddp":
        return DDPSync(model, group, find_unused_parameters=find_unused_parameters, bucket_mb=max(1, int(chunk_mib)))
    raise ValueError(f"grad_sync.kind: unknown gradient exchange {kind!r} (chunk_stream, chunk_stream_overlap, ddp)")

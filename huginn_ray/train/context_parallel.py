"""Context parallelism: one sequence split over the N ranks of a cp group, attention over the whole sequence by an
all-gather of its keys and values (Llama 3's choice), the same code on CPU (gloo) as on GPUs.

The split is torchtitan's head-tail load balancing: a sequence of T tokens is cut into 2N pieces of T / 2N, and
cp rank r holds pieces r and 2N - 1 - r (`head_tail_positions`), so every rank holds as much causal attention work
as every other. Every position-indexed tensor is split with that one permutation: token ids and labels
(`ContextParallel.local_batch`), the RoPE angles and the keyed initial state noise (RecurrentGPT.split_sequence:
the model reads `positions`); the noise of a position is the unsplit run's.

Attention (`ContextParallel.attend`, which the model's attention calls for every block of every one of the
n + k iterations, the no-grad ones included): the local K and V are all-gathered over the cp group in one
collective (`_GatherSequence`, whose backward reduce-scatters the gathered gradients back to their owners: the
sum over the queries of every rank), put in sequence order, and each local piece's queries attend to the keys up
to the piece's end with the causal mask aligned to the lower right (`causal_lower_right`): piece p of length c
starting at position s sees keys [0, s + c), query i the keys up to s + i. That is scaled_dot_product_attention's
public API; which kernel serves the lower-right causal mask is torch's choice among those the run allows.

The loss is the sum of the local token losses over the global count of supervised tokens (huginn_ray.train.loop
counts the local labels, the step's all-reduce sums them over every rank), so the cp ranks' gradients are partial
sums: the gradient exchange sums them (FSDP's reduce-scatter over shard x cp, the chunk stream over every rank).

Forward and backward run inside `ContextParallel.sequence()`. A forward with gradients, or a backward (a
checkpointed block's recomputation included), outside it raises ContextParallelError naming it: outside, the
split would be silently wrong. Forwards without gradients (validation, the no-grad iterations) run anywhere.

What has run: the CPU/gloo tests (tests/test_train_context_parallel.py). Not yet run on a GPU (NCCL/RCCL).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from huginn_ray.train.shard_reader import Batch


class ContextParallelError(RuntimeError):
    """A sequence split the cp group cannot serve, or a forward/backward with gradients outside the context."""


def head_tail_positions(seq_len: int, size: int, rank: int) -> Tensor:
    """The positions cp rank `rank` of `size` holds, in its local order: pieces rank and 2 size - 1 - rank of the
    2 size pieces of seq_len / (2 size) tokens (int64, on the host)."""
    if seq_len % (2 * size):
        raise ContextParallelError(f"block_size={seq_len} does not split into 2 x context_parallel = {2 * size} "
                                   "equal pieces (the head-tail layout): block_size must be a multiple of it")
    piece = seq_len // (2 * size)
    head, tail = rank * piece, (2 * size - 1 - rank) * piece
    return torch.cat([torch.arange(head, head + piece), torch.arange(tail, tail + piece)])


class _GatherSequence(torch.autograd.Function):
    """All-gather along a new leading dimension over the cp group; backward reduce-scatters (sums) the gradient."""

    @staticmethod
    def forward(ctx, local: Tensor, cp: ContextParallel) -> Tensor:
        ctx.cp = cp
        gathered = local.new_empty((cp.size * local.shape[0], *local.shape[1:]))
        dist.all_gather_single(gathered, local.contiguous(), group=cp.group)
        return gathered.unflatten(0, (cp.size, local.shape[0]))

    @staticmethod
    def backward(ctx, grad: Tensor):
        cp = ctx.cp
        cp.check_active("a backward")
        local = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_single(local, grad.flatten(0, 1).contiguous(), op=dist.ReduceOp.SUM, group=cp.group)
        return local, None


class ContextParallel:
    """This rank's part of a cp group: its positions of a block_size-token sequence, the batch split to them, and
    the attention over the whole sequence. `group` None (context_parallel 1): the whole sequence, no collective
    (`enabled` False; the loop's one path)."""

    def __init__(self, group, seq_len: int, device: torch.device):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.seq_len = seq_len
        self.host_positions = head_tail_positions(seq_len, self.size, self.rank)
        self.positions = self.host_positions.to(device)
        """This rank's positions (device int64): the model's RoPE angles and keyed noise read them."""
        everyone = torch.cat([head_tail_positions(seq_len, self.size, r) for r in range(self.size)])
        self.sequence_order = torch.argsort(everyone).to(device)
        """Index into the gathered (rank-major) keys that puts them in sequence order."""
        self.active = False

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def local_batch(self, batch: Batch) -> Batch:
        """The batch's token ids and labels at this rank's positions (on the host; the keys stay whole: the model
        draws each row's noise whole and keeps these positions)."""
        if not self.enabled:
            return batch
        if batch.inputs.shape[1] != self.seq_len:
            raise ContextParallelError(f"a batch of rows of {batch.inputs.shape[1]} tokens, but the cp group splits "
                                       f"block_size={self.seq_len}")
        return Batch(batch.inputs[:, self.host_positions], batch.labels[:, self.host_positions], batch.keys)

    @contextmanager
    def sequence(self):
        """Run a micro-batch's forward and backward inside: the attention may gather over the cp group."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def mean(self, values: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
        """Device scalars (the model's telemetry) averaged over the cp group: one all-reduce. A mean over the
        tokens is exact (every rank holds as many); a statistic of pairs of tokens (token correlation) is the mean
        of the ranks' own."""
        if not self.enabled or not values:
            return values
        stacked = torch.stack(list(values.values()))
        dist.all_reduce(stacked, group=self.group)
        return dict(zip(values, (stacked / self.size).unbind()))

    def check_active(self, what: str) -> None:
        if not self.active:
            raise ContextParallelError(
                f"{what} with gradients outside ContextParallel.sequence() (parallelism.context_parallel="
                f"{self.size}): run every training forward and its backward inside the context (a checkpointed "
                "block recomputes its forward in the backward)")

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal attention of the local queries (batch, heads, local length, head_dim) over the whole sequence's
        keys and values, gathered from the cp group; returns the local output, same shape as q."""
        if torch.is_grad_enabled():
            self.check_active("a forward (or a checkpointed block's recomputation in a backward)")
        local = q.shape[2]
        gathered = _GatherSequence.apply(torch.stack([k, v]), self)  # (cp, 2, batch, heads, local, head_dim)
        gathered = gathered.permute(1, 2, 3, 0, 4, 5).flatten(3, 4).index_select(3, self.sequence_order)
        keys, values = gathered.unbind(0)
        piece = local // 2
        outputs = []
        for index, start in enumerate(self.host_positions[::piece].tolist()):
            end = start + piece
            queries = q[:, :, index * piece : (index + 1) * piece]
            outputs.append(F.scaled_dot_product_attention(queries, keys[:, :, :end], values[:, :, :end],
                                                          attn_mask=causal_lower_right(piece, end)))
        return torch.cat(outputs, dim=2)

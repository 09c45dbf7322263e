"""Which rows every rank trains on at every step: a function of the step, not of the worker count.

The shards are S streams: stream i is train shard i, read in the order of huginn_ray.train.shard_reader (row
groups in file order, the rows of each shuffled with `Random(seed + i)`). An optimizer step consumes the same
number of rows, b = B / S, from every stream (B = `global_batch_rows`), so after step s every stream stands at
row s x b, whatever the worker count: that one number is the data position a checkpoint records.

Within a step the B rows form GA micro-batches (GA = gradient accumulation, a divisor of b). Global micro-batch j
of a step is the concatenation, stream by stream, of the next r = b / GA rows of every stream: R = S x r = B / GA
rows. Rank k of W takes rows [floor(k R / W), floor((k + 1) R / W)) of it, so the ranks' micro-batches differ by
one row at most. So

    rank k reads the streams its rows touch, and from each of them, per micro-batch, the same r rows every rank
    touching that stream reads, keeping its own part.

GA, for W ranks and micro_batch_size m: the smallest divisor of b with W <= R <= m x W (every rank gets at least
one row and at most m). When no divisor gives that (too few ranks for m x W rows to reach a micro-batch of whole
stream rows, e.g. one row of each of 4,096 streams on 4,088 ranks of m = 1), GA is the largest divisor of b with
R >= W: a rank's micro-batch is then larger than m (`largest_micro_batch` rows, which the memory plan counts).
Where m x W divides B and S divides m x W (the rule of equal micro-batches) this is GA = B / (m x W), R = m x W
and rank k's rows [k m, (k + 1) m): the same rows, micro-batches and order as equal micro-batches always had.

With W = S and m x GA = b (the Huginn layout) rank k reads stream k alone, r = m rows per micro-batch: the
reference's one-shard-per-rank order. With W < S a rank reads about S / W streams; with W > S, about W / S ranks
share a stream, each reading it all and keeping its part.

Every W from 1 to B is allowed (B % S == 0 is the only condition on the batch); a step's loss and gradient are
means over the supervised tokens of the whole global batch (huginn_ray.train.loop), whichever rank holds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class DataOrderError(ValueError):
    """A worker count or batch the data order cannot serve; names the numbers and the allowed range."""


@dataclass(frozen=True)
class StreamSlice:
    """Part of one stream's r rows of a global micro-batch that one rank takes."""

    stream: int
    """The stream (train shard index)."""
    start: int
    """First row taken, counted in the stream's r rows of the micro-batch."""
    stop: int
    """One past the last row taken."""


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass(frozen=True)
class DataOrder:
    """The data order of a run with `world_size` ranks; see the module docstring."""

    num_streams: int
    """S: train shards (streams)."""
    global_batch_rows: int
    """B: rows per optimizer step, all ranks and micro-batches together (fixed for the whole run)."""
    micro_batch_size: int
    """m: the configured rows per rank per forward (a rank may get fewer, or more where W is too small:
    `largest_micro_batch`)."""
    world_size: int
    """W: ranks."""

    def check(self) -> DataOrder:
        """Raise DataOrderError unless 1 <= W <= B and S divides B; returns self."""
        S, B, W = self.num_streams, self.global_batch_rows, self.world_size
        if B % S:
            raise DataOrderError(
                f"a global batch of {B} rows cannot take the same rows from each of {S} shards ({B} % {S} = "
                f"{B % S}): world_batch_size must be a multiple of the shard count (huginn_ray/train/README.md)")
        if not 1 <= W <= B:
            raise DataOrderError(
                f"{W} workers: the data order of {S} shards and a global batch of {B} rows serves 1 to {B} workers "
                f"(at least one row of a global micro-batch per worker; a global micro-batch holds at most the "
                f"{B} rows of a step, huginn_ray/train/README.md)")
        return self

    @property
    def grad_accum(self) -> int:
        """GA: micro-batches per optimizer step (module docstring)."""
        B, m, W = self.global_batch_rows, self.micro_batch_size, self.world_size
        candidates = divisors(self.rows_per_stream_per_step)
        within = [ga for ga in candidates if W <= B // ga <= m * W]
        return within[0] if within else max(ga for ga in candidates if B // ga >= W)

    @property
    def rows_per_stream_per_step(self) -> int:
        """b: rows every stream gives to every step."""
        return self.global_batch_rows // self.num_streams

    @property
    def rows_per_stream_per_micro_batch(self) -> int:
        """r: rows every stream gives to every global micro-batch."""
        return self.rows_per_stream_per_step // self.grad_accum

    @property
    def rows_per_micro_batch(self) -> int:
        """R: rows of a global micro-batch, all ranks together."""
        return self.rows_per_stream_per_micro_batch * self.num_streams

    def rows(self, rank: int) -> range:
        """The rows of every global micro-batch rank `rank` takes: [floor(k R / W), floor((k + 1) R / W))."""
        R, W = self.rows_per_micro_batch, self.world_size
        return range(rank * R // W, (rank + 1) * R // W)

    @property
    def largest_micro_batch(self) -> int:
        """The most rows a rank gets per micro-batch: ceil(R / W)."""
        return -(-self.rows_per_micro_batch // self.world_size)

    def slices(self, rank: int) -> list[StreamSlice]:
        """The streams rank `rank` reads and which of their r rows per micro-batch it keeps, in batch order."""
        r, rows = self.rows_per_stream_per_micro_batch, self.rows(rank)
        first, last = rows.start, rows.stop  # the rank's rows in the concatenation of the streams' r rows
        return [StreamSlice(stream, max(first, stream * r) - stream * r, min(last, (stream + 1) * r) - stream * r)
                for stream in range(first // r, (last - 1) // r + 1)]


def largest_micro_batch(num_streams: int, global_batch_rows: int, micro_batch_size: int,
                        worker_counts: range) -> int:
    """The most rows a rank gets per micro-batch on any of `worker_counts` (the memory plan counts it)."""
    return max(DataOrder(num_streams, global_batch_rows, micro_batch_size, w).largest_micro_batch
               for w in worker_counts)


def accumulates_gradients(num_streams: int, global_batch_rows: int, micro_batch_size: int,
                          worker_counts: range) -> bool:
    """Whether a step runs more than one micro-batch (GA > 1) on any of `worker_counts` (the memory plan then
    counts the gradients from the forward on)."""
    return any(DataOrder(num_streams, global_batch_rows, micro_batch_size, w).grad_accum > 1 for w in worker_counts)

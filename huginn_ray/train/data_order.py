"""Which rows every rank trains on at every step: a function of the step, not of the worker count.

The shards are S streams: stream i is train shard i, read in the order of huginn_ray.train.shard_reader (row
groups in file order, the rows of each shuffled with `Random(seed + i)`). An optimizer step consumes the same
number of rows, b = B / S, from every stream (B = `global_batch_rows`), so after step s every stream stands at
row s x b, whatever the worker count: that one number is the data position a checkpoint records.

Within a step the B rows form GA micro-batches (GA = gradient accumulation). Global micro-batch j of a step is
the concatenation, stream by stream, of the next r = B / (S x GA) rows of every stream; rank k of W takes rows
[k x m, (k + 1) x m) of that concatenation (m = micro_batch_size = B / (GA x W)). So

    rank k reads the streams its slice touches, and from each of them, per micro-batch, the same r rows every
    rank touching that stream reads, keeping its own part.

With W = S and m x GA = b (the Huginn layout) rank k reads stream k alone, r = m rows per micro-batch: the
reference's one-shard-per-rank order. With W < S a rank reads S / W streams (when W divides S) whole; with
W > S, W / S ranks share a stream, each reading it all and keeping 1 / (W / S) of its rows.

The rule (`DataOrder.check`): m x W must divide B (equal micro-batches on every rank, GA = B / (m x W)) and S
must divide m x W (every stream gives the same r rows to every micro-batch). Both the rows of a step and the
rows of each global micro-batch are then the same for every allowed (W, m) with the same GA; another GA keeps
the rows of each step and regroups them into micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass


class DataOrderError(ValueError):
    """A worker count or micro-batch size the data order cannot serve; names both numbers and the allowed ones."""


@dataclass(frozen=True)
class StreamSlice:
    """Part of one stream's r rows of a global micro-batch that one rank takes."""

    stream: int
    """The stream (train shard index)."""
    start: int
    """First row taken, counted in the stream's r rows of the micro-batch."""
    stop: int
    """One past the last row taken."""


@dataclass(frozen=True)
class DataOrder:
    """The data order of a run with `world_size` ranks; see the module docstring."""

    num_streams: int
    """S: train shards (streams)."""
    global_batch_rows: int
    """B: rows per optimizer step, all ranks and micro-batches together (fixed for the whole run)."""
    micro_batch_size: int
    """m: rows per rank per forward."""
    world_size: int
    """W: ranks."""

    def check(self) -> DataOrder:
        """Raise DataOrderError unless the rule holds (module docstring); returns self."""
        S, B, m, W = self.num_streams, self.global_batch_rows, self.micro_batch_size, self.world_size
        per_micro = m * W
        if B % per_micro or per_micro % S:
            allowed = allowed_worker_counts(S, B, m, up_to=max(4 * W, 4 * S))
            raise DataOrderError(
                f"{W} workers x micro_batch_size {m} = {per_micro} rows per micro-batch cannot serve the data order "
                f"of {S} shards and a global batch of {B} rows: the rows per micro-batch must divide the global "
                f"batch ({B} % {per_micro} = {B % per_micro}) and be a multiple of the shard count "
                f"({per_micro} % {S} = {per_micro % S}); with micro_batch_size {m} the allowed worker counts are "
                f"{allowed or 'none'} (or change micro_batch_size: the rule is in huginn_ray/train/README.md)")
        return self

    @property
    def grad_accum(self) -> int:
        """GA: micro-batches per optimizer step."""
        return self.global_batch_rows // (self.micro_batch_size * self.world_size)

    @property
    def rows_per_stream_per_step(self) -> int:
        """b: rows every stream gives to every step."""
        return self.global_batch_rows // self.num_streams

    @property
    def rows_per_stream_per_micro_batch(self) -> int:
        """r: rows every stream gives to every global micro-batch."""
        return self.micro_batch_size * self.world_size // self.num_streams

    def slices(self, rank: int) -> list[StreamSlice]:
        """The streams rank `rank` reads and which of their r rows per micro-batch it keeps, in batch order."""
        r, m = self.rows_per_stream_per_micro_batch, self.micro_batch_size
        first, last = rank * m, (rank + 1) * m  # the rank's rows in the concatenation of the streams' r rows
        return [StreamSlice(stream, max(first, stream * r) - stream * r, min(last, (stream + 1) * r) - stream * r)
                for stream in range(first // r, (last - 1) // r + 1)]


def allowed_worker_counts(num_streams: int, global_batch_rows: int, micro_batch_size: int, up_to: int) -> list[int]:
    """Every worker count W <= up_to the rule allows for these shards, global batch and micro-batch size."""
    return [w for w in range(1, up_to + 1) if global_batch_rows % (micro_batch_size * w) == 0
            and (micro_batch_size * w) % num_streams == 0]

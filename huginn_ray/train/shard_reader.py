"""Reading the training data in the run's data order (huginn_ray.train.data_order), with an exact resume, and the
collate step (reference §3.12).

A `ShardReader` reads one train shard as a stream: row groups in order, the rows of each row group shuffled with
the stream's own `random.Random(seed + stream)` (one generator continuing over the whole file) and taken from the
end of the shuffled list. Its position is the number of rows consumed; `seek(position)` replays the shuffles of
the row groups before it from the footer's row counts alone (no data read) and re-reads the one it falls in, so a
resumed run reads exactly the rows an uninterrupted run reads (the reference re-read the current row group once
more after a resume).

A `RankReader` holds the streams one rank's slices touch and assembles its micro-batches from them. Every stream
stands at the same position after every step (rows per stream per step x steps), so a checkpoint records one
number, on any worker count.

Every row carries a key: `stream x 2^32 + its row index in the file`. The loop seeds the row's initial latent
noise with it, so the noise of a row is the same whichever rank, micro-batch or worker count trains on it.

Training reads through a `StepPrefetcher`: while step s runs, one background thread reads, checks and collates
step s + 1's micro-batches (and pins them on a GPU, so their copies to the device can be asynchronous). The rows
and their order are the reader's, unchanged; its `position` counts the rows the loop has consumed, not the ones
read ahead, so a checkpoint resumes exactly.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from huginn_ray import storage
from huginn_ray.data.shards import open_parquet, shard_path
from huginn_ray.data.tokens import MASK
from huginn_ray.train.data_order import DataOrder

COLUMN = "input_ids"
KEY_STRIDE = 2**32
"""Row keys are stream x KEY_STRIDE + row index in the file."""


@dataclass
class Rows:
    """Rows of a shard or of a micro-batch."""

    ids: np.ndarray
    """(rows, row_length) int32 token ids."""
    loss_mask: np.ndarray | None
    """(rows, row_length) uint8, 1 where the token is a training target; None: every token but padding is."""
    keys: np.ndarray
    """(rows,) int64: stream x 2^32 + row index in the file, the row's identity (and its noise seed)."""

    @staticmethod
    def concatenate(parts: list[Rows]) -> Rows:
        masks = [p.loss_mask for p in parts]
        if any(m is None for m in masks) and not all(m is None for m in masks):
            raise ValueError("some shards have a loss_mask column and others do not")
        return Rows(np.concatenate([p.ids for p in parts]),
                    None if masks[0] is None else np.concatenate(masks), np.concatenate([p.keys for p in parts]))

    def __getitem__(self, index) -> Rows:
        return Rows(self.ids[index], None if self.loss_mask is None else self.loss_mask[index], self.keys[index])


def read_row_group(file: pq.ParquetFile, path: str | Path, index: int, row_length: int,
                   column: str = COLUMN) -> np.ndarray:
    """(rows, row_length) int32 array of one row group's `column`; every row must have exactly `row_length`
    values."""
    values = file.read_row_group(index, columns=[column]).column(column).combine_chunks()
    lengths = np.diff(values.offsets.to_numpy())
    if lengths.size and (lengths != row_length).any():
        bad = int(np.flatnonzero(lengths != row_length)[0])
        raise ValueError(
            f"{path}: row group {index}, row {bad} has {lengths[bad]} values in {column}, expected {row_length} "
            f"(seq_len + 1)"
        )
    return values.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False).reshape(-1, row_length)


def read_rows(file: pq.ParquetFile, path: str | Path, index: int, row_length: int, stream: int, first_row: int) -> Rows:
    """One row group as Rows (its loss mask when the shard has one); `first_row`: its first row's index in the
    file."""
    ids = read_row_group(file, path, index, row_length)
    mask = (read_row_group(file, path, index, row_length, MASK).astype(np.uint8)
            if MASK in file.schema_arrow.names else None)
    keys = stream * KEY_STRIDE + first_row + np.arange(len(ids), dtype=np.int64)
    return Rows(ids, mask, keys)


class ShardReader:
    """One train shard (a local file or an object) as a stream (module docstring)."""

    def __init__(self, path: str | Path, stream: int, seed: int, row_length: int):
        self.path = path if isinstance(path, str) and storage.is_uri(path) else Path(path)
        self.file = open_parquet(self.path)
        self.stream = stream
        self.seed = seed
        self.row_length = row_length
        sizes = [self.file.metadata.row_group(g).num_rows for g in range(self.file.num_row_groups)]
        self.row_group_sizes = sizes
        self.row_group_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._rewind()

    def _rewind(self) -> None:
        self.rng = random.Random(self.seed + self.stream)
        self.row_group = -1
        self.rows: Rows | None = None
        self.order: list[int] = []
        self.position = 0
        """Rows consumed."""

    @property
    def num_rows(self) -> int:
        return self.file.metadata.num_rows

    def _load_row_group(self, index: int) -> None:
        self.rows = read_rows(self.file, self.path, index, self.row_length, self.stream,
                              int(self.row_group_starts[index]))
        self.order = list(range(len(self.rows.ids)))
        self.rng.shuffle(self.order)
        self.row_group = index

    def next_rows(self, count: int) -> Rows:
        """The next `count` rows; StopIteration once the shard is exhausted."""
        parts, taken = [], []
        for _ in range(count):
            while not self.order:
                if taken:
                    parts.append(self.rows[np.array(taken)])
                    taken = []
                if self.row_group + 1 >= self.file.num_row_groups:
                    raise StopIteration(f"{self.path}: all {self.num_rows} rows read")
                self._load_row_group(self.row_group + 1)
            taken.append(self.order.pop())
            self.position += 1
        if taken:
            parts.append(self.rows[np.array(taken)])
        return Rows.concatenate(parts)

    def seek(self, position: int) -> None:
        """Stand where an uninterrupted read stands after `position` rows: the shuffles of the row groups before
        it are replayed from their row counts (the same generator calls), the row group it falls in is read."""
        if not 0 <= position <= self.num_rows:
            raise ValueError(f"{self.path}: cannot resume at row {position}, the shard holds {self.num_rows} rows: "
                             "the data changed since the checkpoint")
        self._rewind()
        group = 0
        while group < len(self.row_group_sizes) and position - self.position >= self.row_group_sizes[group]:
            self.rng.shuffle(list(range(self.row_group_sizes[group])))
            self.position += self.row_group_sizes[group]
            self.row_group = group
            group += 1
        if position > self.position:
            self._load_row_group(group)
            del self.order[len(self.order) - (position - self.position):]
            self.position = position


class RankReader:
    """One rank's micro-batches in the data order `order` (huginn_ray.train.data_order).

    `open_stream(i)` returns stream i's ShardReader. Per micro-batch the rank reads, from every stream its slices
    touch, the r rows of that stream (as every rank touching the stream does) and keeps its slice."""

    def __init__(self, order: DataOrder, rank: int, open_stream: Callable[[int], ShardReader]):
        self.order = order
        self.slices = order.slices(rank)
        self.streams = {s.stream: open_stream(s.stream) for s in self.slices}

    @property
    def path(self) -> str:
        """The shards read (error messages name them)."""
        return ", ".join(str(stream.path) for stream in self.streams.values())

    @property
    def position(self) -> int:
        """Rows consumed per stream (every stream of the run stands at the same row after every step)."""
        return next(iter(self.streams.values())).position

    def next_micro_batch(self) -> Rows:
        r = self.order.rows_per_stream_per_micro_batch
        return Rows.concatenate([self.streams[s.stream].next_rows(r)[s.start:s.stop] for s in self.slices])

    def seek(self, position: int) -> None:
        for stream in self.streams.values():
            stream.seek(position)


@dataclass
class Batch:
    """A collated micro-batch."""

    inputs: torch.Tensor
    """(rows, seq_len) int64: row[:-1], padding replaced by EOS."""
    labels: torch.Tensor
    """(rows, seq_len) int64: row[1:], with the pad id wherever the token is not a target (ignored by the loss)."""
    keys: torch.Tensor
    """(rows,) int64 row keys (noise seeds), on the host."""

    def pin_memory(self) -> Batch:
        return Batch(self.inputs.pin_memory(), self.labels.pin_memory(), self.keys)


class StepPrefetcher:
    """A training step's micro-batches from `reader`, the next step's read in a background thread meanwhile.

    `next_step()` returns `micro_batches` collated Batches (pinned when `pin`: a CUDA device trains on them),
    then starts reading the step after. Reading is pyarrow, numpy and torch work that releases the GIL for its
    bulk, so it overlaps the step's compute. A read error (pyarrow's, collate's ValueError, StopIteration at the
    shard's end) is raised by the `next_step()` that would have returned those rows, so a bad row group stops
    the step that reaches it, as a synchronous read would.

    `position` is the reader's right after the rows of the last step returned: the rows consumed. The read-ahead
    rows are read again after a resume, as they were never trained on."""

    def __init__(self, reader: RankReader, micro_batches: int, collate_rows: Callable[[Rows], Batch], pin: bool):
        self.reader = reader
        self.micro_batches = micro_batches
        self.collate_rows = collate_rows
        self.pin = pin
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="huginn-prefetch")
        self.pending: Future | None = None
        """The read of the next step, in flight or done; None before the first step and after a failed read."""
        self.consumed_position = 0
        """reader.position after the last step returned (valid while `pending` is not None)."""

    @property
    def path(self) -> str:
        return self.reader.path

    def _read_step(self) -> list[Batch]:
        batches = [self.collate_rows(self.reader.next_micro_batch()) for _ in range(self.micro_batches)]
        return [batch.pin_memory() for batch in batches] if self.pin else batches

    def next_step(self) -> list[Batch]:
        pending = self.pending or self.executor.submit(self._read_step)
        self.pending = None
        batches = pending.result()  # raises the read's error, if any; then nothing is read ahead
        # nothing is in flight here, so the reader stands right after the rows just returned
        self.consumed_position = self.reader.position
        self.pending = self.executor.submit(self._read_step)
        return batches

    @property
    def position(self) -> int:
        return self.consumed_position if self.pending is not None else self.reader.position

    def seek(self, position: int) -> None:
        """Drop what was read ahead (its error too) and continue from `position`."""
        if self.pending is not None:
            self.pending.exception()  # waits for the read to end; its rows and error are dropped
            self.pending = None
        self.reader.seek(position)


def collate(rows: Rows, pad_id: int, eos_id: int, vocab_size: int | None = None) -> Batch:
    """rows (B, seq_len + 1) -> inputs = row[:-1] with pad replaced by eos, labels = row[1:] with the pad id
    where the token is padding or, with a loss mask, not a target.

    With `vocab_size`, every id must lie in [0, vocab_size): checked here on the host, once per batch, so the
    model's forward does not need its own check (a host sync on a GPU) in training."""
    ids = rows.ids
    if vocab_size is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        row, col = (int(i) for i in np.argwhere((ids < 0) | (ids >= vocab_size))[0])
        raise ValueError(f"token id {int(ids[row, col])} at (row {row}, position {col}) of the batch is outside "
                         f"the model's vocabulary [0, {vocab_size}): were the shards made with another tokenizer?")
    batch = torch.from_numpy(np.ascontiguousarray(ids)).long()
    inputs = batch[:, :-1].clone()
    inputs[inputs == pad_id] = eos_id
    labels = batch[:, 1:].clone()
    if rows.loss_mask is not None:
        labels[torch.from_numpy(np.ascontiguousarray(rows.loss_mask[:, 1:])) == 0] = pad_id
    return Batch(inputs, labels, torch.from_numpy(np.asarray(rows.keys, dtype=np.int64)))


def validation_rows(data_dir: str | Path, order: DataOrder, rank: int, eval_iters: int, row_length: int) -> Rows:
    """The fixed validation set of a rank, `eval_iters` micro-batches: validation micro-batch e is the
    concatenation of rows [e x r, (e + 1) x r) of every validation shard, in file order, sliced like training's
    (r = order.rows_per_stream_per_micro_batch). With one shard per rank: the first rows of the rank's shard."""
    r = order.rows_per_stream_per_micro_batch
    per_stream = {}
    for s in order.slices(rank):
        path = shard_path(data_dir, "val", s.stream)
        file = open_parquet(path)
        if file.metadata.num_rows < eval_iters * r:
            raise ValueError(f"{path}: {file.metadata.num_rows} rows, validation needs {eval_iters * r}")
        parts, first = [], 0
        while first < eval_iters * r:
            parts.append(read_rows(file, path, len(parts), row_length, s.stream, first))
            first += len(parts[-1].ids)
        per_stream[s.stream] = Rows.concatenate(parts)
    return Rows.concatenate([per_stream[s.stream][e * r + s.start:e * r + s.stop]
                             for e in range(eval_iters) for s in order.slices(rank)])

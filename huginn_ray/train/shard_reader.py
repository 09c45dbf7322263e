"""Per-rank reading of the training shard, with an exact resume, and the collate step (reference §3.12).

Rank r reads `<data_dir>/train/{r:05d}.parquet` and no other file. Row groups are read in order; the rows of each
row group are shuffled with the rank's own `random.Random(seed + rank)` (one generator continuing over the whole
file) and taken from the end of the shuffled list.

The reader's state is (row group in the buffer, RNG state before that row group's shuffle, rows taken from it).
Loading it re-reads and re-shuffles that row group and drops the rows already taken, then continues with the
next row group, so a resumed run reads exactly the rows an uninterrupted run reads (the reference re-read the
current row group once more after a resume).

Training reads through a `StepPrefetcher`: while step s runs, one background thread reads, checks and collates
step s + 1's micro-batches (and pins them on a GPU, so their copies to the device can be asynchronous). The rows
and their order are the reader's, unchanged; its `state_dict` describes the rows the loop has consumed, not the
ones read ahead, so a checkpoint resumes exactly.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from huginn_ray.data.shards import shard_path

COLUMN = "input_ids"


def read_row_group(file: pq.ParquetFile, path: Path, index: int, row_length: int) -> np.ndarray:
    """(rows, row_length) int32 array of one row group; every row must have exactly `row_length` ids."""
    column = file.read_row_group(index, columns=[COLUMN]).column(COLUMN).combine_chunks()
    lengths = np.diff(column.offsets.to_numpy())
    if lengths.size and (lengths != row_length).any():
        bad = int(np.flatnonzero(lengths != row_length)[0])
        raise ValueError(
            f"{path}: row group {index}, row {bad} has {lengths[bad]} ids, expected {row_length} (seq_len + 1)"
        )
    return column.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False).reshape(-1, row_length)


class ShardReader:
    def __init__(self, path: str | Path, seed: int, row_length: int):
        self.path = Path(path)
        self.file = pq.ParquetFile(self.path)
        self.row_length = row_length
        self.rng = random.Random(seed)
        self.row_group = -1
        self.rng_state_before_shuffle: tuple | None = None
        self.taken = 0
        self.rows = np.empty((0, row_length), dtype=np.int32)
        self.order: list[int] = []

    @property
    def num_rows(self) -> int:
        return self.file.metadata.num_rows

    def _load_row_group(self, index: int) -> None:
        self.rows = read_row_group(self.file, self.path, index, self.row_length)
        self.rng_state_before_shuffle = self.rng.getstate()
        self.order = list(range(len(self.rows)))
        self.rng.shuffle(self.order)
        self.row_group = index
        self.taken = 0

    def next_row(self) -> np.ndarray:
        """The next row; StopIteration once the shard is exhausted."""
        while not self.order:
            if self.row_group + 1 >= self.file.num_row_groups:
                raise StopIteration(f"{self.path}: all {self.num_rows} rows read")
            self._load_row_group(self.row_group + 1)
        self.taken += 1
        return self.rows[self.order.pop()]

    def next_rows(self, count: int) -> np.ndarray:
        return np.stack([self.next_row() for _ in range(count)])

    def state_dict(self) -> dict:
        return {
            "file": self.path.name,
            "num_rows": self.num_rows,
            "row_group": self.row_group,
            "taken": self.taken,
            "rng_state_before_shuffle": self.rng_state_before_shuffle,
            "rng_state": self.rng.getstate(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["file"] != self.path.name or state["num_rows"] != self.num_rows:
            raise ValueError(
                f"reader state is for {state['file']} with {state['num_rows']} rows, "
                f"but this rank reads {self.path} with {self.num_rows} rows: the data changed since the checkpoint"
            )
        if state["row_group"] < 0:
            self.rng.setstate(_as_state(state["rng_state"]))
            return
        self.rng.setstate(_as_state(state["rng_state_before_shuffle"]))
        self._load_row_group(state["row_group"])
        for _ in range(state["taken"]):
            self.order.pop()
        self.taken = state["taken"]


class StepPrefetcher:
    """A training step's micro-batches from `reader`, the next step's read in a background thread meanwhile.

    `next_step()` returns `micro_batches` collated (inputs, labels) pairs of `micro_batch_size` rows each, pinned
    when `pin` (a CUDA device trains on them), then starts reading the step after. Reading is pyarrow, numpy and
    torch work that releases the GIL for its bulk, so it overlaps the step's compute. A read error (pyarrow's,
    collate's ValueError, StopIteration at the shard's end) is raised by the `next_step()` that would have
    returned those rows, so a bad row group stops the step that reaches it, as a synchronous read would.

    `state_dict()` is the reader's state right after the rows of the last step returned: the rows consumed. The
    read-ahead rows are read again after a resume, as they were never trained on."""

    def __init__(self, reader, micro_batch_size: int, micro_batches: int,
                 collate_rows: Callable[[np.ndarray], tuple[torch.Tensor, torch.Tensor]], pin: bool):
        self.reader = reader
        self.micro_batch_size = micro_batch_size
        self.micro_batches = micro_batches
        self.collate_rows = collate_rows
        self.pin = pin
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="huginn-prefetch")
        self.pending: Future | None = None
        """The read of the next step, in flight or done; None before the first step and after a failed read."""
        self.consumed_state: dict | None = None
        """reader.state_dict() after the last step returned (valid while `pending` is not None)."""

    @property
    def path(self):
        """The shard being read (error messages name it)."""
        return self.reader.path

    def _read_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batches = [self.collate_rows(self.reader.next_rows(self.micro_batch_size)) for _ in range(self.micro_batches)]
        if self.pin:
            batches = [(inputs.pin_memory(), labels.pin_memory()) for inputs, labels in batches]
        return batches

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pending = self.pending or self.executor.submit(self._read_step)
        self.pending = None
        batches = pending.result()  # raises the read's error, if any; then nothing is read ahead
        # nothing is in flight here, so the reader stands right after the rows just returned
        self.consumed_state = self.reader.state_dict()
        self.pending = self.executor.submit(self._read_step)
        return batches

    def state_dict(self) -> dict:
        return self.consumed_state if self.pending is not None else self.reader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Drop what was read ahead (its error too) and continue from `state`."""
        if self.pending is not None:
            self.pending.exception()  # waits for the read to end; its rows and error are dropped
            self.pending = None
        self.reader.load_state_dict(state)


def _as_state(state) -> tuple:
    """random.Random states come back from some serialisers with lists instead of tuples."""
    version, internal, gauss = state
    return version, tuple(internal), gauss


def collate(rows: np.ndarray, pad_id: int, eos_id: int, vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (B, seq_len + 1) -> inputs = row[:-1] with pad replaced by eos, labels = row[1:] (pad kept).

    With `vocab_size`, every id must lie in [0, vocab_size): checked here on the host, once per batch, so the
    model's forward does not need its own check (a host sync on a GPU) in training."""
    if vocab_size is not None and rows.size and (rows.min() < 0 or rows.max() >= vocab_size):
        row, col = (int(i) for i in np.argwhere((rows < 0) | (rows >= vocab_size))[0])
        raise ValueError(f"token id {int(rows[row, col])} at (row {row}, position {col}) of the batch is outside "
                         f"the model's vocabulary [0, {vocab_size}): were the shards made with another tokenizer?")
    batch = torch.from_numpy(np.ascontiguousarray(rows)).long()
    inputs = batch[:, :-1].clone()
    inputs[inputs == pad_id] = eos_id
    return inputs, batch[:, 1:].clone()


def validation_rows(data_dir: str | Path, rank: int, count: int, row_length: int) -> np.ndarray:
    """The fixed validation set of a rank: the first `count` rows of its validation shard, in file order."""
    path = shard_path(data_dir, "val", rank)
    file = pq.ParquetFile(path)
    if file.metadata.num_rows < count:
        raise ValueError(f"{path}: {file.metadata.num_rows} rows, validation needs {count}")
    rows, index = [], 0
    while sum(len(r) for r in rows) < count:
        rows.append(read_row_group(file, path, index, row_length))
        index += 1
    return np.concatenate(rows)[:count]

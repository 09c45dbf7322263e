"""Packed rows as Ray Data records, and how the operators that carry them run (shuffle, released data, dedup).

The operators of huginn_ray/data/shards.py and huginn_ray/data/dedup.py are each one Ray Data dataset over the rows
themselves:

    read_datasource(packed_rows(units))   the rows of a unit's files (a map group, or one released file), read by
                                          row groups, checked (row length, id range), with their file and index
      -> map_batches(fn)                  the work on the rows: their place in the permutation, their hashes
      -> write_datasink(sink)             the unit's output files (map files, shards), committed

(The shuffle's reduce pass reads map files instead, with no map step: shards.map_file_rows; the dedup passes
gather their rows' hashes on the driver instead of writing: dedup.py.)

Read, map and write are tasks that declare the same resources, so Ray Data fuses them into one task per unit
(operator `ReadPackedRows->MapBatches(fn)->Write`): the rows go from the read to the writer inside one worker
and never through the object store, which matters where a stage moves all the bytes of the data (the shuffle).
Ray Data shows each operator's progress in rows and blocks; blocks are at most BLOCK_BYTES (the context's
target_max_block_size while a pass runs), so a task holds its own state plus a few blocks, not its unit's read.

`run_units` runs such a pass over units of declared memory: one dataset per memory class, tasks never retried by Ray
(max_retries=0), a unit whose worker was killed rerun with twice its memory (execution.rerun_killed), and an error
of this project's own (TokenRangeError, DataError, ...: it names the file and row) raised on the driver as that
very exception, not Ray's wrapper of it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa

from huginn_ray.data.execution import quiet_remote_args, task_args, unit_reads
from huginn_ray.data.tokens import MASK, rows_to_arrow

BLOCK_BYTES = 4 << 20
"""Ray Data's target block size while these passes run: a block is emitted once its buffer holds more, so a task
holds a few blocks of this size besides its own state (part of every memory= of these passes, shards.py). Below a
read batch of long rows (1,024 rows of 4,097 uint16 ids: 8 MiB), so that Ray Data passes such a batch on as
zero-copy slices instead of concatenating batches into a new block."""

UNIT, FILE, SPLIT, INDEX, SHA256 = "unit", "file", "split", "index", "sha256"
"""The columns the read adds to a row: its unit, its file in the unit, its split (0 train, 1 val), its index in
the split (the unit's offset for the split plus its number among the split's kept rows of the unit), and, when the
files are hashed, its file's sha256."""


def read_unit_rows(unit_index: int, unit: dict, row_len: int, dtype: str, vocab_size: int, hashed: bool):
    """The read task of one unit ({"files": [entry, ...], "offsets": {split: first index}}): its rows, one block
    per read batch (shards._read_input: at most a row group, checked, in the storage type)."""
    from huginn_ray.data.shards import SPLITS, _read_input

    index = {name: unit.get("offsets", {}).get(name, 0) for name in SPLITS}
    for file, entry in enumerate(unit["files"]):
        hashes: dict | None = {} if hashed else None
        for name, rows, mask in _read_input(entry, row_len, dtype, vocab_size, hashes):
            if not len(rows):
                continue
            n = len(rows)
            columns = {UNIT: pa.array(np.full(n, unit_index, np.int32)), FILE: pa.array(np.full(n, file, np.int32)),
                       SPLIT: pa.array(np.full(n, SPLITS[name], np.uint8)),
                       INDEX: pa.array(np.arange(index[name], index[name] + n, dtype=np.int64)),
                       "input_ids": rows_to_arrow(rows, dtype, large=True)}
            if mask is not None:
                columns[MASK] = rows_to_arrow(mask, "uint8", large=True)
            if hashed:
                columns[SHA256] = pa.array([hashes[entry["path"]]] * n, pa.string())
            index[name] += n
            yield pa.table(columns)


def rows_by_unit(table: pa.Table):
    """(unit, its rows) for each unit a block holds, in unit order (a block usually holds one unit's rows: then the
    block itself, not a filtered copy)."""
    unit_col = table.column(UNIT).to_numpy()
    for unit in np.unique(unit_col):
        yield int(unit), table if unit_col[0] == unit_col[-1] else table.filter(pa.array(unit_col == unit))


def packed_rows(units: list[tuple[int, dict]], *, row_len: int, dtype: str, vocab_size: int, hashed: bool):
    """A Ray Data datasource of the rows of `units` ((unit index, unit) pairs), one read task per unit."""
    return unit_reads("PackedRows", units, lambda unit: read_unit_rows(*unit, row_len, dtype, vocab_size, hashed),
                      rows=lambda unit: sum(f["train_rows"] + f["val_rows"] for f in unit[1]["files"]),
                      files=lambda unit: [f["path"] for f in unit[1]["files"]])


def read_dataset(datasource, count: int, memory: int | None):
    """The read of a pass: one read task and block stream per unit (override_num_blocks)."""
    import ray.data

    with quiet_remote_args():
        return ray.data.read_datasource(datasource, override_num_blocks=count, ray_remote_args=task_args(memory))


def map_rows(dataset, fn: Callable, memory: int | None, **fn_kwargs):
    """The map step of a pass: `fn(table, **fn_kwargs)` on each block (pyarrow), fused with the read."""
    with quiet_remote_args():
        return dataset.map_batches(fn, fn_kwargs=fn_kwargs, batch_size=None, batch_format="pyarrow",
                                   **task_args(memory))


def write_rows(dataset, sink, memory: int | None) -> None:
    """The write step of a pass, fused with the read and the map: runs the dataset to its end."""
    dataset.write_datasink(sink, ray_remote_args=task_args(memory))

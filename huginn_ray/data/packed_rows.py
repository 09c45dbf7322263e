"""Packed rows read by unit, and how the passes that carry them run (shuffle, released data, dedup).

The passes of the shuffle (huginn_ray/data/shuffle.py) and the per-file conversion of already packed data
(per_file.py) are each one Ray Data dataset of one task per unit that does the unit's whole work:

    read_packed_file / read_unit_rows     the rows of a unit's files (a map group, or one released file), read by
                                          row groups, checked (row length, id range), with their file and index
      -> the work on the rows             their place in the permutation, their hashes
      -> the unit's output files          map files, shards: committed by the task itself

run as the read task of the unit (`execution.run_unit_tasks`, operator `Read<name>`), which hands Ray Data only
the small dict of what it committed. (The shuffle's reduce pass reads map files instead: shuffle.read_reducer_rows; the
dedup passes gather their rows' hashes on the driver instead of writing, a read and a map step over the rows:
dedup.py.) A packed file is read by `read_packed_file`, READ_BATCH_ROWS rows at a time, each batch checked (row
length, id range) and split into train and validation rows.

Why the rows do not go through a Ray Data write: Ray Data's write operator (2.60, `plan_write_op`) tees its
task's blocks and drains the second copy for its statistics only after the datasink's write returns, so a write
that gathers its whole unit (a map group, a reducer) would hold the unit's rows twice until the task ends. In one
task per unit the rows go from the read to the files inside one worker, never through the object store (which
matters where a stage moves all the bytes of the data), and each block is dropped once copied: a task holds its
own state plus a block or two.

`run_units` runs such a pass over units of declared memory: one dataset per memory class, tasks never retried by Ray
(max_retries=0), a unit whose worker was killed rerun with twice its memory (execution.rerun_killed), and an error
of this project's own (TokenRangeError, DataError, ...: it names the file and row) raised on the driver as that
very exception, not Ray's wrapper of it.
"""

from __future__ import annotations

import hashlib
import resource
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from huginn_ray.data.execution import quiet_remote_args, task_args, unit_reads
from huginn_ray.data.shards import SPLITS
from huginn_ray.data.tokens import (MASK, TokenRangeError, check_ids, fixed_rows, mask_rows, numpy_dtype,
                                    rows_to_arrow, token_column_error)

BLOCK_BYTES = 4 << 20
"""Ray Data's target block size while these passes run: a block is emitted once its buffer holds more, so a task
holds a few blocks of this size besides its own state (part of every memory= of these passes: RAY_DATA_BLOCKS). Below a
read batch of long rows (1,024 rows of 4,097 uint16 ids: 8 MiB), so that Ray Data passes such a batch on as
zero-copy slices instead of concatenating batches into a new block."""

UNIT, FILE, SPLIT, INDEX, SHA256 = "unit", "file", "split", "index", "sha256"
"""The columns the read adds to a row: its unit, its file in the unit, its split (0 train, 1 val), its index in
the split (the unit's offset for the split plus its number among the split's kept rows of the unit), and, when the
files are hashed, its file's sha256."""

TASK_OVERHEAD = 256 << 20  # a worker's own footprint (interpreter, pyarrow, numpy), added to memory= requests

RAY_DATA_BLOCKS = 3 * BLOCK_BYTES
"""What Ray Data holds in a task of these passes besides the task's own state: the read's and the map step's
output buffers (blocks are emitted once they exceed BLOCK_BYTES) and the block being built from them."""

READ_BATCH_ROWS = 1024
"""Rows decoded at a time from an input file (parquet still reads a whole column chunk, compressed, at once)."""


def read_packed_file(entry: dict, row_len: int, dtype: str, vocab_size: int, hashes: dict):
    """Yield (split, rows, mask) blocks of one input file: (n, row_len) arrays of the storage type, checked, and
    their (n, row_len) uint8 loss mask (None when the file has no `loss_mask` column).

    Decoded READ_BATCH_ROWS at a time, so a task holds one file's compressed column chunk and a batch, not the
    file decoded. With `hashes` not None, the file's sha256 is recorded in it (read once: hashed and parsed).
    Row numbers (in the file) listed in `entry["skip_rows"]` are left out (validation rows that also occur in train,
    huginn_ray/data/dedup.py); the entry's row counts are those of the rows kept."""
    path = entry["path"]
    skip = np.asarray(entry.get("skip_rows", []), np.int64)
    if hashes is not None:
        data = pa.py_buffer(Path(path).read_bytes())
        hashes[path] = hashlib.sha256(data).hexdigest()
        source = pa.BufferReader(data)
    else:
        source = path
    pf = pq.ParquetFile(source, pre_buffer=False)
    names = pf.schema_arrow.names
    why = token_column_error(pf.schema_arrow)
    if why:
        raise TokenRangeError(f"{path}: {why}")
    has_split, has_mask = "split" in names, MASK in names
    seen = dict.fromkeys(SPLITS, 0)
    row = 0
    columns = ["input_ids", *([MASK] if has_mask else []), *(["split"] if has_split else [])]
    # a batch spanning row groups is decoded from all of them at once: no batch larger than a row group
    batch_rows = min([READ_BATCH_ROWS] + [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)])
    for batch in pf.iter_batches(batch_size=max(1, batch_rows), columns=columns, use_threads=False):
        rows = fixed_rows(batch.column("input_ids"), row_len, str(path), first_row=row)
        check_ids(rows, vocab_size, dtype, str(path))
        rows = rows.astype(numpy_dtype(dtype), copy=False)
        mask = mask_rows(batch.column(MASK), row_len, str(path), row) if has_mask else None
        codes = batch.column("split").to_numpy(zero_copy_only=False) if has_split else None
        if len(skip):
            keep = ~np.isin(np.arange(row, row + len(rows)), skip)
            rows, codes = rows[keep], codes[keep] if has_split else None
            mask = mask[keep] if has_mask else None
        row += len(keep) if len(skip) else len(rows)
        for name, code in SPLITS.items():
            if has_split:
                chosen = codes == code
                part, part_mask = rows[chosen], mask[chosen] if has_mask else None
            else:
                part = rows if entry[f"{name}_rows"] else rows[:0]
                part_mask = None if mask is None else mask[:len(part)]
            seen[name] += len(part)
            if seen[name] > entry[f"{name}_rows"]:
                break
            yield name, part, part_mask
    for name in SPLITS:
        if seen[name] != entry[f"{name}_rows"]:
            raise ValueError(f"{path}: {'more than ' if seen[name] > entry[f'{name}_rows'] else ''}{seen[name]} "
                             f"{name} rows, the plan expected {entry[f'{name}_rows']} (the file changed since it "
                             "was listed)")


def read_unit_rows(unit_index: int, unit: dict, row_len: int, dtype: str, vocab_size: int, hashed: bool):
    """The read task of one unit ({"files": [entry, ...], "offsets": {split: first index}}): its rows, one block
    per read batch (read_packed_file: at most a row group, checked, in the storage type)."""
    index = {name: unit.get("offsets", {}).get(name, 0) for name in SPLITS}
    for file, entry in enumerate(unit["files"]):
        hashes: dict | None = {} if hashed else None
        for name, rows, mask in read_packed_file(entry, row_len, dtype, vocab_size, hashes):
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
                      files=unit_files)


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


def peak_rss_mib() -> float:
    """The peak resident memory of this process in MiB (a task reports its own: tests check it against its
    memory= declaration)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def unit_files(unit: tuple[int, dict]) -> list[str]:
    """The input files of an (index, unit) pair, for Ray Data's metadata."""
    return [f["path"] for f in unit[1].get("files", [])]

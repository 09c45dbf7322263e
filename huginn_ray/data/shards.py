"""The global shuffle: packed rows -> exactly N train + N validation shards, one per training rank.

Contract. Packed rows have a deterministic global order per split (input files in the given order, rows in file
order). For a split with T rows, rows_per_shard = T // N and the first N * rows_per_shard positions of a seeded
pseudo-random permutation of [0, T) are kept (the surplus T mod N rows are dropped and reported). The row at
global index g goes to position p = perm(g): shard p // rows_per_shard, slot p % rows_per_shard. The permutation
is a keyed Feistel network with cycle walking, so every row is placed exactly once, with no table of T entries.
Train and validation rows are shuffled separately and never mixed.

Execution: a two-pass external shuffle through files, so that no intermediate data lives in Ray's object store
and nothing the driver or a task holds grows with N (huginn_ray/data/README.md has the cost model). Each pass is one
Ray Data dataset of the rows themselves, read -> map -> write fused into one task per unit (packed_rows.py):

1. map (operator `ReadPackedRows->MapBatches(place_rows)->Write`, one task per group of
   ~`shuffle.map_mib` of input files): the read yields the group's rows by row groups (row length and id range
   checked), each with its split and index in the split; `place_rows` computes every row's position in the
   permutation; the write (`write_map_units`) drops the surplus, sorts the rows by position (hence by destination
   shard) and commits one Arrow IPC file per split, `map/<split>/MMMMMM.arrow` (columns `position`, `input_ids`,
   and `loss_mask` for chat rows), plus `MMMMMM.idx.npy`: N + 1 row offsets, row range [idx[s], idx[s+1]) of the
   file holds the rows bound for shard s.
2. reduce (operator `ReadMapFileRows->Write`): the driver gathers a split's per-map indexes into one
   `map/<split>/index.npy` ((N + 1) x M); one task per range of consecutive shards holding ~`shuffle.reducer_mib`
   of rows reads the two rows of it that bound its shards, memory-maps only the map files holding rows for it and
   yields only its row ranges; the write (`write_reducer_shards`) merges them by position and commits its shards
   `<split>/RRRRR.parquet` (column `input_ids`, list<uint16|int32>, row groups of `shuffle.row_group_size`).

Chat rows (huginn_ray/data/tokenize_pack.py) carry a `loss_mask` column, list<uint8>, one entry per id: it is read,
sorted, written and merged with its row's ids in every step, so a shard's `loss_mask` row r belongs to its
`input_ids` row r, and the manifest records `loss_mask` with the shards' supervised tokens per split. Inputs without
the column give shards without it, byte for byte as before; a shuffle's inputs all have it or none does.

Ray Data shows each operator's progress in rows (off under `prepare_data.py --quiet`). Map tasks and reducers
declare `memory=` to Ray from their data size and the input's id width (map_task_memory, reduce_task_memory), so
Ray does not start more of them on a node than its memory holds; a task whose worker was killed reruns with twice
its memory (execution.run_units). Every file is written under a temporary name and renamed when complete, in
`<shard_dir>.partial/` with the plan's fingerprint: a rerun after a crash keeps the committed map files and
shards and reads and redoes only the rest.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import math
import os
import resource
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.execution import block_size, run_units, unit_reads
from huginn_ray.data.packed_rows import (BLOCK_BYTES, FILE, INDEX, SHA256, SPLIT, UNIT, map_rows, packed_rows,
                                         read_dataset, rows_by_unit, write_rows)
from huginn_ray.data.permutation import FeistelPermutation
from huginn_ray.data.tokens import (DTYPES, MASK, MAX_LIST_IDS, TokenRangeError, arrow_type, check_ids, fixed_rows,
                                    numpy_dtype, parquet_options, row_schema, rows_to_arrow)

TRAIN, VAL = 0, 1
SPLITS = {"train": TRAIN, "val": VAL}
MANIFEST = "manifest.json"
_TASK_OVERHEAD = 256 << 20  # a worker's own footprint (interpreter, pyarrow, numpy), added to memory= requests


def shard_path(shard_dir: str | Path, split: str, rank: int) -> Path:
    return Path(shard_dir) / split / f"{rank:05d}.parquet"


def plan_split(total_rows: int, num_shards: int, row_bytes: int, reducer_bytes: int, split: str) -> dict:
    """Rows per shard, surplus and reducer layout of one split: about `reducer_bytes` of rows per reducer."""
    rows_per_shard = total_rows // num_shards
    if rows_per_shard == 0:
        raise ValueError(f"the {split} split has {total_rows} packed rows, fewer than num_shards={num_shards}: "
                         "add data, lower num_shards or (for val) raise val_fraction")
    reducers = max(1, min(num_shards, math.ceil(total_rows * row_bytes / reducer_bytes)))
    shards_per_reducer = math.ceil(num_shards / reducers)
    reducers = math.ceil(num_shards / shards_per_reducer)
    return {"rows": total_rows, "num_shards": num_shards, "rows_per_shard": rows_per_shard,
            "kept": rows_per_shard * num_shards,
            "dropped": total_rows - rows_per_shard * num_shards, "reducers": reducers,
            "shards_per_reducer": shards_per_reducer}


def _group_files(files: list[dict], row_bytes: int, group_bytes: int) -> list[list[dict]]:
    """Consecutive input files in groups of about `group_bytes` of rows: one map task each."""
    groups: list[list[dict]] = [[]]
    size = 0
    for f in files:
        if groups[-1] and size + (f["train_rows"] + f["val_rows"]) * row_bytes > group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(f)
        size += (f["train_rows"] + f["val_rows"]) * row_bytes
    return [g for g in groups if g]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _map_paths(work: Path, split: str, index: int) -> tuple[Path, Path]:
    return work / "map" / split / f"{index:06d}.arrow", work / "map" / split / f"{index:06d}.idx.npy"


def _hashes_path(work: Path, index: int) -> Path:
    """The sha256 of map group `index`'s input files (hashed inputs), committed before its map files."""
    return work / "map" / f"{index:06d}.sha256.json"


READ_BATCH_ROWS = 1024
"""Rows decoded at a time from an input file (parquet still reads a whole column chunk, compressed, at once)."""


def _read_input(entry: dict, row_len: int, dtype: str, vocab_size: int, hashes: dict):
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
        mask = _mask_rows(batch.column(MASK), row_len, str(path), row) if has_mask else None
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


def token_column_error(schema: pa.Schema) -> str | None:
    """Why a file's `input_ids` column cannot be read as token ids (None when it can): it must be a list of
    integers. Floats would be truncated to ids without a word, strings cannot be ids."""
    ids = schema.field("input_ids").type if "input_ids" in schema.names else None
    if ids is None:
        return f"no column input_ids (columns: {', '.join(schema.names)})"
    if not (pa.types.is_list(ids) or pa.types.is_large_list(ids)) or not pa.types.is_integer(ids.value_type):
        return f"column input_ids must hold lists of integer token ids, got {ids}"
    return None


def _mask_rows(column, row_len: int, where: str, first_row: int) -> np.ndarray:
    """A loss_mask list column -> (rows, row_len) uint8 of 0/1; refuses other lengths and values."""
    mask = fixed_rows(column, row_len, f"{where}: column {MASK}", first_row=first_row).astype(np.uint8, copy=False)
    if mask.size and mask.max() > 1:
        raise ValueError(f"{where}: column {MASK} holds {int(mask.max())}, a loss mask holds 0 or 1")
    return mask


WRITE_CHUNK_BYTES = 32 << 20
"""Rows are gathered into sorted order and written this many bytes at a time (map files and shards), so a task
never holds a second full copy of its rows."""

RAY_DATA_BLOCKS = 3 * BLOCK_BYTES
"""What Ray Data holds in a task of these passes besides the task's own state: the read's and the map step's
output buffers (blocks are emitted once they exceed BLOCK_BYTES) and the block being built from them."""

HELD_COLUMN_BYTES = 40
"""Ray Data's write (2.60) keeps every block of its task until the task ends (its write function tees the blocks
and drains the second copy for statistics after the datasink's write returns), so a task that writes holds its
unit's rows once as blocks besides what its write builds from them: their ids in the storage type (a loss mask:
one byte more per id) and up to this many bytes per row of the columns the read and the map step add (unit, file,
split, index, position, hash)."""


READ_FACTOR = 3
"""A task reading a parquet file holding B bytes of ids in their physical type (parquet has no 16-bit integers:
uint16 ids are stored as int32) holds up to ~READ_FACTOR x B while it does (the whole column chunk is read at once,
then decoded batch by batch). Measured up to 2.6x (a map group of two 64 MiB int64 files like the released data's;
fresh process, ru_maxrss growth less the group's rows and write chunks) and 1.5x for packed uint16 files; +1 B
when the file is hashed (its bytes are held while parsed)."""


def map_task_memory(group: list[dict], row_len: int, dtype: str, input_width: int, hashed: bool,
                    mask: bool = False) -> int:
    """The memory a map task uses, declared to Ray as `memory=`: its rows once in the storage type, 24 bytes per
    row of positions and sort order, reading its largest input file (READ_FACTOR), one write chunk twice (the
    gathered rows and their Arrow copy), Ray Data's blocks in flight (RAY_DATA_BLOCKS) and the blocks its write
    keeps (the rows once more: HELD_COLUMN_BYTES), and the worker's own footprint. A loss mask adds one byte per
    id."""
    width = np.dtype(numpy_dtype(dtype)).itemsize + mask
    rows = sum(f["train_rows"] + f["val_rows"] for f in group)
    largest = max((f["train_rows"] + f["val_rows"] for f in group), default=0) * row_len * max(4, input_width)
    return (rows * (2 * row_len * width + 24 + HELD_COLUMN_BYTES) + largest * (READ_FACTOR + hashed)
            + 2 * WRITE_CHUNK_BYTES + RAY_DATA_BLOCKS + _TASK_OVERHEAD)


def reduce_task_memory(plan: dict, row_len: int, dtype: str, mask: bool = False) -> int:
    """The memory a reducer uses, declared as `memory=`: its rows once in the storage type plus the same again for
    the memory-mapped map-file ranges it copies from (resident while read), 24 bytes per row of positions and
    order, one shard's rows and one write chunk, Ray Data's blocks in flight (RAY_DATA_BLOCKS) and the worker's
    own footprint. A loss mask adds a byte per id."""
    width = np.dtype(numpy_dtype(dtype)).itemsize + mask
    rows = plan["shards_per_reducer"] * plan["rows_per_shard"]
    return (rows * (2 * row_len * width + 24) + plan["rows_per_shard"] * row_len * width + 2 * WRITE_CHUNK_BYTES
            + RAY_DATA_BLOCKS + _TASK_OVERHEAD)


def place_rows(table: pa.Table, plans: dict, seed: int) -> pa.Table:
    """The map step of the shuffle's map pass (operator `MapBatches(place_rows)`): every row's position in its
    split's permutation (`position`; -1 for a row of a split that is not shuffled here)."""
    split, index = table.column(SPLIT).to_numpy(), table.column(INDEX).to_numpy()
    position = np.full(len(index), -1, np.int64)
    for name, plan in plans.items():
        chosen = split == SPLITS[name]
        if chosen.any():
            position[chosen] = FeistelPermutation(plan["rows"], seed, f"shuffle:{name}")(index[chosen])
    return table.append_column("position", pa.array(position))


def write_map_units(tables, units: dict[int, dict], plans: dict, work: str, row_len: int, dtype: str,
                    with_mask: bool) -> list[dict]:
    """The write of the shuffle's map pass: the placed rows of the units in `tables` (all rows of each: one
    unit's read, map and write are one task) sorted by position, hence by destination shard, into one map file
    (+ index) per split not yet committed. `units`: {unit: {"files": entries, "counts": {split: rows}}}.

    Each unit's rows are copied once into arrays of their planned size as the blocks arrive (a block is dropped
    once copied); a unit whose rows are not all there is refused before anything of it is committed."""
    work_dir = Path(work)
    state: dict[int, dict] = {}
    for table in tables:
        for unit, part in rows_by_unit(table):
            if unit not in state:
                state[unit] = _map_state(unit, units[unit]["counts"], plans, work_dir, row_len, dtype, with_mask)
            st = state[unit]
            if SHA256 in part.column_names:
                files, digests = part.column(FILE).to_numpy(), part.column(SHA256)
                for f in np.unique(files):
                    st["hashes"][units[unit]["files"][int(f)]["path"]] = digests[int(np.argmax(files == f))].as_py()
            if (MASK in part.column_names) != with_mask:
                path = units[unit]["files"][int(part.column(FILE)[0].as_py())]["path"]
                raise ValueError(f"{path}: {'no' if with_mask else 'a'} {MASK} column, the other inputs of this "
                                 f"shuffle have {'one' if with_mask else 'none'}")
            for batch in part.to_batches():  # the block's chunks, each a view: no combined copy of the block
                split = batch.column(SPLIT).to_numpy()
                for name, code in SPLITS.items():
                    chosen = split == code
                    n = int(chosen.sum())
                    if name in st["todo"] and n:
                        # a run of one split (the common case) is copied as a slice, without a gathered copy
                        take = slice(None) if n == len(split) else chosen
                        at = st["filled"][name]
                        st["rows"][name][at:at + n] = fixed_rows(batch.column("input_ids"), row_len, "map block")[take]
                        st["position"][name][at:at + n] = batch.column("position").to_numpy()[take]
                        if with_mask:
                            st["masks"][name][at:at + n] = fixed_rows(batch.column(MASK), row_len, "map block")[take]
                    st["filled"][name] += n
    return [_commit_map_unit(unit, st, units[unit], plans, work_dir, row_len, dtype, with_mask)
            for unit, st in state.items()]


def _map_state(unit: int, counts: dict, plans: dict, work_dir: Path, row_len: int, dtype: str,
               with_mask: bool) -> dict:
    """A map group's rows as the write gathers them: arrays of their planned size for each split whose map file
    is still to write."""
    todo = [name for name in plans if not _map_paths(work_dir, name, unit)[1].exists()]
    return {"todo": todo, "filled": dict.fromkeys(SPLITS, 0), "hashes": {},
            "rows": {name: np.empty((counts[name], row_len), numpy_dtype(dtype)) for name in todo},
            "masks": {name: np.empty((counts[name], row_len), np.uint8) for name in todo} if with_mask else {},
            "position": {name: np.empty(counts[name], np.int64) for name in todo}}


def _commit_map_unit(unit: int, st: dict, planned: dict, plans: dict, work_dir: Path, row_len: int, dtype: str,
                     with_mask: bool) -> dict:
    """One unit's map files: its rows of each split to do, the surplus dropped, sorted by position; the index
    (N + 1 row offsets, one range per shard) is committed last, as the mark of a complete map file."""
    for name in plans:
        if st["filled"][name] != planned["counts"][name]:
            raise RuntimeError(f"shuffle_map: map group {unit} got {st['filled'][name]} of its "
                               f"{planned['counts'][name]} {name} rows in one task")
    if st["hashes"]:  # before any map file is committed, so that a rerun that skips the unit finds them
        layout.write_json(_hashes_path(work_dir, unit), st["hashes"])
    written = 0
    for name in st["todo"]:
        plan = plans[name]
        rows, position = st["rows"].pop(name), st["position"].pop(name)
        masks = st["masks"].pop(name, None)
        kept = np.flatnonzero(position < plan["kept"])
        order = kept[np.argsort(position[kept], kind="stable")]
        position = position[order]
        bounds = np.searchsorted(position // plan["rows_per_shard"], np.arange(plan["num_shards"] + 1))
        data_path, index_path = _map_paths(work_dir, name, unit)
        # large_list: a map file holds ~map_mib of rows, more ids than 32-bit list offsets address at >= 4 GiB
        schema = pa.schema([("position", pa.int64()), ("input_ids", pa.large_list(arrow_type(dtype))),
                            *([(MASK, pa.large_list(pa.uint8()))] if with_mask else [])])
        chunk = max(1, WRITE_CHUNK_BYTES // (row_len * rows.itemsize))
        tmp = layout.temp_path(data_path)
        with ipc.new_file(tmp, schema) as writer:
            for start in range(0, len(order), chunk):
                taken = order[start:start + chunk]
                writer.write_batch(pa.record_batch(
                    [pa.array(position[start:start + chunk], pa.int64()),
                     rows_to_arrow(rows[taken], dtype, large=True),
                     *([rows_to_arrow(masks[taken], "uint8", large=True)] if with_mask else [])],
                    schema=schema))
        del rows, masks
        layout.commit_file(tmp, data_path)
        written += data_path.stat().st_size
        tmp = layout.temp_path(index_path)
        with open(tmp, "wb") as f:
            np.save(f, bounds.astype(np.int64))
        layout.commit_file(tmp, index_path)  # the index is the commit mark of this map file
    return {"unit": unit, "bytes_written": written, "peak_rss_mib": _peak_rss_mib(), "sha256": st["hashes"]}


def _results_sink(name: str, write: Callable[[list[pa.Table]], list[dict]]):
    """A Ray Data datasink whose write is `write(tables)` over the blocks of its task; the dicts the writes return
    are in `.results` ({unit: result}) once the dataset completes (a failed dataset reports none: what its
    completed tasks committed is read back from their files)."""
    from ray.data.block import BlockAccessor
    from ray.data.datasource import Datasink

    class ResultsSink(Datasink):
        def __init__(self):
            self.results: dict[int, dict] = {}

        def get_name(self) -> str:
            return name

        def write(self, blocks, ctx) -> list[dict]:
            return write(BlockAccessor.for_block(block).to_arrow() for block in blocks)

        def on_write_complete(self, write_result) -> None:
            self.results = {r["unit"]: r for returned in write_result.write_returns for r in returned}

    return ResultsSink()


def _split_index_path(work: Path, split: str) -> Path:
    return work / "map" / split / "index.npy"


def write_split_index(work: Path, split: str, num_maps: int, num_shards: int) -> None:
    """Gather the split's per-map indexes into one (num_shards + 1, num_maps) int64 array, `map/<split>/index.npy`.

    Row s holds where shard s's rows start in every map file, so a reducer reads two rows of it (once) and then
    opens only the map files whose range for it is not empty. Written through a memory map: the driver's heap
    does not grow with num_shards x num_maps."""
    final = _split_index_path(work, split)
    tmp = layout.temp_path(final)
    index = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int64, shape=(num_shards + 1, num_maps))
    for m in range(num_maps):
        index[:, m] = np.load(_map_paths(work, split, m)[1])
    index.flush()
    del index
    layout.commit_file(tmp, final)


def read_reducer_rows(unit: int, reducer: dict, work: str):
    """The read task of one reducer ({"split", "shards": the shards to write, "maps": the map files holding rows
    for them}): the rows bound for its shards, from the two rows of the split's index that bound them, each map
    file memory-mapped and only its range read, one block per record batch of the map file (no copy: views of
    the mapped file)."""
    work_dir = Path(work)
    split, shards = reducer["split"], reducer["shards"]
    index = np.load(_split_index_path(work_dir, split), mmap_mode="r")
    starts, ends = np.array(index[shards[0]]), np.array(index[shards[-1] + 1])
    del index
    for m in np.flatnonzero(ends > starts):
        lo, hi = int(starts[m]), int(ends[m])
        part = ipc.open_file(pa.memory_map(str(_map_paths(work_dir, split, int(m))[0]))).read_all().slice(lo, hi - lo)
        for batch in part.to_batches():
            n = batch.num_rows
            yield pa.Table.from_batches([batch]).append_column(UNIT, pa.array(np.full(n, unit, np.int32)))


def map_file_rows(reducers: list[tuple[int, dict]], work: str):
    """A Ray Data datasource of the map files' rows, one read task per reducer ((unit index, reducer) pairs)."""
    return unit_reads("MapFileRows", reducers, lambda unit: read_reducer_rows(*unit, work),
                      rows=lambda unit: unit[1]["rows"])


def write_reducer_shards(tables, reducers: dict[int, dict], plans: dict, work: str, row_len: int, dtype: str,
                         row_group_size: int, with_mask: bool) -> list[dict]:
    """The write of the shuffle's reduce pass: each reducer's rows (all of them: one reducer's read and write are
    one task), copied once into arrays of their size as the blocks arrive, ordered by position and written as its
    shards `<split>/RRRRR.parquet` (column `input_ids`, list<dtype>, row groups of `row_group_size`), each
    committed on its own. Returns per reducer its peak RSS and the supervised tokens (loss-mask ones after each
    row's first token) of the shards it wrote."""
    work_dir = Path(work)
    state: dict[int, dict] = {}
    for table in tables:
        unit = int(table.column(UNIT)[0].as_py())
        if unit not in state:
            total = reducers[unit]["rows"]
            state[unit] = {"rows": np.empty((total, row_len), numpy_dtype(dtype)),
                           "masks": np.empty((total, row_len), np.uint8) if with_mask else None,
                           "position": np.empty(total, np.int64), "filled": 0}
        st = state[unit]
        for batch in table.to_batches():  # the block's chunks, each a view: no combined copy of the block
            at, n = st["filled"], batch.num_rows
            st["rows"][at:at + n] = fixed_rows(batch.column("input_ids"), row_len, "map block")
            st["position"][at:at + n] = batch.column("position").to_numpy()
            if with_mask:
                st["masks"][at:at + n] = fixed_rows(batch.column(MASK), row_len, "map block")
            st["filled"] += n
    return [_commit_reducer(unit, st, reducers[unit], plans[reducers[unit]["split"]], work_dir, row_len, dtype,
                            row_group_size, with_mask) for unit, st in state.items()]


def _commit_reducer(unit: int, st: dict, reducer: dict, plan: dict, work_dir: Path, row_len: int, dtype: str,
                    row_group_size: int, with_mask: bool) -> dict:
    split, rows, masks = reducer["split"], st["rows"], st["masks"]
    if st["filled"] != reducer["rows"]:
        raise RuntimeError(f"shuffle_reduce: {split} reducer {unit} got {st['filled']} of its {reducer['rows']} rows "
                           "in one task")
    order = np.argsort(st["position"], kind="stable")
    position = st["position"][order]
    rps = plan["rows_per_shard"]
    supervised = {}
    for shard in reducer["shards"]:
        lo, hi = np.searchsorted(position, [shard * rps, (shard + 1) * rps])
        if hi - lo != rps or (hi > lo and (position[lo] != shard * rps or position[hi - 1] != (shard + 1) * rps - 1)):
            raise RuntimeError(f"{split} shard {shard}: {hi - lo} rows, expected {rps}")
        path = shard_path(work_dir / "out", split, shard)
        if path.exists():  # between two shards still to write: committed by an interrupted run
            continue
        tmp = layout.temp_path(path)
        columns = {"input_ids": rows_to_arrow(rows[order[lo:hi]], dtype)}
        if with_mask:
            shard_mask = masks[order[lo:hi]]
            supervised[shard] = int(shard_mask[:, 1:].sum())
            columns[MASK] = rows_to_arrow(shard_mask, "uint8")
        table = pa.table(columns, schema=row_schema(dtype, with_mask))
        pq.write_table(table, tmp, row_group_size=row_group_size, **parquet_options(table))
        layout.commit_file(tmp, path)
    return {"unit": unit, "split": split, "peak_rss_mib": _peak_rss_mib(), "supervised": supervised}


last_run_stats: dict = {}
"""Figures of the latest write_shards in this process, for bench/shuffle_scale.py: its tasks, its seconds, the bytes
and map files of the whole shuffle read back from its committed files (`_committed_figures`: every map group and
reducer counted once, whichever attempt committed it), and the largest peak RSS a task reported (tasks report it
with their results, which a dataset stopped by a killed worker loses: the tasks of its rerun report theirs)."""


def run_shuffle(files: list[dict], row_len: int, shard_root: Path, **settings) -> dict:
    """Shuffle the rows of both splits of `files` ({path, train_rows, val_rows}, in global order) into shards;
    returns the manifest (write_shards with no split made per file)."""
    return write_shards(files, {}, row_len, shard_root, **settings)


def shard_work_id(fingerprint: str, map_mib: int, reducer_mib: int, token_dtype: str) -> str:
    """What the files in `<shard_root>.partial` are valid for: the inputs and shard settings (`fingerprint`) and
    the grouping of the shuffle's tasks (map_mib, reducer_mib change which rows a map file holds, not the shards)."""
    return layout.fingerprint({"fingerprint": fingerprint, "map_mib": map_mib, "reducer_mib": reducer_mib,
                               "token_dtype": token_dtype})


def open_work(shard_root: Path, work_id: str, fingerprint: str) -> tuple[Path, bool]:
    """`<shard_root>.partial` and whether it was kept, with what an interrupted run of the same `work_id` committed
    there (its temp files removed); else it is made anew."""
    work = shard_root.with_name(shard_root.name + ".partial")
    previous = layout.read_marker(work, layout.PLAN)
    if previous is not None and previous.get("id") == work_id:
        for stale in work.glob("*/*/*.tmp"):  # half-written by a crashed attempt: never read, removed
            stale.unlink()
        return work, True
    if work.exists():
        print(f"[shuffle] removing {work}: left by a run with other inputs or settings", flush=True)
        shutil.rmtree(work)
    for name in SPLITS:
        for part in ("map", "out", "records"):
            (work / part / name).mkdir(parents=True)
    layout.write_json(work / layout.PLAN, {"id": work_id, "fingerprint": fingerprint})
    return work, False


def per_file_shards(split: str, method: str, files: list[dict], shard_root: Path, work_id: str, fingerprint: str,
                    **settings) -> list[np.ndarray]:
    """One split's shards from its files one per rank (`_per_file_split`), committed into `<shard_root>.partial`
    ahead of `write_shards` (which keeps them: same `work_id`); returns per file the `lookup` hashes its rows
    have."""
    work, _ = open_work(Path(shard_root), work_id, fingerprint)
    return _per_file_split(split, method, files, work, digests={}, **settings)


def write_shards(shuffle_files: list[dict], per_file: dict[str, tuple[str, list[dict]]], row_len: int,
                 shard_root: Path, *, num_shards: int, seed: int, row_group_size: int, reducer_mib: int,
                 map_mib: int, token_dtype: str, vocab_size: int, fingerprint: str, manifest_extra: dict,
                 hash_inputs: bool = False) -> dict:
    """The N train + N validation shards: each split in `per_file` ({split: (method, files)}, methods from
    `per_file_method`) from its files one per rank, with nothing shuffled again; every other split by the two-pass
    shuffle of the rows `shuffle_files` hold for it. Returns the manifest.

    Skipped when `shard_root` holds a manifest of the same fingerprint. Resumes from `<shard_root>.partial` when a
    run with the same inputs and layout left it: committed map files, shards and per-file shards are kept, only
    the rest is done."""
    shard_root = Path(shard_root)
    existing = layout.current_marker(shard_root, fingerprint, manifest_extra.get("fingerprint_inputs", {}),
                                     "shuffle", MANIFEST)
    work = shard_root.with_name(shard_root.name + ".partial")
    if existing is not None:
        shutil.rmtree(work, ignore_errors=True)
        print(f"[shuffle] complete ({num_shards} + {num_shards} shards), skipped", flush=True)
        return existing
    shuffled = [name for name in SPLITS if name not in per_file]
    plans, groups, with_mask = {}, [], False
    if shuffled:
        # every input comes from one producer (the pack stage, or one released dataset): the first file's columns
        # stand for all of them (the map tasks refuse a file that differs)
        with_mask = MASK in pq.read_schema(shuffle_files[0]["path"]).names
        itemsize = np.dtype(numpy_dtype(token_dtype)).itemsize + with_mask
        row_bytes = row_len * itemsize + 8
        plans = {name: plan_split(sum(f[f"{name}_rows"] for f in shuffle_files), num_shards, row_bytes,
                                  reducer_mib << 20, name) for name in shuffled}
        for name, plan in plans.items():
            if plan["rows_per_shard"] * row_len > MAX_LIST_IDS:  # a shard's input_ids column is one list<> array
                raise ValueError(f"num_shards={num_shards}: a {name} shard would hold {plan['rows_per_shard']} rows "
                                 f"of {row_len} ids, more than the {MAX_LIST_IDS} ids a parquet list column "
                                 "addresses; raise num_shards")
        groups = _group_files(shuffle_files, row_bytes, map_mib << 20)
    work, resumed = open_work(shard_root, shard_work_id(fingerprint, map_mib, reducer_mib, token_dtype), fingerprint)
    if resumed:
        done_maps = sum(1 for _ in (work / "map").glob("*/*.idx.npy"))
        done_shards = sum(1 for _ in (work / "out").glob("*/*.parquet"))
        print(f"[shuffle] resuming {work}: {done_maps}/{2 * len(groups)} map files and "
              f"{done_shards}/{2 * num_shards} shards already written are kept", flush=True)

    last_run_stats.clear()
    digests: dict[str, str] = {}
    supervised: dict[str, int] = {}
    if shuffled:
        supervised = _shuffle_splits(shuffle_files, groups, plans, work, row_len=row_len, seed=seed,
                                     row_group_size=row_group_size, token_dtype=token_dtype, vocab_size=vocab_size,
                                     hash_inputs=hash_inputs, with_mask=with_mask, digests=digests)
    for name, (method, files) in per_file.items():
        _per_file_split(name, method, files, work, row_len=row_len, token_dtype=token_dtype, vocab_size=vocab_size,
                        row_group_size=row_group_size, hash_inputs=hash_inputs, digests=digests)
    for name in SPLITS:
        written = sorted(p.name for p in (work / "out" / name).glob("*.parquet"))
        if written != [f"{r:05d}.parquet" for r in range(num_shards)]:
            raise RuntimeError(f"wrote {len(written)} {name} shards, expected {num_shards}")
        layout.fsync_dir(work / "out" / name)

    if hash_inputs:
        _record_local_hashes(manifest_extra, digests)
    rows = {name: plans[name]["rows_per_shard"] if name in plans else per_file[name][1][0][f"{name}_rows"]
            for name in SPLITS}
    methods = {name: per_file[name][0] if name in per_file else "shuffle" for name in SPLITS}
    manifest = {
        "format": "huginn_ray.shards/2",
        "fingerprint": fingerprint,
        "num_shards": num_shards,
        "seq_len": row_len - 1,
        "row_len": row_len,
        "token_dtype": token_dtype,
        "seed": seed,
        # linked shards keep the released files' own row groups
        **({"row_group_size": row_group_size} if set(methods.values()) != {"hard_link"} else {}),
        "rows_per_shard": rows,
        "tokens_per_shard": {name: rows[name] * row_len for name in SPLITS},
        "total_rows": {name: rows[name] * num_shards for name in SPLITS},
        "dropped_surplus_rows": {name: plans[name]["dropped"] if name in plans else 0 for name in SPLITS},
        "reshard_method": methods,
        **({"source_files": {name: [f["rel"] for f in files] for name, (_, files) in per_file.items()}}
           if per_file else {}),
        **manifest_extra,
    }
    if with_mask:
        manifest[MASK] = {"dtype": "uint8", "supervised_tokens": supervised}
    publish(work, shard_root, manifest)
    for name in SPLITS:
        if name in plans:
            print(f"[shuffle] {name}: {num_shards} shards x {plans[name]['rows_per_shard']} rows "
                  f"({plans[name]['dropped']} surplus rows dropped)", flush=True)
        else:
            done = ("hard-linked as the shards" if methods[name] == "hard_link"
                    else f"converted to {token_dtype} shards one by one")
            print(f"[shuffle] {name}: {num_shards} released files verified and {done} ({rows[name]} rows each), "
                  "not shuffled again", flush=True)
    return manifest


def _shuffle_splits(files: list[dict], groups: list[list[dict]], plans: dict, work: Path, *, row_len: int, seed: int,
                    row_group_size: int, token_dtype: str, vocab_size: int, hash_inputs: bool, with_mask: bool,
                    digests: dict) -> dict[str, int]:
    """The two passes for the splits of `plans`, into `work`/out; returns the supervised tokens per split (chat
    rows) and adds the sha256 of every file read to `digests` (with `hash_inputs`)."""
    started = time.time()
    input_width = pq.read_schema(files[0]["path"]).field("input_ids").type.value_type.bit_width // 8
    units, running = {}, {name: 0 for name in SPLITS}
    for index, group in enumerate(groups):
        entries = [{"path": str(f["path"]), "train_rows": f["train_rows"], "val_rows": f["val_rows"],
                    "skip_rows": f.get("skip_rows", [])} for f in group]
        units[index] = {"files": entries, "offsets": dict(running),
                        "counts": {name: sum(f[f"{name}_rows"] for f in group) for name in SPLITS}}
        for name in SPLITS:
            running[name] += units[index]["counts"][name]

    def map_done(unit: int) -> bool:
        return all(_map_paths(work, name, unit)[1].exists() for name in plans)

    todo = [unit for unit in units if not map_done(unit)]
    for unit in [u for u in todo if not any(units[u]["counts"][name] for name in plans)]:
        # no row to shuffle (all skipped, or only rows of a split that goes per file): empty map files, nothing read
        _commit_map_unit(unit, _map_state(unit, units[unit]["counts"], plans, work, row_len, token_dtype, with_mask),
                         units[unit], plans, work, row_len, token_dtype, with_mask)
        todo.remove(unit)
    map_results: dict[int, dict] = {}

    def map_pass(members: list[int], memory: int | None) -> None:
        chosen = {todo[i]: units[todo[i]] for i in members}
        sink = _results_sink("map_files", functools.partial(
            write_map_units, units=chosen, plans=plans, work=str(work), row_len=row_len, dtype=token_dtype,
            with_mask=with_mask))
        rows = packed_rows(list(chosen.items()), row_len=row_len, dtype=token_dtype, vocab_size=vocab_size,
                           hashed=hash_inputs)
        try:
            write_rows(map_rows(read_dataset(rows, len(chosen), memory), place_rows, memory, plans=plans, seed=seed),
                       sink, memory)
        finally:
            map_results.update(sink.results)

    with block_size(BLOCK_BYTES):
        run_units("shuffle_map", [map_task_memory(units[u]["files"], row_len, token_dtype, input_width, hash_inputs,
                                                  with_mask) for u in todo],
                  map_pass, lambda i: map_done(todo[i]))
    map_s = time.time() - started
    for name, plan in plans.items():
        write_split_index(work, name, len(groups), plan["num_shards"])
    if hash_inputs:
        for unit, planned in units.items():  # recorded next to the map files, by this run or an earlier one
            hashes = json.loads(_hashes_path(work, unit).read_text()) if _hashes_path(work, unit).exists() else {}
            for f in planned["files"]:  # a file that gave no row to shuffle: no map task hashed it
                digests[f["path"]] = hashes.get(f["path"]) or hashlib.sha256(Path(f["path"]).read_bytes()).hexdigest()

    reducers: dict[int, dict] = {}
    for name, plan in plans.items():
        index = np.load(_split_index_path(work, name), mmap_mode="r")
        for r in range(plan["reducers"]):
            first = r * plan["shards_per_reducer"]
            shards = [s for s in range(first, min(plan["num_shards"], first + plan["shards_per_reducer"]))
                      if not shard_path(work / "out", name, s).exists()]
            if shards:
                rows = int((np.array(index[shards[-1] + 1]) - np.array(index[shards[0]])).sum())
                reducers[len(reducers)] = {"split": name, "shards": shards, "rows": rows}
        del index
    todo_reducers = list(reducers)
    reduce_results: dict[int, dict] = {}

    def reduce_pass(members: list[int], memory: int | None) -> None:
        chosen = {todo_reducers[i]: reducers[todo_reducers[i]] for i in members}
        sink = _results_sink("shard_files", functools.partial(
            write_reducer_shards, reducers=chosen, plans=plans, work=str(work), row_len=row_len, dtype=token_dtype,
            row_group_size=row_group_size, with_mask=with_mask))
        try:
            write_rows(read_dataset(map_file_rows(list(chosen.items()), str(work)), len(chosen), memory), sink, memory)
        finally:
            reduce_results.update(sink.results)

    def reducer_done(i: int) -> bool:
        reducer = reducers[todo_reducers[i]]
        return all(shard_path(work / "out", reducer["split"], s).exists() for s in reducer["shards"])

    with block_size(BLOCK_BYTES):
        run_units("shuffle_reduce", [reduce_task_memory(plans[reducers[r]["split"]], row_len, token_dtype, with_mask)
                                     for r in todo_reducers], reduce_pass, reducer_done)
    for stale in work.glob("out/*/*.tmp"):  # left by an attempt whose worker died (its rerun committed the file)
        stale.unlink()
    done = list(map_results.values()) + list(reduce_results.values())
    last_run_stats.update(
        map_tasks=len(groups), reducers=sum(plan["reducers"] for plan in plans.values()), map_s=map_s,
        total_s=time.time() - started, **_committed_figures(work, plans, len(groups), row_len, token_dtype, with_mask),
        max_task_peak_rss_mib=max([r["peak_rss_mib"] for r in done], default=0.0))
    if not with_mask:
        return dict.fromkeys(plans, 0)
    # every shard's supervised tokens: counted by the reducer that wrote it in this run, else read from its file
    counted = {(r["split"], shard): n for r in reduce_results.values() for shard, n in r["supervised"].items()}
    return {name: sum(counted[(name, s)] if (name, s) in counted else
                      shard_supervised_tokens(shard_path(work / "out", name, s), row_len)
                      for s in range(plan["num_shards"]))
            for name, plan in plans.items()}


def _committed_figures(work: Path, plans: dict, num_maps: int, row_len: int, dtype: str, with_mask: bool) -> dict:
    """The shuffle's bytes and map file opens, read back from the files it committed under `work`, so that a map
    group or reducer counts once whichever attempt committed it (a dataset stopped by a killed worker returns no
    result of the tasks it completed): the map files' bytes, the bytes the reducers read (every kept row, at
    the size the reduce write counts it), the shards' bytes, and per reducer the map files holding rows for its
    shards (a non-empty range in the split's index: the files its read opens)."""
    row_bytes = row_len * (np.dtype(numpy_dtype(dtype)).itemsize + with_mask) + 8
    figures = dict.fromkeys(("intermediate_bytes_written", "intermediate_bytes_read", "shard_bytes_written",
                             "map_files_opened"), 0)
    for name, plan in plans.items():
        figures["intermediate_bytes_written"] += sum(_map_paths(work, name, m)[0].stat().st_size
                                                     for m in range(num_maps))
        figures["intermediate_bytes_read"] += plan["kept"] * row_bytes
        figures["shard_bytes_written"] += sum(shard_path(work / "out", name, s).stat().st_size
                                              for s in range(plan["num_shards"]))
        index = np.load(_split_index_path(work, name), mmap_mode="r")
        for r in range(plan["reducers"]):
            first = r * plan["shards_per_reducer"]
            last = min(plan["num_shards"], first + plan["shards_per_reducer"])
            figures["map_files_opened"] += int((np.array(index[last]) > np.array(index[first])).sum())
        del index
    return figures


def _record_path(work: Path, split: str, rank: int) -> Path:
    return work / "records" / split / f"{rank:05d}.json"


def _per_file_split(split: str, method: str, files: list[dict], work: Path, *, row_len: int, token_dtype: str,
                    vocab_size: int, row_group_size: int, hash_inputs: bool, digests: dict,
                    lookup: np.ndarray | None = None) -> list[np.ndarray]:
    """One split's files become its shards one per rank (rank r = the split's r-th file in name order), into
    `work`/out; a file whose shard an interrupted run already committed is not read again.

    One Ray Data pass, one fused task per file: the read of its rows (packed_rows: row length and id range
    checked; a local file hashed), with a `lookup` the map step `look_up_rows`, and the write
    (`write_per_file_units`; operator `ReadPackedRows->Write`, with the lookup `ReadPackedRows->
    MapBatches(look_up_rows)->Write`; `verify_released` or `convert_released` in messages):

    hard_link: every row is read through, then the file is hard-linked as `<split>/RRRRR.parquet`. A hard link,
    not a symlink: the shard is an ordinary file inside the shard directory that stays valid when the download
    directory is removed, and costs no bytes. Where the inputs are on another file system (a local_dir source
    elsewhere; a link cannot cross file systems), the file is copied.

    convert_<dtype>: the rows are written, in the file's order, as the shard in the storage type, in row groups
    of `row_group_size`, as they arrive: a task's memory is bounded by a row group and a few blocks, not by the
    file.

    `lookup` (sorted, unique row hashes, dedup.row_hashes): the same read also finds which of them the file's rows
    have (the validation rows also in train: the released data's one pass over its training files). A file's
    record (`records/<split>/RRRRR.json`: its sha256 with `hash_inputs`, the hashes found) is committed before its
    shard, so a resumed run has both for the files it skips. Returns the hashes found per file (empty arrays
    without a `lookup`) and adds the sha256 of every file to `digests`."""
    todo = [rank for rank in range(len(files)) if not shard_path(work / "out", split, rank).exists()]
    if len(todo) < len(files):
        print(f"[shuffle] {split}: {len(files) - len(todo)}/{len(files)} per-file shards already written are kept",
              flush=True)
    recorded = hash_inputs or lookup is not None
    units = {rank: {"files": [{"path": str(files[rank]["path"]), "train_rows": files[rank]["train_rows"],
                               "val_rows": files[rank]["val_rows"]}],
                    "target": str(shard_path(work / "out", split, rank)),
                    "record": str(_record_path(work, split, rank)) if recorded else None} for rank in todo}
    name = "verify_released" if method == "hard_link" else "convert_released"
    results: dict[int, dict] = {}

    def per_file_pass(members: list[int], memory: int | None) -> None:
        chosen = {todo[i]: units[todo[i]] for i in members}
        sink = _results_sink(name, functools.partial(
            write_per_file_units, units=chosen, link=method == "hard_link", row_len=row_len, dtype=token_dtype,
            row_group_size=row_group_size, looked_up=lookup is not None))
        rows = read_dataset(packed_rows(list(chosen.items()), row_len=row_len, dtype=token_dtype,
                                        vocab_size=vocab_size, hashed=hash_inputs), len(chosen), memory)
        if lookup is not None:
            rows = map_rows(rows, look_up_rows, memory, lookup=lookup, row_len=row_len)
        try:
            write_rows(rows, sink, memory)
        finally:
            results.update(sink.results)

    # a file to link is read as one to convert is (and its blocks kept alike): the same declaration
    estimates = [convert_task_memory(units[rank]["files"][0], row_len, token_dtype, row_group_size, hash_inputs)
                 for rank in todo]
    with block_size(BLOCK_BYTES):
        run_units(name, estimates, per_file_pass, lambda i: shard_path(work / "out", split, todo[i]).exists())
    if results:
        last_run_stats["max_task_peak_rss_mib"] = max(
            [last_run_stats.get("max_task_peak_rss_mib", 0.0)] + [r["peak_rss_mib"] for r in results.values()])
    found = []
    for rank in range(len(files)):
        record = json.loads(_record_path(work, split, rank).read_text()) if recorded else {}
        digests.update(record.get("sha256") or {})
        found.append(np.asarray(record.get("found") or [], np.uint64))
    return found


def look_up_rows(table: pa.Table, lookup: np.ndarray, row_len: int) -> pa.Table:
    """The map step of a per-file pass with a lookup (operator `MapBatches(look_up_rows)`): every row's hash
    (dedup.row_hashes, column `row_hash`) and whether it is one of `lookup` (sorted, unique; `in_lookup`)."""
    from huginn_ray.data.dedup import in_sorted, row_hashes

    rows = fixed_rows(table.column("input_ids"), row_len, "packed block")
    mask = fixed_rows(table.column(MASK), row_len, "packed block") if MASK in table.column_names else None
    hashes = row_hashes(rows, mask)
    return table.append_column("row_hash", pa.array(hashes)).append_column(
        "in_lookup", pa.array(in_sorted(hashes, lookup)))


def write_per_file_units(tables, units: dict[int, dict], link: bool, row_len: int, dtype: str, row_group_size: int,
                         looked_up: bool) -> list[dict]:
    """The write of a per-file pass: for each file (unit: {"files": [entry], "target", "record"}) in `tables`,
    its rows in its order (one file's read and write are one task); its record (sha256, the lookup hashes its
    rows have) committed, then its shard: linked (`link`) or its rows written as list<dtype> in row groups of
    `row_group_size`, as a reducer writes a shard. A file whose rows are not all there is refused before its
    shard is committed."""
    state: dict[int, dict] = {}
    schema = row_schema(dtype)
    for table in tables:
        for unit, part in rows_by_unit(table):
            if unit not in state:
                state[unit] = {"rows": 0, "found": [], "sha256": None, "pending": [], "pending_rows": 0,
                               "tmp": None if link else layout.temp_path(Path(units[unit]["target"]))}
                if not link:
                    state[unit]["writer"] = pq.ParquetWriter(state[unit]["tmp"], schema,
                                                             **parquet_options(schema.empty_table()))
            st = state[unit]
            st["rows"] += part.num_rows
            if SHA256 in part.column_names:
                st["sha256"] = {units[unit]["files"][0]["path"]: part.column(SHA256)[0].as_py()}
            if looked_up:
                found = part.column("in_lookup").to_numpy(zero_copy_only=False)
                st["found"].append(part.column("row_hash").to_numpy()[found])
            if not link:  # whole row groups go out, the rest waits for the next block
                st["pending"].append(fixed_rows(part.column("input_ids"), row_len, "packed block"))
                st["pending_rows"] += part.num_rows
                if st["pending_rows"] >= row_group_size:
                    pending = np.concatenate(st["pending"])
                    whole = len(pending) - len(pending) % row_group_size
                    _write_row_groups(st["writer"], pending[:whole], dtype, row_group_size)
                    st["pending"], st["pending_rows"] = [pending[whole:]], len(pending) - whole
    results = []
    for unit, st in state.items():
        entry, target = units[unit]["files"][0], Path(units[unit]["target"])
        if not link:
            if st["pending_rows"]:
                _write_row_groups(st["writer"], np.concatenate(st["pending"]), dtype, row_group_size)
            st["writer"].close()
        if st["rows"] != entry["train_rows"] + entry["val_rows"]:
            raise RuntimeError(f"{entry['path']}: {st['rows']} of its {entry['train_rows'] + entry['val_rows']} rows "
                               "reached the write of its shard in one task")
        if units[unit]["record"]:
            found = np.unique(np.concatenate(st["found"])) if st["found"] else np.zeros(0, np.uint64)
            layout.write_json(Path(units[unit]["record"]), {
                "sha256": st["sha256"], "found": [int(h) for h in found] if looked_up else None})
        if link:
            _link_or_copy(Path(entry["path"]), target)
        else:
            layout.commit_file(st["tmp"], target)
        results.append({"unit": unit, "rows": st["rows"], "peak_rss_mib": _peak_rss_mib()})
    return results


def _write_row_groups(writer: pq.ParquetWriter, rows: np.ndarray, dtype: str, row_group_size: int) -> None:
    if len(rows):
        writer.write_table(pa.table({"input_ids": rows_to_arrow(rows, dtype)}, schema=row_schema(dtype)),
                           row_group_size=row_group_size)


def shard_supervised_tokens(path: Path, row_len: int) -> int:
    """The training targets of a shard with a loss mask: its ones after each row's first token."""
    return int(_mask_rows(pq.read_table(path, columns=[MASK]).column(MASK), row_len, str(path), 0)[:, 1:].sum())


def _record_local_hashes(manifest_extra: dict, digests: dict[str, str]) -> None:
    """Local packed inputs: the sha256 of every file read goes into the manifest's file list (Hub files carry the
    hash the download verified)."""
    for info in manifest_extra.get("sources", {}).values():
        for f in info.get("files", []):
            root = info.get("local_dir")
            if root and f.get("hash") is None:
                f["hash"] = digests.get(str(Path(root) / f["path"]))


def per_file_method(files: list[dict], split: str, num_shards: int, token_dtype: str) -> tuple[str, str | None]:
    """How one split's already packed files become its shards one file per rank, from their footers:
    ("hard_link", None) when they already are shards, ("convert_<token_dtype>", None) when their ids only need the
    storage type, else ("shuffle", why not per file).

    Per file needs the split to have exactly `num_shards` files, all of one row count, with a column `input_ids`
    of integer lists. They are linked when every file holds that column only, as list<token_dtype> (what the
    training preflight, huginn_ray/train/shard_check.py, asks of a shard); otherwise each file is converted (the
    release stores list<int64>: 4x the uint16 width)."""
    wanted = pa.list_(arrow_type(token_dtype))
    if len(files) != num_shards:
        return "shuffle", f"{len(files)} {split} files for num_shards={num_shards}"
    counts = {f[f"{split}_rows"] for f in files}
    if len(counts) > 1:
        return "shuffle", f"the {split} files hold {min(counts)} to {max(counts)} rows, shards hold one count"
    linkable = True
    for f in files:
        schema = pq.read_schema(f["path"])
        why = token_column_error(schema)
        if why:
            raise TokenRangeError(f"{f['path']}: {why}")
        if MASK in schema.names:  # the per-file paths write input_ids only
            return "shuffle", f"{f['path']} has a {MASK} column"
        linkable = linkable and schema.names == ["input_ids"] and schema.field("input_ids").type == wanted
    return ("hard_link" if linkable else f"convert_{token_dtype}"), None


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError as err:
        if err.errno != errno.EXDEV:
            raise
        tmp = layout.temp_path(target)
        shutil.copyfile(source, tmp)
        layout.commit_file(tmp, target)


CONVERT_READ_FACTOR = 8
CONVERT_READER_BYTES = 96 << 20
"""A conversion task's growth over its worker's footprint, measured (fresh process, ru_maxrss, int64 files of
rows of 4,097 ids, row groups of 32 to 2,048 rows): about CONVERT_READER_BYTES (parquet reader and writer state,
allocator) plus up to CONVERT_READ_FACTOR x the decoded bytes of one read batch (compressed and decompressed
pages, repetition and definition levels, the decoded ids and their storage-type copy): 96 MiB at 32-row groups,
150 MiB at 256, 285 MiB at 1,024."""


def convert_task_memory(entry: dict, row_len: int, dtype: str, row_group_size: int, hashed: bool) -> int:
    """The memory a conversion task uses, declared as `memory=`: reading one batch (at most a row group,
    `_read_input`) at the file's id width (CONVERT_READ_FACTOR, CONVERT_READER_BYTES), the whole file's bytes when
    it is hashed (held while parsed), one output row group plus one batch twice (the rows and their Arrow copy),
    Ray Data's blocks in flight (RAY_DATA_BLOCKS), the blocks its write keeps until the task ends (the file's rows
    in the storage type: HELD_COLUMN_BYTES), and the worker's own footprint."""
    meta = pq.read_metadata(entry["path"])
    width = np.dtype(numpy_dtype(dtype)).itemsize
    input_width = max(4, meta.schema.to_arrow_schema().field("input_ids").type.value_type.bit_width // 8)
    batch = min([READ_BATCH_ROWS] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    return (batch * row_len * input_width * CONVERT_READ_FACTOR + CONVERT_READER_BYTES
            + (os.path.getsize(entry["path"]) if hashed else 0)
            + 2 * (row_group_size + batch) * row_len * width + RAY_DATA_BLOCKS
            + meta.num_rows * (row_len * width + HELD_COLUMN_BYTES) + _TASK_OVERHEAD)


_REQUIRED = {
    "num_shards": int, "seq_len": int, "seed": int, "rows_per_shard": dict, "tokens_per_shard": dict,
    "tokenizer_sha256": str, "vocab_size": int, "input_fingerprint": str, "dropped_surplus_rows": dict,
}


def read_manifest(shard_dir: str | Path) -> dict:
    """Load and validate `<shard_dir>/manifest.json`; errors name the file and the offending key."""
    path = Path(shard_dir) / MANIFEST
    if not path.is_file():
        raise ValueError(f"shard manifest not found: {path} (run jobs/prepare_data.py first)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path}: expected a JSON object")
    for key, kind in _REQUIRED.items():
        if key not in manifest:
            raise ValueError(f"{path}: missing key {key!r}")
        if not isinstance(manifest[key], kind) or isinstance(manifest[key], bool):
            raise ValueError(f"{path}: key {key!r} should be {kind.__name__}, got {manifest[key]!r}")
    for key in ("rows_per_shard", "tokens_per_shard", "dropped_surplus_rows"):
        for split in SPLITS:
            value = manifest[key].get(split)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{path}: {key}.{split} should be a non-negative integer, got {value!r}")
    dtype = manifest.setdefault("token_dtype", "int32")  # manifests before 16-bit storage held int32 rows
    if dtype not in DTYPES:
        raise ValueError(f"{path}: token_dtype should be one of {', '.join(DTYPES)}, got {dtype!r}")
    if manifest["num_shards"] <= 0 or manifest["seq_len"] <= 0:
        raise ValueError(f"{path}: num_shards and seq_len must be positive")
    for split in SPLITS:
        if manifest["tokens_per_shard"][split] != manifest["rows_per_shard"][split] * (manifest["seq_len"] + 1):
            raise ValueError(f"{path}: tokens_per_shard.{split} != rows_per_shard.{split} * (seq_len + 1)")
    return manifest


def publish(work: Path, shard_root: Path, manifest: dict) -> None:
    """The shards written under `work`/out, with their manifest, become a new immutable version
    `<shard_root>.vNNNN`, and the pointer `shard_root` moves to it (layout.publish_version); the work directory
    goes. A training run that resolved the pointer before (shard_version) keeps reading its own version."""
    layout.write_json(work / "out" / MANIFEST, manifest)
    version = layout.publish_version(work / "out", shard_root)
    shutil.rmtree(work)
    older = len(layout.versions(shard_root)) - 1
    print(f"[shuffle] published {version}; {shard_root} points to it"
          + (f"; {older} older versions kept (`jobs/prepare_data.py --gc-shards` removes them once no training run "
             "reads them)" if older else ""), flush=True)


def shard_version(shard_dir: str | Path) -> Path:
    """The version directory `shard_dir` names now: the pointer `<output_dir>/shards` resolved to
    `<output_dir>/shards.vNNNN` (a directory that is not a pointer: itself). A training run resolves it once and
    reads that version to its end, whatever is published meanwhile."""
    return Path(os.path.realpath(shard_dir))


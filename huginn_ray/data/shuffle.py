"""The global shuffle: the packed rows of a split -> exactly N shards of it, one per training rank.

Contract. Packed rows have a deterministic global order per split (input files in the given order, rows in file
order). For a split with T rows, rows_per_shard = T // N and the first N * rows_per_shard positions of a seeded
pseudo-random permutation of [0, T) are kept (the surplus T mod N rows are dropped and reported). The row at
global index g goes to position p = perm(g): shard p // rows_per_shard, slot p % rows_per_shard. The permutation
is a keyed Feistel network with cycle walking, so every row is placed exactly once, with no table of T entries.
Train and validation rows are shuffled separately and never mixed.

Execution: a two-pass external shuffle through files, so that no intermediate data lives in Ray's object store
and nothing the driver or a task holds grows with N (huginn_ray/data/README.md has the cost model). Each pass is one
Ray Data dataset of one task per unit that reads, works on and commits its unit's rows itself, the rows never
leaving the worker (execution.run_unit_tasks):

1. map (operator `ReadShuffleMap`, `map_unit`, one task per group of ~`shuffle.map_mib` of input files): the
   group's rows are read by row groups (row length and id range checked), each with its split and index in the
   split; `place_rows` computes every row's position in the permutation; `write_map_units` drops the surplus,
   sorts the rows by position (hence by destination shard) and commits one Arrow IPC file per split,
   `map/<split>/MMMMMM.arrow` (columns `position`, `input_ids`, and `loss_mask` for chat rows), plus
   `MMMMMM.idx.npy`: N + 1 row offsets, row range [idx[s], idx[s+1]) of the file holds the rows bound for shard s.
2. reduce (operator `ReadShuffleReduce`, `reduce_unit`): the driver gathers a split's per-map indexes into one
   `map/<split>/index.npy` ((N + 1) x M); one task per range of consecutive shards holding ~`shuffle.reducer_mib`
   of rows reads the two rows of it that bound its shards, memory-maps only the map files holding rows for it and
   reads only its row ranges; `write_reducer_shards` merges them by position and commits its shards
   `<split>/RRRRR.parquet` (column `input_ids`, list<uint16|int32>, row groups of `shuffle.row_group_size`).

Chat rows (huginn_ray/data/tokenize_pack.py) carry a `loss_mask` column, list<uint8>, one entry per id: it is read,
sorted, written and merged with its row's ids in every step, so a shard's `loss_mask` row r belongs to its
`input_ids` row r, and the manifest records `loss_mask` with the shards' supervised tokens per split. Inputs without
the column give shards without it, byte for byte as before; a shuffle's inputs all have it or none does.

Ray Data shows each pass's progress in tasks (off under `prepare_data.py --quiet`). Map tasks and reducers
declare `memory=` to Ray from their data size and the input's id width (map_task_memory, reduce_task_memory), so
Ray does not start more of them on a node than its memory holds; a task whose worker was killed reruns with twice
its memory (execution.run_units). Every file is written under a temporary name and renamed when complete, in
`<shard_dir>.partial/` with the plan's fingerprint (huginn_ray/data/shard_build.py): a rerun after a crash keeps
the committed map files and shards and reads and redoes only the rest.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.execution import block_size, run_unit_tasks, run_units
from huginn_ray.data.packed_rows import (BLOCK_BYTES, FILE, INDEX, RAY_DATA_BLOCKS, SHA256, SPLIT, TASK_OVERHEAD,
                                         UNIT, peak_rss_mib, read_unit_rows, rows_by_unit, unit_files)
from huginn_ray.data.permutation import FeistelPermutation
from huginn_ray.data.shards import SPLITS, shard_path, shard_supervised_tokens
from huginn_ray.data.tokens import MASK, arrow_type, fixed_rows, numpy_dtype, parquet_options, row_schema, rows_to_arrow


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


def group_files(files: list[dict], row_bytes: int, group_bytes: int) -> list[list[dict]]:
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


def _map_paths(work: Path, split: str, index: int) -> tuple[Path, Path]:
    return work / "map" / split / f"{index:06d}.arrow", work / "map" / split / f"{index:06d}.idx.npy"


def _hashes_path(work: Path, index: int) -> Path:
    """The sha256 of map group `index`'s input files (hashed inputs), committed before its map files."""
    return work / "map" / f"{index:06d}.sha256.json"


WRITE_CHUNK_BYTES = 32 << 20
"""Rows are gathered into sorted order and written this many bytes at a time (map files and shards), so a task
never holds a second full copy of its rows."""


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
    gathered rows and their Arrow copy), the blocks in flight (RAY_DATA_BLOCKS) and the worker's own footprint. A
    loss mask adds one byte per id."""
    width = np.dtype(numpy_dtype(dtype)).itemsize + mask
    rows = sum(f["train_rows"] + f["val_rows"] for f in group)
    largest = max((f["train_rows"] + f["val_rows"] for f in group), default=0) * row_len * max(4, input_width)
    return (rows * (row_len * width + 24) + largest * (READ_FACTOR + hashed)
            + 2 * WRITE_CHUNK_BYTES + RAY_DATA_BLOCKS + TASK_OVERHEAD)


def reduce_task_memory(plan: dict, row_len: int, dtype: str, mask: bool = False) -> int:
    """The memory a reducer uses, declared as `memory=`: its rows once in the storage type plus the same again for
    the memory-mapped map-file ranges it copies from (resident while read), 24 bytes per row of positions and
    order, one shard's rows and one write chunk, Ray Data's blocks in flight (RAY_DATA_BLOCKS) and the worker's
    own footprint. A loss mask adds a byte per id."""
    width = np.dtype(numpy_dtype(dtype)).itemsize + mask
    rows = plan["shards_per_reducer"] * plan["rows_per_shard"]
    return (rows * (2 * row_len * width + 24) + plan["rows_per_shard"] * row_len * width + 2 * WRITE_CHUNK_BYTES
            + RAY_DATA_BLOCKS + TASK_OVERHEAD)


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


def map_unit(unit: tuple[int, dict], plans: dict, seed: int, work: str, row_len: int, dtype: str, vocab_size: int,
             hashed: bool, with_mask: bool) -> dict:
    """One task of the shuffle's map pass: the rows of map group `unit` ((index, {"files", "counts"})) read,
    placed and committed as its map files; returns what it committed."""
    index, planned = unit
    placed = (place_rows(table, plans, seed) for table in read_unit_rows(index, planned, row_len, dtype, vocab_size,
                                                                         hashed))
    [committed] = write_map_units(placed, {index: planned}, plans, work, row_len, dtype, with_mask)
    return committed


def write_map_units(tables, units: dict[int, dict], plans: dict, work: str, row_len: int, dtype: str,
                    with_mask: bool) -> list[dict]:
    """The write of the shuffle's map pass: the placed rows of the units in `tables` (all rows of each)
    sorted by position, hence by destination shard, into one map file (+ index) per split not yet committed.
    `units`: {unit: {"files": entries, "counts": {split: rows}}}.

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
    return {"unit": unit, "bytes_written": written, "peak_rss_mib": peak_rss_mib(), "sha256": st["hashes"]}


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


def reduce_unit(unit: tuple[int, dict], plans: dict, work: str, row_len: int, dtype: str, row_group_size: int,
                with_mask: bool) -> dict:
    """One task of the shuffle's reduce pass: reducer `unit`'s ((index, reducer)) rows read from the map files and
    committed as its shards; returns what it committed."""
    index, reducer = unit
    [committed] = write_reducer_shards(read_reducer_rows(index, reducer, work), {index: reducer}, plans, work,
                                       row_len, dtype, row_group_size, with_mask)
    return committed


def write_reducer_shards(tables, reducers: dict[int, dict], plans: dict, work: str, row_len: int, dtype: str,
                         row_group_size: int, with_mask: bool) -> list[dict]:
    """The write of the shuffle's reduce pass: each reducer's rows (all of them), copied once into arrays of
    their size as the blocks arrive, ordered by position and written as its shards `<split>/RRRRR.parquet`
    (column `input_ids`, list<dtype>, row groups of `row_group_size`), each committed on its own. Returns per
    reducer its peak RSS and the supervised tokens (loss-mask ones after each row's first token) of the shards it
    wrote."""
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
    return {"unit": unit, "split": split, "peak_rss_mib": peak_rss_mib(), "supervised": supervised}


def shuffle_splits(files: list[dict], groups: list[list[dict]], plans: dict, work: Path, *, row_len: int, seed: int,
                   row_group_size: int, token_dtype: str, vocab_size: int, hash_inputs: bool, with_mask: bool,
                   digests: dict) -> tuple[dict[str, int], dict]:
    """The two passes for the splits of `plans`, into `work`/out; returns the supervised tokens per split (chat
    rows) and the run's figures (shard_build.last_run_stats), and adds the sha256 of every file read to `digests`
    (with `hash_inputs`)."""
    started = time.time()
    input_width = pq.read_schema(files[0]["path"]).field("input_ids").type.value_type.bit_width // 8
    units = _map_units(groups)
    map_results = _map_pass(units, plans, work, row_len=row_len, seed=seed, token_dtype=token_dtype,
                            vocab_size=vocab_size, hash_inputs=hash_inputs, with_mask=with_mask,
                            input_width=input_width)
    map_s = time.time() - started
    for name, plan in plans.items():
        write_split_index(work, name, len(groups), plan["num_shards"])
    if hash_inputs:
        for unit, planned in units.items():  # recorded next to the map files, by this run or an earlier one
            hashes = json.loads(_hashes_path(work, unit).read_text()) if _hashes_path(work, unit).exists() else {}
            for f in planned["files"]:  # a file that gave no row to shuffle: no map task hashed it
                digests[f["path"]] = hashes.get(f["path"]) or hashlib.sha256(Path(f["path"]).read_bytes()).hexdigest()
    reduce_results = _reduce_pass(plans, work, row_len=row_len, token_dtype=token_dtype,
                                  row_group_size=row_group_size, with_mask=with_mask)
    for stale in work.glob("out/*/*.tmp"):  # left by an attempt whose worker died (its rerun committed the file)
        stale.unlink()
    done = list(map_results.values()) + list(reduce_results.values())
    figures = dict(
        map_tasks=len(groups), reducers=sum(plan["reducers"] for plan in plans.values()), map_s=map_s,
        total_s=time.time() - started, **_committed_figures(work, plans, len(groups), row_len, token_dtype, with_mask),
        max_task_peak_rss_mib=max([r["peak_rss_mib"] for r in done], default=0.0))
    if not with_mask:
        return dict.fromkeys(plans, 0), figures
    # every shard's supervised tokens: counted by the reducer that wrote it in this run, else read from its file
    counted = {(r["split"], shard): n for r in reduce_results.values() for shard, n in r["supervised"].items()}
    return {name: sum(counted[(name, s)] if (name, s) in counted else
                      shard_supervised_tokens(shard_path(work / "out", name, s), row_len)
                      for s in range(plan["num_shards"]))
            for name, plan in plans.items()}, figures


def _map_units(groups: list[list[dict]]) -> dict[int, dict]:
    """The map pass's units, one per map group: {"files": entries, "offsets": {split: the group's first index in
    the split}, "counts": {split: its rows}}."""
    units, running = {}, {name: 0 for name in SPLITS}
    for index, group in enumerate(groups):
        entries = [{"path": str(f["path"]), "train_rows": f["train_rows"], "val_rows": f["val_rows"],
                    "skip_rows": f.get("skip_rows", [])} for f in group]
        units[index] = {"files": entries, "offsets": dict(running),
                        "counts": {name: sum(f[f"{name}_rows"] for f in group) for name in SPLITS}}
        for name in SPLITS:
            running[name] += units[index]["counts"][name]
    return units


def _map_pass(units: dict[int, dict], plans: dict, work: Path, *, row_len: int, seed: int, token_dtype: str,
              vocab_size: int, hash_inputs: bool, with_mask: bool, input_width: int) -> dict[int, dict]:
    """The map files of every unit not yet committed (operator `ReadShuffleMap`); returns the results its tasks
    reported."""

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
        done = run_unit_tasks("ShuffleMap", [(todo[i], units[todo[i]]) for i in members], functools.partial(
            map_unit, plans=plans, seed=seed, work=str(work), row_len=row_len, dtype=token_dtype,
            vocab_size=vocab_size, hashed=hash_inputs, with_mask=with_mask), memory, files=unit_files)
        map_results.update((result["unit"], result) for result in done)

    with block_size(BLOCK_BYTES):
        run_units("shuffle_map", [map_task_memory(units[u]["files"], row_len, token_dtype, input_width, hash_inputs,
                                                  with_mask) for u in todo],
                  map_pass, lambda i: map_done(todo[i]))
    return map_results


def _reduce_pass(plans: dict, work: Path, *, row_len: int, token_dtype: str, row_group_size: int,
                 with_mask: bool) -> dict[int, dict]:
    """The shards of every reducer with a shard still to write (operator `ReadShuffleReduce`); returns the results
    its tasks reported."""
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
        chosen = [(todo_reducers[i], reducers[todo_reducers[i]]) for i in members]
        done = run_unit_tasks("ShuffleReduce", chosen, functools.partial(
            reduce_unit, plans=plans, work=str(work), row_len=row_len, dtype=token_dtype,
            row_group_size=row_group_size, with_mask=with_mask), memory)
        reduce_results.update((result["unit"], result) for result in done)

    def reducer_done(i: int) -> bool:
        reducer = reducers[todo_reducers[i]]
        return all(shard_path(work / "out", reducer["split"], s).exists() for s in reducer["shards"])

    with block_size(BLOCK_BYTES):
        run_units("shuffle_reduce", [reduce_task_memory(plans[reducers[r]["split"]], row_len, token_dtype, with_mask)
                                     for r in todo_reducers], reduce_pass, reducer_done)
    return reduce_results


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

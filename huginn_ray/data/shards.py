"""The global shuffle: packed rows -> exactly N train + N validation shards, one per training rank.

Contract. Packed rows have a deterministic global order per split (input files in the given order, rows in file
order). For a split with T rows, rows_per_shard = T // N and the first N * rows_per_shard positions of a seeded
pseudo-random permutation of [0, T) are kept (the surplus T mod N rows are dropped and reported). The row at
global index g goes to position p = perm(g): shard p // rows_per_shard, slot p % rows_per_shard. The permutation
is a keyed Feistel network with cycle walking, so every row is placed exactly once, with no table of T entries.
Train and validation rows are shuffled separately and never mixed.

Execution: a two-pass external shuffle through files, so that no intermediate data lives in Ray's object store
and nothing the driver or a task holds grows with N (huginn_ray/data/README.md has the cost model):

1. map (Ray Data operator `shuffle_map`): one task per group of ~`shuffle.map_mib` of input files computes every
   row's position, drops the surplus, sorts its rows by position (hence by destination shard) and writes one Arrow
   IPC file per split, `map/<split>/MMMMMM.arrow` (columns `position`, `input_ids`, and `loss_mask` for chat
   rows), plus `MMMMMM.idx.npy`: N + 1
   row offsets, row range [idx[s], idx[s+1]) of the file holds the rows bound for shard s.
2. reduce (Ray Data operator `shuffle_reduce`): the driver gathers a split's per-map indexes into one
   `map/<split>/index.npy` ((N + 1) x M); one task per range of consecutive shards holding ~`shuffle.reducer_mib`
   of rows reads the two rows of it that bound its shards, memory-maps only the map files holding rows for it,
   reads only its row ranges, merges by position and writes its shards `<split>/RRRRR.parquet` (column
   `input_ids`, list<uint16|int32>, row groups of `shuffle.row_group_size`).

Chat rows (huginn_ray/data/tokenize_pack.py) carry a `loss_mask` column, list<uint8>, one entry per id: it is read,
sorted, written and merged with its row's ids in every step, so a shard's `loss_mask` row r belongs to its
`input_ids` row r, and the manifest records `loss_mask` with the shards' supervised tokens per split. Inputs without
the column give shards without it, byte for byte as before; a shuffle's inputs all have it or none does.

Both passes run on Ray Data's streaming executor (huginn_ray/data/execution.py: progress bars, retries of tasks
whose worker died). Tasks return only a few integers; map tasks and reducers declare `memory=` to Ray from their
data size and the input's id width (map_task_memory, reduce_task_memory), so Ray does not start more of them on a
node than its memory holds. Every file is written under a temporary name and
renamed when complete, in `<shard_dir>.partial/` with the plan's fingerprint: a rerun after a crash keeps the
committed map files and shards and redoes only the rest.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import resource
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.execution import run_tasks
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
    gathered rows and their Arrow copy), and the worker's own footprint. A loss mask adds one byte per id."""
    width = np.dtype(numpy_dtype(dtype)).itemsize + mask
    rows = sum(f["train_rows"] + f["val_rows"] for f in group)
    largest = max((f["train_rows"] + f["val_rows"] for f in group), default=0) * row_len * max(4, input_width)
    return (rows * (row_len * width + 24) + largest * (READ_FACTOR + hashed) + 2 * WRITE_CHUNK_BYTES
            + _TASK_OVERHEAD)


def reduce_task_memory(plan: dict, row_len: int, dtype: str, mask: bool = False) -> int:
    """The memory a reducer uses, declared as `memory=`: its rows once in the storage type plus the same again for
    the memory-mapped map-file ranges it copies from (resident while read), 24 bytes per row of positions and
    order, one shard's rows and one write chunk, and the worker's own footprint. A loss mask adds a byte per id."""
    width = np.dtype(numpy_dtype(dtype)).itemsize + mask
    rows = plan["shards_per_reducer"] * plan["rows_per_shard"]
    return (rows * (2 * row_len * width + 24) + plan["rows_per_shard"] * row_len * width + 2 * WRITE_CHUNK_BYTES
            + _TASK_OVERHEAD)


def _map_group(index: int, files: list[dict], offsets: dict, plans: dict, seed: int, row_len: int, dtype: str,
               vocab_size: int, work: str, hash_inputs: bool = False, with_mask: bool = False) -> dict:
    """Ray task: sort one group's rows by destination position and write one map file (+ index) per split.
    `with_mask`: every input file has a loss_mask column (else none may have one)."""
    work_dir = Path(work)
    todo = [name for name in plans if not _map_paths(work_dir, name, index)[1].exists()]
    written = 0
    hashes: dict | None = {} if hash_inputs else None
    if todo:
        # every input file is read, converted and copied into one array per split, then dropped
        counts = {name: sum(f[f"{name}_rows"] for f in files) for name in SPLITS}
        rows = {name: np.empty((counts[name], row_len), numpy_dtype(dtype)) for name in todo}
        masks = {name: np.empty((counts[name], row_len), np.uint8) for name in todo} if with_mask else {}
        filled = dict.fromkeys(SPLITS, 0)
        for entry in files:
            for name, part, part_mask in _read_input(entry, row_len, dtype, vocab_size, hashes):
                if (part_mask is not None) != with_mask:
                    raise ValueError(f"{entry['path']}: {'no' if with_mask else 'a'} {MASK} column, the other "
                                     f"inputs of this shuffle have {'one' if with_mask else 'none'}")
                if name in rows:
                    rows[name][filled[name]:filled[name] + len(part)] = part
                    if with_mask:
                        masks[name][filled[name]:filled[name] + len(part)] = part_mask
                filled[name] += len(part)
        if hash_inputs:  # before any map file is committed, so a resumed task finds them
            layout.write_json(work_dir / "map" / f"{index:06d}.sha256.json", hashes)
        for name in todo:
            plan = plans[name]
            permutation = FeistelPermutation(plan["rows"], seed, f"shuffle:{name}")
            position = permutation(offsets[name] + np.arange(counts[name]))
            kept = np.flatnonzero(position < plan["kept"])
            order = kept[np.argsort(position[kept], kind="stable")]
            position = position[order]
            bounds = np.searchsorted(position // plan["rows_per_shard"], np.arange(plan["num_shards"] + 1))
            data_path, index_path = _map_paths(work_dir, name, index)
            # large_list: a map file holds ~map_mib of rows, more ids than 32-bit list offsets address at >= 4 GiB
            schema = pa.schema([("position", pa.int64()), ("input_ids", pa.large_list(arrow_type(dtype))),
                                *([(MASK, pa.large_list(pa.uint8()))] if with_mask else [])])
            chunk = max(1, WRITE_CHUNK_BYTES // (row_len * rows[name].itemsize))
            tmp = layout.temp_path(data_path)
            with ipc.new_file(tmp, schema) as writer:
                for start in range(0, len(order), chunk):
                    taken = order[start:start + chunk]
                    writer.write_batch(pa.record_batch(
                        [pa.array(position[start:start + chunk], pa.int64()),
                         rows_to_arrow(rows[name][taken], dtype, large=True),
                         *([rows_to_arrow(masks[name][taken], "uint8", large=True)] if with_mask else [])],
                        schema=schema))
            del rows[name]
            masks.pop(name, None)
            layout.commit_file(tmp, data_path)
            written += data_path.stat().st_size
            tmp = layout.temp_path(index_path)
            with open(tmp, "wb") as f:
                np.save(f, bounds.astype(np.int64))
            layout.commit_file(tmp, index_path)  # the index is the commit mark of this map file
    if hash_inputs and not todo:  # resumed: the hashes were recorded next to the committed map files
        hashes = json.loads((work_dir / "map" / f"{index:06d}.sha256.json").read_text())
    return {"bytes_written": written, "skipped": not todo, "peak_rss_mib": _peak_rss_mib(), "sha256": hashes}


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


def _reduce(split: str, reducer: int, plan: dict, work: str, row_len: int, dtype: str, row_group_size: int,
            with_mask: bool = False) -> dict:
    """Ray task: read this reducer's row range from the map files that hold rows for it, order by position, write.
    Returns, with the sizes, the supervised tokens (loss-mask ones after each row's first token) it wrote."""
    work_dir = Path(work)
    first = reducer * plan["shards_per_reducer"]
    mine = range(first, min(plan["num_shards"], first + plan["shards_per_reducer"]))
    shards = [s for s in mine if not shard_path(work_dir / "out", split, s).exists()]
    read = written = opened = 0
    # shards an interrupted run already wrote are counted from their files
    supervised = sum(shard_supervised_tokens(shard_path(work_dir / "out", split, s), row_len)
                     for s in mine if s not in shards) if with_mask else 0
    if shards:
        lo_shard, hi_shard = shards[0], shards[-1] + 1
        index = np.load(_split_index_path(work_dir, split), mmap_mode="r")
        starts, ends = np.array(index[lo_shard]), np.array(index[hi_shard])
        del index
        holding = np.flatnonzero(ends > starts)
        total = int((ends[holding] - starts[holding]).sum())
        rows = np.empty((total, row_len), numpy_dtype(dtype))  # this reducer's rows, copied in once
        masks = np.empty((total, row_len), np.uint8) if with_mask else None
        position = np.empty(total, np.int64)
        filled = 0
        for m in holding:
            lo, hi = int(starts[m]), int(ends[m])
            data_path = _map_paths(work_dir, split, int(m))[0]
            opened += 1
            with pa.memory_map(str(data_path)) as source:
                part = ipc.open_file(source).read_all().slice(lo, hi - lo)
                position[filled:filled + hi - lo] = part.column("position").to_numpy()
                if with_mask:  # the same record batches as input_ids: row-aligned
                    at = filled
                    for chunk in part.column(MASK).chunks:
                        block = fixed_rows(chunk, row_len, str(data_path))
                        masks[at:at + len(block)] = block
                        at += len(block)
                for chunk in part.column("input_ids").chunks:  # record batches of the map file: no combined copy
                    block = fixed_rows(chunk, row_len, str(data_path))
                    rows[filled:filled + len(block)] = block
                    filled += len(block)
                del part, block
        read = total * (row_len * (rows.itemsize + with_mask) + 8)
        order = np.argsort(position, kind="stable")
        position = position[order]
        rps = plan["rows_per_shard"]
        for shard in shards:
            lo, hi = np.searchsorted(position, [shard * rps, (shard + 1) * rps])
            if hi - lo != rps or (hi > lo and (position[lo] != shard * rps or position[hi - 1] != (shard + 1) * rps - 1)):
                raise RuntimeError(f"{split} shard {shard}: {hi - lo} rows, expected {rps}")
            path = shard_path(work_dir / "out", split, shard)
            tmp = layout.temp_path(path)
            columns = {"input_ids": rows_to_arrow(rows[order[lo:hi]], dtype)}
            if with_mask:
                shard_mask = masks[order[lo:hi]]
                supervised += int(shard_mask[:, 1:].sum())
                columns[MASK] = rows_to_arrow(shard_mask, "uint8")
            table = pa.table(columns, schema=row_schema(dtype, with_mask))
            pq.write_table(table, tmp, row_group_size=row_group_size, **parquet_options(table))
            layout.commit_file(tmp, path)
            written += path.stat().st_size
    return {"bytes_read": read, "bytes_written": written, "shards": len(shards), "map_files_opened": opened,
            "peak_rss_mib": _peak_rss_mib(), "supervised_tokens": supervised}


last_run_stats: dict = {}
"""Figures of the latest write_shards in this process (tasks, bytes, task peak RSS), for bench/shuffle_scale.py."""


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
    calls, memory, running = [], [], {name: 0 for name in SPLITS}
    for index, group in enumerate(groups):
        entries = [{"path": str(f["path"]), "train_rows": f["train_rows"], "val_rows": f["val_rows"],
                    "skip_rows": f.get("skip_rows", [])} for f in group]
        calls.append((index, entries, dict(running), plans, seed, row_len, token_dtype, vocab_size, str(work),
                      hash_inputs, with_mask))
        memory.append(map_task_memory(entries, row_len, token_dtype, input_width, hash_inputs, with_mask))
        for f in group:
            for name in SPLITS:
                running[name] += f[f"{name}_rows"]
    map_results = run_tasks(_map_group, calls, name="shuffle_map", memory=memory)
    map_s = time.time() - started
    for name, plan in plans.items():
        write_split_index(work, name, len(groups), plan["num_shards"])

    calls, memory = [], []
    for name, plan in plans.items():
        for r in range(plan["reducers"]):
            calls.append((name, r, plan, str(work), row_len, token_dtype, row_group_size, with_mask))
            memory.append(reduce_task_memory(plan, row_len, token_dtype, with_mask))
    reduce_results = run_tasks(_reduce, calls, name="shuffle_reduce", memory=memory)
    for stale in work.glob("out/*/*.tmp"):  # left by an attempt whose worker died (its retry committed the file)
        stale.unlink()
    last_run_stats.update(
        map_tasks=len(groups), reducers=len(calls), map_s=map_s, total_s=time.time() - started,
        intermediate_bytes_written=sum(r["bytes_written"] for r in map_results),
        intermediate_bytes_read=sum(r["bytes_read"] for r in reduce_results),
        shard_bytes_written=sum(r["bytes_written"] for r in reduce_results),
        map_files_opened=sum(r["map_files_opened"] for r in reduce_results),
        max_task_peak_rss_mib=max(r["peak_rss_mib"] for r in map_results + reduce_results))
    for r in map_results:
        digests.update(r["sha256"] or {})
    return {name: sum(r["supervised_tokens"] for c, r in zip(calls, reduce_results) if c[0] == name)
            for name in plans}


def _record_path(work: Path, split: str, rank: int) -> Path:
    return work / "records" / split / f"{rank:05d}.json"


def _per_file_split(split: str, method: str, files: list[dict], work: Path, *, row_len: int, token_dtype: str,
                    vocab_size: int, row_group_size: int, hash_inputs: bool, digests: dict,
                    lookup: np.ndarray | None = None) -> list[np.ndarray]:
    """One split's files become its shards one per rank (rank r = the split's r-th file in name order), into
    `work`/out; a file whose shard an interrupted run already committed is not read again.

    hard_link: every file is verified (each row read: row length, id range; local files hashed), then hard-linked
    as `<split>/RRRRR.parquet`, each as soon as it is verified. A hard link, not a symlink: the shard is an ordinary
    file inside the shard directory that stays valid when the download directory is removed, and costs no bytes.
    Where the inputs are on another file system (a local_dir source elsewhere; a link cannot cross file systems),
    the file is copied.

    convert_<dtype>: one task per file reads it (the same checks) and writes its rows, in order, as the shard in
    the storage type (`_convert_file`), streaming: a task's memory is bounded by a row group, not by the file.

    `lookup` (sorted, unique row hashes, dedup.row_hashes): the same read also finds which of them the file's rows
    have (the validation rows also in train: the released data's one pass over its training files). A file's
    record (`records/<split>/RRRRR.json`: its sha256 with `hash_inputs`, the hashes found) is committed before its
    shard, so a resumed run has both for the files it skips. Returns the hashes found per file (empty arrays
    without a `lookup`) and adds the sha256 of every file to `digests`."""
    todo = [(rank, {"path": str(f["path"]), "train_rows": f["train_rows"], "val_rows": f["val_rows"]})
            for rank, f in enumerate(files) if not shard_path(work / "out", split, rank).exists()]
    if len(todo) < len(files):
        print(f"[shuffle] {split}: {len(files) - len(todo)}/{len(files)} per-file shards already written are kept",
              flush=True)
    recorded = hash_inputs or lookup is not None
    records = [str(_record_path(work, split, rank)) if recorded else None for rank, _ in todo]
    common = {"hash_input": hash_inputs, "lookup": lookup}
    if method == "hard_link":
        def link(i: int, result: dict) -> None:  # as each file is verified: a crash keeps the links made
            rank, entry = todo[i]
            _link_or_copy(Path(entry["path"]), shard_path(work / "out", split, rank))

        calls = [(entry, row_len, token_dtype, vocab_size, record) for (_, entry), record in zip(todo, records)]
        run_tasks(_verify_file, calls, name="verify_released", on_result=link, common=common)
    else:
        calls = [(entry, str(shard_path(work / "out", split, rank)), row_len, token_dtype, vocab_size,
                  row_group_size, record) for (rank, entry), record in zip(todo, records)]
        results = run_tasks(_convert_file, calls, name="convert_released", common=common, memory=[
            convert_task_memory(c[0], row_len, token_dtype, row_group_size, hash_inputs) for c in calls])
        if results:
            last_run_stats["max_task_peak_rss_mib"] = max(
                [last_run_stats.get("max_task_peak_rss_mib", 0.0)] + [r["peak_rss_mib"] for r in results])
    found = []
    for rank in range(len(files)):
        record = json.loads(_record_path(work, split, rank).read_text()) if recorded else {}
        digests.update(record.get("sha256") or {})
        found.append(np.asarray(record.get("found") or [], np.uint64))
    return found


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


class _RowReader:
    """A task's reading of one packed file: its rows (row length and id range checked, as the shuffle's map tasks
    do), its sha256 when `hash_input` (read once: hashed and parsed), and which of the `lookup` hashes its rows have
    (dedup.row_hashes, looked up by binary search). `commit(record_path)` writes what it found there."""

    def __init__(self, entry: dict, row_len: int, dtype: str, vocab_size: int, hash_input: bool,
                 lookup: np.ndarray | None):
        self.hashes: dict | None = {} if hash_input else None
        self.parts = _read_input(entry, row_len, dtype, vocab_size, self.hashes)
        self.lookup, self.found = lookup, []

    def __iter__(self):
        from huginn_ray.data.dedup import in_sorted, row_hashes

        for _, part, mask in self.parts:
            if self.lookup is not None and len(part):
                hashes = row_hashes(part, mask)
                self.found.append(hashes[in_sorted(hashes, self.lookup)])
            yield part

    def commit(self, record_path: str | None) -> None:
        if record_path:
            found = np.unique(np.concatenate(self.found)) if self.found else np.zeros(0, np.uint64)
            layout.write_json(Path(record_path), {"sha256": self.hashes,
                                                  "found": [int(h) for h in found] if self.lookup is not None else None})


def _verify_file(entry: dict, row_len: int, dtype: str, vocab_size: int, record_path: str | None,
                 hash_input: bool = False, lookup: np.ndarray | None = None) -> dict:
    """Task: read every row of a file to be linked as a shard (`_RowReader`) and commit its record."""
    reader = _RowReader(entry, row_len, dtype, vocab_size, hash_input, lookup)
    rows = sum(len(part) for part in reader)
    reader.commit(record_path)
    return {"rows": rows}


def _convert_file(entry: dict, target: str, row_len: int, dtype: str, vocab_size: int, row_group_size: int,
                  record_path: str | None, hash_input: bool = False, lookup: np.ndarray | None = None) -> dict:
    """Task: one packed file -> its rank's shard at `target`: every row read (`_RowReader`), in file order,
    READ_BATCH_ROWS at a time, and written as list<dtype> in row groups of `row_group_size`, as a reducer writes a
    shard. Holds one batch and one row group, not the file. The file's record is committed before the shard."""
    reader = _RowReader(entry, row_len, dtype, vocab_size, hash_input, lookup)
    schema = row_schema(dtype)

    def write(block: np.ndarray) -> None:
        writer.write_table(pa.table({"input_ids": rows_to_arrow(block, dtype)}, schema=schema),
                           row_group_size=row_group_size)

    tmp = layout.temp_path(Path(target))
    pending, rows = np.empty((0, row_len), numpy_dtype(dtype)), 0
    with pq.ParquetWriter(tmp, schema, **parquet_options(schema.empty_table())) as writer:
        for part in reader:
            pending, rows = np.concatenate([pending, part]), rows + len(part)
            whole = len(pending) - len(pending) % row_group_size  # whole row groups go out, the rest waits
            if whole:
                write(pending[:whole])
                pending = pending[whole:]
        if len(pending):
            write(pending)
    reader.commit(record_path)
    layout.commit_file(tmp, Path(target))
    return {"rows": rows, "peak_rss_mib": _peak_rss_mib()}


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
    and the worker's own footprint. It does not grow with the file."""
    meta = pq.read_metadata(entry["path"])
    width = np.dtype(numpy_dtype(dtype)).itemsize
    input_width = max(4, meta.schema.to_arrow_schema().field("input_ids").type.value_type.bit_width // 8)
    batch = min([READ_BATCH_ROWS] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    return (batch * row_len * input_width * CONVERT_READ_FACTOR + CONVERT_READER_BYTES
            + (os.path.getsize(entry["path"]) if hashed else 0)
            + 2 * (row_group_size + batch) * row_len * width + _TASK_OVERHEAD)


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


"""Already packed data (the released huginn-dataset's layout) made into shards one file per rank, nothing shuffled.

A split whose files are exactly `num_shards` files of one row count, with a column `input_ids` of integer lists
(`per_file_method`), becomes the shards one by one: rank r = the split's r-th file by name. Each file is one unit
of one Ray Data pass (`per_file_split`), its read, lookup and write one task (`per_file_unit`, operator
`Read<verify|convert>_released`, execution.run_unit_tasks): the file is read through (row length and id range
checked, huginn_ray/data/packed_rows.py), then hard-linked as its shard when it already is one (`hard_link`), else
written as the shard in the storage type (`convert_<dtype>`, `write_per_file_units`). Each file's record (its sha256, the lookup's hashes found) is committed before its shard,
so a resumed run reads neither again. The shard stage (huginn_ray/data/shard_build.py) runs it for the splits that
go per file and shuffles the others (huginn_ray/data/shuffle.py).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.dedup import in_sorted, row_hashes
from huginn_ray.data.execution import block_size, run_unit_tasks, run_units
from huginn_ray.data.packed_rows import (BLOCK_BYTES, RAY_DATA_BLOCKS, READ_BATCH_ROWS, SHA256, TASK_OVERHEAD,
                                         peak_rss_mib, read_unit_rows, rows_by_unit, unit_files)
from huginn_ray.data.shards import shard_path
from huginn_ray.data.tokens import (MASK, TokenRangeError, arrow_type, fixed_rows, numpy_dtype, parquet_options,
                                    row_schema, rows_to_arrow, token_column_error)


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
    `read_packed_file`) at the file's id width (CONVERT_READ_FACTOR, CONVERT_READER_BYTES), the whole file's bytes when
    it is hashed (held while parsed), one output row group plus one batch twice (the rows and their Arrow copy),
    the blocks in flight (RAY_DATA_BLOCKS) and the worker's own footprint: nothing that grows with the file but
    its hashed bytes."""
    meta = pq.read_metadata(entry["path"])
    width = np.dtype(numpy_dtype(dtype)).itemsize
    input_width = max(4, meta.schema.to_arrow_schema().field("input_ids").type.value_type.bit_width // 8)
    batch = min([READ_BATCH_ROWS] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    return (batch * row_len * input_width * CONVERT_READ_FACTOR + CONVERT_READER_BYTES
            + (os.path.getsize(entry["path"]) if hashed else 0)
            + 2 * (row_group_size + batch) * row_len * width + RAY_DATA_BLOCKS + TASK_OVERHEAD)


def _record_path(work: Path, split: str, rank: int) -> Path:
    return work / "records" / split / f"{rank:05d}.json"


def per_file_split(split: str, method: str, files: list[dict], work: Path, *, row_len: int, token_dtype: str,
                   vocab_size: int, row_group_size: int, hash_inputs: bool, digests: dict,
                   lookup: np.ndarray | None = None) -> tuple[list[np.ndarray], float | None]:
    """One split's files become its shards one per rank (rank r = the split's r-th file in name order), into
    `work`/out; a file whose shard an interrupted run already committed is not read again.

    One Ray Data pass, one task per file (`per_file_unit`; `verify_released` or `convert_released` in messages):
    the read of its rows (packed_rows: row length and id range checked; a local file hashed), with a `lookup`
    `look_up_rows` on each block, and the write (`write_per_file_units`):

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
    without a `lookup`) and the largest peak RSS its tasks reported (None when no task ran), and adds the sha256
    of every file to `digests`."""
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
        done = run_unit_tasks(name, [(todo[i], units[todo[i]]) for i in members], functools.partial(
            per_file_unit, link=method == "hard_link", row_len=row_len, dtype=token_dtype, vocab_size=vocab_size,
            hashed=hash_inputs, row_group_size=row_group_size, lookup=lookup), memory, files=unit_files)
        results.update((result["unit"], result) for result in done)

    # a file to link is read as one to convert is (and its blocks kept alike): the same declaration
    estimates = [convert_task_memory(units[rank]["files"][0], row_len, token_dtype, row_group_size, hash_inputs)
                 for rank in todo]
    with block_size(BLOCK_BYTES):
        run_units(name, estimates, per_file_pass, lambda i: shard_path(work / "out", split, todo[i]).exists())
    found = []
    for rank in range(len(files)):
        record = json.loads(_record_path(work, split, rank).read_text()) if recorded else {}
        digests.update(record.get("sha256") or {})
        found.append(np.asarray(record.get("found") or [], np.uint64))
    return found, max((r["peak_rss_mib"] for r in results.values()), default=None)


def look_up_rows(table: pa.Table, lookup: np.ndarray, row_len: int) -> pa.Table:
    """The map step of a per-file pass with a lookup (operator `MapBatches(look_up_rows)`): every row's hash
    (dedup.row_hashes, column `row_hash`) and whether it is one of `lookup` (sorted, unique; `in_lookup`)."""
    rows = fixed_rows(table.column("input_ids"), row_len, "packed block")
    mask = fixed_rows(table.column(MASK), row_len, "packed block") if MASK in table.column_names else None
    hashes = row_hashes(rows, mask)
    return table.append_column("row_hash", pa.array(hashes)).append_column(
        "in_lookup", pa.array(in_sorted(hashes, lookup)))


def per_file_unit(unit: tuple[int, dict], link: bool, row_len: int, dtype: str, vocab_size: int, hashed: bool,
                  row_group_size: int, lookup: np.ndarray | None) -> dict:
    """One task of a per-file pass: file `unit` ((rank, {"files": [entry], "target", "record"})) read, looked up
    and committed as its shard; returns what it committed."""
    index, planned = unit
    tables = read_unit_rows(index, planned, row_len, dtype, vocab_size, hashed)
    if lookup is not None:
        tables = (look_up_rows(table, lookup, row_len) for table in tables)
    [committed] = write_per_file_units(tables, {index: planned}, link, row_len, dtype, row_group_size,
                                       lookup is not None)
    return committed


def write_per_file_units(tables, units: dict[int, dict], link: bool, row_len: int, dtype: str, row_group_size: int,
                         looked_up: bool) -> list[dict]:
    """The write of a per-file pass: for each file (unit: {"files": [entry], "target", "record"}) in `tables`,
    its rows in its order; its record (sha256, the lookup hashes its
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
        results.append({"unit": unit, "rows": st["rows"], "peak_rss_mib": peak_rss_mib()})
    return results


def _write_row_groups(writer: pq.ParquetWriter, rows: np.ndarray, dtype: str, row_group_size: int) -> None:
    if len(rows):
        writer.write_table(pa.table({"input_ids": rows_to_arrow(rows, dtype)}, schema=row_schema(dtype)),
                           row_group_size=row_group_size)

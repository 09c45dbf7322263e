"""The preflight's check of every train and val shard, from the parquet footers only (never the data pages).

A run of W workers reads 2W shard files (`<data_dir>/{train,val}/{rank:05d}.parquet`). Each one is opened and
its footer read, in a thread pool (the reads wait on the filesystem; the threads overlap the waits), and held
to the manifest:

- the file exists and its footer parses (a file cut short has no footer);
- `num_rows` == the manifest's `rows_per_shard[split]`;
- column `input_ids` is a list of the manifest's `token_dtype` (uint16 or int32, huginn_ray/data/tokens.py);
- every row group holds rows x row_length ids: its leaf column chunk's `num_values` (one entry per id, plus
  one per empty or null list) equals rows x row_length, and the chunk's statistics count no nulls (an empty or
  null row, a null id). Rows of compensating lengths (one longer, one shorter by as much, in the same row group)
  pass this; the reader refuses them when it reads that row group (shard_reader.read_row_group);
- where the chunk statistics carry min/max, every id lies in [0, vocab_size) of the manifest (which must not
  exceed the model's: checked first, without opening a file);
- chat shards (the manifest records `loss_mask`, huginn_ray/data/shards.py): column `loss_mask` is list<uint8> and
  holds, row group by row group, as many entries as `input_ids` (one per id) with no nulls and, where statistics
  say, values 0 and 1 only; a shard with a loss mask the manifest does not record is refused.

Cost: 2W x (one open and a read of the footer: 0.6 KiB for a shard of two row groups, 80 KiB for a Frontier train
shard of 745) with `threads` in flight, plus about 2 µs of Python per row group, which holds the GIL
(BENCHMARKS.md: 8,192 Frontier-sized shards in 18 s on 2 busy cores). The first bad file in (train, val) x rank
order is reported, however the threads finish.

A data directory in a bucket (`s3://...`) is checked the same way, each footer by ranged GETs through a seekable
reader (huginn_ray.storage.open_input_file: the object's size, then its last bytes), never the whole object; a
missing or truncated object is refused naming it, as a local file is.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from huginn_ray import storage
from huginn_ray.data.shards import MANIFEST, SPLITS, shard_path
from huginn_ray.data.tokens import MASK
from huginn_ray.data.tokens import arrow_type

COLUMN = "input_ids"
DEFAULT_THREADS = 32  # footer reads mostly wait on the filesystem; this many in flight overlap the waits


class ShardCheckError(ValueError):
    """A shard that does not hold what the manifest says; the message names the file, expected and found."""


@dataclass
class ShardCheckSummary:
    files: int
    """Shard files checked (train + val)."""
    seconds: float
    """Wall time of the check."""
    threads: int
    """Footer reads in flight at a time."""
    row_groups_without_statistics: int
    """Row groups whose id column carries no min/max, so their id range could not be checked."""


def check_shards(data_dir: str | Path, manifest: dict, model_vocab_size: int,
                 threads: int = DEFAULT_THREADS) -> ShardCheckSummary:
    """Check the footers of all 2 x num_shards shards against `manifest` (see the module docstring)."""
    started = time.perf_counter()
    vocab_size = manifest["vocab_size"]
    if vocab_size > model_vocab_size:
        raise ShardCheckError(
            f"{storage.join(str(data_dir), MANIFEST)}: the shards were made with a vocabulary of {vocab_size} ids "
            f"(vocab_size), the model has vocab_size={model_vocab_size}"
        )
    expected = {
        "row_length": manifest["seq_len"] + 1,
        "value_type": arrow_type(manifest["token_dtype"]),
        "vocab_size": vocab_size,
        "loss_mask": MASK in manifest,
    }
    files = [(split, rank) for split in SPLITS for rank in range(manifest["num_shards"])]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = [pool.submit(check_shard, shard_path(data_dir, split, rank), rank,
                               manifest["rows_per_shard"][split], **expected) for split, rank in files]
        try:
            unchecked = sum(future.result() for future in futures)  # in file order: the first bad file raises
        except ShardCheckError:
            for future in futures:
                future.cancel()
            raise
    return ShardCheckSummary(len(files), time.perf_counter() - started, threads, unchecked)


def read_footer(path: str | Path, rank: int) -> pq.FileMetaData:
    """The footer of a local shard file or a shard object (ranged reads); ShardCheckError naming it when it is
    missing or its footer does not parse."""
    in_bucket = storage.is_uri(str(path))
    if not in_bucket and not Path(path).is_file():
        raise ShardCheckError(f"missing shard of rank {rank}: {path}")
    try:
        if not in_bucket:
            return pq.read_metadata(path)
        with storage.open_input_file(str(path)) as file:
            return pq.read_metadata(file)
    except FileNotFoundError:
        raise ShardCheckError(f"missing shard of rank {rank}: {path}") from None
    except (OSError, pa.ArrowException) as err:
        raise ShardCheckError(f"{path}: not a readable parquet file (truncated or corrupt?): {err}") from None


def check_shard(path: str | Path, rank: int, num_rows: int, row_length: int, value_type: pa.DataType,
                vocab_size: int, loss_mask: bool = False) -> int:
    """Check one shard's footer (a local file or an object); returns how many of its row groups carry no id
    statistics."""
    metadata = read_footer(path, rank)
    if metadata.num_rows != num_rows:
        raise ShardCheckError(f"{path}: {metadata.num_rows} rows, the manifest says {num_rows} (rows_per_shard)")
    schema = metadata.schema.to_arrow_schema()
    if COLUMN not in schema.names:
        raise ShardCheckError(f"{path}: no column {COLUMN!r} (columns: {', '.join(schema.names)})")
    found_type = schema.field(COLUMN).type
    if not pa.types.is_list(found_type) or found_type.value_type != value_type:
        raise ShardCheckError(f"{path}: column {COLUMN!r} is {found_type}, the manifest's token_dtype "
                              f"needs list<{value_type}>")
    if (MASK in schema.names) != loss_mask:
        raise ShardCheckError(f"{path}: {'no' if loss_mask else 'a'} column {MASK!r}, the manifest records "
                              f"{'a' if loss_mask else 'no'} loss mask")
    if loss_mask and schema.field(MASK).type != pa.list_(pa.uint8()):
        raise ShardCheckError(f"{path}: column {MASK!r} is {schema.field(MASK).type}, expected "
                              "list<uint8>")
    # the columns' leaves (a list of ids, a list of mask entries) among the file's leaf columns
    leaves = {metadata.schema.column(i).path.split(".")[0]: i for i in range(metadata.num_columns)}
    leaf = leaves[COLUMN]
    for index in range(metadata.num_row_groups) if loss_mask else ():
        row_group = metadata.row_group(index)
        chunk = row_group.column(leaves[MASK])
        stats = chunk.statistics
        if chunk.num_values != row_group.num_rows * row_length or (stats is not None and stats.null_count):
            raise ShardCheckError(f"{path}: row group {index} holds {chunk.num_values} loss-mask entries "
                                  f"({stats.null_count if stats is not None else 0} null) in {row_group.num_rows} "
                                  f"rows, expected one per id: {row_group.num_rows * row_length}")
        if stats is not None and stats.has_min_max and stats.max > 1:
            raise ShardCheckError(f"{path}: row group {index} holds loss-mask value {stats.max}, expected 0 or 1")
    unchecked = 0
    for index in range(metadata.num_row_groups):
        row_group = metadata.row_group(index)
        chunk = row_group.column(leaf)
        stats = chunk.statistics
        if stats is not None and stats.null_count:
            raise ShardCheckError(f"{path}: row group {index} holds {stats.null_count} empty or null rows or ids, "
                                  f"expected {row_group.num_rows} rows of {row_length} ids (seq_len + 1)")
        if chunk.num_values != row_group.num_rows * row_length:
            raise ShardCheckError(
                f"{path}: row group {index} holds {chunk.num_values} ids in {row_group.num_rows} rows, expected "
                f"{row_group.num_rows} x {row_length} (seq_len + 1) = {row_group.num_rows * row_length}"
            )
        if stats is None or not stats.has_min_max:
            unchecked += 1
        elif stats.min < 0 or stats.max >= vocab_size:
            bad = stats.min if stats.min < 0 else stats.max
            raise ShardCheckError(f"{path}: row group {index} holds token id {bad} (statistics: min {stats.min}, "
                                  f"max {stats.max}), outside the manifest's vocabulary [0, {vocab_size})")
    return unchecked

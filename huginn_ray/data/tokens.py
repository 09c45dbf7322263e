"""Storage type of token ids: uint16 when every id of the vocabulary fits in 16 bits, int32 otherwise.

With a 65,536-entry vocabulary (the Huginn tokenizer) every id is < 2^16, so packed rows and shards hold
2 bytes per token instead of 4. The choice is recorded in the pack marker and the shard manifest
(`token_dtype`); readers (huginn_ray/train/shard_reader.py) accept both and widen to int32 / int64.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

DTYPES = {"uint16": (np.uint16, pa.uint16()), "int32": (np.int32, pa.int32())}
MASK = "loss_mask"
"""The optional column of chat rows, list<uint8>: 1 where the token is a training target (huginn_ray/data/chat.py)."""
_ARRAY_TYPES = {**DTYPES, "uint8": (np.uint8, pa.uint8())}  # token ids, and a loss mask's 0/1 entries


class TokenRangeError(ValueError):
    """A token id outside [0, vocab_size) or outside the storage type; the message names where it came from."""


# How token columns are written to parquet (packed files and shards): no dictionary (a dictionary of up to 65,536
# ids per row group costs more than it saves), BYTE_STREAM_SPLIT + zstd level 1 (parquet stores 16-bit ids in
# 32-bit slots; splitting the bytes lets zstd drop the empty high bytes). Measured on 2,048 rows of 4,097 ids,
# 64-row groups: 0.82x the uint16 bytes on Zipf-distributed ids (snappy + dictionary, pyarrow's default: 1.14x),
# and a 1.5-5x faster write.
PARQUET_OPTIONS = {"use_dictionary": ["split"], "compression": "zstd", "compression_level": 1,
                   "column_encoding": {"input_ids": "BYTE_STREAM_SPLIT"}}


def parquet_options(table: pa.Table) -> dict:
    """PARQUET_OPTIONS for a table (dictionary only for the columns it has besides input_ids)."""
    return {**PARQUET_OPTIONS, "use_dictionary": [c for c in table.column_names if c != "input_ids"]}


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "int32"


def numpy_dtype(name: str) -> type:
    return _ARRAY_TYPES[name][0]


def arrow_type(name: str) -> pa.DataType:
    return _ARRAY_TYPES[name][1]


def row_schema(name: str, loss_mask: bool = False) -> pa.Schema:
    """A shard's columns: `input_ids`, and for chat rows `loss_mask` (list<uint8>, 1 where a token is a target)."""
    return pa.schema([("input_ids", pa.list_(arrow_type(name))),
                      *([(MASK, pa.list_(pa.uint8()))] if loss_mask else [])])


def check_ids(ids: np.ndarray, vocab_size: int, dtype: str, where: str) -> None:
    """Refuse ids that do not fit [0, vocab_size) or the storage type, naming `where` and the first bad id."""
    if ids.size == 0:
        return
    limit = min(vocab_size, int(np.iinfo(numpy_dtype(dtype)).max) + 1)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise TokenRangeError(f"{where}: token id {bad} does not fit the vocabulary of {vocab_size} ids "
                              f"stored as {dtype} (valid ids: 0..{limit - 1})")


MAX_LIST_IDS = 2**31 - 1  # a list<> array's 32-bit offsets address at most this many ids


def rows_to_arrow(rows: np.ndarray, dtype: str, large: bool = False) -> pa.ListArray | pa.LargeListArray:
    """(n, width) array -> list<dtype> array without a Python loop (ids must already be checked).

    `large`: large_list<dtype> (64-bit offsets), for arrays that may hold more than MAX_LIST_IDS ids."""
    n, width = rows.shape
    if not large and n * width > MAX_LIST_IDS:
        raise ValueError(f"{n} rows of {width} ids do not fit one list array ({MAX_LIST_IDS} ids at most)")
    offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int64 if large else np.int32))
    values = pa.array(rows.reshape(-1).astype(numpy_dtype(dtype), copy=False), arrow_type(dtype))
    return (pa.LargeListArray if large else pa.ListArray).from_arrays(offsets, values)


def fixed_rows(column: pa.ChunkedArray | pa.Array, row_len: int, where: str, first_row: int = 0) -> np.ndarray:
    """A list column of ids -> (rows, row_len) numpy array in the column's value type; refuses other lengths.

    `first_row`: the column's first row number in its file, for the error message."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if len(column) == 0:
        return np.zeros((0, row_len), column.type.value_type.to_pandas_dtype())
    offsets = column.offsets.to_numpy()
    lengths = np.diff(offsets)
    if (lengths != row_len).any():
        bad = int(np.flatnonzero(lengths != row_len)[0])
        raise TokenRangeError(f"{where}: row {first_row + bad} has {int(lengths[bad])} ids, expected {row_len} "
                              "(seq_len + 1)")
    values = column.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    return values.to_numpy(zero_copy_only=False).reshape(-1, row_len)


def token_column_error(schema: pa.Schema) -> str | None:
    """Why a file's `input_ids` column cannot be read as token ids (None when it can): it must be a list of
    integers. Floats would be truncated to ids without a word, strings cannot be ids."""
    ids = schema.field("input_ids").type if "input_ids" in schema.names else None
    if ids is None:
        return f"no column input_ids (columns: {', '.join(schema.names)})"
    if not (pa.types.is_list(ids) or pa.types.is_large_list(ids)) or not pa.types.is_integer(ids.value_type):
        return f"column input_ids must hold lists of integer token ids, got {ids}"
    return None


def mask_rows(column, row_len: int, where: str, first_row: int) -> np.ndarray:
    """A loss_mask list column -> (rows, row_len) uint8 of 0/1; refuses other lengths and values."""
    mask = fixed_rows(column, row_len, f"{where}: column {MASK}", first_row=first_row).astype(np.uint8, copy=False)
    if mask.size and mask.max() > 1:
        raise ValueError(f"{where}: column {MASK} holds {int(mask.max())}, a loss mask holds 0 or 1")
    return mask

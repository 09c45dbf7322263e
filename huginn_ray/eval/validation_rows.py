"""The validation shards' rows that evaluation reads, keyed as training's validation keys them.

Depth scaling (huginn_ray.eval.batch_inference.depth_losses) reads the first `max_rows` rows of every validation
shard on the driver; a row's key (shard x 2^32 + row) seeds its initial latent state, so a row's loss does not
depend on the replica that serves it. bench/generate.py takes its prompts from the same rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq


def read_val_rows(path: str | Path, max_rows: int | None) -> np.ndarray:
    """(rows, seq_len + 1) token ids of the first `max_rows` rows of a shard."""
    column = pq.read_table(path, columns=["input_ids"]).column("input_ids").combine_chunks()
    offsets = column.offsets.to_numpy()
    rows = len(offsets) - 1 if max_rows is None else min(max_rows, len(offsets) - 1)
    length = int(offsets[1] - offsets[0])
    values = column.values.to_numpy(zero_copy_only=False)
    return values[: rows * length].astype(np.int64).reshape(rows, length)


def read_validation_rows(shards: list[str], max_rows: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(keys, rows): the first `max_rows` rows of every validation shard, keyed shard x 2^32 + row."""
    keys, rows = [], []
    for index, shard in enumerate(shards):
        shard_rows = read_val_rows(shard, max_rows)
        keys.append((index << 32) + np.arange(len(shard_rows), dtype=np.int64))
        rows.append(shard_rows)
    return np.concatenate(keys), np.concatenate(rows)

"""Validation rows of released data that also occur in its training rows (`drop_val_duplicates`).

The released tomg-group-umd/huginn-dataset split its validation files off after whole files had been duplicated
for up-weighting, so a validation row can be byte-identical to a training row. Before the shuffle, two passes of
tasks (one per file, Ray Data operators `dedup_hash_val` and `dedup_match_train`: huginn_ray/data/execution.py)
find them:

1. every validation file: a 64-bit hash (blake2b) of each row in the storage type;
2. every training file: which of those hashes its rows have (the validation hashes go to the tasks once, with
   the operator's function, through the object store: 8 bytes per validation row).

The result is, per validation file, the row numbers that also occur in train. They are counted (manifest and
console) and, with `drop_val_duplicates: true` (the default), left out of the validation shards: the shuffle's map
tasks skip those rows, so they never reach a shard. Cost: one more read of every packed file (≈ D) and 8 bytes
per validation row in the driver and in each training-file task.
"""

from __future__ import annotations

import hashlib

import numpy as np

from huginn_ray.data.execution import run_tasks
from huginn_ray.data.shards import _read_input


def row_hashes(rows: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """A 64-bit blake2b hash of every row (its bytes in the storage type, then its loss mask's when it has one:
    the same ids trained on other tokens are another row)."""
    rows = np.ascontiguousarray(rows)
    masks = [b""] * len(rows) if mask is None else [m.tobytes() for m in np.ascontiguousarray(mask)]
    digests = b"".join(hashlib.blake2b(row.tobytes() + m, digest_size=8).digest() for row, m in zip(rows, masks))
    return np.frombuffer(digests, "<u8").copy()


def _val_file_hashes(entry: dict, row_len: int, dtype: str, vocab_size: int) -> np.ndarray:
    """Ray task: the hashes of a validation file's rows, in file order."""
    parts = [row_hashes(rows, mask) for _, rows, mask in _read_input(entry, row_len, dtype, vocab_size, None)
             if len(rows)]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint64)


def _train_file_matches(entry: dict, row_len: int, dtype: str, vocab_size: int, val_hashes: np.ndarray) -> np.ndarray:
    """Ray task: the validation hashes (sorted, unique) that rows of this training file have."""
    found = [h[np.isin(h, val_hashes)] for h in (row_hashes(rows, mask) for _, rows, mask in
                                               _read_input(entry, row_len, dtype, vocab_size, None) if len(rows))]
    return np.unique(np.concatenate(found)) if found else np.zeros(0, np.uint64)


def find_val_duplicates(train: list[dict], val: list[dict], row_len: int, dtype: str,
                        vocab_size: int) -> dict[str, list[int]]:
    """Per validation file path, the row numbers (in the file) whose bytes also occur in a training row."""
    per_file = run_tasks(_val_file_hashes, [(e, row_len, dtype, vocab_size) for e in val], name="dedup_hash_val")
    all_val = np.unique(np.concatenate(per_file)) if per_file else np.zeros(0, np.uint64)
    found = run_tasks(_train_file_matches, [(e, row_len, dtype, vocab_size) for e in train],
                      name="dedup_match_train", common={"val_hashes": all_val})
    in_train = np.unique(np.concatenate(found)) if found else np.zeros(0, np.uint64)
    return {e["path"]: np.flatnonzero(np.isin(h, in_train)).tolist() for e, h in zip(val, per_file)}

"""Validation rows of released data that also occur in its training rows (`drop_val_duplicates`).

The released tomg-group-umd/huginn-dataset split its validation files off after whole files had been duplicated
for up-weighting, so a validation row can be byte-identical to a training row. They are found by a 64-bit hash
(blake2b) of each row in the storage type:

1. every validation file: its rows' hashes (the pass `dedup_hash_val`, Ray Data operator
   `ReadPackedRows->MapBatches(hash_rows)`: the rows read by row groups and hashed in one task per file, only
   their index and hash, 16 bytes per row, sent to the driver), saved as `<output_dir>/dedup/<input fingerprint>.npz`, so a rerun does not
   read the validation files again;
2. every training file: which of those hashes its rows have, by a binary search (`in_sorted`, `np.searchsorted`)
   of its row hashes in the validation hashes, sorted and unique (they go to the tasks with the map step: 8 bytes
   per validation row). `np.isin` over the same arrays sorts both sides on every call: 1.39 s per batch against
   0.3 ms for the search (issue 29). When the training split becomes the shards one file per rank, the tasks
   that convert or verify its files do this lookup in the same read (per_file.look_up_rows: one pass over the
   training data, and each file's result is committed with its shard, so a resumed run keeps it); otherwise the
   operator `dedup_match_train` (the same read and `hash_rows`, keeping only the rows found) reads every training
   file once more, before the shuffle, and the result is saved as `<output_dir>/dedup/<input fingerprint>.json`.

The result is, per validation file, the row numbers that also occur in train. They are counted (manifest and
console) and, with `drop_val_duplicates: true` (the default), left out of the validation shards: the shuffle's map
tasks skip those rows, so they never reach a shard.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from huginn_ray.data import layout
from huginn_ray.data.execution import block_size, run_units
from huginn_ray.data.packed_rows import BLOCK_BYTES, INDEX, UNIT, map_rows, packed_rows, read_dataset, rows_by_unit
from huginn_ray.data.tokens import MASK, fixed_rows


def row_hashes(rows: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """A 64-bit blake2b hash of every row (its bytes in the storage type, then its loss mask's when it has one:
    the same ids trained on other tokens are another row)."""
    rows = np.ascontiguousarray(rows)
    masks = [b""] * len(rows) if mask is None else [m.tobytes() for m in np.ascontiguousarray(mask)]
    digests = b"".join(hashlib.blake2b(row.tobytes() + m, digest_size=8).digest() for row, m in zip(rows, masks))
    return np.frombuffer(digests, "<u8").copy()


def in_sorted(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """For every entry of `values`, whether it is in `sorted_set` (ascending): a binary search each, O(n log m),
    with no sort of `values` and no copy of the set."""
    if not len(sorted_set):
        return np.zeros(len(values), bool)
    at = np.minimum(np.searchsorted(sorted_set, values), len(sorted_set) - 1)
    return sorted_set[at] == values


def hash_rows(table: pa.Table, row_len: int, lookup: np.ndarray | None = None) -> pa.Table:
    """The map step of the dedup passes: every row's unit, index and hash (`row_hash`), the ids dropped, so that
    only 16 bytes per row travel to the driver; with `lookup` (sorted, unique hashes), only the rows whose hash
    is one of them (operator `MapBatches(hash_rows)`)."""
    rows = fixed_rows(table.column("input_ids"), row_len, "packed block")
    mask = fixed_rows(table.column(MASK), row_len, "packed block") if MASK in table.column_names else None
    hashes = row_hashes(rows, mask)
    keep = np.ones(len(hashes), bool) if lookup is None else in_sorted(hashes, lookup)
    return pa.table({UNIT: table.column(UNIT).filter(pa.array(keep)), INDEX: table.column(INDEX).filter(pa.array(keep)),
                     "row_hash": pa.array(hashes[keep])})


def _hash_files(name: str, files: list[dict], row_len: int, dtype: str, vocab_size: int,
                lookup: np.ndarray | None = None) -> list[np.ndarray]:
    """Per file, the hashes of its rows in file order (with `lookup`: of its rows whose hash is in it): one Ray
    Data pass, read and hash fused into one task per file, the hashes gathered on the driver."""
    units = [(i, {"files": [{"path": f["path"], "train_rows": f["train_rows"], "val_rows": f["val_rows"]}]})
             for i, f in enumerate(files)]
    parts: dict[int, list[pa.Table]] = {}
    done: set[int] = set()

    def hash_pass(members: list[int], memory: int | None) -> None:
        rows = read_dataset(packed_rows([units[i] for i in members], row_len=row_len, dtype=dtype,
                                        vocab_size=vocab_size, hashed=False), len(members), memory)
        for i in members:
            parts.pop(i, None)  # a rerun reads the file again
        for batch in map_rows(rows, hash_rows, memory, row_len=row_len, lookup=lookup).iter_batches(
                batch_size=None, batch_format="pyarrow"):
            for unit, part in rows_by_unit(batch):
                parts.setdefault(unit, []).append(part)
        done.update(members)

    with block_size(BLOCK_BYTES):
        run_units(name, [None] * len(files), hash_pass, lambda i: i in done)
    hashes = []
    for i in range(len(files)):
        table = pa.concat_tables(parts[i]) if parts.get(i) else None
        if table is None:
            hashes.append(np.zeros(0, np.uint64))
            continue
        order = np.argsort(table.column(INDEX).to_numpy(), kind="stable")
        hashes.append(table.column("row_hash").to_numpy()[order])
    return hashes


def validation_hashes(val: list[dict], row_len: int, dtype: str, vocab_size: int, saved: Path) -> list[np.ndarray]:
    """Per validation file, its rows' hashes in file order (operator `dedup_hash_val`); read from `saved` (an .npz
    keyed by the caller with the inputs' fingerprint) when an earlier run wrote it, else found and saved there."""
    if saved.is_file():
        with np.load(saved) as stored:
            if stored["paths"].tolist() == [e["path"] for e in val]:
                print(f"[dedup] validation row hashes read from {saved} (found by an earlier run)", flush=True)
                return [stored[f"file{i}"] for i in range(len(val))]
    per_file = _hash_files("dedup_hash_val", val, row_len, dtype, vocab_size)
    saved.parent.mkdir(parents=True, exist_ok=True)
    tmp = layout.temp_path(saved)
    with open(tmp, "wb") as f:
        np.savez(f, paths=np.array([e["path"] for e in val]), **{f"file{i}": h for i, h in enumerate(per_file)})
    layout.commit_file(tmp, saved)
    return per_file


def sorted_unique(parts: list[np.ndarray]) -> np.ndarray:
    """The hashes of all `parts`, sorted and unique: the set `in_sorted` searches."""
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)


def duplicates_found(val: list[dict], per_file: list[np.ndarray], in_train: np.ndarray) -> dict[str, list[int]]:
    """Per validation file path, the row numbers whose hash is in `in_train` (sorted, unique)."""
    return {e["path"]: np.flatnonzero(in_sorted(h, in_train)).tolist() for e, h in zip(val, per_file)}


def find_val_duplicates(train: list[dict], val: list[dict], row_len: int, dtype: str, vocab_size: int,
                        saved: Path) -> dict[str, list[int]]:
    """Per validation file path, the row numbers (in the file) whose bytes also occur in a training row, by the
    two passes (`dedup_hash_val`, `dedup_match_train`): for training files that are not read anyway. The
    validation hashes are saved as `saved`.npz, the result as `saved`.json; a rerun reads them."""
    result = saved.with_suffix(".json")
    if result.is_file():
        found = json.loads(result.read_text())
        if sorted(found) == sorted(e["path"] for e in val):
            print(f"[dedup] validation rows also in train: read from {result} (found by an earlier run)", flush=True)
            return found
    per_file = validation_hashes(val, row_len, dtype, vocab_size, saved.with_suffix(".npz"))
    matches = _hash_files("dedup_match_train", train, row_len, dtype, vocab_size, lookup=sorted_unique(per_file))
    duplicates = duplicates_found(val, per_file, sorted_unique(matches))
    layout.write_json(result, duplicates)
    return duplicates

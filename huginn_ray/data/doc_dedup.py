"""Exact deduplication of documents across all sources: of documents with the same content, the first is kept.

The content hash is the 64-bit blake2b of a document's text exactly as staged (its UTF-8 bytes; no
normalisation: documents that differ in one character, or only in case or whitespace, are both kept; a chat
document's staged JSON is its messages, so two identical conversations are duplicates). "First" is the
document's key, `(file ordinal << 32) | row`: file ordinals number the staged files in source-list order, then
file order, so the decision does not depend on task timing. Three steps (run by huginn_ray/data/doc_filter.py):

1. per scan unit (a staged file's run of documents), `content_hashes` of its texts, `hash_table`: (hash, row)
   pairs sorted by hash, saved as one .npy file;
2. per hash bucket (`bucket_bounds`: the 2^64 hash values cut into equal ranges), `bucket_entries`: the slice
   of every unit's table in the bucket's range (two binary searches in a memory map per table), and
   `duplicate_keys`: sorted by (hash, key), every entry after the first of its hash is a duplicate; their keys,
   sorted, in one .npy file;
3. per staged file, `duplicate_rows`: its rows among every bucket's duplicate keys (two binary searches each);
   on the driver, `duplicate_counts`: how many each file has.

Memory is bounded by a bucket: 16 bytes per document of the bucket (x about 3 while sorting), whatever the
total; tables are opened U x B times in step 2 (U scan units, B buckets), dups files F x B times in step 3 (F
staged files).
"""

from __future__ import annotations

import hashlib

import numpy as np

ROW_BITS = 32
"""A key's row field (doc_id uses the same split: staging.py)."""
DOCS_PER_BUCKET = 1 << 24
"""Entries one dedup task sorts (16 M: 256 MiB of (hash, key) pairs, ~3x that while sorting)."""


def content_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def content_hashes(texts: list[str]) -> np.ndarray:
    """content_hash of every text (uint64)."""
    return np.fromiter((content_hash(t) for t in texts), np.uint64, len(texts))


def hash_table(hashes: np.ndarray, first_row: int = 0) -> np.ndarray:
    """(hash, row) of consecutive documents whose rows start at `first_row`, shape (n, 2) uint64, sorted by hash
    then row."""
    rows = np.arange(first_row, first_row + len(hashes), dtype=np.uint64)
    order = np.lexsort((rows, hashes))
    return np.stack([hashes[order], rows[order]], axis=1)


def bucket_bounds(buckets: int) -> list[tuple[int, int]]:
    """`buckets` consecutive [lo, hi) ranges covering 0 .. 2^64 (hi of the last is 2^64)."""
    edges = [(b << 64) // buckets for b in range(buckets + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _hash_range(table: np.ndarray, lo: int, hi: int) -> slice:
    column = table[:, 0]
    start = int(np.searchsorted(column, np.uint64(lo)))
    stop = len(column) if hi >= 1 << 64 else int(np.searchsorted(column, np.uint64(hi)))
    return slice(start, stop)


def bucket_entries(tables: list[tuple[int, str]], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """(hashes, keys) of every document whose hash is in [lo, hi), from the `hash_table` files `tables`, each
    given with the ordinal of the staged file its rows belong to."""
    hashes, keys = [np.zeros(0, np.uint64)], [np.zeros(0, np.uint64)]
    for ordinal, path in tables:
        table = np.load(path, mmap_mode="r")
        part = np.array(table[_hash_range(table, lo, hi)])
        hashes.append(part[:, 0])
        keys.append((np.uint64(ordinal) << np.uint64(ROW_BITS)) | part[:, 1])
    return np.concatenate(hashes), np.concatenate(keys)


def duplicate_keys(hashes: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Keys (sorted, uint64) of the documents whose hash occurs at a smaller key."""
    order = np.lexsort((keys, hashes))
    hashes, keys = hashes[order], keys[order]
    repeat = np.zeros(len(hashes), bool)
    repeat[1:] = hashes[1:] == hashes[:-1]
    return np.sort(keys[repeat])


def duplicate_rows(duplicate_files: list[str], ordinal: int) -> np.ndarray:
    """Rows (sorted, int64) of file `ordinal` that some bucket found to be duplicates."""
    lo = np.uint64(ordinal) << np.uint64(ROW_BITS)
    hi = np.uint64(ordinal + 1) << np.uint64(ROW_BITS) if ordinal + 1 < 1 << 32 else None
    rows = []
    for path in duplicate_files:
        keys = np.load(path, mmap_mode="r")
        start = int(np.searchsorted(keys, lo))
        stop = len(keys) if hi is None else int(np.searchsorted(keys, hi))
        rows.append(np.array(keys[start:stop]) - lo)
    return np.sort(np.concatenate(rows)).astype(np.int64) if rows else np.zeros(0, np.int64)


def duplicate_counts(duplicate_files: list[str], files: int) -> np.ndarray:
    """How many of its rows each of the `files` staged files has among the buckets' duplicate keys (int64, one
    count per file ordinal); one bucket's keys in memory at a time."""
    counts = np.zeros(files, np.int64)
    for path in duplicate_files:
        ordinals = np.load(path) >> np.uint64(ROW_BITS)
        counts += np.bincount(ordinals.astype(np.int64), minlength=files)[:files]
    return counts

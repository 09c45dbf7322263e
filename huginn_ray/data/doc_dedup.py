"""Exact deduplication of documents across all sources: of documents with the same content, the first is kept.

The content hash is the 64-bit blake2b of a document's text exactly as staged (its UTF-8 bytes; no
normalisation: documents that differ in one character, or only in case or whitespace, are both kept; a chat
document's staged JSON is its messages, so two identical conversations are duplicates). "First" is the
document's key, `(file ordinal << 32) | row`: file ordinals number the staged files in source-list order, then
file order, so the decision does not depend on task timing. Three steps (run by huginn_ray/data/doc_filter.py):

1. per staged file, `hash_table(texts)` per batch of documents, `merge_hash_tables`: (hash, row) pairs sorted by
   hash, saved as one .npy file;
2. per hash bucket (`bucket_bounds`: the 2^64 hash values cut into equal ranges), `bucket_duplicates`: the slice
   of every file's table in the bucket's range (two binary searches in a memory map per file), sorted by
   (hash, key): every entry after the first of its hash is a duplicate; their keys, sorted, in one .npy file;
3. per staged file, `duplicate_rows`: its rows among every bucket's duplicate keys (two binary searches each).

Memory is bounded by a bucket: 16 bytes per document of the bucket (x about 3 while sorting), whatever the
total; files are opened F x B times in steps 2 and 3 (F staged files, B buckets).
"""

from __future__ import annotations

import hashlib

import numpy as np

ROW_BITS = 32
"""A key's row field (doc_id uses the same split: staging.py)."""


def content_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def hash_table(texts: list[str]) -> np.ndarray:
    """(hash, row) of every document, shape (n, 2) uint64, sorted by hash then row."""
    hashes = np.fromiter((content_hash(t) for t in texts), np.uint64, len(texts))
    rows = np.arange(len(texts), dtype=np.uint64)
    order = np.lexsort((rows, hashes))
    return np.stack([hashes[order], rows[order]], axis=1)


def merge_hash_tables(parts: list[np.ndarray]) -> np.ndarray:
    """One file's `hash_table` from the tables of its consecutive batches (rows renumbered from 0)."""
    offset, shifted = 0, []
    for part in parts:
        shifted.append(part + np.array([0, offset], np.uint64))
        offset += len(part)
    table = np.concatenate(shifted) if shifted else np.zeros((0, 2), np.uint64)
    return table[np.lexsort((table[:, 1], table[:, 0]))]


def bucket_bounds(buckets: int) -> list[tuple[int, int]]:
    """`buckets` consecutive [lo, hi) ranges covering 0 .. 2^64 (hi of the last is 2^64)."""
    edges = [(b << 64) // buckets for b in range(buckets + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _hash_range(table: np.ndarray, lo: int, hi: int) -> slice:
    column = table[:, 0]
    start = int(np.searchsorted(column, np.uint64(lo)))
    stop = len(column) if hi >= 1 << 64 else int(np.searchsorted(column, np.uint64(hi)))
    return slice(start, stop)


def bucket_duplicates(tables: list[str], lo: int, hi: int) -> np.ndarray:
    """Keys (sorted, uint64) of the documents in hash range [lo, hi) whose hash occurs at a smaller key.

    `tables[ordinal]` is the path of that file's `hash_table` (.npy)."""
    hashes, keys = [], []
    for ordinal, path in enumerate(tables):
        table = np.load(path, mmap_mode="r")
        part = np.array(table[_hash_range(table, lo, hi)])
        hashes.append(part[:, 0])
        keys.append((np.uint64(ordinal) << np.uint64(ROW_BITS)) | part[:, 1])
    all_hashes = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
    all_keys = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
    order = np.lexsort((all_keys, all_hashes))
    all_hashes, all_keys = all_hashes[order], all_keys[order]
    repeat = np.zeros(len(all_hashes), bool)
    repeat[1:] = all_hashes[1:] == all_hashes[:-1]
    return np.sort(all_keys[repeat])


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

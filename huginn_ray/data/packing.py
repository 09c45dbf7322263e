"""Packing tokenised documents into rows of exactly seq_len + 1 ids (§6.4), and source up-weighting.

The rule, walking the documents of one batch in order with a running buffer:
before a document is appended, if the buffer holds >= row_len tokens then
- if the previous document is sacred (`every_token_is_sacred`), cut as many row_len blocks as fit and keep the rest;
- otherwise emit the first row_len tokens as one row and discard ("incinerate") the rest.
The same check runs once more after the last document; what is left (< row_len tokens) is dropped. Every row
therefore starts at a document boundary or at a sacred remainder, and there is no padding.

Weights: a source of weight w contributes floor(w) full copies of its documents plus one partial copy holding
a seeded random frac(w) share of them. Each copy packs its batch in its own seeded document order, so the copies
of short documents land in different rows.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

from huginn_ray.data.permutation import FeistelPermutation


def pack_row_starts(lengths: Sequence[int], sacred: Sequence[bool], row_len: int) -> list[int]:
    """Start offsets, in the concatenation of the documents, of the rows the packing rule cuts."""
    starts: list[int] = []
    buf_start = buf_end = 0
    prev_sacred = False

    def flush() -> None:
        nonlocal buf_start
        if buf_end - buf_start < row_len:
            return
        if prev_sacred:
            while buf_end - buf_start >= row_len:
                starts.append(buf_start)
                buf_start += row_len
        else:
            starts.append(buf_start)
            buf_start = buf_end

    for length, is_sacred in zip(lengths, sacred):
        flush()
        buf_end += int(length)
        prev_sacred = bool(is_sacred)
    flush()
    return starts


def pack(docs: Sequence[np.ndarray], sacred: Sequence[bool], row_len: int) -> np.ndarray:
    """Pack token arrays into a (rows, row_len) int32 array with the rule above."""
    if not docs:
        return np.zeros((0, row_len), np.int32)
    flat = np.concatenate([np.asarray(d, np.int32) for d in docs])
    starts = pack_row_starts([len(d) for d in docs], sacred, row_len)
    if not starts:
        return np.zeros((0, row_len), np.int32)
    index = np.asarray(starts, np.int64)[:, None] + np.arange(row_len, dtype=np.int64)[None, :]
    return flat[index]


def copy_fractions(weight: float) -> list[float]:
    """Share of documents in each copy: weight 2.5 -> [1.0, 1.0, 0.5]; weight 0.25 -> [0.25]."""
    full = math.floor(weight)
    fractions = [1.0] * full
    if weight - full > 1e-12:
        fractions.append(weight - full)
    return fractions


def unit_hash(seed: int, salt: str, text: str) -> float:
    """A seeded hash of a document mapped to [0, 1): decides hold-out and partial-copy membership."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8,
                             key=f"{seed}:{salt}".encode()[:64]).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def copy_order(seed: int, copy: int, first_doc_id: int, n: int) -> np.ndarray:
    """The document order copy `copy` of a batch (named by its first document) is packed in: the project's own
    keyed permutation (huginn_ray/data/permutation.py), so the order does not move with a NumPy upgrade."""
    return FeistelPermutation(n, seed, f"pack:copy{copy}:batch{first_doc_id}")(np.arange(n))

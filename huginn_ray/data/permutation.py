"""The pipeline's seeded permutations, defined by this file's code alone (no library random stream).

    FeistelPermutation(n, seed, "shuffle:train")(np.arange(n))   # a bijection of [0, n)

Every seeded order of the data (the global shuffle of each split, huginn_ray/data/shuffle.py; the order each
up-weighting copy of a pack batch is packed in, huginn_ray/data/packing.py) is one of these. Its round keys are a
keyed hash (blake2b, key and personalisation the project's constants below) of (seed, stage, round index), and its
rounds are splitmix64's finaliser in numpy uint64 arithmetic: nothing depends on how a library seeds or draws from
a generator (NumPy does not promise that a Generator stream stays the same across versions), so the order of the
data is the same with any NumPy that does integer arithmetic. tests/test_data_units.py pins an exact sequence.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

HASH_KEY = b"huginn_ray"
HASH_PERSON = b"permutation"
"""blake2b's key and personalisation for every permutation key: changing either changes every data order."""


def permutation_key(seed: int, stage: str, index: int) -> int:
    """A 64-bit key for round `index` of the permutation `stage` (which also names what it orders, e.g.
    "pack:copy1:batch4294967296") under `seed`."""
    message = f"{seed}\x00{stage}\x00{index}".encode()
    digest = hashlib.blake2b(message, digest_size=8, key=HASH_KEY, person=HASH_PERSON).digest()
    return int.from_bytes(digest, "little")


class FeistelPermutation:
    """A seeded bijection of [0, n), evaluated on numpy arrays: a balanced Feistel network over the smallest even
    number of bits that holds n, with cycle walking (an output >= n is fed through again until it is < n)."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int, stage: str):
        self.n = n
        bits = max(2, math.ceil(math.log2(max(n, 2))))
        self.half = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.array([permutation_key(seed, stage, r) for r in range(self.ROUNDS)], np.uint64)

    def _round(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(self.half), x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix64(right ^ key) & self.mask)
        return (left << np.uint64(self.half)) | right

    def __call__(self, index: np.ndarray) -> np.ndarray:
        out = self._round(index.astype(np.uint64))
        outside = out >= np.uint64(self.n)
        while outside.any():  # cycle walking: stays a bijection of [0, n)
            out[outside] = self._round(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a good 64-bit mixing function."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))

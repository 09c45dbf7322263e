"""Near-duplicate detection by MinHash LSH: signatures, band keys, candidate pairs and their components.

Of documents whose word 5-shingle sets have a Jaccard similarity of at least `near_dedup.threshold`, the first
(smallest key: source-list, file, row order, as exact dedup keeps, huginn_ray/data/doc_dedup.py) is kept. The
steps, run by the filter stage (huginn_ray/data/doc_filter.py, huginn_ray/data/dedup_pass.py):

1. `minhash_signatures` of a batch of documents, all numpy over the batch at once: the text lower-cased and cut
   into words at every ASCII byte that is not a letter or digit (punctuation is no word; bytes >= 128 belong to
   words, so non-ASCII letters stay in them); each word a 64-bit polynomial hash of its bytes (prefix sums over
   the batch's bytes, no Python loop per word); each shingle of `shingle` consecutive words of one document a
   mixed combination of its words' hashes (a document of fewer words is one shingle of all of them; one of no
   word has no signature and is never a near duplicate); then bands x rows hash functions of the shingle's 64-bit
   hash x, h(x) = the high 32 bits of (a x + b) mod 2^64 (multiply-add-shift; a odd and b drawn from `seed`), and
   the minimum over the document's shingles of each: the signature, bands x rows uint32 values. (a x + b) mod
   (2^61 - 1) of x's low 32 bits, the other common choice, cost twice as much here and its estimate of the
   similarity of copies with Jaccard 0.886 spread wider: 90 % of them at >= 0.8, against 99 %;
2. `band_keys`: each band's rows hashed to one 64-bit key (salted with the band's number, so that bands share one
   key space); `band_table`: (key, row) of every band of every document, sorted like exact dedup's hash table, so
   that the same range buckets and reads group equal keys (doc_dedup.bucket_entries);
3. `candidate_pairs` per bucket: in each run of equal keys, every document paired with the run's first (linear in
   the run, where all pairs would be quadratic: a template shared by thousands of pages); a pair is kept when the
   share of equal values in the two signatures (the MinHash estimate of their Jaccard similarity) is at least the
   threshold, so that documents colliding in one band by chance (a shared boilerplate paragraph) are kept;
4. `component_drops` over every bucket's pairs: connected components (min-label propagation with pointer jumping,
   numpy over all pairs at once); in each component every document but the smallest key is dropped.

With 14 bands of 8 rows (FineWeb's setting) a pair of Jaccard similarity s becomes a candidate with probability
1 - (1 - s^8)^14: 92 % at 0.8, 99.6 % at 0.87, 5 % at 0.6.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_HIGH = np.uint64(32)
_WORD_BASE = np.uint64(0x100000001B3)  # odd: invertible modulo 2^64
_WORD_BASE_INVERSE = np.uint64(pow(0x100000001B3, -1, 1 << 64))
_POSITION = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
                      0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x94D049BB133111EB, 0xBF58476D1CE4E5B9], np.uint64)
"""Odd multipliers of a word's hash by its position in the shingle (order matters: "a b" is not "b a")."""
SIGNATURE_BATCH_BYTES = 1 << 20
"""Characters hashed into words at a time (the word hashes' arrays: ~40 bytes per character)."""
SIGNATURE_CHUNK = 1 << 13
"""Shingles hashed at a time: a (chunk, bands x rows) uint64 array, 7 MiB at 112 hash functions (a larger one
leaves the caches and is slower per shingle)."""

_WORD_BYTE = np.zeros(256, bool)
_WORD_BYTE[128:] = True
for _c in b"abcdefghijklmnopqrstuvwxyz0123456789":
    _WORD_BYTE[_c] = True


@dataclass(frozen=True)
class MinHashParams:
    """The hash functions of one near-dedup setting (from NearDedupConfig: shingle, bands, rows, seed)."""

    shingle: int
    bands: int
    rows: int
    a: np.ndarray
    b: np.ndarray

    @classmethod
    def make(cls, shingle: int, bands: int, rows: int, seed: int) -> "MinHashParams":
        rng = np.random.default_rng(seed)
        a = rng.integers(0, 1 << 63, bands * rows, dtype=np.uint64) * np.uint64(2) + np.uint64(1)  # odd
        b = rng.integers(0, 1 << 63, bands * rows, dtype=np.uint64) * np.uint64(2)
        return cls(shingle, bands, rows, a, b)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit spread over the output (uint64 in, uint64 out)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


_POWERS: list[np.ndarray] = [np.ones(1, np.uint64), np.ones(1, np.uint64)]


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(base^i, base^-i) modulo 2^64 for i < at least n, kept between calls (computing them cost as much as the
    rest of the word hashes); at most SIGNATURE_BATCH_BYTES of them unless a longer text asks for more."""
    if len(_POWERS[0]) < n:
        size = max(n, min(2 * len(_POWERS[0]), SIGNATURE_BATCH_BYTES))
        with np.errstate(over="ignore"):
            for i, base in enumerate((_WORD_BASE, _WORD_BASE_INVERSE)):
                _POWERS[i] = np.concatenate((np.ones(1, np.uint64), np.cumprod(np.full(size - 1, base, np.uint64))))
    return _POWERS[0], _POWERS[1]


def word_hashes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(hash of every word of every text, in order; the text each word belongs to), words as the module's
    docstring defines them."""
    encoded = [t.lower().encode() for t in texts]
    data = np.frombuffer(b" ".join(encoded), np.uint8)
    if not len(data):
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    starts_of_texts = np.cumsum([0] + [len(e) + 1 for e in encoded[:-1]])
    inside = _WORD_BYTE[data]
    edges = np.diff(np.concatenate(([False], inside, [False])).astype(np.int8))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    powers, inverse = _powers(len(data))
    with np.errstate(over="ignore"):
        prefix = np.concatenate(([np.uint64(0)], np.cumsum(data.astype(np.uint64) * powers[:len(data)])))
        hashes = mix64((prefix[ends] - prefix[starts]) * inverse[starts])
    return hashes, np.searchsorted(starts_of_texts, starts, side="right") - 1


def shingle_hashes(texts: list[str], shingle: int) -> tuple[np.ndarray, np.ndarray]:
    """(hash of every shingle, the text each belongs to), shingles of a text consecutive."""
    words, text_of = word_hashes(texts)
    if not len(words):
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    first_word = np.searchsorted(text_of, np.arange(len(texts)))
    count = np.bincount(text_of, minlength=len(texts))
    position = np.arange(len(words)) - first_word[text_of]
    start = position <= np.maximum(count[text_of] - shingle, 0)  # a shingle begins at this word
    begins = np.flatnonzero(start)
    combined = np.zeros(len(begins), np.uint64)
    with np.errstate(over="ignore"):
        for k in range(shingle):
            at = begins + k
            inside = (at < len(words)) & (text_of[np.minimum(at, len(words) - 1)] == text_of[begins])
            combined += np.where(inside, words[np.minimum(at, len(words) - 1)] * _POSITION[k % len(_POSITION)], 0)
    return mix64(combined), text_of[begins]


def minhash_signatures(texts: list[str], params: MinHashParams) -> tuple[np.ndarray, np.ndarray]:
    """(signature of every text, (n, bands x rows) uint32; whether it has one: a text of no word has none, its row
    is all ones). Texts are hashed in groups of about SIGNATURE_BATCH_BYTES characters."""
    signatures = np.zeros((len(texts), params.bands * params.rows), np.uint32)
    has = np.zeros(len(texts), bool)
    start, size = 0, 0
    for end, text in enumerate(texts, 1):
        size += len(text) + 1
        if size >= SIGNATURE_BATCH_BYTES or end == len(texts):
            signatures[start:end], has[start:end] = _signatures(texts[start:end], params)
            start, size = end, 0
    return signatures, has


def _signatures(texts: list[str], params: MinHashParams) -> tuple[np.ndarray, np.ndarray]:
    shingles, text_of = shingle_hashes(texts, params.shingle)
    minima = np.full((len(texts), params.bands * params.rows), np.iinfo(np.uint64).max, np.uint64)
    has = np.zeros(len(texts), bool)
    has[text_of] = True
    values = np.empty((min(SIGNATURE_CHUNK, len(shingles)), params.bands * params.rows), np.uint64)
    for lo in range(0, len(shingles), SIGNATURE_CHUNK):
        part, owner = shingles[lo:lo + SIGNATURE_CHUNK], text_of[lo:lo + SIGNATURE_CHUNK]
        chunk = values[:len(part)]
        with np.errstate(over="ignore"):  # (a x + b) mod 2^64, in place
            np.multiply(part[:, None], params.a[None, :], out=chunk)
            np.add(chunk, params.b[None, :], out=chunk)
        firsts = np.flatnonzero(np.concatenate(([True], owner[1:] != owner[:-1])))
        # the minimum of the high halves is the high half of the minimum: shifted once, after
        found = np.minimum.reduceat(chunk, firsts, axis=0)
        minima[owner[firsts]] = np.minimum(minima[owner[firsts]], found)  # a text split between chunks
    return (minima >> _HIGH).astype(np.uint32), has


def band_keys(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """Each band's rows hashed to one key, salted with the band's number: (n, bands) uint64."""
    grouped = signatures.reshape(len(signatures), bands, rows).astype(np.uint64)
    with np.errstate(over="ignore"):
        keys = np.broadcast_to(mix64(np.arange(1, bands + 1, dtype=np.uint64)), (len(signatures), bands)).copy()
        for r in range(rows):
            keys = mix64(keys ^ grouped[:, :, r])
    return keys


def band_table(keys: np.ndarray, has: np.ndarray, first_row: int = 0) -> np.ndarray:
    """(band key, row) of every band of the documents that have a signature (rows from `first_row`), (m, 2)
    uint64 sorted by key then row: the layout of doc_dedup.hash_table."""
    rows = np.repeat(np.arange(first_row, first_row + len(keys), dtype=np.uint64)[has], keys.shape[1])
    flat = keys[has].reshape(-1)
    order = np.lexsort((rows, flat))
    return np.stack([flat[order], rows[order]], axis=1)


def candidate_pairs(hashes: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, other): per run of equal band keys, its smallest document key paired with each other one, unique
    pairs (uint64 each)."""
    order = np.lexsort((keys, hashes))
    hashes, keys = hashes[order], keys[order]
    new_run = np.ones(len(hashes), bool)
    new_run[1:] = hashes[1:] != hashes[:-1]
    run_first = keys[np.flatnonzero(new_run)[np.cumsum(new_run) - 1]]
    other = ~new_run & (keys != run_first)
    pairs = np.unique(np.stack([run_first[other], keys[other]], axis=1), axis=0) if other.any() else \
        np.zeros((0, 2), np.uint64)
    return pairs[:, 0], pairs[:, 1]


def similar(first: np.ndarray, other: np.ndarray, threshold: float) -> np.ndarray:
    """Whether each pair of signatures (rows of `first`, `other`) shares at least `threshold` of its values."""
    return (first == other).mean(axis=1) >= threshold if len(first) else np.zeros(0, bool)


def component_drops(first: np.ndarray, other: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dropped keys, sorted; the kept key of each one's component): the connected components of the pairs,
    every key of a component but the smallest dropped."""
    if not len(first):
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    nodes, index = np.unique(np.concatenate([first, other]), return_inverse=True)
    a, b = index[:len(first)], index[len(first):]
    label = np.arange(len(nodes))  # nodes are sorted: the smallest label of a component is its smallest key
    while True:
        low = np.minimum(label[a], label[b])
        before = label.copy()
        np.minimum.at(label, a, low)
        np.minimum.at(label, b, low)
        label = label[label]  # pointer jumping: a label's label, until every node names its component's root
        while not np.array_equal(label, label[label]):
            label = label[label]
        if np.array_equal(label, before):
            break
    dropped = label != np.arange(len(nodes))
    return nodes[dropped], nodes[label[dropped]]

"""Filter-stage CPU cost per document: decontamination scan, content hash and near dedup, one process, one core.

    python bench/doc_filter.py [--docs 20000] [--words 750] [--eval configs/eval/gsm8k_test_sample.jsonl]

Documents are generated (seeded): --words words each, drawn from a Zipf-like vocabulary of 50,000 made-up words
with punctuation and mixed case, about 1,000 tokens of web text. Measures, as the `doc_scan` actors run them:
  ngram - document_words + first_match against the n-gram set of --eval (13-grams; no document matches, so every
          gram of every document is checked: the worst case);
  hash  - content_hashes + hash_table (64-bit blake2b of each document's text, sorted (hash, row) table);
  near  - `dedup: near`'s scan (huginn_ray/data/near_dedup.py with the default near_dedup settings: 5-word
          shingles, 14 bands x 8 rows): minhash_signatures + band_keys + band_table, in batches of --near-batch;
and the dedup decisions per document: exact (`bucket_entries` + `duplicate_keys` over the tables of 8 files) and
near (`bucket_entries` + `candidate_pairs` + `similar` + `component_drops` over the band tables of 8 files; the
documents are distinct, so the pairs are the LSH's chance collisions). Times are the process's CPU time
(time.process_time: all of it is one thread), so that other load on the machine slows them less than wall time.
Figures are printed; nothing is asserted.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from huginn_ray.data.decontaminate import EvalFile, build_ngram_set, document_words, first_match  # noqa: E402
from huginn_ray.data.config import NearDedupConfig  # noqa: E402
from huginn_ray.data.doc_dedup import bucket_bounds, bucket_entries, content_hashes, duplicate_keys, hash_table  # noqa: E402
from huginn_ray.data.near_dedup import (MinHashParams, band_keys, band_table, candidate_pairs,  # noqa: E402
                                        component_drops, minhash_signatures, similar)


def documents(count: int, words: int) -> list[str]:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(50_000)]
    weights = [1 / (rank + 1) for rank in range(len(vocab))]
    docs = []
    for _ in range(count):
        chosen = rng.choices(vocab, weights, k=words)
        docs.append(" ".join(w.capitalize() + "." if rng.random() < 0.07 else w + ("," if rng.random() < 0.05 else "")
                             for w in chosen))
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=20_000)
    parser.add_argument("--words", type=int, default=750)
    parser.add_argument("--near-batch", type=int, default=1024, help="documents per minhash_signatures call")
    parser.add_argument("--eval", default=str(Path(__file__).resolve().parents[1] / "configs" / "eval" /
                                              "gsm8k_test_sample.jsonl"))
    args = parser.parse_args()
    docs = documents(args.docs, args.words)
    mib = sum(len(d.encode()) for d in docs) / 2**20
    ngrams = build_ngram_set([EvalFile(Path(args.eval), args.eval)], 13)
    start = time.process_time()
    matched = sum(first_match(document_words(d, False), ngrams.hashes, ngrams.items, ngrams.lengths) is not None
                  for d in docs)
    scan_s = time.process_time() - start
    start = time.process_time()
    tables = [hash_table(content_hashes(docs[i::8])) for i in range(8)]
    hash_s = time.process_time() - start
    near = NearDedupConfig()
    params = MinHashParams.make(near.shingle, near.bands, near.rows, near.seed)
    start = time.process_time()
    signatures, band_tables = [], []
    for i in range(0, len(docs), args.near_batch):
        batch_signatures, has = minhash_signatures(docs[i:i + args.near_batch], params)
        signatures.append(batch_signatures)
        band_tables.append(band_table(band_keys(batch_signatures, near.bands, near.rows), has, i))
    near_s = time.process_time() - start
    signatures = np.concatenate(signatures)
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, table in enumerate(tables):
            paths.append(f"{tmp}/{i}.npy")
            np.save(paths[-1], table)
        start = time.process_time()
        (lo, hi), = bucket_bounds(1)
        duplicate_keys(*bucket_entries(list(enumerate(paths)), lo, hi))
        dedup_s = time.process_time() - start
        band_paths = []
        for i, table in enumerate(band_tables):
            band_paths.append(f"{tmp}/bands{i}.npy")
            np.save(band_paths[-1], table)
        start = time.process_time()
        bands, keys = bucket_entries([(0, p) for p in band_paths], lo, hi)
        first, other = candidate_pairs(bands, keys)
        keep = similar(signatures[first.astype(np.int64)], signatures[other.astype(np.int64)], near.threshold)
        dropped, _ = component_drops(first[keep], other[keep])
        near_dedup_s = time.process_time() - start
    print(f"{args.docs} documents of {args.words} words, {mib:.1f} MiB; n-gram set {len(ngrams.hashes)} grams, "
          f"lengths {ngrams.lengths}; {matched} matched")
    print(f"near dedup: {len(first)} candidate pairs, {int(keep.sum())} similar, {len(dropped)} dropped")
    for name, seconds in (("ngram scan", scan_s), ("content hash", hash_s), ("near signatures", near_s),
                          ("dedup decision", dedup_s), ("near decision", near_dedup_s)):
        print(f"{name:15s} {seconds:7.2f} s  {args.docs / seconds:10,.0f} docs/s  {mib / seconds:8.1f} MiB/s  "
              f"{seconds / args.docs * 1e6:8.1f} us/doc")


if __name__ == "__main__":
    main()

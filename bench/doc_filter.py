"""Filter-stage CPU cost per document: decontamination scan and content hash, one process, one core.

    python bench/doc_filter.py [--docs 20000] [--words 750] [--eval configs/eval/gsm8k_test_sample.jsonl]

Documents are generated (seeded): --words words each, drawn from a Zipf-like vocabulary of 50,000 made-up words
with punctuation and mixed case, about 1,000 tokens of web text. Measures, as the `doc_scan` actors run them:
  ngram - document_words + first_match against the n-gram set of --eval (13-grams; no document matches, so every
          gram of every document is checked: the worst case);
  hash  - content_hashes + hash_table (64-bit blake2b of each document's text, sorted (hash, row) table);
and the dedup decision (`bucket_entries` + `duplicate_keys` over the tables of 8 files) per document. Figures are printed;
nothing is asserted.
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
from huginn_ray.data.doc_dedup import bucket_bounds, bucket_entries, content_hashes, duplicate_keys, hash_table  # noqa: E402


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
    parser.add_argument("--eval", default=str(Path(__file__).resolve().parents[1] / "configs" / "eval" /
                                              "gsm8k_test_sample.jsonl"))
    args = parser.parse_args()
    docs = documents(args.docs, args.words)
    mib = sum(len(d.encode()) for d in docs) / 2**20
    ngrams = build_ngram_set([EvalFile(Path(args.eval), args.eval)], 13)
    start = time.perf_counter()
    matched = sum(first_match(document_words(d, False), ngrams.hashes, ngrams.items, ngrams.lengths) is not None
                  for d in docs)
    scan_s = time.perf_counter() - start
    start = time.perf_counter()
    tables = [hash_table(content_hashes(docs[i::8])) for i in range(8)]
    hash_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, table in enumerate(tables):
            paths.append(f"{tmp}/{i}.npy")
            np.save(paths[-1], table)
        start = time.perf_counter()
        (lo, hi), = bucket_bounds(1)
        duplicate_keys(*bucket_entries(list(enumerate(paths)), lo, hi))
        dedup_s = time.perf_counter() - start
    print(f"{args.docs} documents of {args.words} words, {mib:.1f} MiB; n-gram set {len(ngrams.hashes)} grams, "
          f"lengths {ngrams.lengths}; {matched} matched")
    for name, seconds in (("ngram scan", scan_s), ("content hash", hash_s), ("dedup decision", dedup_s)):
        print(f"{name:15s} {seconds:7.2f} s  {args.docs / seconds:10,.0f} docs/s  {mib / seconds:8.1f} MiB/s  "
              f"{seconds / args.docs * 1e6:8.1f} us/doc")


if __name__ == "__main__":
    main()

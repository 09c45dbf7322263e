"""The preflight's shard check (huginn_ray/train/shard_check.py) on N train + N val shards: files/s and seconds.

    python bench/preflight_shards.py                       # 4096 + 4096 shards of 4 rows, row groups of 2
    python bench/preflight_shards.py --train-rows 47680 --row-group-size 64 --seq-len 1   # Frontier-sized footers

One train and one val shard are written with the project's writer (huginn_ray.data.tokens: list<uint16> rows,
BYTE_STREAM_SPLIT + zstd, as huginn_ray/data/shuffle.py writes them) into a temporary directory and copied to
every rank (the footer check reads only footers: their size is set by the number of row groups, not by the
row length, so `--seq-len 1` gives a Frontier shard's footer — 47,680 rows of 4,097 ids in row groups of 64 —
without its 390 MB). Then `check_shards` runs once per thread count in `--threads`; the files were just
written, so their footers come from the page cache (a parallel filesystem adds its open latency per file,
which is what the threads overlap).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from huginn_ray.data.shards import shard_path
from huginn_ray.data.tokens import parquet_options, row_schema, rows_to_arrow
from huginn_ray.train.shard_check import DEFAULT_THREADS, check_shards

VOCAB = 65536


def write_template(path: Path, rows: int, row_length: int, row_group_size: int, seed: int) -> int:
    """A shard of random ids as huginn_ray/data/shuffle.py writes it; returns its footer's size in bytes."""
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=(rows, row_length)).astype(np.uint16)
    table = pa.table({"input_ids": rows_to_arrow(ids, "uint16")}, schema=row_schema("uint16"))
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size, **parquet_options(table))
    return pq.read_metadata(path).serialized_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=4096, help="shards per split (= workers)")
    parser.add_argument("--train-rows", type=int, default=4)
    parser.add_argument("--val-rows", type=int, default=4)
    parser.add_argument("--row-group-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", default=f"1,8,{DEFAULT_THREADS}", help="comma-separated thread counts")
    args = parser.parse_args()

    rows = {"train": args.train_rows, "val": args.val_rows}
    with tempfile.TemporaryDirectory(prefix="preflight_shards_") as tmp:
        data_dir = Path(tmp)
        for seed, (split, count) in enumerate(rows.items()):
            template = shard_path(data_dir, split, 0)
            footer = write_template(template, count, args.seq_len + 1, args.row_group_size, seed)
            for rank in range(1, args.files):
                shutil.copyfile(template, shard_path(data_dir, split, rank))
            print(f"{split}: {args.files} shards of {count} rows, {-(-count // args.row_group_size)} row groups, "
                  f"{template.stat().st_size} bytes, footer {footer} bytes", flush=True)
        manifest = {"seq_len": args.seq_len, "token_dtype": "uint16", "vocab_size": VOCAB, "num_shards": args.files,
                    "rows_per_shard": rows}
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
        for threads in (int(t) for t in args.threads.split(",")):
            summary = check_shards(data_dir, manifest, VOCAB, threads=threads)
            print(f"threads {summary.threads:3d}: {summary.files} files in {summary.seconds:.2f} s = "
                  f"{summary.files / summary.seconds:,.0f} files/s", flush=True)


if __name__ == "__main__":
    main()

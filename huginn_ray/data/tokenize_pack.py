"""Tokenise + pack on Ray Data: staged documents -> rows of seq_len + 1 ids in `packed/`.

Per source: `read_parquet(staging files)` -> `map_batches(tokenize_and_pack, batch_size=docs_per_pack_batch)`.
Each batch is encoded with the Rust `tokenizers` batch encoder (the post-processor adds BOS/EOS per document),
split into held-out validation documents and training documents (a seeded hash of the text, so a document and all
its up-weighted copies are on one side), up-weighted, packed (huginn_ray/data/packing.py), and written by the UDF as
`packed/<source index>-<first doc_id>.parquet` with columns `input_ids` (list<int32>) and `split` (0 train, 1 val).

Naming each file after the first document of its batch, with preserve_order set so batches are cut at the same
documents every run, makes the packed data a deterministic function of the staged data, the tokenizer and the
seed, whatever the task scheduling; the shuffle stage builds on that order.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.packing import copy_fractions, copy_order, pack, unit_hash
from huginn_ray.data.sources import Source

PACK_VERSION = 1
TRAIN, VAL = 0, 1
ENCODE_CHUNK = 256
PACKED_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("split", pa.uint8())])


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str):
    from tokenizers import Tokenizer

    # One Ray task = one CPU: keep the Rust encoder on this task's core.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return Tokenizer.from_file(path)


def rows_to_arrow(rows: np.ndarray) -> pa.ListArray:
    n, width = rows.shape
    offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1), pa.int32()))


def tokenize_and_pack(batch: pa.Table, *, source_index: int, tokenizer_file: str, row_len: int, seed: int,
                      val_fraction: float, weight: float, sacred: bool, out_dir: str) -> dict:
    """Ray Data UDF: one batch of staged documents -> one packed parquet file; returns its row counts."""
    texts = batch.column("text").to_pylist()
    first_doc_id = int(batch.column("doc_id")[0].as_py())
    tokenizer = _tokenizer(tokenizer_file)
    docs = []
    for i in range(0, len(texts), ENCODE_CHUNK):  # Encoding objects cost ~100 bytes per token: keep few alive
        docs += [np.asarray(e.ids, np.int32) for e in tokenizer.encode_batch_fast(texts[i:i + ENCODE_CHUNK])]
    held_out = np.array([unit_hash(seed, "val", t) < val_fraction for t in texts])

    parts, splits = [], []
    copied_docs = 0
    for copy, fraction in enumerate(copy_fractions(weight)):
        member = np.ones(len(texts), bool) if fraction >= 1.0 else \
            np.array([unit_hash(seed, f"copy{copy}", t) < fraction for t in texts])
        order = copy_order(seed, copy, first_doc_id, len(texts))
        for split in (TRAIN, VAL):
            chosen = [docs[i] for i in order if member[i] and held_out[i] == (split == VAL)]
            copied_docs += len(chosen)
            rows = pack(chosen, [sacred] * len(chosen), row_len)
            parts.append(rows)
            splits.append(np.full(len(rows), split, np.uint8))
    rows = np.concatenate(parts)
    split_col = np.concatenate(splits)

    name = ""
    if len(rows):
        name = f"{source_index:04d}-{first_doc_id:016x}.parquet"
        table = pa.table({"input_ids": rows_to_arrow(rows), "split": pa.array(split_col)}, schema=PACKED_SCHEMA)
        tmp = Path(out_dir) / (name + ".tmp")
        pq.write_table(table, tmp)
        tmp.rename(Path(out_dir) / name)
    return {
        "file": [name], "source_index": [source_index], "docs": [len(texts)], "copied_docs": [copied_docs],
        "doc_tokens": [int(sum(len(d) for d in docs))],
        "train_rows": [int((split_col == TRAIN).sum())], "val_rows": [int((split_col == VAL).sum())],
    }


def pack_fingerprint(sources: list[Source], staging_markers: dict[str, dict], tokenizer_sha256: str,
                     seq_len: int, seed: int, val_fraction: float, docs_per_batch: int) -> str:
    return layout.fingerprint({
        "version": PACK_VERSION, "tokenizer": tokenizer_sha256, "seq_len": seq_len, "seed": seed,
        "val_fraction": val_fraction, "docs_per_batch": docs_per_batch,
        "sources": [(s.name, s.weight, s.every_token_is_sacred, staging_markers[s.name]["fingerprint"])
                    for s in sources],
    })


def run_pack(sources: list[Source], staged: dict[str, list[Path]], doc_counts: dict[str, int],
             tokenizer_file: Path, out_root: Path, *,
             seq_len: int, seed: int, val_fraction: float, docs_per_batch: int, fingerprint: str,
             extra_marker: dict) -> dict:
    """Tokenise and pack every source into `out_root` (skipped when complete); returns the pack marker."""
    import ray.data

    if layout.is_complete(out_root, fingerprint):
        marker = layout.read_marker(out_root)
        print(f"[pack] complete ({marker['train_rows']} train + {marker['val_rows']} val rows), skipped", flush=True)
        return marker

    tmp = layout.tmp_dir_for(out_root)
    per_source: dict[str, dict] = {}
    datasets = []
    for index, source in enumerate(sources):
        per_source[source.name] = {"docs": 0, "copied_docs": 0, "doc_tokens": 0, "train_rows": 0, "val_rows": 0,
                                   "weight": source.weight, "every_token_is_sacred": source.every_token_is_sacred}
        if not staged[source.name] or source.weight == 0:
            doc_counts = {**doc_counts, source.name: 0}
            continue
        ds = ray.data.read_parquet([str(p) for p in staged[source.name]]).select_columns(["text", "doc_id"])
        # A staged file is read as one block and a block goes to one task: cut blocks to batch size so all
        # CPUs tokenize in parallel.
        ds = ds.repartition(target_num_rows_per_block=docs_per_batch)
        datasets.append(ds.map_batches(
            tokenize_and_pack, batch_size=docs_per_batch, batch_format="pyarrow",
            fn_kwargs={"source_index": index, "tokenizer_file": str(tokenizer_file), "row_len": seq_len + 1,
                       "seed": seed, "val_fraction": val_fraction, "weight": source.weight,
                       "sacred": source.every_token_is_sacred, "out_dir": str(tmp)},
        ))
    files = []
    if datasets:
        ds = datasets[0].union(*datasets[1:]) if len(datasets) > 1 else datasets[0]
        total_docs = sum(doc_counts.values())
        done_docs = done_tokens = 0
        last_print = 0.0
        for r in ds.iter_rows():
            stats = per_source[sources[r["source_index"]].name]
            for key in ("docs", "copied_docs", "doc_tokens", "train_rows", "val_rows"):
                stats[key] += int(r[key])
            if r["file"]:
                files.append({"file": r["file"], "train_rows": int(r["train_rows"]), "val_rows": int(r["val_rows"])})
            done_docs += int(r["docs"])
            done_tokens += int(r["doc_tokens"])
            if time.time() - last_print > 5 or done_docs == total_docs:
                last_print = time.time()
                print(f"[pack] {done_docs}/{total_docs} documents, {done_tokens / 1e6:.2f}M tokens, "
                      f"{len(files)} packed files", flush=True)
    files.sort(key=lambda f: f["file"])
    marker = {
        "fingerprint": fingerprint, "seq_len": seq_len, "seed": seed, "files": files, "sources": per_source,
        "train_rows": sum(f["train_rows"] for f in files), "val_rows": sum(f["val_rows"] for f in files),
        **extra_marker,
    }
    layout.write_json(tmp / layout.COMPLETE, marker)
    layout.replace_dir(tmp, out_root)
    for name, stats in per_source.items():
        print(f"[pack] {name}: {stats['docs']} docs ({stats['copied_docs']} after weighting), "
              f"{stats['doc_tokens']} tokens -> "
              f"{stats['train_rows']} train + {stats['val_rows']} val rows", flush=True)
    return marker

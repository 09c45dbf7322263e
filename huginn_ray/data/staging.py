"""Staging: every source's raw files become parquet files with columns `text`, `source` and `doc_id` (§6.3).

One Ray Data task per input file reads it in batches (huginn_ray/data/formatting.py) and streams the documents
into `staging/<source>/<index>.parquet`, where index is the input file's position in the sorted file list, so the
staged data does not depend on task scheduling. `doc_id` = index * 2^32 + row number in the file: a stable
identity that later names packed files and seeds their document order.
"""

from __future__ import annotations

import fnmatch
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.formatting import DataError, iter_documents
from huginn_ray.data.sources import Source

STAGING_SCHEMA = pa.schema([("text", pa.large_string()), ("source", pa.string()), ("doc_id", pa.int64())])
FORMAT_VERSION = 1  # bump when formatting rules change, so staged data is rebuilt


def list_local_files(source: Source) -> list[Path]:
    root = source.resolved_local_dir()
    if not root.is_dir():
        raise DataError(f"source {source.name!r}: local_dir {root} is not a directory")
    files = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            rel = Path(dirpath, name).relative_to(root).as_posix()
            if any(fnmatch.fnmatch(rel, pattern) for pattern in source.file_patterns):
                files.append(Path(dirpath, name))
    return sorted(files)


def input_fingerprint(source: Source, files: list[Path]) -> str:
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return layout.fingerprint({
        "format_version": FORMAT_VERSION, "features": source.features,
        "chat": source.needs_chat_templating, "files": stats,
    })


def stage_source(source: Source, files: list[Path], staging_root: Path) -> dict:
    """Stage one source unless its output is complete; returns the source's staging marker."""
    import ray.data

    final = staging_root / source.name
    expected = input_fingerprint(source, files)
    if layout.is_complete(final, expected):
        marker = layout.read_marker(final)
        print(f"[staging] {source.name}: complete ({marker['rows']} documents), skipped", flush=True)
        return marker

    tmp = layout.tmp_dir_for(final)
    items = [{"index": i, "path": str(p)} for i, p in enumerate(files)]
    results = []
    if items:
        ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            _stage_file, fn_kwargs={"source": source, "out_dir": str(tmp)}, batch_size=1)
        last_print = 0.0
        for row in ds.iter_rows():
            results.append(row)
            if time.time() - last_print > 5 or len(results) == len(items):
                last_print = time.time()
                print(f"[staging] {source.name}: {len(results)}/{len(items)} files, "
                      f"{sum(r['rows'] for r in results)} documents", flush=True)
    results.sort(key=lambda r: r["index"])
    rows = sum(r["rows"] for r in results)
    marker = {
        "source": source.name, "fingerprint": expected, "rows": rows,
        "chars": sum(r["chars"] for r in results),
        "files": [{"input": r["path"], "output": r["output"], "rows": r["rows"]} for r in results],
    }
    layout.write_json(tmp / layout.COMPLETE, marker)
    layout.replace_dir(tmp, final)
    note = "  WARNING: no rows" if rows == 0 else ""
    print(f"[staging] {source.name}: {len(files)} files -> {rows} documents{note}", flush=True)
    return marker


def _stage_file(batch: dict, source: Source, out_dir: str) -> dict:
    """Ray Data UDF: format one input file and stream its documents into its staging parquet file."""
    index, path = int(batch["index"][0]), str(batch["path"][0])
    output = Path(out_dir) / f"{index:05d}.parquet"
    tmp = layout.temp_path(output)
    rows = chars = 0
    with pq.ParquetWriter(tmp, STAGING_SCHEMA) as writer:
        for texts in iter_documents(path, source):
            writer.write_table(pa.table({
                "text": pa.array(texts, pa.large_string()),
                "source": pa.array([source.name] * len(texts), pa.string()),
                "doc_id": pa.array(range((index << 32) + rows, (index << 32) + rows + len(texts)), pa.int64()),
            }))
            rows += len(texts)
            chars += sum(len(t) for t in texts)
    layout.commit_file(tmp, output)
    return {"index": [index], "path": [path], "output": [output.name], "rows": [rows], "chars": [chars]}


def staged_files(staging_root: Path, source_name: str) -> list[Path]:
    marker = layout.read_marker(staging_root / source_name)
    if marker is None:
        raise DataError(f"source {source_name!r} is not staged yet ({staging_root / source_name}); "
                        "run the staging stage first")
    return [staging_root / source_name / f["output"] for f in marker["files"] if f["rows"] > 0]

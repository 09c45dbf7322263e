"""Staging: every source's raw files become parquet files with columns `text`, `source` and `doc_id` (§6.3).

One Ray Data operator (`staging`, huginn_ray/data/execution.py) maps every (source, input file) pair of every
source at once; a task reads its file in batches (huginn_ray/data/formatting.py) and streams the documents into
`staging/<source>.partial/<index>.parquet`, where index is the input file's position in the sorted file list, so
the staged data does not depend on task scheduling. Each file is committed on its own (temp name, fsync, rename;
its counts in the parquet footer), so a rerun after a crash keeps the staged files of the interrupted run (the
`.partial` directory is keyed by the source's input fingerprint) and stages only the rest. A source's directory
is renamed to `staging/<source>/` with its marker when all of its files are staged. `doc_id` = index * 2^32 + row number in the file: a stable
identity that later names packed files and seeds their document order.
"""

from __future__ import annotations

import collections
import fnmatch
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.execution import run_tasks
from huginn_ray.data.formatting import BadRecord, DataError, iter_documents
from huginn_ray.data.sources import Source

STAGING_SCHEMA = pa.schema([("text", pa.large_string()), ("source", pa.string()), ("doc_id", pa.int64())])
FORMAT_VERSION = 2  # bump when formatting rules change, so staged data is rebuilt (2: record counts and
                    # quarantine; pretraining chat documents staged as parts)
STATS_KEY = b"huginn_ray.staging"  # a staged file's row and character counts, in its parquet footer


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


def input_fingerprint(source: Source, files: list[Path]) -> tuple[str, dict]:
    """The staging fingerprint of a source and its inputs (layout.stage_fingerprint; the file list by its hash)."""
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return layout.stage_fingerprint({
        "format_version": FORMAT_VERSION, "features": source.features,
        "chat": source.needs_chat_templating, "files": layout.fingerprint(stats),
        # a chat source's staged documents are its conversations (huginn_ray/data/formatting.py); other sources'
        # fingerprints stay as they were
        **({"kind": source.kind, "system_prompt": source.system_prompt} if source.is_chat else {}),
    })


def stage_sources(inputs: list[tuple[Source, list[Path]]], staging_root: Path) -> dict[str, dict]:
    """Stage every source whose output is not complete, all in one Ray Data operator; returns {name: marker}.

    `inputs` holds each source with its sorted input files. A source's marker is written, and its directory
    renamed into place, as soon as all of its files are staged."""
    markers: dict[str, dict] = {}
    todo, calls = [], []
    for source, files in inputs:
        final = staging_root / source.name
        expected, fingerprint_inputs = input_fingerprint(source, files)
        layout.finish_commit(final)
        if (marker := layout.current_marker(final, expected, fingerprint_inputs, "staging")) is not None:
            markers[source.name] = marker
            check_bad_records(source, markers[source.name]["records"])  # the limit may have changed since
            print(f"[staging] {source.name}: complete ({markers[source.name]['rows']} documents), skipped", flush=True)
            continue
        quarantine = staging_root.parent / "quarantine" / source.name
        if not layout.is_complete(final.with_name(final.name + ".partial"), expected, layout.PLAN):
            shutil.rmtree(quarantine, ignore_errors=True)  # of other inputs: a fresh staging writes its own
        work = layout.resumable_work_dir(final, expected, "staging", "staged files", len(files),
                                         fingerprint_inputs)
        todo.append({"source": source, "files": files, "work": work, "final": final, "fingerprint": expected,
                     "fingerprint_inputs": fingerprint_inputs,
                     "results": [None] * len(files), "remaining": len(files), "quarantine": quarantine})
        calls += [(source, i, str(p), str(work), str(quarantine)) for i, p in enumerate(files)]
    owner = [(t, i) for t in todo for i in range(len(t["files"]))]

    def finish(task: dict) -> None:
        source, results = task["source"], task["results"]
        rows = sum(r["rows"] for r in results)
        quarantined = collections.Counter()
        for r in results:
            quarantined.update(r["quarantined"])
        records = {"read": sum(r["read"] for r in results), "kept": rows,
                   "quarantined": dict(sorted(quarantined.items())),
                   "dropped": {"empty": sum(r["empty"] for r in results)},
                   "first_bad": next((r["first_bad"] for r in results if r["first_bad"]), None)}
        check_bad_records(source, records)
        marker = {
            "source": source.name, "fingerprint": task["fingerprint"],
            "fingerprint_inputs": task["fingerprint_inputs"], "rows": rows,
            "chars": sum(r["chars"] for r in results), "records": records,
            "files": [{"input": str(p), "output": r["output"], "rows": r["rows"], "max_chars": r["max_chars"]}
                      for p, r in zip(task["files"], results)],
        }
        layout.commit_work_dir(task["work"], task["final"], marker)
        markers[source.name] = marker
        note = "  WARNING: no rows" if rows == 0 else ""
        print(f"[staging] {source.name}: {len(task['files'])} files -> {rows} documents{note}; "
              f"{records_line(records, task['quarantine'])}", flush=True)

    def done(call: int, result: dict) -> None:
        task, index = owner[call]
        task["results"][index] = result
        task["remaining"] -= 1
        if task["remaining"] == 0:
            finish(task)

    for task in todo:
        if not task["files"]:
            finish(task)
    run_tasks(stage_file, calls, name="staging", on_result=done)
    return markers


def stage_file(source: Source, index: int, path: str, out_dir: str, quarantine_dir: str) -> dict:
    """Format one input file and stream its documents into `out_dir/<index>.parquet` (kept when committed by an
    earlier, interrupted run: its counts are read back from the file's metadata). Its bad records go to
    `quarantine_dir/<index>.jsonl` (committed before the parquet file); more of them than `max_bad_records`
    allows as a count fails the task naming the last one read."""
    output = Path(out_dir) / f"{index:05d}.parquet"
    if output.exists():
        return {**json.loads(pq.read_metadata(output).metadata[STATS_KEY]), "output": output.name}
    tmp = layout.temp_path(output)
    rows = chars = max_chars = read = empty = 0
    bad: list[BadRecord] = []
    with pq.ParquetWriter(tmp, STAGING_SCHEMA) as writer:
        for batch in iter_documents(path, source):
            read, empty, bad = read + batch.read, empty + batch.empty, bad + batch.bad
            if is_count(source.max_bad_records) and len(bad) > source.max_bad_records:  # broken within this file
                raise DataError(bad_record_error(source, bad[int(source.max_bad_records)]))
            texts = batch.texts
            if not texts:
                continue
            writer.write_table(pa.table({
                "text": pa.array(texts, pa.large_string()),
                "source": pa.array([source.name] * len(texts), pa.string()),
                "doc_id": pa.array(range((index << 32) + rows, (index << 32) + rows + len(texts)), pa.int64()),
            }))
            rows += len(texts)
            chars += sum(len(t) for t in texts)
            max_chars = max(max_chars, max(len(t) for t in texts))
        stats = {"rows": rows, "chars": chars, "max_chars": max_chars, "read": read, "empty": empty,
                 "quarantined": dict(sorted(collections.Counter(r.reason for r in bad).items())),
                 "first_bad": f"{bad[0].where}: {bad[0].reason}: {bad[0].detail}" if bad else None}
        writer.add_key_value_metadata({STATS_KEY: json.dumps(stats)})
    if bad:
        quarantine = Path(quarantine_dir) / f"{index:05d}.jsonl"
        quarantine.parent.mkdir(parents=True, exist_ok=True)
        quarantine_tmp = layout.temp_path(quarantine)
        quarantine_tmp.write_text("".join(json.dumps({"file": r.file, r.unit: r.number, "reason": r.reason,
                                                      "detail": r.detail, "record": r.record},
                                                     ensure_ascii=False) + "\n" for r in bad))
        layout.commit_file(quarantine_tmp, quarantine)
    layout.commit_file(tmp, output)
    return {**stats, "output": output.name}


def records_line(records: dict, quarantine: Path) -> str:
    """The console's record counts of a source: read, kept, quarantined (per reason), dropped (per filter)."""
    bad = sum(records["quarantined"].values())
    reasons = ", ".join(f"{reason} {n}" for reason, n in records["quarantined"].items())
    dropped = ", ".join(f"{name} {n}" for name, n in records["dropped"].items())
    return (f"records: {records['read']} read, {records['kept']} kept, {bad} quarantined"
            f"{f' ({reasons}) in {quarantine}' if bad else ''}, dropped: {dropped}")


def check_bad_records(source: Source, records: dict) -> None:
    """Refuse a source with more bad records than its `max_bad_records` allows, naming the first one."""
    bad = sum(records["quarantined"].values())
    if bad > allowed_bad_records(source, records["read"]):
        raise DataError(f"source {source.name!r}: {bad} bad records of {records['read']} read, more than "
                        f"max_bad_records: {source.max_bad_records:g} allows; the first: {records['first_bad']}")


def is_count(max_bad_records: float) -> bool:
    """`max_bad_records` is a count (0, or a whole number >= 1), else a fraction of the records read."""
    return max_bad_records == 0 or max_bad_records >= 1


def allowed_bad_records(source: Source, read: int) -> int:
    """How many bad records a source of `read` records may have."""
    limit = source.max_bad_records
    return int(limit) if is_count(limit) else int(limit * read)


def bad_record_error(source: Source, record: BadRecord) -> str:
    """One line: the bad record's file, line or row and reason, and the limit it broke."""
    return (f"source {source.name!r}: {record.where}: {record.reason}: {record.detail} (a bad record beyond "
            f"max_bad_records: {source.max_bad_records:g}; raise it to quarantine such records and go on)")


def staged_files(staging_root: Path, source_name: str) -> list[Path]:
    marker = layout.read_marker(staging_root / source_name)
    if marker is None:
        raise DataError(f"source {source_name!r} is not staged yet ({staging_root / source_name}); "
                        "run the staging stage first")
    return [staging_root / source_name / f["output"] for f in marker["files"] if f["rows"] > 0]

"""Staging: every source's raw files become parquet files with columns `text`, `source` and `doc_id` (§6.3).

One Ray Data dataset stages every (source, input file) pair of every source at once, one task per input file
(`stage_file`, operator `Readstaging`; execution.run_unit_tasks):

    read_batches(path)                  the file's records unformatted, in batches of ROWS_PER_BATCH (line or row
                                        numbers; huginn_ray/data/formatting.py)
      -> format_batch                   each record's document or bad record
      -> StagedFile.add                 the batch's documents as one row group of the file's
                                        `staging/<source>.partial/<index>.parquet`, its bad records kept for the
                                        quarantine file; both committed at the file's end

The records go from the reader to the writer inside the task as Arrow arrays, never through the object store; the
task hands Ray Data only the file's counts. `index` is the input file's position in the source's sorted file list,
and `doc_id` = index * 2^32 + row number in the file: a stable identity, independent of task scheduling, that
later names packed files and seeds their document order.

Each file is committed on its own (temp name, fsync, rename; its counts in the parquet footer), so a rerun after a
crash keeps the staged files of the interrupted run (the `.partial` directory is keyed by the source's input
fingerprint; their counts are read back from their footers on the driver) and stages only the rest. A killed
worker: the files not yet committed run again with twice the memory (execution.rerun_killed). A source's
directory is renamed to `staging/<source>/` with its marker as soon as its own files are staged: the dataset runs
on a thread while the driver looks for finished sources every POLL_S seconds (and once more when it ends, also
when it failed), so a failure in one source does not make a rerun stage a finished one again.
"""

from __future__ import annotations

import collections
import fnmatch
import functools
import json
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.execution import original_error, rerun_killed, run_unit_tasks
from huginn_ray.data.formatting import BadRecord, DataError, FormattedBatch, format_batch, read_batches
from huginn_ray.data.sources import Source

STAGING_SCHEMA = pa.schema([("text", pa.large_string()), ("source", pa.string()), ("doc_id", pa.int64())])
FORMAT_VERSION = 2  # bump when formatting rules change, so staged data is rebuilt (2: record counts and
                    # quarantine; pretraining chat documents staged as parts)
STATS_KEY = b"huginn_ray.staging"  # a staged file's row and character counts, in its parquet footer
POLL_S = 1.0
"""How often the driver looks for sources whose files are all staged, to commit them while the others run."""


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
    """Stage every source whose output is not complete, all in one Ray Data dataset; returns {name: marker}.

    `inputs` holds each source with its sorted input files. A source's marker is written, and its directory
    renamed into place, as soon as all of its files are staged (while the dataset runs the other sources')."""
    markers: dict[str, dict] = {}
    todo, files = [], []
    for source, paths in inputs:
        final = staging_root / source.name
        expected, fingerprint_inputs = input_fingerprint(source, paths)
        layout.finish_commit(final)
        if (marker := layout.current_marker(final, expected, fingerprint_inputs, "staging")) is not None:
            markers[source.name] = marker
            check_bad_records(source, markers[source.name]["records"])  # the limit may have changed since
            print(f"[staging] {source.name}: complete ({markers[source.name]['rows']} documents), skipped", flush=True)
            continue
        quarantine = staging_root.parent / "quarantine" / source.name
        if not layout.is_complete(final.with_name(final.name + ".partial"), expected, layout.PLAN):
            shutil.rmtree(quarantine, ignore_errors=True)  # of other inputs: a fresh staging writes its own
        work = layout.resumable_work_dir(final, expected, "staging", "staged files", len(paths),
                                         fingerprint_inputs)
        todo.append({"source": source, "paths": paths, "work": work, "final": final, "fingerprint": expected,
                     "fingerprint_inputs": fingerprint_inputs, "quarantine": quarantine, "first": len(files)})
        files += [{"source": source, "index": i, "path": str(p), "output": str(work / f"{i:05d}.parquet"),
                   "committed": str(final / f"{i:05d}.parquet"), "quarantine": str(quarantine / f"{i:05d}.jsonl")}
                  for i, p in enumerate(paths)]

    results: dict[int, dict] = {}
    for i, f in enumerate(files):  # committed by an earlier, interrupted run: kept, counts from their footers
        if Path(f["output"]).exists():
            results[i] = staged_file_stats(Path(f["output"]))
    pending = [i for i in range(len(files)) if i not in results]
    committed: dict[str, dict] = {}

    def commit_finished() -> None:
        """Commit every source whose files are all staged (counts from their footers for those the dataset has not
        reported yet)."""
        for task in todo:
            own = range(task["first"], task["first"] + len(task["paths"]))
            if task["source"].name not in committed and all(Path(files[i]["output"]).exists() for i in own):
                stats = [results.get(i) or staged_file_stats(Path(files[i]["output"])) for i in own]
                committed[task["source"].name] = commit_source(task, stats)

    while_running(functools.partial(run_staging, files, pending, results), commit_finished)
    markers.update({task["source"].name: committed[task["source"].name] for task in todo})
    return markers


def while_running(run: Callable[[], None], poll: Callable[[], None]) -> None:
    """run() on a thread while poll() runs every POLL_S seconds, and once more when run() ends (also when it
    failed, so that what finished is kept); an error of either is raised once run() has ended."""
    failed: list[BaseException] = []

    def target() -> None:
        try:
            run()
        except BaseException as err:  # raised on the caller's thread below
            failed.append(err)

    thread = threading.Thread(target=target, name="staging", daemon=True)
    thread.start()
    polled: BaseException | None = None
    running = True
    while running:
        thread.join(POLL_S)
        running = thread.is_alive()
        if polled is None:
            try:
                poll()
            except Exception as err:  # a source over its bad-record limit: raised when the dataset has stopped
                polled = err
    if failed:
        raise failed[0]
    if polled is not None:
        raise polled


def commit_source(task: dict, stats: list[dict]) -> dict:
    """A staged source's marker, from its files' counts (its bad records checked against its limit), committed
    with its directory; returns the marker."""
    source, count = task["source"], len(task["paths"])
    rows = sum(r["rows"] for r in stats)
    quarantined = collections.Counter()
    for r in stats:
        quarantined.update(r["quarantined"])
    records = {"read": sum(r["read"] for r in stats), "kept": rows,
               "quarantined": dict(sorted(quarantined.items())),
               "dropped": {"empty": sum(r["empty"] for r in stats)},
               "first_bad": next((r["first_bad"] for r in stats if r["first_bad"]), None)}
    check_bad_records(source, records)
    marker = {
        "source": source.name, "fingerprint": task["fingerprint"],
        "fingerprint_inputs": task["fingerprint_inputs"], "rows": rows,
        "chars": sum(r["chars"] for r in stats), "records": records,
        "files": [{"input": str(p), "output": f"{i:05d}.parquet", "rows": r["rows"], "max_chars": r["max_chars"]}
                  for i, (p, r) in enumerate(zip(task["paths"], stats))],
    }
    layout.commit_work_dir(task["work"], task["final"], marker)
    note = "  WARNING: no rows" if rows == 0 else ""
    print(f"[staging] {source.name}: {count} files -> {rows} documents{note}; "
          f"{records_line(records, task['quarantine'])}", flush=True)
    return marker


def staged_file_stats(path: Path) -> dict:
    """A committed staged file's counts (rows, chars, max_chars, read, empty, quarantined, first_bad), from its
    parquet footer."""
    return json.loads(pq.read_metadata(path).metadata[STATS_KEY])


def run_staging(files: list[dict], todo: list[int], results: dict[int, dict]) -> None:
    """Stage the input files `todo` (indexes into `files`) on Ray Data, one task per file (`stage_file`), putting
    each one's counts in `results` (a file committed by a task of a dataset that a killed worker stopped has none:
    the driver reads its counts from its footer, commit_finished). A killed worker: the files not yet committed
    run again with twice the memory (execution.rerun_killed); an error of the project's own (DataError: a bad
    record beyond max_bad_records, an unreadable file) is raised as itself."""

    def run(units: list[int], declared: list[int | None]) -> None:
        classes: dict[int | None, list[int]] = {}
        for unit in units:
            classes.setdefault(declared[unit], []).append(todo[unit])
        for memory, members in sorted(classes.items(), key=lambda kv: kv[0] or 0):  # one dataset per declaration
            results.update(run_unit_tasks("staging", members, functools.partial(stage_file, files=files), memory,
                                          files=lambda i: [files[i]["path"]]))

    def unfinished(units: list[int]) -> list[int]:  # a staged file is in its work directory or, once the driver
        # committed its source (while the stopped dataset ran), in the source's directory
        return [u for u in units if not any(Path(files[todo[u]][at]).exists() for at in ("output", "committed"))]

    own = None
    try:
        rerun_killed(run, [None] * len(todo), name="staging", unfinished=unfinished)
    except Exception as err:
        own = original_error(err, (DataError,))
        if own is err:
            raise
    if own is not None:  # raised here, not in the handler: Ray's error (and the dataset it holds) can be collected
        raise DataError(RAY_DATA_RETRY_HINT.split(str(own))[0])


RAY_DATA_RETRY_HINT = re.compile(r"\nFailed to .* after \d+/\d+ attempts")
"""Where Ray Data's retry hint begins, which it appends to the message of an error raised in a task; the
project's message (one line naming the file and record) is what comes before it."""


def stage_file(index: int, files: list[dict]) -> tuple[int, dict]:
    """One task of the stage: input file `files[index]` read batch by batch (formatting.read_batches), each batch
    formatted and written as it comes (StagedFile), the staged file and its quarantine file committed at its end.
    Returns (index, its counts)."""
    unit = files[index]
    staged = StagedFile(unit)
    for raw in read_batches(unit["path"], unit["source"]):
        staged.add(format_batch(raw, unit["path"], unit["source"]))
    return index, staged.commit()


def quarantine_entry(record: BadRecord) -> dict:
    """A bad record as its line in the quarantine file."""
    return {"file": record.file, record.unit: record.number, "reason": record.reason, "detail": record.detail,
            "record": record.record}


class StagedFile:
    """One input file's staged parquet (under a temp name until committed) and quarantine file, written batch by
    batch from its formatted records: one row group per batch that has documents, `doc_id` = index * 2^32 + row.
    The documents stay Arrow arrays from the formatter to the parquet writer (no Python string per document:
    that conversion and back cost the writer a third of its time)."""

    def __init__(self, unit: dict):
        self.unit, self.source = unit, unit["source"]
        self.output = Path(unit["output"])
        self.tmp = layout.temp_path(self.output)
        self.writer = pq.ParquetWriter(self.tmp, STAGING_SCHEMA)
        self.rows = self.chars = self.max_chars = self.read = self.empty = 0
        self.bad: list[BadRecord] = []

    def add(self, formatted: FormattedBatch) -> None:
        """One batch's records (a null text: a bad record), written as one row group. More bad records than
        `max_bad_records` allows as a count fail the file, naming the first one beyond it."""
        self.read += len(formatted.texts)
        self.bad += formatted.bad
        limit = self.source.max_bad_records
        if is_count(limit) and len(self.bad) > limit:  # broken within this file
            raise DataError(bad_record_error(self.source, self.bad[int(limit)]))
        lengths = pc.fill_null(pc.utf8_length(formatted.texts), -1)  # null: a bad record
        self.empty += int(pc.sum(pc.equal(lengths, 0)).as_py() or 0)
        texts = formatted.texts.filter(pc.greater(lengths, 0))
        if not len(texts):
            return
        first = (self.unit["index"] << 32) + self.rows
        self.writer.write_table(pa.table({
            "text": texts,
            "source": pa.array([self.source.name] * len(texts), pa.string()),
            "doc_id": pa.array(np.arange(first, first + len(texts)), pa.int64()),
        }, schema=STAGING_SCHEMA))
        lengths = pc.utf8_length(texts)
        self.rows += len(texts)
        self.chars += int(pc.sum(lengths).as_py())
        self.max_chars = max(self.max_chars, int(pc.max(lengths).as_py()))

    def commit(self) -> dict:
        """Finish the file and commit its quarantine file (first) and its staged parquet; returns its counts."""
        bad = self.bad
        stats = {"rows": self.rows, "chars": self.chars, "max_chars": self.max_chars, "read": self.read,
                 "empty": self.empty, "quarantined": dict(sorted(collections.Counter(r.reason for r in bad).items())),
                 "first_bad": f"{bad[0].where}: {bad[0].reason}: {bad[0].detail}" if bad else None}
        self.writer.add_key_value_metadata({STATS_KEY: json.dumps(stats)})
        self.writer.close()
        if bad:
            quarantine = Path(self.unit["quarantine"])
            quarantine.parent.mkdir(parents=True, exist_ok=True)
            quarantine_tmp = layout.temp_path(quarantine)
            quarantine_tmp.write_text("".join(json.dumps(quarantine_entry(r), ensure_ascii=False) + "\n"
                                              for r in bad))
            layout.commit_file(quarantine_tmp, quarantine)
        layout.commit_file(self.tmp, self.output)
        return stats


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

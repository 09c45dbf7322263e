"""The filter stage: staged documents -> `filtered/`, without contaminated documents and exact duplicates.

Runs between staging and tokenize + pack when the data config sets `decontaminate.mode` (drop, report) or
`dedup: exact`; the pack stage then reads `filtered/<source>/NNNNN.parquet` (same columns and doc_ids as the
staged files, so a document left out here never reaches packing, and the rest pack exactly as before). Three Ray
Data operators over every source with weight > 0 (huginn_ray/data/execution.py):

1. `doc_scan`, one task per staged file: each document's content hash (huginn_ray/data/doc_dedup.py) and its
   first n-gram found in the evaluation sets (huginn_ray/data/decontaminate.py; the set reaches the tasks
   through Ray's object store, put there once by the driver); `scan/FFFFFF.npy` (hashes sorted) and
   `scan/FFFFFF.json` (matches), F = the file's ordinal in source-list, file order;
2. `doc_dedup` (dedup: exact), one task per hash bucket of about `DOCS_PER_BUCKET` documents: the keys of the
   documents whose content occurred at a smaller key, `dups/BBBBB.npy`;
3. `doc_filter`, one task per staged file: the file without its dropped rows (rewritten), or a hard link to the
   staged file when none is dropped (a copy where a link cannot be made).

Resumable like the other stages: everything is written into `filtered.partial/`, keyed by the stage's
fingerprint (the staged sources, the settings, the n-gram set's digest), each file committed on its own and kept
by a rerun; the intermediate `scan/` and `dups/` are removed before the commit. `filtered/ngrams.{npy,json}` is the
n-gram set, `filtered/decontamination.jsonl` lists every document with a match (dropped or, with mode report,
kept): source, input file, doc_id, the matched n-gram, the evaluation item.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.decontaminate import NgramSet, document_words, first_match, save_ngram_set
from huginn_ray.data.doc_dedup import (bucket_bounds, bucket_duplicates, duplicate_rows, hash_table,
                                       merge_hash_tables)
from huginn_ray.data.execution import run_tasks
from huginn_ray.data.sources import Source
from huginn_ray.data.staging import STAGING_SCHEMA
from huginn_ray.data.staging import STATS_KEY as STAGING_STATS_KEY

FILTER_VERSION = 1
DOCS_PER_BUCKET = 1 << 24
"""Documents one dedup task sorts (16 M: 256 MiB of (hash, key) pairs, ~3x that while sorting)."""
READ_BATCH_ROWS = 4096
"""Staged documents a scan or filter task holds at a time (the files are read in batches of this many)."""
STATS_KEY = b"huginn_ray.filter"  # a rewritten file's row and character counts, in its parquet footer
REPORT = "decontamination.jsonl"


def filter_fingerprint(sources: list[Source], staging_markers: dict[str, dict], mode: str, ngram: int,
                       ngram_digest: str | None, dedup: str) -> str:
    return layout.fingerprint({
        "version": FILTER_VERSION, "decontaminate": [mode, ngram, ngram_digest], "dedup": dedup,
        "sources": [(s.name, staging_markers[s.name]["fingerprint"]) for s in sources if s.weight > 0]})


def scan_file(ordinal: int, path: str, chat: bool, *, ngrams, lengths: tuple[int, ...], scan_dir: str) -> dict:
    """Ray task: the content hashes (sorted) and the n-gram matches of one staged file."""
    table_path = Path(scan_dir) / f"{ordinal:06d}.npy"
    matches_path = table_path.with_suffix(".json")
    if table_path.exists():  # committed by an earlier, interrupted run (its matches were committed first)
        return {"matches": json.loads(matches_path.read_text())}
    import ray

    hashes, items = ray.get(ngrams) if ngrams is not None else (np.zeros(0, np.uint64), None)
    matches, content, row = [], [], 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=READ_BATCH_ROWS, columns=["text", "doc_id"]):
        texts = batch.column("text").to_pylist()
        content.append(hash_table(texts))
        if len(hashes):
            for text, doc_id in zip(texts, batch.column("doc_id").to_pylist()):
                match = first_match(document_words(text, chat), hashes, items, lengths)
                if match is not None:
                    matches.append({"row": row, "doc_id": doc_id, "gram": match.gram, "item": match.item})
                row += 1
        else:
            row += len(texts)
    tmp = layout.temp_path(matches_path)
    tmp.write_text(json.dumps(matches))
    layout.commit_file(tmp, matches_path)
    tmp = layout.temp_path(table_path)
    with open(tmp, "wb") as f:
        np.save(f, merge_hash_tables(content))
    layout.commit_file(tmp, table_path)
    return {"matches": matches}


def dedup_bucket(bucket: int, lo: int, hi: int, *, tables: list[str], out_dir: str) -> int:
    """Ray task: the duplicates of one hash bucket, `dups/BBBBB.npy`; returns how many."""
    out = Path(out_dir) / f"{bucket:05d}.npy"
    if not out.exists():
        tmp = layout.temp_path(out)
        with open(tmp, "wb") as f:
            np.save(f, bucket_duplicates(tables, lo, hi))
        layout.commit_file(tmp, out)
    return int(np.load(out, mmap_mode="r").shape[0])


def filter_file(ordinal: int, staged: str, out: str, drop_rows: list[int], *, duplicate_files: list[str]) -> dict:
    """Ray task: one staged file without `drop_rows` (contaminated) and its exact duplicates; returns the kept
    rows, characters and longest document's characters, and the duplicates dropped (not counting rows also in
    drop_rows)."""
    duplicates = duplicate_rows(duplicate_files, ordinal)
    contaminated = np.asarray(drop_rows, np.int64)
    out_path = Path(out)
    duplicates_dropped = int(len(np.setdiff1d(duplicates, contaminated)))
    if not out_path.exists():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = layout.temp_path(out_path)
        if len(duplicates) + len(contaminated) == 0:
            try:
                os.link(staged, tmp)
            except OSError:  # another file system, or links not supported
                shutil.copyfile(staged, tmp)
        else:
            source = pq.ParquetFile(staged)
            keep = np.ones(source.metadata.num_rows, bool)
            keep[np.union1d(duplicates, contaminated)] = False
            rows = chars = max_chars = start = 0
            with pq.ParquetWriter(tmp, STAGING_SCHEMA) as writer:
                for batch in source.iter_batches(batch_size=READ_BATCH_ROWS):
                    kept = batch.filter(pa.array(keep[start:start + batch.num_rows]))
                    start += batch.num_rows
                    if kept.num_rows:
                        writer.write_batch(kept)
                        rows += kept.num_rows
                        lengths = pc.utf8_length(kept.column("text"))
                        chars += int(pc.sum(lengths).as_py() or 0)
                        max_chars = max(max_chars, int(pc.max(lengths).as_py() or 0))
                writer.add_key_value_metadata({STATS_KEY: json.dumps({"rows": rows, "chars": chars,
                                                                      "max_chars": max_chars})})
        layout.commit_file(tmp, out_path)
    metadata = pq.read_metadata(out_path).metadata or {}
    stats = json.loads(metadata.get(STATS_KEY) or metadata[STAGING_STATS_KEY])
    return {"rows": stats["rows"], "chars": stats["chars"], "max_chars": stats["max_chars"],
            "duplicates_dropped": duplicates_dropped}


def run_filter(sources: list[Source], markers: dict[str, dict], staging_root: Path, out_root: Path, *,
               mode: str, ngrams: NgramSet | None, dedup: str, fingerprint: str) -> dict:
    """Filter every source with weight > 0 into `out_root` (skipped when complete); returns the stage's marker:
    per source the staging marker's shape (`rows`, `chars`, `files`, a `fingerprint` of its own) and the counts
    `decontaminated` ({dropped: n} or {reported: n}) and `exact_duplicates_dropped`."""
    import ray

    layout.finish_commit(out_root)
    if layout.is_complete(out_root, fingerprint):
        marker = layout.read_marker(out_root)
        print(f"[filter] complete ({sum(s['rows'] for s in marker['sources'].values())} documents), skipped",
              flush=True)
        return marker
    files = [(source, f) for source in sources if source.weight > 0 for f in markers[source.name]["files"]]
    work = layout.resumable_work_dir(out_root, fingerprint, "filter", "filtered files", len(files))
    scan_dir, dups_dir = work / "scan", work / "dups"
    scan_dir.mkdir(exist_ok=True)
    dups_dir.mkdir(exist_ok=True)
    if ngrams is not None:
        save_ngram_set(ngrams, work)
    ref = ray.put((ngrams.hashes, ngrams.items)) if ngrams is not None else None
    scans = run_tasks(scan_file, [(i, str(staging_root / s.name / f["output"]), s.is_chat or s.needs_chat_templating)
                                  for i, (s, f) in enumerate(files)], name="doc_scan",
                      common={"ngrams": ref, "lengths": ngrams.lengths if ngrams else (), "scan_dir": str(scan_dir)})
    duplicate_files: list[str] = []
    if dedup == "exact" and files:
        total = sum(f["rows"] for _, f in files)
        buckets = bucket_bounds(max(1, -(-total // DOCS_PER_BUCKET)))
        tables = [str(scan_dir / f"{i:06d}.npy") for i in range(len(files))]
        run_tasks(dedup_bucket, [(b, lo, hi) for b, (lo, hi) in enumerate(buckets)], name="doc_dedup",
                  common={"tables": tables, "out_dir": str(dups_dir)},
                  memory=int(256 * 2**20 + 48 * total / len(buckets)))
        duplicate_files = [str(dups_dir / f"{b:05d}.npy") for b in range(len(buckets))]
    dropping = mode == "drop"
    results = run_tasks(filter_file, [
        (i, str(staging_root / s.name / f["output"]), str(work / s.name / f["output"]),
         [m["row"] for m in scan["matches"]] if dropping else [])
        for i, ((s, f), scan) in enumerate(zip(files, scans))], name="doc_filter",
        common={"duplicate_files": duplicate_files})

    per_source: dict[str, dict] = {}
    report = []
    for source in sources:
        if source.weight > 0:
            per_source[source.name] = {"fingerprint": layout.fingerprint([fingerprint, source.name]), "rows": 0,
                                       "chars": 0, "files": [], "documents_in": 0, "exact_duplicates_dropped": 0,
                                       "decontaminated": {}}
    for (source, f), scan, result in zip(files, scans, results):
        entry = per_source[source.name]
        entry["rows"] += result["rows"]
        entry["chars"] += result["chars"]
        entry["documents_in"] += f["rows"]
        entry["exact_duplicates_dropped"] += result["duplicates_dropped"]
        entry["files"].append({"input": f["input"], "output": f["output"], "rows": result["rows"],
                               "max_chars": result["max_chars"]})
        report += [{"source": source.name, "file": f["input"], "doc_id": m["doc_id"], "gram": m["gram"],
                    "item": ngrams.sources[m["item"]], "dropped": dropping} for m in scan["matches"]]
    for source in sources:
        if source.weight > 0 and mode != "none":
            matched = sum(1 for r in report if r["source"] == source.name)
            per_source[source.name]["decontaminated"] = {"dropped" if dropping else "reported": matched}
    if ngrams is not None:
        tmp = layout.temp_path(work / REPORT)
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in report))
        layout.commit_file(tmp, work / REPORT)
    shutil.rmtree(scan_dir)
    shutil.rmtree(dups_dir)
    marker = {"fingerprint": fingerprint, "decontaminate": mode, "dedup": dedup,
              "ngram_set": None if ngrams is None else {"n": ngrams.n, "grams": len(ngrams.hashes),
                                                        "digest": ngrams.digest},
              "sources": per_source}
    layout.commit_work_dir(work, out_root, marker)
    for name, entry in per_source.items():
        decon = entry["decontaminated"]
        what = ", ".join(f"{n} {k}" for k, n in decon.items())
        print(f"[filter] {name}: {entry['documents_in']} documents -> {entry['rows']} kept; decontaminated: "
              f"{what or 'off'}; exact duplicates dropped: {entry['exact_duplicates_dropped']}"
              f"{'' if dedup == 'exact' else ' (dedup off)'}", flush=True)
    if report:
        print(f"[filter] {len(report)} documents share an n-gram with the evaluation sets: {out_root / REPORT}",
              flush=True)
    return marker


def filter_counts(marker: dict) -> dict[str, dict]:
    """The manifest's `document_filters`: per source `decontaminated` and `exact_duplicates_dropped`."""
    return {name: {"decontaminated": entry["decontaminated"],
                   "exact_duplicates_dropped": entry["exact_duplicates_dropped"]}
            for name, entry in marker["sources"].items()}

"""The filter stage: staged documents -> `filtered/`, without contaminated documents and exact (and near) duplicates.

Runs between staging and tokenize + pack when the data config sets `decontaminate.mode` (drop, report) or
`dedup` (exact; near: exact, then the MinHash LSH steps of huginn_ray/data/doc_near_dedup.py); the pack stage then reads `filtered/<source>/NNNNN.parquet` (same columns and doc_ids as the
staged files, so a document left out here never reaches packing, and the rest pack exactly as before). Three Ray
Data datasets over every source with weight > 0, the records flowing from a read to a write:

1. `doc_scan`: the staged documents read by scan unit (a staged file, or a run of `scan_unit_docs` documents of a
   large one: huginn_ray/data/tokenize_pack.py `staged_documents`) -> `scan_documents` (the evaluation n-gram set
   loaded from `ngrams.npy` by each call): each document's content hash (huginn_ray/data/doc_dedup.py) and its
   first n-gram found in the evaluation sets (huginn_ray/data/decontaminate.py) -> the `scan_tables` write, per
   unit `scan/FFFFFF-RRRRRRRRRR.npy` ((hash, row) sorted) and `.json` (matches), F = the file's ordinal in
   source-list, file order, R its first row. Read, map and write are fused into one Ray task per read of scan
   units: the documents never cross the object store, and the stage starts no actor (an actor pool's start, a
   process importing Ray Data and the project, cost 2.5-3 s per filter run on the 2-core machine, more than
   loading the n-gram set in every task);
2. `doc_dedup` (dedup: exact): per hash bucket of about `DOCS_PER_BUCKET` documents, one record holding the
   bucket's (hash, key) entries read from every unit's table (`bucket_hashes`) -> `find_duplicates` -> the
   `duplicate_keys` write: the keys of the documents whose content occurred at a smaller key, `dups/BBBBB.npy`.
   Read, map and write are fused into one Ray task per bucket, which declares the bucket's memory: the entries
   never cross the object store;
3. `doc_filter`: the driver hard-links each staged file that loses no document (a copy where a link cannot be
   made); every other file is read (`documents_to_filter`: its documents, each marked dropped or kept) and written
   without its dropped documents by the `filtered_files` write, fused into one task per file, in row groups of
   the kept documents of each batch of `READ_BATCH_ROWS` read.

Ray Data streams the records between the operators with its backpressure and shows each operator's progress in
records (documents, buckets); progress bars are off under `prepare_data.py --quiet`. A worker killed (by Ray's
memory monitor, the kernel's OOM killer, a node lost) reruns the units that had not committed their files, each
with twice its memory (huginn_ray/data/execution.py `rerun_killed`; tasks are not retried); an error of this project's (a staged file that no longer matches its marker) fails the stage as that
exception, naming the file.

Resumable like the other stages: everything is written into `filtered.partial/`, keyed by the stage's
fingerprint (the staged sources, the settings, the n-gram set's digest), each file committed on its own and kept
by a rerun (a scan unit, a bucket, a filtered file whose file exists is not run again); the intermediate `scan/`
and `dups/` are removed before the commit. `filtered/ngrams.{npy,json}` is the n-gram set,
`filtered/decontamination.jsonl` lists every document with a match (dropped or, with mode report, kept): source,
input file, doc_id, the matched n-gram, the evaluation item.

Costs besides the scan's CPU: the driver reads every scan unit's matches (a small .json each), the duplicate keys
once (one bucket's at a time, to count each file's duplicates) and every filtered file's parquet footer.
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
from huginn_ray.data.decontaminate import (NgramSet, decontamination_counts, document_words, first_match,
                                           guard_common_grams, save_ngram_set)
from huginn_ray.data.doc_dedup import (DOCS_PER_BUCKET, bucket_bounds, bucket_entries, content_hashes,
                                       duplicate_counts, duplicate_keys, duplicate_rows, hash_table)
from huginn_ray.data.doc_near_dedup import (NEAR_REPORT, SignatureFiles, find_near_pairs, near_bucket_count,
                                            near_bucket_memory, near_columns, near_drops, near_pairs_files,
                                            near_pairs_report, write_near_report, write_near_tables)
from huginn_ray.data.execution import (block_size, declared_memory, node_memory_cap, quiet_remote_args, rerun_killed,
                                        table_sink, task_args, unit_reads)
from huginn_ray.data.filter_counts import print_counts
from huginn_ray.data.formatting import DataError
from huginn_ray.data.near_dedup import MinHashParams
from huginn_ray.data.sources import Source
from huginn_ray.data.staging import STAGING_SCHEMA
from huginn_ray.data.staging import STATS_KEY as STAGING_STATS_KEY
from huginn_ray.data.tokenize_pack import BATCH, staged_documents, whole_batches

FILTER_VERSION = 1
SCAN_UNIT_DOCS = 1 << 16
SCAN_UNIT_CHARS = 1 << 24
"""A scan unit (one block from the read to the write) holds at most SCAN_UNIT_DOCS documents and, at its
source's mean document size, SCAN_UNIT_CHARS characters (16 Mi: about 16-64 MiB of text as Arrow and Python
strings in a task, about a second of scanning); a smaller staged file is one unit. Units this size spread a
large staged file over every CPU's scan tasks (a 64 MiB staged file is four units, not one on one CPU)."""
READ_BATCH_ROWS = 4096
"""Staged documents `doc_filter` reads at a time; a rewritten file has one row group per batch read (its kept
documents)."""
STATS_KEY = b"huginn_ray.filter"  # a rewritten file's row and character counts, in its parquet footer
REPORT = "decontamination.jsonl"
FILE = "file"
"""The column that names a record's staged file ({"out": path, "rows": n} as JSON) from doc_filter's read to its
write."""


def filter_fingerprint(sources: list[Source], staging_markers: dict[str, dict], mode: str, ngram: int,
                       ngram_digest: str | None, dedup: str, near: dict | None = None) -> str:
    """`near`: the near_dedup settings (shingle, threshold, bands, rows, seed) with dedup near."""
    return layout.fingerprint({
        "version": FILTER_VERSION, "decontaminate": [mode, ngram, ngram_digest],
        "dedup": dedup if near is None else [dedup, near],
        "sources": [(s.name, staging_markers[s.name]["fingerprint"]) for s in sources if s.weight > 0]})


# --- doc_scan -----------------------------------------------------------------------------------------------

def scan_units(files: list[tuple[Source, dict]], markers: dict[str, dict], staging_root: Path) -> list[dict]:
    """Every scan unit, in key order: (staged file ordinal, first row, documents, their estimated characters),
    named `FFFFFF-RRRRRRRRRR`."""
    units = []
    for ordinal, (source, f) in enumerate(files):
        mean_chars = markers[source.name]["chars"] / max(1, markers[source.name]["rows"])
        docs = max(1, min(SCAN_UNIT_DOCS, int(SCAN_UNIT_CHARS // max(1.0, mean_chars))))
        for start in range(0, f["rows"], docs):
            count = min(docs, f["rows"] - start)
            units.append({"name": f"{ordinal:06d}-{start:010d}", "file": ordinal, "source": source.name,
                          "path": str(staging_root / source.name / f["output"]), "start": start, "count": count,
                          "chars": count * mean_chars, "chat": source.is_chat or source.needs_chat_templating})
    return units


def scan_reads(units: list[dict]) -> list[list[dict]]:
    """The units in read tasks: consecutive units together while they hold at most SCAN_UNIT_DOCS documents and
    SCAN_UNIT_CHARS characters (a unit alone when larger), so that small files do not each cost a read task, an
    actor call and a write task."""
    reads: list[list[dict]] = []
    for unit in units:
        if (reads and sum(u["count"] for u in reads[-1]) + unit["count"] <= SCAN_UNIT_DOCS
                and sum(u["chars"] for u in reads[-1]) + unit["chars"] <= SCAN_UNIT_CHARS):
            reads[-1].append(unit)
        else:
            reads.append([unit])
    return reads


def scan_documents(table: pa.Table, ngram_file: str | None, lengths: tuple[int, ...],
                   near: dict | None = None) -> pa.Table:
    """doc_scan's map, a function on tasks: one call = one block of whole scan units: per document its content
    hash and, when the set is not empty, its first gram found in the set (`gram`, `item`; null when none); with
    `near` (the near_dedup settings) its MinHash signature and band keys."""
    if ngram_file is None:
        hashes, items = np.zeros(0, np.uint64), np.zeros(0, np.uint32)
    else:
        grams = np.load(ngram_file)  # save_ngram_set: (hash, item) per gram, sorted by hash
        hashes, items = np.ascontiguousarray(grams[:, 0]), grams[:, 1].astype(np.uint32)
        del grams
    params = None if near is None else MinHashParams.make(near["shingle"], near["bands"], near["rows"], near["seed"])
    return pa.concat_tables([scan_unit(unit, records, hashes, items, tuple(lengths), params)
                             for unit, records in whole_batches(table)])


def scan_unit(unit: dict, records: pa.Table, hashes: np.ndarray, items: np.ndarray, lengths: tuple[int, ...],
              near: MinHashParams | None) -> pa.Table:
    texts = records.column("text").to_pylist()
    grams, matched_items = [None] * len(texts), [None] * len(texts)
    if len(hashes):
        for i, text in enumerate(texts):
            match = first_match(document_words(text, unit["chat"]), hashes, items, lengths)
            if match is not None:
                grams[i], matched_items[i] = match.gram, match.item
    near_cols = {} if near is None else near_columns(texts, near)
    return pa.table({"hash": pa.array(content_hashes(texts), pa.uint64()), "doc_id": records.column("doc_id"),
                     "gram": pa.array(grams, pa.string()), "item": pa.array(matched_items, pa.int64()), **near_cols,
                     BATCH: records.column(BATCH)})


def write_scan(unit: dict, records: pa.Table, scan_dir: str) -> None:
    """One scan unit's results, committed: with near dedup its signatures and band table (write_near_tables), its
    matches (`.json`, rows counted from the file's first row), then its (hash, row) table (`.npy`: the unit is
    done when it exists)."""
    table_path = Path(scan_dir) / f"{unit['name']}.npy"
    if "signature" in records.column_names:
        write_near_tables(records, table_path.with_suffix(""), unit["start"])
    matched = np.flatnonzero(records.column("gram").is_valid().to_numpy(zero_copy_only=False))
    doc_ids, grams, items = (records.column(c).take(matched).to_pylist() for c in ("doc_id", "gram", "item"))
    matches = [{"row": unit["start"] + int(i), "doc_id": d, "gram": g, "item": it}
               for i, d, g, it in zip(matched, doc_ids, grams, items)]
    matches_path = table_path.with_suffix(".json")
    tmp = layout.temp_path(matches_path)
    tmp.write_text(json.dumps(matches))
    layout.commit_file(tmp, matches_path)
    hashes = records.column("hash").to_numpy()
    tmp = layout.temp_path(table_path)
    with open(tmp, "wb") as f:
        np.save(f, hash_table(hashes, unit["start"]))
    layout.commit_file(tmp, table_path)


def scan_tables(scan_dir: str):
    """doc_scan's write: a Ray Data datasink that commits each scan unit of its blocks (write_scan)."""

    def write(tables) -> None:
        for table in tables:
            for unit, records in whole_batches(table):
                write_scan(unit, records, scan_dir)

    return table_sink("scan_tables", write)


def run_scan(units: list[dict], scan_dir: Path, ngram_file: Path | None, lengths: tuple[int, ...],
             near: dict | None) -> None:
    """doc_scan over the units whose table is not committed yet (with `near`, the near_dedup settings, their
    signatures too)."""
    import ray.data

    def done(i: int) -> bool:
        return (scan_dir / f"{units[i]['name']}.npy").exists()

    scanner = {"ngram_file": None if ngram_file is None else str(ngram_file), "lengths": lengths, "near": near}

    def run(todo: list[int], declared: list[int | None]) -> None:
        classes: dict[int | None, list[dict]] = {}
        for i in todo:
            if not done(i):
                classes.setdefault(declared[i], []).append(units[i])
        for memory, members in sorted(classes.items(), key=lambda kv: kv[0] or 0):  # one dataset per declaration
            reads, remote = scan_reads(members), task_args(memory)
            with quiet_remote_args():
                # one read task and one block per read (whole units); read, map and write carry the same remote
                # args, so that Ray Data fuses them into one task per read
                ray.data.read_datasource(staged_documents(reads), override_num_blocks=len(reads),
                                         ray_remote_args=remote).map_batches(
                    scan_documents, fn_kwargs=scanner, batch_size=None, batch_format="pyarrow", **remote
                ).write_datasink(scan_tables(str(scan_dir)), ray_remote_args=remote)

    with block_size(None):
        rerun_killed(run, [None] * len(units), name="doc_scan",
                     unfinished=lambda todo: [i for i in todo if not done(i)])


# --- doc_dedup ----------------------------------------------------------------------------------------------

def _values(column: pa.ChunkedArray, row: int) -> np.ndarray:
    """Row `row` of a list<uint64> column as an array."""
    return column[row].values.to_numpy(zero_copy_only=False)


def _one_list(values: np.ndarray) -> pa.LargeListArray:
    return pa.LargeListArray.from_arrays(pa.array([0, len(values)], pa.int64()), pa.array(values, pa.uint64()))


def read_bucket(bucket: int, lo: int, hi: int, tables: list[tuple[int, str]]) -> list[pa.Table]:
    """One bucket's record: its number and the (hash, key) of every document whose hash is in [lo, hi)."""
    hashes, keys = bucket_entries(tables, lo, hi)
    return [pa.table({"bucket": [bucket], "hashes": _one_list(hashes), "keys": _one_list(keys)})]


def bucket_hashes(buckets: list[tuple[int, int, int]], tables: list[tuple[int, str]]):
    """doc_dedup's read: a Ray Data datasource of one record per (bucket, lo, hi), read from the scan tables."""
    return unit_reads("bucket_hashes", buckets, lambda bucket: read_bucket(*bucket, tables), rows=lambda bucket: 1)


def find_duplicates(table: pa.Table) -> pa.Table:
    """doc_dedup's map: per bucket record, the keys (sorted) of its documents whose content occurred at a smaller
    key."""
    found = [duplicate_keys(_values(table.column("hashes"), i), _values(table.column("keys"), i))
             for i in range(table.num_rows)]
    return pa.table({"bucket": table.column("bucket"),
                     "duplicates": pa.concat_arrays([_one_list(keys) for keys in found])})


def duplicate_keys_files(dups_dir: str):
    """doc_dedup's write: a Ray Data datasink that commits each bucket's duplicate keys, `BBBBB.npy`."""

    def write(tables) -> None:
        for table in tables:
            for i in range(table.num_rows):
                out = Path(dups_dir) / f"{table.column('bucket')[i].as_py():05d}.npy"
                tmp = layout.temp_path(out)
                with open(tmp, "wb") as f:
                    np.save(f, _values(table.column("duplicates"), i))
                layout.commit_file(tmp, out)

    return table_sink("duplicate_keys", write)


def run_dedup(tables: list[tuple[int, str]], documents: int, dups_dir: Path, near: tuple | None = None) -> list[str]:
    """doc_dedup over the buckets whose keys are not committed yet; returns every bucket's file. With `near`
    (bands, threshold, SignatureFiles) the pass is doc_near_pairs: `tables` are band tables, each bucket's output
    its similar pairs (huginn_ray/data/doc_near_dedup.py)."""
    import ray.data

    if near is None:
        count, name = max(1, -(-documents // DOCS_PER_BUCKET)), "doc_dedup"
        estimate = int(256 * 2**20 + 48 * documents / count)  # the (hash, key) pairs, x 3 while sorting
        find, find_args, sink = find_duplicates, {}, duplicate_keys_files(str(dups_dir))
    else:
        bands, threshold, signatures = near
        count, estimate, name = near_bucket_count(documents, bands), near_bucket_memory(documents, bands), "near_pairs"
        find, find_args = find_near_pairs, {"signatures": signatures, "threshold": threshold}
        sink = near_pairs_files(str(dups_dir))
    buckets = bucket_bounds(count)
    files = [dups_dir / f"{b:05d}.npy" for b in range(len(buckets))]
    cap = node_memory_cap()

    def run(todo: list[int], declared: list[int | None]) -> None:
        classes: dict[int | None, list[tuple[int, int, int]]] = {}
        for b in todo:
            if not files[b].exists():
                classes.setdefault(declared[b], []).append((b, *buckets[b]))
        for memory, members in sorted(classes.items(), key=lambda kv: kv[0] or 0):
            # the same remote args on the read, the map and the write: Ray Data fuses them into one task per
            # bucket, which holds the bucket's entries (never in the object store) and declares their memory
            task = {"num_cpus": 1, "memory": memory, "max_retries": 0}
            with quiet_remote_args():
                ray.data.read_datasource(bucket_hashes(members, tables), override_num_blocks=len(members),
                                         ray_remote_args=task).map_batches(
                    find, fn_kwargs=find_args, batch_size=None, batch_format="pyarrow", **task).write_datasink(
                    sink, ray_remote_args=task)

    with block_size(None):
        rerun_killed(run, [declared_memory(estimate, cap)] * len(buckets), name=name,
                     unfinished=lambda todo: [b for b in todo if not files[b].exists()])
    return [str(f) for f in files]


# --- doc_filter ---------------------------------------------------------------------------------------------

def read_documents_to_filter(file: dict, duplicate_files: list[str], batch_rows: int):
    """A staged file's documents in batches of `batch_rows`, each with its `row`, the batch it was read in, whether
    it is `dropped` (contaminated, `file["contaminated"]`, or a duplicate) and its FILE."""
    source = pq.ParquetFile(file["staged"])
    if source.metadata.num_rows != file["rows"]:
        raise DataError(f"source {file['source']!r}: {file['staged']} holds {source.metadata.num_rows} documents, "
                        f"its staging marker {file['rows']}: staged again since the filter stage began; rerun the "
                        "staging stage")
    dropped = np.zeros(file["rows"], bool)
    dropped[np.union1d(duplicate_rows(duplicate_files, file["ordinal"]),
                       np.asarray(file["contaminated"], np.int64))] = True
    name = json.dumps({"out": file["out"], "rows": file["rows"]})
    start = 0
    for index, batch in enumerate(source.iter_batches(batch_size=batch_rows)):
        n = batch.num_rows
        table = pa.Table.from_batches([batch])
        for column, values in (("row", pa.array(np.arange(start, start + n))),
                               ("read_batch", pa.array(np.full(n, index))),
                               ("dropped", pa.array(dropped[start:start + n])), (FILE, pa.array([name] * n))):
            table = table.append_column(column, values)
        start += n
        yield table


def documents_to_filter(files: list[dict], duplicate_files: list[str]):
    """doc_filter's read: a Ray Data datasource of the documents of the staged files that lose some, one read task
    per file."""
    return unit_reads("documents_to_filter", files,
                      lambda f: read_documents_to_filter(f, duplicate_files, READ_BATCH_ROWS),
                      rows=lambda f: f["rows"], files=lambda f: [f["staged"]])


class FilteredFile:
    """One filtered file being written: the kept documents of each batch read, as one row group, in read order;
    its statistics in the footer; committed by `close` once all its `rows` documents have arrived."""

    def __init__(self, name: str):
        target = json.loads(name)
        self.name, self.out, self.rows = name, Path(target["out"]), target["rows"]
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = layout.temp_path(self.out)
        self.writer = pq.ParquetWriter(self.tmp, STAGING_SCHEMA)
        self.seen = self.kept = self.chars = self.max_chars = 0
        self.batch, self.pending = None, []

    def add(self, table: pa.Table) -> None:
        """Consecutive documents of the file (from the next row on)."""
        rows = table.column("row").to_numpy()
        if rows[0] != self.seen or rows[-1] != self.seen + len(rows) - 1:
            raise RuntimeError(f"doc_filter: {self.out}: documents from row {rows[0]} arrived after row {self.seen}")
        self.seen += len(rows)
        kept = table.filter(pc.invert(table.column("dropped")))
        for index in pc.unique(kept.column("read_batch")).to_pylist():
            if index != self.batch:
                self.flush()
                self.batch = index
            self.pending.append(kept.filter(pc.equal(kept.column("read_batch"), index)))

    def flush(self) -> None:
        if self.pending:
            kept = pa.concat_tables(self.pending).select(STAGING_SCHEMA.names).cast(STAGING_SCHEMA)
            self.writer.write_table(kept)
            lengths = pc.utf8_length(kept.column("text"))
            self.kept += kept.num_rows
            self.chars += int(pc.sum(lengths).as_py() or 0)
            self.max_chars = max(self.max_chars, int(pc.max(lengths).as_py() or 0))
        self.pending = []

    def close(self) -> None:
        if self.seen != self.rows:
            raise RuntimeError(f"doc_filter: {self.out}: {self.seen} of its {self.rows} documents arrived")
        self.flush()
        self.writer.add_key_value_metadata({STATS_KEY: json.dumps({"rows": self.kept, "chars": self.chars,
                                                                   "max_chars": self.max_chars})})
        self.writer.close()
        layout.commit_file(self.tmp, self.out)


def filtered_files():
    """doc_filter's write: a Ray Data datasink that writes each file of its blocks without its dropped documents
    (FilteredFile) and commits it."""

    def write(tables) -> None:
        current = None
        for table in tables:
            names = table.column(FILE)
            row = 0
            while row < table.num_rows:
                name = names[row].as_py()
                run = table.slice(row)
                ends = np.flatnonzero(pc.not_equal(run.column(FILE), name).to_numpy(zero_copy_only=False))
                run = run.slice(0, int(ends[0]) if len(ends) else run.num_rows)
                if current is None or current.name != name:
                    if current is not None:
                        current.close()
                    current = FilteredFile(name)
                current.add(run)
                row += run.num_rows
        if current is not None:
            current.close()

    return table_sink("filtered_files", write)


def link_staged(staged: Path, out: Path) -> None:
    """`out` as a hard link to the staged file (no byte copied), committed; a copy where a link cannot be made."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = layout.temp_path(out)
    try:
        os.link(staged, tmp)
    except OSError:  # another file system, or links not supported
        shutil.copyfile(staged, tmp)
    layout.commit_file(tmp, out)


def run_rewrite(files: list[dict], duplicate_files: list[str]) -> None:
    """doc_filter over the files that lose documents and are not committed yet."""
    import ray.data

    def done(i: int) -> bool:
        return Path(files[i]["out"]).exists()

    def run(todo: list[int], declared: list[int | None]) -> None:
        classes: dict[int | None, list[dict]] = {}
        for i in todo:
            if not done(i):
                classes.setdefault(declared[i], []).append(files[i])
        for memory, members in sorted(classes.items(), key=lambda kv: kv[0] or 0):
            # the same remote args on the read and the write: fused into one task per file (the documents never
            # cross the object store)
            task = {"num_cpus": 1, "max_retries": 0, **({"memory": memory} if memory else {})}
            with quiet_remote_args():
                ray.data.read_datasource(documents_to_filter(members, duplicate_files),
                                         override_num_blocks=len(members), ray_remote_args=task).write_datasink(
                    filtered_files(), ray_remote_args=task)

    rerun_killed(run, [None] * len(files), name="doc_filter", unfinished=lambda todo: [i for i in todo if not done(i)])


def run_near(units: list[dict], scan_dir: Path, near_dir: Path, documents: int, near: dict,
             exact_files: list[str]) -> tuple[Path, Path]:
    """Near dedup after the exact one: doc_near_pairs over the units' band tables, then the components
    (doc_near_dedup.near_drops); returns its dropped and kept keys' files."""
    (near_dir / "pairs").mkdir(parents=True, exist_ok=True)
    band_tables = [(unit["file"], str(scan_dir / f"{unit['name']}.bands.npy")) for unit in units]
    pair_files = run_dedup(band_tables, documents, near_dir / "pairs",
                           (near["bands"], near["threshold"], SignatureFiles.of(units, scan_dir)))
    return near_drops(pair_files, exact_files, near_dir)


def run_dedups(units: list[dict], scan_dir: Path, work: Path, files: list, dedup: str,
               near: dict | None) -> tuple[list[str], np.ndarray, list[str], np.ndarray]:
    """Exact dedup (and near, with `near`) over the scanned units: (the exact duplicates' key files, each staged
    file's count of them, the near duplicates' key file, each file's count of those)."""
    duplicate_files: list[str] = []
    duplicates = np.zeros(len(files), np.int64)
    near_files: list[str] = []
    near_found = np.zeros(len(files), np.int64)
    if dedup != "none" and files:
        documents = sum(f["rows"] for _, f in files)
        tables = [(unit["file"], str(scan_dir / f"{unit['name']}.npy")) for unit in units]
        duplicate_files = run_dedup(tables, documents, work / "dups")
        duplicates = duplicate_counts(duplicate_files, len(files))
        if near is not None:
            dropped_keys, _ = run_near(units, scan_dir, work / "near", documents, near, duplicate_files)
            near_files = [str(dropped_keys)]
            near_found = duplicate_counts(near_files, len(files))
    return duplicate_files, duplicates, near_files, near_found


def run_filter(sources: list[Source], markers: dict[str, dict], staging_root: Path, out_root: Path, *,
               mode: str, ngrams: NgramSet | None, dedup: str, fingerprint: str, near: dict | None = None) -> dict:
    """Filter every source with weight > 0 into `out_root` (skipped when complete); returns the stage's marker:
    per source the staging marker's shape (`rows`, `chars`, `files`, a `fingerprint` of its own) and the counts
    `decontaminated` ({dropped: n} or {reported: n}) and `exact_duplicates_dropped` (and, with dedup near and
    `near` its settings, `near_duplicates_dropped`)."""
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
    units = scan_units(files, markers, staging_root)
    run_scan(units, scan_dir, work / "ngrams.npy" if ngrams is not None else None,
             ngrams.lengths if ngrams is not None else (), near)
    matches: list[list[dict]] = [[] for _ in files]
    for unit in units:
        matches[unit["file"]] += json.loads((scan_dir / f"{unit['name']}.json").read_text())
    dropping = mode == "drop"
    # the scan was the counting pass: a gram common in a source stops a dropping run before any file is filtered
    guarded = guard_common_grams(ngrams, files, matches, dropping) if ngrams is not None else []
    duplicate_files, duplicates, near_files, near_found = run_dedups(units, scan_dir, work, files, dedup, near)
    duplicates_dropped = duplicates.copy()  # a contaminated duplicate counts as contaminated only
    near_dropped = near_found.copy()
    rewrite = []
    for i, (source, f) in enumerate(files):
        staged, out = staging_root / source.name / f["output"], work / source.name / f["output"]
        contaminated = [m["row"] for m in matches[i]] if dropping else []
        if contaminated and duplicates[i]:
            duplicates_dropped[i] -= len(np.intersect1d(duplicate_rows(duplicate_files, i), contaminated))
        if contaminated and near_found[i]:
            near_dropped[i] -= len(np.intersect1d(duplicate_rows(near_files, i), contaminated))
        if out.exists():
            continue
        if contaminated or duplicates[i] or near_found[i]:
            rewrite.append({"ordinal": i, "source": source.name, "staged": str(staged), "out": str(out),
                            "rows": f["rows"], "contaminated": contaminated})
        else:
            link_staged(staged, out)
    run_rewrite(rewrite, duplicate_files + near_files)
    results = []
    for source, f in files:
        metadata = pq.read_metadata(work / source.name / f["output"]).metadata or {}
        results.append(json.loads(metadata.get(STATS_KEY) or metadata[STAGING_STATS_KEY]))

    per_source: dict[str, dict] = {}
    report = []
    for source in sources:
        if source.weight > 0:
            per_source[source.name] = {"fingerprint": layout.fingerprint([fingerprint, source.name]), "rows": 0,
                                       "chars": 0, "files": [], "documents_in": 0, "exact_duplicates_dropped": 0,
                                       "decontaminated": {}, **({"near_duplicates_dropped": 0} if near else {})}
    for (source, f), found, result, dropped, near_count in zip(files, matches, results, duplicates_dropped,
                                                               near_dropped):
        entry = per_source[source.name]
        if near is not None:
            entry["near_duplicates_dropped"] += int(near_count)
        entry["rows"] += result["rows"]
        entry["chars"] += result["chars"]
        entry["documents_in"] += f["rows"]
        entry["exact_duplicates_dropped"] += int(dropped)
        entry["files"].append({"input": f["input"], "output": f["output"], "rows": result["rows"],
                               "max_chars": result["max_chars"]})
        report += [{"source": source.name, "file": f["input"], "doc_id": m["doc_id"], "gram": m["gram"],
                    "item": ngrams.sources[m["item"]], "dropped": dropping} for m in found]
    for source in sources:
        if source.weight > 0 and mode != "none":
            matched = sum(1 for r in report if r["source"] == source.name)
            per_source[source.name]["decontaminated"] = {"dropped" if dropping else "reported": matched}
    if ngrams is not None:
        tmp = layout.temp_path(work / REPORT)
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in report))
        layout.commit_file(tmp, work / REPORT)
    if near_files:
        write_near_report(near_pairs_report(Path(near_files[0]), work / "near" / "kept.npy", [
            {"source": source.name, "input": f["input"], "staged": str(staging_root / source.name / f["output"])}
            for source, f in files]), work / NEAR_REPORT)
        shutil.rmtree(work / "near")
    shutil.rmtree(scan_dir)
    shutil.rmtree(dups_dir)
    marker = {"fingerprint": fingerprint, "decontaminate": mode, "dedup": dedup,
              "ngram_set": None if ngrams is None else {"n": ngrams.n, "grams": len(ngrams.hashes),
                                                        "digest": ngrams.digest},
              "sources": per_source,
              "decontamination": None if ngrams is None else decontamination_counts(ngrams, report, guarded)}
    layout.commit_work_dir(work, out_root, marker)
    print_counts(per_source, report, guarded, out_root / REPORT, dedup)
    return marker

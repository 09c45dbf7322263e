"""`dedup: near` in the filter stage: the MinHash LSH steps of huginn_ray/data/near_dedup.py on its Ray Data passes.

The filter stage (huginn_ray/data/doc_filter.py) runs them after its exact dedup:

1. in `doc_scan`'s actors, `near_columns`: each document's MinHash signature and band keys, written per scan unit
   by `write_near_tables` as `scan/<unit>.sig.npy` ((documents, bands x rows) uint32) and `scan/<unit>.bands.npy`
   ((band key, row) sorted, doc_dedup.hash_table's layout), before the unit's `.npy` that says it is done;
2. `doc_near_pairs`, the exact dedup's bucket pass over the band tables instead of the hash tables (range buckets
   of band keys: the band tables of every unit read by two binary searches each, the grouping by key done by the
   sort in the bucket's task), with `find_near_pairs` as its map: the candidate pairs of each run of equal band
   keys, each checked against the threshold with the two signatures (read from the units' `.sig.npy` memory
   maps: candidates are few), the similar ones written by `near_pairs_files` as `near/BBBBB.npy`;
3. on the driver, `near_drops`: the connected components of every bucket's pairs, each component's documents but
   its first dropped, less those exact dedup drops already: `near/dropped.npy` (keys, sorted: read per file by
   doc_dedup.duplicate_rows like the exact duplicates) and `near/kept.npy` (the kept key of each), committed
   kept first; `near_pairs_report` names a sample of NEAR_SAMPLE pairs for `filtered/near_duplicates.jsonl`.

Each step's files are committed on their own, so a rerun keeps what an interrupted run finished: a unit's tables,
a bucket's pairs, the components. Costs (`near_dedup_plan`): per document 4 x bands x rows bytes of signature and
16 x bands bytes of band table; a bucket task holds its band entries like an exact bucket (DOCS_PER_BUCKET
entries, 16 bytes each, x 3 while sorting); the driver holds 16 bytes per similar pair and 8 per exact
duplicate while it finds the components.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.dedup import in_sorted, sorted_unique
from huginn_ray.data.doc_dedup import DOCS_PER_BUCKET, ROW_BITS
from huginn_ray.data.execution import table_sink
from huginn_ray.data.near_dedup import (MinHashParams, band_keys, band_table, candidate_pairs, component_drops,
                                        minhash_signatures, similar)

NEAR_SAMPLE = 1000
"""Dropped near duplicates listed, with the document each one was found near, in `near_duplicates.jsonl`."""
NEAR_REPORT = "near_duplicates.jsonl"
NPY_HEADER = 128


def near_columns(texts: list[str], params: MinHashParams) -> dict[str, pa.Array]:
    """doc_scan's near-dedup columns of a batch of documents: `signature` and `bands` (fixed-size lists) and
    `has_signature` (a document of no word has none)."""
    signatures, has = minhash_signatures(texts, params)
    keys = band_keys(signatures, params.bands, params.rows)
    return {"signature": pa.FixedSizeListArray.from_arrays(pa.array(signatures.reshape(-1)), signatures.shape[1]),
            "bands": pa.FixedSizeListArray.from_arrays(pa.array(keys.reshape(-1)), keys.shape[1]),
            "has_signature": pa.array(has)}


def _fixed(column: pa.ChunkedArray, dtype) -> np.ndarray:
    array = column.combine_chunks()
    return array.values.to_numpy(zero_copy_only=False).astype(dtype).reshape(len(array), -1)


def write_near_tables(records: pa.Table, stem: Path, first_row: int) -> None:
    """A scan unit's signatures (`<stem>.sig.npy`) and band table (`<stem>.bands.npy`), each committed."""
    signatures = _fixed(records.column("signature"), np.uint32)
    keys = _fixed(records.column("bands"), np.uint64)
    has = records.column("has_signature").to_numpy(zero_copy_only=False)
    for suffix, array in ((".sig.npy", signatures), (".bands.npy", band_table(keys, has, first_row))):
        path = stem.with_name(stem.name + suffix)
        tmp = layout.temp_path(path)
        with open(tmp, "wb") as f:
            np.save(f, array)
        layout.commit_file(tmp, path)


@dataclass(frozen=True)
class SignatureFiles:
    """Where the bucket tasks read signatures: per staged file ordinal, its scan units' first rows (ascending) and
    `.sig.npy` paths."""

    starts: dict[int, list[int]]
    paths: dict[int, list[str]]

    @classmethod
    def of(cls, units: list[dict], scan_dir: Path) -> "SignatureFiles":
        starts: dict[int, list[int]] = {}
        paths: dict[int, list[str]] = {}
        for unit in units:
            starts.setdefault(unit["file"], []).append(unit["start"])
            paths.setdefault(unit["file"], []).append(str(scan_dir / f"{unit['name']}.sig.npy"))
        return cls(starts, paths)

    def read(self, keys: np.ndarray) -> np.ndarray:
        """The signatures of the documents `keys` (rows in their order)."""
        ordinals, rows = (keys >> np.uint64(ROW_BITS)).astype(np.int64), (keys & np.uint64((1 << ROW_BITS) - 1))
        out = None
        for ordinal in np.unique(ordinals):
            here = np.flatnonzero(ordinals == ordinal)
            unit = np.searchsorted(self.starts[int(ordinal)], rows[here].astype(np.int64), side="right") - 1
            for u in np.unique(unit):
                at = here[unit == u]
                table = np.load(self.paths[int(ordinal)][u], mmap_mode="r")
                part = np.asarray(table[rows[at].astype(np.int64) - self.starts[int(ordinal)][u]])
                if out is None:
                    out = np.zeros((len(keys), table.shape[1]), np.uint32)
                out[at] = part
        return out if out is not None else np.zeros((0, 0), np.uint32)


def find_near_pairs(table: pa.Table, signatures: SignatureFiles, threshold: float) -> pa.Table:
    """doc_near_pairs' map: per bucket record (band keys as `hashes`, document keys as `keys`), the candidate pairs
    whose signatures are at least `threshold` similar, (first, other) flattened into `pairs`."""
    found = []
    for i in range(table.num_rows):
        bands = table.column("hashes")[i].values.to_numpy(zero_copy_only=False)
        keys = table.column("keys")[i].values.to_numpy(zero_copy_only=False)
        first, other = candidate_pairs(bands, keys)
        if len(first):
            keep = similar(signatures.read(first), signatures.read(other), threshold)
            first, other = first[keep], other[keep]
        found.append(np.stack([first, other], axis=1).reshape(-1))
    offsets = pa.array(np.cumsum([0] + [len(p) for p in found]), pa.int64())
    values = pa.array(np.concatenate(found) if found else np.zeros(0, np.uint64), pa.uint64())
    return pa.table({"bucket": table.column("bucket"), "pairs": pa.LargeListArray.from_arrays(offsets, values)})


def near_pairs_files(pairs_dir: str):
    """doc_near_pairs' write: each bucket's similar pairs, (n, 2) uint64, committed as `BBBBB.npy`."""

    def write(tables) -> None:
        for table in tables:
            for i in range(table.num_rows):
                out = Path(pairs_dir) / f"{table.column('bucket')[i].as_py():05d}.npy"
                pairs = table.column("pairs")[i].values.to_numpy(zero_copy_only=False).reshape(-1, 2)
                tmp = layout.temp_path(out)
                with open(tmp, "wb") as f:
                    np.save(f, pairs)
                layout.commit_file(tmp, out)

    return table_sink("near_pairs", write)


def near_drops(pair_files: list[str], exact_files: list[str], near_dir: Path) -> tuple[Path, Path]:
    """The components of every bucket's pairs: `dropped.npy` (the keys each component drops but exact dedup does
    not, sorted) and `kept.npy` (the component's first key for each), committed (kept first); kept when a rerun
    finds them."""
    dropped_path, kept_path = near_dir / "dropped.npy", near_dir / "kept.npy"
    if dropped_path.exists():
        return dropped_path, kept_path
    pairs = [np.load(p).reshape(-1, 2) for p in pair_files]
    pairs = np.concatenate(pairs) if pairs else np.zeros((0, 2), np.uint64)
    dropped, kept = component_drops(pairs[:, 0], pairs[:, 1])
    new = ~in_sorted(dropped, sorted_unique([np.load(p) for p in exact_files]))
    for path, array in ((kept_path, kept[new]), (dropped_path, dropped[new])):
        tmp = layout.temp_path(path)
        with open(tmp, "wb") as f:
            np.save(f, array)
        layout.commit_file(tmp, path)
    return dropped_path, kept_path


def near_pairs_report(dropped_path: Path, kept_path: Path, files: list[dict]) -> list[dict]:
    """The first NEAR_SAMPLE dropped near duplicates (key order), each with the document kept in its place:
    source, input file and doc_id of both. `files[ordinal]` gives each staged file's `source`, `input` and
    `staged` path."""
    dropped, kept = np.load(dropped_path)[:NEAR_SAMPLE], np.load(kept_path)[:NEAR_SAMPLE]
    shift, mask = np.uint64(ROW_BITS), np.uint64((1 << ROW_BITS) - 1)
    doc_ids: dict[int, np.ndarray] = {}
    for ordinal in np.unique(np.concatenate([dropped, kept]) >> shift).tolist():
        doc_ids[ordinal] = pq.read_table(files[ordinal]["staged"], columns=["doc_id"]).column("doc_id").to_numpy()

    def name(key: np.uint64) -> dict:
        f = files[int(key >> shift)]
        return {"source": f["source"], "file": f["input"], "doc_id": int(doc_ids[int(key >> shift)][int(key & mask)])}

    return [{**name(d), "kept": name(k)} for d, k in zip(dropped, kept)]


def write_near_report(report: list[dict], out: Path) -> None:
    tmp = layout.temp_path(out)
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in report))
    layout.commit_file(tmp, out)


@dataclass(frozen=True)
class NearDedupPlan:
    """What `dedup: near` adds to the filter stage, for `--plan`."""

    buckets: int
    """doc_near_pairs tasks (one per bucket of band entries)."""
    scan_bytes_written: int
    """Signatures and band tables written by doc_scan (read again by doc_near_pairs: the same bytes)."""
    bucket_task_memory: int
    """The memory a doc_near_pairs task declares (its band entries, x 3 while sorting)."""
    driver_bytes_per_pair: int = 16
    """The driver's memory per similar pair while it finds the components (pairs are near duplicates only)."""


def near_bucket_count(documents: int, bands: int) -> int:
    return max(1, -(-documents * bands // DOCS_PER_BUCKET))


def near_bucket_memory(documents: int, bands: int) -> int:
    """A doc_near_pairs task's declared memory (before rounding): as exact dedup's, per band entry."""
    return int(256 * 2**20 + 48 * documents * bands / near_bucket_count(documents, bands))


def near_dedup_plan(documents: int, scan_units: int, bands: int, rows: int) -> NearDedupPlan:
    """The near-dedup part of the filter stage's plan for `documents` documents in `scan_units` scan units."""
    per_doc = 4 * bands * rows + 16 * bands
    return NearDedupPlan(buckets=near_bucket_count(documents, bands),
                         scan_bytes_written=per_doc * documents + 2 * NPY_HEADER * scan_units,
                         bucket_task_memory=near_bucket_memory(documents, bands))

"""What a data config means before it runs: bytes, tokens, disk, memory, counts and time (`--plan`).

    python jobs/prepare_data.py --config configs/data/huginn.yaml --plan [--json]

Nothing is downloaded; nothing is written but the plan itself, cached under an output_dir that already exists
(`build_plan`). Per source the files and their bytes come from the local files, the download stage's provenance
when the source is already downloaded, or else the Hub's listing (file sizes from
`dataset_info(files_metadata=True)`, the same call the download stage makes). A source whose files are on this
machine is *sampled*: up to plan_sources.SAMPLE_BYTES of its input files, in file order, are formatted exactly as
staging does, encoded with the run's tokenizer (when it exists) and packed with the run's packing rule, which gives
its text bytes per input byte, tokens per text byte, packed tokens per document token, staged and packed bytes on
disk per token (huginn_ray/data/plan_sources.py). A source that cannot be sampled (Hub files not downloaded, or no
tokenizer yet) takes the mean of the sampled sources, or plan_sources.DEFAULTS when none was sampled; the report
says which sources were estimated so.

Estimates, all per split-less total (train + validation together):
- `estimated_tokens`: packed training tokens after weighting (rows x (seq_len + 1));
- peak disk per stage: what is on disk under output_dir at the end of each stage (nothing is deleted before the
  shuffle ends; its map files live until the last shard is written): download + staging (+ filtered, and the
  filter stage's hash tables until it commits) + packed + map + shards;
- bytes each stage reads and writes (`io_bytes`); the shard stage per split, with how the split's shards are made
  (`reshard_method`: shuffle, or for already packed data whose split is num_shards files of one row count, one file
  per rank, hard-linked or converted; a validation split is planned as shuffled when `drop_val_duplicates` is on,
  since which of its files lose rows is known only after the duplicate search);
- the filter stage (`decontaminate` / `dedup` on; huginn_ray/data/doc_filter.py), `filter` in the plan: the
  staged documents and bytes it scans, its scan units and reads (doc_filter's `scan_units` and `scan_reads` over
  each staged file's estimated documents), its dedup buckets, the evaluation n-gram set (grams; bytes as
  `ngrams.npy` and in each scan task; built only when no Hub evaluation set has to be fetched) and,
  with `dedup: near`, its signatures, band buckets and their tasks' memory (doc_near_dedup.near_dedup_plan).
  Bytes: `doc_scan` reads the staged files (S) and writes 16 B per document of hash tables (+ an npy header per
  scan unit); `doc_dedup` writes at most 8 B per document (its duplicates' keys); `doc_filter` rewrites every
  file that loses a document: planned as every file (S read, S written), the upper bound (a file that loses none
  is a hard link); nothing is rewritten with `mode: report` and `dedup: none`;
- the pack stage's batches (tokenize_pack's rule applied to each staged file's estimated documents: its runs of
  `docs_per_pack_batch`, one packed file each) and its read tasks (`read_units`: consecutive batches grouped);
- memory per task: the `memory=` the stages declare (tokenize_pack, shuffle, doc_filter), the largest of each kind;
- time: input volumes over the throughputs of THROUGHPUT (BENCHMARKS.md figures where measured, marked assumed
  where not), at the CPUs of `local_ray.num_cpus` (or this machine's).

The free space of output_dir's file system must hold the peak minus what output_dir already holds; otherwise the
plan (and a real run, which checks the same at its start) is refused naming the figures.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.config import DataConfig
from huginn_ray.data.decontaminate import NgramSet
from huginn_ray.data.doc_dedup import DOCS_PER_BUCKET
from huginn_ray.data.doc_filter import scan_reads, scan_units
from huginn_ray.data.doc_near_dedup import NearDedupPlan, near_dedup_plan
from huginn_ray.data.formatting import DataError
from huginn_ray.data.plan_sources import (DEFAULTS, EMPTY, TEXT_PER_INPUT_BYTE, Ratios, hub_listings, input_files,
                                          mean_ratios, packed_splits, plan_tokenizer, planned, sample_source)
from huginn_ray.data.shuffle import map_task_memory, plan_split, reduce_task_memory
from huginn_ray.data.sources import Source
from huginn_ray.data.tokenize_pack import read_units
from huginn_ray.data.tokens import arrow_type, token_dtype

THROUGHPUT = {
    "download_bytes_per_s": (100e6, "assumed: 100 MB/s aggregate from the Hub"),
    "staging_text_bytes_per_s_per_cpu": (20e6, "measured, BENCHMARKS.md: 20-24 MiB/s of text per task (Arrow's JSON "
                                                "reader, web and math text)"),
    "pack_tokens_per_s_per_cpu": (750e3, "assumed: no figure in BENCHMARKS.md's present tables"),
    "shuffle_bytes_per_s_per_cpu": (11e6, "assumed: no figure in BENCHMARKS.md's present tables"),
    "filter_scan_text_bytes_per_s_per_cpu": (14.7 * 2**20, "measured, BENCHMARKS.md: bench/doc_filter.py, the n-gram "
                                                           "check 334 us per 750-word document, one core"),
    "filter_hash_text_bytes_per_s_per_cpu": (689 * 2**20, "measured, BENCHMARKS.md: bench/doc_filter.py, content "
                                                          "hash alone (dedup without decontamination)"),
}
"""Rates the time estimate uses, with where each figure comes from."""

PLAN_FORMAT = 4
"""The layout of a plan; plans cached under another layout are not read."""


def build_plan(cfg: DataConfig, sources: list[Source], ngrams: NgramSet | None = None) -> dict:
    """The plan of a run (see the module docstring); raises DataError when its peak disk does not fit. `ngrams`:
    the evaluation n-gram set (pipeline.eval_ngrams; None when decontamination is off or a Hub evaluation set is not
    fetched yet).

    Cached under an existing output_dir, `<output_dir>/plan/<key>.json`, keyed by the config, the n-gram set's
    digest, the tokenizer file (size, mtime) and every source's file listing (names, sizes and mtimes of files on
    this machine; a Hub source not downloaded yet: its commit, names and sizes): a rerun on unchanged inputs reads
    no parquet footer and samples no file again (the released data: 8,192 footers). The disk check is made on every
    call."""
    from huginn_ray.data.tokenizer import TOKENIZER_FILE

    listing = hub_listings(cfg, sources)
    inputs = {s.name: input_files(cfg, s, listing) for s in sources if planned(s)}

    def mtime(path: str | Path) -> int | None:
        try:
            return os.stat(path).st_mtime_ns
        except OSError:
            return None

    tokenizer_file = cfg.tokenizer_dir / TOKENIZER_FILE
    key = layout.fingerprint({
        "format": PLAN_FORMAT, "config": dataclasses.asdict(cfg), "ngrams": ngrams.digest if ngrams else None,
        "tokenizer": [tokenizer_file.stat().st_size, mtime(tokenizer_file)] if tokenizer_file.is_file() else None,
        "inputs": {name: [commit, here, [[rel, size, mtime(path) if here else None] for path, size, rel in files]]
                   for name, (files, here, commit) in inputs.items()}})
    cache = cfg.root / "plan" / f"{key}.json"
    if cache.is_file():
        plan = json.loads(cache.read_text())
        plan["cached"] = str(cache)
    else:
        plan = _compute_plan(cfg, sources, inputs, ngrams)
        if cfg.root.is_dir():  # a --plan of a new output_dir writes nothing
            cache.parent.mkdir(exist_ok=True)
            layout.write_json(cache, plan)
        plan["cached"] = None
    plan.update(check_disk(cfg, plan["peak_disk_bytes"]))
    return plan


NPY_HEADER = 128
"""Bytes of an .npy file's header (format 1.0, padded to 64-byte blocks; 128 for these arrays)."""

NGRAM_TASK_BYTES_PER_GRAM = (8 + 4, 16 + 8 + 4)
"""What a scan task holds of the n-gram set per gram (doc_filter.scan_documents): the hashes (uint64) and items
(uint32) it keeps, and its peak while loading them (the (hash, item) uint64 table of `ngrams.npy`, 16 B, read
whole before the two are copied out of it)."""


def _scan_work(staged: list[tuple[Source, list[int], float]]) -> tuple[int, int]:
    """(scan units, scan reads) of the doc_scan stage over staged files, each given as (source, every file's
    estimated documents, at least one, the source's characters per document): the units and reads doc_filter builds
    (`scan_units`, `scan_reads`) from staging markers of those counts."""
    files, markers = [], {}
    for source, rows, chars_per_doc in staged:
        markers[source.name] = {"rows": sum(rows), "chars": sum(rows) * chars_per_doc}
        files += [(source, {"rows": n, "output": f"{i:05d}.parquet"}) for i, n in enumerate(rows)]
    units = scan_units(files, markers, Path("staging"))
    return len(units), len(scan_reads(units))


@dataclass
class _Volumes:
    """What the sources' files add up to, before the shard stage (summed over all sources)."""

    per_source: list[dict] = field(default_factory=list)
    # the documents of the sources that are staged (not already packed)
    staged_bytes: float = 0.0
    documents: float = 0.0
    worst_pack_chars: float = 0.0
    """The characters of the largest pack batch (the pack task's memory formula counts characters)."""
    scanned: list[tuple[Source, list[int], float]] = field(default_factory=list)
    """Per staged source: (source, each file's estimated documents, characters per document)."""
    # the packed rows of all sources, and their shards
    pack_batches: list[int] = field(default_factory=list)  # documents per pack batch, in the stage's order
    packed_tokens: float = 0.0
    packed_file_bytes: float = 0.0
    shard_token_bytes: float = 0.0
    packed: dict[str, dict] = field(default_factory=lambda: {
        split: {"files": 0, "bytes": 0, "rows": 0.0, "row_counts": set(), "linkable": True}
        for split in ("train", "val")})
    """Per split of the already packed sources: files, bytes, rows, the files' row counts, whether all link."""


@dataclass
class _ShardStage:
    """How the shard stage makes each split's shards, and what it reads and writes."""

    methods: dict[str, str]
    split_rows: dict[str, float]
    split_input: dict[str, float]
    shuffled: list[str]
    map_split_bytes: dict[str, float]
    map_bytes: float
    map_tasks: int
    split_plans: dict[str, dict]
    reducers: dict[str, int]
    shard_split_bytes: dict[str, float]


@dataclass
class _FilterStage:
    """What the filter stage (decontaminate / dedup) scans and writes; all zero when it does not run."""

    filtering: bool
    buckets: int
    scan_units: int
    scan_reads: int
    hash_tables: float
    duplicate_keys: float
    rewritten: float
    ngram_file: float
    near: NearDedupPlan | None  # dedup near only


def _source_entries(cfg: DataConfig, sources: list[Source], inputs: dict, tokenizer, row_len: int,
                    dtype: str) -> tuple[list[dict], list[Ratios]]:
    """Per source its files and, where it could be sampled, its ratios; and the ratios of the sampled sources."""
    entries, sampled = [], []
    for source in sources:
        if not planned(source):
            entries.append({"name": source.name, "files": 0, "input_bytes": 0, "weight": 0.0, "estimated_tokens": 0,
                            "hub_bytes": 0, "ratios": None, "sampled": False, "commit": None})
            continue
        files, here, commit = inputs[source.name]
        ratios = None
        if here and tokenizer is not None and not source.is_packed and files:
            ratios = sample_source(source, [(path, size) for path, size, _ in files], tokenizer, row_len,
                                   cfg.docs_per_pack_batch, dtype, cfg.shuffle.row_group_size, cfg.chat.pack)
            if ratios is None:  # no document in the sampled files: staging will report the source as empty
                ratios = EMPTY
            else:
                sampled.append(ratios)
        entries.append({"name": source.name, "files": len(files), "input_bytes": sum(s for _, s, _ in files),
                        "hub_bytes": 0 if source.is_local and not source.mirrored_from else sum(s for _, s, _ in files), "weight": source.weight,
                        "ratios": ratios, "sampled": ratios is not None, "commit": commit,
                        "paths": [p for p, _, _ in files], "sizes": [s for _, s, _ in files],
                        "packed": source.is_packed, "here": here, "source": source,
                        "splits": packed_splits(source, files) if source.is_packed else None})
    return entries, sampled


def _packed_source_rows(entry: dict, packed: dict[str, dict], row_len: int, dtype: str) -> float:
    """An already packed source's rows, added to `packed` per split: exact from the parquet footers when its files
    are here."""
    source_rows = 0.0
    for split, split_files in entry["splits"].items():
        info = packed[split]
        for path, size in split_files:
            if entry["here"]:
                meta = pq.read_metadata(path)
                file_rows = float(meta.num_rows)
                arrow = meta.schema.to_arrow_schema()
                info["linkable"] &= arrow.names == ["input_ids"] and arrow.field(
                    "input_ids").type == pa.list_(arrow_type(dtype))
                info["row_counts"].add(file_rows)
            else:  # not on this machine: the rows its bytes hold as packed uint16 files do
                file_rows = size / DEFAULTS.packed_file_per_token / row_len
                info["linkable"] = False
            info["files"] += 1
            info["bytes"] += size
            info["rows"] += file_rows
            source_rows += file_rows
    return source_rows


def _volumes(cfg: DataConfig, entries: list[dict], fallback: Ratios, row_len: int, dtype: str) -> _Volumes:
    """The sources' estimated text, documents, tokens and bytes on disk (a source not sampled: `fallback`)."""
    volumes = _Volumes()
    for e in entries:
        if not e["files"] or e["ratios"] is EMPTY:
            volumes.per_source.append({k: e[k] for k in ("name", "files", "input_bytes")}
                                | {"estimated_tokens": 0, "sampled": e["ratios"] is EMPTY})
            continue
        if e["packed"]:  # released rows: exact from the parquet footers when the files are here
            tokens = _packed_source_rows(e, volumes.packed, row_len, dtype) * row_len
            volumes.packed_tokens += tokens
            volumes.shard_token_bytes += tokens * DEFAULTS.shard_per_token
            volumes.per_source.append({"name": e["name"], "files": e["files"], "input_bytes": e["input_bytes"],
                                 "estimated_tokens": int(tokens), "sampled": False, "commit": e["commit"]})
            continue
        r = e["ratios"] or fallback
        text_per_byte = r.text_per_input_byte if e["ratios"] else next(
            (ratio for suffix, ratio in TEXT_PER_INPUT_BYTE.items()
             if all(p.endswith(suffix) for p in e["paths"])), fallback.text_per_input_byte)
        text = e["input_bytes"] * text_per_byte
        tokens = text * r.tokens_per_text_byte * e["weight"] * r.packed_per_token
        volumes.staged_bytes += text * r.staged_per_text_byte
        volumes.packed_tokens += tokens
        docs = text * r.docs_per_text_byte
        volumes.documents += docs
        file_docs = [max(1, round(size * text_per_byte * r.docs_per_text_byte)) for size in e["sizes"]]
        volumes.scanned.append((e["source"], file_docs, r.chars_per_text_byte / r.docs_per_text_byte))
        # tokenize_pack.pack_batches' rule: each staged file's runs of docs_per_pack_batch documents
        batches = [min(cfg.docs_per_pack_batch, n - start) for n in file_docs
                   for start in range(0, n, cfg.docs_per_pack_batch)]
        volumes.pack_batches += batches
        volumes.packed_file_bytes += tokens * r.packed_file_per_token + len(batches) * r.parquet_file_bytes
        volumes.shard_token_bytes += tokens * r.shard_per_token
        chars_per_doc = r.chars_per_text_byte / r.docs_per_text_byte
        volumes.worst_pack_chars = max(volumes.worst_pack_chars, chars_per_doc * min(docs, cfg.docs_per_pack_batch))
        volumes.per_source.append({"name": e["name"], "files": e["files"], "input_bytes": e["input_bytes"],
                             "text_bytes": int(text), "estimated_tokens": round(tokens), "sampled": e["sampled"],
                             "commit": e["commit"]})
    return volumes


def _shard_stage(cfg: DataConfig, volumes: _Volumes, rows: float, row_bytes: int, all_packed: bool, dtype: str,
                 fallback: Ratios) -> _ShardStage:
    """Each split's method (shuffle, or one file per rank for already packed data), rows, and the shuffle's map
    files and reducers."""
    if all_packed:  # each split on its own (pipeline.run_stage_shuffle_packed)
        split_rows = {split: info["rows"] for split, info in volumes.packed.items()}
        split_input = {split: info["bytes"] for split, info in volumes.packed.items()}
        methods = {}
        for split, info in volumes.packed.items():
            # the validation split is shuffled when duplicates of training rows are dropped from it: the released
            # data has such rows (issue 29), and which files lose rows is known only after the search
            shuffled = (info["files"] != cfg.num_shards or len(info["row_counts"]) > 1
                        or (split == "val" and cfg.drop_val_duplicates))
            methods[split] = "shuffle" if shuffled else "hard_link" if info["linkable"] else f"convert_{dtype}"
    else:
        split_rows = {"train": rows * (1 - cfg.val_fraction), "val": rows * cfg.val_fraction}
        split_input = {split: volumes.packed_file_bytes * n / max(rows, 1) for split, n in split_rows.items()}
        methods = {"train": "shuffle", "val": "shuffle"}
    shuffled = [split for split, method in methods.items() if method == "shuffle"]
    map_split_bytes = {split: split_rows[split] * row_bytes if split in shuffled else 0.0 for split in methods}
    map_bytes = sum(map_split_bytes.values())
    split_plans = {name: plan_split(max(int(split_rows[name]), cfg.num_shards), cfg.num_shards, row_bytes,
                                    cfg.shuffle.reducer_mib << 20, name) for name in shuffled}
    return _ShardStage(
        methods=methods, split_rows=split_rows, split_input=split_input, shuffled=shuffled,
        map_split_bytes=map_split_bytes, map_bytes=map_bytes,
        map_tasks=math.ceil(map_bytes / (cfg.shuffle.map_mib << 20)) if shuffled else 0, split_plans=split_plans,
        reducers={name: plan["reducers"] for name, plan in split_plans.items()},
        shard_split_bytes={  # same rows, same encoding; a hard-linked file is no new byte
            split: 0.0 if method == "hard_link" else (volumes.shard_token_bytes * split_rows[split] / max(rows, 1)
                                                      + cfg.num_shards * fallback.parquet_file_bytes)
            for split, method in methods.items()})


def _filter_stage(cfg: DataConfig, volumes: _Volumes, ngrams: NgramSet | None, all_packed: bool) -> _FilterStage:
    """The filter stage's units and bytes: its scan units and reads, dedup buckets, hash tables, duplicate keys,
    rewritten files and n-gram file."""
    filtering = not all_packed and (cfg.decontaminate.mode != "none" or cfg.dedup != "none")
    buckets = max(1, math.ceil(volumes.documents / DOCS_PER_BUCKET)) if filtering and cfg.dedup != "none" else 0
    scan_unit_count, scan_read_count = _scan_work(volumes.scanned) if filtering else (0, 0)
    near = cfg.near_dedup
    return _FilterStage(
        filtering=filtering, buckets=buckets, scan_units=scan_unit_count, scan_reads=scan_read_count,
        # doc_scan: (hash, row) per document; doc_dedup: at most every document
        hash_tables=16 * volumes.documents + NPY_HEADER * scan_unit_count if filtering else 0.0,
        duplicate_keys=8 * volumes.documents + NPY_HEADER * buckets if buckets else 0.0,
        rewritten=(volumes.staged_bytes if filtering and (cfg.decontaminate.mode == "drop" or cfg.dedup != "none")
                   else 0.0),
        ngram_file=16 * len(ngrams.hashes) + NPY_HEADER if filtering and ngrams is not None else 0.0,
        near=(near_dedup_plan(int(volumes.documents), scan_unit_count, near.bands, near.rows)
              if filtering and cfg.dedup == "near" else None))


def _disk_after_stages(cfg: DataConfig, hub_bytes: int, volumes: _Volumes, filters: _FilterStage,
                       shards: _ShardStage) -> dict:
    """What is on disk under output_dir at the end of each stage (nothing is deleted before the shuffle ends)."""
    disk = {"download": hub_bytes}
    disk["staging"] = disk["download"] + volumes.staged_bytes
    if filters.filtering:  # the filtered files stay; the hash tables and duplicate keys until the stage commits
        disk["filter"] = (disk["staging"] + filters.rewritten + filters.ngram_file + filters.hash_tables
                          + filters.duplicate_keys + (filters.near.scan_bytes_written if filters.near else 0))
    disk["pack"] = disk["staging"] + filters.rewritten + filters.ngram_file + volumes.packed_file_bytes
    disk["shuffle"] = (disk["pack"] + shards.map_bytes
                       + 8 * (cfg.num_shards + 1) * len(shards.shuffled) * shards.map_tasks
                       + sum(shards.shard_split_bytes.values()))
    return {k: int(n) for k, n in disk.items()}


def _io_bytes(entries: list[dict], hub_bytes: int, volumes: _Volumes, filters: _FilterStage, shards: _ShardStage,
              all_packed: bool) -> dict:
    """The bytes each stage reads and writes under output_dir (or reads from a local_dir)."""
    io = {"download": {"read": hub_bytes, "written": hub_bytes}}  # read: each file hashed once when verified
    if all_packed:  # the validation files read once more; the training files too unless they go per file (their
        # tasks then look their rows up while they convert them: one pass)
        train_read = shards.split_input["train"] if shards.methods["train"] == "shuffle" else 0
        io["dedup"] = {"read": shards.split_input["val"] + train_read, "written": 0}
    else:
        io["staging"] = {"read": sum(e["input_bytes"] for e in entries), "written": volumes.staged_bytes}
        if filters.filtering:
            tables = filters.hash_tables + filters.duplicate_keys
            io["filter"] = {"read": volumes.staged_bytes + (tables if filters.buckets else 0) + filters.rewritten,
                            "written": tables + filters.rewritten + filters.ngram_file}
        io["pack"] = {"read": volumes.staged_bytes, "written": volumes.packed_file_bytes}
    for split, method in shards.methods.items():
        io[f"shards_{split}"] = {
            "read": shards.split_input[split] + shards.map_split_bytes[split],  # the shuffle reads its map files back
            "written": shards.map_split_bytes[split] + shards.shard_split_bytes[split]}
    return {stage: {k: int(n) for k, n in figures.items()} for stage, figures in io.items()}


def _estimated_seconds(cfg: DataConfig, hub_bytes: int, volumes: _Volumes, filters: _FilterStage, shards: _ShardStage,
                       all_packed: bool, cpus: int) -> dict:
    """Each stage's input volume over its throughput (THROUGHPUT) at `cpus` CPUs."""
    text_total = sum(p.get("text_bytes", 0) for p in volumes.per_source)
    # packed data is not encoded; the encoder's work is about the packed tokens (copies are encoded once)
    doc_tokens = 0.0 if all_packed else volumes.packed_tokens
    filter_rate = ("filter_scan_text_bytes_per_s_per_cpu" if cfg.decontaminate.mode != "none"
                   else "filter_hash_text_bytes_per_s_per_cpu")  # the n-gram check dominates when it runs
    return {
        "download": hub_bytes / THROUGHPUT["download_bytes_per_s"][0],
        "staging": text_total / (THROUGHPUT["staging_text_bytes_per_s_per_cpu"][0] * cpus),
        **({"filter": text_total / (THROUGHPUT[filter_rate][0] * cpus)} if filters.filtering else {}),
        "pack": doc_tokens / (THROUGHPUT["pack_tokens_per_s_per_cpu"][0] * cpus),
        "shuffle": sum(shards.split_input.values()) / (THROUGHPUT["shuffle_bytes_per_s_per_cpu"][0] * cpus),
    }


def _memory_per_task(cfg: DataConfig, volumes: _Volumes, filters: _FilterStage, shards: _ShardStage, rows: float,
                     row_len: int, row_bytes: int, itemsize: int, dtype: str, all_packed: bool) -> dict:
    """The `memory=` the stages declare, for the largest task of each kind."""
    # the largest map group, taken as one file (an upper bound); released files are read as int64 (8 bytes)
    group_rows = int(min(rows, (cfg.shuffle.map_mib << 20) // row_bytes + 1))
    input_width = 8 if all_packed else itemsize
    memory = {
        "pack_task": int(256 * 2**20 + 24 * volumes.worst_pack_chars),
        "map_task": map_task_memory([{"train_rows": group_rows, "val_rows": 0}], row_len, dtype, input_width, False),
        "reduce_task": max([reduce_task_memory(p, row_len, dtype) for p in shards.split_plans.values()], default=0),
    }
    if filters.buckets:  # doc_filter.run_filter's declaration
        memory["dedup_task"] = int(256 * 2**20 + 48 * volumes.documents / filters.buckets)
    if filters.near:
        memory["near_pairs_task"] = filters.near.bucket_task_memory
    return memory


def _counts(cfg: DataConfig, entries: list[dict], volumes: _Volumes, filters: _FilterStage, shards: _ShardStage,
            all_packed: bool) -> dict:
    """The files and tasks of each stage."""
    staged_files = sum(e["files"] for e in entries if not e.get("packed"))
    # the pack stage's read tasks (one encoder call each): its batches grouped as tokenize_pack.read_units groups them
    pack_reads = len(read_units([{"count": n} for n in volumes.pack_batches], cfg.docs_per_pack_batch))
    train_files = volumes.packed["train"]["files"] if shards.methods["train"] == "shuffle" else 0
    dedup_tasks = volumes.packed["val"]["files"] + train_files if all_packed else 0
    per_file_tasks = sum(cfg.num_shards for method in shards.methods.values() if method != "shuffle")
    counts = {
        "input_files": sum(e["files"] for e in entries),
        "staged_files": staged_files,
        "pack_batches": len(volumes.pack_batches),  # one packed file each
        "pack_tasks": pack_reads,
        "map_tasks": shards.map_tasks,
        "map_files": 2 * len(shards.shuffled) * shards.map_tasks,  # per shuffled split: data + index
        "per_file_tasks": per_file_tasks,
        "reducers": sum(shards.reducers.values()),
        "shard_files": 2 * cfg.num_shards,
        "ray_tasks": int(sum(e["files"] for e in entries) + dedup_tasks + pack_reads + shards.map_tasks
                         + sum(shards.reducers.values()) + per_file_tasks
                         + (filters.scan_reads + filters.buckets + staged_files if filters.filtering else 0)
                         + (filters.near.buckets if filters.near else 0)),
    }
    if filters.filtering:  # doc_scan: one task per group of scan units; doc_dedup: one task per
        # bucket; doc_filter: one per staged file (the bound: a file that loses no document is linked, no task)
        counts.update(scan_units=filters.scan_units, scan_tasks=filters.scan_reads, dedup_tasks=filters.buckets,
                      filter_tasks=staged_files, **({"near_pairs_tasks": filters.near.buckets} if filters.near else {}))
    return counts


def _filter_report(cfg: DataConfig, volumes: _Volumes, filters: _FilterStage, ngrams: NgramSet | None,
                   cpus: int) -> dict | None:
    """The plan's `filter`: the documents and bytes the filter stage scans and writes, and its n-gram set."""
    if not filters.filtering:
        return None
    scan_tasks = min(cpus, filters.scan_reads)  # doc_filter.run_scan: one task per read, at most one per CPU at once
    return {
        "documents": int(volumes.documents), "staged_bytes": int(volumes.staged_bytes),
        "rewritten_bytes": int(filters.rewritten), "hash_table_bytes": int(filters.hash_tables),
        "duplicate_key_bytes": int(filters.duplicate_keys),
        **({"near_signature_bytes": filters.near.scan_bytes_written} if filters.near else {}),
        "ngram_set": None if cfg.decontaminate.mode == "none" else {
            "built_on": "driver, before any stage (pipeline.eval_ngrams); saved as ngrams.npy in the filter "
                        "stage's directory, loaded from it by each scan task",
            "tasks_at_once": scan_tasks,
            **({"grams": None, "why": "a Hub evaluation set is not fetched yet: built when the run starts"}
               if ngrams is None else
               {"grams": len(ngrams.hashes), "items": len(ngrams.sources), "file_bytes": int(filters.ngram_file),
                "bytes_per_task": NGRAM_TASK_BYTES_PER_GRAM[0] * len(ngrams.hashes),
                "load_peak_bytes_per_task": NGRAM_TASK_BYTES_PER_GRAM[1] * len(ngrams.hashes),
                "eval_sets": [o.get("path") or f"{o['hub']}@{o['commit'][:12]}" for o in ngrams.origins]})}}


def _compute_plan(cfg: DataConfig, sources: list[Source], inputs: dict, ngrams: NgramSet | None) -> dict:
    """The plan from the sources' input files ({name: input_files(...)} of the sources the plan counts)."""
    tokenizer, vocab_size = plan_tokenizer(cfg)
    dtype = token_dtype(vocab_size)
    itemsize = 2 if dtype == "uint16" else 4
    row_len = cfg.seq_len + 1
    entries, sampled = _source_entries(cfg, sources, inputs, tokenizer, row_len, dtype)
    fallback = mean_ratios(sampled)
    volumes = _volumes(cfg, entries, fallback, row_len, dtype)
    rows = volumes.packed_tokens / row_len
    row_bytes = row_len * itemsize + 8
    all_packed = bool(entries) and all(e.get("packed") for e in entries if e["files"])
    shards = _shard_stage(cfg, volumes, rows, row_bytes, all_packed, dtype, fallback)
    filters = _filter_stage(cfg, volumes, ngrams, all_packed)
    hub_bytes = sum(e["hub_bytes"] for e in entries)
    disk = _disk_after_stages(cfg, hub_bytes, volumes, filters, shards)
    cpus = cfg.local_ray.num_cpus or os.cpu_count() or 1
    seconds = _estimated_seconds(cfg, hub_bytes, volumes, filters, shards, all_packed, cpus)
    return {
        "sources": volumes.per_source,
        "input_bytes": int(sum(e["input_bytes"] for e in entries)),
        "estimated_tokens": round(volumes.packed_tokens),  # a product of sampled ratios: round, not truncate
        "estimated_rows": int(rows),
        "token_dtype": dtype,
        "peak_disk_bytes": max(disk.values()),
        "disk_after_stage_bytes": disk,
        "io_bytes": _io_bytes(entries, hub_bytes, volumes, filters, shards, all_packed),
        "reshard_method": shards.methods,
        "memory_per_task_bytes": _memory_per_task(cfg, volumes, filters, shards, rows, row_len, row_bytes, itemsize,
                                                  dtype, all_packed),
        "filter": _filter_report(cfg, volumes, filters, ngrams, cpus),
        "object_store_bytes_per_task": 4096,  # tasks return a few integers; data moves through files
        "counts": _counts(cfg, entries, volumes, filters, shards, all_packed),
        "estimated_seconds": {k: round(n, 1) for k, n in seconds.items()},
        "cpus": cpus,
        "throughputs": {k: {"value": n, "source": why} for k, (n, why) in THROUGHPUT.items()},
        "unsampled_sources": [p["name"] for p in volumes.per_source if p["files"] and not p["sampled"]],
        "unsupported_sources": [src.name for src in sources if src.requires_software_heritage_aws_download
                                and src.weight > 0 and not src.is_packed],
    }


def _bytes_under(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def check_disk(cfg: DataConfig, peak: int) -> dict:
    """Refuse a run whose peak disk, less what output_dir already holds, exceeds the free space there."""
    existing = _bytes_under(cfg.root) if cfg.root.is_dir() else 0
    probe = cfg.root
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    needed = max(0, peak - existing)
    if needed > free:
        raise DataError(f"{'scratch_dir' if cfg.in_bucket else 'output_dir'} {cfg.root}: the run needs {needed / 2**30:.2f} GiB more disk at its peak "
                        f"({peak / 2**30:.2f} GiB in all, {existing / 2**30:.2f} GiB already there) but "
                        f"{free / 2**30:.2f} GiB are free on its file system")
    return {"output_dir_bytes": existing, "free_bytes": free}


def _size(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min" if seconds >= 60 \
        else f"{seconds:.0f} s"


def format_plan(plan: dict) -> str:
    lines = [f"{'source':32} {'files':>7} {'input':>11} {'est. tokens':>17}  sampled"]
    for s in plan["sources"]:
        lines.append(f"{s['name'][:32]:32} {s['files']:7d} {_size(s['input_bytes']):>11} "
                     f"{s['estimated_tokens']:17,d}  {'yes' if s['sampled'] else 'no'}")
    lines.append(f"{'total':32} {plan['counts']['input_files']:7d} {_size(plan['input_bytes']):>11} "
                 f"{plan['estimated_tokens']:17,d}  (packed tokens after weighting, train + val, "
                 f"{plan['token_dtype']})")
    lines.append("disk under output_dir after each stage: " + ", ".join(
        f"{k} {_size(v)}" for k, v in plan["disk_after_stage_bytes"].items()) +
        f"; peak {_size(plan['peak_disk_bytes'])}, free {_size(plan['free_bytes'])}")
    lines.append("bytes read / written per stage: " + ", ".join(
        f"{k} {_size(v['read'])} / {_size(v['written'])}" for k, v in plan["io_bytes"].items()) +
        f"; in all {_size(sum(v['read'] for v in plan['io_bytes'].values()))} / "
        f"{_size(sum(v['written'] for v in plan['io_bytes'].values()))}")
    if plan["filter"]:
        f = plan["filter"]
        grams = f["ngram_set"]
        lines.append(f"filter: scans {f['documents']:,d} documents ({_size(f['staged_bytes'])} staged; scan units: "
                     f"{plan['counts']['scan_units']:,d}, reads: {plan['counts']['scan_tasks']:,d}), rewrites at "
                     f"most {_size(f['rewritten_bytes'])}; hash tables {_size(f['hash_table_bytes'])}, duplicate keys "
                     f"at most {_size(f['duplicate_key_bytes'])}; n-gram set " + (
                         "off" if grams is None else f"not built yet ({grams['why']})" if grams["grams"] is None else
                         f"{grams['grams']:,d} grams of {grams['items']:,d} items ({_size(grams['file_bytes'])} file; "
                         f"{_size(grams['bytes_per_task'])} per scan task, tasks at once: {grams['tasks_at_once']}, "
                         f"{_size(grams['load_peak_bytes_per_task'])} while loading), built on the driver"))
    lines.append("shards from the packed rows: " + ", ".join(
        f"{split} {method}" for split, method in plan["reshard_method"].items()))
    lines.append("memory per task: " + ", ".join(
        f"{k} {_size(v)}" for k, v in plan["memory_per_task_bytes"].items()) +
        f"; object store per task: {_size(plan['object_store_bytes_per_task'])} (results only)")
    lines.append("counts: " + ", ".join(f"{k} {v:,d}" for k, v in plan["counts"].items()))
    total = sum(plan["estimated_seconds"].values())
    lines.append(f"estimated time at {plan['cpus']} CPUs: " + ", ".join(
        f"{k} {_duration(v)}" for k, v in plan["estimated_seconds"].items()) + f"; total {_duration(total)}")
    if plan["cached"]:
        lines.append(f"(read from {plan['cached']}: the sources' files, the config and the tokenizer are those it was "
                     "made for)")
    if plan["unsampled_sources"]:
        lines.append(f"{len(plan['unsampled_sources'])} source(s) not sampled (files not on this machine or no "
                     "tokenizer yet): estimated from the sampled sources' mean or defaults")
    if plan["unsupported_sources"]:
        lines.append(f"planned without {', '.join(plan['unsupported_sources'])}: a run refuses them (their files "
                     "come from the Software Heritage S3 bucket, which this pipeline does not download); set their "
                     "weight to 0 or provide their files as local_dir sources")
    return "\n".join(lines)

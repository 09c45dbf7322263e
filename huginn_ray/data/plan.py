"""What a data config means before it runs: bytes, tokens, disk, memory, counts and time (`--plan`).

    python jobs/prepare_data.py --config configs/data/huginn.yaml --plan [--json]

Nothing is downloaded; nothing is written but the plan itself, cached under an output_dir that already exists
(`build_plan`). Per source the files and their bytes come from the local files, the download
stage's provenance when the source is already downloaded, or else the Hub's listing (file sizes from
`dataset_info(files_metadata=True)`, the same call the download stage makes). A source whose files are on this
machine is *sampled*: up to SAMPLE_BYTES of its input files, in file order, are formatted exactly as staging does,
encoded with the run's tokenizer (when it exists) and packed with the run's packing rule, which gives its text
bytes per input byte, tokens per text byte, packed tokens per document token, staged and packed bytes on disk per
token. A source that cannot be sampled (Hub files not downloaded, or no tokenizer yet) takes the mean of the
sampled sources, or the DEFAULTS below when none was sampled; the report says which sources were estimated so.

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
  staged documents and bytes it scans, its scan units and reads (doc_filter's own rule, `scan_units` and
  `scan_reads`, applied to each staged file's estimated documents: a file of more than a unit's documents or
  characters is several units, consecutive small units share one read), its dedup buckets, and the evaluation
  n-gram set (grams; bytes as the `ngrams.npy` file and in each `ScanDocuments` actor, which loads it once; built on
  the driver before any stage, from the `ngrams` given, which `--plan` builds only when no Hub evaluation set has to
  be fetched). Its bytes: `doc_scan` reads the staged files (S) and writes 16 B per document of hash tables (+ an
  npy header per scan unit); `doc_dedup` reads those tables and writes at most
  8 B per document (its duplicates' keys); `doc_filter` reads the duplicate keys and rewrites every file that loses a
  document: planned as every file (S read, S written), the upper bound a run reaches when duplicates or matches
  are spread over all files (a file that loses none is a hard link: no byte); nothing is rewritten with
  `mode: report` and `dedup: none`;
- memory per task: the `memory=` the stages declare (tokenize_pack.py; shards.map_task_memory and
  reduce_task_memory; doc_filter.py's dedup tasks), for the largest task of each kind;
- time: input volumes over the throughputs of THROUGHPUT (BENCHMARKS.md figures where measured, marked assumed
  where not), at the CPUs of `local_ray.num_cpus` (or this machine's).

The free space of output_dir's file system must hold the peak minus what output_dir already holds; otherwise the
plan (and a real run, which checks the same at its start) is refused naming the figures.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.chat import pack_groups, render, render_document
from huginn_ray.data.config import DataConfig
from huginn_ray.data.decontaminate import NgramSet
from huginn_ray.data.doc_filter import DOCS_PER_BUCKET, scan_reads, scan_units
from huginn_ray.data.formatting import DataError, iter_documents
from huginn_ray.data.hub_download import PROVENANCE
from huginn_ray.data.packing import pack_row_starts
from huginn_ray.data.shards import map_task_memory, plan_split, reduce_task_memory
from huginn_ray.data.sources import Source
from huginn_ray.data.staging import STAGING_SCHEMA, list_local_files
from huginn_ray.data.tokens import arrow_type, parquet_options, rows_to_arrow, token_dtype

SAMPLE_BYTES = 8 << 20
"""Per source: input bytes read to measure its ratios (whole files, in file order, at least one), and text bytes
kept of them to encode and pack (the first documents: a large first file is read, not encoded, past them)."""


@dataclass(frozen=True)
class Ratios:
    """What one source's sample measured (or the defaults for a source that was not sampled)."""

    text_per_input_byte: float
    """UTF-8 bytes of document text per byte of input file (compressed formats > 1)."""
    tokens_per_text_byte: float
    """Token ids (BOS/EOS included) per byte of text."""
    packed_per_token: float
    """Packed row tokens per document token for one copy (what incineration and batch leftovers keep)."""
    chars_per_text_byte: float
    """Characters per UTF-8 byte (the pack task's memory formula counts characters)."""
    staged_per_text_byte: float
    """Bytes of the staging parquet files (one per input file, footers included) per byte of text."""
    packed_file_per_token: float
    """Bytes of packed parquet per token (BYTE_STREAM_SPLIT + zstd, one batch's rows per file), less the
    per-file part."""
    shard_per_token: float
    """Bytes of shard parquet per token (row groups of shuffle.row_group_size), less the per-file part."""
    parquet_file_bytes: float
    """The per-file part of a packed or shard parquet file (footer, schema, statistics)."""
    docs_per_text_byte: float
    """Documents per byte of text."""


DEFAULTS = Ratios(text_per_input_byte=1.0, tokens_per_text_byte=0.25, packed_per_token=0.9,
                  chars_per_text_byte=1.0, staged_per_text_byte=0.5, packed_file_per_token=1.8,
                  shard_per_token=1.8, parquet_file_bytes=1500, docs_per_text_byte=1 / 4096)
"""Used when no source could be sampled: ~4 bytes per token (English BPE), 2 bytes per uint16 id x 0.9."""

EMPTY = Ratios(*([0.0] * len(Ratios.__dataclass_fields__)))
"""A sampled source whose files hold no document."""

TEXT_PER_INPUT_BYTE = {".parquet": 2.5, ".gz": 3.5, ".zst": 4.0}
"""Text bytes per compressed input byte for unsampled sources (typical zstd/snappy/gzip ratios on text)."""

THROUGHPUT = {
    "download_bytes_per_s": (100e6, "assumed: 100 MB/s aggregate from the Hub"),
    "staging_text_bytes_per_s_per_cpu": (20e6, "measured, BENCHMARKS.md: 20-24 MiB/s of text per task (Arrow's JSON "
                                                "reader, web and math text)"),
    "pack_tokens_per_s_per_cpu": (750e3, "measured, BENCHMARKS.md: 4k vocabulary on code, 1 CPU"),
    "shuffle_bytes_per_s_per_cpu": (11e6, "measured, BENCHMARKS.md: ~22 MiB/s of packed bytes on 2 CPUs"),
    "filter_scan_text_bytes_per_s_per_cpu": (14.7 * 2**20, "measured, BENCHMARKS.md: bench/doc_filter.py, the n-gram "
                                                           "check 334 us per 750-word document, one core"),
    "filter_hash_text_bytes_per_s_per_cpu": (689 * 2**20, "measured, BENCHMARKS.md: bench/doc_filter.py, content "
                                                          "hash alone (dedup without decontamination)"),
}
"""Rates the time estimate uses, with where each figure comes from."""


def _input_files(cfg: DataConfig, source: Source, listing: dict) -> tuple[list[tuple[str, int, str]], bool, str | None]:
    """(path, bytes, name in the source) of a source's input files, whether they are on this machine, and the Hub
    commit if known."""
    if source.is_local:
        root = source.resolved_local_dir()
        return ([(str(p), p.stat().st_size, p.relative_to(root).as_posix()) for p in list_local_files(source)], True,
                None)
    marker = layout.read_marker(cfg.root / "download" / source.name, PROVENANCE)
    if marker is not None:
        root = cfg.root / "download" / source.name
        return [(str(root / f["path"]), int(f["size"]), f["path"]) for f in marker["files"]], True, marker["commit"]
    commit, files = listing[source.name]
    return [(f.path, f.size, f.path) for f in files], False, commit


def _packed_splits(source: Source, files: list[tuple[str, int, str]]) -> dict[str, list[tuple[str, int]]]:
    """A packed source's files per split, by its train_files / val_files patterns (a run refuses a file that
    matches both or a split that matches none: pipeline.packed_source_files)."""
    import fnmatch

    return {split: [(path, size) for path, size, rel in files if any(fnmatch.fnmatch(rel, p) for p in patterns)]
            for split, patterns in (("train", source.train_files), ("val", source.val_files))}


def _hub_listings(cfg: DataConfig, sources: list[Source]) -> dict:
    """The Hub's file listing of every source not on this machine (metadata only, with the download's retries)."""
    from huggingface_hub import constants, get_token

    from huginn_ray.data.hub_download import list_repo_files

    todo = [s for s in sources if not s.is_local and (s.weight > 0 or s.is_packed)
            and not s.requires_software_heritage_aws_download and layout.read_marker(cfg.root / "download" / s.name, PROVENANCE) is None]
    token = get_token() if todo else None
    return {s.name: list_repo_files(s.address, s.revision, s.file_patterns, constants.ENDPOINT, token, cfg.download)
            for s in todo}


def _sample(source: Source, files: list[tuple[str, int]], tokenizer, row_len: int, docs_per_batch: int,
            dtype: str, row_group_size: int, chat_pack: bool = False) -> Ratios | None:
    """Format, encode and pack the first SAMPLE_BYTES of a source's files as the pipeline does (None: no text).
    A chat source's conversations are rendered with the chat template and laid out one per row or packed
    (`chat_pack`), in file order (the run lays out each split of a batch in a seeded order)."""
    texts: list[str] = []
    input_bytes = staged_bytes = read_text_bytes = text_bytes = 0
    for path, size in files:
        if input_bytes and input_bytes + size > SAMPLE_BYTES:
            break
        docs = []
        for batch in iter_documents(path, source):  # bad records are left out (staging applies the limit)
            for doc in batch.texts:
                n = len(doc.encode("utf-8", "surrogatepass"))
                read_text_bytes += n  # every document read counts for the text per input byte
                if text_bytes < SAMPLE_BYTES:
                    docs.append(doc)
                    text_bytes += n
        staged = io.BytesIO()  # one staging file per input file, as staging writes them
        pq.write_table(pa.table({"text": pa.array(docs, pa.large_string()), "source": [source.name] * len(docs),
                                 "doc_id": pa.array(range(len(docs)), pa.int64())}, schema=STAGING_SCHEMA), staged)
        staged_bytes += staged.tell()
        texts += docs
        input_bytes += size
    if not text_bytes:
        return None
    if source.is_chat:
        encoded = [render(json.loads(t), tokenizer, source.loss_on)[0] for t in texts]
        lengths = [len(ids) for ids in encoded]
        rows = sum(len(pack_groups(lengths[i:i + docs_per_batch], row_len))
                   for i in range(0, len(lengths), docs_per_batch)) if chat_pack else len(lengths)
    elif source.needs_chat_templating:  # staged as parts: the template's structure as ids, the text as text
        encoded = [render_document(json.loads(t), tokenizer) for t in texts]
        lengths = [len(ids) for ids in encoded]
        rows = sum(len(pack_row_starts(lengths[i:i + docs_per_batch], [source.every_token_is_sacred] * len(
            lengths[i:i + docs_per_batch]), row_len)) for i in range(0, len(lengths), docs_per_batch))
    else:
        encoded = [e.ids for e in tokenizer.encode_batch_fast(texts[:256])]
        lengths = [len(e.ids) for e in tokenizer.encode_batch_fast(texts)]
        rows = sum(len(pack_row_starts(lengths[i:i + docs_per_batch], [source.every_token_is_sacred] * len(
            lengths[i:i + docs_per_batch]), row_len)) for i in range(0, len(lengths), docs_per_batch))
    tokens = sum(lengths)
    ids = np.concatenate([np.asarray(e) for e in encoded[:256]])
    sample_rows = np.resize(ids, (max(1, len(ids) // row_len), row_len))  # real ids in rows, as packing cuts them

    def written_size(rows: np.ndarray, **options) -> int:
        table = pa.table({"input_ids": rows_to_arrow(rows, dtype), "split": pa.array(np.zeros(len(rows), np.uint8))})
        buf = io.BytesIO()
        pq.write_table(table, buf, **parquet_options(table), **options)
        return buf.tell()

    # zstd's gain depends on how many rows a file (packed: one batch) or row group (shards) holds, so the sample
    # is written in those units; the per-file part is what an empty file takes
    per_file = written_size(sample_rows[:0])
    batch_rows = max(1, round(docs_per_batch * tokens / len(texts) * rows * row_len / max(1, tokens) / row_len))
    chunks = [sample_rows[i:i + batch_rows] for i in range(0, len(sample_rows), batch_rows)]
    per_token = sum(written_size(c) - per_file for c in chunks) / sample_rows.size
    shard_per_token = (written_size(sample_rows, row_group_size=row_group_size) - per_file) / sample_rows.size
    return Ratios(text_per_input_byte=read_text_bytes / max(1, input_bytes), tokens_per_text_byte=tokens / text_bytes,
                  packed_per_token=rows * row_len / max(1, tokens),
                  chars_per_text_byte=sum(len(t) for t in texts) / text_bytes,
                  staged_per_text_byte=staged_bytes / text_bytes, packed_file_per_token=per_token,
                  shard_per_token=shard_per_token, parquet_file_bytes=per_file,
                  docs_per_text_byte=len(texts) / text_bytes)


def _mean(ratios: list[Ratios]) -> Ratios:
    if not ratios:
        return DEFAULTS
    return Ratios(*(float(np.mean([getattr(r, f) for r in ratios])) for f in Ratios.__dataclass_fields__))


def _tokenizer(cfg: DataConfig):
    from huginn_ray.data.tokenizer import TOKENIZER_FILE, load_text_tokenizer, special_token_ids

    path = cfg.tokenizer_dir / TOKENIZER_FILE
    if not path.is_file():
        return None, cfg.tokenizer.vocab_size
    return load_text_tokenizer(path), special_token_ids(cfg.tokenizer_dir)["vocab_size"]


PLAN_FORMAT = 4
"""The layout of a plan; plans cached under another layout are not read."""


def _planned(source: Source) -> bool:
    """Whether the plan counts a source's files (a run leaves out sources of weight 0 and those it refuses)."""
    return source.is_packed or (source.weight > 0 and not source.requires_software_heritage_aws_download)


def build_plan(cfg: DataConfig, sources: list[Source], ngrams: NgramSet | None = None) -> dict:
    """The plan of a run (see the module docstring); raises DataError when its peak disk does not fit. `ngrams`:
    the evaluation n-gram set (pipeline.eval_ngrams; None when decontamination is off or a Hub evaluation set is not
    fetched yet).

    Cached under an existing output_dir, `<output_dir>/plan/<key>.json`, keyed by the config, the n-gram set's
    digest, the tokenizer file (size, mtime) and every source's file listing (names, sizes and mtimes of files on this machine; a Hub source
    not downloaded yet: its commit, names and sizes): a rerun on unchanged inputs reads no parquet footer and
    samples no file again (the released data: 8,192 footers). The disk check is made on every call."""
    from huginn_ray.data.tokenizer import TOKENIZER_FILE

    listing = _hub_listings(cfg, sources)
    inputs = {s.name: _input_files(cfg, s, listing) for s in sources if _planned(s)}

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

NGRAM_ACTOR_BYTES_PER_GRAM = (8 + 4, 16 + 8 + 4)
"""What a `ScanDocuments` actor holds of the n-gram set per gram (doc_filter.ScanDocuments.__init__): the hashes
(uint64) and items (uint32) it keeps, and its peak while loading them (the (hash, item) uint64 table of
`ngrams.npy`, 16 B, read whole before the two are copied out of it)."""


def _scan_work(staged: list[tuple[Source, list[float], float]]) -> tuple[int, int]:
    """(scan units, scan reads) of the doc_scan stage over staged files, each given as (source, every file's
    estimated documents, the source's characters per document): the units and reads doc_filter builds
    (`scan_units`, `scan_reads`) from staging markers of those counts. A file is taken to hold at least one
    document."""
    files, markers = [], {}
    for source, file_docs, chars_per_doc in staged:
        rows = [max(1, round(docs)) for docs in file_docs]
        markers[source.name] = {"rows": sum(rows), "chars": sum(rows) * chars_per_doc}
        files += [(source, {"rows": n, "output": f"{i:05d}.parquet"}) for i, n in enumerate(rows)]
    units = scan_units(files, markers, Path("staging"))
    return len(units), len(scan_reads(units))


def _compute_plan(cfg: DataConfig, sources: list[Source], inputs: dict, ngrams: NgramSet | None) -> dict:
    """The plan from the sources' input files ({name: _input_files(...)} of the sources the plan counts)."""
    tokenizer, vocab_size = _tokenizer(cfg)
    dtype = token_dtype(vocab_size)
    itemsize = 2 if dtype == "uint16" else 4
    row_len = cfg.seq_len + 1
    entries, sampled = [], []
    for source in sources:
        if not _planned(source):
            entries.append({"name": source.name, "files": 0, "input_bytes": 0, "weight": 0.0, "estimated_tokens": 0,
                            "hub_bytes": 0, "ratios": None, "sampled": False, "commit": None})
            continue
        files, here, commit = inputs[source.name]
        ratios = None
        if here and tokenizer is not None and not source.is_packed and files:
            ratios = _sample(source, [(path, size) for path, size, _ in files], tokenizer, row_len, cfg.docs_per_pack_batch, dtype,
                             cfg.shuffle.row_group_size, cfg.chat.pack)
            if ratios is None:  # no document in the sampled files: staging will report the source as empty
                ratios = EMPTY
            else:
                sampled.append(ratios)
        entries.append({"name": source.name, "files": len(files), "input_bytes": sum(s for _, s, _ in files),
                        "hub_bytes": 0 if source.is_local else sum(s for _, s, _ in files), "weight": source.weight,
                        "ratios": ratios, "sampled": ratios is not None, "commit": commit,
                        "paths": [p for p, _, _ in files], "sizes": [s for _, s, _ in files],
                        "packed": source.is_packed, "here": here, "source": source,
                        "splits": _packed_splits(source, files) if source.is_packed else None})
    fallback = _mean(sampled)

    staged_bytes = packed_tokens = packed_file_bytes = shard_token_bytes = pack_tasks = documents = 0.0
    worst_pack_chars = 0.0
    per_source = []
    scanned = []  # per staged source: (source, each file's estimated documents, characters per document)
    packed = {split: {"files": 0, "bytes": 0, "rows": 0.0, "row_counts": set(), "linkable": True}
              for split in ("train", "val")}
    for e in entries:
        if not e["files"] or e["ratios"] is EMPTY:
            per_source.append({k: e[k] for k in ("name", "files", "input_bytes")}
                              | {"estimated_tokens": 0, "sampled": e["ratios"] is EMPTY})
            continue
        if e["packed"]:  # released rows: exact from the parquet footers when the files are here
            source_rows = 0.0
            for split, split_files in e["splits"].items():
                info = packed[split]
                for path, size in split_files:
                    if e["here"]:
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
            tokens = source_rows * row_len
            packed_tokens += tokens
            shard_token_bytes += tokens * DEFAULTS.shard_per_token
            per_source.append({"name": e["name"], "files": e["files"], "input_bytes": e["input_bytes"],
                               "estimated_tokens": int(tokens), "sampled": False, "commit": e["commit"]})
            continue
        r = e["ratios"] or fallback
        text_per_byte = r.text_per_input_byte if e["ratios"] else next(
            (ratio for suffix, ratio in TEXT_PER_INPUT_BYTE.items()
             if all(p.endswith(suffix) for p in e["paths"])), fallback.text_per_input_byte)
        text = e["input_bytes"] * text_per_byte
        tokens = text * r.tokens_per_text_byte * e["weight"] * r.packed_per_token
        staged_bytes += text * r.staged_per_text_byte
        packed_tokens += tokens
        docs = text * r.docs_per_text_byte
        documents += docs
        scanned.append((e["source"], [size * text_per_byte * r.docs_per_text_byte for size in e["sizes"]],
                        r.chars_per_text_byte / r.docs_per_text_byte))
        batches = max(e["files"], math.ceil(docs / cfg.docs_per_pack_batch))
        pack_tasks += batches
        packed_file_bytes += tokens * r.packed_file_per_token + batches * r.parquet_file_bytes
        shard_token_bytes += tokens * r.shard_per_token
        chars_per_doc = r.chars_per_text_byte / r.docs_per_text_byte
        worst_pack_chars = max(worst_pack_chars, chars_per_doc * min(docs, cfg.docs_per_pack_batch))
        per_source.append({"name": e["name"], "files": e["files"], "input_bytes": e["input_bytes"],
                           "text_bytes": int(text), "estimated_tokens": round(tokens), "sampled": e["sampled"],
                           "commit": e["commit"]})

    rows = packed_tokens / row_len
    row_bytes = row_len * itemsize + 8
    all_packed = bool(entries) and all(e.get("packed") for e in entries if e["files"])
    if all_packed:  # each split on its own (pipeline.run_stage_shuffle_packed)
        split_rows = {split: info["rows"] for split, info in packed.items()}
        split_input = {split: info["bytes"] for split, info in packed.items()}
        methods = {}
        for split, info in packed.items():
            # the validation split is shuffled when duplicates of training rows are dropped from it: the released
            # data has such rows (issue 29), and which files lose rows is known only after the search
            shuffled = (info["files"] != cfg.num_shards or len(info["row_counts"]) > 1
                        or (split == "val" and cfg.drop_val_duplicates))
            methods[split] = "shuffle" if shuffled else "hard_link" if info["linkable"] else f"convert_{dtype}"
    else:
        split_rows = {"train": rows * (1 - cfg.val_fraction), "val": rows * cfg.val_fraction}
        split_input = {split: packed_file_bytes * n / max(rows, 1) for split, n in split_rows.items()}
        methods = {"train": "shuffle", "val": "shuffle"}
    shuffled = [split for split, method in methods.items() if method == "shuffle"]
    map_split_bytes = {split: split_rows[split] * row_bytes if split in shuffled else 0.0 for split in methods}
    map_bytes = sum(map_split_bytes.values())
    map_tasks = math.ceil(map_bytes / (cfg.shuffle.map_mib << 20)) if shuffled else 0
    split_plans = {name: plan_split(max(int(split_rows[name]), cfg.num_shards), cfg.num_shards, row_bytes,
                                    cfg.shuffle.reducer_mib << 20, name) for name in shuffled}
    reducers = {name: plan["reducers"] for name, plan in split_plans.items()}
    shard_split_bytes = {  # same rows, same encoding; a hard-linked file is no new byte
        split: 0.0 if method == "hard_link" else (shard_token_bytes * split_rows[split] / max(rows, 1)
                                                  + cfg.num_shards * fallback.parquet_file_bytes)
        for split, method in methods.items()}
    hub_bytes = sum(e["hub_bytes"] for e in entries)
    disk = {"download": hub_bytes}
    disk["staging"] = disk["download"] + staged_bytes
    staged_files = sum(e["files"] for e in entries if not e.get("packed"))
    filtering = not all_packed and (cfg.decontaminate.mode != "none" or cfg.dedup != "none")
    buckets = max(1, math.ceil(documents / DOCS_PER_BUCKET)) if filtering and cfg.dedup == "exact" else 0
    scan_unit_count, scan_read_count = _scan_work(scanned) if filtering else (0, 0)
    hash_tables = 16 * documents + NPY_HEADER * scan_unit_count if filtering else 0.0  # doc_scan: (hash, row) per doc
    duplicate_keys = 8 * documents + NPY_HEADER * buckets if buckets else 0.0  # doc_dedup, at most every document
    rewritten = staged_bytes if filtering and (cfg.decontaminate.mode == "drop" or cfg.dedup == "exact") else 0.0
    ngram_file = 16 * len(ngrams.hashes) + NPY_HEADER if filtering and ngrams is not None else 0.0
    if filtering:  # the filtered files stay; the hash tables and duplicate keys until the stage commits
        disk["filter"] = disk["staging"] + rewritten + ngram_file + hash_tables + duplicate_keys
    disk["pack"] = disk["staging"] + rewritten + ngram_file + packed_file_bytes
    disk["shuffle"] = (disk["pack"] + map_bytes + 8 * (cfg.num_shards + 1) * len(shuffled) * map_tasks
                       + sum(shard_split_bytes.values()))
    disk = {k: int(v) for k, v in disk.items()}
    peak = max(disk.values())

    # bytes each stage reads and writes under output_dir (or reads from a local_dir)
    io = {"download": {"read": hub_bytes, "written": hub_bytes}}  # read: each file hashed once when verified
    if all_packed:  # the validation files read once more; the training files too unless they go per file (their
        # tasks then look their rows up while they convert them: one pass)
        io["dedup"] = {"read": split_input["val"] + (split_input["train"] if methods["train"] == "shuffle" else 0),
                       "written": 0}
    else:
        io["staging"] = {"read": sum(e["input_bytes"] for e in entries), "written": staged_bytes}
        if filtering:
            io["filter"] = {"read": staged_bytes + (hash_tables + duplicate_keys if buckets else 0) + rewritten,
                            "written": hash_tables + duplicate_keys + rewritten + ngram_file}
        io["pack"] = {"read": staged_bytes, "written": packed_file_bytes}
    for split, method in methods.items():
        io[f"shards_{split}"] = {
            "read": split_input[split] + map_split_bytes[split],  # the shuffle reads its map files back
            "written": map_split_bytes[split] + shard_split_bytes[split]}
    io = {stage: {k: int(v) for k, v in figures.items()} for stage, figures in io.items()}

    cpus = cfg.local_ray.num_cpus or os.cpu_count() or 1
    text_total = sum(p.get("text_bytes", 0) for p in per_source)
    doc_tokens = 0.0 if all_packed else packed_tokens  # packed data is not encoded; the encoder's work is about the packed tokens (copies are encoded once)
    filter_rate = ("filter_scan_text_bytes_per_s_per_cpu" if cfg.decontaminate.mode != "none"
                   else "filter_hash_text_bytes_per_s_per_cpu")  # the n-gram check dominates when it runs
    seconds = {
        "download": hub_bytes / THROUGHPUT["download_bytes_per_s"][0],
        "staging": text_total / (THROUGHPUT["staging_text_bytes_per_s_per_cpu"][0] * cpus),
        **({"filter": text_total / (THROUGHPUT[filter_rate][0] * cpus)} if filtering else {}),
        "pack": doc_tokens / (THROUGHPUT["pack_tokens_per_s_per_cpu"][0] * cpus),
        "shuffle": sum(split_input.values()) / (THROUGHPUT["shuffle_bytes_per_s_per_cpu"][0] * cpus),
    }
    # the largest map group, taken as one file (an upper bound); released files are read as int64 (8 bytes)
    group_rows = int(min(rows, (cfg.shuffle.map_mib << 20) // row_bytes + 1))
    input_width = 8 if all_packed else itemsize
    memory = {
        "pack_task": int(256 * 2**20 + 24 * worst_pack_chars),
        "map_task": map_task_memory([{"train_rows": group_rows, "val_rows": 0}], row_len, dtype, input_width, False),
        "reduce_task": max([reduce_task_memory(p, row_len, dtype) for p in split_plans.values()], default=0),
    }
    if buckets:  # doc_filter.run_filter's declaration
        memory["dedup_task"] = int(256 * 2**20 + 48 * documents / buckets)
    dedup_tasks = (packed["val"]["files"] + (packed["train"]["files"] if methods["train"] == "shuffle" else 0)
                   if all_packed else 0)
    counts = {
        "input_files": sum(e["files"] for e in entries),
        "staged_files": staged_files,
        "pack_tasks": int(pack_tasks),
        "map_tasks": map_tasks,
        "map_files": 2 * len(shuffled) * map_tasks,  # per shuffled split: data + index
        "per_file_tasks": sum(cfg.num_shards for method in methods.values() if method != "shuffle"),
        "reducers": sum(reducers.values()),
        "shard_files": 2 * cfg.num_shards,
        "ray_tasks": int(sum(e["files"] for e in entries) + dedup_tasks + pack_tasks + map_tasks
                         + sum(reducers.values()) + sum(cfg.num_shards for m in methods.values() if m != "shuffle")
                         + (scan_read_count + buckets + staged_files if filtering else 0)),
    }
    if filtering:  # doc_scan: one read (and actor call) per group of scan units; doc_dedup: one task per bucket;
        # doc_filter: one per staged file (the bound: a file that loses no document is linked, no task)
        counts.update(scan_units=scan_unit_count, scan_tasks=scan_read_count, dedup_tasks=buckets,
                      filter_tasks=staged_files)
    scan_actors = min(cpus, scan_read_count)  # doc_filter.run_scan: one actor per CPU, at most one per read
    plan = {
        "sources": per_source,
        "input_bytes": int(sum(e["input_bytes"] for e in entries)),
        "estimated_tokens": round(packed_tokens),  # a product of sampled ratios: round, not truncate
        "estimated_rows": int(rows),
        "token_dtype": dtype,
        "peak_disk_bytes": peak,
        "disk_after_stage_bytes": disk,
        "io_bytes": io,
        "reshard_method": methods,
        "memory_per_task_bytes": memory,
        "filter": None if not filtering else {
            "documents": int(documents), "staged_bytes": int(staged_bytes), "rewritten_bytes": int(rewritten),
            "hash_table_bytes": int(hash_tables), "duplicate_key_bytes": int(duplicate_keys),
            "ngram_set": None if cfg.decontaminate.mode == "none" else {
                "built_on": "driver, before any stage (pipeline.eval_ngrams); saved as ngrams.npy in the filter "
                            "stage's directory, loaded from it once by each ScanDocuments actor",
                "actors": scan_actors,
                **({"grams": None, "why": "a Hub evaluation set is not fetched yet: built when the run starts"}
                   if ngrams is None else
                   {"grams": len(ngrams.hashes), "items": len(ngrams.sources), "file_bytes": int(ngram_file),
                    "bytes_per_actor": NGRAM_ACTOR_BYTES_PER_GRAM[0] * len(ngrams.hashes),
                    "load_peak_bytes_per_actor": NGRAM_ACTOR_BYTES_PER_GRAM[1] * len(ngrams.hashes),
                    "eval_sets": [o.get("path") or f"{o['hub']}@{o['commit'][:12]}" for o in ngrams.origins]})}},
        "object_store_bytes_per_task": 4096,  # tasks return a few integers; data moves through files
        "counts": counts,
        "estimated_seconds": {k: round(v, 1) for k, v in seconds.items()},
        "cpus": cpus,
        "throughputs": {k: {"value": v, "source": why} for k, (v, why) in THROUGHPUT.items()},
        "unsampled_sources": [p["name"] for p in per_source if p["files"] and not p["sampled"]],
        "unsupported_sources": [s.name for s in sources if s.requires_software_heritage_aws_download
                                and s.weight > 0 and not s.is_packed],
    }
    return plan


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
        raise DataError(f"output_dir {cfg.root}: the run needs {needed / 2**30:.2f} GiB more disk at its peak "
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
                         f"{_size(grams['bytes_per_actor'])} per scan actor, actors: {grams['actors']}, "
                         f"{_size(grams['load_peak_bytes_per_actor'])} while loading), built on the driver"))
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

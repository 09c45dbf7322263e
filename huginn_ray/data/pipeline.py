"""The data preparation job, stage by stage: download -> staging -> filter -> pack -> shuffle.

Each stage reads the previous stage's output from disk and skips itself when its own output is complete and was
built from the same inputs (huginn_ray/data/layout.py), so a rerun after a failure redoes only what is missing,
and `--stage NAME` runs one stage alone.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

from huginn_ray import storage
from huginn_ray.cluster.local_ray import connect_ray
from huginn_ray.data import layout
from huginn_ray.data.bucket_publish import publish_to_bucket
from huginn_ray.data.bucket_sources import mirror_bucket_inputs, mirrored_hashes
from huginn_ray.data.config import DataConfig
from huginn_ray.data.formatting import DataError
from huginn_ray.data.hub_download import PROVENANCE, DownloadError, download_sources, downloaded_files
from huginn_ray.data.plan import build_plan
from huginn_ray.data.decontaminate import EVAL_CACHE, DropGuard, NgramSet, build_ngram_set, eval_files
from huginn_ray.data.dedup import duplicates_found, find_val_duplicates, sorted_unique, validation_hashes
from huginn_ray.data.doc_filter import filter_fingerprint, run_filter
from huginn_ray.data.filter_counts import filter_counts
from huginn_ray.data.execution import original_error
from huginn_ray.data.per_file import per_file_method
from huginn_ray.data.shard_build import per_file_shards, run_shuffle, shard_work_id, write_shards
from huginn_ray.data.shards import MANIFEST
from huginn_ray.data.sources import Source, load_sources
from huginn_ray.data.staging import list_local_files, stage_sources
from huginn_ray.data.tokenize_pack import pack_fingerprint, run_pack
from huginn_ray.data.tokens import TokenRangeError, token_column_error, token_dtype
from huginn_ray.data.tokenizer import TOKENIZER_FILE, file_sha256, special_token_ids

STAGES = ("download", "staging", "filter", "pack", "shuffle")


def init_ray(cfg: DataConfig, quiet: bool = False) -> Callable[[], None]:
    """Connect to the cluster in RAY_ADDRESS (set by `ray job submit`), else start a private local Ray
    (huginn_ray.cluster.local_ray.connect_ray; in `local_ray.temp_dir` when the config names one).

    Ray Data shows its progress bars (one per stage's operator: rows, throughput, ETA; on a console that is not a
    terminal, progress lines every 10 s) unless `quiet`.

    Returns what stops the local Ray this call started and removes the temp dir it made for it (a no-op
    when it started none: a cluster, or a Ray the caller had already initialised)."""
    import ray
    from ray.data import DataContext

    connection = None
    if not ray.is_initialized():
        store = cfg.local_ray.object_store_mib
        connection = connect_ray(temp_dir=cfg.local_ray.temp_dir, temp_prefix="hrdata_",
                                 num_cpus=cfg.local_ray.num_cpus, object_store_memory=store << 20 if store else None)
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = not quiet
    ctx.print_on_execution_start = not quiet
    # on a console that is not a terminal (`ray job submit`, a log file) Ray Data logs the progress instead, every
    # RAY_DATA_NON_TTY_PROGRESS_LOG_INTERVAL seconds (10), through a logger that quiet_local_ray sets to ERROR
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR if quiet else logging.INFO)
    return connection.stop if connection is not None and connection.local else (lambda: None)


def check_supported(sources: list[Source]) -> None:
    for source in sources:
        if source.requires_software_heritage_aws_download and source.weight > 0:
            raise DataError(f"source {source.name!r} ({source.address}) needs file contents from the Software "
                            "Heritage S3 bucket, which this pipeline does not download: set its weight to 0 to "
                            "leave it out, or provide its files as a local_dir source")


def run_stage_download(cfg: DataConfig, sources: list[Source]) -> dict[str, dict]:
    sources = [s for s in sources if s.weight > 0 or s.is_packed]
    root = cfg.root / "download"
    provenance = download_sources([s for s in sources if not s.is_local], root, cfg.download)
    if provenance:
        layout.write_json(root / "manifest.json", {"sources": provenance})
    return provenance


def source_inputs(cfg: DataConfig, source: Source) -> list[Path]:
    if source.is_local:
        files = list_local_files(source)
        if not files and source.weight > 0:
            raise DataError(f"source {source.name!r}: no file under {source.resolved_local_dir()} matches "
                            f"{source.file_patterns}")
        return files
    if source.weight == 0:
        return []
    provenance = layout.read_marker(cfg.root / "download" / source.name, PROVENANCE)
    if provenance is None:
        raise DataError(f"source {source.name!r} is not downloaded yet ({cfg.root / 'download' / source.name}); "
                        "run the download stage first")
    return downloaded_files(cfg.root / "download", provenance)


def packed_only(sources: list[Source]) -> bool:
    """True when every source is already packed; mixing packed and document sources is refused."""
    packed = [s.name for s in sources if s.is_packed]
    if packed and len(packed) != len(sources):
        others = [s.name for s in sources if not s.is_packed]
        raise DataError(f"source list mixes packed sources ({', '.join(packed)}) with document sources "
                        f"({', '.join(others)}): prepare them with separate configs")
    return bool(packed)


def check_chat_not_mixed(sources: list[Source]) -> None:
    """Refuse a source list that mixes chat sources with others: the shards of one config either all carry a
    loss mask or none does (pretraining shards stay as they are; the trainer refuses shards of both kinds)."""
    chat = [s.name for s in sources if s.is_chat]
    if chat and len(chat) != len(sources):
        others = [s.name for s in sources if not s.is_chat]
        raise DataError(f"source list mixes chat sources ({', '.join(chat)}) with other sources "
                        f"({', '.join(others)}): chat rows carry a loss mask, the others none; prepare them with "
                        "separate configs")


def check_sources(sources: list[Source]) -> None:
    """What a source list may not be, refused by name before any work: sources this pipeline cannot fetch, packed
    sources mixed with others, chat sources mixed with others."""
    check_supported(sources)
    packed_only(sources)
    check_chat_not_mixed(sources)


def run_stage_staging(cfg: DataConfig, sources: list[Source]) -> dict[str, dict]:
    if packed_only(sources):
        print("[staging] packed sources: nothing to stage", flush=True)
        return {}
    return stage_sources([(s, source_inputs(cfg, s)) for s in sources], cfg.root / "staging")


def staging_markers(cfg: DataConfig, sources: list[Source]) -> dict[str, dict]:
    markers = {}
    for source in sources:
        marker = layout.read_marker(cfg.root / "staging" / source.name)
        if marker is None:
            raise DataError(f"source {source.name!r} is not staged yet; run the staging stage first")
        markers[source.name] = marker
    return markers


def filters_on(cfg: DataConfig) -> bool:
    return cfg.decontaminate.mode != "none" or cfg.dedup != "none"


def eval_ngrams(cfg: DataConfig, fetch: bool = True) -> NgramSet | None:
    """The evaluation sets' n-gram set (None when decontamination is off); built from small files, so every run
    builds it first, on the driver, refusing a missing Hub set or a bad evaluation file by name before any stage
    runs. With `fetch` false (`--plan`) nothing is fetched: None when a Hub set is not in the cache yet."""
    if cfg.decontaminate.mode == "none":
        return None
    found = eval_files(cfg.decontaminate.against, cfg.root, cfg.download, fetch)
    if found is None:
        return None
    files, origins = found
    for origin in origins if fetch else ():  # (--plan --json prints nothing but the plan)
        if "commit" in origin:
            print(f"[decontaminate] {origin['hub']} ({origin['config']}, {origin['split']}) at "
                  f"{origin['commit'][:12]}: {len(origin['files'])} file(s) in {cfg.root / EVAL_CACHE}", flush=True)
    d = cfg.decontaminate
    return build_ngram_set(files, d.ngram, origins, d.min_ngram, DropGuard(d.max_drop_fraction, d.min_guarded_drops))


def expected_filter_fingerprint(cfg: DataConfig, sources: list[Source], markers: dict[str, dict],
                                ngrams: NgramSet | None) -> str:
    return filter_fingerprint(sources, markers, cfg.decontaminate.mode, cfg.decontaminate.ngram,
                              ngrams.digest if ngrams else None, cfg.dedup, near_settings(cfg))


def near_settings(cfg: DataConfig) -> dict | None:
    """The near_dedup settings the filter stage runs with (None unless dedup is near)."""
    return dataclasses.asdict(cfg.near_dedup) if cfg.dedup == "near" else None


def run_stage_filter(cfg: DataConfig, sources: list[Source], ngrams: NgramSet | None = None) -> dict:
    if packed_only(sources) or not filters_on(cfg):
        print("[filter] decontaminate and dedup are off" if not packed_only(sources) else
              "[filter] packed sources: nothing to filter", flush=True)
        return {}
    markers = staging_markers(cfg, sources)
    return run_filter(sources, markers, cfg.root / "staging", cfg.root / "filtered", mode=cfg.decontaminate.mode,
                      ngrams=ngrams, dedup=cfg.dedup, near=near_settings(cfg),
                      fingerprint=expected_filter_fingerprint(cfg, sources, markers, ngrams))


def documents_to_pack(cfg: DataConfig, sources: list[Source], ngrams: NgramSet | None) -> tuple[Path, dict]:
    """Where the pack stage reads documents, with their markers: `filtered/` when a filter is on, else `staging/`.
    Sources the filter skips (weight 0) keep their staging markers."""
    markers = staging_markers(cfg, sources)
    if not filters_on(cfg):
        return cfg.root / "staging", markers
    filtered = layout.read_marker(cfg.root / "filtered")
    if filtered is None or filtered["fingerprint"] != expected_filter_fingerprint(cfg, sources, markers, ngrams):
        raise DataError(f"no filtered documents for these sources and settings at {cfg.root / 'filtered'}; run "
                        "the filter stage first")
    return cfg.root / "filtered", {**markers, **filtered["sources"]}


def tokenizer_facts(cfg: DataConfig) -> dict:
    tokenizer_file = cfg.tokenizer_dir / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        raise DataError(f"no tokenizer at {tokenizer_file}: run jobs/train_tokenizer.py with this config first, "
                        "or set tokenizer.path to an existing tokenizer directory")
    ids = special_token_ids(cfg.tokenizer_dir)
    return {"tokenizer_file": str(tokenizer_file), "tokenizer_sha256": file_sha256(tokenizer_file),
            "vocab_size": ids["vocab_size"],
            "bos_id": ids["bos"], "eos_id": ids["eos"], "pad_id": ids["pad"]}


def check_document_delimiters(tokenizer_file: str, bos_id: int, eos_id: int) -> None:
    """Refuse a tokenizer that does not wrap every document in BOS ... EOS: packed rows need the delimiters."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(tokenizer_file).encode("Huginn probe: the raven flies.").ids
    if len(ids) < 3 or ids[0] != bos_id or ids[-1] != eos_id:
        raise DataError(f"tokenizer {tokenizer_file} does not wrap documents in BOS ({bos_id}) ... EOS ({eos_id}): "
                        f"a probe text encodes to {ids[:3]} ... {ids[-3:]}. Packing without document delimiters "
                        "would run documents together; use a tokenizer whose post-processor adds both "
                        "(jobs/train_tokenizer.py writes one)")


def run_stage_pack(cfg: DataConfig, sources: list[Source], ngrams: NgramSet | None = None) -> dict:
    if packed_only(sources):
        print("[pack] packed sources: nothing to tokenise or pack", flush=True)
        return {}
    documents, markers = documents_to_pack(cfg, sources, ngrams)
    facts = tokenizer_facts(cfg)
    check_document_delimiters(facts["tokenizer_file"], facts["bos_id"], facts["eos_id"])
    fingerprint, fingerprint_inputs = pack_fingerprint(sources, markers, facts["tokenizer_sha256"], cfg.seq_len,
                                                       cfg.seed, cfg.val_fraction, cfg.docs_per_pack_batch,
                                                       cfg.chat.pack)
    if any(s.is_chat for s in sources):
        from tokenizers import Tokenizer

        from huginn_ray.data.chat import chat_token_ids
        try:  # before any task: a tokenizer without the template's special tokens is refused by name
            chat_token_ids(Tokenizer.from_file(facts["tokenizer_file"]))
        except ValueError as err:
            raise DataError(f"{facts['tokenizer_file']}: {err}") from None
    return run_pack(sources, markers, documents, Path(facts["tokenizer_file"]), cfg.root / "packed",
                    seq_len=cfg.seq_len, seed=cfg.seed, val_fraction=cfg.val_fraction,
                    docs_per_batch=cfg.docs_per_pack_batch, vocab_size=facts["vocab_size"],
                    fingerprint=fingerprint, fingerprint_inputs=fingerprint_inputs, extra_marker=facts,
                    max_document_chars=cfg.max_document_chars, chat_pack=cfg.chat.pack)


def check_token_column(source: Source, path: Path, schema) -> None:
    """Refuse a packed file whose `input_ids` is not a list of integers (floats would be truncated, strings
    cannot be ids), naming source, file and type, before any path (dedup, per file, shuffle) reads it."""
    why = token_column_error(schema)
    if why:
        raise DataError(f"source {source.name!r}: {path}: {why}")


def packed_source_files(cfg: DataConfig, source: Source) -> dict[str, list[dict]]:
    """The files of a packed source per split, with row counts and provenance; errors name source and pattern."""
    import fnmatch

    import pyarrow.parquet as pq

    if source.is_local:
        root = source.resolved_local_dir()
        paths = {p.relative_to(root).as_posix(): p for p in list_local_files(source)}
        hashes: dict = {}
    else:
        provenance = layout.read_marker(cfg.root / "download" / source.name, PROVENANCE)
        if provenance is None:
            raise DataError(f"source {source.name!r} is not downloaded yet; run the download stage first")
        paths = {f["path"]: cfg.root / "download" / source.name / f["path"] for f in provenance["files"]}
        hashes = {f["path"]: f.get("sha256") or f.get("git_sha1") for f in provenance["files"]}
    out: dict[str, list[dict]] = {}
    for split, patterns in (("train", source.train_files), ("val", source.val_files)):
        other = source.val_files if split == "train" else source.train_files
        chosen = []
        for rel in sorted(paths):
            if any(fnmatch.fnmatch(rel, p) for p in patterns):
                if any(fnmatch.fnmatch(rel, p) for p in other):
                    raise DataError(f"source {source.name!r}: {rel} matches both train_files and val_files")
                chosen.append(rel)
        if not chosen:
            raise DataError(f"source {source.name!r}: no file matches {split}_files {patterns}")
        entries = []
        for rel in chosen:
            path = paths[rel]
            pf = pq.ParquetFile(path)
            check_token_column(source, path, pf.schema_arrow)
            rows = pf.metadata.num_rows
            entries.append({"path": str(path), "rel": rel, "size": path.stat().st_size, "hash": hashes.get(rel),
                            "train_rows": rows if split == "train" else 0, "val_rows": rows if split == "val" else 0})
        out[split] = entries
    return out


def run_provenance(cfg: DataConfig, sources: list[Source]) -> dict:
    """What produced these shards besides the data: library versions, the config (and its hash), source commits.

    `huginn_ray_git` is the commit of this package's checkout (None outside a git checkout; `+dirty` when it has
    uncommitted changes); a source's commit is the Hub commit its files were downloaded at (None for local_dir);
    `eval_sets`, with decontamination on, the origin of each evaluation set (a Hub set's resolved commit and files
    with their hashes), as the filter stage recorded it with the n-gram set."""
    import dataclasses
    import importlib.metadata
    import subprocess

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(Path(__file__).parent), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        commit = None
    config = dataclasses.asdict(cfg)
    commits = {}
    for source in sources:
        marker = None if source.is_local else layout.read_marker(cfg.root / "download" / source.name, PROVENANCE)
        commits[source.name] = marker["commit"] if marker else None
    ngrams = cfg.root / "filtered" / "ngrams.json"
    eval_sets = json.loads(ngrams.read_text())["origins"] if cfg.decontaminate.mode != "none" and ngrams.is_file() \
        else None
    return {"versions": {name: version(name) for name in ("huginn_ray", "ray", "pyarrow", "tokenizers", "numpy")},
            "huginn_ray_git": commit, "config": config, "config_sha256": layout.fingerprint(config),
            "source_commits": commits, "eval_sets": eval_sets}


def packed_source_provenance(cfg: DataConfig, source: Source, split_files: dict[str, list[dict]]) -> dict:
    """A packed source's entry in the manifest's `sources`: where its files come from (a Hub commit, a local
    directory, or the bucket prefix whose local copy was read), its rows, each file's size and hash (a Hub file's
    verified hash, a bucket object's sha256 taken when copied; a local file's is added as the shuffle reads it)."""
    marker = None if source.is_local else layout.read_marker(cfg.root / "download" / source.name, PROVENANCE)
    copied = mirrored_hashes(cfg, source)
    return {
        "kind": "packed", "address": source.address,
        "local_dir": (source.mirrored_from or str(source.resolved_local_dir())) if source.is_local else "",
        "revision": source.revision, "commit": marker["commit"] if marker else None,
        "train_rows": sum(f["train_rows"] for f in split_files["train"]),
        "val_rows": sum(f["val_rows"] for f in split_files["val"]),
        "files": [{"path": f["rel"], "size": f["size"], "hash": f["hash"] or copied.get(f["rel"])}
                  for split in ("train", "val") for f in split_files[split]],
    }


def drop_val_duplicates(cfg: DataConfig, per_source: dict, provenance: dict, duplicates: dict[str, list[int]]) -> dict:
    """Count (and with cfg.drop_val_duplicates leave out) the validation rows that also occur in train
    (`duplicates`: per validation file path, the row numbers), per source.

    Marks the rows to skip in the validation file entries (`skip_rows`, val_rows lowered) and records the counts
    in `provenance`; returns the totals for the manifest."""
    found = 0
    for name, split_files in per_source.items():
        count = sum(len(duplicates[f["path"]]) for f in split_files["val"])
        found += count
        provenance[name]["val_rows_also_in_train"] = count
        if cfg.drop_val_duplicates:
            for f in split_files["val"]:
                f["skip_rows"] = duplicates[f["path"]]
                f["val_rows"] -= len(f["skip_rows"])
            provenance[name]["val_rows"] -= count
        print(f"[dedup] {name}: {count} validation rows also occur in train"
              f"{', dropped from validation' if cfg.drop_val_duplicates and count else ''}", flush=True)
    return {"found": found, "dropped": found if cfg.drop_val_duplicates else 0}


def run_stage_shuffle_packed(cfg: DataConfig, sources: list[Source]) -> dict:
    """Already packed sources (e.g. the released Huginn data) straight into N + N shards, each split on its own:
    when a split is N files of one row count, one file per rank (hard-linked as they are when they meet the shard
    contract, else converted to the storage type file by file: per_file.per_file_method), else shuffled.

    Validation rows that also occur in train (dedup.py) are found first. When the training split goes per file,
    in one pass over its files: the tasks that convert (or verify) them also look their rows up in the validation
    hashes, and its shards are committed before the validation split is written. A validation split that loses
    duplicate rows is shuffled (its files no longer hold one row count); the training split stays per file."""
    facts = tokenizer_facts(cfg)
    per_source, provenance = {}, {}
    for source in sources:
        split_files = packed_source_files(cfg, source)
        provenance[source.name] = packed_source_provenance(cfg, source, split_files)
        per_source[source.name] = split_files
    input_fingerprint = layout.fingerprint({
        "packed": {name: [(f["path"], f["size"], f["hash"] or os.stat(f["path"]).st_mtime_ns) for f in v["train"] + v["val"]]
                   for name, v in per_source.items()},
        "tokenizer": facts["tokenizer_sha256"], "seq_len": cfg.seq_len})
    fingerprint, fingerprint_inputs = layout.stage_fingerprint({
        "packed": input_fingerprint, "num_shards": cfg.num_shards, "seed": cfg.seed,
        "row_group_size": cfg.shuffle.row_group_size, "drop_val_duplicates": cfg.drop_val_duplicates})
    extra = {key: facts[key] for key in ("tokenizer_sha256", "vocab_size", "bos_id", "eos_id", "pad_id")}
    extra.update(input_fingerprint=input_fingerprint, fingerprint_inputs=fingerprint_inputs, sources=provenance,
                 empty_sources=[], staged_documents={}, provenance=run_provenance(cfg, sources))
    existing = layout.current_marker(cfg.root / "shards", fingerprint, fingerprint_inputs, "shuffle", MANIFEST)
    if existing is not None:
        print(f"[shuffle] complete ({cfg.num_shards} + {cfg.num_shards} shards), skipped", flush=True)
        return existing
    dtype, vocab_size, row_len = token_dtype(facts["vocab_size"]), facts["vocab_size"], cfg.seq_len + 1
    hash_inputs = any(s.is_local for s in sources)
    settings = dict(row_len=row_len, token_dtype=dtype, vocab_size=vocab_size,
                    row_group_size=cfg.shuffle.row_group_size, hash_inputs=hash_inputs)
    train = [f for v in per_source.values() for f in v["train"]]
    val = [f for v in per_source.values() for f in v["val"]]
    saved = cfg.root / "dedup" / input_fingerprint
    train_method, train_blocker = per_file_method(train, "train", cfg.num_shards, dtype)
    per_file = {}
    if train_blocker is None:
        val_hashes = validation_hashes(val, row_len, dtype, vocab_size, saved.with_suffix(".npz"))
        work_id = shard_work_id(fingerprint, cfg.shuffle.map_mib, cfg.shuffle.reducer_mib, dtype)
        found = per_file_shards("train", train_method, train, cfg.root / "shards", work_id, fingerprint,
                                lookup=sorted_unique(val_hashes), **settings)
        duplicates = duplicates_found(val, val_hashes, sorted_unique(found))
        per_file["train"] = (train_method, train)
    else:
        duplicates = find_val_duplicates(train, val, row_len, dtype, vocab_size, saved)
    extra["val_duplicates"] = drop_val_duplicates(cfg, per_source, provenance, duplicates)
    val_method, val_blocker = per_file_method(val, "val", cfg.num_shards, dtype)
    if val_blocker is None and extra["val_duplicates"]["dropped"]:
        val_method, val_blocker = "shuffle", f"{extra['val_duplicates']['dropped']} validation rows are left out"
    if val_blocker is None:
        per_file["val"] = (val_method, val)
    for split, blocker, files in (("train", train_blocker, train), ("val", val_blocker, val)):
        if blocker is not None and len(files) == cfg.num_shards:
            print(f"[shuffle] {split}: num_shards={cfg.num_shards} equals the released file count, but the files "
                  f"cannot become the shards one by one ({blocker}): re-sharding them through the shuffle",
                  flush=True)
    # the shuffled files in the global row order of the sources' file lists (train before val per source)
    shuffle_files = [f for v in per_source.values() for split in ("train", "val") if split not in per_file
                     for f in v[split]]
    return write_shards(shuffle_files, per_file, shard_root=cfg.root / "shards", num_shards=cfg.num_shards,
                        seed=cfg.seed, reducer_mib=cfg.shuffle.reducer_mib, map_mib=cfg.shuffle.map_mib,
                        fingerprint=fingerprint, manifest_extra=extra, **settings)


def check_rows_for_shards(pack_marker: dict, num_shards: int) -> None:
    """Refuses packed data with fewer train rows than shards, naming seq_len when no row was cut at all: a row
    never spans two staged files, so a corpus of files shorter than a row packs to nothing."""
    train_rows = sum(s["train_rows"] for s in pack_marker["sources"].values())
    if train_rows >= num_shards:
        return
    tokens = sum(s["doc_tokens"] for s in pack_marker["sources"].values())
    raise DataError(f"seq_len={pack_marker['seq_len']}: the pack stage cut {train_rows} train rows from {tokens:,} "
                    f"document tokens, fewer than num_shards={num_shards}. A row's {pack_marker['seq_len'] + 1:,} "
                    "tokens come from one pack batch (one staged file's run of up to docs_per_pack_batch "
                    "documents): lower seq_len or num_shards, or use sources whose files hold more tokens than a row")


def run_stage_shuffle(cfg: DataConfig, sources: list[Source]) -> dict:
    if packed_only(sources):
        return run_stage_shuffle_packed(cfg, sources)
    pack_marker = layout.read_marker(cfg.root / "packed")
    if pack_marker is None:
        raise DataError(f"no packed data at {cfg.root / 'packed'}; run the pack stage first")
    check_rows_for_shards(pack_marker, cfg.num_shards)
    markers = staging_markers(cfg, sources)
    empty = sorted(name for name, m in markers.items() if m["rows"] == 0)
    for name in empty:
        print(f"[shuffle] WARNING: source {name!r} has no rows", flush=True)
    fingerprint, fingerprint_inputs = layout.stage_fingerprint({
        "packed": pack_marker["fingerprint"], "num_shards": cfg.num_shards, "seed": cfg.seed,
        "row_group_size": cfg.shuffle.row_group_size})
    extra = {key: pack_marker[key] for key in ("tokenizer_sha256", "vocab_size", "bos_id", "eos_id", "pad_id")}
    extra.update(input_fingerprint=pack_marker["fingerprint"], fingerprint_inputs=fingerprint_inputs,
                 sources=pack_marker["sources"],
                 empty_sources=empty, staged_documents={n: m["rows"] for n, m in markers.items()},
                 records={n: {k: v for k, v in m["records"].items() if k != "first_bad"} for n, m in markers.items()},
                 provenance=run_provenance(cfg, sources))
    if filters_on(cfg):
        filtered = layout.read_marker(cfg.root / "filtered")
        if filtered is None:
            raise DataError(f"no filtered documents at {cfg.root / 'filtered'}; run the filter stage first")
        extra["document_filters"] = filter_counts(filtered)
        extra["decontamination"] = filtered.get("decontamination")
    files = [{"path": str(cfg.root / "packed" / f["file"]), "train_rows": f["train_rows"], "val_rows": f["val_rows"]}
             for f in pack_marker["files"]]
    return run_shuffle(files, pack_marker["seq_len"] + 1, cfg.root / "shards", num_shards=cfg.num_shards,
                       seed=cfg.seed, row_group_size=cfg.shuffle.row_group_size,
                       reducer_mib=cfg.shuffle.reducer_mib, map_mib=cfg.shuffle.map_mib,
                       token_dtype=pack_marker.get("token_dtype", "int32"), vocab_size=pack_marker["vocab_size"],
                       fingerprint=fingerprint, manifest_extra=extra)


def run(cfg: DataConfig, stages: tuple[str, ...] = STAGES) -> dict:
    """Run the given stages in order; returns the shard manifest when the shuffle stage ran."""
    sources = load_sources(cfg.sources)
    check_sources(sources)  # before the plan samples their files
    if cfg.in_bucket:  # the bucket and the credentials, before any stage: the upload comes last
        storage.check_location(cfg.output_dir, "output_dir")
    sources = mirror_bucket_inputs(cfg, sources)  # bucket local_dirs and tokenizer.path, copied for the stages
    # the evaluation sets serve the filter stage (and the pack stage's check that its input is filtered with them):
    # resolved, fetched and read, a bad one refused, before the plan and any stage, only when one of those runs
    ngrams = eval_ngrams(cfg) if {"filter", "pack"} & set(stages) else None
    plan = build_plan(cfg, sources, ngrams)  # refuses a run whose peak disk does not fit output_dir's free space
    print(f"[plan] about {plan['estimated_tokens']:,d} packed tokens, peak disk "
          f"{plan['peak_disk_bytes'] / 2**30:.2f} GiB ({plan['free_bytes'] / 2**30:.1f} GiB free)", flush=True)
    if plan["estimated_rows"] < cfg.num_shards and not plan["unsampled_sources"]:  # the shuffle would refuse
        print(f"[plan] WARNING: about {plan['estimated_rows']} rows of seq_len + 1 = {cfg.seq_len + 1:,} tokens, "
              f"fewer than num_shards={cfg.num_shards}: a row never spans two staged files", flush=True)
    layout.clean_stale_under(cfg.root)
    layout.finish_publish(cfg.root / "shards")
    steps = {"download": run_stage_download, "staging": run_stage_staging,
             "filter": functools.partial(run_stage_filter, ngrams=ngrams),
             "pack": functools.partial(run_stage_pack, ngrams=ngrams), "shuffle": run_stage_shuffle}
    result: dict = {}
    for stage in STAGES:
        if stage not in stages:
            continue
        start = time.time()
        print(f"==> {stage}", flush=True)
        result = steps[stage](cfg, sources)
        print(f"<== {stage} done in {time.time() - start:.1f}s", flush=True)
    if cfg.in_bucket and "shuffle" in stages:  # the stages ran in the scratch directory
        publish_to_bucket(cfg.root, cfg.output_dir, None if storage.is_uri(cfg.tokenizer.path) else cfg.tokenizer_dir)
    return result


def print_last_error(job: str, error: str) -> None:
    """A job's error as its last console line: Ray Data prints its retry hint when the failed stage's iterator is
    collected (the exception's frames hold it), so collect first, then print."""
    import gc
    import sys

    gc.collect()
    print(f"{job}: error: {error}", file=sys.stderr, flush=True)


def root_error(err: BaseException) -> BaseException:
    """The DataError / DownloadError / TokenRangeError behind Ray's wrappers (task errors, user-code errors)."""
    return original_error(err, (DataError, DownloadError, TokenRangeError))

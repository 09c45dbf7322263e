"""The shard stage: packed rows -> the N train + N validation shards of a new version of the shard store.

Each split on its own: a split in `per_file` (already packed data whose split is `num_shards` files of one row count,
huginn_ray/data/per_file.py) becomes its shards one file per rank; every other split goes through the two-pass
global shuffle (huginn_ray/data/shuffle.py). Both commit their files into the work directory `<shard_root>.partial`
(`open_work`), which a rerun with the same inputs and layout keeps: it redoes only what is missing. When every
shard is there, the manifest is written and the shards are published as a new immutable version behind the pointer
`shard_root` (huginn_ray/data/shards.py, the store training reads).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.per_file import per_file_split
from huginn_ray.data.shards import MANIFEST, SPLITS, publish
from huginn_ray.data.shuffle import group_files, plan_split, shuffle_splits
from huginn_ray.data.tokens import MASK, MAX_LIST_IDS, numpy_dtype

last_run_stats: dict = {}
"""Figures of the latest write_shards in this process, for bench/shuffle_scale.py: its tasks, its seconds, the bytes
and map files of the whole shuffle read back from its committed files (shuffle.py `_committed_figures`: every map
group and reducer counted once, whichever attempt committed it), and the largest peak RSS a task reported (tasks
report it with their results, which a dataset stopped by a killed worker loses: the tasks of its rerun report
theirs), those of a split that `per_file_shards` made ahead of it included."""
_ahead_peaks: dict[str, float] = {}
"""Per work id, the largest peak RSS of the per-file splits `per_file_shards` made ahead of `write_shards`, which
takes it into its run's figures (once: a later run of the same work starts from nothing)."""


def run_shuffle(files: list[dict], row_len: int, shard_root: Path, **settings) -> dict:
    """Shuffle the rows of both splits of `files` ({path, train_rows, val_rows}, in global order) into shards;
    returns the manifest (write_shards with no split made per file)."""
    return write_shards(files, {}, row_len, shard_root, **settings)


def shard_work_id(fingerprint: str, map_mib: int, reducer_mib: int, token_dtype: str) -> str:
    """What the files in `<shard_root>.partial` are valid for: the inputs and shard settings (`fingerprint`) and
    the grouping of the shuffle's tasks (map_mib, reducer_mib change which rows a map file holds, not the shards)."""
    return layout.fingerprint({"fingerprint": fingerprint, "map_mib": map_mib, "reducer_mib": reducer_mib,
                               "token_dtype": token_dtype})


def open_work(shard_root: Path, work_id: str, fingerprint: str) -> tuple[Path, bool]:
    """`<shard_root>.partial` and whether it was kept, with what an interrupted run of the same `work_id` committed
    there (its temp files removed); else it is made anew."""
    work = shard_root.with_name(shard_root.name + ".partial")
    previous = layout.read_marker(work, layout.PLAN)
    if previous is not None and previous.get("id") == work_id:
        for stale in work.glob("*/*/*.tmp"):  # half-written by a crashed attempt: never read, removed
            stale.unlink()
        return work, True
    if work.exists():
        print(f"[shuffle] removing {work}: left by a run with other inputs or settings", flush=True)
        shutil.rmtree(work)
    for name in SPLITS:
        for part in ("map", "out", "records"):
            (work / part / name).mkdir(parents=True)
    layout.write_json(work / layout.PLAN, {"id": work_id, "fingerprint": fingerprint})
    return work, False


def _note_peak_rss(peak_rss_mib: float | None) -> None:
    """The largest peak RSS the tasks of a per-file pass reported (None: no task ran) into last_run_stats."""
    if peak_rss_mib is not None:
        last_run_stats["max_task_peak_rss_mib"] = max(last_run_stats.get("max_task_peak_rss_mib", 0.0), peak_rss_mib)


def per_file_shards(split: str, method: str, files: list[dict], shard_root: Path, work_id: str, fingerprint: str,
                    **settings) -> list[np.ndarray]:
    """One split's shards from its files one per rank (`per_file.per_file_split`), committed into
    `<shard_root>.partial` ahead of `write_shards` (which keeps them: same `work_id`); returns per file the `lookup`
    hashes its rows have."""
    work, _ = open_work(Path(shard_root), work_id, fingerprint)
    found, peak_rss_mib = per_file_split(split, method, files, work, digests={}, **settings)
    if peak_rss_mib is not None:
        _ahead_peaks[work_id] = max(_ahead_peaks.get(work_id, 0.0), peak_rss_mib)
    return found


def _plan_shuffle(shuffle_files: list[dict], shuffled: list[str], row_len: int, *, num_shards: int,
                  token_dtype: str, reducer_mib: int, map_mib: int) -> tuple[dict, list[list[dict]], bool]:
    """The shuffle of the splits `shuffled`: each split's plan (shuffle.plan_split), the map groups of the input
    files, and whether the rows carry a loss mask."""
    # every input comes from one producer (the pack stage, or one released dataset): the first file's columns
    # stand for all of them (the map tasks refuse a file that differs)
    with_mask = MASK in pq.read_schema(shuffle_files[0]["path"]).names
    itemsize = np.dtype(numpy_dtype(token_dtype)).itemsize + with_mask
    row_bytes = row_len * itemsize + 8
    plans = {name: plan_split(sum(f[f"{name}_rows"] for f in shuffle_files), num_shards, row_bytes,
                              reducer_mib << 20, name) for name in shuffled}
    for name, plan in plans.items():
        if plan["rows_per_shard"] * row_len > MAX_LIST_IDS:  # a shard's input_ids column is one list<> array
            raise ValueError(f"num_shards={num_shards}: a {name} shard would hold {plan['rows_per_shard']} rows "
                             f"of {row_len} ids, more than the {MAX_LIST_IDS} ids a parquet list column "
                             "addresses; raise num_shards")
    return plans, group_files(shuffle_files, row_bytes, map_mib << 20), with_mask


def write_shards(shuffle_files: list[dict], per_file: dict[str, tuple[str, list[dict]]], row_len: int,
                 shard_root: Path, *, num_shards: int, seed: int, row_group_size: int, reducer_mib: int,
                 map_mib: int, token_dtype: str, vocab_size: int, fingerprint: str, manifest_extra: dict,
                 hash_inputs: bool = False) -> dict:
    """The N train + N validation shards: each split in `per_file` ({split: (method, files)}, methods from
    `per_file.per_file_method`) from its files one per rank, with nothing shuffled again; every other split by the
    two-pass shuffle of the rows `shuffle_files` hold for it. Returns the manifest.

    Skipped when `shard_root` holds a manifest of the same fingerprint. Resumes from `<shard_root>.partial` when a
    run with the same inputs and layout left it: committed map files, shards and per-file shards are kept, only
    the rest is done."""
    shard_root = Path(shard_root)
    existing = layout.current_marker(shard_root, fingerprint, manifest_extra.get("fingerprint_inputs", {}),
                                     "shuffle", MANIFEST)
    work = shard_root.with_name(shard_root.name + ".partial")
    if existing is not None:
        shutil.rmtree(work, ignore_errors=True)
        print(f"[shuffle] complete ({num_shards} + {num_shards} shards), skipped", flush=True)
        return existing
    shuffled = [name for name in SPLITS if name not in per_file]
    plans, groups, with_mask = {}, [], False
    if shuffled:
        plans, groups, with_mask = _plan_shuffle(shuffle_files, shuffled, row_len, num_shards=num_shards,
                                                 token_dtype=token_dtype, reducer_mib=reducer_mib, map_mib=map_mib)
    work_id = shard_work_id(fingerprint, map_mib, reducer_mib, token_dtype)
    work, resumed = open_work(shard_root, work_id, fingerprint)
    if resumed:
        done_maps = sum(1 for _ in (work / "map").glob("*/*.idx.npy"))
        done_shards = sum(1 for _ in (work / "out").glob("*/*.parquet"))
        print(f"[shuffle] resuming {work}: {done_maps}/{2 * len(groups)} map files and "
              f"{done_shards}/{2 * num_shards} shards already written are kept", flush=True)

    last_run_stats.clear()
    _note_peak_rss(_ahead_peaks.pop(work_id, None))  # per_file_shards' tasks ran for this run, before this call
    digests: dict[str, str] = {}
    supervised: dict[str, int] = {}
    if shuffled:
        supervised, figures = shuffle_splits(shuffle_files, groups, plans, work, row_len=row_len, seed=seed,
                                             row_group_size=row_group_size, token_dtype=token_dtype,
                                             vocab_size=vocab_size, hash_inputs=hash_inputs, with_mask=with_mask,
                                             digests=digests)
        last_run_stats.update(figures)
    for name, (method, files) in per_file.items():
        _, peak_rss_mib = per_file_split(name, method, files, work, row_len=row_len, token_dtype=token_dtype,
                                         vocab_size=vocab_size, row_group_size=row_group_size,
                                         hash_inputs=hash_inputs, digests=digests)
        _note_peak_rss(peak_rss_mib)
    for name in SPLITS:
        written = sorted(p.name for p in (work / "out" / name).glob("*.parquet"))
        if written != [f"{r:05d}.parquet" for r in range(num_shards)]:
            raise RuntimeError(f"wrote {len(written)} {name} shards, expected {num_shards}")
        layout.fsync_dir(work / "out" / name)

    if hash_inputs:
        _record_local_hashes(manifest_extra, digests)
    manifest = _manifest(plans, per_file, row_len, num_shards=num_shards, token_dtype=token_dtype, seed=seed,
                         row_group_size=row_group_size, fingerprint=fingerprint, manifest_extra=manifest_extra)
    if with_mask:
        manifest[MASK] = {"dtype": "uint8", "supervised_tokens": supervised}
    publish(work, shard_root, manifest)
    for name in SPLITS:
        if name in plans:
            print(f"[shuffle] {name}: {num_shards} shards x {plans[name]['rows_per_shard']} rows "
                  f"({plans[name]['dropped']} surplus rows dropped)", flush=True)
        else:
            method, files = per_file[name]
            done = ("hard-linked as the shards" if method == "hard_link"
                    else f"converted to {token_dtype} shards one by one")
            print(f"[shuffle] {name}: {num_shards} released files verified and {done} "
                  f"({files[0][f'{name}_rows']} rows each), not shuffled again", flush=True)
    return manifest


def _manifest(plans: dict, per_file: dict[str, tuple[str, list[dict]]], row_len: int, *, num_shards: int,
              token_dtype: str, seed: int, row_group_size: int, fingerprint: str, manifest_extra: dict) -> dict:
    """The manifest of shards made from the shuffle `plans` and the splits made `per_file` (shards.read_manifest
    reads it)."""
    rows = {name: plans[name]["rows_per_shard"] if name in plans else per_file[name][1][0][f"{name}_rows"]
            for name in SPLITS}
    methods = {name: per_file[name][0] if name in per_file else "shuffle" for name in SPLITS}
    return {
        "format": "huginn_ray.shards/2",
        "fingerprint": fingerprint,
        "num_shards": num_shards,
        "seq_len": row_len - 1,
        "row_len": row_len,
        "token_dtype": token_dtype,
        "seed": seed,
        # linked shards keep the released files' own row groups
        **({"row_group_size": row_group_size} if set(methods.values()) != {"hard_link"} else {}),
        "rows_per_shard": rows,
        "tokens_per_shard": {name: rows[name] * row_len for name in SPLITS},
        "total_rows": {name: rows[name] * num_shards for name in SPLITS},
        "dropped_surplus_rows": {name: plans[name]["dropped"] if name in plans else 0 for name in SPLITS},
        "reshard_method": methods,
        **({"source_files": {name: [f["rel"] for f in files] for name, (_, files) in per_file.items()}}
           if per_file else {}),
        **manifest_extra,
    }


def _record_local_hashes(manifest_extra: dict, digests: dict[str, str]) -> None:
    """Local packed inputs: the sha256 of every file read goes into the manifest's file list (Hub files carry the
    hash the download verified)."""
    for info in manifest_extra.get("sources", {}).values():
        for f in info.get("files", []):
            root = info.get("local_dir")
            if root and f.get("hash") is None:
                f["hash"] = digests.get(str(Path(root) / f["path"]))

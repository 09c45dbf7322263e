"""Inputs in a bucket: sources with `local_dir: s3://bucket/prefix` and a `tokenizer.path` in a bucket, copied into
the local directory the stages read, before each run samples or stages them.

    sources = mirror_bucket_inputs(cfg, sources)    # bucket sources now have local_dir = their local copy

The copies live under `DataConfig.mirror_dir` (`<output_dir>/mirror/`, or `scratch_dir`'s with output_dir in a
bucket):

    <source name>/           the objects under the source's prefix that match its file patterns, same relative names
    .tokenizer/              every object under tokenizer.path
    .objects/<name>.json     the record of a copy: its location and, per relative name, the object's size and
                             version (storage.list_versions: S3's ETag), the local file's size and mtime_ns once
                             downloaded, and (packed sources) its sha256

A run lists each prefix (one LIST request per 1,000 objects) and downloads only the objects whose size and version
the record does not hold for an untouched local file, `download.max_in_flight` at a time; every other file is left
as it is, its mtime too, so staging's input fingerprint (staging.input_fingerprint) of an unchanged bucket is
unchanged and nothing is restaged. A file whose object is gone, or no longer matches the patterns, is deleted. The
record is written when a copy is complete; a run killed before that downloads again what it cannot vouch for.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from huginn_ray import storage
from huginn_ray.data import layout
from huginn_ray.data.config import DataConfig
from huginn_ray.data.formatting import DataError
from huginn_ray.data.sources import Source
from huginn_ray.data.tokenizer import file_sha256

RECORDS = ".objects"
"""The folder of `mirror_dir` holding each copy's record (a source name starts with a letter or a digit)."""


def mirror_bucket_inputs(cfg: DataConfig, sources: list[Source], quiet: bool = False) -> list[Source]:
    """Bring the local copies of the bucket inputs up to date (module docstring) and return `sources` with each
    bucket source's local_dir set to its copy (`mirrored_from` holding the prefix); a line per copy unless `quiet`.
    DataError naming the field for a bucket that cannot be reached, a source of weight > 0 with no matching object,
    an empty tokenizer.path."""
    if storage.is_uri(cfg.tokenizer.path):
        if not _mirror(cfg, cfg.tokenizer.path, None, cfg.tokenizer_dir, "tokenizer.path", False, quiet):
            raise DataError(f"tokenizer.path: nothing at {cfg.tokenizer.path} (no objects under it)")
    mirrored = []
    for source in sources:
        if not source.in_bucket:
            mirrored.append(source)
            continue
        local = cfg.mirror_dir / source.name
        found = _mirror(cfg, source.local_dir, source.file_patterns, local, f"source {source.name!r}: local_dir",
                        source.is_packed, quiet)
        if not found and source.weight > 0:
            raise DataError(f"source {source.name!r}: no object under {source.local_dir} matches "
                            f"{source.file_patterns}")
        copy = dataclasses.replace(source, local_dir=str(local))
        copy.mirrored_from = source.local_dir
        mirrored.append(copy)
    return mirrored


def mirrored_hashes(cfg: DataConfig, source: Source) -> dict[str, str]:
    """The sha256 of each file of a packed source's copy, by relative name ({} for a source not copied)."""
    if not source.mirrored_from:
        return {}
    objects = _recorded_objects(_record_path(cfg, Path(source.local_dir)), source.mirrored_from)
    return {name: entry["sha256"] for name, entry in objects.items() if entry.get("sha256")}


def _record_path(cfg: DataConfig, local: Path) -> Path:
    return cfg.mirror_dir / RECORDS / f"{local.name}.json"


def _recorded_objects(path: Path, location: str) -> dict[str, dict]:
    """The objects a copy's record holds, {} when there is none or it records another location."""
    record = layout.read_marker(path.parent, path.name)
    return record["objects"] if record is not None and record.get("location") == location else {}


def _mirror(cfg: DataConfig, location: str, patterns: list[str] | None, local: Path, key: str, hashed: bool,
            quiet: bool) -> int:
    """Make `local` hold the objects under `location` that match `patterns` (all when None), with their sha256 in
    the record when `hashed`; returns how many."""
    try:
        storage.check_location(location, key)
    except storage.StorageError as err:
        raise DataError(str(err)) from None
    listed = [(name, size, version) for name, size, version in storage.list_versions(location)
              if patterns is None or any(fnmatch.fnmatch(name, p) for p in patterns)]
    for name, _, _ in listed:
        if any(part in ("", ".", "..") for part in name.split("/")):
            raise DataError(f"{key}: {storage.join(location, name)}: an object name that is no local file name")
    record_path = _record_path(cfg, local)
    recorded = _recorded_objects(record_path, location)

    def unchanged(name: str, size: int, version: str) -> bool:
        entry = recorded.get(name)
        return (entry is not None and entry["object"] == [size, version] and (not hashed or "sha256" in entry)
                and _file_stat(local.joinpath(*name.split("/"))) == entry["file"])

    todo = [(name, size, version) for name, size, version in listed if not unchanged(name, size, version)]

    def download(item: tuple[str, int, str]) -> tuple[str, dict]:
        name, size, version = item
        path = local.joinpath(*name.split("/"))
        storage.download_file(storage.join(location, name), path)
        if (found := path.stat().st_size) != size:
            raise DataError(f"{key}: {storage.join(location, name)}: {found} bytes read, {size} listed: the object "
                            f"changed during the download; run again")
        return name, {"object": [size, version], "file": _file_stat(path),
                      **({"sha256": file_sha256(path)} if hashed else {})}

    local.mkdir(parents=True, exist_ok=True)  # the stages list it even when nothing matches (a weight-0 source)
    with ThreadPoolExecutor(max_workers=cfg.download.max_in_flight) as pool:
        fetched = dict(pool.map(download, todo))
    objects = {name: fetched.get(name) or recorded[name] for name, _, _ in listed}
    removed = _remove_others(local, set(objects))
    record_path.parent.mkdir(parents=True, exist_ok=True)
    layout.write_json(record_path, {"location": location, "objects": objects})
    if not quiet:
        print(f"[mirror] {key}: {location}: {len(listed)} objects ({sum(s for _, s, _ in listed):,} bytes) in {local}: "
              f"{len(todo)} downloaded, {len(listed) - len(todo)} unchanged, {removed} removed", flush=True)
    return len(listed)


def _file_stat(path: Path) -> list[int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return [stat.st_size, stat.st_mtime_ns]


def _remove_others(local: Path, names: set[str]) -> int:
    """Delete the files under `local` that are not `names` (objects gone, temporary files of a killed download)
    and the folders left empty; returns how many files."""
    removed = 0
    for directory, folders, files in os.walk(local, topdown=False):
        for file in files:
            path = Path(directory, file)
            if path.relative_to(local).as_posix() not in names:
                path.unlink()
                removed += 1
        if directory != str(local) and not os.listdir(directory):
            os.rmdir(directory)
    return removed

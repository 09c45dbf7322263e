"""The shard store: where the N train + N validation shards live, what their manifest says, and which version a
reader reads. Training (huginn_ray/train/) takes the shards' paths, manifest and version from this module (and
their storage types from tokens.py); the shard stage (huginn_ray/data/shard_build.py) writes them.

- `<split>/RRRRR.parquet` (`shard_path`): rank RRRRR's rows of the split, column `input_ids` (list<uint16|int32>,
  `token_dtype`) and, for chat rows, `loss_mask` (list<uint8>, one entry per id: 1 where the token is a target);
- `manifest.json` (`read_manifest`): the shards' layout (num_shards, seq_len, rows and tokens per shard, dropped
  surplus rows, token dtype), their inputs' fingerprint and provenance, and for chat rows the supervised tokens
  per split (`shard_supervised_tokens`);
- versions: every completed set of shards is published as a new immutable directory `<output_dir>/shards.vNNNN`
  behind the pointer `<output_dir>/shards` (`publish`, layout.publish_version); a training run resolves the
  pointer once (`shard_version`) and reads that version to its end, whatever is published meanwhile.

The shard store may be a bucket (`s3://...`, huginn_ray/storage.py): the same keys, and the pointer is a small
object at `<output_dir>/shards` whose content is the version directory's name (`shards.v0003`), as the symlink's
target is (`pointer_bytes`, `read_pointer`; huginn_ray/data/bucket_publish.py swaps it conditionally). Paths and
readers take a location (a local path or a URI); a local one stays a `Path`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq

from huginn_ray import storage
from huginn_ray.data import layout
from huginn_ray.data.tokens import DTYPES, MASK, mask_rows

TRAIN, VAL = 0, 1
SPLITS = {"train": TRAIN, "val": VAL}
MANIFEST = "manifest.json"


def shard_path(shard_dir: str | Path, split: str, rank: int) -> Path | str:
    """Where rank `rank`'s shard of `split` is: a `Path` under a local directory, a URI under a bucket's."""
    if storage.is_uri(str(shard_dir)):
        return storage.join(str(shard_dir), split, f"{rank:05d}.parquet")
    return Path(shard_dir) / split / f"{rank:05d}.parquet"


def open_parquet(path: str | Path) -> pq.ParquetFile:
    """A shard opened for reading: a local file as pyarrow opens it; an object through a seekable reader whose
    reads are ranged GETs (the footer, then only the row groups read)."""
    if storage.is_uri(str(path)):
        return pq.ParquetFile(storage.open_input_file(str(path)))
    return pq.ParquetFile(path)


def shard_supervised_tokens(path: Path, row_len: int) -> int:
    """The training targets of a shard with a loss mask: its ones after each row's first token."""
    return int(mask_rows(pq.read_table(path, columns=[MASK]).column(MASK), row_len, str(path), 0)[:, 1:].sum())


_REQUIRED = {
    "num_shards": int, "seq_len": int, "seed": int, "rows_per_shard": dict, "tokens_per_shard": dict,
    "tokenizer_sha256": str, "vocab_size": int, "input_fingerprint": str, "dropped_surplus_rows": dict,
}


def read_manifest(shard_dir: str | Path) -> dict:
    """Load and validate `<shard_dir>/manifest.json` (a local file or an object; through the pointer, a symlink or
    a bucket's pointer object, when `shard_dir` is one); errors name the file and the offending key."""
    in_bucket = storage.is_uri(str(shard_dir))
    path = storage.join(shard_version(str(shard_dir)), MANIFEST) if in_bucket else Path(shard_dir) / MANIFEST
    try:
        text = storage.read_text(str(path)) if isinstance(path, str) else path.read_text()
    except (FileNotFoundError, IsADirectoryError):
        raise ValueError(f"shard manifest not found: {path} (run jobs/prepare_data.py first)") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path}: expected a JSON object")
    for key, kind in _REQUIRED.items():
        if key not in manifest:
            raise ValueError(f"{path}: missing key {key!r}")
        if not isinstance(manifest[key], kind) or isinstance(manifest[key], bool):
            raise ValueError(f"{path}: key {key!r} should be {kind.__name__}, got {manifest[key]!r}")
    for key in ("rows_per_shard", "tokens_per_shard", "dropped_surplus_rows"):
        for split in SPLITS:
            value = manifest[key].get(split)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{path}: {key}.{split} should be a non-negative integer, got {value!r}")
    dtype = manifest.setdefault("token_dtype", "int32")  # manifests before 16-bit storage held int32 rows
    if dtype not in DTYPES:
        raise ValueError(f"{path}: token_dtype should be one of {', '.join(DTYPES)}, got {dtype!r}")
    if manifest["num_shards"] <= 0 or manifest["seq_len"] <= 0:
        raise ValueError(f"{path}: num_shards and seq_len must be positive")
    for split in SPLITS:
        if manifest["tokens_per_shard"][split] != manifest["rows_per_shard"][split] * (manifest["seq_len"] + 1):
            raise ValueError(f"{path}: tokens_per_shard.{split} != rows_per_shard.{split} * (seq_len + 1)")
    return manifest


def publish(work: Path, shard_root: Path, manifest: dict) -> None:
    """The shards written under `work`/out, with their manifest, become a new immutable version
    `<shard_root>.vNNNN`, and the pointer `shard_root` moves to it (layout.publish_version); the work directory
    goes. A training run that resolved the pointer before (shard_version) keeps reading its own version."""
    layout.write_json(work / "out" / MANIFEST, manifest)
    version = layout.publish_version(work / "out", shard_root)
    shutil.rmtree(work)
    older = len(layout.versions(shard_root)) - 1
    print(f"[shuffle] published {version}; {shard_root} points to it"
          + (f"; {older} older versions kept (`jobs/prepare_data.py --gc-shards` removes them once no training run "
             "reads them)" if older else ""), flush=True)


def shard_version(shard_dir: str | Path) -> str:
    """The version directory `shard_dir` names now: the pointer `<output_dir>/shards` resolved to
    `<output_dir>/shards.vNNNN` (a directory that is not a pointer: itself), as a location. A training run
    resolves it once and reads that version to its end, whatever is published meanwhile."""
    if not storage.is_uri(str(shard_dir)):
        return os.path.realpath(shard_dir)
    name = read_pointer(str(shard_dir))
    return str(shard_dir) if name is None else storage.join(parent(str(shard_dir)), name)


def parent(location: str) -> str:
    """The directory or prefix holding `location`."""
    return location.rstrip("/").rsplit("/", 1)[0] if storage.is_uri(location) else os.path.dirname(location)


def is_version_of(version: str, pointer: str) -> bool:
    """Whether `version` is one of `pointer`'s version directories (`<pointer>.vNNNN` beside it)."""
    name = version.rstrip("/").rsplit("/", 1)[-1]
    pointer_name = pointer.rstrip("/").rsplit("/", 1)[-1]
    return parent(version) == parent(pointer) and name.startswith(f"{pointer_name}.v") and name[
        len(pointer_name) + 2:].isdigit()


def pointer_bytes(version_name: str) -> bytes:
    """What a bucket's pointer object holds: the version directory's name (relative, as the symlink's target)."""
    return f"{version_name}\n".encode()


def pointed_version(pointer: str, data: bytes) -> str:
    """The version name a pointer object's bytes hold; ValueError naming the pointer unless it is a version of it."""
    name = data.decode(errors="replace").strip()
    if not is_version_of(storage.join(parent(pointer), name), pointer):
        raise ValueError(f"{pointer}: a shard pointer must name a version beside it "
                         f"({pointer.rstrip('/').rsplit('/', 1)[-1]}.vNNNN), it holds {name[:80]!r}")
    return name


def read_pointer(pointer: str) -> str | None:
    """The version name a bucket pointer object names; None when `pointer` is no object (a prefix holding the
    shards themselves)."""
    try:
        return pointed_version(pointer, storage.read_bytes(pointer))
    except (FileNotFoundError, IsADirectoryError):
        return None

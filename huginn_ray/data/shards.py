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
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.tokens import DTYPES, MASK, mask_rows

TRAIN, VAL = 0, 1
SPLITS = {"train": TRAIN, "val": VAL}
MANIFEST = "manifest.json"


def shard_path(shard_dir: str | Path, split: str, rank: int) -> Path:
    return Path(shard_dir) / split / f"{rank:05d}.parquet"


def shard_supervised_tokens(path: Path, row_len: int) -> int:
    """The training targets of a shard with a loss mask: its ones after each row's first token."""
    return int(mask_rows(pq.read_table(path, columns=[MASK]).column(MASK), row_len, str(path), 0)[:, 1:].sum())


_REQUIRED = {
    "num_shards": int, "seq_len": int, "seed": int, "rows_per_shard": dict, "tokens_per_shard": dict,
    "tokenizer_sha256": str, "vocab_size": int, "input_fingerprint": str, "dropped_surplus_rows": dict,
}


def read_manifest(shard_dir: str | Path) -> dict:
    """Load and validate `<shard_dir>/manifest.json`; errors name the file and the offending key."""
    path = Path(shard_dir) / MANIFEST
    if not path.is_file():
        raise ValueError(f"shard manifest not found: {path} (run jobs/prepare_data.py first)")
    try:
        manifest = json.loads(path.read_text())
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


def shard_version(shard_dir: str | Path) -> Path:
    """The version directory `shard_dir` names now: the pointer `<output_dir>/shards` resolved to
    `<output_dir>/shards.vNNNN` (a directory that is not a pointer: itself). A training run resolves it once and
    reads that version to its end, whatever is published meanwhile."""
    return Path(os.path.realpath(shard_dir))

"""Publishing prepared data to a bucket: the stages ran in a local scratch directory (DataConfig.root), and the
shard version they published there, with the tokenizer, becomes the bucket's current version.

    <output_dir>/tokenizer/{tokenizer.json,tokenizer_config.json}   uploaded when the scratch holds a tokenizer
    <output_dir>/shards.vNNNN/_PUBLISHER.json   claims the version number (create-if-absent), before any upload
    <output_dir>/shards.vNNNN/{train,val}/RRRRR.parquet, manifest.json   the scratch version's files, manifest last
    <output_dir>/shards                         the pointer object: `shards.vNNNN\\n` (huginn_ray.data.shards)

Object storage has no renames, so the local publish (a directory rename, then a symlink swapped by rename) becomes:
claim the next free version number with a create-if-absent write (two publishers never write into one version),
upload the version's objects (each PUT is atomic; the manifest last, so a version with a manifest is whole), then
move the pointer with a conditional write: created if absent, else replaced only if it is still the version read
before the upload (S3 `If-Match`). A publisher whose pointer moved meanwhile loses, named: its version stays
uploaded, unpointed. A training run resolves the pointer once (shards.shard_version) and reads its version to the
end. When the bucket's current version already holds the very manifest of the scratch's version, nothing is
uploaded (a rerun after a completed publish, or after a crash between the local publish and the upload, converges).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pyarrow.fs as pafs

from huginn_ray import storage
from huginn_ray.data.formatting import DataError
from huginn_ray.data.shards import MANIFEST, is_version_of, pointed_version, pointer_bytes, read_pointer
from huginn_ray.data.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

POINTER = "shards"
PUBLISHER = "_PUBLISHER.json"
"""The object that claims a version number: who publishes it (host, pid, time)."""


def publish_to_bucket(local_root: Path, output_dir: str, tokenizer_dir: Path | None) -> str:
    """Make the scratch's current shard version (`<local_root>/shards`) the current version of the bucket's
    `<output_dir>/shards`, uploading the tokenizer of `tokenizer_dir` (when it lies in the scratch) to
    `<output_dir>/tokenizer` first; returns the bucket version's location (module docstring)."""
    local_version = Path(os.path.realpath(local_root / POINTER))
    manifest = (local_version / MANIFEST).read_bytes()
    if tokenizer_dir is not None and tokenizer_dir.is_relative_to(local_root) and tokenizer_dir.is_dir():
        _upload_tokenizer(tokenizer_dir, storage.join(output_dir, "tokenizer"))
    pointer = storage.join(output_dir, POINTER)
    current, tag = _read_pointer(pointer)
    if current is not None and _manifest_of(storage.join(output_dir, current)) == manifest:
        print(f"[publish] {pointer} already names {current}, the shards of {local_version}: nothing to upload",
              flush=True)
        return storage.join(output_dir, current)
    version = _claim_version(output_dir)
    started = time.time()
    names = storage.upload_dir(local_version, version, last=MANIFEST)
    name = version.rsplit("/", 1)[-1]
    moved = storage.create_if_absent(pointer, pointer_bytes(name)) if tag is None else \
        storage.replace_if_version(pointer, pointer_bytes(name), tag)
    if not moved:
        raise DataError(f"{pointer}: another publisher moved the pointer while {version} was uploaded (it named "
                        f"{current}); {version} is complete but not current: rerun to publish over the new pointer")
    print(f"[publish] uploaded {len(names)} files of {local_version} to {version} in {time.time() - started:.1f}s; "
          f"{pointer} names it", flush=True)
    return version


def _read_pointer(pointer: str) -> tuple[str | None, str | None]:
    """(the version name the pointer object holds, its version for the conditional replace); (None, None) when
    there is no pointer yet."""
    try:
        data, tag = storage.read_versioned(pointer)
    except FileNotFoundError:
        return None, None
    return pointed_version(pointer, data), tag


def _manifest_of(version: str) -> bytes | None:
    try:
        return storage.read_bytes(storage.join(version, MANIFEST))
    except FileNotFoundError:
        return None


def versions(output_dir: str) -> list[str]:
    """The version names (`shards.vNNNN`) under a bucket output_dir, oldest first (one listing of its top level,
    not of the shards)."""
    fs, path = storage.filesystem(output_dir)
    found = fs.get_file_info(pafs.FileSelector(path, recursive=False, allow_not_found=True))
    names = [info.base_name for info in found if info.type == pafs.FileType.Directory]
    numbered = [n for n in names if is_version_of(storage.join(output_dir, n), storage.join(output_dir, POINTER))]
    return sorted(numbered, key=lambda n: int(n.rsplit(".v", 1)[1]))


def _claim_version(output_dir: str) -> str:
    """The next version number nobody has claimed, claimed by a create-if-absent write of its PUBLISHER object."""
    existing = versions(output_dir)
    number = int(existing[-1].rsplit(".v", 1)[1]) + 1 if existing else 1
    claim = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}).encode()
    while not storage.create_if_absent(storage.join(output_dir, f"{POINTER}.v{number:04d}", PUBLISHER), claim):
        number += 1  # another publisher claimed it since the listing
    return storage.join(output_dir, f"{POINTER}.v{number:04d}")


def _upload_tokenizer(tokenizer_dir: Path, location: str) -> None:
    """The tokenizer's two files, each replaced only when its bytes differ (a training run's preflight reads
    tokenizer.json and checks its sha256 against the manifest it resolved)."""
    for name in (TOKENIZER_CONFIG_FILE, TOKENIZER_FILE):
        local = tokenizer_dir / name
        target = storage.join(location, name)
        if local.is_file() and (not storage.exists(target) or storage.read_bytes(target) != local.read_bytes()):
            storage.upload_file(local, target)


def remove_old_versions(output_dir: str) -> list[str]:
    """Delete every object of every version but the one `<output_dir>/shards` names; returns the versions removed.
    Only while no training run reads an old version."""
    current = read_pointer(storage.join(output_dir, POINTER))
    removed = [name for name in versions(output_dir) if name != current]
    for name in removed:  # the whole prefix (deleting object by object would leave pyarrow's directory markers)
        fs, path = storage.filesystem(storage.join(output_dir, name))
        fs.delete_dir(path)
    return [storage.join(output_dir, name) for name in removed]

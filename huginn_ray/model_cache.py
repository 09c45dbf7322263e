"""A model in object storage, read from a local copy: every entry point that takes a model location
(`--checkpoint`, `init_from`) resolves it here.

    model_dir = local_model_dir("s3://bucket/runs/r1/checkpoint_000010", "--checkpoint")   # a local Path

A local path is resolved as huginn_ray.model.pretrained.resolve_model_dir resolves it. A bucket URI names a
model directory: an export or a released-layout directory (its `config.json` at the top) or a training checkpoint
(its `model/config.json` beside `state/`). Its objects are downloaded once per node into a cache entry keyed by
the location and every object's name, size and version (the ETag on S3, the modification time elsewhere), then
resolved and loaded from there as a local directory is (safetensors memory-mapped, a checkpoint's marker checked):

    $HUGINN_CACHE/models/            (default ~/.cache/huginn_ray/models/)
        <key>/                       a complete copy: the objects under the location, by the same relative names
        <key>.lock                   held (flock) by the process downloading <key> on this node
        .<key>.<random>/             a download in progress, renamed to <key> when whole

The rename makes an entry appear complete or not at all; a process that finds `<key>` downloads nothing, and
the lock makes the ranks of one node that ask at once download it once (without flock, e.g. on Lustre mounted
without it, each downloads its own temporary copy and the first rename wins). A changed object has a new version,
hence a new key: the stale entry is left for the user to delete. A training output directory in a bucket is not
searched for its newest checkpoint: name the checkpoint.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from huginn_ray import storage
from huginn_ray.config import ConfigError
from huginn_ray.model.pretrained import CONFIG_NAME, resolve_model_dir, tensor_locations, training_state

CACHE_ENV = "HUGINN_CACHE"
"""The environment variable naming the local cache directory (models under its `models/`)."""


def cache_root() -> Path:
    """Where this node keeps its copies of models in object storage: $HUGINN_CACHE/models, else
    ~/.cache/huginn_ray/models."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "huginn_ray").expanduser() / "models"


def in_bucket(location: str | Path) -> bool:
    """True for an object-storage URI (`s3://`, `gs://`), False for a local path or `file://`."""
    return storage.is_uri(str(location)) and not str(location).lower().startswith("file://")


def local_model_dir(location: str | Path, purpose: str = "--checkpoint", log=None) -> Path:
    """The local model directory `location` names (resolve_model_dir's rules), a bucket URI through this node's
    cache. Errors (ConfigError) start with `purpose` and name the location: nothing there, no model directory at
    its top, an incomplete checkpoint, a weights file missing (the safetensors headers are read before any load)."""
    if not in_bucket(location):
        return resolve_model_dir(local_dir(location, purpose), purpose, log)
    location = str(location).rstrip("/")
    objects = object_versions(location, purpose)
    names = {name for name, _, _ in objects}
    if location.endswith("/model") and names == {CONFIG_NAME}:  # a training checkpoint's model/: its weights are
        return local_model_dir(location.removesuffix("/model"), purpose, log)  # the state/ beside it
    if CONFIG_NAME not in names and f"model/{CONFIG_NAME}" not in names:
        raise ConfigError(f"{purpose}: {location} holds no model directory ({CONFIG_NAME} or model/{CONFIG_NAME} "
                          f"at its top): name an export, a released-layout directory or a training checkpoint")
    copy = cached_copy(location, objects, purpose, log)
    try:
        directory = resolve_model_dir(copy, purpose)
        if training_state(directory) is None:
            tensor_locations(directory)
    except ValueError as err:  # the copy's path in the message is the location's
        message = str(err).replace(str(copy), location)
        raise ConfigError(message if message.startswith(purpose) else f"{purpose}: {message}") from None
    return directory


def local_dir(location: str | Path, purpose: str, log=None) -> Path:
    """A local directory for any location (a tokenizer's, say): a local path or `file://` as it is, a bucket
    prefix through this node's cache."""
    if in_bucket(location):
        location = str(location).rstrip("/")
        return cached_copy(location, object_versions(location, purpose), purpose, log)
    try:
        return Path(storage.resolve_location(str(location), os.getcwd()) if storage.is_uri(str(location))
                    else location)
    except storage.StorageError as err:
        raise ConfigError(f"{purpose}: {err}") from None


def cached_copy(location: str, objects: list[tuple[str, int, str]], purpose: str, log=None) -> Path:
    """This node's complete copy of `objects` (object_versions of the bucket prefix `location`), downloaded
    unless the cache holds it already (module docstring)."""
    key = hashlib.sha256(json.dumps([location, objects]).encode()).hexdigest()[:32]
    root = cache_root()
    entry = root / key
    if entry.is_dir():
        return entry
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed
        except OSError:
            pass  # no flock here: each process downloads its own temporary copy, the first rename wins
        if not entry.is_dir():
            _download(location, objects, entry)
            if log is not None:
                log(f"[huginn] {purpose}: {location} downloaded to {entry} ({len(objects)} objects, "
                    f"{sum(size for _, size, _ in objects):,} bytes)")
    return entry


def _download(location: str, objects: list[tuple[str, int, str]], entry: Path) -> None:
    """Every object into a temporary sibling of `entry`, renamed to `entry` once all are there."""
    temporary = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}."))
    try:
        for name, size, _ in objects:
            storage.download_file(storage.join(location, name), temporary.joinpath(*name.split("/")))
            if (found := temporary.joinpath(*name.split("/")).stat().st_size) != size:
                raise ConfigError(f"{storage.join(location, name)}: {found} bytes read, {size} listed: the object "
                                  f"changed during the download")
        os.rename(temporary, entry)
    except OSError:
        if not entry.is_dir():  # another process's rename won the race: its copy is the same objects
            raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def object_versions(location: str, purpose: str) -> list[tuple[str, int, str]]:
    """(relative name, size, version) of every object under the bucket prefix `location`, sorted by name
    (storage.list_versions). ConfigError naming `purpose` and the location for a bucket that cannot be reached or
    a prefix with nothing."""
    try:
        storage.check_location(location, purpose)
    except storage.StorageError as err:
        raise ConfigError(str(err)) from None
    objects = storage.list_versions(location)
    if not objects:
        raise ConfigError(f"{purpose}: nothing at {location} (no objects under it)")
    return objects

"""Files the workers write into the run directory (flight-recorder dumps, profiler traces): written where the
process can write files, then published to the run directory.

- A local run directory: written in place, `<run_dir>/<name>/<file>`; nothing to publish.
- A run directory in a bucket (huginn_ray.storage): written under a local directory named by the run,
  `<tempfile.gettempdir()>/huginn_run_files/<scheme>/<bucket>/<key>/<name>/<file>` on the worker's node, then
  uploaded to `<run_dir>/<name>/<file>`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from huginn_ray import storage


def local_dir(run_dir: str | Path, name: str) -> Path:
    """Where this process writes the run's files of kind `name` (`flight_recorder`, `profile`)."""
    run_dir = str(run_dir)
    if not storage.is_uri(run_dir):
        return Path(run_dir) / name
    scheme, rest = run_dir.split("://", 1)
    return Path(tempfile.gettempdir(), "huginn_run_files", scheme, *rest.strip("/").split("/"), name)


def published_dir(run_dir: str | Path, name: str) -> str:
    """Where the run's files of kind `name` are for a reader: `<run_dir>/<name>`, a local path or a bucket prefix."""
    return storage.join(str(run_dir), name)


def publish(local_file: Path, run_dir: str | Path) -> str:
    """The file's location in the run directory: a file of `local_dir(run_dir, name)` uploaded to
    `<run_dir>/<name>/<file>` when the run directory is a bucket (a local one holds it already)."""
    if not storage.is_uri(str(run_dir)):
        return str(local_file)
    location = storage.join(published_dir(run_dir, local_file.parent.name), local_file.name)
    storage.upload_file(local_file, location)
    return location

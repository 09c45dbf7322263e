"""The names in a training checkpoint's directory, and whether one is complete.

A training checkpoint (written by huginn_ray.train.checkpoint) holds the DCP `state/`, a `model/` directory that
reads as a model directory (huginn_ray.model.pretrained: its config.json beside the DCP state that holds the
weights), `trainer_state.json`, and the marker `checkpoint_complete.json`, written last, which lists every file
with its size. Training writes and resumes checkpoints; the model's loaders take one as a model directory only when
it is complete. Both read the names and the check here, so that neither imports the other: the model does not
build on training.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from huginn_ray import storage

TRAINING_STATE_DIR = "state"
"""A training checkpoint's torch.distributed.checkpoint directory, beside its `model/`."""

MARKER = "checkpoint_complete.json"
"""Every file of a finished save with its size in bytes, and the step; written last, once every rank's save
succeeded."""


def incomplete(directory: str | os.PathLike, part: int = 0, parts: int = 1) -> str | None:
    """Why `directory` (a local path or a bucket prefix: huginn_ray.storage) is not a complete checkpoint (no or
    unreadable marker, a listed file missing or of another size), or None when it is complete. With `parts` > 1,
    only the marker and this part's share of its files (every `parts`-th in name order from the `part`-th; `resume`
    gives each rank its own share) are checked: one stat (on a bucket, one HEAD) per file."""
    directory = str(directory)
    try:
        listing = json.loads(read_text(storage.join(directory, MARKER)))
        files, step = listing["files"], listing["step"]
        if not (isinstance(files, dict) and isinstance(step, int)):
            raise ValueError("'files' is not a mapping or 'step' not an integer")
    except FileNotFoundError:
        return f"no {MARKER}: the save did not finish"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{MARKER} cannot be read ({type(err).__name__}: {err})"
    for name, size in sorted(files.items())[part::parts]:
        found = file_size(storage.join(directory, name))
        if found is None:
            return f"{name} is missing ({MARKER} lists it with {size} bytes)"
        if found != size:
            return f"{name} has {found} bytes, {MARKER} lists {size}: truncated or rewritten"
    return None


# A checkpoint's local files are read through Python's file API, as they always were (its errors, one stat or open
# per call: what bench/scale_sim.py counts); a bucket's objects through huginn_ray.storage.

def read_text(location: str | os.PathLike) -> str:
    """The text of a checkpoint's file or object; FileNotFoundError when there is none."""
    location = str(location)
    return storage.read_text(location) if storage.is_uri(location) else Path(location).read_text()


def file_size(location: str | os.PathLike) -> int | None:
    """Bytes of a checkpoint's regular file or object; None when there is none (or a directory is there)."""
    location = str(location)
    if storage.is_uri(location):
        try:
            return storage.size(location)
        except FileNotFoundError:
            return None
    try:
        found = os.stat(location)
    except FileNotFoundError:
        return None
    return found.st_size if stat.S_ISREG(found.st_mode) else None

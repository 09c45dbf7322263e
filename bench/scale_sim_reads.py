"""The reads of bench/scale_sim.py's simulated rank, counted: resume() of a saved checkpoint through the
replica-spread read, and init_from's load of a released model's safetensors files."""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import pickle
from collections import Counter
from pathlib import Path

import torch

from huginn_ray.checkpoint_layout import TRAINING_STATE_DIR
from huginn_ray.model import pretrained
from huginn_ray.train import checkpoint as ckpt
from huginn_ray.train import loop, replica_read
from huginn_ray.train.run_plan import WeightsSource
from scale_sim_counting import CountingSafetensors, Counts, released_files, uncounted

META = torch.device("meta")
CPU = torch.device("cpu")


def simulated_resume(c, directory: Path, step: int, rank: int, counts: Counts) -> int:
    """resume() over the later save's checkpoint, counted, through the replica-spread read (ckpt.read_tensors with the
    mesh's replicate group: replica_read.read_dcp's plan, its opens and reads of the checkpoint's files, its
    all-gathers over the fake group, the optimizer state set back). Planned only: the archive header of each piece
    whose data start this rank reads (the synthesised pieces are raw bytes, no torch.save archive). Not run: the
    copies of the gathered bytes into the tensors (meta here, the optimizer's step counters on the host; no file or
    collective in them) and the non-tensor values' unpickling (their pieces hold no pickle). Returns the planned
    header bytes."""
    run_dir = directory.parent
    with uncounted():
        with open(directory / TRAINING_STATE_DIR / ".metadata", "rb") as f:
            metadata = pickle.load(f)
    planned = Counter()

    def planned_data_start(files, segment) -> int:
        files.stream(segment.relative_path)  # opened as the real header read opens it (counted)
        dtype = metadata.state_dict_metadata[segment.fqn].properties.dtype
        planned["header_bytes"] += archive_header_bytes(dtype, len(segment.chunk_sizes))
        return 0  # the synthesised piece is the tensor's bytes alone

    real_read = replica_read.read_dcp

    def read_dcp(*args, **kwargs):  # counted apart from resume's checks
        counts.phase = "resume_read"
        try:
            return real_read(*args, **kwargs)
        finally:
            counts.phase = "resume"

    patches = [(replica_read._Files, "data_start", planned_data_start), (replica_read, "read_dcp", read_dcp),
               (replica_read, "set_non_tensors", lambda *args: None), (replica_read, "_scatter", lambda *args: None)]
    real = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        resumed = ckpt.resume(directory, run_dir, rank, c.model, c.optimizer, CPU, log=lambda message: None,
                              replicas=c.mesh.get_group("replicate"))
    finally:
        for owner, name, value in real:
            setattr(owner, name, value)
    assert resumed is not None and resumed.state.step == step, resumed
    return planned["header_bytes"]


@functools.cache
def archive_header_bytes(dtype: torch.dtype, dims: int) -> int:
    """Bytes torch.load(map_location="meta") reads of a DCP piece (a torch.save archive) holding one tensor of
    `dtype` with `dims` dimensions: read_dcp's read of where the piece's data starts, measured."""
    with uncounted():
        archive = io.BytesIO()
        torch.save(torch.zeros([2] * dims, dtype=dtype), archive)
    archive.seek(0)
    with replica_read.counting_reads() as count:
        torch.load(replica_read._CountingStream(archive), map_location="meta", weights_only=True)
    return count.bytes


def init_from_model(setup, world_size: int, rank: int, counts: Counts) -> None:
    """A fresh run with init_from: build_components without weights, then load_initial_weights from a released
    layout of the same model (safe_open counted)."""
    directory = setup.root / "released"
    with uncounted():
        if not directory.exists():
            directory.mkdir()
            setup.model_cfg.to_json(directory / pretrained.CONFIG_NAME)
            files = released_files(setup.shapes)
            (directory / pretrained.INDEX_NAME).write_text(json.dumps({"weight_map": files}))
            for name in set(files.values()):
                (directory / name).touch()
    plan = dataclasses.replace(setup.plan, init_from=WeightsSource(str(directory), str(directory), "0" * 64))
    c = loop.build_components(setup.cfg, plan, rank, META, local_world_size=setup.shard_size, initialise=False)
    real_open = pretrained.safe_open
    pretrained.safe_open = CountingSafetensors(setup.shapes, counts)
    counts.by_phase["init_from"] = Counter()  # what build_components did is counted in startup's figures
    try:
        loop.load_initial_weights(c.model, plan, rank, setup.cfg.seed, c.mesh.get_group("replicate"))
    finally:
        pretrained.safe_open = real_open

"""What one rank of a W-rank run does, counted with this project's own code, for W up to 4,096 on one machine.

One process plays one rank of a world of W ranks (rank 0, then the last rank of the last node; each item is the
maximum of the two) through the real code paths of a run of `configs/train/frontier_nebel_512_nodes.yaml`:

    startup   register_node, build_components (mesh, model, FSDP2 units, optimizer), the placements' all-gather,
              warm_mesh, the data check's all-reduce, check_replicas_agree, warmup_allreduce (128 MiB, 8 stages)
    init_from build_components without weights, then load_initial_weights from a released-layout directory
    save      rank 0's small files, finish_save (agreement, marker), with the project's DCP save planner
              (checkpoint.SmallValuesOnRankZero) deciding which rank writes which piece
    resume    resume(): the candidate list, the completeness check, the agreement, and read_tensors through the
              replica-spread read (huginn_ray.train.replica_read.read_dcp: the group's bytes from the `.metadata`,
              this rank's contiguous span of them read from the files, the rounds of all-gather over the
              replicate group, the copies into the tensors), then the optimizer state set back

over stand-ins that count instead of communicating (what they stand in for: 4,096 processes on 512 nodes):

- the process group is torch's fake backend (`torch.testing._internal.distributed.fake_pg`): collectives return
  at once; a dispatch mode counts every c10d operation. A broadcast from rank 0 delivers, on the other simulated
  rank, what the simulated rank 0 sent; an all-reduce leaves this rank's value (every rank agreeing).
- the key-value store (`CountingStore`) counts every key an operation touches; keys the other ranks would have
  set are there, and a counter reads as if every rank had added to it.
- the file system is real (a temporary directory) but every stat, open, directory listing and byte read or written
  through Python is counted (os.stat, os.scandir, os.listdir, io.open and the files it returns), and the
  safetensors slices requested are counted by their bytes.
- the model lives on the meta device: shapes and byte counts are real, no memory is used. The checkpoint is
  synthesised: DCP's `.metadata` from DCP's planner (which rank writes which piece), its tensor files sparse files
  of their sizes (no 13 GB written).

What DCP itself does inside dcp.save (its plan exchange, the writes) cannot run over the fake group; that figure
comes from DCP's save planner. The resume's read runs, over sparse pieces without torch.save archives around
them: the archive header a rank reads for each piece whose data start it finds is measured on a real archive of
that dtype and rank (marked "planned" in the output and the README, with the save's figure); the gathered bytes
are not copied into the (meta) tensors, nor the non-tensor values unpickled. Everything else is counted as it
happens.

    python bench/scale_sim.py --world-sizes 8,64,512,4096 [--json]
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import dataclasses
import functools
import io
import json
import math
import multiprocessing
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh
import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from huginn_ray.checkpoint_layout import TRAINING_STATE_DIR  # noqa: E402
from huginn_ray.config import load_config  # noqa: E402
from huginn_ray.model import ModelConfig, RecurrentGPT  # noqa: E402
from huginn_ray.model import pretrained  # noqa: E402
from huginn_ray.train import checkpoint as ckpt  # noqa: E402
from huginn_ray.train import loop, parallel  # noqa: E402
from huginn_ray.train import replica_read  # noqa: E402
from huginn_ray.train.collectives import all_ranks  # noqa: E402
from huginn_ray.train.config import TrainConfig  # noqa: E402
from huginn_ray.train.run_plan import RunPlan, WeightsSource  # noqa: E402
from huginn_ray.train.stopping import Stop, stop_if_a_rank_cannot_read  # noqa: E402
from huginn_ray.train.warmup import register_node, warmup_allreduce  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs/train/frontier_nebel_512_nodes.yaml"
META = torch.device("meta")
CPU = torch.device("cpu")
"""The agreements' tensors: their values are read back on the host."""
NODE_SIZE = 8
"""GCDs per Frontier node: Ray Train's local world size there, so hsdp's shard size S."""

ITEMS = {
    "store_ops_startup": "keys the store touches for this rank: process group, mesh, warm-up (counted)",
    "process_groups_created_startup": "new_group calls this rank makes (counted); each member group of a gloo "
                                      "backend also opens a full mesh: see the README",
    "collectives_startup": "c10d operations from process group to the first step (counted)",
    "collective_bytes_startup": "bytes those operations deliver to this rank (counted)",
    "peak_model_bytes_startup": "largest model state (parameters, buffers, optimizer state) this rank holds at "
                                "once during startup (counted at every allocation of the model and optimizer)",
    "bytes_read_init_from": "bytes of the safetensors slices this rank requests and the headers of the files it "
                            "opens (counted)",
    "fs_metadata_ops_init_from": "stat/open/list calls of load_initial_weights (counted)",
    "collectives_per_step": "c10d operations of one train_step (counted on a model of the nebel's depth and "
                            "64 wide; its chunk-stream exchanges replaced by the nebel's number, from the chunk "
                            "stream's own layout of this rank's gradient shard)",
    "bytes_written_save": "bytes a rank writes: the most DCP's save planner gives any of the W ranks (planned) "
                          "plus this rank's small files and the marker (counted)",
    "collectives_save": "c10d operations of finish_save (counted; DCP's own plan exchange not included)",
    "collective_bytes_save": "bytes those operations deliver to this rank (counted)",
    "fs_metadata_ops_save": "stat/open/list calls of the save after DCP's writes (counted)",
    "fs_metadata_ops_resume_checks": "stat/open/list calls of resume outside the tensors' read: candidates, "
                                     "marker, completeness check, trainer state (counted)",
    "fs_metadata_ops_resume": "stat/open/list calls of resume: the checks, the .metadata and the files of this "
                              "rank's spans of its replica group's bytes and of the values every rank holds "
                              "whole (counted)",
    "bytes_read_resume": "bytes resume reads: marker, trainer state, .metadata and this rank's span (counted) plus "
                         "the archive header of each piece whose data start it reads (planned)",
    "collectives_resume": "c10d operations of resume (counted)",
    "collective_bytes_resume": "bytes those operations deliver to this rank (counted)",
}


# --- the counting stand-ins ------------------------------------------------------------------------------

class Counts:
    """What this simulated rank did, by phase."""

    def __init__(self):
        self.phase = "startup"
        self.by_phase: dict[str, Counter] = {}

    def add(self, what: str, n: int = 1) -> None:
        if PAUSED and what.startswith(("fs_", "bytes_")):
            return
        self.by_phase.setdefault(self.phase, Counter())[what] += n

    def get(self, phase: str, what: str) -> int:
        return self.by_phase.get(phase, Counter())[what]


class CountingStore(dist.Store):
    """The process group's key-value store (a TCPStore on rank 0 in a real run), counting every key an operation
    touches. The other ranks are taken to have done their part: a key they set is there, a counter every rank
    adds to reads W times the addition."""

    def __init__(self, counts: Counts, world_size: int):
        super().__init__()
        self.counts, self.world_size, self.data = counts, world_size, {}

    def set(self, key, value):
        self.counts.add("store_ops")
        self.data[key] = value

    def get(self, key):
        self.counts.add("store_ops")
        return self.data.get(key, b"node-of-another-rank")

    def add(self, key, amount):
        self.counts.add("store_ops")
        self.data[key] = self.data.get(key, 0) + amount * self.world_size
        return self.data[key]

    def check(self, keys):
        self.counts.add("store_ops", len(keys))
        return True

    def wait(self, keys, timeout=None):
        self.counts.add("store_ops", len(keys))

    def compare_set(self, key, expected, desired):
        self.counts.add("store_ops")
        self.data[key] = desired
        return desired

    def delete_key(self, key):
        self.counts.add("store_ops")
        return self.data.pop(key, None) is not None

    def num_keys(self):
        self.counts.add("store_ops")
        return len(self.data)


class CountingCollectives(TorchDispatchMode):
    """Counts every c10d operation and the bytes it delivers to this rank (its output tensors). A broadcast from
    rank 0 gives the payload the simulated rank 0 sent; on host tensors (values the code reads back) an all-reduce
    gives the group's sum and an all-gather every rank's value as if every rank held this rank's value; device
    (meta) tensors keep their shape and hold nothing."""

    def __init__(self, counts: Counts, broadcasts: list, rank: int):
        super().__init__()
        self.counts, self.broadcasts, self.rank = counts, broadcasts, rank
        self.replayed = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional"):
            self.counts.add("collectives")
            self.counts.add("collective_bytes", sum(t.numel() * t.element_size() for t in tensors_in(args[0])))
            if func.__name__.startswith("allgather") and not args[1][0].is_meta:
                for output in args[0][0]:
                    output.copy_(args[1][0])
            if func.__name__.startswith("allreduce") and not args[0][0].is_meta:
                for tensor in args[0]:  # a sum over the group, every rank holding this rank's value
                    tensor.mul_(dist.ProcessGroup.unbox(args[1]).size())
            if func.__name__.startswith("broadcast") and not args[0][0].is_meta:
                tensor = args[0][0]
                if self.rank == 0:
                    self.broadcasts.append(tensor.tolist())  # plain values: they cross to another process
                elif self.replayed < len(self.broadcasts):
                    tensor.copy_(torch.tensor(self.broadcasts[self.replayed], dtype=tensor.dtype))
                    self.replayed += 1
        return out


def tensors_in(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


@contextlib.contextmanager
def counting_files(counts: Counts):
    """Count the file system operations Python code makes (pathlib goes through these too)."""
    real = {"stat": os.stat, "scandir": os.scandir, "listdir": os.listdir, "open": io.open}

    def stat(*args, **kwargs):
        counts.add("fs_metadata_ops")
        return real["stat"](*args, **kwargs)

    def scandir(*args, **kwargs):
        counts.add("fs_metadata_ops")
        return real["scandir"](*args, **kwargs)

    def listdir(*args, **kwargs):
        counts.add("fs_metadata_ops")
        return real["listdir"](*args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        counts.add("fs_metadata_ops")
        return CountedFile(real["open"](file, mode, *args, **kwargs), counts)

    os.stat, os.scandir, os.listdir, io.open, builtins.open = stat, scandir, listdir, open_, open_
    try:
        yield
    finally:
        os.stat, os.scandir, os.listdir = real["stat"], real["scandir"], real["listdir"]
        io.open = builtins.open = real["open"]


class CountedFile:
    """A file object that counts the bytes read from and written to it."""

    def __init__(self, file, counts: Counts):
        self._file, self._counts = file, counts

    def read(self, *args):
        data = self._file.read(*args)
        self._counts.add("bytes_read", len(data.encode() if isinstance(data, str) else data))
        return data

    def readinto(self, buffer):
        n = self._file.readinto(buffer)
        self._counts.add("bytes_read", n or 0)
        return n

    def write(self, data):
        self._counts.add("bytes_written", len(data.encode() if isinstance(data, str) else data))
        return self._file.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()

    def __iter__(self):
        return iter(self._file)

    def __getattr__(self, name):
        return getattr(self._file, name)


class CountingSafetensors:
    """`safe_open` of a released model directory: the stored shapes are the model's, and every slice requested
    is counted by its bytes (fp32, as `save_pretrained` writes them) and returned as a meta tensor."""

    def __init__(self, shapes: dict[str, torch.Size], counts: Counts):
        self.shapes, self.counts = shapes, counts

    def __call__(self, filename, framework="pt", device="cpu"):
        self.counts.add("fs_metadata_ops")
        file = _SafeFile(self, Path(filename).name)
        self.counts.add("bytes_read", file.header_bytes())
        return file


class _SafeFile:
    def __init__(self, source: CountingSafetensors, name: str):
        self.source, self.name = source, name

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def keys(self):
        return [key for key, file in released_files(self.source.shapes).items() if file == self.name]

    def header_bytes(self) -> int:
        """What safe_open reads of the file: its 8-byte length and its JSON header (every tensor's dtype, shape,
        offsets), as safetensors writes it."""
        header, offset = {}, 0
        for key in sorted(self.keys()):
            nbytes = math.prod(self.source.shapes[key]) * 4
            header[key] = {"dtype": "F32", "shape": list(self.source.shapes[key]), "data_offsets": [offset,
                                                                                               offset + nbytes]}
            offset += nbytes
        return 8 + len(json.dumps(header, separators=(",", ":")))

    def get_slice(self, key):
        return _Slice(self.source, self.source.shapes[key])


class _Slice:
    def __init__(self, source: CountingSafetensors, shape: torch.Size):
        self.source, self.shape = source, shape

    def get_shape(self):
        return list(self.shape)

    def __getitem__(self, rows):
        part = torch.empty(self.shape, device=META)[rows]
        self.source.counts.add("bytes_read", part.numel() * 4)
        return part


def released_files(shapes: dict[str, torch.Size]) -> dict[str, str]:
    """tensor -> file of a released layout: about 5 GB shards, in name order."""
    files, size, shard = {}, 0, 1
    for key in sorted(shapes):
        files[key] = f"model-{shard:05d}.safetensors"
        size += shapes[key].numel() * 4
        if size > 5e9:
            shard, size = shard + 1, 0
    return files


# --- model bytes -----------------------------------------------------------------------------------------

class ModelBytes:
    """The model state this rank holds: every allocation of the model (allocate, materialize, FSDP2's sharding)
    and of the optimizer is followed by a count of the bytes it then holds; the peak is kept."""

    def __init__(self):
        self.peak, self.allocated, self.model, self.optimizer = 0, False, None, None

    def measure(self) -> None:
        if not self.allocated:
            return
        tensors = {id(t): t for t in [*self.model.parameters(), *self.model.buffers()]}
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                tensors.update({id(t): t for t in state.values() if torch.is_tensor(t)})
        held = sum(parallel.local(t).numel() * t.element_size() for t in tensors.values())
        self.peak = max(self.peak, held)

    @contextlib.contextmanager
    def watching(self):
        """Patch the allocation points of the model (the names loop.py calls) to measure after each."""
        patched = []

        def after(owner, name, on_result):
            real = getattr(owner, name)

            def wrapper(*args, **kwargs):
                result = real(*args, **kwargs)
                on_result(args, result)
                self.measure()
                return result

            setattr(owner, name, wrapper)
            patched.append((owner, name, real))

        def model_allocated(args, result):
            self.model, self.allocated = args[0], True

        after(RecurrentGPT, "allocate", model_allocated)
        after(RecurrentGPT, "materialize", model_allocated)
        after(parallel, "apply_hsdp", lambda args, result: None)
        after(loop, "build_optimizer", lambda args, result: setattr(self, "optimizer", result))
        try:
            yield self
        finally:
            for owner, name, real in reversed(patched):
                setattr(owner, name, real)


# --- one simulated rank ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Setup:
    cfg: TrainConfig
    plan: RunPlan
    model_cfg: ModelConfig
    shard_size: int
    root: Path
    """A temporary directory: the synthesised checkpoints and model directory."""
    shapes: dict[str, torch.Size]
    """Every parameter's shape (the released weights' shapes)."""
    local_plans_by_shard: dict = dataclasses.field(default_factory=dict)
    """DCP's local save plan of each shard index (`prime`)."""


class NoData:
    """Stands in for a train shard's reader (huginn_ray.train.shard_reader.ShardReader): the control plane is
    simulated, not the data; the step reads `OneStepOfZeros`."""

    def __init__(self, path, stream, seed, row_length):
        self.path = path


def simulate_rank(setup: Setup, world_size: int, rank: int, broadcasts: list) -> dict[str, int]:
    counts = Counts()
    store = CountingStore(counts, world_size)
    new_groups = Counter()
    real_new_group = dist.new_group

    def counted_new_group(*args, **kwargs):
        new_groups[counts.phase] += 1
        return real_new_group(*args, **kwargs)

    model_bytes = ModelBytes()
    real_build_mesh = parallel.build_mesh

    def cpu_mesh(shape, device_type):  # FSDP2 takes the mesh's device from a real device type; tensors stay meta
        return real_build_mesh(shape, "cpu" if device_type == "meta" else device_type)

    # init_device_mesh calls new_group by its own name: counted there too, should build_mesh use it
    patches = [(dist, "new_group", counted_new_group), (device_mesh, "new_group", counted_new_group),
               (loop, "ShardReader", NoData), (parallel, "build_mesh", cpu_mesh)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    results = {}
    try:
        with CountingCollectives(counts, broadcasts, rank), counting_files(counts), model_bytes.watching(), \
                host_reads_of_meta():
            dist.init_process_group("fake", store=store, rank=rank, world_size=world_size)
            register_node()
            c = loop.build_components(setup.cfg, setup.plan, rank, META, local_world_size=setup.shard_size)
            # loop.start_worker's node-layout check: every rank's placement, as Ray Train reports it
            placement = {"node_rank": rank // setup.shard_size, "local_rank": rank % setup.shard_size,
                         "local_world_size": setup.shard_size, "node_ip": "10.128.0.1"}
            all_ranks(placement, CPU)
            parallel.warm_mesh(c.mesh, CPU)
            stop_if_a_rank_cannot_read(None, CPU)
            parallel.check_replicas_agree(c.model, c.optimizer, c.mesh, META, "at startup")
            warmup_allreduce(META, setup.cfg.warmup_allreduce_mib, timeout_s=setup.cfg.warmup_timeout_s)
            results["peak_model_bytes_startup"] = model_bytes.peak
            results["chunk_exchanges"] = chunk_exchanges(c)
            plans, metadata = save_plans(setup, c, world_size, rank)
            if plans is None:
                return {}  # priming: this shard index's local plan is recorded
            tensors = [md for md in metadata.state_dict_metadata.values() if isinstance(md, TensorStorageMetadata)]
            results["state_bytes"] = sum(md.size.numel() * md.properties.dtype.itemsize for md in tensors)
            results["state_tensors"] = len(tensors)

            counts.phase = "save"
            results["bytes_written_save"] = simulated_save(setup, c, world_size, rank, counts)
            counts.phase = "resume"
            results["planned_resume_bytes"] = simulated_resume(setup, c, world_size, rank, counts)

            counts.phase = "init_from"
            init_from_model(setup, world_size, rank, counts)
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        if dist.is_initialized():
            dist.destroy_process_group()
    return {
        "store_ops_startup": counts.get("startup", "store_ops"),
        "process_groups_created_startup": new_groups["startup"],
        "collectives_startup": counts.get("startup", "collectives"),
        "collective_bytes_startup": counts.get("startup", "collective_bytes"),
        "peak_model_bytes_startup": results["peak_model_bytes_startup"],
        "bytes_read_init_from": counts.get("init_from", "bytes_read"),
        "fs_metadata_ops_init_from": counts.get("init_from", "fs_metadata_ops"),
        "bytes_written_save": results["bytes_written_save"],
        "collectives_save": counts.get("save", "collectives"),
        "collective_bytes_save": counts.get("save", "collective_bytes"),
        "fs_metadata_ops_save": counts.get("save", "fs_metadata_ops"),
        "fs_metadata_ops_resume_checks": counts.get("resume", "fs_metadata_ops"),
        "fs_metadata_ops_resume": sum(counts.get(phase, "fs_metadata_ops") for phase in RESUME),
        "bytes_read_resume": sum(counts.get(phase, "bytes_read") for phase in RESUME)
        + results["planned_resume_bytes"],
        "collectives_resume": sum(counts.get(phase, "collectives") for phase in RESUME),
        "collective_bytes_resume": sum(counts.get(phase, "collective_bytes") for phase in RESUME),
        "chunk_exchanges": results["chunk_exchanges"],
        "state_bytes": results["state_bytes"],
        "state_tensors": results["state_tensors"],
    }


RESUME = ("resume", "resume_read")
"""resume's phases: its checks, and the tensors' read."""


@contextlib.contextmanager
def host_reads_of_meta():
    """Host reads of meta tensors (`.item()`, `.tolist()`) give zeros: on the fake group no value is ever
    exchanged, and zero (no rank failed, no rank disagrees) is what the agreements read when all is well."""
    real_item, real_tolist = torch.Tensor.item, torch.Tensor.tolist
    torch.Tensor.item = lambda self: 0 if self.is_meta else real_item(self)
    torch.Tensor.tolist = lambda self: (torch.zeros(self.shape, dtype=self.dtype).tolist() if self.is_meta
                                      else real_tolist(self))
    try:
        yield
    finally:
        torch.Tensor.item, torch.Tensor.tolist = real_item, real_tolist


def state_dict_of(c) -> dict:
    return {"model": ckpt.model_state(c.model), "optim": get_optimizer_state_dict(c.model, c.optimizer)}


def save_plans(setup: Setup, c, world_size: int, rank: int) -> tuple[list, Metadata]:
    """DCP's save planning over W ranks with the project's planner (ckpt.SmallValuesOnRankZero): every rank's
    local plan (rank r holds shard r mod S of every tensor, as this rank's DTensors say; rank 0 alone the small
    values every rank holds whole) and DCP's global plan (which rank writes which replicated piece), with the
    `.metadata` a FileSystemWriter would record (pieces back to back in one file per rank)."""
    local_plans = setup.local_plans_by_shard
    if rank % setup.shard_size not in local_plans:
        planner = ckpt.SmallValuesOnRankZero()
        planner.set_up_planner(state_dict_of(c), is_coordinator=True)  # rank 0's plan; the others' below
        local_plans[rank % setup.shard_size] = planner.create_local_plan()
    if len(local_plans) < setup.shard_size:
        return None, None
    planner = ckpt.SmallValuesOnRankZero()
    planner.set_up_planner({}, is_coordinator=True)
    global_plans, metadata = planner.create_global_plan(
        [local_plans[0]] + [ckpt.SmallValuesOnRankZero.without_rank_zero_values(local_plans[r % setup.shard_size])
                            for r in range(1, world_size)])
    storage = {}
    for r, plan in enumerate(global_plans):
        offset = 0
        for item in plan.items:
            length = item_bytes(item)
            storage[item.index] = _StorageInfo(f"__{r}_0.distcp", offset, length)
            offset += length
    metadata.storage_data = storage
    return global_plans, metadata


def item_bytes(item) -> int:
    """A write item's bytes in its file: a tensor's elements, or a pickled object (a few hundred bytes)."""
    if item.tensor_data is None:
        return 1261
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def simulated_save(setup: Setup, c, world_size: int, rank: int, counts: Counts) -> int:
    """The save of step 128 into a fresh directory: DCP's planned pieces (sparse files of their sizes, and the
    `.metadata`, written unobserved as DCP would), then start_save's small files and finish_save, counted."""
    global_plans, metadata = save_plans(setup, c, world_size, rank)
    directory = setup.root / "runs" / f"{world_size:06d}" / "checkpoint_2026-11-25_00-00-00.000000"
    with uncounted():
        state_dir = directory / TRAINING_STATE_DIR
        state_dir.mkdir(parents=True, exist_ok=True)
        sizes = Counter()
        for info in metadata.storage_data.values():
            sizes[info.relative_path] = max(sizes[info.relative_path], info.offset + info.length)
        for name, size in sizes.items():
            with open(state_dir / name, "wb") as f:
                f.truncate(size)
        with open(state_dir / ".metadata", "wb") as f:
            pickle.dump(metadata, f)
    pieces = max(sum(item_bytes(item) for item in plan.items) for plan in global_plans)
    state = ckpt.TrainerState(step=128, world_size=world_size, num_streams=setup.plan.num_streams,
                              global_batch_rows=setup.plan.global_batch_rows, rows_per_stream=128)
    written_before = counts.get("save", "bytes_written")
    if rank == 0:
        (directory / "model").mkdir(exist_ok=True)
        c.model.config.to_json(directory / "model" / pretrained.CONFIG_NAME)
        (directory / "trainer_state.json").write_text(json.dumps(dataclasses.asdict(state), indent=2))
    from concurrent.futures import Future
    done = Future()
    done.set_result(None)
    assert ckpt.finish_save(ckpt.PendingSave(directory, 128, rank, done), CPU)
    return pieces + counts.get("save", "bytes_written") - written_before


def simulated_resume(setup: Setup, c, world_size: int, rank: int, counts: Counts) -> int:
    """resume() over the saved checkpoint, counted, through the replica-spread read (ckpt.read_tensors with the
    mesh's replicate group: replica_read.read_dcp's plan, its opens and reads of the checkpoint's files, its
    all-gathers over the fake group, the optimizer state set back). Planned only: the archive header of each piece
    whose data start this rank reads (the synthesised pieces are raw bytes, no torch.save archive). Not run: the
    copies of the gathered bytes into the tensors (meta here, the optimizer's step counters on the host; no file or
    collective in them) and the non-tensor values' unpickling (their pieces hold no pickle). Returns the planned
    header bytes."""
    run_dir = setup.root / "runs" / f"{world_size:06d}"
    directory = next(run_dir.glob("checkpoint_*"))
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
    assert resumed is not None and resumed.state.step == 128, resumed
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


PAUSED = []


@contextlib.contextmanager
def uncounted():
    """The simulator's own file work (synthesising a checkpoint), outside the counts."""
    PAUSED.append(True)
    try:
        yield
    finally:
        PAUSED.pop()


def init_from_model(setup: Setup, world_size: int, rank: int, counts: Counts) -> None:
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


# --- one training step ------------------------------------------------------------------------------------

NARROW = dict(n_embd=64, num_attention_heads=2, intermediate_size=128, vocab_size=256, padding_multiple=64,
              block_size=32)
"""The step runs on the nebel's depth (2 prelude, 4 core, 2 coda blocks: the same FSDP2 units) at this width: FSDP2
refuses to train meta parameters, and the full width does not fit here."""


class OneStepOfZeros:
    """The step's data: one micro-batch of zeros (its values do not change which collectives run)."""

    path = "no data"

    def __init__(self, block_size: int):
        self.block_size = block_size

    def next_step(self):
        from huginn_ray.train.shard_reader import Batch
        tokens = torch.zeros(1, self.block_size, dtype=torch.long)
        return [Batch(tokens, tokens + 5, torch.zeros(1, dtype=torch.long))]


def step_collectives(setup: Setup, world_size: int, rank: int) -> tuple[int, int]:
    """The c10d operations of one train_step (loop.py) at W, counted on the narrow model on CPU over the fake group,
    and how many of them are the chunk stream's exchanges between shard groups (the nebel's own number replaces
    them: `chunk_exchanges`). The fake group exchanges nothing, so the loss is garbage and the step may end in a
    Stop (non-finite loss): every collective of the step has run by then."""
    counts = Counts()
    model_cfg = ModelConfig.from_name(setup.model_cfg.name, **NARROW)
    plan = dataclasses.replace(setup.plan, model_config=model_cfg)
    cfg = dataclasses.replace(setup.cfg, block_size=NARROW["block_size"], warmup_allreduce_mib=0)
    dist.init_process_group("fake", store=CountingStore(counts, world_size), rank=rank, world_size=world_size)
    try:
        real_reader = loop.ShardReader
        loop.ShardReader = NoData
        try:
            c = loop.build_components(cfg, plan, rank, CPU, local_world_size=setup.shard_size)
        finally:
            loop.ShardReader = real_reader
        c.reader = OneStepOfZeros(cfg.block_size)
        with CountingCollectives(counts, [], rank):
            try:
                loop.train_step(c, 2, cfg, plan, CPU)
            except Stop:
                pass
    finally:
        dist.destroy_process_group()
    return counts.get("startup", "collectives"), chunk_exchanges(c)


def chunk_exchanges(c) -> int:
    """The chunk stream's all-reduces per step between shard groups: one per chunk of this rank's gradient shard
    (its own `chunk_layout`), none with a single shard group."""
    return len(c.sync.chunks) if getattr(c.sync, "group_size", 1) > 1 else 0


def step_collectives_quietly(setup: Setup, world_size: int, rank: int) -> tuple[int, int]:
    with contextlib.redirect_stdout(io.StringIO()):
        return step_collectives(setup, world_size, rank)


# --- driver ----------------------------------------------------------------------------------------------

def make_setup(root: Path) -> Setup:
    cfg = load_config(TrainConfig, CONFIG, ["out_dir=" + str(root / "runs"), "compile=false"])
    model_cfg = cfg_model(cfg)
    plan = RunPlan(global_batch_rows=cfg.world_batch_size, num_streams=8, data_dir=cfg.data.data_dir,
                   schedule_steps=238_418, pad_id=0, eos_id=1, precision="fp32", model_config=model_cfg)
    with torch.device("meta"):
        model = RecurrentGPT(model_cfg)
    return Setup(cfg, plan, model_cfg, NODE_SIZE, root,
                 {key: p.shape for key, p in model.named_parameters()})


def cfg_model(cfg: TrainConfig) -> ModelConfig:
    from huginn_ray.train.init_from import model_config
    return model_config(cfg)


def simulate(world_sizes: list[int]) -> dict:
    """Every simulated rank runs in a child process of its own (torch's device-mesh and FSDP objects are cached per
    process, and a rank must not see another's)."""
    per_rank: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="huginn_scale_sim_") as tmp:
        setup = make_setup(Path(tmp))
        # DCP's global plan needs every shard index's local plan: ranks 0 .. S-1 of one shard group give them
        primed = in_children([(prime, (setup, shard)) for shard in range(setup.shard_size)])
        setup.local_plans_by_shard = dict(enumerate(primed))
        for world_size in world_sizes:
            (first, broadcasts), = in_children([(simulate_rank_quietly, (setup, world_size, 0, []))])
            results, ranks = [first], sorted({0, world_size - 1})
            if world_size > 1:
                results += [in_children([(simulate_rank_quietly, (setup, world_size, world_size - 1,
                                                                  broadcasts))])[0][0]]
            steps = in_children([(step_collectives_quietly, (setup, world_size, rank)) for rank in ranks])
            for result, (narrow, narrow_exchanges) in zip(results, steps):
                result["collectives_per_step"] = narrow - narrow_exchanges + result.pop("chunk_exchanges")
            state_bytes, state_tensors = {(result.pop("state_bytes"), result.pop("state_tensors"))
                                          for result in results}.pop()
            for item in results[0]:
                per_rank.setdefault(item, []).append(max(result[item] for result in results))
    parameter_bytes = sum(shape.numel() * 4 for shape in setup.shapes.values())
    return {"world_sizes": world_sizes, "per_rank": per_rank,
            "sizes": {"state_bytes": state_bytes, "state_tensors": state_tensors, "parameter_bytes": parameter_bytes}}


def in_children(tasks: list, parallel: int = 2) -> list:
    """fn(*args) of every task, each in a child process of its own, `parallel` at a time, results in task order.
    Children fork from a fork server started clean with torch and the training code imported (fast, and safe
    where the caller has threads: a test process that ran Ray before)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "huginn_ray.train.loop"])
    results, running = [None] * len(tasks), []

    def collect(index, process, receiver):
        try:
            outcome, value = receiver.recv()
        except EOFError:
            outcome, value = "error", f"the child exited with code {process.join() or process.exitcode}"
        process.join()
        if outcome == "error":
            raise RuntimeError(f"simulated rank failed:\n{value}")
        results[index] = value

    for index, (fn, args) in enumerate(tasks):
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(target=run_task, args=(fn, args, sender))
        process.start()
        sender.close()  # the child holds the only sending end: its exit ends the parent's wait
        running.append((index, process, receiver))
        if len(running) == parallel:
            collect(*running.pop(0))
    for task in running:
        collect(*task)
    return results


def run_task(fn, args, sender) -> None:
    try:
        sender.send(("ok", fn(*args)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        sender.send(("error", traceback.format_exc()))


def prime(setup: Setup, shard: int):
    """The local save plan of shard index `shard` (rank `shard` of a world of one shard group)."""
    with contextlib.redirect_stdout(io.StringIO()):
        simulate_rank(setup, setup.shard_size, shard, [])
    return setup.local_plans_by_shard[shard]


def simulate_rank_quietly(setup: Setup, world_size: int, rank: int, broadcasts: list) -> tuple[dict, list]:
    """One rank's counts, and the broadcasts it sent (rank 0: what the other ranks receive)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return simulate_rank(setup, world_size, rank, broadcasts), broadcasts


def table(result: dict) -> str:
    sizes = result["world_sizes"]
    lines = [f"{'per rank (max of rank 0 and rank W-1)':<34}" + "".join(f"{'W=' + str(w):>16}" for w in sizes)]
    for item, values in result["per_rank"].items():
        lines.append(f"{item:<34}" + "".join(f"{v:>16,}" for v in values))
    state, parameters = result["sizes"]["state_bytes"], result["sizes"]["parameter_bytes"]
    for item, whole in (("bytes_read_resume", state), ("bytes_read_init_from", parameters)):
        lines.append(f"{item + ' x W / ' + ('state' if whole == state else 'P'):<34}"
                     + "".join(f"{v * w / whole:>16.3f}" for v, w in zip(result["per_rank"][item], sizes)))
    lines.append(f"state (the checkpoint's tensors) {state:,} bytes, P (the parameters, fp32) {parameters:,} bytes")
    lines.append("")
    lines += [f"{item}: {ITEMS[item]}" for item in result["per_rank"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", default="8,64,512,4096")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    start = time.perf_counter()
    result = simulate(world_sizes)
    if args.json:
        print(json.dumps(result))
    else:
        print(table(result))
        print(f"\n{time.perf_counter() - start:.0f} s; {CONFIG.name}, shard size 8")


if __name__ == "__main__":
    main()

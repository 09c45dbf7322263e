"""The counting stand-ins of bench/scale_sim.py: a key-value store, a dispatch mode over the fake process group's
collectives, the file system's calls, the released model's safetensors files and the model state a rank holds. Each
counts what one simulated rank asks of the thing it stands in for; none of them communicates."""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import math
import os
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from huginn_ray.model import RecurrentGPT
from huginn_ray.train import loop, parallel
from huginn_ray.train.hang_watch import KEY as HANG_WATCH_KEY

META = torch.device("meta")

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


NOBODY_SETS = (f"{HANG_WATCH_KEY}/signal",)
"""Keys no other rank sets in the simulated run: the hang watch's signal, posted only by a rank whose collective
hangs (none does in steady state)."""


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
        return all(key in self.data or not key.startswith(NOBODY_SETS) for key in keys)

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
    """The tensors of a (nested) list, tuple or dict."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
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


PAUSED = []


@contextlib.contextmanager
def uncounted():
    """The simulator's own file work (synthesising a checkpoint), outside the counts."""
    PAUSED.append(True)
    try:
        yield
    finally:
        PAUSED.pop()


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


@contextlib.contextmanager
def patched(patches: list):
    """(owner, name, value) set for the duration, then restored."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)

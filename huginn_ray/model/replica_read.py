"""Reading a model's (and optimizer's) state so that the file system serves it once, not once per replica.

R ranks hold identical copies of each part of the state: under `hsdp` the replicas of a shard (the mesh's
"replicate" dimension, R = W / S), under `replicate` every rank (R = W). Read naively, every one of them reads its
part from the file system: the state is served R times. Here each of the R ranks reads 1/R of its part's rows (dim
0: `replica_rows`), and the replicas then complete each other with one all-gather per tensor over their group (the
network), so every rank reads about 1/W of the state from the file system and ends holding exactly the bytes a
full read gives. Tensors are handled one at a time: no buffer larger than one tensor's local part.

- `local_rows`: the part of a (possibly FSDP2-sharded) tensor this rank holds, and its rows of the whole tensor.
- `replica_rows` / `complete_over_replicas`: which rows of its part a replica reads, and the all-gather after.
- `plan_dcp_read` / `read_dcp_parts` / `complete_dcp_parts`: the same for a torch.distributed.checkpoint (DCP)
  directory: a load plan for this rank's rows only, a reader that reads only their bytes from the stored pieces
  (`RangeReader`), then the all-gather.
- `counting_reads`: bytes read from the file system by this process (what the tests and bench/scale_sim.py count).
"""

from __future__ import annotations

import io
import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


# ---- which rows a rank holds and reads ----------------------------------------------------------------------
def local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, slice | None]:
    """This rank's part of a tensor and the rows of the whole tensor it holds (None: all of it). FSDP2 shards dim 0
    (Shard(0) on the shard-group mesh); the part is a view: writing it writes the tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor.data, None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if any(offset[1:]):
        raise ValueError(f"a tensor sharded on another dimension than 0 ({tensor.placements}) cannot be read")
    return tensor.to_local(), slice(offset[0], offset[0] + shape[0])


def replica_rows(rows: int, replicas: int, index: int) -> slice:
    """The rows of a part of `rows` rows that replica `index` of `replicas` reads: blocks of ceil(rows / replicas)
    rows (the last ones shorter or empty), so that one padded all-gather completes the part."""
    block = math.ceil(rows / replicas)
    return slice(min(index * block, rows), min((index + 1) * block, rows))


def complete_over_replicas(part: torch.Tensor, group) -> None:
    """Fill `part` (this rank's local tensor, of which it has read its `replica_rows`) with the rows its replicas
    read: one all-gather over `group`. A 0-dim tensor is read whole by every replica: nothing to do."""
    replicas = group.size()
    if replicas == 1 or part.dim() == 0 or part.shape[0] == 0:
        return
    rows = part.shape[0]
    block = math.ceil(rows / replicas)
    mine = replica_rows(rows, replicas, group.rank())
    send = part.new_zeros((block, *part.shape[1:]))
    send[: mine.stop - mine.start] = part[mine]
    if rows == block * replicas and part.is_contiguous():
        dist.all_gather_into_tensor(part, send, group=group)
        return
    gathered = part.new_empty((block * replicas, *part.shape[1:]))
    dist.all_gather_into_tensor(gathered, send, group=group)
    part.copy_(gathered[:rows])


# ---- counting ------------------------------------------------------------------------------------------------
@dataclass
class ReadCount:
    """Bytes this process read from the file system while counting (DCP files, safetensors slices)."""

    bytes: int = 0


_COUNTS: list[ReadCount] = []


@contextmanager
def counting_reads():
    """Count the bytes the readers of this module (and `count_read`) read inside the block."""
    count = ReadCount()
    _COUNTS.append(count)
    try:
        yield count
    finally:
        _COUNTS.remove(count)


def count_read(nbytes: int) -> None:
    for count in _COUNTS:
        count.bytes += nbytes


class _CountingStream(io.RawIOBase):
    """A binary file whose reads are counted (every byte DCP's reader takes from the file system)."""

    def __init__(self, raw):
        self.raw = raw

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset, whence=io.SEEK_SET):
        return self.raw.seek(offset, whence)

    def tell(self):
        return self.raw.tell()

    def readinto(self, buffer):
        n = self.raw.readinto(buffer)
        count_read(n or 0)
        return n

    def read(self, size=-1):
        data = self.raw.read(size)
        count_read(len(data))
        return data


def _counting_file_system():
    from torch.distributed.checkpoint.filesystem import FileSystem

    class CountingFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as stream:
                yield _CountingStream(stream) if "r" in mode else stream

    return CountingFileSystem()


# ---- DCP -------------------------------------------------------------------------------------------------------
def counting_reader(state_dir):
    """DCP's FileSystemReader with its reads counted: what every rank reads when it loads its whole part."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(state_dir)
    reader.fs = _counting_file_system()
    return reader


def range_reader(state_dir):
    """A DCP FileSystemReader that reads, of every stored piece, only the bytes of the rows asked for.

    DCP's own reader loads a whole stored piece (a `torch.save` archive inside the .distcp file) for any part of
    it. The archive stores the tensor's bytes uncompressed: its header (read with map_location="meta", no tensor
    data) gives where they start, and a request for whole rows of a contiguous tensor is one contiguous byte range.
    Anything else (an extension-transformed item, a request cutting dims past 0) is read as DCP reads it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.distributed.checkpoint.utils import _create_file_view

    class RangeReader(dcp.FileSystemReader):
        def read_data(self, plan, planner):
            per_file: dict[str, list] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for relative_path, items in per_file.items():
                with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                    for item in items:
                        info = self.storage_data[item.storage_index]
                        view = _create_file_view(stream, info.offset, info.length)
                        if item.type == LoadItemType.BYTE_IO:
                            planner.load_bytes(item, io.BytesIO(view.read(-1)))
                            continue
                        stored = None if info.transform_descriptors else torch.load(
                            view, map_location="meta", weights_only=True)
                        if stored is not None and _whole_rows(stored, item):
                            tensor = _read_rows(stream, info.offset, stored, item)
                        else:
                            view.seek(0)
                            tensor = narrow_tensor_by_index(torch.load(view, map_location="cpu", weights_only=True),
                                                            item.storage_offsets, item.lengths)
                        target = planner.resolve_tensor(item).detach()
                        if target.size() != tensor.size():
                            raise AssertionError(f"{item.storage_index}: read {tensor.size()}, expected {target.size()}")
                        target.copy_(tensor)
                        planner.commit_tensor(item, target)
            done = torch.futures.Future()
            done.set_result(None)
            return done

    reader = RangeReader(state_dir)
    reader.fs = _counting_file_system()
    return reader


def _whole_rows(stored: torch.Tensor, item) -> bool:
    """The request is rows [a, b) of a contiguous stored tensor, every other dim whole: one byte range."""
    return stored.is_contiguous() and all(
        offset == 0 and length == size
        for offset, length, size in zip(item.storage_offsets[1:], item.lengths[1:], stored.shape[1:]))


def _read_rows(stream, piece_offset: int, stored: torch.Tensor, item) -> torch.Tensor:
    """The requested rows' bytes, read straight from the archive's data record of the stored tensor."""
    lengths = list(item.lengths)
    nbytes = math.prod(lengths) * stored.element_size()
    first = stored.storage_offset() + (item.storage_offsets[0] * stored.stride(0) if stored.dim() else 0)
    stream.seek(piece_offset + stored.untyped_storage()._checkpoint_offset + first * stored.element_size())
    data = bytearray(nbytes)
    if nbytes and stream.readinto(memoryview(data)) != nbytes:
        raise OSError(f"short read of {item.storage_index.fqn}: the checkpoint file is truncated")
    return torch.frombuffer(data, dtype=stored.dtype).reshape(lengths) if nbytes else \
        torch.empty(lengths, dtype=stored.dtype)


@dataclass
class DcpParts:
    """What one rank reads of a (nested) state dict, and how its replicas complete it."""

    state: dict
    """The nested state dict loaded in place (tensors), its other values replaced as DCP loads them."""
    group: object
    """The replicas of this rank's part (the mesh's "replicate" dimension)."""
    targets: dict = field(default_factory=dict)
    """Flattened name (DCP's) -> this rank's whole local part of that tensor, in one order on every rank."""
    reads: dict = field(default_factory=dict)
    """Flattened name -> what this rank reads: the rows of its local part (a view) or a non-tensor value."""
    offsets: dict = field(default_factory=dict)
    """Flattened name -> the global offset of the rows read."""
    shapes: dict = field(default_factory=dict)
    """Flattened name -> the whole tensor's shape."""
    mappings: dict = field(default_factory=dict)
    """Flattened name -> its path in `state`."""


def plan_dcp_read(state: dict, group) -> DcpParts:
    """Split every tensor of `state` (plain tensors or FSDP2 DTensors) into the rows this rank reads: rank i of its
    replica group reads block i of its local part (`replica_rows`)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, mappings = flatten_state_dict(state)
    parts = DcpParts(state, group, mappings=mappings)
    replicas, index = group.size(), group.rank()
    for name, value in flat.items():
        if not isinstance(value, torch.Tensor):
            parts.reads[name] = value
            continue
        local, rows = local_rows(value)
        start = rows.start if rows is not None else 0
        read = replica_rows(local.shape[0], replicas, index) if local.dim() else slice(0, 0)
        parts.targets[name] = local
        parts.shapes[name] = value.shape
        parts.reads[name] = local[read] if local.dim() else local
        parts.offsets[name] = torch.Size([start + read.start, *[0] * (local.dim() - 1)]) if local.dim() else \
            torch.Size([])
    return parts


def read_dcp_parts(parts: DcpParts, state_dir) -> None:
    """Read this rank's rows from the DCP directory (a collective: every rank calls it). Raises DCP's errors."""
    import torch.distributed.checkpoint as dcp

    dcp.load(parts.reads, storage_reader=range_reader(state_dir), planner=_PartsPlanner(parts))
    from torch.distributed.checkpoint._traverse import set_element

    for name, value in parts.reads.items():
        if name not in parts.targets:
            set_element(parts.state, parts.mappings[name], value)


def complete_dcp_parts(parts: DcpParts) -> None:
    """The all-gather over the replica group that completes every tensor (collective; same order on every rank)."""
    for local in parts.targets.values():
        complete_over_replicas(local, parts.group)


def _PartsPlanner(parts: DcpParts):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import _create_read_items, create_read_items_for_chunk_list

    class PartsPlanner(DefaultLoadPlanner):
        """DCP's default load planner for plain tensors that are rows of a larger tensor, at `parts.offsets`."""

        def create_local_plan(self) -> LoadPlan:
            requests = []
            for name, value in self.state_dict.items():
                if name not in self.metadata.state_dict_metadata:
                    raise RuntimeError(f"Missing key in checkpoint state_dict: {name}.")
                md = self.metadata.state_dict_metadata[name]
                if name not in parts.targets:
                    requests += _create_read_items(name, md, value)
                    continue
                if isinstance(md, TensorStorageMetadata) and md.size != parts.shapes[name]:
                    raise ValueError(f"Size mismatch between saved {md.size} and current: {parts.shapes[name]} "
                                     f"for {name}")
                if value.numel():
                    chunk = ChunkStorageMetadata(offsets=parts.offsets[name], sizes=value.size())
                    requests += create_read_items_for_chunk_list(name, md, [chunk])
            return LoadPlan(requests)

        def lookup_tensor(self, index):
            return self.state_dict[index.fqn]

    return PartsPlanner()

"""Reading a model's (and optimizer's) state so that the file system serves it once, not once per replica.

R ranks hold identical copies of each part of the state: under `hsdp` the replicas of a shard (the mesh's
"replicate" dimension, R = W / S), under `replicate` every rank (R = W). Read naively, every one of them reads its
part from the file system: the state is served R times. Here the R ranks divide the reading of their parts
(`deal`): a tensor part is cut into R blocks of rows, each tensor's blocks going to the replicas that have read
the least so far, so that every replica reads about 1/R of the bytes even when a part has fewer rows than there
are replicas; a small part (`SMALL_BYTES`, a 0-dim tensor) is read whole by one replica, its owner. The
replicas then complete each other over their group (the network): one all-gather per split tensor, one broadcast
from its owner per small one. Every rank reads about 1/W of the state from the file system and ends holding exactly
the bytes a full read gives. Tensors are handled one at a time: no buffer larger than one tensor's local part.

- `local_rows`: the part of a (possibly FSDP2-sharded) tensor this rank holds, and its rows of the whole tensor.
- `deal` / `portion` / `complete_over_replicas`: who reads which rows of each part, and the collective after.
- `plan_dcp_read` / `read_dcp_parts` / `complete_dcp_parts`: the same for a torch.distributed.checkpoint (DCP)
  directory: a load plan for this rank's rows only, a reader that reads only their bytes from the stored pieces
  (`RangeReader`), then the collectives.
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


def replica_rows(rows: int, replicas: int, block_index: int) -> slice:
    """Rows of block `block_index` of a part of `rows` rows cut into `replicas` blocks of ceil(rows / replicas)
    rows (the last ones shorter or empty), so that one padded all-gather completes the part."""
    block = math.ceil(rows / replicas)
    return slice(min(block_index * block, rows), min((block_index + 1) * block, rows))


SMALL_BYTES = 64 * 1024
"""A part of at most this many bytes (or a 0-dim tensor) is read whole by one replica: split R ways, its reads
would be a few rows each, R requests (and R archive headers in a DCP piece) for what one read serves."""


@dataclass(frozen=True)
class Share:
    """How the replicas of one tensor part divide its reading."""

    owner: int | None
    """Small part: the replica (index in the group) that reads it whole and broadcasts it; None: split by rows."""
    first: int = 0
    """Split part: the replica that reads block 0 of its rows; replica i reads block (i - first) mod R."""


def deal(parts: list[torch.Tensor], replicas: int) -> list[Share]:
    """Who reads what of each part (in this order, the same on every replica). A split part's non-empty blocks go
    to consecutive replicas (mod R): the window that has read the fewest bytes so far, or, when every replica gets
    a block, the start that gives the short last block to the replica that has read the most; a small part goes to
    the replica that has read the fewest bytes. So no replica reads much more than 1/R of the bytes, even where
    parts have fewer rows than there are replicas. Needs only the parts' shapes: every replica computes the same
    shares."""
    shares, load = [], torch.zeros(replicas, dtype=torch.float64, device="cpu")  # bytes each has read so far
    for part in parts:
        nbytes = part.numel() * part.element_size()
        if part.dim() == 0 or nbytes <= SMALL_BYTES:
            owner = int(torch.argmin(load))
            load[owner] += nbytes
            shares.append(Share(owner=owner))
            continue
        rows = part.shape[split_dim(part)]
        block = math.ceil(rows / replicas)
        blocks = math.ceil(rows / block)  # the non-empty ones
        row_bytes = nbytes // rows
        if blocks == replicas:
            first = (int(torch.argmax(load)) - (blocks - 1)) % replicas
        else:
            cyclic = torch.cat([load.new_zeros(1), load, load[: blocks - 1]]).cumsum(0)
            windows = cyclic[blocks: blocks + replicas] - cyclic[:replicas]  # bytes read by replicas f .. f + blocks - 1
            first = int(torch.argmin(windows))
        receivers = [(first + b) % replicas for b in range(blocks)]
        load[receivers] += block * row_bytes
        load[receivers[-1]] -= (blocks * block - rows) * row_bytes
        shares.append(Share(owner=None, first=first))
    return shares


def split_dim(part: torch.Tensor) -> int:
    """The dim a part is cut along: its first of more than one element (a buffer of shape (1, 4096, ...) is cut
    along its 4096), 0 when there is none. Every dim before it has one element, so a block is contiguous."""
    return next((dim for dim, size in enumerate(part.shape) if size > 1), 0)


def rows_read(part: torch.Tensor, share: Share | None, group) -> slice:
    """The rows (along `split_dim`) of `part` (dim >= 1) this rank reads: all of them without replicas (`share` or
    `group` None)."""
    rows = part.shape[split_dim(part)]
    if share is None or group is None:
        return slice(0, rows)
    if share.owner is not None:
        return slice(0, rows) if group.rank() == share.owner else slice(0, 0)
    replicas = group.size()
    return replica_rows(rows, replicas, (group.rank() - share.first) % replicas)


def portion(part: torch.Tensor, share: Share | None, group) -> tuple[slice, ...] | None:
    """The index of `part` this rank reads (a slice per dim: `rows_read` along `split_dim`, the rest whole), or
    None when it reads none of it (a 0-dim part: () when it reads it)."""
    if part.dim() == 0:
        return () if share is None or group is None or share.owner == group.rank() else None
    read, dim = rows_read(part, share, group), split_dim(part)
    if read.stop == read.start:
        return None
    return tuple(read if d == dim else slice(0, size) for d, size in enumerate(part.shape))


def in_whole(index: tuple[slice, ...], start: int) -> tuple[slice, ...]:
    """`index` of a part as an index of the whole tensor, the part being its rows from `start` on (dim 0)."""
    if not index:
        return index
    return (slice(index[0].start + start, index[0].stop + start), *index[1:])


def complete_over_replicas(part: torch.Tensor, share: Share, group) -> None:
    """Fill `part` (this rank's local tensor, of which it has read its `rows_read`) with what its replicas read: a
    broadcast from the owner of a small part, one all-gather of the blocks of a split one (gathered in replica
    order, block b coming from replica (b + first) mod R)."""
    replicas = group.size()
    if replicas == 1 or part.numel() == 0:
        return
    if share.owner is not None:
        source = part if part.is_contiguous() else part.contiguous()
        dist.broadcast(source, src=dist.get_global_rank(group, share.owner), group=group)
        if source is not part:
            part.copy_(source)
        return
    mine = rows_read(part, share, group)
    part = part[(0,) * split_dim(part)]  # a view without the leading dims of one element
    rows = part.shape[0]
    block = math.ceil(rows / replicas)
    send = part.new_zeros((block, *part.shape[1:]))
    send[: mine.stop - mine.start] = part[mine]
    if share.first == 0 and rows == block * replicas and part.is_contiguous():
        dist.all_gather_into_tensor(part, send, group=group)
        return
    gathered = part.new_empty((block * replicas, *part.shape[1:]))
    dist.all_gather_into_tensor(gathered, send, group=group)
    # gathered holds blocks first, first + 1, ... (mod R): rotate them back into block order
    head = min(rows, (replicas - share.first) * block)
    part[:head].copy_(gathered[share.first * block: share.first * block + head])
    part[head:].copy_(gathered[: rows - head])


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
                        if stored is not None and _contiguous(stored, item):
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


def _contiguous(stored: torch.Tensor, item) -> bool:
    """The request is one byte range of a contiguous stored tensor: every dim before the first it takes more
    than one element of is taken one element of, every dim after it whole."""
    if not stored.is_contiguous():
        return False
    lengths, sizes = list(item.lengths), list(stored.shape)
    first = next((dim for dim, length in enumerate(lengths) if length > 1), len(lengths))
    return all(length == size for length, size in zip(lengths[first + 1:], sizes[first + 1:]))


def _read_rows(stream, piece_offset: int, stored: torch.Tensor, item) -> torch.Tensor:
    """The requested elements' bytes (one range: `_contiguous`), read straight from the archive's data record of
    the stored tensor."""
    lengths = list(item.lengths)
    nbytes = math.prod(lengths) * stored.element_size()
    first = stored.storage_offset() + sum(offset * stride for offset, stride in zip(item.storage_offsets,
                                                                                   stored.stride()))
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
    shares: dict = field(default_factory=dict)
    """Flattened name -> how the replicas divide its reading (`deal`)."""
    reads: dict = field(default_factory=dict)
    """Flattened name -> what this rank reads: the rows of its local part (a view, empty when it reads none of
    it) or a non-tensor value."""
    offsets: dict = field(default_factory=dict)
    """Flattened name -> the global offset of the rows read."""
    shapes: dict = field(default_factory=dict)
    """Flattened name -> the whole tensor's shape."""
    mappings: dict = field(default_factory=dict)
    """Flattened name -> its path in `state`."""


def plan_dcp_read(state: dict, group) -> DcpParts:
    """Split every tensor of `state` (plain tensors or FSDP2 DTensors) into what this rank reads (`deal` in the
    flattened state dict's order, then `portion`)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, mappings = flatten_state_dict(state)
    parts = DcpParts(state, group, mappings=mappings)
    for name, value in flat.items():
        if not isinstance(value, torch.Tensor):
            parts.reads[name] = value
            continue
        local, rows = local_rows(value)
        parts.targets[name] = local
        parts.shapes[name] = value.shape
    shares = deal(list(parts.targets.values()), group.size())
    for (name, local), share in zip(parts.targets.items(), shares):
        parts.shares[name] = share
        rows = local_rows(flat[name])[1]
        index = portion(local, share, group)
        parts.reads[name] = local[index] if index is not None else local.new_empty(0)
        parts.offsets[name] = torch.Size([s.start for s in in_whole(index or (), rows.start if rows else 0)])
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
    """The collectives over the replica group that complete every tensor (same order on every rank)."""
    for name, local in parts.targets.items():
        complete_over_replicas(local, parts.shares[name], parts.group)


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

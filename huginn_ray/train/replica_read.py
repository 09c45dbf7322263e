"""Reading a model's (and optimizer's) state so that the file system serves it once, not once per replica.

R ranks hold identical copies of each part of the state: under `hsdp` the replicas of a shard (the mesh's
"replicate" dimension, R = W / S), under `replicate` every rank (R = W). Read naively, every one of them reads its
part from the file system: the state is served R times. Here the R ranks divide the reading and complete each
other over their group (the network), so that every rank reads about 1/W of the state and ends holding exactly
the bytes a full read gives. Two readers:

- A torch.distributed.checkpoint (DCP) directory (resume, and init_from a training checkpoint): `read_dcp`. The
  stored bytes the group needs (of every stored piece the rows that overlap the group's part, in any save layout;
  every non-tensor piece whole) are laid end to end in file order (file, offset): B bytes. Replica r reads the
  contiguous bytes [r B / R, (r + 1) B / R): a few files, whatever W is. The replica whose span holds a piece's
  first needed byte reads that piece's archive header (where its data starts; one all-reduce gives every replica
  every start). Then in equal rounds of one all-gather each (about `ROUND_BYTES` gathered per round, the same
  count of rounds at every R), every replica gets the others' bytes and copies them into its tensors: no padding
  but the last replica's fewer-than-R bytes, no buffer but one round's beside the part. The replicas agree on
  failure (an all-reduce before the rounds, one after), so a replica group raises together.
- A safetensors directory (init_from a released model): `deal` / `portion` / `complete_over_replicas`. A tensor
  part is cut into R blocks of rows, each tensor's blocks going to the replicas that have read the least so far;
  a small part (`SMALL_BYTES`, a 0-dim tensor) is read whole by one replica, its owner; then one all-gather per
  split tensor, one broadcast per small one. The file count of a released model is fixed (its shards), so a rank
  opens at most those files at any W.

- `local_rows`: the part of a (possibly FSDP2-sharded) tensor this rank holds, and its rows of the whole tensor.
Both DCP readers (`read_dcp` and `counting_reader`) take the DCP directory as a location, a local path or a
bucket's prefix: every file is opened by huginn_ray.train.file_reads.open_for_reading (on a bucket, ranged GETs).

- `counting_reads`: bytes read from the file system by this process (what the tests and bench/scale_sim.py count);
  `counting_reader`: DCP's own reader, counted (a rank reading its whole part, without replicas).
"""

from __future__ import annotations

import io
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from huginn_ray import storage
from huginn_ray.train.file_reads import open_for_reading


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
    """DCP's file system over huginn_ray.storage, for reading: a checkpoint directory is a location (a local path
    or a bucket prefix), its files opened by `open_for_reading`, every byte read counted."""
    from torch.distributed.checkpoint.filesystem import FileSystemBase

    class CountingFileSystem(FileSystemBase):
        @contextmanager
        def create_stream(self, path, mode):
            if "r" not in mode:
                raise ValueError(f"{path}: DCP's reader over huginn_ray.storage only reads")
            with open_for_reading(path) as stream:
                yield _CountingStream(stream)

        def concat_path(self, path, suffix):
            return storage.join(str(path), suffix)

        def init_path(self, path):
            return str(path)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id) -> bool:
            return True

        def exists(self, path) -> bool:
            return storage.exists(str(path))

        def rename(self, path, new_path) -> None:
            raise ValueError(f"{path}: DCP's reader over huginn_ray.storage only reads")

        mkdir = rm_file = rename

    return CountingFileSystem()


# ---- DCP -------------------------------------------------------------------------------------------------------
def counting_reader(state_dir):
    """DCP's FileSystemReader of the DCP directory `state_dir` (a local path or a bucket prefix), with its reads
    counted: what every rank reads when it loads its whole part."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(state_dir))
    reader.fs = _counting_file_system()
    reader.path = str(state_dir)  # a bucket URI kept as it is (DCP's own init_path makes every path a Path)
    return reader


ROUND_BYTES = 64 * 2**20
"""About what one round of the replicas' exchange gathers (the bounded buffer a rank holds beside its part)."""


@dataclass(frozen=True)
class Segment:
    """Bytes the replica group needs of one stored piece: a run of whole rows of one tensor's stored chunk (or a
    whole non-tensor piece), at `position` in the group's bytes laid end to end."""

    fqn: str
    relative_path: str
    piece_offset: int
    """Where the piece (a torch.save archive, or a non-tensor's pickled bytes) starts in its file."""
    piece_length: int
    start: int
    """The first byte needed, counted from the start of the stored tensor's data (a non-tensor piece: 0)."""
    length: int
    target_start: int
    """Where those bytes go in this rank's part of the tensor, as bytes (a non-tensor piece: 0)."""
    chunk_sizes: tuple | None
    """The stored chunk's shape (checked against the archive's header); None for a non-tensor piece."""
    position: int


@dataclass
class GroupBytes:
    """What a replica group reads of a DCP checkpoint: its segments in file order (file, offset), end to end."""

    segments: list[Segment]
    targets: dict
    """fqn -> this rank's part of the tensor as one flat run of bytes (a view: writing it writes the tensor)."""
    non_tensors: dict
    """fqn -> a buffer (on the tensors' device) for a non-tensor piece's pickled bytes."""
    total: int


def read_dcp(state_dir, state: dict, group, round_bytes: int = ROUND_BYTES) -> None:
    """Load `state` (a nested state dict of plain tensors and FSDP2 DTensors sharded on dim 0, and non-tensor
    values) in place from the DCP directory `state_dir`, the file system serving each byte once. A collective over
    the default group: every rank calls it, `group` being the replicas of its part (the mesh's "replicate" dim).

    Two passes of `read_spread`: the values every rank holds whole (plain tensors: the RoPE buffer, the optimizer's
    step counters; non-tensor values), which every rank needs alike, spread over every rank (the default group;
    the small ones are one run of rank 0's file: checkpoint.SmallValuesOnRankZero); then this rank's part of every
    DTensor, spread over `group`.

    Raises ValueError naming the file and key for a checkpoint that does not hold what `state` asks (a missing key
    or rows, another shape or dtype, a piece that is not a plain torch.save of a contiguous tensor), OSError when a
    file could not be read; on every rank alike (the failing ranks with their own error, the others saying how many
    failed), so that all may retry together."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor

    flat, mappings = flatten_state_dict(state)
    device = next((t.device for t in flat.values() if isinstance(t, torch.Tensor)), torch.device("cpu"))
    everyone, errors, passes = dist.group.WORLD, _Errors(state_dir), []
    with errors.caught():
        metadata = counting_reader(state_dir).read_metadata()
        passes = [(plan_group_bytes(metadata, {fqn: value for fqn, value in flat.items()
                                               if isinstance(value, DTensor) == sharded}, state_dir, device),
                   group if sharded else everyone) for sharded in (False, True)]
    errors.settle(everyone, device)  # a rank that could not plan has no layout to exchange: all stop here
    with _Files(state_dir) as files:
        for plan, replicas in passes:
            if plan.segments:  # the same on every rank: the state's keys decide it
                read_spread(plan, replicas, files, errors, device, round_bytes)
    errors.settle(everyone, device)
    for plan, _ in passes:
        set_non_tensors(plan, state, mappings)


def read_spread(plan: GroupBytes, group, files: _Files, errors: _Errors, device, round_bytes: int) -> None:
    """Fill this rank's tensors of `plan`, which every rank of `group` needs alike, each rank reading 1/R of them.

    The group's bytes are cut into R equal spans, one per replica, each a few files' worth of contiguous reads.
    The owner of each stored piece's first needed byte reads the piece's archive header (where its data starts),
    and one all-reduce gives every replica every piece's data start (and whether a replica failed: then the group
    skips its rounds together). Then, round by round, each replica reads the next `chunk` bytes of its span and
    an all-gather gives every replica every replica's chunk, which it copies into its tensors: R x chunk (about
    `round_bytes`) is the one buffer it holds beside its part; only the last replica's span is shorter (by fewer
    than R bytes), its chunks padded. A read that fails is recorded in `errors`, the rounds going on."""
    replicas, me = group.size(), group.rank()
    span = max(math.ceil(plan.total / replicas), 1)
    data_starts = [0] * len(plan.segments)
    for index, segment in enumerate(plan.segments):
        if segment.chunk_sizes is not None and segment.position // span == me:
            with errors.caught():
                data_starts[index] = files.data_start(segment)
    data_starts, failed = errors.exchange(group, device, data_starts)
    if failed:
        return
    chunk, rounds = round_layout(plan.total, replicas, round_bytes)
    host = torch.empty(chunk, dtype=torch.uint8)
    positions = [segment.position for segment in plan.segments]
    for round_index in range(rounds):
        width = min(chunk, span - round_index * chunk)
        first = me * span + round_index * chunk
        stop = min(first + width, plan.total)
        host[max(stop - first, 0): width].zero_()  # the last replica's padding
        with errors.caught():
            files.read(plan, positions, data_starts, first, stop, host)
        if replicas == 1:
            gathered = host[:width].to(device)
        else:
            gathered = torch.empty(width * replicas, dtype=torch.uint8, device=device)
            dist.all_gather_into_tensor(gathered, host[:width].to(device), group=group)
        for replica in range(replicas):
            start = replica * span + round_index * chunk
            _scatter(plan, positions, start, min(start + width, plan.total),
                     gathered[replica * width: (replica + 1) * width])


def set_non_tensors(plan: GroupBytes, state: dict, mappings: dict) -> None:
    """Put the non-tensor values (their pickled pieces, gathered with the tensors' bytes) into `state`, as DCP's
    load does."""
    from torch.distributed.checkpoint._traverse import set_element

    for fqn, buffer in plan.non_tensors.items():
        set_element(state, mappings[fqn], torch.load(io.BytesIO(buffer.cpu().numpy().tobytes()), weights_only=False))


def round_layout(total: int, replicas: int, round_bytes: int) -> tuple[int, int]:
    """(chunk, rounds): each replica's span of ceil(total / R) bytes read and gathered in `rounds` chunks of
    `chunk` bytes (the last one shorter), as many rounds as `total` needs in about `round_bytes` each: the same
    count at every R."""
    span = math.ceil(total / replicas)
    if span == 0:
        return 0, 0
    chunk = math.ceil(span / math.ceil(total / round_bytes))
    return chunk, math.ceil(span / chunk)


def plan_group_bytes(metadata, flat: dict, state_dir, device) -> GroupBytes:
    """The segments this rank's replica group needs (the same on every replica: only this rank's rows of each
    tensor, which its replicas share, and the metadata decide it): of every stored chunk of a tensor the rows that
    overlap this rank's part, every non-tensor piece whole; in file order (file, offset)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    pieces, targets, non_tensors = [], {}, {}
    for fqn, value in flat.items():
        stored = metadata.state_dict_metadata.get(fqn)
        if stored is None:
            raise ValueError(f"{state_dir}: {fqn} is not in the checkpoint (its .metadata)")
        if not isinstance(value, torch.Tensor):
            if not isinstance(stored, BytesStorageMetadata):
                raise ValueError(f"{state_dir}: {fqn} is a tensor in the checkpoint, not a {type(value).__name__}")
            info = _storage(metadata, MetadataIndex(fqn), state_dir)
            pieces.append((info, 0, info.length, 0, None, fqn))
            non_tensors[fqn] = torch.empty(info.length, dtype=torch.uint8, device=device)
            continue
        if isinstance(stored, BytesStorageMetadata):
            raise ValueError(f"{state_dir}: {fqn} is not a tensor in the checkpoint")
        if stored.size != value.shape or stored.properties.dtype != value.dtype:
            raise ValueError(f"{state_dir}: {fqn} is stored as {stored.properties.dtype} {list(stored.size)}, "
                             f"this run's is {value.dtype} {list(value.shape)}")
        local, rows = local_rows(value)
        if not local.is_contiguous():
            raise ValueError(f"{fqn}: this rank's part is not contiguous: it cannot be filled as bytes")
        targets[fqn] = local.reshape(-1).view(torch.uint8)
        whole = value.shape[0] if value.dim() else 1
        rows = rows or slice(0, whole)
        row_bytes = math.prod(value.shape[1:]) * value.element_size()
        covered = 0
        for chunk_index, chunk in enumerate(stored.chunks):
            first_row, chunk_rows = (chunk.offsets[0], chunk.sizes[0]) if value.dim() else (0, 1)
            if list(chunk.offsets[1:]) != [0] * (value.dim() - 1) or list(chunk.sizes[1:]) != list(value.shape[1:]):
                raise ValueError(f"{state_dir}: {fqn} is stored in pieces cut along another dim than 0 "
                                 f"({list(chunk.offsets)} + {list(chunk.sizes)}): they cannot be read as rows")
            low, high = max(rows.start, first_row), min(rows.stop, first_row + chunk_rows)
            if low >= high:
                continue
            covered += high - low
            info = _storage(metadata, MetadataIndex(fqn, chunk.offsets, chunk_index), state_dir)
            pieces.append((info, (low - first_row) * row_bytes, (high - low) * row_bytes,
                           (low - rows.start) * row_bytes, tuple(chunk.sizes), fqn))
        if covered != rows.stop - rows.start:
            raise ValueError(f"{state_dir}: rows {rows.start}..{rows.stop} of {fqn} are not all in the checkpoint's "
                             f"pieces ({covered} of them are)")
    pieces.sort(key=lambda piece: (piece[0].relative_path, piece[0].offset, piece[1]))
    segments, position = [], 0
    for info, start, length, target_start, chunk_sizes, fqn in pieces:
        if info.transform_descriptors:
            raise ValueError(f"{storage.join(state_dir, info.relative_path)}: the piece of {fqn} is stored transformed "
                             f"({info.transform_descriptors}): only plain torch.save pieces are read")
        segments.append(Segment(fqn, info.relative_path, info.offset, info.length, start, length, target_start,
                                chunk_sizes, position))
        position += length
    return GroupBytes(segments, targets, non_tensors, position)


def _storage(metadata, index, state_dir):
    info = metadata.storage_data.get(index)
    if info is None:
        raise ValueError(f"{state_dir}: the piece of {index.fqn}" + (f" at {list(index.offset)}" if index.offset
                         is not None else "") + " is missing from the checkpoint's .metadata storage data")
    return info


def _overlapping(plan: GroupBytes, positions: list[int], first: int, stop: int):
    """(segment, its first byte in [first, stop), that run's end) for every segment overlapping those bytes."""
    from bisect import bisect_right

    index = max(bisect_right(positions, first) - 1, 0)
    while index < len(plan.segments) and positions[index] < stop:
        segment = plan.segments[index]
        low, high = max(first, segment.position), min(stop, segment.position + segment.length)
        if low < high:
            yield index, segment, low, high
        index += 1


def _scatter(plan: GroupBytes, positions: list[int], first: int, stop: int, data: torch.Tensor) -> None:
    """Copy the group's bytes [first, stop), which `data` holds from its start, into this rank's tensors."""
    for _, segment, low, high in _overlapping(plan, positions, first, stop):
        source = data[low - first: high - first]
        if segment.chunk_sizes is None:
            plan.non_tensors[segment.fqn][low - segment.position: high - segment.position].copy_(source)
        else:
            at = segment.target_start + low - segment.position
            plan.targets[segment.fqn][at: at + high - low].copy_(source)


class _Files:
    """The files of this replica's span, each opened once (at its first read) and closed at the end."""

    def __init__(self, state_dir):
        self.state_dir, self.open = state_dir, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for stream in self.open.values():
            stream.raw.close()

    def stream(self, relative_path: str):
        if relative_path not in self.open:
            self.open[relative_path] = _CountingStream(open_for_reading(storage.join(self.state_dir, relative_path)))
        return self.open[relative_path]

    def data_start(self, segment: Segment) -> int:
        """Where the stored tensor's data starts in its piece: the piece's torch.save archive read with
        map_location="meta" (its header and record directory, no tensor data)."""
        from torch.distributed.checkpoint.utils import _create_file_view

        path = storage.join(self.state_dir, segment.relative_path)
        try:
            stored = torch.load(_create_file_view(self.stream(segment.relative_path), segment.piece_offset,
                                                  segment.piece_length), map_location="meta", weights_only=True)
        except OSError:
            raise
        except Exception as err:  # noqa: BLE001 - torch raises RuntimeError, UnpicklingError, ... for a bad piece
            raise ValueError(f"{path}: the piece of {segment.fqn} at byte {segment.piece_offset} is not a torch.save "
                             f"archive ({type(err).__name__}: {str(err)[:200]})") from None
        if not isinstance(stored, torch.Tensor) or tuple(stored.shape) != segment.chunk_sizes \
                or not stored.is_contiguous():
            raise ValueError(f"{path}: the piece of {segment.fqn} at byte {segment.piece_offset} is not a contiguous "
                             f"tensor of shape {list(segment.chunk_sizes)}")
        return stored.untyped_storage()._checkpoint_offset + stored.storage_offset() * stored.element_size()

    def read(self, plan: GroupBytes, positions, data_starts, first: int, stop: int, host: torch.Tensor) -> None:
        """The group's bytes [first, stop) into `host` from its start, piece by piece from the files."""
        into = memoryview(host.numpy())
        for index, segment, low, high in _overlapping(plan, positions, first, stop):
            stream = self.stream(segment.relative_path)
            stream.seek(segment.piece_offset + data_starts[index] + segment.start + low - segment.position)
            wanted = into[low - first: high - first]
            got = 0
            while got < len(wanted):
                n = stream.readinto(wanted[got:])
                if not n:
                    raise OSError(f"{storage.join(self.state_dir, segment.relative_path)}: short read of the piece of "
                                  f"{segment.fqn}: the checkpoint file is truncated")
                got += n


class _Errors:
    """This rank's first error reading the checkpoint, and the ranks' agreement on whether any had one: every rank
    takes part in every collective even after a failure, then all raise together."""

    def __init__(self, state_dir):
        self.state_dir, self.error = state_dir, None

    @contextmanager
    def caught(self):
        try:
            yield
        except (OSError, ValueError) as err:
            self.error = self.error or err

    def exchange(self, group, device, values: list[int]) -> tuple[list[int], bool]:
        """The sum over `group` of `values` (each set by one replica, zero on the others), and whether a replica
        of the group has failed so far."""
        summed = torch.tensor([*values, int(self.error is not None)], dtype=torch.int64, device=device)
        if group.size() > 1:
            dist.all_reduce(summed, group=group)
        *values, failed = summed.tolist()
        return values, failed > 0

    def settle(self, everyone, device) -> None:
        """Raise on every rank when any has failed: this rank's own error, or how many ranks failed (an OSError
        when every failure is one, so that all retry together)."""
        mine = [int(isinstance(self.error, OSError)), int(self.error is not None and not isinstance(self.error,
                                                                                                    OSError))]
        failed = torch.tensor(mine, dtype=torch.int64, device=device)
        if everyone.size() > 1:
            dist.all_reduce(failed, group=everyone)
        io_failed, other_failed = failed.tolist()
        if self.error is not None:
            raise self.error
        if io_failed or other_failed:
            message = (f"{self.state_dir}: {io_failed + other_failed} other rank(s) could not read their bytes of "
                       "the checkpoint (each names its file)")
            raise OSError(message) if not other_failed else ValueError(message)

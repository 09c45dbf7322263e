"""The save's stand-ins for bench/scale_sim.py: what the other W - 1 ranks send in DCP's save coordination, and a
FileSystemWriter that writes sparse files instead of the (meta) tensors' bytes.

`ckpt.start_save` and `dcp.save` run as they are, over the fake process group, with DCP's save-plan caching. Two
things cannot come from the fake group and are supplied here, in one place each:

- `OtherRanks`: DCP's `_DistWrapper.gather_object` and `scatter_object` run torch's object collectives (counted
  like every c10d operation), but over the fake group the objects they return are the bytes of no rank. The
  coordinator (rank 0) receives instead what the other ranks' DCP would have sent: at the plan step each rank's
  local plan (rank r holds shard r mod S of every tensor: the local plan of that shard index, without the values
  rank 0 alone writes), or, when this rank's own DCP finds its plan unchanged since its last save (plan caching),
  the empty, unusable plan every rank sends then; at the write step each rank's write results, from the final plan
  DCP last scattered to it. Another simulated rank receives from the scatter what the simulated rank 0 sent it
  (`FromRankZero`). torch's gather_object sizes every rank's object as this rank's (the all-gather of sizes gives
  every rank this rank's size).
- `SparseWriter`: the model is on the meta device; each rank's file becomes a sparse file of the size its pieces
  fill, and the write results (file, offset, length of each piece) are FileSystemWriter's for a file of those
  pieces back to back. The `.metadata` and everything else are FileSystemWriter's own. A background save
  (`dcp.async_save`) stages the state through the writer (FileSystemWriter is DCP's stager): the copy to host
  memory is not made (the state is on the meta device), the staged state is the state itself, and the bytes the
  copy would hold, this rank's part of the state, are planned (`bytes_staged`).
- `background_save_counted`: `dcp.async_save` runs `dcp.save` in a thread of its own; the counting dispatch mode
  is thread-local, so the thread's save runs inside the same mode (its collectives, on the background group, are
  counted like the others).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
from torch.distributed import distributed_c10d
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import _async_thread_executor
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import _DistWrapper

from huginn_ray.train import checkpoint as ckpt
from huginn_ray.train import parallel
from scale_sim_counting import Counts, tensors_in, uncounted

PICKLED_VALUE_BYTES = 1261
"""A non-tensor value's bytes in its file (a pickled object: a few hundred bytes)."""


@dataclasses.dataclass
class FromRankZero:
    """What the simulated rank 0 sent that the other simulated rank (run after it, in another process) receives."""

    broadcasts: list = dataclasses.field(default_factory=list)
    """Every broadcast's payload, in order (as plain values)."""
    scattered: list = dataclasses.field(default_factory=list)
    """The object each of DCP's scatters gave the last rank, in order."""


def item_bytes(item) -> int:
    """A write item's bytes in its file: a tensor's elements, or a pickled object."""
    if item.tensor_data is None:
        return PICKLED_VALUE_BYTES
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def write_results(plan: SavePlan) -> tuple[str, list[WriteResult]]:
    """The file a rank's final plan writes (FileSystemWriter: one per rank) and the result of every piece in it."""
    name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
    results, offset = [], 0
    for item in plan.items:
        length = item_bytes(item)
        results.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=_StorageInfo(name, offset, length)))
        offset += length
    return name, results


def sparse_file(directory, plan: SavePlan) -> tuple[int, list[WriteResult]]:
    """The file of a rank's final plan, as a sparse file of its pieces' size; its size and write results."""
    name, results = write_results(plan)
    size = sum(result.size_in_bytes for result in results)
    with uncounted(), open(directory / name, "wb") as f:
        f.truncate(size)
    return size, results


class SparseWriter(FileSystemWriter):
    """FileSystemWriter, its tensor data written as a sparse file of the pieces' size (counted as written)."""

    counts: Counts | None = None
    """This simulated rank's counts (set by the simulator)."""

    other_ranks: OtherRanks | None = None
    """The other ranks' stand-in, which writes their files into the same directory."""

    def stage(self, state_dict):
        """The background save's copy to host memory, planned: its bytes counted, the (meta) state returned."""
        self.counts.add("bytes_staged", sum(parallel.local(t).numel() * t.element_size()
                                            for t in tensors_in(state_dict)))
        return state_dict

    def write_data(self, plan, planner):
        self.other_ranks.directory = self.path
        size, results = sparse_file(self.path, plan)
        self.counts.add("bytes_written", size)
        done = torch.futures.Future()
        done.set_result(results)
        return done


@contextlib.contextmanager
def background_save_counted(mode):
    """dcp.async_save's thread runs its save inside `mode` (the counting dispatch mode, thread-local)."""
    real = _async_thread_executor.save_wrapper

    def save_in_mode(*args, **kwargs):
        with mode:
            return real(*args, **kwargs)

    _async_thread_executor.save_wrapper = save_in_mode
    try:
        yield
    finally:
        _async_thread_executor.save_wrapper = real


@contextlib.contextmanager
def objects_not_unpickled():
    """torch's object collectives return None for what the fake group delivered (the bytes of no rank)."""
    real = distributed_c10d._tensor_to_object
    distributed_c10d._tensor_to_object = lambda tensor, size, group: None
    try:
        yield
    finally:
        distributed_c10d._tensor_to_object = real


class OtherRanks:
    """The other ranks of DCP's save coordination (see the module docstring), installed over `_DistWrapper`."""

    def __init__(self, world_size: int, rank: int, shard_size: int, local_plans_by_shard: dict,
                 from_rank_zero: FromRankZero, counts: Counts):
        self.world_size, self.rank, self.shard_size = world_size, rank, shard_size
        self.local_plans_by_shard, self.from_rank_zero, self.counts = local_plans_by_shard, from_rank_zero, counts
        self.directory = None
        """The directory DCP's writer writes this save into."""
        self.final_plans: dict[int, SavePlan] = {}
        """rank -> the final plan DCP last scattered to it (what its planner's cache holds)."""

    def most_bytes_of_a_rank(self) -> int:
        """The most bytes DCP's last global plan gives one rank to write (0 where this rank did not coordinate)."""
        return max((sum(item_bytes(item) for item in plan.items) for plan in self.final_plans.values()), default=0)

    def local_plan_of(self, r: int, own: SavePlan) -> SavePlan:
        if not own.usable:  # unchanged since the last save, as every rank's state is: DCP's plan cache sends nothing
            return SavePlan([], usable=False)
        plan = self.local_plans_by_shard[r % self.shard_size]
        return plan if r == 0 else ckpt.SmallValuesOnRankZero.without_rank_zero_values(plan)

    def sent_by(self, r: int, own):
        if isinstance(own, SavePlan):
            return self.local_plan_of(r, own)
        if isinstance(own, list):  # what rank r wrote: its file too
            return sparse_file(self.directory, self.final_plans[r])[1]
        return own  # an error of this rank's step: every rank's, alike

    def gather_object(self, wrapper: _DistWrapper, own):
        with objects_not_unpickled():
            REAL["gather_object"](wrapper, own)
        if not wrapper.is_coordinator:
            return None
        objects = [own if r == self.rank else self.sent_by(r, own) for r in range(self.world_size)]
        if isinstance(own, SavePlan):
            self.counts.add("dcp_plan_items", sum(len(plan.items) for plan in objects))
        return objects

    def scatter_object(self, wrapper: _DistWrapper, objects: list | None):
        with objects_not_unpickled():
            REAL["scatter_object"](wrapper, objects)
        if not wrapper.is_coordinator:
            return self.from_rank_zero.scattered.pop(0)
        for r, plan in enumerate(objects):
            if isinstance(plan, SavePlan) and plan.usable:
                self.final_plans[r] = plan
        self.from_rank_zero.scattered.append(objects[self.world_size - 1])
        return objects[self.rank]

    @contextlib.contextmanager
    def installed(self):
        _DistWrapper.gather_object = lambda wrapper, own: self.gather_object(wrapper, own)
        _DistWrapper.scatter_object = lambda wrapper, objects: self.scatter_object(wrapper, objects)
        real_writer, ckpt.dcp.FileSystemWriter = ckpt.dcp.FileSystemWriter, SparseWriter
        SparseWriter.counts, SparseWriter.other_ranks = self.counts, self
        try:
            yield
        finally:
            _DistWrapper.gather_object, _DistWrapper.scatter_object = REAL["gather_object"], REAL["scatter_object"]
            ckpt.dcp.FileSystemWriter = real_writer


REAL = {"gather_object": _DistWrapper.gather_object, "scatter_object": _DistWrapper.scatter_object}
"""DCP's own methods, which the stand-ins run for their collectives."""

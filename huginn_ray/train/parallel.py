"""Data parallelism as a device mesh: `replicate` (every rank holds the whole model) or `hsdp` (FSDP2 inside a
shard group, the reference's chunk stream between shard groups), and context parallelism inside either.

The mesh has two dimensions, ("replicate", "shard"), of shape (W / S, S); rank = replica x S + shard index, so a
shard group is S consecutive ranks, which is one node when S is Ray Train's local world size (Ray Train numbers
workers node by node; `check_node_layout` verifies it on every run).

- `replicate` (S = 1): the model is whole on every rank; `grad_sync.kind` (chunk_stream, chunk_stream_overlap,
  ddp) exchanges the gradients over all ranks. The reference-exact path.
- `hsdp`: FSDP2 (`fully_shard` on the "shard" dimension) shards parameters, gradients and optimizer state over
  the S ranks of a shard group. Units: every prelude and coda block (gathered for its forward, again for its
  backward), the core block as one unit (`RecurrentCore.forward` runs every iteration in one call, so the core is
  gathered once per step and kept until its backward ends, then reduce-scattered once), and the root (embedding
  = tied head, adapter, final norm). Within the shard group FSDP reduce-scatters the gradient sums (no division);
  between shard groups each rank then streams its gradient shard over the "replicate" dimension with
  `grad_sync.kind` (`ChunkStream` after backward, `ChunkStreamOverlap` as each unit's reduce-scatter completes):
  fixed-size, zero-padded fp32 chunks, summed, then divided by W (reference §4.2). Each rank sends 1/S of the
  flat stream's bytes between shard groups.

Numerics: the sharded parameters are the fp32 master weights, reductions run in fp32, and bf16 comes from the
autocast around the forward, as in `replicate`. `parallelism.param_dtype` (`gather_dtype`) picks the dtype the
blocks' matmul weights are gathered in: fp32 (the default on CPU) or bf16 (the default under bf16-mixed), the
values autocast would cast them to, at half the bytes (`apply_hsdp`).

Context parallelism (`parallelism.context_parallel` = N, huginn_ray.train.context_parallel): N consecutive ranks
(a cp group, inside a node) split each sequence; they read the same rows (the data order runs on W / N ranks,
`MeshShape.data_rank`) and hold the same parameters: under hsdp FSDP shards over the whole shard group, shard x cp
(as torchtitan shards over its flattened dp_shard x cp), under replicate every rank holds the model. Their
gradients are partial sums over their positions, which the exchange sums like any rank's; the chunk stream
between shard groups is unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class MeshShape:
    """The run's layout, typed: whether the model is sharded and how the ranks are laid out, `replicas` shard groups
    of `shard_size` consecutive ranks. Built once from `parallelism.mode` (`ParallelismSection.sharded`): nothing
    compares the mode's string after it."""

    sharded: bool
    """hsdp: FSDP2 shards the model over a shard group; replicate: every rank holds it whole."""
    world_size: int
    shard_size: int
    """Ranks that share one copy of the model (1 under replicate); under hsdp with context parallelism the ranks
    of shard x cp (FSDP shards over both, as torchtitan does)."""
    context_parallel: int = 1
    """Ranks one sequence is split over (`parallelism.context_parallel`): a cp group is that many consecutive
    ranks, inside a shard group (hsdp) or a node (replicate)."""

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_size

    @property
    def data_ranks(self) -> int:
        """Ranks that read different rows (huginn_ray.train.data_order): the cp groups; a cp group's ranks read the
        same rows and keep their positions of them."""
        return self.world_size // self.context_parallel

    def data_rank(self, rank: int) -> int:
        """The data order's rank of `rank`: its cp group."""
        return rank // self.context_parallel

    @property
    def name(self) -> str:
        """The layout as a checkpoint records it (`TrainerState.layout`)."""
        name = f"hsdp, shard_size {self.shard_size}" if self.sharded else "replicate"
        return name + (f", context_parallel {self.context_parallel}" if self.context_parallel > 1 else "")


class LayoutError(ValueError):
    """A worker layout the mesh cannot take (names the numbers)."""


def mesh_shape(sharded: bool, world_size: int, local_world_size: int, context_parallel: int = 1) -> MeshShape:
    """Sharded (hsdp): a shard group is one node of `local_world_size` ranks (Ray Train's local world size).
    `context_parallel` consecutive ranks split each sequence; it must divide the node's ranks."""
    if sharded and world_size % local_world_size:
        raise LayoutError(f"{local_world_size} ranks per node do not divide the world size {world_size}")
    if local_world_size % context_parallel:
        raise LayoutError(f"parallelism.context_parallel={context_parallel} does not divide the {local_world_size} "
                         "ranks of a node: a cp group would span nodes")
    return MeshShape(sharded, world_size, local_world_size if sharded else 1, context_parallel)


def check_node_layout(shape: MeshShape, placements: list[dict]) -> None:
    """Every rank's (node_rank, local_rank, local_world_size), as Ray Train reports them, in rank order: ranks must
    be numbered node by node, every node must run the same number of workers, and a shard group must lie inside
    one node (FSDP's gathers and reductions belong on the node's fast links). Raises naming the first bad rank."""
    local_sizes = {p["local_world_size"] for p in placements}
    if len(local_sizes) > 1:
        counts = ", ".join(f"rank {r}: {p['local_world_size']}" for r, p in enumerate(placements))
        raise RuntimeError(f"the nodes run different numbers of workers ({counts}); every node must run the same "
                           "number (scaling.num_workers a multiple of the workers per node)")
    local_size = local_sizes.pop()
    for rank, p in enumerate(placements):
        if rank != p["node_rank"] * local_size + p["local_rank"]:
            raise RuntimeError(f"rank {rank} is local rank {p['local_rank']} on node {p['node_rank']} "
                               f"({local_size} workers per node): ranks are not numbered node by node")
    if local_size % shape.shard_size:
        raise RuntimeError(f"a shard group of {shape.shard_size} ranks does not divide the {local_size} workers of "
                           "a node: it would span nodes")
    if local_size % shape.context_parallel:
        raise RuntimeError(f"parallelism.context_parallel={shape.context_parallel} does not divide the {local_size} "
                           "workers of a node: a cp group would span nodes")


def describe_layout(shape: MeshShape, placements: list[dict]) -> str:
    """One line for the console: which node (Ray's node rank and address) runs which ranks, and the mesh.
    `placements`: every rank's placement as `check_node_layout` takes it, plus its node's address (`node_ip`)."""
    nodes: dict[int, list[int]] = {}
    for rank, p in enumerate(placements):
        nodes.setdefault(p["node_rank"], []).append(rank)
    where = ", ".join(f"node {node} ({placements[ranks[0]]['node_ip']}) ranks {ranks[0]}-{ranks[-1]}"
                      for node, ranks in sorted(nodes.items()))
    mesh = (f"hsdp: {shape.replicas} shard group(s) of {shape.shard_size} ranks" if shape.sharded
            else "replicate")
    if shape.context_parallel > 1:
        mesh += (f"; cp groups of {shape.context_parallel} consecutive ranks split each sequence (all-gather K/V "
                 "attention)")
    return f"{shape.world_size} workers on {len(nodes)} node(s): {where}; {mesh}"


def build_mesh(shape: MeshShape, device_type: str) -> DeviceMesh:
    """The ("replicate", "shard") mesh. Each rank creates only the two process groups it is a member of (its
    replicas' column and its shard group's row; the world's own group where one spans every rank), with
    `use_local_synchronization` so that the other ranks take no part: two new_group calls per rank, where
    init_device_mesh would make every rank call new_group for every row and column (W / S + S calls). A group's
    communicator is connected when the backend does it: NCCL (RCCL) at the group's first collective (warm_mesh),
    gloo at creation, a full mesh of connections to every member (README, "Cost at scale")."""
    layout = torch.arange(shape.world_size).view(shape.replicas, shape.shard_size)
    replica, shard = divmod(dist.get_rank(), shape.shard_size)
    groups = [group_of(layout[:, shard].tolist()), group_of(layout[replica].tolist())]
    return DeviceMesh.from_group(groups, device_type, mesh=layout, mesh_dim_names=("replicate", "shard"))


def context_group(shape: MeshShape):
    """This rank's cp group (its `context_parallel` consecutive ranks), created by its members alone; None without
    context parallelism."""
    if shape.context_parallel == 1:
        return None
    first = shape.data_rank(dist.get_rank()) * shape.context_parallel
    return group_of(list(range(first, first + shape.context_parallel)))


def group_of(ranks: list[int]):
    """The process group of `ranks`, created by its members alone; the default group when it is every rank."""
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    return dist.new_group(ranks, use_local_synchronization=True)


GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"


def lazy_gloo_group():
    """A gloo group of every rank whose connections open at their first use (TORCH_GLOO_LAZY_INIT=1, set here for
    this process's later gloo groups): gloo otherwise connects every member to every other at creation, W - 1
    connections per rank, where the collectives on this group (DCP's background save: gathers to and broadcasts
    from rank 0) use one pair per rank (rank 0: every pair)."""
    os.environ[GLOO_LAZY_INIT] = "1"
    return dist.new_group(backend="gloo")


def warm_mesh(mesh: DeviceMesh, device: torch.device, cp_group=None) -> None:
    """One small all-reduce in each of this rank's mesh groups (and its cp group), so a communicator that cannot
    form fails here, at startup, naming the dimension, instead of in step 1."""
    groups = [("shard", mesh.get_group("shard")), ("replicate", mesh.get_group("replicate"))]
    for name, group in groups + ([("cp", cp_group)] if cp_group is not None else []):
        probe = torch.ones(1, device=device)
        try:
            dist.all_reduce(probe, group=group)
        except Exception as err:  # noqa: BLE001 - any backend error: say which group
            raise RuntimeError(f"the {name!r} process group of rank {dist.get_rank()} (ranks "
                               f"{dist.get_process_group_ranks(group)}) did not form: {err}") from err
        if int(probe.item()) != group.size():
            raise RuntimeError(f"the {name!r} process group of rank {dist.get_rank()} summed {probe.item()} "
                               f"instead of {group.size()}")


def gather_dtype(param_dtype: str, precision: str) -> torch.dtype:
    """The dtype hsdp gathers the blocks' matmul weights in (`parallelism.param_dtype`; "auto": bf16 when the run
    trains in bf16-mixed)."""
    if param_dtype == "auto":
        return torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    if param_dtype == "bfloat16" and precision != "bf16-mixed":
        raise ValueError(f"parallelism.param_dtype=bfloat16 needs precision bf16-mixed, not {precision}: the matmuls "
                         "would meet fp32 activations")
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[param_dtype]


def fp32_parameters(block: nn.Module) -> set[nn.Parameter]:
    """A block's parameters that are not matmul weights (norm weights, qk_bias): never gathered in bf16."""
    matmul = {id(m.weight) for m in block.modules() if isinstance(m, nn.Linear)}
    return {p for p in block.parameters() if id(p) not in matmul}


def apply_hsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype = torch.float32) -> list[FSDPModule]:
    """Shard a materialised RecurrentGPT over the mesh's "shard" dimension (units: see the module docstring).
    Every rank must hold the same weights when this is called: each keeps its slice.

    `param_dtype` bfloat16: the block units gather their matmul weights in bf16 and reduce-scatter their
    gradients in fp32 (MixedPrecisionPolicy; forward inputs not cast: the residual stream and the recurrent
    state stay as autocast leaves them); the blocks' norm weights and qk_bias stay whole fp32 tensors on every
    rank (FSDP2's ignored params, exchanged over all ranks by the gradient sync), and the root unit (embedding =
    head, adapter, final norm) stays fp32."""
    shard_mesh = mesh["shard"]
    t = model.transformer
    if param_dtype == torch.float32:
        block_options = {}
    else:
        block_options = {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                                           cast_forward_inputs=False)}

    def shard_block(block: nn.Module, reshard_after_forward: bool) -> FSDPModule:
        ignored = fp32_parameters(block) if block_options else None
        return fully_shard(block, mesh=shard_mesh, reshard_after_forward=reshard_after_forward,
                           ignored_params=ignored, **block_options)

    units = [shard_block(block, reshard_after_forward=True) for block in [*t.prelude, *t.coda]]
    # the core runs n + k times per forward: keep it gathered from its forward to the end of its backward
    units.append(shard_block(t.core_block, reshard_after_forward=False))
    units.append(fully_shard(model, mesh=shard_mesh, reshard_after_forward=False))
    for unit in units:
        # plain sums in the reduce-scatter; the exchange between shard groups divides by the world size once
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(1.0)
    return units


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor (a view: writing it writes the DTensor), or
    the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_group(params: list[torch.Tensor]):
    """The process group a model's parameters are sharded over; None when they are whole."""
    for p in params:
        if isinstance(p, DTensor):
            return p.device_mesh.get_group()
    return None


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the averaged gradients to a global L2 norm of `max_norm`; returns the norm before clipping as a device
    scalar (no host read). Sharded gradients: the squares of every local shard are summed with one all-reduce
    over the shard group (the replicas hold the same gradients), not one collective per tensor; whole ones
    (every rank holds the same) are added once."""
    with_grad = [p for p in params if p.grad is not None]
    grads = [local(p.grad) for p in with_grad]
    group = shard_group(params)
    norms = torch._foreach_norm(grads, 2.0)
    if group is None:
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    else:  # whole tensors among sharded ones (hsdp's fp32 norm weights in bf16 gathers) count once, after it
        sharded = [isinstance(p, DTensor) for p in with_grad]
        squares = torch.stack([n for n, s in zip(norms, sharded) if s]).square().sum().reshape(1)
        dist.all_reduce(squares, group=group)
        whole = [n for n, s in zip(norms, sharded) if not s]
        if whole:
            squares = squares + torch.stack(whole).square().sum()
        total = squares.sqrt()[0]
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total


def replicated_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """(name, local tensor) of everything the replicas of a shard must hold identically: parameters and the
    optimizer's tensors, in a fixed order."""
    names = {p: name for name, p in model.named_parameters()}
    items = [(name, local(p.detach())) for name, p in model.named_parameters()]
    for p, state in optimizer.state.items():
        for key in sorted(state):
            if torch.is_tensor(state[key]):
                items.append((f"optimizer {key} of {names.get(p, '?')}", local(state[key])))
    return items


def check_replicas_agree(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh,
                         device: torch.device, when: str) -> None:
    """Compare a checksum of every replicated tensor (fp64 sum and sum of squares of this rank's part) across the
    replicas of this rank's shard: one all-reduce over the "replicate" dimension of the checksums and their
    negations with MAX gives every checksum's largest and smallest value, equal where the replicas agree; then one
    all-reduce over all ranks, so that every rank raises together. Two fixed-size reductions: the cost does not
    grow with the number of replicas. Only on a mismatch are the replicas' checksums gathered, so that the ranks
    that saw it name the ranks and the first tensor that differs. Replicas start from the same seed and apply the
    same averaged gradients, so any difference means a broken replica (an RNG that diverged, a bad load, a faulty
    device)."""
    group = mesh.get_group("replicate")
    message = None
    if group.size() > 1:
        items = replicated_state(model, optimizer)
        # each checksum on the device: optimizer state may hold host scalars (a step count) beside device tensors
        sums = torch.stack([torch.stack([t.double().sum(), t.double().square().sum()]).to(device) for _, t in items])
        extremes = torch.cat([sums, -sums])
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
        largest, smallest = extremes[: len(items)], -extremes[len(items):]
        if (largest != smallest).any().item():
            message = replicas_differ(items, sums, group, when)
    failed = torch.tensor([float(message is not None)], device=device)
    dist.all_reduce(failed)
    if failed.item():
        raise RuntimeError(message or f"{when}: the replicas of another shard disagree (their ranks name them)")


def replicas_differ(items: list[tuple[str, torch.Tensor]], sums: torch.Tensor, group, when: str) -> str:
    """The message of a mismatch, from every replica's checksums (one all-gather over the group)."""
    gathered = [torch.empty_like(sums) for _ in range(group.size())]
    dist.all_gather(gathered, sums, group=group)
    ranks = dist.get_process_group_ranks(group)
    differing = [rank for rank, other in zip(ranks, gathered) if not torch.equal(other, gathered[0])]
    first = next(i for i in range(len(items)) if any(not torch.equal(g[i], gathered[0][i]) for g in gathered))
    return (f"{when}: the replicas disagree: rank(s) {differing} differ from rank {ranks[0]} (first "
            f"differing tensor: {items[first][0]}); replicas of a shard must be identical")

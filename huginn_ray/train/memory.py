"""Per-rank memory plan of a training configuration, checked before launch.

    python -m huginn_ray.train.memory --config configs/train/frontier_nebel_512_nodes.yaml [key=value ...]

Prints one row per item, the phases of the step with what is alive in each, then `total per rank: X.X GiB of
Y.Y GiB device memory` (the largest phase) as its last line, and exits 1 when the total exceeds
`device_memory_gib x memory_headroom`. `jobs/train.py` runs the same plan in its preflight.

Rows (what lives across the step, or a long part of it), per rank:
- parameters and buffers (fp32 master weights), gradients (fp32, every trainable tensor: backward produces all
  of them before any exchange finishes; a replicated run whose steps never accumulate micro-batches, on any of
  its worker counts, has a row of its own for the prelude blocks' gradients, which backward produces last),
  optimizer state (two fp32 moments and a step counter per tensor):
  whole under `parallelism.mode: replicate`; under `hsdp` this rank's FSDP2 shard (dim 0 split over the shard
  group, padded to a multiple of it), plus what FSDP2 gathers whole: the root unit's weights (embedding = head,
  adapter, final norm) for the whole step and its gradients from the loss's backward on; the core block unit's
  weights from its forward to the end of its backward and its gradients from its backward to its reduce-scatter
  (gathered and reduced once per step); one prelude block prefetched while the core's backward runs. The blocks
  gather in `parallelism.param_dtype` (bf16: their matmul weights at 2 bytes, their norm weights and qk_bias
  whole fp32 tensors on every rank instead of shards; no autocast casts of them), the root unit in fp32. The plan
  also counts the bytes all-gathered per micro-batch, by dtype (`MemoryPlan.gathered`);
- exchange buffers (hsdp: only when there is more than one shard group): chunk_stream one chunk,
  chunk_stream_overlap `max_chunks_in_flight` chunks, ddp none beyond the gradients (gradient_as_bucket_view);
- activations kept for backward at the deepest backprop the sampler draws (k = mean_backprop_depth gradient
  iterations, with the configured activation checkpointing), for one micro-batch: measured, not estimated, by
  running the model's forward and loss on the meta device under `saved_tensors_hooks` and summing the bytes of
  the distinct storages saved (parameters and buffers excluded; huginn_ray.train.activation_memory). On GPU
  configurations bf16 autocast is emulated on meta (linear/matmul/attention inputs cast to bf16, casts of weights
  cached as autocast does) and attention is counted as the fused flash kernel saves it (q, k, v, output,
  log-sum-exp), as on the device. The chunked loss (`loss_chunk_tokens`) saves only references to the final
  hidden states, the head weight and the labels. With `parallelism.context_parallel: N` one micro-batch is this
  rank's block_size / N tokens; each attention call all-gathers the whole sequence's K and V (2 x block_size x
  D in the compute dtype), saved for backward unless the block is checkpointed; the core's backward holds one
  call's gathered K/V (recomputed) and their fp32 gradient.

Phases (the moments memory can peak), each the rows alive then plus what exists only then; every activation
counts in every phase up to the end of backward (those of the coda and the core are freed before the later
ones: the plan errs safe):
- end of forward (the loss's forward): under bf16 autocast the cached bf16 copies of the weights (those not
  saved for backward) and the chunked loss's bf16 copy of the head weight, plus with `loss_chunk_tokens` what
  one chunk of the loss's forward allocates (measured). Both the head's copy and the chunk are freed when the
  loss returns. Under hsdp no unsharded gradient exists yet: each micro-batch's backward reduce-scatters its
  own. Replicated, gradients exist from a step's second micro-batch on; in a step of one micro-batch none
  exists yet (the loop sets them to None after every step), and in its loss backward only the head's, which
  that phase's transient counts;
- loss backward, every activation still alive. With `loss_chunk_tokens` the chunked loss's backward runs first
  and recomputes the head chunk by chunk: at its peak it holds the fp32 accumulator of the head weight's
  gradient (weight-sized; it becomes the .grad), hidden's gradient, one chunk's logits and their gradient, and
  under bf16 the weight's bf16 copy and one chunk's weight-sized bf16 product. Measured by running that backward
  on meta and tracking the storages it creates (`PeakLiveBytes`); equal to a real CPU step byte for byte. Without
  `loss_chunk_tokens`: the gradient of the full logits;
- core backward: every row alive (under hsdp the core's weights and gradients both gathered, and the next unit
  prefetched; in a replicated step of one micro-batch every gradient but the prelude blocks'), plus with
  activation checkpointing the recomputation of the core's largest checkpointed segment (the adapter and its
  first block; measured the same way);
- core reduce-scatter (hsdp): FSDP2 has resharded the core's weights and copies its gradients into the
  reduce-scatter input (core-sized, fp32);
- optimizer step: backward has freed every activation (under hsdp FSDP2 has also resharded every unit and
  reduce-scattered every gradient): the parameters, gradients, optimizer state and exchange buffers, plus the
  step's scratch. ELLISAdam (huginn_ray.train.optim) steps one tensor at a time and writes each update over
  its denominator: its scratch is the largest tensor, one hyperparameter tensor per group, plus with update
  clipping one scalar per tensor and three more (512 bytes each on GPUs, the caching allocator's smallest
  block); its compiled step (the default on GPUs) holds no tensor-sized scratch, so there the plan errs safe. AdamW: twice a
  tensor plus the tensor before it (torch's single-tensor step; the fused kernel on GPUs holds none of them).
  With `observe.module_norms` (the default) a log step also holds ModuleNorms' copy of this rank's parameters
  through the step, then frees it tensor by tensor while it makes and squares (in fp64 chunks of NORM_CHUNK
  elements) each tensor's update. Equal to a real CPU step byte for byte, with and without the norms.
Not counted, but listed with an estimate under the total (never added to it): the CUDA/HIP context, the
communication library's buffers, the allocator's fragmentation; `memory_headroom` (default 0.9) is there for them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass, field

import torch

from huginn_ray.model import ModelConfig, RecurrentGPT
from huginn_ray.train import observe
from huginn_ray.train.activation_memory import saved_activation_bytes
from huginn_ray.train.optim import param_groups, step_scratch_bytes
from huginn_ray.train.parallel import MeshShape, fp32_parameters, gather_dtype

GIB = 2**30
MI250X_GCD_GIB = 64.0
"""Device memory assumed for GPU configurations when none is configured or detected (an MI250X GCD)."""
GPU_NODE_SIZE = 8
"""Ranks per node (hsdp's shard size) assumed for GPU configurations (Frontier: 8 GCDs)."""
CUDA_BLOCK_BYTES = 512
"""The CUDA caching allocator's smallest block: what a device scalar occupies."""

# what FSDP2 gathers whole under hsdp, rows of the plan
ROOT_W, ROOT_G = "gathered: root unit weights (fp32)", "gathered: root unit gradients (fp32)"
CORE_W, CORE_G = "gathered: core block unit weights", "gathered: core block unit gradients"
PREFETCH = "gathered: one prelude block (backward prefetch)"
GRADS, PRELUDE_G = "gradients (fp32)", "gradients of the prelude blocks (fp32)"
GATHERED_KV = "context parallel: gathered K/V saved for backward"
BLOCK_STEP = 1024
"""The longest block_size that fits (`longest_block_size`) is searched in multiples of this (and of
2 x context_parallel, the head-tail split's chunks)."""


@dataclass(frozen=True)
class Phase:
    """A moment of the training step: the rows alive then, plus what exists only at that moment."""

    name: str
    transient: str
    """What exists only at this moment, on top of the rows."""
    transient_bytes: int
    absent: tuple[str, ...] = ()
    """Rows not alive at this moment (freed before it, or allocated after it)."""


@dataclass
class MemoryPlan:
    rows: list[tuple[str, int, str]] = field(default_factory=list)
    """(item, bytes, how it was obtained): what lives across the step, or a long part of it."""
    phases: list[Phase] = field(default_factory=list)
    """The moments where memory can peak; the plan's total is the largest."""
    not_counted: list[tuple[str, int, str]] = field(default_factory=list)
    """(item, estimated bytes, basis of the estimate): listed, never added to the total."""
    gathered: dict[str, int] = field(default_factory=dict)
    """hsdp: bytes FSDP2 all-gathers per micro-batch on each rank, by dtype (the root and the core once, every
    prelude and coda block twice: forward and backward), padded as FSDP2 pads dim 0."""
    device_bytes: int = 0
    headroom: float = 0.9
    header: str = ""
    advice: str = ""
    longest_block: int | None = None
    """A plan that does not fit: the longest block_size that would (0: none), the rest of the config kept."""

    def phase_total(self, phase: Phase) -> int:
        return sum(b for name, b, _ in self.rows if name not in phase.absent) + phase.transient_bytes

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=self.phase_total)

    @property
    def total(self) -> int:
        return self.phase_total(self.peak)

    @property
    def limit(self) -> int:
        return int(self.device_bytes * self.headroom)

    @property
    def fits(self) -> bool:
        return self.total <= self.limit

    def largest(self, count: int = 3) -> list[tuple[str, int]]:
        """The largest items alive at the peak."""
        peak = self.peak
        items = [(name, b) for name, b, _ in self.rows if name not in peak.absent]
        return sorted(items + [(peak.transient, peak.transient_bytes)], key=lambda t: -t[1])[:count]

    def render(self) -> str:
        lines = [self.header, f"{'item':<52}{'GiB':>8}  how"]
        for name, b, how in self.rows:
            lines.append(f"{name:<52}{b / GIB:>8.2f}  {how}")
        if self.gathered:
            lines.append("all-gathered per micro-batch: " + ", ".join(
                f"{dtype} {b / GIB:.2f} GiB" for dtype, b in self.gathered.items()))
        lines.append(f"{'phase: rows alive + what exists only then':<52}{'GiB':>8}")
        for phase in self.phases:
            short = [name.removeprefix("gathered: ").removesuffix(" (fp32)") for name in phase.absent]
            absent = f"  (without: {', '.join(short)})" if short else ""
            lines.append(f"{'  ' + phase.name:<36}{'+' + format(phase.transient_bytes / GIB, '.2f'):>8}"
                         f"{self.phase_total(phase) / GIB:>16.2f}  + {phase.transient}{absent}")
        lines.append(f"{'peak: ' + self.peak.name:<52}{self.total / GIB:>8.2f}")
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(f"{verdict} within memory_headroom {self.headroom:g} x device memory = {self.limit / GIB:.1f} GiB")
        if not self.fits:
            lines.append("largest items: " + ", ".join(f"{n} {b / GIB:.1f} GiB" for n, b in self.largest()))
            lines.append("what would help: " + self.advice)
        for name, b, how in self.not_counted:
            lines.append(f"{'  not counted: ' + name:<52}{'~' + format(b / GIB, '.1f'):>8}  {how}")
        lines.append(f"total per rank: {self.total / GIB:.1f} GiB of {self.device_bytes / GIB:.1f} GiB device memory")
        return "\n".join(lines)


def device_memory_bytes(cfg) -> int:
    if cfg.device_memory_gib:
        return int(cfg.device_memory_gib * GIB)
    if cfg.scaling.use_gpu:
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory
        return int(MI250X_GCD_GIB * GIB)
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // max(1, cfg.scaling.max_workers)


def planned_shape(cfg) -> MeshShape:
    """The run's layout at its largest worker count: under hsdp a shard group is one node (8 GPUs, or every CPU
    worker)."""
    workers = cfg.scaling.max_workers
    if not cfg.parallelism.sharded:
        return MeshShape(sharded=False, world_size=workers, shard_size=1)
    return MeshShape(sharded=True, world_size=workers,
                     shard_size=min(workers, GPU_NODE_SIZE) if cfg.scaling.use_gpu else workers)


def shard_numel(shape: torch.Size, shards: int) -> int:
    """Elements of one FSDP2 shard of a tensor: dim 0 split into `shards` equal parts, padded."""
    rows = shape[0] if len(shape) else 1
    return math.ceil(rows / shards) * (math.prod(shape[1:]) if len(shape) > 1 else 1)


def model_name(cfg, model_cfg: ModelConfig) -> str:
    """The registry name, or with init_from the directory's model."""
    return f"{model_cfg.name} from {cfg.init_from}" if cfg.init_from else model_cfg.name


def plan_memory(cfg, model_cfg: ModelConfig | None = None, micro_batch_rows: int | None = None,
                accumulates: bool = True, search: bool = True) -> MemoryPlan:
    """The per-rank memory plan of a TrainConfig (huginn_ray.train.config), for micro-batches of
    `micro_batch_rows` rows: the largest a rank gets in the run's data order (huginn_ray.train.data_order; the
    preflight passes it), by default micro_batch_size. `accumulates`: whether a step may run more than one
    micro-batch on a rank (on any worker count of the run); when it never does, a replicated step's gradients
    (set to None after every step) come into being in its backward, which the phases then count. A plan that
    does not fit names the longest block_size that would (`longest_block_size`; not with `search` false)."""
    rows = micro_batch_rows or cfg.micro_batch_size
    cp = cfg.parallelism.context_parallel
    if cp < 1 or cfg.block_size % cp:
        raise ValueError(f"parallelism.context_parallel={cp} must be positive and divide block_size={cfg.block_size}")
    local_tokens = cfg.block_size // cp
    if model_cfg is None:
        from huginn_ray.train.init_from import model_config, section_config

        # a recipe with init_from and a model section plans without the weights directory (preflight checks both agree)
        model_cfg = section_config(cfg) if cfg.model is not None else model_config(cfg)
    precision = cfg.precision if cfg.precision != "auto" else ("bf16-mixed" if cfg.scaling.use_gpu else "fp32")
    bf16 = precision == "bf16-mixed"
    gather = gather_dtype(cfg.parallelism.param_dtype, precision)
    with torch.device("meta"):
        model = RecurrentGPT(model_cfg)
    model.train()
    shape = planned_shape(cfg)

    plan = MemoryPlan(device_bytes=device_memory_bytes(cfg), headroom=cfg.memory_headroom)
    layout = f"hsdp, {shape.replicas} shard groups x {shape.shard_size}" if shape.sharded else "replicate"
    plan.header = (f"memory plan per rank: {model_name(cfg, model_cfg)}, {shape.world_size} ranks ({layout}), "
                   f"micro-batch {rows} x {cfg.block_size} tokens"
                   + (f" split over context_parallel={cp} ranks ({local_tokens} each)" if cp > 1 else "")
                   + f", {precision}, "
                   f"grad_sync.kind={cfg.grad_sync.kind}")
    if shape.sharded:
        whole, local = add_sharded_rows(plan, cfg, model, gather, shape.shard_size)
    else:
        whole, local = set(), sum(p.numel() for p in model.parameters() if p.requires_grad)
        add_replicated_rows(plan, cfg, model, accumulates)
    add_exchange_row(plan, cfg, shape, whole, local)

    k = model_cfg.mean_backprop_depth
    if shape.sharded and gather != torch.float32:  # the blocks' matmul weights arrive in bf16: autocast casts none
        for block in model.blocks():
            for module in block.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.data = module.weight.data.to(gather)
    ids = torch.zeros(rows, local_tokens, dtype=torch.long, device="meta")
    measured = saved_activation_bytes(model, ids, (1, k), bf16=bf16, device_type="cuda" if cfg.scaling.use_gpu
                                      else "cpu", loss_chunk_tokens=cfg.loss_chunk_tokens)
    checkpointing = "every block checkpointed" if model_cfg.activation_checkpointing else "no checkpointing"
    plan.rows.append((f"activations saved for backward (k={k})", measured["activations"],
                      f"meta forward+loss under saved_tensors_hooks, {checkpointing}"
                      + (f", {local_tokens} local tokens" if cp > 1 else "")))
    gathered_kv = add_context_parallel_row(plan, cfg, model_cfg, rows, bf16)
    add_phases(plan, cfg, model, shape, measured, rows * local_tokens, bf16, whole, gathered_kv)
    if cfg.scaling.use_gpu:
        plan.not_counted += [
            ("CUDA/HIP context", int(0.6 * GIB), "driver context + kernel images, ~0.5-1 GiB per process"),
            ("communicator buffers", int(0.2 * GIB) * (3 if shape.sharded else 1),
             "NCCL/RCCL: ~0.2 GiB per communicator at default buffer sizes (world"
             + (", shard, replicate)" if shape.sharded else ")")),
            ("allocator fragmentation", int(0.05 * plan.total), "~5% of the planned peak (caching allocator)"),
        ]
    plan.advice = advice(cfg, model_cfg, shape, rows)
    if search and not plan.fits:
        plan.longest_block = longest_block_size(cfg, model_cfg, rows, accumulates, plan)
        fitting = (f"the longest block_size that fits is {plan.longest_block}" if plan.longest_block
                   else f"no block_size of {block_step(cfg)} tokens or more fits")
        plan.advice += (f"; block_size={cfg.block_size} needs {plan.total / GIB:.1f} GiB per rank, {fitting} "
                        f"(context_parallel={cp})")
    return plan


def context_parallel_bytes(cfg, model_cfg: ModelConfig, rows: int, bf16: bool) -> tuple[int, int]:
    """(one attention call's gathered K and V, their fp32 gradient) under context parallelism: every rank
    all-gathers the keys and values of the whole sequence (block_size tokens) before each attention call; 0, 0
    without."""
    if cfg.parallelism.context_parallel == 1:
        return 0, 0
    elements = 2 * rows * cfg.block_size * model_cfg.num_attention_heads * model_cfg.head_dim
    return elements * (2 if bf16 else 4), elements * 4


def add_context_parallel_row(plan: MemoryPlan, cfg, model_cfg: ModelConfig, rows: int, bf16: bool) -> int:
    """The gathered K/V every attention call with gradient saves for backward (none when every block is
    checkpointed: a block's recomputation gathers them again); returns what the core's backward holds on top:
    one call's gathered K/V recomputed (with checkpointing) and their fp32 gradient."""
    kv, kv_grad = context_parallel_bytes(cfg, model_cfg, rows, bf16)
    if not kv:
        return 0
    calls = (model_cfg.n_layers_in_prelude + model_cfg.mean_backprop_depth * model_cfg.n_layers_in_recurrent_block
             + model_cfg.n_layers_in_coda)
    if model_cfg.activation_checkpointing:
        plan.rows.append((GATHERED_KV, 0, "none: every block is checkpointed, its recomputation gathers them again"))
        return kv + kv_grad
    plan.rows.append((GATHERED_KV, calls * kv, f"{calls} attention calls with gradient x K and V of "
                                               f"{cfg.block_size} tokens"))
    return kv_grad


def block_step(cfg) -> int:
    """The granularity of the block_size search: BLOCK_STEP (block_size if shorter) and the head-tail split's
    2 x context_parallel."""
    return math.lcm(min(BLOCK_STEP, cfg.block_size), 2 * cfg.parallelism.context_parallel)


def longest_block_size(cfg, model_cfg: ModelConfig, rows: int, accumulates: bool, plan: MemoryPlan) -> int:
    """The longest block_size (a multiple of `block_step`) whose plan fits, every other field of `cfg` kept; 0
    when none does. The plan grows linearly with block_size (activations, gathered K/V and logits chunks are per
    token, the rest fixed): the line through the plan at one step and `plan` (at cfg.block_size) gives the
    candidate, which the plans around it confirm."""
    step = block_step(cfg)

    def total(block: int) -> int:
        return plan_memory(dataclasses.replace(cfg, block_size=block), model_cfg, rows, accumulates, False).total

    smallest = total(step) if step < cfg.block_size else plan.total
    if smallest > plan.limit:
        return 0
    per_step = max(1, (plan.total - smallest) * step // max(1, cfg.block_size - step))
    block = min(cfg.block_size - step, step + (plan.limit - smallest) // per_step * step)
    while block > step and total(block) > plan.limit:
        block -= step
    while block + step < cfg.block_size and total(block + step) <= plan.limit:
        block += step
    return block


def gathered_numel(unit: torch.nn.Module, whole: set, shards: int, padded: bool = False) -> int:
    """Elements FSDP2 gathers for a unit (padded: as its all-gather moves them), the tensors left whole aside."""
    return sum(shard_numel(p.shape, shards) * shards if padded else p.numel()
               for p in unit.parameters() if p not in whole)


def add_sharded_rows(plan: MemoryPlan, cfg, model: RecurrentGPT, gather: torch.dtype, shards: int) -> tuple[set, int]:
    """hsdp: this rank's shards of the parameters, gradients and optimizer state, and what FSDP2 gathers whole
    (with the bytes all-gathered per micro-batch, `plan.gathered`). Returns the tensors left whole on every rank
    and the elements this rank holds."""
    t = model.transformer
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    # tensors FSDP2 leaves whole: the blocks' norm weights and qk_bias when the matmul weights gather in bf16
    whole = {p for block in model.blocks() for p in fp32_parameters(block)} if gather != torch.float32 else set()
    local = sum(p.numel() if p in whole else shard_numel(p.shape, shards) for p in params)
    how = (f"{local:,} of {numel:,} elements: this rank's shard of every tensor (1/{shards}, dim 0 padded)"
           + (f", the blocks' {sum(p.numel() for p in whole):,} norm and qk_bias elements whole" if whole else ""))
    plan.rows.append(("parameters (fp32, sharded) + buffers", local * 4 + buffer_bytes, how))
    plan.rows.append(("gradients (fp32, sharded)", local * 4, "after the reduce-scatter: this rank's shard"))
    plan.rows.append((optimizer_row(cfg), local * 8 + len(params) * step_counter_bytes(cfg),
                      "sharded like the parameters"))
    size = gather.itemsize
    name = str(gather).removeprefix("torch.")
    core = gathered_numel(t.core_block, whole, shards) * size
    blocks = [gathered_numel(block, whole, shards) * size for block in [*t.prelude, *t.coda]]
    root = (numel - sum(p.numel() for block in model.blocks() for p in block.parameters())) * 4
    plan.rows.append((ROOT_W, root, "embedding = head, adapter, final norm: whole for the whole step"))
    plan.rows.append((ROOT_G, root, "from the loss's backward to the end of the step"))
    plan.rows.append((CORE_W, core, f"{name}, from its forward to the end of its backward (gathered once per "
                                    "step)"))
    plan.rows.append((CORE_G, core, f"{name}, from its backward to its reduce-scatter (once per step)"))
    plan.rows.append((PREFETCH, max(blocks, default=0), f"{name}, FSDP2 gathers the next unit while the core's "
                                                        "backward runs"))
    root_padded = sum(shard_numel(p.shape, shards) * shards for p in params) - sum(
        gathered_numel(block, whole, shards, padded=True) for block in model.blocks()) - sum(
        shard_numel(p.shape, shards) * shards for p in whole)
    moved = {name: (gathered_numel(t.core_block, whole, shards, True)
                    + 2 * sum(gathered_numel(b, whole, shards, True) for b in [*t.prelude, *t.coda])) * size}
    moved["float32"] = moved.get("float32", 0) + root_padded * 4
    plan.gathered = moved
    return whole, local


def add_replicated_rows(plan: MemoryPlan, cfg, model: RecurrentGPT, accumulates: bool) -> None:
    """replicate: the whole parameters, gradients (the prelude blocks' apart when a step never accumulates) and
    optimizer state on every rank."""
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    plan.rows.append(("parameters + buffers (fp32)", numel * 4 + buffer_bytes, f"{numel:,} trainable elements"))
    if accumulates or cfg.grad_sync.kind == "ddp":  # DDP's buckets hold the gradients for the whole run
        plan.rows.append((GRADS, numel * 4, "every trainable tensor"))
    else:
        prelude = sum(p.numel() for block in model.transformer.prelude for p in block.parameters())
        plan.rows.append((GRADS, (numel - prelude) * 4, "every trainable tensor but the prelude blocks': from "
                                                        "the loss's or the core's backward on"))
        plan.rows.append((PRELUDE_G, prelude * 4, "from the prelude's backward, the last, on"))
    plan.rows.append((optimizer_row(cfg), numel * 8 + len(params) * step_counter_bytes(cfg),
                      "replicated on every rank"))


def optimizer_row(cfg) -> str:
    return f"optimizer state ({cfg.optim.name}: 2 fp32 moments)"


def step_counter_bytes(cfg) -> int:
    """The optimizer's step counter per tensor: ELLISAdam's int64, AdamW's fp32."""
    return 8 if cfg.optim.name == "ELLISAdam" else 4


def add_exchange_row(plan: MemoryPlan, cfg, shape: MeshShape, whole: set, local: int) -> None:
    """The gradient exchange's buffers for `local` elements per rank (hsdp: only with more than one shard group)."""
    chunk_bytes = int(cfg.grad_sync.chunk_mib * 1024 * 1024) // 4 * 4
    kind = cfg.grad_sync.kind
    between = ", streamed between shard groups" if shape.sharded else ""
    if shape.sharded and shape.world_size == shape.shard_size:
        exchange, how = 0, "one shard group: no stream"
    elif kind == "chunk_stream":
        exchange, how = chunk_bytes, "one chunk" + between
    elif kind == "chunk_stream_overlap":
        chunks = math.ceil(local * 4 / chunk_bytes)
        in_flight = min(cfg.grad_sync.max_chunks_in_flight, chunks)
        exchange, how = (in_flight * chunk_bytes,
                         f"{in_flight} chunks in flight (grad_sync.max_chunks_in_flight){between}")
    else:
        exchange, how = 0, "gradients are views into DDP's buckets"
    if shape.sharded and whole:  # their own stream over all ranks: one buffer of their size
        exchange += sum(p.numel() for p in whole) * 4
        how += "; the whole fp32 tensors' buffer"
    plan.rows.append((f"exchange buffers ({kind})", exchange, how))


def add_phases(plan: MemoryPlan, cfg, model: RecurrentGPT, shape: MeshShape, measured: dict, tokens: int,
               bf16: bool, whole: set, gathered_kv: int = 0) -> None:
    """The phases, in step order. Every activation counts in each up to the end of backward (the coda's and the
    core's are freed before the later phases: an overestimate). Under hsdp each micro-batch's backward
    reduce-scatters its unsharded gradients, so none exist during a forward. A replicated step of one
    micro-batch has no gradient before its backward (with accumulation they exist from the second micro-batch
    on), and the chunked loss's head gradient (the .grad of the tied embedding) is its backward's transient.
    `tokens`: this rank's (its part of the sequence under context parallelism); `gathered_kv`: what the core's
    backward holds on top under context parallelism (`add_context_parallel_row`)."""
    hsdp = shape.sharded
    model_cfg = model.config
    split = any(name == PRELUDE_G for name, _, _ in plan.rows)
    not_yet = (ROOT_G, CORE_G, PREFETCH) if hsdp else (GRADS, PRELUDE_G) if split else ()
    activations_row = f"activations saved for backward (k={model_cfg.mean_backprop_depth})"
    # the micro-batch's keyed initial state, drawn before its forward; on a split sequence each row's noise is
    # drawn whole (one row of block_size tokens, fp32) and its positions kept (RecurrentGPT.keyed_initial_state)
    whole_row = cfg.block_size * model_cfg.n_embd * 4 if cfg.parallelism.context_parallel > 1 else 0
    plan.phases.append(Phase("initial state draw", "the keyed initial state (fp32)"
                             + (" + one row's whole noise" if whole_row else ""),
                             tokens * model_cfg.n_embd * 4 + whole_row, not_yet + (activations_row, GATHERED_KV)))
    casts = "autocast's cache" + (" and the chunked loss's head copy" if cfg.loss_chunk_tokens else "")
    ending = (f"bf16 weight casts ({casts}), " if bf16 else "") + (
        "one loss chunk" if cfg.loss_chunk_tokens else "nothing more")
    plan.phases.append(Phase("end of forward", ending,
                             measured["weight_casts"] + measured["loss_forward"], not_yet))
    if cfg.loss_chunk_tokens:
        # the transient holds the head's gradient (its fp32 accumulator becomes the .grad)
        chunk = min(cfg.loss_chunk_tokens, tokens)
        plan.phases.append(Phase("loss backward", f"chunked loss backward, chunk {chunk}",
                                 measured["loss_backward"], not_yet))
    else:
        plan.phases.append(Phase("loss backward", "gradient of the logits",
                                 tokens * model_cfg.padded_vocab_size * (4 + (2 if bf16 else 0)),
                                 (CORE_G, PREFETCH) if hsdp else (PRELUDE_G,) if split else ()))
    # every row alive (under hsdp the core's weights and gradients both gathered), plus with checkpointing the
    # recomputation of the core's first segment (the adapter and its first block), the largest; a prelude or coda
    # block's comes when the core is not gathered
    before_prelude = (PRELUDE_G,) if split else ()
    kv = (" + its gathered K/V and their fp32 gradient" if model_cfg.activation_checkpointing
          else " + the gathered K/V's fp32 gradient") if gathered_kv else ""
    if model_cfg.activation_checkpointing:
        plan.phases.append(Phase("core backward", "recompute of one core block" + kv,
                                 measured["recompute_block"] + gathered_kv, before_prelude))
    else:
        plan.phases.append(Phase("core backward", "nothing recomputed" + kv, gathered_kv, before_prelude))
    if hsdp:
        # FSDP2 reshards the core's weights, then copies its gradients into the reduce-scatter input
        plan.phases.append(Phase("core reduce-scatter", "reduce-scatter input of the core unit (fp32)",
                                 gathered_numel(model.transformer.core_block, whole, shape.shard_size) * 4,
                                 (CORE_W,)))
    # the optimizer step: backward has freed every activation, and under hsdp FSDP2 has resharded every unit
    # and reduce-scattered every gradient, so the sharded rows and the exchange buffers remain
    freed = (activations_row, GATHERED_KV, ROOT_W, ROOT_G, CORE_W, CORE_G, PREFETCH) if hsdp else (activations_row,
                                                                                                 GATHERED_KV)
    plan.phases.append(optimizer_phase(cfg, model, whole, shape.shard_size, freed))


def advice(cfg, model_cfg: ModelConfig, shape: MeshShape, rows: int) -> str:
    """What would help a plan that does not fit, most effective first."""
    helps = []
    if not shape.sharded:
        helps.append("parallelism.mode=hsdp (parameters, gradients and optimizer state / shard size)")
    if cfg.scaling.use_gpu and cfg.parallelism.context_parallel < GPU_NODE_SIZE:
        helps.append(f"parallelism.context_parallel up to {GPU_NODE_SIZE} (each rank holds block_size / "
                     "context_parallel tokens, plus every attention call's gathered K/V)")
    if cfg.grad_sync.kind == "chunk_stream_overlap":
        helps.append("a smaller grad_sync.max_chunks_in_flight")
    if not model_cfg.activation_checkpointing:
        helps.append("activation_checkpointing=true")
    if rows > cfg.micro_batch_size:
        helps.append(f"more workers (on scaling.num_workers={cfg.scaling.num_workers} a rank gets micro-batches of "
                     f"up to {rows} rows, more than micro_batch_size)")
    elif rows > 1:
        helps.append("a smaller micro_batch_size (with world_batch_size kept: more gradient accumulation)")
    return "; ".join(helps) or "a shorter block_size or a smaller model"


def optimizer_phase(cfg, model: RecurrentGPT, whole: set, shards: int, freed: tuple[str, ...]) -> Phase:
    """The optimizer step's phase: what the step allocates beyond the parameters, gradients and state, for this
    rank's part of each tensor (a shard under hsdp, `whole` tensors excepted)."""
    groups = param_groups(model, cfg.optim.weight_decay, cfg.optim.no_weight_decay_for_bias_and_norm)
    sizes = [[(p.numel() if p in whole or shards == 1 else shard_numel(p.shape, shards)) * 4 for p in group["params"]]
             for group in groups]
    if cfg.optim.name == "AdamW":
        # torch's single-tensor step (CPU) holds sqrt(v) and its quotient, and the previous tensor's quotient until
        # its loop rebinds the name; the fused kernel on GPUs holds none of them (the plan errs safe there)
        scratch = max(2 * group[i] + (group[i - 1] if i else 0) for group in sizes for i in range(len(group)))
        phase = Phase("optimizer step", "AdamW: 2 x a tensor + the one before (single-tensor step)", scratch, freed)
        return with_update_norms(phase, cfg, model, whole, shards)
    scalar_bytes = CUDA_BLOCK_BYTES if cfg.scaling.use_gpu else 4
    scratch = step_scratch_bytes(sizes, cfg.optim.update_clipping, scalar_bytes)
    phase = Phase("optimizer step", "ELLISAdam: the largest tensor's denominator + per-tensor scalars", scratch, freed)
    return with_update_norms(phase, cfg, model, whole, shards)


def with_update_norms(phase: Phase, cfg, model: RecurrentGPT, whole: set, shards: int) -> Phase:
    """The optimizer step of a log step with `observe.module_norms`: ModuleNorms (huginn_ray.train.observe) copies
    this rank's part of every parameter before the step and, after it, frees the copies one by one while it makes
    each tensor's update and squares it in fp64 chunks. The phase's transient is the larger of the step's scratch
    with the copies, and the copies still held with one update and its chunk's fp64 copy and square."""
    if not cfg.observe.module_norms:
        return phase

    def allocated(nbytes: int) -> int:
        return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES if cfg.scaling.use_gpu else nbytes

    sizes = [allocated((p.numel() if p in whole or shards == 1 else shard_numel(p.shape, shards)) * 4)
             for p in model.parameters() if p.requires_grad]
    copies = sum(sizes)
    # tensor i's update is made while its copy exists, then squared (a chunk's fp64 copy and square) without it,
    # into the fp64 sums per module
    updates = allocated(8 * len(observe.MODULES)) + max(
        max(sum(sizes[i:]), sum(sizes[i + 1 :]) + 2 * allocated(8 * min(size // 4, observe.NORM_CHUNK))) + size
        for i, size in enumerate(sizes))
    return Phase(phase.name, phase.transient + " + the update norms' copy of the parameters (log steps)",
                 max(phase.transient_bytes + copies, updates), phase.absent)


def rank_micro_batches(cfg) -> tuple[int | None, bool]:
    """(the most rows a rank gets per micro-batch, whether a step may run more than one micro-batch on a rank)
    in the run's data order when data.data_dir holds a manifest (the shard count); (None: micro_batch_size,
    True) without one. A resumed run's checkpointed global batch is the preflight's business: it passes its own
    figures."""
    from huginn_ray.data.shards import read_manifest
    from huginn_ray.train.data_order import accumulates_gradients, largest_micro_batch

    try:
        num_streams = read_manifest(cfg.data.data_dir)["num_shards"]
    except (OSError, TypeError, ValueError):
        return None, True
    rows = cfg.world_batch_size or cfg.micro_batch_size * cfg.scaling.max_workers
    counts = range(cfg.scaling.min_workers, cfg.scaling.max_workers + 1)
    return (largest_micro_batch(num_streams, rows, cfg.micro_batch_size, counts),
            accumulates_gradients(num_streams, rows, cfg.micro_batch_size, counts))


def main(argv: list[str] | None = None) -> int:
    from huginn_ray.config import ConfigError
    from huginn_ray.train.config import load_train_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML file (configs/train/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. parallelism.mode=replicate")
    args = parser.parse_args(argv)
    try:
        cfg = load_train_config(args.config, args.overrides)
        rows, accumulates = rank_micro_batches(cfg)
        plan = plan_memory(cfg, micro_batch_rows=rows, accumulates=accumulates)
    except (ConfigError, KeyError, TypeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(plan.render())
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())

"""The step of bench/scale_sim.py: one whole train_step (loop.py) of a simulated rank, with all its micro-batches,
counted on a narrow model (the nebel's depth, 64 wide) on CPU over the fake process group.

FSDP2 refuses to train meta parameters and the full width does not fit here, so the step's model is 64 wide; its
gradient exchange's chunk size is the configuration's scaled by that model's parameters over the nebel's, so that
its gradient shard splits into about as many chunks. With context parallelism the sequence is also scaled
(`Scenario.step_block_size`: 131,072 tokens become 128, 16 per rank of a cp group of 8, in the same head-tail
pieces): the cp group, the split of the batch, and the attention's all-gather of K/V (forward, the no-grad
iterations and the checkpointed blocks' recomputation included) and its reduce-scatter (backward) run as written,
over the fake group."""

from __future__ import annotations

import contextlib
import dataclasses
import io

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from huginn_ray.model import ModelConfig, RecurrentGPT
from huginn_ray.train import context_parallel, loop
from huginn_ray.train.shard_reader import Batch
from huginn_ray.train.stopping import Stop
from scale_sim_counting import CountingCollectives, CountingStore, Counts, patched

CPU = torch.device("cpu")

NARROW = dict(n_embd=64, num_attention_heads=2, intermediate_size=128, vocab_size=256, padding_multiple=64)
"""The step runs on the nebel's depth (2 prelude, 4 core, 2 coda blocks: the same FSDP2 units) at this width: FSDP2
refuses to train meta parameters, and the full width does not fit here."""


class NoData:
    """Stands in for a train shard's reader (huginn_ray.train.shard_reader.ShardReader): the control plane is
    simulated, not the data; the step reads `StepOfZeros`."""

    def __init__(self, path, stream, seed, row_length):
        self.path = path


class StepOfZeros:
    """The step's data: every micro-batch of this rank (grad_accum of them, its rows of each) as zeros (their
    values do not change which collectives run), split to this rank's positions by its cp group as the loop's
    prefetcher splits them (`ContextParallel.local_batch`)."""

    path = "no data"

    def __init__(self, order, data_rank: int, block_size: int, cp):
        self.order, self.data_rank, self.block_size, self.cp = order, data_rank, block_size, cp

    def next_step(self):
        rows = len(self.order.rows(self.data_rank))
        tokens = torch.zeros(rows, self.block_size, dtype=torch.long)
        batch = self.cp.local_batch(Batch(tokens, tokens + 5, torch.zeros(rows, dtype=torch.long)))
        return [batch] * self.order.grad_accum


def mask_outside_modes(*args):
    """context_parallel's causal_lower_right, made outside the counting dispatch mode: its tensor subclass
    (CausalBias) cannot be created inside a dispatch mode. It holds no data and runs no collective."""
    with _disable_current_modes():
        return REAL_MASK(*args)


REAL_MASK = context_parallel.causal_lower_right


def step_collectives(setup, world_size: int, rank: int) -> tuple[int, int]:
    """The c10d operations and store keys of one train_step at W with all its micro-batches, counted on the narrow
    model on CPU over the fake group (`setup`: scale_sim.Setup). The fake group exchanges nothing, so the loss is
    garbage and the step may end in a Stop (non-finite loss): every collective of the step has run by then."""
    counts = Counts()
    block_size = setup.scenario.step_block_size
    model_cfg = ModelConfig.from_name(setup.model_cfg.name, **NARROW, block_size=block_size)
    with torch.device("meta"):
        narrow_params = sum(p.numel() for p in RecurrentGPT(model_cfg).parameters())
    nebel_params = sum(shape.numel() for shape in setup.shapes.values())
    plan = dataclasses.replace(setup.plan, model_config=model_cfg)
    grad_sync = dataclasses.replace(setup.cfg.grad_sync,
                                    chunk_mib=setup.cfg.grad_sync.chunk_mib * narrow_params / nebel_params)
    cfg = dataclasses.replace(setup.cfg, block_size=block_size, warmup_allreduce_mib=0, grad_sync=grad_sync)
    store = CountingStore(counts, world_size)
    dist.init_process_group("fake", store=store, rank=rank, world_size=world_size)
    try:
        with patched([(loop, "ShardReader", NoData)]):
            c = loop.build_components(cfg, plan, rank, CPU, local_world_size=setup.shard_size)
        c.reader = StepOfZeros(c.order, c.shape.data_rank(rank), cfg.block_size, c.cp)
        counts.phase = "step"
        with CountingCollectives(counts, [], rank), patched([(context_parallel, "causal_lower_right",
                                                                 mask_outside_modes)]):
            try:
                loop.train_step(c, 2, cfg, plan, CPU)
            except Stop:
                pass
    finally:
        dist.destroy_process_group()
    return counts.get("step", "collectives"), counts.get("step", "store_ops")


def step_collectives_quietly(setup, world_size: int, rank: int) -> tuple[int, int]:
    with contextlib.redirect_stdout(io.StringIO()):
        return step_collectives(setup, world_size, rank)

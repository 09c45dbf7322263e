"""A run's parallelism applied to a plain RecurrentGPT built on the meta device, in one place (as torchtitan's
parallelize.py): every sandwich block torch.compile'd, FSDP2 units under a sharded layout, this rank's part
allocated on the training device, and the gradient exchange the layout uses.

    shard_and_allocate(model, cfg, precision, shape, mesh, device)   compile, FSDP2 (hsdp), allocate
    ... the weights filled (random init, a trained model, or a checkpoint) ...
    sync = gradient_sync(model, cfg, shape, mesh)                     replicate: chunk_stream / overlap / ddp;
                                                                      hsdp: the chunk stream between shard groups

The exchange is built after the weights are filled: DDP broadcasts rank 0's parameters when it is built.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from huginn_ray.model import RecurrentGPT
from huginn_ray.train import parallel
from huginn_ray.train.config import TrainConfig, compile_options_for
from huginn_ray.train.grad_sync import build_grad_sync, build_hsdp_grad_sync


def compile_blocks(model: RecurrentGPT, **compile_kwargs) -> RecurrentGPT:
    """Regional compilation: compile every sandwich block (prelude, core, coda) on its own, as torchtitan does
    per transformer block, instead of the whole forward. The recurrent loop stays in Python, so a newly
    sampled depth reuses the compiled blocks instead of recompiling; all blocks share one compiled graph per
    (grad mode, input dtype, shape). Inside a block the compiler fuses the memory-bound work around the
    matmuls: the RMSNorms with their fp32 round trip and the residual adds before them, qk_bias + RoPE + casts,
    SiLU(gate) * up. Parameter names and state_dict keys do not change. Calls with a KV cache (generation)
    run the eager block, whose shapes change at every token. Returns the model."""
    for block in model.blocks():
        block.compiled_sandwich = torch.compile(block.sandwich, **compile_kwargs)
    return model


def shard_and_allocate(model: RecurrentGPT, cfg: TrainConfig, precision: str, shape: parallel.MeshShape,
                       mesh: DeviceMesh, device: torch.device) -> None:
    """The blocks compiled (`cfg.compile`), the model sharded while still on meta (hsdp: FSDP2 units gathering
    the blocks' weights in `parallelism.param_dtype`), then only this rank's part allocated on `device` (its
    shards under hsdp; no rank ever holds the whole model there). The weights are left uninitialised."""
    if cfg.compile:
        compile_blocks(model, **compile_options_for(cfg, device.type))
    if shape.sharded:
        parallel.apply_hsdp(model, mesh, parallel.gather_dtype(cfg.parallelism.param_dtype, precision))
    model.allocate(device)


def gradient_sync(model: RecurrentGPT, cfg: TrainConfig, shape: parallel.MeshShape, mesh: DeviceMesh):
    """The gradient exchange of `grad_sync.kind` for the layout (huginn_ray.train.grad_sync): over every rank when
    the model is replicated; under hsdp between the shard groups (the mesh's "replicate" dimension), over each
    rank's gradient shard, dividing by the world size."""
    grad_sync = cfg.grad_sync
    if shape.sharded:
        return build_hsdp_grad_sync(grad_sync.kind, model, grad_sync.chunk_mib, mesh.get_group("replicate"),
                                    shape.world_size, grad_sync.max_chunks_in_flight)
    return build_grad_sync(grad_sync.kind, model, grad_sync.chunk_mib,
                           find_unused_parameters=grad_sync.ddp_find_unused_parameters,
                           max_chunks_in_flight=grad_sync.max_chunks_in_flight)

"""The model's building blocks: RMSNorm, the gated MLP, the sandwich block (four norms around attention and the
MLP), and the recurrent core that applies its sandwich blocks once per iteration."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from huginn_ray.model.attention import CausalSelfAttention
from huginn_ray.model.cache import KVCache
from huginn_ray.model.config import ModelConfig


class RMSNorm(nn.Module):
    """Normalise in fp32, cast back to the input dtype, then scale (the weight stays fp32 under autocast)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 2 * config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)  # SiLU on the first half, times the second
        return self.proj(F.silu(gate) * up)


class SandwichBlock(nn.Module):
    """Pre-norm on each branch input and a norm on each residual sum: four RMSNorms per block."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.norm_3 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = GatedMLP(config)
        self.norm_4 = RMSNorm(config.n_embd, config.norm_eps)

    compiled_sandwich = None
    """Set by huginn_ray.train.parallelize.compile_blocks: a torch.compile'd `sandwich`, used whenever no KV cache
    is passed."""

    def forward(self, x: Tensor, rope: Tensor, cache: KVCache | None = None, block_index: int = 0) -> Tensor:
        if cache is None and self.compiled_sandwich is not None:
            return self.compiled_sandwich(x, rope)
        return self.sandwich(x, rope, cache, block_index)

    def sandwich(self, x: Tensor, rope: Tensor, cache: KVCache | None = None, block_index: int = 0) -> Tensor:
        x = self.norm_2(self.attn(self.norm_1(x), rope, cache, block_index) + x)
        return self.norm_4(self.mlp(self.norm_3(x)) + x)


CHECKPOINT_OPTIONS = dict(use_reentrant=False, preserve_rng_state=False, determinism_check="none")
"""Activation checkpointing without RNG bookkeeping: nothing inside a block draws random numbers."""


class RecurrentCore(nn.Module):
    """The core block: its sandwich blocks, applied once per recurrence iteration.

    `forward` runs every iteration of one forward pass in one call, so a wrapper that hooks module calls (FSDP2,
    huginn_ray.train.parallel) gathers the core's weights once per step and reduces their gradients once, after
    the backward of the last use, instead of once per iteration. The blocks are its children "0", "1", ..., so
    the parameter names (`transformer.core_block.{i}....`) are the released checkpoint's. It is not an
    nn.ModuleList: torch 2.11's fully_shard refuses any ModuleList, even one with its own forward."""

    def __init__(self, blocks: Iterable[nn.Module]):
        super().__init__()
        for index, block in enumerate(blocks):
            self.add_module(str(index), block)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __getitem__(self, index: int) -> nn.Module:
        return list(self._modules.values())[index]

    def iterate(self, state: Tensor, injected: Tensor, adapter_weight: Tensor, rope: Tensor,
                cache: KVCache | None = None, first_block_index: int = 0) -> Tensor:
        """One iteration. adapter(concat[s, e]) = W[:, :D] s + W[:, D:] e: `injected` is W[:, D:] e (the same in
        every iteration), `adapter_weight` is W[:, :D]. The block index keys the KV cache only."""
        x = F.linear(state, adapter_weight) + injected
        for offset, block in enumerate(self):
            x = block(x, rope) if cache is None else block(x, rope, cache, first_block_index + offset)
        return x

    def forward(self, state: Tensor, injected: Tensor, adapter_weight: Tensor, rope: Tensor,
                num_steps: tuple[int, int], checkpointing: bool = False, cache: KVCache | None = None,
                block_offset: int = 0) -> tuple[Tensor, Tensor]:
        """`n` iterations without gradients, then `k` with (each recomputed in backward when `checkpointing`).
        Returns the final state and the state before the last iteration (for telemetry). Iteration i's blocks
        have KV-cache indices block_offset + len(self) * i + j (the released bookkeeping)."""
        n, k = num_steps
        previous = state
        with torch.no_grad():
            for iteration in range(n):
                previous, state = state, self.iterate(state, injected, adapter_weight, rope, cache,
                                                      block_offset + len(self) * iteration)
        for iteration in range(n, n + k):
            previous = state
            if checkpointing:
                state = self._iterate_checkpointed(state, injected, adapter_weight, rope)
            else:
                state = self.iterate(state, injected, adapter_weight, rope, cache, block_offset + len(self) * iteration)
        return state, previous

    def _iterate_checkpointed(self, state: Tensor, injected: Tensor, adapter_weight: Tensor, rope: Tensor) -> Tensor:
        """One iteration with every block checkpointed on its own (the adapter with the first block): backward
        recomputes one block at a time, so its transient is one block's activations, for one saved input per
        block (training only: no KV cache)."""
        def adapter_and_first_block(state: Tensor) -> Tensor:
            return self[0](F.linear(state, adapter_weight) + injected, rope)

        x = checkpoint(adapter_and_first_block, state, **CHECKPOINT_OPTIONS)
        for block in list(self)[1:]:
            x = checkpoint(block, x, rope, **CHECKPOINT_OPTIONS)
        return x

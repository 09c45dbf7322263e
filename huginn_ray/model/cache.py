"""The model's own key/value cache: what an attention call of a cached forward reads and appends, at every
position and block index (a fixed depth).

`CausalSelfAttention` reads a cache through two calls, `attention_mask` and `update`; generation's batched caches
(huginn_ray.generation.caches.RowBatch for `generate`, huginn_ray.generation.slots.SlotAttention for the engine's
decode step) answer the same two.

Block indices: prelude blocks 0..P-1, core block j of iteration i gets P + L*i + j, coda blocks -1, -2, ...
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Keys and values per block index, for a forward that continues an earlier one at a fixed depth (the `full`
    strategy of the reference).

    Every index holds the keys/values of all positions seen so far, so a cached step attends exactly as a
    full recomputation at the same depth would.
    """

    def __init__(self) -> None:
        self.entries: dict[int, tuple[Tensor, Tensor]] = {}

    def __len__(self) -> int:
        """Number of positions cached (read off the first prelude/core block)."""
        return next(iter(self.entries.values()))[0].shape[1] if self.entries else 0

    def attention_mask(self, index: int, length: int) -> Tensor | None:
        """(length, past + length) which cached and new positions the `length` new queries of block `index` attend
        to, called before `update`; None when the causal mask at offset 0 is right (nothing cached yet)."""
        past = self.entries[index][0].shape[1] if index in self.entries else 0
        if not past:
            return None
        return torch.ones(length, past + length, dtype=torch.bool, device=self.entries[index][0].device).tril(past)

    def update(self, index: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if index in self.entries:
            past_k, past_v = self.entries[index]
            k, v = torch.cat([past_k, k], dim=1), torch.cat([past_v, v], dim=1)
        self.entries[index] = (k, v)
        return k, v

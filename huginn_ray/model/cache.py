"""Key/value caches for generation: what an attention call of a cached forward reads and appends.

`KVCache` is the model's own (every position at every block index: fixed-depth generation); `IterationKVCache`
is adaptive-compute generation's (huginn_ray.model.generate), where tokens exit the recurrence at different
iterations and a deeper token meets past positions that have no entry for its iteration. Both are read through
the same three calls from `CausalSelfAttention`: `past_length`, `update`, `attendable`.

Block indices: prelude blocks 0..P-1, core block j of iteration i gets P + L*i + j, coda blocks -1, -2, ...
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from huginn_ray.model.config import ModelConfig


class KVCache:
    """Keys and values per block index, for generation (the `full` strategy of the reference).

    Every index holds the keys/values of all positions seen so far, so a cached step attends exactly as a
    full recomputation at the same depth would.
    """

    def __init__(self) -> None:
        self.entries: dict[int, tuple[Tensor, Tensor]] = {}

    def __len__(self) -> int:
        """Number of positions cached (read off the first prelude/core block)."""
        return next(iter(self.entries.values()))[0].shape[1] if self.entries else 0

    def past_length(self, index: int) -> int:
        """Positions already cached for block `index` (the attention's query offset)."""
        return self.entries[index][0].shape[1] if index in self.entries else 0

    def update(self, index: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if index in self.entries:
            past_k, past_v = self.entries[index]
            k, v = torch.cat([past_k, k], dim=1), torch.cat([past_v, v], dim=1)
        self.entries[index] = (k, v)
        return k, v

    def attendable(self, index: int) -> Tensor | None:
        """(batch, positions) which cached positions block `index` may attend to, None for all: every position
        here. Generation with per-token depth (IterationKVCache) leaves out positions that exited."""
        return None



class IterationKVCache:
    """Keys/values per block and position for generation with per-token depth (strategies `full`, `latest`, `ring:N`).

    Duck-types the model's KVCache (`past_length`, `update`, `attendable`). Storage is preallocated per slot as
    (batch, max_len, heads, head_dim) with a `present` flag per (row, position); `rows` selects the batch rows
    of the next updates (exited sequences are not computed) and `length` is the number of committed positions."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, strategy: str = "full"):
        self.prelude, self.core = cfg.n_layers_in_prelude, cfg.n_layers_in_recurrent_block
        self.batch, self.max_len = batch, max_len
        self.shape = (cfg.num_attention_heads, cfg.head_dim)
        self.strategy, self.ring = strategy, parse_cache(strategy)
        self.length = self.end = 0
        self.rows: Tensor | None = None
        self.slots: dict[tuple, list[Tensor]] = {}   # key -> [K, V, present (batch, max_len)]
        self.latest: dict[int, list[Tensor]] = {}    # core block j -> [K, V] of the deepest iteration written

    def _key(self, index: int) -> tuple:
        if index < 0:
            return ("coda", -1 - index)
        if index < self.prelude:
            return ("prelude", index)
        iteration, j = divmod(index - self.prelude, self.core)
        return ("core", iteration if self.ring is None else iteration % self.ring, j)

    def _alloc(self, like: Tensor, with_present: bool) -> list[Tensor]:
        kv = [like.new_zeros(self.batch, self.max_len, *self.shape) for _ in range(2)]
        if with_present:
            kv.append(torch.zeros(self.batch, self.max_len, dtype=torch.bool, device=like.device))
        return kv

    def _rows(self, device) -> Tensor:
        return self.rows if self.rows is not None else torch.arange(self.batch, device=device)

    def past_length(self, index: int) -> int:
        return self.length

    def update(self, index: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        rows = self._rows(k.device)
        start, end = self.length, self.length + k.shape[1]
        self.end = end  # the positions `attendable` covers, read right after this update
        key = self._key(index)
        entry = self.slots.get(key) or self.slots.setdefault(key, self._alloc(k, with_present=True))
        entry[0][rows, start:end], entry[1][rows, start:end] = k, v
        entry[2][rows, start:end] = True
        keys, values = entry[0][rows, :end], entry[1][rows, :end]
        if key[0] == "core" and self.strategy != "full":
            latest = self.latest.get(key[2]) or self.latest.setdefault(key[2], self._alloc(k, with_present=False))
            latest[0][rows, start:end], latest[1][rows, start:end] = k, v
            present = entry[2][rows, :end, None, None]
            keys = torch.where(present, keys, latest[0][rows, :end])
            values = torch.where(present, values, latest[1][rows, :end])
        return keys, values

    def attendable(self, index: int) -> Tensor | None:
        """(rows, positions) which cached positions the queries of block `index` may attend to; None for all.
        Only the `full` strategy leaves positions out: those that did not reach this core iteration."""
        key = self._key(index)
        if self.strategy != "full" or key[0] != "core":
            return None
        flags = self.slots[key][2]
        present = flags[self._rows(flags.device), : self.end]
        return None if bool(present.all()) else present

    def bytes_per_token(self) -> float:
        """Bytes of the key/value entries held (present ones, plus the latest-iteration copies) per position."""
        if not self.length:
            return 0.0
        per_entry = 2 * math.prod(self.shape) * next(iter(self.slots.values()))[0].element_size()
        held = sum(int(entry[2].sum()) for entry in self.slots.values())
        held += len(self.latest) * self.batch * self.length
        return held * per_entry / (self.batch * self.length)


def parse_cache(strategy: str) -> int | None:
    """The ring size of `ring:N`; None for `full` and `latest`."""
    if strategy in ("full", "latest"):
        return None
    if strategy.startswith("ring:") and strategy[5:].isdigit() and int(strategy[5:]) > 0:
        return int(strategy[5:])
    raise ValueError(f"cache must be 'full', 'latest' or 'ring:N' with N >= 1, got {strategy!r}")

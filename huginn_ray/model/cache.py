"""Key/value caches for generation: what an attention call of a cached forward reads and appends.

`KVCache` is the model's own (every position at every block index: fixed-depth generation). `IterationKVCache`
is one sequence's in adaptive-compute generation (huginn_ray.model.generate, huginn_ray.model.engine), where
tokens exit the recurrence at different iterations and a deeper token meets past positions that have no entry
for its iteration; `RowBatchCache` puts such sequences side by side in one batched call, each row at its own
position and iteration. `KVCache` and `RowBatchCache` are read through the same three calls from
`CausalSelfAttention`: `past_length`, `update`, `attendable`.

Block indices: prelude blocks 0..P-1, core block j of iteration i gets P + L*i + j, coda blocks -1, -2, ...
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

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



NOT_YET = 2**62
"""The depth of a position whose forward has not ended: it has every iteration written so far."""


class IterationKVCache:
    """One sequence's keys/values per block and position, for generation with per-token depth (strategies
    `full`, `latest`, `ring:N`). Read and written through `RowBatchCache`, which puts sequences side by side.

    Storage is allocated per block key on first use as (max_len, 2, heads, head_dim): keys and values side by
    side, written in one copy. `length` is the number of committed positions (those of finished forwards) and
    `depths` the core iterations each of them ran: position p has an entry for iteration i (ring slot s) iff
    depths[p] > i (> s), so no per-entry flag is kept."""

    def __init__(self, cfg: ModelConfig, max_len: int, strategy: str = "full"):
        self.prelude, self.core = cfg.n_layers_in_prelude, cfg.n_layers_in_recurrent_block
        self.prelude_and_coda = cfg.n_layers_in_prelude + cfg.n_layers_in_coda
        self.max_len = max_len
        self.strategy, self.ring = strategy, parse_cache(strategy)
        self.length = 0
        self.depths: Tensor | None = None  # (max_len,) int64, allocated with the first entry; NOT_YET beyond length
        self.shallowest = math.inf  # the fewest iterations in depths: every position has the iterations below it
        self.keys: dict[int, tuple[tuple, int]] = {}  # block index -> _key(index)
        self.slots: dict[tuple, Tensor] = {}   # key -> (max_len, 2, heads, head_dim)
        self.latest: dict[int, Tensor] = {}    # core block j -> the same, of the deepest iteration written

    @staticmethod
    def reserved_bytes(cfg: ModelConfig, max_len: int, strategy: str, num_steps: int, element_size: int) -> int:
        """The most bytes a cache of `max_len` positions holds when a forward runs at most `num_steps` iterations:
        prelude and coda blocks, core blocks of every iteration kept (`full`: num_steps; `latest`: num_steps plus
        the latest copy; `ring:N`: min(N, num_steps) plus the latest copy)."""
        ring = parse_cache(strategy)
        kept = num_steps if strategy == "full" else (num_steps if ring is None else min(ring, num_steps)) + 1
        entries = cfg.n_layers_in_prelude + cfg.n_layers_in_coda + cfg.n_layers_in_recurrent_block * kept
        return entries * max_len * 2 * cfg.n_embd * element_size

    def _key(self, index: int) -> tuple[tuple, int]:
        """The storage key of block `index` and, for a core block, its iteration (-1 for prelude and coda)."""
        if index < 0:
            return ("coda", -1 - index), -1
        if index < self.prelude:
            return ("prelude", index), -1
        iteration, j = divmod(index - self.prelude, self.core)
        return ("core", iteration if self.ring is None else iteration % self.ring, j), iteration

    def commit(self, positions: int, iterations: int) -> None:
        """The forward of the next `positions` positions ended after `iterations` core iterations."""
        self.depths[self.length : self.length + positions] = iterations
        self.length += positions
        self.shallowest = min(self.shallowest, iterations)

    def update(self, index: int, kv: Tensor) -> tuple[Tensor, Tensor | None]:
        """Write (positions, 2, heads, head_dim) keys and values of the positions after `length` for block
        `index`; return every position's keys and values up to them, and which of those the queries may attend
        to (None for all). Only the `full` strategy leaves positions out: those that did not reach this core
        iteration; `latest` and `ring:N` read them from the latest iteration written."""
        start, end = self.length, self.length + kv.shape[0]
        key, iteration = self.keys.get(index) or self.keys.setdefault(index, self._key(index))
        entry = self.slots.get(key)
        if entry is None:
            entry = self.slots[key] = kv.new_zeros(self.max_len, *kv.shape[1:])
            if self.depths is None:
                self.depths = torch.full((self.max_len,), NOT_YET, dtype=torch.long, device=kv.device)
        entry[start:end] = kv
        if iteration < 0:  # prelude and coda: every position has every block
            return entry[:end], None
        if self.strategy != "full":
            latest = self.latest.get(key[2])
            if latest is None:
                latest = self.latest[key[2]] = kv.new_zeros(self.max_len, *kv.shape[1:])
            latest[start:end] = kv
        if iteration < self.shallowest:  # every past position reached this iteration
            return entry[:end], None
        present = self.depths[:end] > key[1]  # the positions being written have NOT_YET: present
        if self.strategy == "full":
            return entry[:end], present
        return torch.where(present[:, None, None, None], entry[:end], latest[:end]), None

    def bytes_held(self) -> int:
        """Bytes of the key/value entries held (positions that have them, plus the latest-iteration copies)."""
        if not self.slots:
            return 0
        per_entry = next(iter(self.slots.values()))[0].numel() * next(iter(self.slots.values())).element_size()
        kept = NOT_YET if self.ring is None else self.ring
        held = self.prelude_and_coda * self.length + self.core * int(self.depths[: self.length].clamp_max(kept).sum())
        return (held + len(self.latest) * self.length) * per_entry


class RowBatchCache:
    """The KV-cache protocol of `CausalSelfAttention` (`past_length`, `update`, `attendable`) over a batch of
    rows from different sequences, each with its own `IterationKVCache`, position and core iteration.

    Row r holds lengths[r] real positions (the rest of the batch's `width` is padding) starting at its cache's
    `length`. Its keys are laid out so that the attention's single causal offset fits every row: with S the
    largest start, row r's position p sits in column p + S - start_r, so its queries see their own past at
    the columns the causal mask of offset S opens; the columns left of its first position (and right of its
    last) are padding, left out through `attendable`. Padding queries attend to real keys only and their
    outputs are discarded. Cost: each call copies every row's attended keys/values into the batch (one more
    read and write of what the attention reads; none for a single row), plus one small copy per row and block
    into its own cache: per-row work that a paged layout attending in place would not have.

    A core block index is given as that of iteration 0 (the call computes every row's iteration in one go);
    row r adds its own iteration `iterations[r]`."""

    def __init__(self, caches: list[IterationKVCache], lengths: list[int], iterations: list[int] | None = None):
        self.caches, self.lengths = caches, lengths
        self.iterations = iterations or [0] * len(caches)
        self.starts = [cache.length for cache in caches]
        self.width, self.offset = max(lengths), max(self.starts)
        self.aligned = len(set(self.starts)) == 1 and min(lengths) == self.width
        self.prelude, self.core = caches[0].prelude, caches[0].core
        self._attendable: Tensor | None = None
        self._own_columns: Tensor | None = None

    def rope(self, freqs_cis: Tensor) -> Tensor:
        """The rotary table of each row's positions, (rows, width, 1, head_dim / 2, 2) (padding: clamped)."""
        if self.aligned:
            return freqs_cis[:, self.offset : self.offset + self.width]
        positions = torch.tensor(self.starts, device=freqs_cis.device)[:, None] + torch.arange(
            self.width, device=freqs_cis.device)
        return freqs_cis[0, positions.clamp_max(freqs_cis.shape[1] - 1)]

    def past_length(self, index: int) -> int:
        return self.offset

    def update(self, index: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        kv = torch.stack([k, v], dim=2)  # (rows, width, 2, heads, head_dim): one copy per row into its cache
        rows = []
        for row, (cache, row_kv) in enumerate(zip(self.caches, kv.unbind(0))):
            row_index = index if index < self.prelude else index + self.core * self.iterations[row]
            length = self.lengths[row]
            rows.append(cache.update(row_index, row_kv if length == self.width else row_kv[:length]))
        if self.aligned:
            self._attendable = None
            if any(attendable is not None for _, attendable in rows):
                self._attendable = torch.stack([torch.ones(len(entries), dtype=torch.bool, device=k.device)
                                                if attendable is None else attendable for entries, attendable in rows])
            entries = rows[0][0][None] if len(rows) == 1 else torch.stack([entries for entries, _ in rows])
            return entries[:, :, 0], entries[:, :, 1]
        entries = pad_sequence([self._right_pad(entries, row) for row, (entries, _) in enumerate(rows)],
                               batch_first=True, padding_side="left")
        self._attendable = self._columns(k.device)
        for row, (_, row_attendable) in enumerate(rows):
            if row_attendable is not None:
                self._attendable[row, self.offset - self.starts[row] : self.offset + self.lengths[row]] = row_attendable
        return entries[:, :, 0], entries[:, :, 1]

    def _right_pad(self, x: Tensor, row: int) -> Tensor:
        missing = self.width - self.lengths[row]
        return x if not missing else torch.cat([x, x.new_zeros(missing, *x.shape[1:])])

    def _columns(self, device) -> Tensor:
        """(rows, columns) True at each row's own positions (from its first to its last real one); a copy."""
        if self._own_columns is None:
            columns = torch.arange(self.offset + self.width, device=device)
            first = torch.tensor([self.offset - start for start in self.starts], device=device)
            end = torch.tensor([self.offset + length for length in self.lengths], device=device)
            self._own_columns = (columns >= first[:, None]) & (columns < end[:, None])
        return self._own_columns.clone()

    def attendable(self, index: int) -> Tensor | None:
        """(rows, columns) which key columns the queries of the last `update` may attend to; None for all."""
        return self._attendable


def parse_cache(strategy: str) -> int | None:
    """The ring size of `ring:N`; None for `full` and `latest`."""
    if strategy in ("full", "latest"):
        return None
    if strategy.startswith("ring:") and strategy[5:].isdigit() and int(strategy[5:]) > 0:
        return int(strategy[5:])
    raise ValueError(f"cache must be 'full', 'latest' or 'ring:N' with N >= 1, got {strategy!r}")

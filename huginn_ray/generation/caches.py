"""The key/value caches of generation with per-token depth: what a batched call over sequences at different
positions and iterations reads and writes.

Every sequence's keys/values live in one `CachePool` (huginn_ray.generation.generate's batch, or the prompts the
engine prefills together), where tokens exit the recurrence at different iterations and a deeper token meets past positions that
have no entry for its iteration; each sequence owns a slot of it (`SequenceCache`). `Rows` indexes the pool for
batched calls, each row at its own position and iteration, and `RowBatch` lets one such call read and write it
through the KV-cache protocol of `CausalSelfAttention` (`attention_mask`, `update`), as the model's own
`KVCache` (huginn_ray.model.cache) does for a fixed depth.

Block indices: prelude blocks 0..P-1, core block j of iteration i gets P + L*i + j, coda blocks -1, -2, ...
"""

from __future__ import annotations

import torch
from torch import Tensor

from huginn_ray.model.config import ModelConfig


NOT_YET = 2**62
"""The depth of a position whose forward has not ended: it has every iteration written so far."""

TRASH = 0
"""The pool entry that padding positions write to (and that no query attends to)."""


class CachePool:
    """Keys and values of every sequence in flight, for generation with per-token depth (strategies `full`,
    `latest`, `ring:N`), laid out so that a batched call over any rows reads and writes them with one indexing
    operation per block, whatever the rows' positions and iterations.

    Storage: `entries` (capacity, 2 x heads x head_dim), one entry = one position's keys and values of one block
    (entry TRASH is scratch). A sequence owns a slot and, from its allocation to its release, the entries of its
    table row: `table[slot, key, position]`, with keys: prelude blocks 0..P-1, coda blocks P..P+C-1, then core
    block j of kept plane q at P + C + L*q + j (iteration i in plane i mod kept: kept = num_steps, or N for
    `ring:N`), then for `latest` and `ring:N` the latest copy of core block j at P + C + L*kept + j.
    `depths[slot, position]` are the core iterations each committed position ran (NOT_YET beyond): position p
    has plane q iff depths > q, so no per-entry flag is kept. Capacity grows on demand up to `max_entries`."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_entries: int | None = None):
        self.prelude, self.coda = cfg.n_layers_in_prelude, cfg.n_layers_in_coda
        self.core = cfg.n_layers_in_recurrent_block
        self.device, self.max_entries = device, max_entries
        self.entries = torch.zeros(1, 2 * cfg.n_embd, device=device, dtype=dtype)  # keys, then values
        self.free = torch.empty(0, dtype=torch.long, device=device)  # entry indices not held
        self.table = torch.zeros(0, 0, 0, dtype=torch.long, device=device)
        self.depths = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.states = torch.zeros(0, cfg.n_embd, device=device, dtype=dtype)
        """(slots, D) the latent state of each slot's decoding forward (one position; huginn_ray.generation.stepping)."""
        self.injected = torch.zeros(0, cfg.n_embd, device=device, dtype=dtype)
        """(slots, D) the adapter's half for e of that forward (W[:, D:] e)."""
        self.free_slots: list[int] = []
        self.layouts: dict[tuple, Rows] = {}
        """The Rows of the batched calls since the last commit or allocation (Rows.of)."""

    @staticmethod
    def keys(cfg: ModelConfig, strategy: str, num_steps: int) -> int:
        """Table keys (blocks kept per position) of a sequence: prelude and coda blocks, core blocks of every
        plane kept (`full`, `latest`: num_steps; `ring:N`: min(N, num_steps)) and, but for `full`, the latest copy."""
        ring = parse_cache(strategy)
        kept = num_steps if ring is None else min(ring, num_steps)
        latest = 0 if strategy == "full" else 1
        return cfg.n_layers_in_prelude + cfg.n_layers_in_coda + cfg.n_layers_in_recurrent_block * (kept + latest)

    @staticmethod
    def reserved_bytes(cfg: ModelConfig, max_len: int, strategy: str, num_steps: int, element_size: int) -> int:
        """Bytes a sequence of `max_len` positions holds from its allocation to its release (its keys x max_len
        entries of keys and values)."""
        return CachePool.keys(cfg, strategy, num_steps) * max_len * 2 * cfg.n_embd * element_size

    def allocate(self, cfg: ModelConfig, max_len: int, strategy: str, num_steps: int) -> "SequenceCache":
        """A slot and the entries of a sequence of `max_len` positions; ValueError when they would exceed
        `max_entries`."""
        keys = self.keys(cfg, strategy, num_steps)
        need = keys * max_len
        if need > self.free.numel():
            self._grow_entries(need - self.free.numel())
        taken, self.free = self.free[self.free.numel() - need :], self.free[: self.free.numel() - need]
        self.layouts.clear()
        slot = self.free_slots.pop() if self.free_slots else self._new_slot()
        self._fit_table(keys, max_len)
        self.table[slot] = TRASH
        self.table[slot, :keys, :max_len] = taken.view(keys, max_len)
        self.depths[slot] = NOT_YET
        ring = parse_cache(strategy)
        kept = num_steps if ring is None else min(ring, num_steps)
        return SequenceCache(self, slot, max_len, strategy, kept, taken)

    def release(self, cache: "SequenceCache") -> None:
        """Give a sequence's slot and entries back."""
        self.free = torch.cat([self.free, cache.taken])
        self.free_slots.append(cache.slot)

    def _grow_entries(self, missing: int) -> None:
        capacity = self.entries.shape[0]
        grown = max(2 * capacity, capacity + missing)
        if self.max_entries is not None:
            grown = min(grown, self.max_entries + 1)  # + TRASH
            if grown - capacity < missing:
                raise ValueError(f"the key/value cache pool holds at most {self.max_entries:,} entries; "
                                 f"{missing:,} more are needed")
        entries = self.entries.new_zeros(grown, *self.entries.shape[1:])
        entries[:capacity] = self.entries
        self.entries = entries
        self.free = torch.cat([self.free, torch.arange(capacity, grown, device=self.device)])

    def _new_slot(self) -> int:
        slots = self.states.shape[0]
        grown = max(2 * slots, 1)
        self.table = _grown(self.table, (grown, *self.table.shape[1:]), TRASH)
        self.depths = _grown(self.depths, (grown, self.depths.shape[1]), NOT_YET)
        self.states = _grown(self.states, (grown, self.states.shape[1]), 0)
        self.injected = _grown(self.injected, (grown, self.injected.shape[1]), 0)
        self.free_slots += range(grown - 1, slots, -1)
        return slots

    def _fit_table(self, keys: int, positions: int) -> None:
        slots, have_keys, have_positions = self.table.shape
        if keys > have_keys or positions > have_positions:
            shape = (slots, max(keys, have_keys), max(positions, have_positions))
            self.table = _grown(self.table, shape, TRASH)
            self.depths = _grown(self.depths, (slots, shape[2]), NOT_YET)

    def commit(self, caches: list["SequenceCache"], positions: list[int], iterations: list[int]) -> None:
        """The forwards of the next `positions[r]` positions of `caches[r]` ended after `iterations[r]` core
        iterations: one write for all of them."""
        self.layouts.clear()
        slots, columns, depths = [], [], []
        for cache, count, iteration in zip(caches, positions, iterations):
            slots += [cache.slot] * count
            columns += range(cache.length, cache.length + count)
            depths += [iteration] * count
            cache.length += count
            cache.shallowest = min(cache.shallowest, iteration)
        self.depths[torch.tensor(slots, device=self.device), torch.tensor(columns, device=self.device)] = torch.tensor(
            depths, device=self.device)


def _grown(t: Tensor, shape: tuple[int, ...], fill) -> Tensor:
    """`t` in a tensor of `shape` (no dimension smaller), the new cells `fill`."""
    out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


class SequenceCache:
    """One sequence's part of a CachePool: its slot, its entries and how many positions it has committed."""

    def __init__(self, pool: CachePool, slot: int, max_len: int, strategy: str, kept: int, taken: Tensor):
        self.pool, self.slot, self.max_len, self.strategy = pool, slot, max_len, strategy
        self.kept, self.taken = kept, taken
        """Core planes kept (num_steps, or N for `ring:N`); the pool entries held."""
        self.length = 0
        """Committed positions (those of finished forwards)."""
        self.shallowest = NOT_YET
        """The fewest core iterations of a committed position: each has every plane below it."""

    def release(self) -> None:
        self.pool.release(self)

    def bytes_held(self) -> int:
        """Bytes of the key/value entries the committed positions have (prelude and coda blocks, the core planes
        each position reached, up to the planes kept, and the latest-iteration copies), as a cache that
        allocated entries only when written would hold."""
        pool = self.pool
        per_entry = pool.entries.shape[1] * pool.entries.element_size()
        depths = pool.depths[self.slot, : self.length]
        planes = int(depths.clamp_max(NOT_YET if parse_cache(self.strategy) is None else self.kept).sum())
        latest = 0 if self.strategy == "full" else pool.core * self.length
        return ((pool.prelude + pool.coda) * self.length + pool.core * planes + latest) * per_entry


class Rows:
    """Rows of a CachePool that batched calls run over: each row's slot, the forward in progress (`lengths[r]`
    positions from `starts[r]`, its committed length; `width` the most) and its table row, read once.

    Columns are positions: column c of every row is that row's position c, so a query at position q attends its
    row's columns <= q (in a core call only those its plane reached, for `full`), whatever the other rows'
    positions; padding queries (past a row's length) attend as its last position does, and write TRASH. The
    columns run to the furthest row's last position, or one further with `next_column` (the position of each
    row's next forward): the rows that exit run their coda over such Rows and, after the commit, their next
    token's prelude over `following()`, with no new table read. Every row-dependent index tensor is computed
    once per Rows and reused by every call over them (every core call of a fixed-depth forward) until a commit
    or an allocation moves the rows (`Rows.of` keeps them in CachePool.layouts until then)."""

    def __init__(self, caches: list[SequenceCache], slots: Tensor, starts: list[int], lengths: list[int],
                 table: Tensor, next_column: bool = False):
        self.pool, self.caches, self.slots = caches[0].pool, caches, slots
        self.starts, self.lengths, self.width = starts, lengths, max(lengths)
        ends = max(start + length for start, length in zip(starts, lengths))
        self.columns = min(ends + next_column, table.shape[2])
        self.table = table[:, :, : self.columns]
        """(rows, keys, columns) each row's entry of each key at each column (position)."""
        self.indices: dict[str, Tensor | None] = {}

    @staticmethod
    def of(caches: list[SequenceCache], lengths: list[int], next_column: bool = False) -> "Rows":
        """The rows of `caches` with forwards of `lengths` positions from their committed lengths, and with
        `next_column` the column of their next forwards: made once between two commits (or allocations)."""
        pool = caches[0].pool
        key = (tuple(cache.slot for cache in caches), tuple(cache.length for cache in caches), tuple(lengths),
               next_column)
        rows = pool.layouts.get(key)
        if rows is None:
            slots = torch.tensor(key[0], device=pool.device)
            rows = pool.layouts[key] = Rows(caches, slots, list(key[1]), list(lengths),
                                            pool.table.index_select(0, slots), next_column)
        return rows

    def following(self, keep: list[int] | None = None) -> "Rows":
        """The next forwards (one position each) of these rows (made with `next_column`), or of the rows `keep`
        indexes, once the forwards in progress are committed."""
        caches, starts, lengths, slots, table = self.caches, self.starts, self.lengths, self.slots, self.table
        if keep is not None:
            index = torch.tensor(keep, device=self.pool.device)
            caches, starts, lengths = [caches[i] for i in keep], [starts[i] for i in keep], [lengths[i] for i in keep]
            slots, table = slots.index_select(0, index), table.index_select(0, index)
        return Rows(caches, slots, [start + length for start, length in zip(starts, lengths)], [1] * len(caches),
                    table)

    def _cached(self, name: str, make):
        if name not in self.indices:
            self.indices[name] = make()
        return self.indices[name]

    def queries(self) -> Tensor:
        """(rows, width) each query's position (padding: past the row's length)."""
        return self._cached("queries", lambda: torch.tensor(self.starts, device=self.pool.device)[:, None] + (
            0 if self.width == 1 else torch.arange(self.width, device=self.pool.device)))

    def padding(self) -> Tensor | None:
        """(rows, width) which queries are padding; None when none is."""
        def make():
            if min(self.lengths) == self.width:
                return None
            lengths = torch.tensor(self.lengths, device=self.pool.device)
            return torch.arange(self.width, device=self.pool.device) >= lengths[:, None]
        return self._cached("padding", make)

    def mask(self) -> Tensor:
        """(rows, width, columns) the columns each query attends (before a core call's planes); (1, width,
        columns) for rows that all start at one position with no padding (a fixed-depth batch)."""
        def make():
            if len(set(self.starts)) == 1 and self.padding() is None:
                queries = self.starts[0] + torch.arange(self.width, device=self.pool.device)
                return (torch.arange(self.columns, device=self.pool.device) <= queries[:, None])[None]
            queries = self.queries()
            if self.padding() is not None:  # padding queries attend as the row's last position
                ends = torch.tensor([s + n - 1 for s, n in zip(self.starts, self.lengths)], device=self.pool.device)
                queries = torch.minimum(queries, ends[:, None])
            return torch.arange(self.columns, device=self.pool.device) <= queries[:, :, None]
        return self._cached("mask", make)

    def writes(self, reads: Tensor, skip: Tensor | None = None) -> Tensor:
        """For the entries of some blocks at every column (rows, blocks, columns), those the new positions write
        (rows, blocks, width): TRASH for padding, and for the rows `skip` marks."""
        columns = self._cached("written", lambda: self.queries().clamp_max(self.columns - 1))
        writes = reads.gather(2, columns[:, None, :].expand(-1, reads.shape[1], -1))
        keep = self.padding()
        keep = None if keep is None else ~keep
        if skip is not None:
            keep = ~skip[:, None] if keep is None else keep & ~skip[:, None]
        return writes if keep is None else torch.where(keep[:, None], writes, TRASH)

    def blocks(self, keys: Tensor) -> Tensor:
        """The entries of (rows, blocks) table keys at every column: (rows, blocks, columns)."""
        return self.table.gather(1, keys[:, :, None].expand(-1, -1, self.columns))

    def full(self) -> Tensor | None:
        """(rows,) which rows have the `full` strategy; None when all have."""
        def make():
            full = [cache.strategy == "full" for cache in self.caches]
            return None if all(full) else torch.tensor(full, device=self.pool.device)
        return self._cached("full", make)

    def latest(self) -> tuple[Tensor, Tensor]:
        """Reads and writes of the latest copies of the core blocks (`latest`, `ring:N`; `full` rows, which keep
        none, write TRASH and have their reads ignored: they index their first plane, within their own keys)."""
        def make():
            pool = self.pool
            first = torch.tensor([pool.prelude + pool.coda + pool.core * (0 if cache.strategy == "full" else cache.kept)
                                  for cache in self.caches], device=pool.device)
            reads = self.blocks(first[:, None] + torch.arange(pool.core, device=pool.device))
            return reads, self.writes(reads, self.full())
        return self._cached("latest", make)

    def depths(self) -> Tensor:
        """(rows, columns) the core iterations of each column's position (NOT_YET: not committed)."""
        return self._cached("depths", lambda: self.pool.depths.index_select(0, self.slots)[:, : self.columns])

    def rope(self, freqs_cis: Tensor) -> Tensor:
        """The rotary table of each query's position, (rows, width, 1, head_dim / 2, 2) (padding: clamped), or
        (1, width, ...) when every row starts at one position."""
        def make():
            if len(set(self.starts)) == 1:
                return freqs_cis[:, self.starts[0] : self.starts[0] + self.width]
            return freqs_cis[0, self.queries().clamp_max(freqs_cis.shape[1] - 1)]
        return self._cached("rope", make)


class RowBatch:
    """The KV-cache protocol of `CausalSelfAttention` (`attention_mask`, `update`) for one batched call over
    `Rows`, each row at its own position and (in a core call) its own iteration: per block one indexed store of
    the new keys/values and one gather of the attended ones from the pool, no per-row work. Padding writes to
    TRASH.

    `kind` is "prelude", "core" or "coda"; a core call gives each row's iteration (`iterations`) and its block
    indices as those of iteration 0."""

    def __init__(self, rows: Rows, kind: str, iterations: list[int] | None = None):
        pool = self.pool = rows.pool
        self.width, self.slots, self.latest_writes = rows.width, rows.slots, None
        mask = rows.mask()
        if kind != "core":
            first, count = (0, pool.prelude) if kind == "prelude" else (pool.prelude, pool.coda)
            self.reads = rows.table[:, first : first + count]
            self.writes = rows._cached(kind, lambda: rows.writes(self.reads))
        else:
            caches, first = rows.caches, pool.prelude + pool.coda
            planes = [iteration % cache.kept for iteration, cache in zip(iterations, caches)]
            one_plane = planes.count(planes[0]) == len(planes)
            plane = None if one_plane else torch.tensor(planes, device=pool.device)
            if one_plane:  # (fixed depth) a slice of every row's keys, its writes kept for the forward's calls
                self.reads = rows.table[:, first + pool.core * planes[0] : first + pool.core * (planes[0] + 1)]
                self.writes = rows._cached(f"plane {planes[0]}", lambda: rows.writes(self.reads))
            else:
                self.reads = rows.blocks((first + pool.core * plane)[:, None] + torch.arange(pool.core,
                                                                                            device=pool.device))
                self.writes = rows.writes(self.reads)
            full = rows.full()
            if full is not None:
                latest_reads, self.latest_writes = rows.latest()
            # a plane some committed position did not reach: `full` masks it, `latest` / `ring:N` read the latest
            if any(q >= cache.shallowest for q, cache in zip(planes, caches)):
                if plane is None:
                    plane = torch.full((len(planes),), planes[0], device=pool.device)
                present = rows.depths() > plane[:, None]  # the columns written at this plane
                if full is not None:
                    self.reads = torch.where((~present & ~full[:, None])[:, None], latest_reads, self.reads)
                mask = mask & (present if full is None else present | ~full[:, None])[:, None]
        self.mask = mask[:, None]

    def update(self, index: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        pool = self.pool
        block = -1 - index if index < 0 else index if index < pool.prelude else index - pool.prelude
        rows, width, heads, head_dim = k.shape
        kv = torch.stack([k, v], dim=2).view(rows * width, -1)  # (rows x width, 2 x heads x head_dim)
        pool.entries.index_copy_(0, self.writes[:, block].flatten(), kv)
        if self.latest_writes is not None:
            pool.entries.index_copy_(0, self.latest_writes[:, block].flatten(), kv)
        reads = self.reads[:, block]
        entries = pool.entries.index_select(0, reads.flatten()).view(*reads.shape, 2, heads, head_dim)
        return entries[:, :, 0], entries[:, :, 1]

    def attention_mask(self, index: int, length: int) -> Tensor:
        """(rows, 1, width, columns) which key columns each query attends to, the same for every block of the call."""
        return self.mask


def parse_cache(strategy: str) -> int | None:
    """The ring size of `ring:N`; None for `full` and `latest`."""
    if strategy in ("full", "latest"):
        return None
    if strategy.startswith("ring:") and strategy[5:].isdigit() and int(strategy[5:]) > 0:
        return int(strategy[5:])
    raise ValueError(f"cache must be 'full', 'latest' or 'ring:N' with N >= 1, got {strategy!r}")

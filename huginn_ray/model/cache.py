"""Key/value caches for generation: what an attention call of a cached forward reads and appends.

`KVCache` is the model's own (every position at every block index: fixed-depth generation). `CachePool` holds the
keys/values of every sequence in adaptive-compute generation (huginn_ray.model.generate, huginn_ray.model.engine),
where tokens exit the recurrence at different iterations and a deeper token meets past positions that have no
entry for its iteration; each sequence owns a slot of it (`SequenceCache`), and `RowBatch` lets one batched call
read and write any of them, each row at its own position and iteration. `KVCache` and `RowBatch` are read
through the same two calls from `CausalSelfAttention`: `attention_mask`, `update`.

Block indices: prelude blocks 0..P-1, core block j of iteration i gets P + L*i + j, coda blocks -1, -2, ...
"""

from __future__ import annotations

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
        """(slots, D) the latent state of each slot's decoding forward (one position; huginn_ray.model.generate)."""
        self.injected = torch.zeros(0, cfg.n_embd, device=device, dtype=dtype)
        """(slots, D) the adapter's half for e of that forward (W[:, D:] e)."""
        self.free_slots: list[int] = []
        self.layouts: dict[tuple, _Layout] = {}
        """Index tensors of the batched calls since the last commit or allocation (RowBatch)."""

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

    def entry_of(self, row_keys: Tensor, positions: Tensor) -> Tensor:
        """(rows, blocks, positions) entry indices of rows (slot x keys + key, (rows, blocks)) of the table at
        (rows, positions) positions."""
        flat = (row_keys * self.table.shape[2])[:, :, None] + positions[:, None, :]
        return self.table.view(-1).index_select(0, flat.flatten()).view(flat.shape)

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


class _Layout:
    """What a batched call over rows in these slots, at these starts and lengths, needs whatever its blocks:
    computed once and reused by every call until a commit moves the rows (CachePool.layouts)."""

    def __init__(self, pool: CachePool, slots: tuple[int, ...], starts: tuple[int, ...], lengths: tuple[int, ...],
                 kept: set[int]):
        device, limit = pool.device, pool.table.shape[2] - 1
        self.pool, self.indices = pool, {}
        self.slots = torch.tensor(slots, device=device)
        self.kept = next(iter(kept)) if len(kept) == 1 else None
        """The core planes every row keeps, None when they differ."""
        offset, width = max(starts), max(lengths)
        start = torch.tensor(starts, device=device)[:, None]
        end = torch.tensor([s + n for s, n in zip(starts, lengths)], device=device)[:, None]
        positions = torch.arange(-offset, width, device=device) + start  # (rows, columns): each column's position
        self.attendable = (positions >= 0) & (positions < end)  # the rows' own
        self.positions = positions.clamp(0, limit)
        written = start if width == 1 else start + torch.arange(width, device=device)  # (rows, width) written
        self.write = None if min(lengths) == width else written < end
        """Which of `written` are real positions; None for all."""
        self.written = written.clamp_max(limit)

    def every_plane(self, caches: list[SequenceCache]) -> tuple[Tensor, Tensor, Tensor | None]:
        """Reads and writes of every core block of every plane (rows, kept x L, ...), and the latest copies' writes
        (None when every row is `full`): computed once per layout, sliced by each core call at one plane."""
        if "every plane" not in self.indices:
            pool, device = self.pool, self.pool.device
            first = pool.prelude + pool.coda
            keys = torch.arange(first, first + pool.core * self.kept, device=device).expand(len(caches), -1)
            latest_writes = None if self.full(caches) is None else self.latest(caches)[1]
            self.indices["every plane"] = (*self.reads_and_writes(keys), latest_writes)
        return self.indices["every plane"]

    def full(self, caches: list[SequenceCache]) -> Tensor | None:
        """(rows,) which rows have the `full` strategy; None when all have."""
        if "full" not in self.indices:
            full = [cache.strategy == "full" for cache in caches]
            self.indices["full"] = None if all(full) else torch.tensor(full, device=self.pool.device)
        return self.indices["full"]

    def latest(self, caches: list[SequenceCache]) -> tuple[Tensor, Tensor]:
        """Reads and writes of the latest copies of the core blocks (`latest`, `ring:N`; `full` rows, which keep
        none, write TRASH and have their reads ignored: they index their first plane, within their own keys)."""
        if "latest" not in self.indices:
            pool = self.pool
            first = torch.tensor([pool.prelude + pool.coda + pool.core * (0 if cache.strategy == "full" else cache.kept)
                                  for cache in caches], device=pool.device)
            keys = first[:, None] + torch.arange(pool.core, device=pool.device)
            self.indices["latest"] = self.reads_and_writes(keys, self.full(caches))
        return self.indices["latest"]

    def depths(self) -> Tensor:
        """(rows, columns) the core iterations of each column's position (NOT_YET: not committed)."""
        if "depths" not in self.indices:
            pool = self.pool
            flat = (self.slots * pool.depths.shape[1])[:, None] + self.positions
            self.indices["depths"] = pool.depths.view(-1).index_select(0, flat.flatten()).view(flat.shape)
        return self.indices["depths"]

    def reads_and_writes(self, keys: Tensor, skip: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """For (rows, blocks) table keys: the entries each column reads (rows, blocks, columns) and those each
        new position writes (rows, blocks, width; TRASH for padding, and for the rows `skip` marks)."""
        row_keys = (self.slots * self.pool.table.shape[1])[:, None] + keys
        write = self.write
        if skip is not None:
            write = ~skip[:, None] if write is None else write & ~skip[:, None]
        writes = self.pool.entry_of(row_keys, self.written)
        return self.pool.entry_of(row_keys, self.positions), writes if write is None else torch.where(
            write[:, None], writes, TRASH)


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


class RowBatch:
    """The KV-cache protocol of `CausalSelfAttention` (`attention_mask`, `update`) for one batched
    call over rows of a CachePool, each row at its own position and (in a core call) its own iteration.

    Row r holds lengths[r] real positions (the rest of the call's `width` is padding) starting at its committed
    length. The keys handed to the attention are laid out so that its single causal offset fits every row: with S
    the largest start, row r's position p sits in column p + S - start_r, so its queries see their own past at
    the columns the causal mask of offset S opens; columns left of a row's first position, and right of its
    last, are padding that the mask leaves out. Everything row-dependent (which entry each column reads, which
    entry each new position writes, which columns may be attended) is computed once per call as index tensors;
    each block then writes its new keys/values with one indexed store and reads the rows' attended ones with one
    gather from the pool. Padding writes to TRASH.

    `kind` is "prelude", "core" or "coda"; a core call gives each row's iteration (`iterations`) and its block
    indices as those of iteration 0."""

    def __init__(self, caches: list[SequenceCache], lengths: list[int], kind: str, iterations: list[int] | None = None):
        pool = self.pool = caches[0].pool
        device = pool.device
        starts = [cache.length for cache in caches]
        self.starts, self.kind = starts, kind
        self.width, self.offset = max(lengths), max(starts)
        self.aligned = len(set(starts)) == 1 and min(lengths) == self.width
        key = (tuple(cache.slot for cache in caches), tuple(starts), tuple(lengths))
        layout = pool.layouts.get(key) or pool.layouts.setdefault(
            key, _Layout(pool, *key, {cache.kept for cache in caches}))
        self.slots, self._mask = layout.slots, None
        attendable, self.latest_writes, presence = layout.attendable, None, False
        if kind != "core":
            if kind not in layout.indices:
                first = 0 if kind == "prelude" else pool.prelude
                keys = torch.arange(first, first + (pool.prelude if kind == "prelude" else pool.coda), device=device)
                layout.indices[kind] = layout.reads_and_writes(keys.expand(len(caches), -1))
            self.reads, self.writes = layout.indices[kind]
        else:
            planes = [iteration % cache.kept for iteration, cache in zip(iterations, caches)]
            # a plane some committed position did not reach: `full` masks it, `latest` / `ring:N` read the latest
            presence = any(plane >= cache.shallowest for plane, cache in zip(planes, caches))
            if not presence and planes.count(planes[0]) == len(planes) and layout.kept is not None:
                # every row at one plane, all present (fixed depth): slices of the layout's every-plane indices
                reads, writes, self.latest_writes = layout.every_plane(caches)
                blocks = slice(pool.core * planes[0], pool.core * (planes[0] + 1))
                self.reads, self.writes = reads[:, blocks], writes[:, blocks]
                self._attendable = None if self.offset == 0 or self.aligned else attendable
                return
            plane = torch.tensor(planes, device=device)
            blocks = torch.arange(pool.core, device=device)
            self.reads, self.writes = layout.reads_and_writes((pool.prelude + pool.coda + pool.core * plane)[:, None]
                                                              + blocks)
            full = layout.full(caches)
            if full is not None:
                latest_reads, self.latest_writes = layout.latest(caches)
            if presence:
                present = layout.depths() > plane[:, None]  # the columns written at this plane
                if full is not None:
                    self.reads = torch.where((~present & ~full[:, None])[:, None], latest_reads, self.reads)
                attendable = attendable & (present if full is None else present | ~full[:, None])
        # at offset 0, and for aligned rows with every plane present, the causal mask suffices
        self._attendable = None if self.offset == 0 or (self.aligned and not presence) else attendable

    def rope(self, freqs_cis: Tensor) -> Tensor:
        """The rotary table of each row's positions, (rows, width, 1, head_dim / 2, 2) (padding: clamped)."""
        if self.aligned:
            return freqs_cis[:, self.starts[0] : self.starts[0] + self.width]
        positions = torch.tensor(self.starts, device=freqs_cis.device)[:, None] + torch.arange(
            self.width, device=freqs_cis.device)
        return freqs_cis[0, positions.clamp_max(freqs_cis.shape[1] - 1)]

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

    def attention_mask(self, index: int, length: int) -> Tensor | None:
        """(rows, 1, width, columns) which key columns each query attends to, the same for every block of the call
        (built at its first): the causal mask at offset `offset` and the columns the rows may attend; None when the
        causal mask at offset 0 is right."""
        if self.offset == 0 and self._attendable is None:
            return None
        if self._mask is None:
            mask = torch.ones(length, self.offset + length, dtype=torch.bool, device=self.pool.device).tril(self.offset)
            self._mask = mask if self._attendable is None else mask & self._attendable[:, None, None, :]
        return self._mask


def parse_cache(strategy: str) -> int | None:
    """The ring size of `ring:N`; None for `full` and `latest`."""
    if strategy in ("full", "latest"):
        return None
    if strategy.startswith("ring:") and strategy[5:].isdigit() and int(strategy[5:]) > 0:
        return int(strategy[5:])
    raise ValueError(f"cache must be 'full', 'latest' or 'ring:N' with N >= 1, got {strategy!r}")

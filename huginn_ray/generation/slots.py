"""The engine's persistent device buffers: B slots, each a request decoding one token at a time, and their
keys/values, laid out so that a decode step over all B slots has fixed shapes and reads no index from the host.

Per slot (index s < B; index B is the trash slot that masked rows write to and nothing reads):
- the forward in progress: latent `state` and `injected` half (B, D), `position` of its token, core `iteration`,
  `exited` (its forward ended, waiting for the finish), `active` (the slot holds a request still decoding);
- the request's settings, set at admission: `num_steps`, `kept` planes, `full` (cache strategy), exit
  `criterion` (a code, CRITERION_CODES), `threshold`, `min_steps`, `check_every`, `warm` start, `temperature`,
  `top_k`, `top_p`, `max_new` tokens, `stop` token ids (padded with -1), `emitted` tokens so far;
- the criterion's comparands of the forward in progress (previous state, entropy, argmax and its run, log-probs);
- the pre-drawn random numbers of its next finish (`next_exponential`: the draw `torch.multinomial` would take
  for its token; `next_uniform`: its next forward's initial noise), copied in by the host from the request's
  draws (huginn_ray.generation.engine) after each finish;
- the outputs of the last finish (`out_token`, `out_emitted`, `out_iterations`, `out_done`), which the host reads
  after the step.

Keys/values (`SlotCache`): per slot contiguous columns, one tensor per block: prelude and coda blocks
(B + 1, positions, heads, head_dim); core block j (B + 1, positions, planes + 1, heads, head_dim), plane q of a
position holding the iteration i ≡ q (mod the slot's kept planes) it reached last, and plane `planes` the latest
iteration (`latest`, `ring:N`). `depths` (B + 1, positions) are the core iterations of each committed position
(NOT_YET beyond). A call's attention reads the first `columns` positions of every slot: of a prelude or coda
block as a view of these tensors, of a core block the one plane each position gives this row's iteration, indexed
on the device into a copy (core_reads).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from huginn_ray.generation.caches import NOT_YET
from huginn_ray.generation.exits import DEFAULT_THRESHOLDS, ENTROPY_START
from huginn_ray.model.config import ModelConfig

CRITERION_CODES = {name: code for code, name in enumerate(DEFAULT_THRESHOLDS, start=1)}
"""Exit criterion name -> the code a slot holds (0: none)."""


class SlotCache:
    """Keys and values of every slot (see the module docstring), grown (never shrunk) to the positions and
    core planes the admitted requests need; a growth moves them to new tensors (a captured graph of the old
    ones is stale: `version` counts growths)."""

    def __init__(self, cfg: ModelConfig, rows: int, device: torch.device, dtype: torch.dtype):
        self.cfg, self.rows, self.device, self.dtype = cfg, rows, device, dtype
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.prelude, self.coda, self.core = cfg.n_layers_in_prelude, cfg.n_layers_in_coda, cfg.n_layers_in_recurrent_block
        self.positions, self.planes, self.version = 0, 0, 0
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        """Per block: prelude blocks, coda blocks, then core blocks (SlotAttention.store)."""
        self.depths = torch.zeros(rows + 1, 0, dtype=torch.long, device=device)

    def fit(self, positions: int, planes: int) -> None:
        """Room for `positions` positions (rounded up to a power of two) and `planes` core planes per slot."""
        positions = max(16, 1 << math.ceil(math.log2(max(positions, 1))))
        if positions <= self.positions and planes <= self.planes:
            return
        positions, planes = max(positions, self.positions), max(planes, self.planes)
        shape = (self.rows + 1, positions)
        grown_keys, grown_values = [], []
        for block in range(self.prelude + self.coda + self.core):
            core = block >= self.prelude + self.coda
            extra = (planes + 1,) if core else ()
            for old, grown in ((self.keys, grown_keys), (self.values, grown_values)):
                new = torch.zeros(*shape, *extra, self.heads, self.head_dim, device=self.device, dtype=self.dtype)
                if old:
                    if core:  # the kept planes, then the latest copy, which moves to the new last plane
                        new[:, : self.positions, : self.planes] = old[block][:, :, : self.planes]
                        new[:, : self.positions, planes] = old[block][:, :, self.planes]
                    else:
                        new[:, : self.positions] = old[block]
                grown.append(new)
        depths = torch.full(shape, NOT_YET, dtype=torch.long, device=self.device)
        depths[:, : self.positions] = self.depths
        self.keys, self.values, self.depths = grown_keys, grown_values, depths
        self.positions, self.planes, self.version = positions, planes, self.version + 1

    def bytes(self) -> int:
        """Bytes of the key/value tensors (trash slot included)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class Slots:
    """The B slots' buffers (module docstring) and their keys/values (`cache`)."""

    def __init__(self, cfg: ModelConfig, rows: int, device: torch.device, dtype: torch.dtype):
        self.cfg, self.rows, self.device = cfg, rows, device
        self.cache = SlotCache(cfg, rows, device, dtype)
        D, V = cfg.n_embd, cfg.vocab_size

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.state, self.injected = zeros(rows, D, dtype=dtype), zeros(rows, D, dtype=dtype)
        self.position, self.iteration, self.emitted = zeros(rows), zeros(rows), zeros(rows)
        self.active, self.exited = zeros(rows, dtype=torch.bool), zeros(rows, dtype=torch.bool)
        self.num_steps, self.kept, self.max_new = zeros(rows) + 1, zeros(rows) + 1, zeros(rows) + 1
        self.full, self.warm = zeros(rows, dtype=torch.bool), zeros(rows, dtype=torch.bool)
        self.criterion, self.min_steps, self.check_every = zeros(rows), zeros(rows), zeros(rows) + 1
        self.threshold = zeros(rows, dtype=torch.float32)
        self.temperature, self.top_p = zeros(rows, dtype=torch.float32), zeros(rows, dtype=torch.float32) + 1
        self.top_k = zeros(rows) + V
        self.stop = zeros(rows, 0) - 1
        self.previous_state = zeros(rows, 1, D, dtype=torch.float32)
        self.previous_entropy = zeros(rows, dtype=torch.float32) + ENTROPY_START
        self.previous_argmax, self.stable = zeros(rows) - 1, zeros(rows)
        self.previous_logp = zeros(rows, V, dtype=torch.float32) - math.log(V)
        self.next_exponential = zeros(rows, V, dtype=torch.float32) + 1
        self.next_uniform = zeros(rows, D, dtype=dtype)
        self.out_token, self.out_iterations = zeros(rows), zeros(rows)
        self.out_emitted, self.out_done = zeros(rows, dtype=torch.bool), zeros(rows, dtype=torch.bool)

    def fit_stop(self, width: int) -> None:
        """Room for `width` stop token ids per slot."""
        if width > self.stop.shape[1]:
            stop = torch.full((self.rows, width), -1, dtype=torch.long, device=self.device)
            stop[:, : self.stop.shape[1]] = self.stop
            self.stop = stop
            self.cache.version += 1

    def outputs(self) -> list[Tensor]:
        """The buffers the host reads after a finish: token, emitted, iterations, done."""
        return [self.out_token, self.out_emitted, self.out_iterations, self.out_done]


class SlotAttention:
    """The KV-cache protocol of `CausalSelfAttention` (`attention_mask`, `update`) for one call over all B
    slots, one query each: the new keys/values of the rows `write` marks go to their slot at `position` (core
    blocks: at `plane`, and, but for `full` rows, at the latest plane), the others' to the trash slot; the
    attention reads the first `columns` positions of the B slots through `mask` (B, 1, 1, columns): prelude and
    coda blocks in place (a view), core blocks as the one plane each position gives the row (`read_plane`,
    core_reads), copied into (B, columns, heads, head_dim)."""

    def __init__(self, slots: Slots, columns: int, position: Tensor, write: Tensor, mask: Tensor,
                 plane: Tensor | None = None, latest: bool = True, read_plane: Tensor | None = None):
        self.cache, self.columns, self.position, self.mask = slots.cache, columns, position, mask
        rows = torch.arange(slots.rows, device=slots.device)
        self.slot = torch.where(write, rows, slots.rows)
        self.plane, self.latest = plane, latest
        if plane is not None:  # (B * columns,) the flat index of the (row, column, plane read) vectors
            cache = slots.cache
            columns_index = torch.arange(columns, device=slots.device)[None]
            self.read_at = ((rows[:, None] * cache.positions + columns_index) * (cache.planes + 1) + read_plane).view(-1)
        if plane is not None and latest:
            self.latest_slot = torch.where(write & ~slots.full, rows, slots.rows)
            self.latest_plane = torch.full_like(plane, slots.cache.planes)

    def store(self, index: int) -> int:
        """The block of a block index (prelude 0..P-1, core P + j of iteration 0, coda -1, -2, ...)."""
        cache = self.cache
        if index < 0:
            return cache.prelude - 1 - index
        return index if index < cache.prelude else cache.prelude + cache.coda + index - cache.prelude

    def update(self, index: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        block = self.store(index)
        keys, values = self.cache.keys[block], self.cache.values[block]
        rows = keys.shape[0] - 1
        if self.plane is None:
            for store, new in ((keys, k), (values, v)):
                store.index_put_((self.slot, self.position), new[:, 0])
            return keys[:rows, : self.columns], values[:rows, : self.columns]
        for store, new in ((keys, k), (values, v)):
            store.index_put_((self.slot, self.position, self.plane), new[:, 0])
            if self.latest:
                store.index_put_((self.latest_slot, self.position, self.latest_plane), new[:, 0])
        # one plane per row and position: reading every plane through a mask would attend (planes + 1) times
        # the keys, which costs far more than this copy of the keys the row attends: an index_select of whole
        # heads x head_dim vectors at flat indices (on CPU about 4x faster than advanced indexing with three
        # index tensors, which computes each element's offset; torch.gather's per-element index is slower still)
        shape = (rows, self.columns, self.cache.heads, self.cache.head_dim)
        return tuple(store.view(-1, *shape[2:]).index_select(0, self.read_at).view(shape) for store in (keys, values))

    def attention_mask(self, index: int, length: int) -> Tensor:
        return self.mask


def past_mask(position: Tensor, columns: int) -> Tensor:
    """(B, 1, 1, columns): each row's positions up to its own."""
    return (torch.arange(columns, device=position.device) <= position[:, None])[:, None, None]


def core_reads(slots: Slots, columns: int, plane: Tensor) -> tuple[Tensor, Tensor]:
    """For a core iteration of every row at `plane`: (B, columns) the plane each past position (and its own)
    gives the row, the row's plane where that position reached it (`depths` > plane), else the latest plane; and
    the (B, 1, 1, columns) mask: the row's positions up to its own, without those that did not reach the plane
    for `full` rows (the latest copy stands in for them under `latest` and `ring:N`)."""
    cache = slots.cache
    past = torch.arange(columns, device=slots.device) <= slots.position[:, None]
    present = cache.depths[: slots.rows, :columns] > plane[:, None]
    read_plane = torch.where(present, plane[:, None], cache.planes)
    mask = past & (present | ~slots.full[:, None])
    return read_plane, mask[:, None, None]

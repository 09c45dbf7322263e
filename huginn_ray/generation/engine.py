"""Continuous depth batching: a serving engine in which every sequence exits the recurrence on its own.

    engine = Engine(model, EngineConfig(max_rows=32, max_cache_bytes=2**30))
    request_id = engine.submit(Request(prompt=(1, 2, 3), max_new_tokens=16, exit_criterion="latent-diff", seed=7))
    while engine.busy:
        for event in engine.step():          # TokenEvent(request_id, token_id, core_iterations, finished, ...)
            ...

A pool of sequences at different positions and different core iterations is advanced together, one loop step
per `step()`: a batched core iteration over every sequence in the pool that is iterating (one call for the
decoding sequences, one for those in their prompt's prefill, so that a prompt does not pad every row to its
length; huginn_ray.generation.stepping.iterate_pool, the generator's own step: the same criteria, caches and
sampling). A sequence whose forward ends (its criterion at its own threshold, min_steps and check_every, or its
own num_steps) leaves the core calls; the ended forwards run the coda and head and emit their tokens together
(stepping.finish), in the step they end or, with `exit_wait_steps`, once the first of them has waited that
many steps (or no sequence is left iterating), and their next tokens' prelude joins the pool at the next loop
step. A finished (or cancelled) request frees its row and its cache at once, and waiting requests are
admitted at the start of a step, in the order they came, while both capacities allow: rows (`max_rows`, the
batch of a core call) and key/value bytes (`max_cache_bytes`; a request reserves the most its cache can hold,
CachePool.reserved_bytes), once `admit_rows` rows are free.

Each request draws its initial noise and its samples from its own generator, seeded with its `seed`, and
attends only through its own cache at its own positions: its output is what `generate` gives it alone at
batch size 1 with `generator=torch.Generator().manual_seed(seed)`, token for token and iteration for
iteration, up to the rounding of batched matmuls (tests/test_model_engine.py).

Layout: one CachePool holds every request's keys/values; a request takes a slot and, at admission, the
entries it reserved (prompt + max_new_tokens positions x the blocks its strategy keeps), and gives both back
when it finishes or is cancelled. A batched call reads and writes every row through index tensors computed once
per set of rows (`Rows`: one table read per step for the decoding rows, one for the rows that exit, shared by
their coda and their next prelude): per block one indexed store of the new keys/values and one gather of the
attended ones, no per-row work; the attention then reads every row's positions up to the furthest row's (one
extra copy of what it reads, as the concatenation of the model's own KVCache has).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from huginn_ray.generation.caches import CachePool
from huginn_ray.generation.requests import Request
from huginn_ray.generation.stepping import Sequence, finish, iterate_pool, start
from huginn_ray.model.model import RecurrentGPT


@dataclass(frozen=True)
class EngineConfig:
    """Capacities of an engine, fixed at its start; admission waits while either would be exceeded."""

    max_rows: int
    """Sequences in flight at once (the batch of each core call)."""
    max_cache_bytes: int
    """Key/value bytes the sequences in flight may reserve together."""
    exit_wait_steps: int = 0
    """Loop steps a sequence whose forward ended may wait, out of the core calls, for others to end, so that
    the coda, head and next prelude of all of them run as one call each (0: in the step its forward ended).
    Each such call costs about as much for 1 row as for 10 when a call's cost is its weights' reads or its
    fixed overhead, not its rows' work; waiting adds at most this many steps to a token's latency and does not
    change any output."""
    admit_rows: int = 1
    """Rows that must be free before waiting requests are admitted (or as many as are waiting; any number when
    no row is in flight), so that prompts enter together: each admission step runs a prelude call, and its
    prompts' prefill runs in core calls of their own until it ends, each costing about as much for one prompt as
    for several. Free rows stay idle meanwhile; it does not change any output. At most max_rows."""

    def __post_init__(self):
        for name, least in (("max_rows", 1), ("max_cache_bytes", 1), ("exit_wait_steps", 0), ("admit_rows", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if self.admit_rows > self.max_rows:
            raise ValueError(f"admit_rows must be at most max_rows={self.max_rows}, got {self.admit_rows}")


@dataclass(frozen=True)
class TokenEvent:
    """One token emitted by one request."""

    request_id: int
    """The id `submit` returned."""
    token_id: int
    """The token emitted."""
    core_iterations: int
    """Core iterations of the forward that produced it (the first token's: the prompt's prefill)."""
    finished: bool
    """Whether it is the request's last token (its row and cache are free after this step)."""
    finish_reason: str | None
    """"stop" (a stop token), "length" (max_new_tokens), or None while the request goes on."""


class Engine:
    """Continuous depth batching over one model (see the module docstring), which it puts in eval mode. Not
    thread-safe: one caller drives `submit`, `step` and `cancel` (a server's engine loop)."""

    def __init__(self, model: RecurrentGPT, config: EngineConfig):
        self.model, self.config = model.eval(), config
        self.device = model.freqs_cis.device
        parameter = next(model.parameters())
        self.element_size = parameter.element_size()
        entry_bytes = 2 * model.config.n_embd * self.element_size
        self.caches = CachePool(model.config, self.device, parameter.dtype, config.max_cache_bytes // entry_bytes)
        """Every request's keys/values, allocated at admission as it reserved them (so never beyond max_cache_bytes)."""
        self.waiting: deque[tuple[int, Request]] = deque()
        self.pool: dict[int, Sequence] = {}
        self.reserved: dict[int, int] = {}
        self.ended_at: dict[int, int] = {}
        """Request id -> the loop step its forward ended, while it waits for `finish` (exit_wait_steps)."""
        self.loop_step = 0
        self.next_id = 0

    @property
    def rows_in_flight(self) -> int:
        return len(self.pool)

    @property
    def cache_bytes_reserved(self) -> int:
        return sum(self.reserved.values())

    @property
    def busy(self) -> bool:
        """Whether any request is waiting or in flight."""
        return bool(self.waiting or self.pool)

    def reservation(self, request: Request) -> int:
        """Cache bytes a checked request reserves while in flight."""
        return CachePool.reserved_bytes(self.model.config, len(request.prompt) + request.max_new_tokens - 1,
                                               request.cache, request.num_steps, self.element_size)

    def submit(self, request: Request) -> int:
        """Queue a request; returns its id. A bad field, or a request that could never fit the cache capacity,
        raises ValueError naming it."""
        if not isinstance(request, Request):
            raise ValueError(f"request must be a huginn_ray.generation.requests.Request, got {type(request).__name__}")
        request = request.checked(self.model.config)
        need = self.reservation(request)
        if need > self.config.max_cache_bytes:
            raise ValueError(f"the request's key/value cache ({need:,} bytes for prompt + max_new_tokens = "
                             f"{len(request.prompt) + request.max_new_tokens} positions, cache {request.cache!r}, "
                             f"num_steps {request.num_steps}) exceeds max_cache_bytes={self.config.max_cache_bytes:,}")
        request_id, self.next_id = self.next_id, self.next_id + 1
        self.waiting.append((request_id, request))
        return request_id

    def cancel(self, request_id: int) -> bool:
        """Drop a waiting or running request, freeing its row and cache; False if it is not known (finished)."""
        for index, (waiting_id, _) in enumerate(self.waiting):
            if waiting_id == request_id:
                del self.waiting[index]
                return True
        if request_id in self.pool:
            self._free(request_id)
            return True
        return False

    @torch.no_grad()
    def step(self) -> list[TokenEvent]:
        """Admit what fits (once `admit_rows` rows are free), then one loop step; the tokens it emitted (none
        in a step whose ended forwards all still wait, exit_wait_steps)."""
        self._admit()
        if not self.pool:
            return []
        ids = {id(sequence): request_id for request_id, sequence in self.pool.items()}
        iterating = [sequence for request_id, sequence in self.pool.items() if request_id not in self.ended_at]
        for sequence in iterate_pool(self.model, iterating) if iterating else []:
            self.ended_at[ids[id(sequence)]] = self.loop_step
        self.loop_step += 1
        if not self.ended_at or (len(self.ended_at) < len(self.pool)
                                 and self.loop_step - min(self.ended_at.values()) <= self.config.exit_wait_steps):
            return []
        ended = [self.pool[request_id] for request_id in self.ended_at]
        self.ended_at.clear()
        events = []
        for sequence, token_id in finish(self.model, ended):
            request_id = ids[id(sequence)]
            events.append(TokenEvent(request_id, token_id, sequence.steps[-1], sequence.finish_reason is not None,
                                     sequence.finish_reason))
            if sequence.finish_reason is not None:
                self._free(request_id)
        return events

    def _admit(self) -> None:
        if self.pool and self.config.max_rows - len(self.pool) < min(self.config.admit_rows, len(self.waiting)):
            return  # wait for more free rows (admit_rows)
        admitted = []
        while self.waiting and len(self.pool) < self.config.max_rows:
            request_id, request = self.waiting[0]
            need = self.reservation(request)
            if self.cache_bytes_reserved + need > self.config.max_cache_bytes:
                break  # first come, first served: a large request is not overtaken
            self.waiting.popleft()
            generator = torch.Generator(device=self.device).manual_seed(request.seed)
            self.pool[request_id] = Sequence(request, generator, self.caches, self.model.config)
            self.reserved[request_id] = need
            admitted.append(self.pool[request_id])
        if admitted:
            start(self.model, admitted)

    def _free(self, request_id: int) -> None:
        self.pool.pop(request_id).cache.release()
        del self.reserved[request_id]
        self.ended_at.pop(request_id, None)

"""Continuous depth batching: a serving engine in which every sequence exits the recurrence on its own, decoded
by a fixed-shape step that never reads the device.

    engine = Engine(model, EngineConfig(max_rows=32, max_cache_bytes=2**30))
    request_id = engine.submit(Request(prompt=(1, 2, 3), max_new_tokens=16, exit_criterion="latent-diff", seed=7))
    while engine.busy:
        for event in engine.step():          # TokenEvent(request_id, token_id, core_iterations, finished, ...)
            ...

`max_rows` slots hold the requests in flight (huginn_ray.generation.slots). Each `step()` (1) reads the outputs of
the previous step's finish (one step late: on CUDA from pinned memory, copied without blocking) and turns them
into TokenEvents, freeing the slots of finished requests and copying in the next draws of those going on; (2)
admits waiting requests, in the order they came, while rows (`max_rows`) and key/value bytes
(`max_cache_bytes`; a request reserves the most its cache can hold, CachePool.reserved_bytes) allow, once
`admit_rows` rows are free: their prompts' prefill runs eagerly, batched (huginn_ray.generation.admission), and
their first tokens are events of this step; (3) runs one decode step over all slots
(huginn_ray.generation.decode_step: a core iteration of every iterating row, and every `exit_wait_steps` + 1
steps the finish of the forwards that ended), compiled with `compile`, as a replayed CUDA graph with
`cuda_graphs`.

Each request draws its initial noise and its samples from its own generator, seeded with its `seed`, in the
order batch-1 `generate` draws them (taken at admission), and attends only through its own cache at its own
positions: its output is what `generate` gives it alone at batch size 1 with
`generator=torch.Generator().manual_seed(seed)`, token for token and iteration for iteration, up to the rounding
of batched matmuls (tests/test_model_engine.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from huginn_ray.generation.admission import Draws, draw_ahead, load, prefill, refill
from huginn_ray.generation.caches import CachePool
from huginn_ray.generation.decode_step import StepKind
from huginn_ray.generation.graphs import StepRunner
from huginn_ray.generation.requests import Request
from huginn_ray.generation.slots import Slots
from huginn_ray.generation.stepping import Sequence
from huginn_ray.model.model import RecurrentGPT


@dataclass(frozen=True)
class EngineConfig:
    """Capacities of an engine, fixed at its start; admission waits while either would be exceeded."""

    max_rows: int
    """Sequences in flight at once (the batch of each core call)."""
    max_cache_bytes: int
    """Key/value bytes the sequences in flight may reserve together."""
    exit_wait_steps: int = 0
    """Decode steps between two finishes: the coda, head, sampling and next prelude run over the slots every
    exit_wait_steps + 1 steps (0: every step), on a schedule the host knows without reading the device; a
    forward that ended waits for the next one, out of the core. A finish costs the same for 1 row as for all,
    so waiting trades up to this many steps of a token's latency for fewer finishes; it changes no output."""
    admit_rows: int = 1
    """Rows that must be free before waiting requests are admitted (or as many as are waiting; any number when
    no row is in flight), so that prompts enter together: their prefill runs batched, in calls costing about
    as much for one prompt as for several. Free rows stay idle meanwhile; it does not change any output. At
    most max_rows."""
    cuda_graphs: bool | None = None
    """Replay each kind of decode step as a captured CUDA graph (huginn_ray.generation.graphs); None: on when
    the model is on a CUDA device. The eager step (off) is the same function."""
    compile: bool = False
    """Compile each kind of decode step with torch.compile (one graph, static shapes) the first time it runs
    (huginn_ray.generation.graphs): the same outputs, with fused elementwise work and no Python per op. The
    first step of each kind waits for its compilation (seconds; torch's cache keeps it for later processes)."""

    def __post_init__(self):
        for name, least in (("max_rows", 1), ("max_cache_bytes", 1), ("exit_wait_steps", 0), ("admit_rows", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if self.cuda_graphs not in (None, True, False):
            raise ValueError(f"cuda_graphs must be true, false or None, got {self.cuda_graphs!r}")
        if self.compile not in (True, False):
            raise ValueError(f"compile must be true or false, got {self.compile!r}")
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




@dataclass
class InFlight:
    """A request in a slot."""

    request: Request
    slot: int
    draws: Draws
    """Its pre-drawn random numbers (admission.draw_ahead)."""
    emitted: int = 1
    """Tokens emitted so far (the host's count, one step late)."""


class Engine:
    """Continuous depth batching over one model (see the module docstring), which it puts in eval mode. Not
    thread-safe: one caller drives `submit`, `step` and `cancel` (a server's engine loop)."""

    def __init__(self, model: RecurrentGPT, config: EngineConfig):
        self.model, self.config = model.eval(), config
        self.device = model.freqs_cis.device
        parameter = next(model.parameters())
        self.dtype, self.element_size = parameter.dtype, parameter.element_size()
        self.slots = Slots(model.config, config.max_rows, self.device, self.dtype)
        cuda_graphs = self.device.type == "cuda" if config.cuda_graphs is None else config.cuda_graphs
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs the model on a CUDA device, not {self.device}")
        self.runner = StepRunner(self.model, self.slots, cuda_graphs, config.compile)
        self.waiting: deque[tuple[int, Request]] = deque()
        self.in_flight: dict[int, InFlight] = {}
        self.free_slots = list(range(config.max_rows - 1, -1, -1))
        self.reserved: dict[int, int] = {}
        self.pending: tuple[dict[int, int], list[torch.Tensor], torch.cuda.Event | None] | None = None
        """The last finish's outputs on their way to the host: slot -> request id then, the host copies, and
        (CUDA) the event that marks their copy done."""
        self.host_outputs = None
        if self.device.type == "cuda":
            self.host_outputs = [torch.empty_like(t, device="cpu").pin_memory() for t in self.slots.outputs()]
        self.loop_step = 0
        self.next_id = 0

    @property
    def rows_in_flight(self) -> int:
        return len(self.in_flight)

    @property
    def cache_bytes_reserved(self) -> int:
        return sum(self.reserved.values())

    @property
    def busy(self) -> bool:
        """Whether any request is waiting or in flight (or a step's tokens are still to be read)."""
        return bool(self.waiting or self.in_flight or self.pending)

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
        if request_id in self.in_flight:
            slot = self.in_flight[request_id].slot
            self.slots.active[slot] = False
            self.slots.exited[slot] = False
            self._free(request_id)
            return True
        return False

    @torch.no_grad()
    def step(self) -> list[TokenEvent]:
        """Read the last finish's tokens, admit what fits (once `admit_rows` rows are free), then one decode
        step; the tokens read and those of the admitted requests' prefill."""
        events = self._collect()
        events += self._admit()
        if self.in_flight:
            kind = self.kind()
            self.runner.run(kind)
            self.loop_step += 1
            if kind.finish:
                self._send_outputs()
        return events

    def kind(self) -> StepKind:
        """The next decode step's kind, from the requests in flight and the step count alone."""
        requests = [flight.request for flight in self.in_flight.values()]
        # a row's forward is at position len(prompt) + emitted - 1, and a finish may write the next one's prelude
        need = max(len(flight.request.prompt) + flight.emitted + 1 for flight in self.in_flight.values())
        columns = min(1 << max(4, (need - 1).bit_length()), self.slots.cache.positions)
        finish = self.loop_step % (self.config.exit_wait_steps + 1) == self.config.exit_wait_steps
        sampled = [r for r in requests if r.temperature > 0] if finish else []  # only a finish samples
        return StepKind(columns=columns, finish=finish,
                        criteria=tuple(sorted({r.exit_criterion for r in requests if r.exit_criterion is not None})),
                        sampling=bool(sampled), top_k=any(r.top_k is not None for r in sampled),
                        top_p=any(r.top_p is not None and r.top_p < 1 for r in sampled),
                        latest=any(r.cache != "full" for r in requests))

    def _send_outputs(self) -> None:
        """Start the copy of the finish's outputs to the host (read by the next `step`)."""
        requests = {flight.slot: request_id for request_id, flight in self.in_flight.items()}
        if self.host_outputs is None:  # CPU: a plain copy, after the step
            self.pending = (requests, [t.clone() for t in self.slots.outputs()], None)
            return
        for host, device in zip(self.host_outputs, self.slots.outputs()):
            host.copy_(device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self.pending = (requests, self.host_outputs, copied)

    def _collect(self) -> list[TokenEvent]:
        """The TokenEvents of the last finish; frees finished requests, refills the draws of those going on."""
        if self.pending is None:
            return []
        requests, outputs, copied = self.pending
        self.pending = None
        if copied is not None:
            copied.synchronize()
        tokens, emitted, iterations, done = (t.tolist() for t in outputs)
        events = []
        for slot, request_id in requests.items():
            flight = self.in_flight.get(request_id)
            if not emitted[slot] or flight is None or flight.slot != slot:
                continue  # nothing emitted, or cancelled since
            flight.emitted += 1
            reason = None
            if done[slot]:
                reason = "stop" if tokens[slot] in flight.request.stop_token_ids else "length"
                self._free(request_id)
            else:
                refill(self.slots, slot, flight.draws, flight.emitted + 1)
            events.append(TokenEvent(request_id, tokens[slot], iterations[slot], reason is not None, reason))
        return events

    def _admit(self) -> list[TokenEvent]:
        """Admit what fits: prefill, first tokens, then into slots."""
        if self.in_flight and self.config.max_rows - len(self.in_flight) < min(self.config.admit_rows,
                                                                                len(self.waiting)):
            return []  # wait for more free rows (admit_rows)
        admitted, pool = [], None
        while self.waiting and len(self.in_flight) + len(admitted) < self.config.max_rows:
            request_id, request = self.waiting[0]
            need = self.reservation(request)
            if self.cache_bytes_reserved + need > self.config.max_cache_bytes:
                break  # first come, first served: a large request is not overtaken
            self.waiting.popleft()
            pool = pool or CachePool(self.model.config, self.device, self.dtype)
            generator = torch.Generator(device=self.device).manual_seed(request.seed)
            admitted.append((request_id, Sequence(request, generator, pool, self.model.config)))
            self.reserved[request_id] = need
        if not admitted:
            return []
        ids = {id(sequence): request_id for request_id, sequence in admitted}
        events = []
        for sequence, token_id in prefill(self.model, [sequence for _, sequence in admitted]):
            request_id, request = ids[id(sequence)], sequence.request
            reason = sequence.finish_reason
            events.append(TokenEvent(request_id, token_id, sequence.steps[-1], reason is not None, reason))
            if reason is not None:
                del self.reserved[request_id]
                continue
            slot = self.free_slots.pop()
            draws = draw_ahead(self.model, request, sequence.generator, self.dtype)
            load(self.slots, slot, sequence, self.model)
            refill(self.slots, slot, draws, 2)
            self.in_flight[request_id] = InFlight(request, slot, draws)
        return events

    def _free(self, request_id: int) -> None:
        self.free_slots.append(self.in_flight.pop(request_id).slot)
        del self.reserved[request_id]

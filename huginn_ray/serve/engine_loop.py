"""One thread that owns an Engine and drives it; the server's request handlers talk to it through queues.

    loop = EngineLoop(engine, report)     # report(loop.snapshot()) now, as the engine changes, and every second
    ticket = loop.submit(request)         # from a handler, on its asyncio event loop
    event = await ticket.events.get()     # TokenEvent ... until event.finished; or an EngineFailed
    loop.cancel(ticket)                   # the client went away: frees the request's row and cache
    loop.stop()

The engine is not thread-safe, so this thread is its only caller. It blocks while the engine is idle; while
requests are in flight it takes every command waiting (submit, cancel) between two loop steps and then runs
the next step, so a request that arrives joins the batch at the next loop step and a cancelled one leaves it.
Each token reaches its handler through that handler's asyncio queue (`call_soon_threadsafe`). A forward is
torch work that releases the GIL for its kernels, so the handlers' event loop keeps answering meanwhile.

The engine thread publishes its `snapshot()` (the engine's state and the loop's counters) after every loop step
and every command; a second thread, the reporter, sends the latest one through `report`: once at the start, at
once after a step in which a request entered or left the engine (submitted, finished, cancelled, failed), and
otherwise every `report_every_s`, idle or not, and also while one engine step runs for long (a large model on a
CPU: a prefill can take minutes). Each report says how long the step under way has run (`step_running_s`; 0
between steps), so a stuck engine thread shows as a growing figure. Only the engine thread reads the engine (it
is not thread-safe); the reporter reads the published snapshot, a dict replaced whole. So once the engine is
idle the last report is exact; while it works, the counters lag by at most one step or `report_every_s`; and a
loop that has not reported for several `report_every_s` has lost its process: the StatsBoard leaves it out.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from huginn_ray.generation.engine import Engine, TokenEvent
from huginn_ray.generation.requests import Request

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Ticket:
    """A handler's view of one submitted request."""

    loop: asyncio.AbstractEventLoop
    """The handler's event loop: tokens are put on `events` there."""
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    """TokenEvent per token, or an EngineFailed that ends the request."""


class EngineFailed(RuntimeError):
    """The engine raised while it held the request (its submit, or a step while the request was in flight): the
    request ends unanswered. The message names the exception; the server answers it with HTTP 500."""


@dataclass
class LoopStats:
    """Counters kept by the engine thread."""

    requests_finished: int = 0
    """Requests that ended with their last token (stop token or max_tokens)."""
    requests_cancelled: int = 0
    """Requests dropped before their end (client gone, stop string)."""
    requests_failed: int = 0
    """Requests ended by the engine raising: its submit refused one, or a step failed every request in flight
    (each handler gets an EngineFailed naming the exception)."""
    tokens: int = 0
    """Tokens emitted."""
    loop_steps: int = 0
    """Engine steps run."""


class EngineLoop:
    def __init__(self, engine: Engine, report: Callable[[dict], None], report_every_s: float = 1.0):
        self.engine = engine
        self.stats = LoopStats()
        self.report, self.report_every_s = report, report_every_s
        self.step_started: float | None = None
        """When the engine step under way began (time.monotonic); None between steps."""
        self.published = self.snapshot()
        """The engine thread's latest snapshot, for the reporter (replaced whole, never changed in place)."""
        self.changed = threading.Event()
        """Set by the engine thread when a request entered or left: the reporter sends at once."""
        self.stopping = threading.Event()
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.tickets: dict[int, Ticket] = {}
        self.ids: dict[Ticket, int] = {}
        self.reporter = threading.Thread(target=self._report_loop, name="huginn-stats-reporter", daemon=True)
        self.reporter.start()
        self.thread = threading.Thread(target=self._run, name="huginn-engine-loop", daemon=True)
        self.thread.start()

    def submit(self, request: Request) -> Ticket:
        """Queue a checked request (from a coroutine); its tokens arrive on the ticket's queue."""
        ticket = Ticket(asyncio.get_running_loop())
        self.commands.put(("submit", ticket, request))
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Drop the request if it is still waiting or running (a no-op once it finished)."""
        self.commands.put(("cancel", ticket, None))

    def stop(self) -> None:
        self.commands.put(("stop", None, None))
        self.thread.join()
        self.stopping.set()
        self.changed.set()
        self.reporter.join()

    def snapshot(self) -> dict:
        """The engine's rows in flight, requests waiting and cache bytes reserved, and the loop's counters (the
        engine thread's call: it reads the engine)."""
        return {"rows_in_flight": self.engine.rows_in_flight, "requests_waiting": len(self.engine.waiting),
                "cache_bytes_reserved": self.engine.cache_bytes_reserved, **asdict(self.stats)}

    def _report_loop(self) -> None:
        while True:
            started = self.step_started
            self.report({**self.published,
                         "step_running_s": 0.0 if started is None else round(time.monotonic() - started, 3)})
            self.changed.wait(self.report_every_s)
            self.changed.clear()
            if self.stopping.is_set():
                return

    def _run(self) -> None:
        while True:
            commands = [] if self.engine.busy else [self.commands.get()]
            while True:
                try:
                    commands.append(self.commands.get_nowait())
                except queue.Empty:
                    break
            entered_or_left = False
            for kind, ticket, request in commands:
                if kind == "stop":
                    return
                if kind == "submit":
                    entered_or_left |= self._submit(ticket, request)
                elif ticket in self.ids and self.engine.cancel(self.ids[ticket]):
                    del self.tickets[self.ids.pop(ticket)]
                    self.stats.requests_cancelled += 1
                    entered_or_left = True
            if self.engine.busy:
                self.step_started = time.monotonic()
                entered_or_left |= self._step()
                self.step_started = None
            self.published = self.snapshot()
            if entered_or_left:
                self.changed.set()

    def _submit(self, ticket: Ticket, request: Request) -> bool:
        """Whether the request entered the engine or failed (either changes the reported counts)."""
        try:
            request_id = self.engine.submit(request)
        except Exception as err:  # the handler checked the request: an engine that refuses it has failed
            logger.exception("the engine refused a request the handler had checked")
            self._deliver(ticket, EngineFailed(f"the engine refused the request: {type(err).__name__}: {err}"))
            self.stats.requests_failed += 1
            return True
        self.tickets[request_id], self.ids[ticket] = ticket, request_id
        return True

    def _step(self) -> bool:
        """Whether a request left the engine (finished, or failed with the step)."""
        try:
            events = self.engine.step()
        except Exception as err:
            logger.exception("the engine's step failed; failing every request in flight")
            failure = EngineFailed(f"the engine's step failed: {type(err).__name__}: {err}")
            for request_id, ticket in list(self.tickets.items()):
                self.engine.cancel(request_id)
                self._deliver(ticket, failure)
            self.stats.requests_failed += len(self.tickets)
            self.tickets.clear()
            self.ids.clear()
            return True
        self.stats.loop_steps += 1
        left = False
        for event in events:
            self.stats.tokens += 1
            ticket = self.tickets[event.request_id]
            self._deliver(ticket, event)
            if event.finished:
                del self.tickets[event.request_id], self.ids[ticket]
                self.stats.requests_finished += 1
                left = True
        return left

    @staticmethod
    def _deliver(ticket: Ticket, item: TokenEvent | EngineFailed) -> None:
        try:
            ticket.loop.call_soon_threadsafe(ticket.events.put_nowait, item)
        except RuntimeError:  # the handler's event loop is closed: nobody is listening
            pass

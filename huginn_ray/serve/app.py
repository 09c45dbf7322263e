"""The Ray Serve application: an OpenAI-compatible HTTP API in front of one continuous-depth-batching engine per
replica.

    app = build_app(ServeSettings(model_dir=..., tokenizer_dir=..., ..., engine=EngineConfig(...)), replicas=2)
    serve.run(app, route_prefix="/")                   # jobs/serve.py does this

Routes (each answered 401 without `Authorization: Bearer <key>` when the server has an API key): POST
/v1/completions, POST /v1/chat/completions (streamed as server-sent events with "stream": true,
ending with `data: [DONE]`), GET /v1/models, GET /stats (the live replicas' engines by replica, and their sums;
503 while the stats board restarts).
Each replica loads the model once and owns one Engine, driven by one thread (engine_loop.py); every request a
replica takes joins that engine's batch at the next loop step, and its response names that replica in the
`Huginn-Replica` header. A refused request gets HTTP 400 with OpenAI's error object naming the field
(protocol.py); a request the engine fails (a step that raised while it was in flight) gets HTTP 500 naming the
exception, or, streamed, an error event before `data: [DONE]`; a client that disconnects has its request
cancelled (Ray Serve cancels the handler, whose `finally` cancels the engine request), which frees its row and
cache.

The replicas' stats meet in `StatsBoard`, one actor per deployment that Serve starts before the replicas and
stops with the deployment: each replica's engine loop reports its snapshot there (EngineLoop: when a request
enters or leaves its engine, else every second, idle or not), so any replica answers GET /stats for all the
live ones; the board leaves out a replica that has not reported for `SILENT_AFTER_S`. Serve starts a new board
when the board's process dies; a replica then takes a handle to the new one (`BoardLink`), its next reports
fill it, and GET /stats answers 503 while there is none.
"""

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ray
from fastapi import FastAPI
from fastapi import Request as HttpRequest  # FastAPI resolves handler annotations: no postponed ones here
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import DeploymentActorConfig

from huginn_ray.generation.engine import EngineConfig
from huginn_ray.serve.access import authorized
from huginn_ray.serve.engine_loop import EngineFailed, EngineLoop
from huginn_ray.serve.protocol import ApiError, Call, Tokens, choice, envelope, error_body, now, read_chat, \
    read_completion, response_id, usage


@dataclass(frozen=True)
class ServeSettings:
    """What every replica needs to start (the driver's plan for the replicas)."""

    model_dir: str
    """The model directory (config.json + weights): an absolute path, or a bucket URI that each replica reads from
    its node's copy (huginn_ray.model_cache)."""
    tokenizer_dir: str | None
    """The directory holding tokenizer.json: an absolute path or a bucket URI; None: the one stored with the model
    in a bucket (each replica finds it in its copy: huginn_ray.model.export.find_tokenizer)."""
    model_name: str
    """The name the API reports (`model` of the responses, GET /v1/models)."""
    device: str
    """cpu or cuda (each GPU replica sees the one GPU Ray gave it as cuda)."""
    dtype: str
    """float32 or bfloat16: the weights' dtype."""
    engine: EngineConfig
    """Each replica's engine capacities (rows, key/value bytes, exit wait, admission), checked by EngineConfig when
    the driver plans them, before Ray starts."""
    api_key: str | None = None
    """Every request must carry `Authorization: Bearer <api_key>` (else 401); None: no key asked."""


SILENT_AFTER_S = 5.0
"""A replica whose last report is older than this (five of its engine loop's report intervals) is taken for dead."""


LONGEST = ("step_running_s",)
"""Report fields that are durations, not counters: their total is the longest, not the sum."""


class StatsBoard:
    """Each live replica's last report (EngineLoop.snapshot), by replica tag. Serve runs it as the deployment's
    actor "stats" (build_app).

    Why reports stamped on arrival rather than asking Serve which replicas run: the engine loop already reports
    to this board and, idle, busy or inside a long step, does so every second, so its silence is the one sign
    that covers every way a replica's process ends (killed, node lost) with no call to Serve's controller, whose
    public status (serve.status) counts replicas by state but does not name them; an engine thread stuck in a
    step shows as its report's growing `step_running_s`. A replica that stops cleanly
    says so (`forget`) and leaves at once; one that dies leaves once it has been silent for `silent_after_s`. The
    clock is monotonic: the arrival times are this actor's own."""

    def __init__(self, silent_after_s: float = SILENT_AFTER_S, clock: Callable[[], float] = time.monotonic):
        self.silent_after_s, self.clock = silent_after_s, clock
        self.replicas: dict[str, tuple[float, dict]] = {}
        """Replica tag -> (arrival time of its last report, the report)."""

    def report(self, replica: str, snapshot: dict) -> None:
        self.replicas[replica] = (self.clock(), snapshot)

    def forget(self, replica: str) -> None:
        self.replicas.pop(replica, None)

    def stats(self) -> dict:
        """{"replicas": {tag: snapshot}, "total": each counter summed over them} over the replicas heard from in
        the last `silent_after_s` (GET /stats); the silent ones are dropped."""
        now = self.clock()
        for replica in [replica for replica, (at, _) in self.replicas.items() if now - at > self.silent_after_s]:
            del self.replicas[replica]
        live = {replica: snapshot for replica, (_, snapshot) in sorted(self.replicas.items())}
        total = {key: (max if key in LONGEST else sum)(snapshot[key] for snapshot in live.values())
                 for key in next(iter(live.values()), {})}
        return {"replicas": live, "total": total}


class BoardLink:
    """A replica's handle to the deployment's StatsBoard, taken again when the board it holds has died.

    Serve 2.60 health-checks a deployment actor and, when its process has died, starts a new one under the same
    name (ray.serve.config.DeploymentActorConfig); a handle taken before keeps pointing at the dead one, and
    `serve.get_deployment_actor` raises ValueError until the new one is registered. So on a call that finds the
    actor dead the link looks the board up again; with none there yet it holds none and looks again at the next
    call. `report` runs on the engine thread, `stats` and `forget` on the handlers' event loop: each only swaps
    the handle, a single assignment."""

    def __init__(self, replica: str, find_board: Callable[[], "ray.actor.ActorHandle"]):
        self.replica, self.find_board = replica, find_board
        self.board = find_board()  # Serve starts the board before the replicas
        self.last_report: ray.ObjectRef | None = None

    def report(self, snapshot: dict) -> None:
        """Send the snapshot without waiting for it; when the previous one found the board dead, to a new board."""
        if self.board is None or (self.last_report is not None and _found_actor_dead(self.last_report)):
            self.board = self._find_board_or_none()
        self.last_report = None if self.board is None else self.board.report.remote(self.replica, snapshot)

    def forget(self) -> None:
        if self.board is not None:
            self.board.forget.remote(self.replica)

    async def stats(self) -> dict | None:
        """The board's stats (StatsBoard.stats), asking a new board once if the held one has died; None while
        Serve has no board running."""
        for _ in range(2):
            if self.board is None:
                self.board = self._find_board_or_none()
                if self.board is None:
                    return None
            try:
                return await self.board.stats.remote()
            except RayActorError:  # ActorDiedError and ActorUnavailableError are RayActorErrors
                self.board = None
        return None

    def _find_board_or_none(self):
        try:
            return self.find_board()
        except ValueError:  # Serve has not registered the new board yet
            return None


def _found_actor_dead(ref: "ray.ObjectRef") -> bool:
    """Whether a call that has ended failed because its actor had died (False while it is still under way)."""
    if not ray.wait([ref], timeout=0)[0]:
        return False
    try:
        ray.get(ref)
    except RayActorError:
        return True
    return False


api = FastAPI(title="huginn_ray")


@serve.deployment
@serve.ingress(api)
class HuginnServer:
    def __init__(self, settings: ServeSettings):
        from tokenizers import Tokenizer

        from huginn_ray.data.chat import END_TURN
        from huginn_ray.data.tokenizer import special_token_ids
        from huginn_ray.generation.engine import Engine
        from huginn_ray.model.export import find_tokenizer
        from huginn_ray.model.inference import inference_placement, load_for_inference
        from huginn_ray.model_cache import local_dir, local_model_dir

        self.settings = settings
        self.replica = serve.get_replica_context().replica_tag
        self.headers = {"Huginn-Replica": self.replica}
        self.board = BoardLink(self.replica, lambda: serve.get_deployment_actor("stats"))
        model_dir = local_model_dir(settings.model_dir)
        self.model, _ = load_for_inference(model_dir, inference_placement(settings.device, settings.dtype))
        tokenizer_dir = local_dir(settings.tokenizer_dir, "--tokenizer") if settings.tokenizer_dir \
            else find_tokenizer(model_dir)
        tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        special = special_token_ids(tokenizer_dir)
        self.tokens = Tokens(tokenizer, special["bos"], special["eos"], tokenizer.token_to_id(END_TURN))
        self.engine = Engine(self.model, settings.engine)
        self.loop = EngineLoop(self.engine, self.board.report)

    def __del__(self):
        if hasattr(self, "loop"):
            self.loop.stop()
            self.board.forget()  # a clean stop leaves /stats at once, not after SILENT_AFTER_S

    @api.post("/v1/completions")
    async def completions(self, http: HttpRequest):
        refused = self._unauthorized(http)
        return refused if refused is not None else await self._answer(http, read_completion)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, http: HttpRequest):
        refused = self._unauthorized(http)
        return refused if refused is not None else await self._answer(http, read_chat)

    @api.get("/v1/models")
    async def models(self, http: HttpRequest):
        if (refused := self._unauthorized(http)) is not None:
            return refused
        return {"object": "list", "data": [{"id": self.settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "huginn_ray"}]}

    @api.get("/stats")
    async def stats(self, http: HttpRequest):
        if (refused := self._unauthorized(http)) is not None:
            return refused
        served = await self.board.stats()
        if served is None:
            return JSONResponse(error_body("the stats board is restarting (Serve starts a new one after the old one "
                                           "died); try again in a few seconds", "service_unavailable"),
                                status_code=503, headers=self.headers)
        return served

    def _unauthorized(self, http: HttpRequest) -> JSONResponse | None:
        """401 unless the request carries `Authorization: Bearer <the server's key>` (None: it does, or the server
        has no key; access.py)."""
        if authorized(http.headers.get("authorization"), self.settings.api_key):
            return None
        return JSONResponse(error_body("a valid API key is required: send `Authorization: Bearer <key>`",
                                       "invalid_request_error", code="invalid_api_key"),
                            status_code=401, headers={**self.headers, "WWW-Authenticate": "Bearer"})

    async def _answer(self, http: HttpRequest, read):
        try:
            try:
                body = await http.json()
            except ValueError as err:
                raise ApiError(f"the body is not JSON: {err}", None) from None
            call = read(body, self.tokens, self.model.config)
            need = self.engine.reservation(call.request)  # a pure function of the request and the model
            capacity = self.settings.engine.max_cache_bytes
            if need > capacity:
                raise ApiError(f"the request's key/value cache ({need:,} bytes for its prompt and max_tokens) exceeds "
                               f"this server's capacity of {capacity:,} bytes", "max_tokens")
        except ApiError as err:
            return JSONResponse(err.body(), status_code=400, headers=self.headers)
        response, created = response_id(call.kind), now()
        if call.stream:
            return StreamingResponse(self._chunks(call, response, created), media_type="text/event-stream",
                                     headers=self.headers)
        text, finish_reason, token_ids, iterations = "", None, [], []
        try:
            async for piece, finish_reason, ids, steps in self._pieces(call):
                text, token_ids, iterations = text + piece, token_ids + ids, iterations + steps
        except EngineFailed as err:
            return JSONResponse(error_body(str(err), "internal_server_error"), status_code=500, headers=self.headers)
        body = envelope(call, response, self.settings.model_name, created,
                        [choice(call, text, finish_reason, token_ids, iterations, chunk=False)], chunk=False)
        body["usage"] = usage(len(call.request.prompt), len(token_ids), sum(iterations))
        return JSONResponse(body, headers=self.headers)

    async def _chunks(self, call: Call, response: str, created: int):
        """Server-sent events: one chunk per piece of text, the finish reason in the last, then the usage when
        stream_options.include_usage asks for it, then [DONE]. A request the engine fails ends with an error event
        (OpenAI's error object, as vLLM streams it) and [DONE]: the status line (200) has gone out already."""
        first, completion_tokens, core_iterations = True, 0, 0
        try:
            async for piece, finish_reason, ids, steps in self._pieces(call):
                completion_tokens, core_iterations = completion_tokens + len(ids), core_iterations + sum(steps)
                if not piece and finish_reason is None and not call.return_token_ids:
                    continue
                chunk = envelope(call, response, self.settings.model_name, created,
                                 [choice(call, piece, finish_reason, ids, steps, chunk=True, first=first)], chunk=True)
                first = False
                yield f"data: {json.dumps(chunk)}\n\n"
        except EngineFailed as err:
            yield f"data: {json.dumps(error_body(str(err), 'internal_server_error'))}\n\n"
            yield "data: [DONE]\n\n"
            return
        if call.include_usage:
            chunk = envelope(call, response, self.settings.model_name, created, [], chunk=True)
            chunk["usage"] = usage(len(call.request.prompt), completion_tokens, core_iterations)
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    async def _pieces(self, call: Call):
        """(text piece, finish reason or None, token ids, their core iterations) as the engine emits tokens, until
        the request ends; the request is cancelled in the engine if this ends first (client gone, stop string)."""
        from huginn_ray.serve.text import GeneratedText

        text = GeneratedText(self.tokens.tokenizer, call.stop_texts)
        ticket = self.loop.submit(call.request)
        try:
            while True:
                event = await ticket.events.get()
                if isinstance(event, EngineFailed):
                    raise event
                is_stop = event.finish_reason == "stop"
                piece = text.add(event.token_id, is_stop)
                if text.stopped:
                    yield piece, "stop", [event.token_id], [event.core_iterations]
                    return
                if event.finished:
                    yield piece + text.finish(), event.finish_reason, [event.token_id], [event.core_iterations]
                    return
                yield piece, None, [event.token_id], [event.core_iterations]
        finally:
            self.loop.cancel(ticket)  # a no-op when the request has finished


def build_app(settings: ServeSettings, replicas: int = 1):
    """The application: `replicas` copies of the server, each on one GPU (a CUDA device) or one CPU, and their
    StatsBoard (no CPU). A replica takes up to 2 x max_rows requests at once (its rows and as many waiting for
    one); Serve routes the rest to other replicas or queues them."""
    actor = {"num_gpus": 1, "num_cpus": 1} if settings.device == "cuda" else {"num_cpus": 1}
    deployment = HuginnServer.options(num_replicas=replicas, ray_actor_options=actor,
                                      max_ongoing_requests=2 * settings.engine.max_rows,
                                      deployment_actors=[DeploymentActorConfig(
                                          name="stats", actor_class=ray.remote(num_cpus=0)(StatsBoard))])
    return deployment.bind(settings)

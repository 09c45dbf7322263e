"""The Ray Serve application: an OpenAI-compatible HTTP API in front of one continuous-depth-batching engine per
replica.

    app = build_app(ServeSettings(model_dir=..., tokenizer_dir=..., ...), replicas=2)
    serve.run(app, route_prefix="/")                   # jobs/serve.py does this

Routes: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events with "stream": true,
ending with `data: [DONE]`), GET /v1/models, GET /stats (every replica's engine by replica, and their sums).
Each replica loads the model once and owns one Engine, driven by one thread (engine_loop.py); every request a
replica takes joins that engine's batch at the next loop step, and its response names that replica in the
`Huginn-Replica` header. A refused request gets HTTP 400 with OpenAI's error object naming the field
(protocol.py); a client that disconnects has its request cancelled (Ray Serve cancels the handler, whose
`finally` cancels the engine request), which frees its row and cache.

The replicas' stats meet in `StatsBoard`, one actor per deployment that Serve starts before the replicas and
stops with the deployment: each replica's engine loop reports its snapshot there (EngineLoop: when a request
enters or leaves its engine, else at most every second while it works), so any replica answers GET /stats for
all of them.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import ray
from fastapi import FastAPI
from fastapi import Request as HttpRequest  # FastAPI resolves handler annotations: no postponed ones here
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.config import DeploymentActorConfig

from huginn_ray.serve.protocol import ApiError, Call, Tokens, choice, envelope, now, read_chat, read_completion, \
    response_id, usage


@dataclass(frozen=True)
class ServeSettings:
    """What every replica needs to start (the driver's plan for the replicas)."""

    model_dir: str
    """Absolute path of the model directory (config.json + weights)."""
    tokenizer_dir: str
    """Absolute path of the directory holding tokenizer.json."""
    model_name: str
    """The name the API reports (`model` of the responses, GET /v1/models)."""
    device: str
    """cpu or cuda (each GPU replica sees the one GPU Ray gave it as cuda)."""
    dtype: str
    """float32 or bfloat16: the weights' dtype."""
    max_rows: int
    """Sequences each replica's engine advances at once (EngineConfig.max_rows)."""
    max_cache_bytes: int
    """Key/value bytes each replica's engine may reserve (EngineConfig.max_cache_bytes)."""


@ray.remote(num_cpus=0)
class StatsBoard:
    """Each replica's last report (EngineLoop.snapshot), by replica tag, until the replica stops."""

    def __init__(self):
        self.replicas: dict[str, dict] = {}

    def report(self, replica: str, snapshot: dict) -> None:
        self.replicas[replica] = snapshot

    def forget(self, replica: str) -> None:
        self.replicas.pop(replica, None)

    def stats(self) -> dict:
        """{"replicas": {tag: snapshot}, "total": each counter summed over the replicas} (GET /stats)."""
        total = {key: sum(snapshot[key] for snapshot in self.replicas.values())
                 for key in next(iter(self.replicas.values()), {})}
        return {"replicas": dict(sorted(self.replicas.items())), "total": total}


api = FastAPI(title="huginn_ray")


@serve.deployment
@serve.ingress(api)
class HuginnServer:
    def __init__(self, settings: ServeSettings):
        from tokenizers import Tokenizer

        from huginn_ray.data.chat import END_TURN
        from huginn_ray.data.tokenizer import special_token_ids
        from huginn_ray.model.engine import Engine, EngineConfig
        from huginn_ray.model.inference import inference_placement, load_for_inference
        from huginn_ray.serve.engine_loop import EngineLoop

        self.settings = settings
        self.replica = serve.get_replica_context().replica_tag
        self.headers = {"Huginn-Replica": self.replica}
        self.board = serve.get_deployment_actor("stats")
        self.model, _ = load_for_inference(settings.model_dir, inference_placement(settings.device, settings.dtype))
        tokenizer = Tokenizer.from_file(str(Path(settings.tokenizer_dir) / "tokenizer.json"))
        special = special_token_ids(settings.tokenizer_dir)
        self.tokens = Tokens(tokenizer, special["bos"], special["eos"], tokenizer.token_to_id(END_TURN))
        self.engine = Engine(self.model, EngineConfig(settings.max_rows, settings.max_cache_bytes))
        self.loop = EngineLoop(self.engine, lambda snapshot: self.board.report.remote(self.replica, snapshot))

    def __del__(self):
        if hasattr(self, "loop"):
            self.loop.stop()
            self.board.forget.remote(self.replica)

    @api.post("/v1/completions")
    async def completions(self, http: HttpRequest):
        return await self._answer(http, read_completion)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, http: HttpRequest):
        return await self._answer(http, read_chat)

    @api.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{"id": self.settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "huginn_ray"}]}

    @api.get("/stats")
    async def stats(self):
        return await self.board.stats.remote()

    async def _answer(self, http: HttpRequest, read):
        try:
            try:
                body = await http.json()
            except ValueError as err:
                raise ApiError(f"the body is not JSON: {err}", None) from None
            call = read(body, self.tokens, self.model.config)
            need = self.engine.reservation(call.request)  # a pure function of the request and the model
            if need > self.settings.max_cache_bytes:
                raise ApiError(f"the request's key/value cache ({need:,} bytes for its prompt and max_tokens) exceeds "
                               f"this server's capacity of {self.settings.max_cache_bytes:,} bytes", "max_tokens")
        except ApiError as err:
            return JSONResponse(err.body(), status_code=400, headers=self.headers)
        response, created = response_id(call.kind), now()
        if call.stream:
            return StreamingResponse(self._chunks(call, response, created), media_type="text/event-stream",
                                     headers=self.headers)
        text, finish_reason, token_ids, iterations = "", None, [], []
        async for piece, finish_reason, ids, steps in self._pieces(call):
            text, token_ids, iterations = text + piece, token_ids + ids, iterations + steps
        body = envelope(call, response, self.settings.model_name, created,
                        [choice(call, text, finish_reason, token_ids, iterations, chunk=False)], chunk=False)
        body["usage"] = usage(len(call.request.prompt), len(token_ids), sum(iterations))
        return JSONResponse(body, headers=self.headers)

    async def _chunks(self, call: Call, response: str, created: int):
        """Server-sent events: one chunk per piece of text, the finish reason in the last, then the usage when
        stream_options.include_usage asks for it, then [DONE]."""
        first, completion_tokens, core_iterations = True, 0, 0
        async for piece, finish_reason, ids, steps in self._pieces(call):
            completion_tokens, core_iterations = completion_tokens + len(ids), core_iterations + sum(steps)
            if not piece and finish_reason is None and not call.return_token_ids:
                continue
            chunk = envelope(call, response, self.settings.model_name, created,
                             [choice(call, piece, finish_reason, ids, steps, chunk=True, first=first)], chunk=True)
            first = False
            yield f"data: {json.dumps(chunk)}\n\n"
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
                if isinstance(event, Exception):
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
                                      max_ongoing_requests=2 * settings.max_rows,
                                      deployment_actors=[DeploymentActorConfig(name="stats", actor_class=StatsBoard)])
    return deployment.bind(settings)

"""The OpenAI-compatible request bodies, read into typed calls of the engine, and the responses' JSON.

    call = read_completion(body, tokens, model_config)     # POST /v1/completions
    call = read_chat(body, tokens, model_config)           # POST /v1/chat/completions
    call.request                                           # a checked huginn_ray.generation.requests.Request

A body that cannot be served raises `ApiError` naming the field (`param`), which the server answers with HTTP 400
and OpenAI's error object. Types and ranges of the fields the engine shares (max_tokens, temperature, top_p,
top_k, seed, num_steps, exit_criterion, exit_threshold, min_steps, check_every, exit_in_prefill, cache,
warm_start) are checked by the engine's own `Request.checked`, so both refuse the same values; this module
checks the fields only the API has (prompt, messages, stop, stream, ...).

Defaults follow OpenAI's where OpenAI has one: temperature 1, top_p 1, max_tokens 16 for completions and the
rest of the model's context for chat. `seed` defaults to 0: the initial latent state of every forward is noise
drawn from the request's own generator, so a request's output is a function of its fields, seed included.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from huginn_ray.model.config import ModelConfig
from huginn_ray.generation.requests import Request

ENGINE_FIELDS = {
    # API field -> Request field
    "max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
    "seed": "seed", "num_steps": "num_steps", "exit_criterion": "exit_criterion",
    "exit_threshold": "exit_threshold", "min_steps": "min_steps", "check_every": "check_every",
    "exit_in_prefill": "exit_in_prefill", "cache": "cache", "warm_start": "warm_start",
}
NEUTRAL_FIELDS = {
    # OpenAI fields accepted at the one value this server implements
    "n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "presence_penalty": 0,
    "frequency_penalty": 0, "logit_bias": None, "suffix": None,
}
API_FIELDS = {"model", "stream", "stream_options", "stop", "user", "return_token_ids"}
"""`return_token_ids` (vLLM's name): each choice also carries the generated `token_ids` and the `core_iterations`
of each token."""
CHAT_ONLY = {"messages", "max_completion_tokens"}
COMPLETION_ONLY = {"prompt", "echo", "best_of", "suffix"}


class ApiError(ValueError):
    """A request the server refuses (HTTP 400); `param` names the field."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param

    def body(self) -> dict:
        return error_body(str(self), "invalid_request_error", self.param)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object (the body of every non-200 answer, and a stream's error event)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class Tokens:
    """What the API needs of the tokenizer: text in and out, and the special tokens that start and stop."""

    tokenizer: object
    """A tokenizers.Tokenizer."""
    bos: int
    """<|begin_text|>: put before a completion's text prompt."""
    eos: int
    """<|end_text|>: a completion stops after it."""
    end_turn: int | None
    """<|end_turn|>: a chat reply stops after it (None: the tokenizer has no chat tokens)."""


@dataclass(frozen=True)
class Call:
    """One request read from its body: what the engine generates and how the answer is shaped."""

    kind: str
    """"completion" or "chat"."""
    request: Request
    """The engine's request, checked against the model (prompt ids, depth, sampling, seed, stop token)."""
    stop_texts: tuple[str, ...]
    """`stop` strings: the text ends before the first of them."""
    stream: bool
    """Answer as server-sent events, one chunk per piece of text."""
    include_usage: bool
    """stream_options.include_usage: a last chunk carries the usage."""
    return_token_ids: bool
    """Each choice also carries token_ids and core_iterations."""


def read_completion(body, tokens: Tokens, config: ModelConfig) -> Call:
    fields = _fields(body, allowed=API_FIELDS | set(ENGINE_FIELDS) | set(NEUTRAL_FIELDS) | COMPLETION_ONLY)
    if "prompt" not in fields:
        raise ApiError("prompt is required", "prompt")
    prompt = fields["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt (lm-eval's local-completions sends [[ids]])
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("prompt must not be empty", "prompt")
        ids = [tokens.bos] + tokens.tokenizer.encode(prompt, add_special_tokens=False).ids
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt  # token ids, taken as they are
    else:
        raise ApiError(f"prompt must be a non-empty string or a non-empty list of token ids (one prompt per "
                       f"request), got {_short(prompt)}", "prompt")
    return _call("completion", fields, ids, "prompt", fields.get("max_tokens", 16), tokens.eos, config)


def read_chat(body, tokens: Tokens, config: ModelConfig) -> Call:
    from huginn_ray.data.chat import render

    fields = _fields(body, allowed=API_FIELDS | set(ENGINE_FIELDS) | set(NEUTRAL_FIELDS) | CHAT_ONLY)
    if tokens.end_turn is None:
        raise ApiError("this model's tokenizer has no chat tokens (<|end_turn|>): use /v1/completions", "messages")
    if "messages" not in fields:
        raise ApiError("messages is required", "messages")
    try:
        ids, _ = render(fields["messages"], tokens.tokenizer, add_generation_prompt=True)
    except ValueError as err:
        raise ApiError(f"messages: {err}", "messages") from None
    if "max_tokens" in fields and "max_completion_tokens" in fields:
        raise ApiError("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    max_tokens = fields.get("max_completion_tokens", fields.get("max_tokens"))
    if max_tokens is None:
        max_tokens = max(config.block_size - len(ids), 1)  # the rest of the context (refused below when none)
    return _call("chat", fields, ids, "messages", max_tokens, tokens.end_turn, config)


def _fields(body, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise ApiError(f"the body must be a JSON object, got {_short(body)}", None)
    for name in body:
        if name not in allowed:
            raise ApiError(f"unknown field {name!r}", name)
    for name, neutral in NEUTRAL_FIELDS.items():
        if name in body and body[name] not in (neutral, None) and not (name == "logit_bias" and body[name] == {}):
            raise ApiError(f"{name} = {_short(body[name])} is not supported (only {neutral!r})", name)
    return {name: value for name, value in body.items() if value is not None}


def _call(kind: str, fields: dict, ids: list[int], prompt_param: str, max_tokens, stop_token: int,
          config: ModelConfig) -> Call:
    for name in ("stream", "return_token_ids"):
        if not isinstance(fields.get(name, False), bool):
            raise ApiError(f"{name} must be true or false, got {_short(fields[name])}", name)
    if "user" in fields and not isinstance(fields["user"], str):
        raise ApiError(f"user must be a string, got {_short(fields['user'])}", "user")
    if "model" in fields and not isinstance(fields["model"], str):
        raise ApiError(f"model must be a string, got {_short(fields['model'])}", "model")
    options = fields.get("stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(
            options.get("include_usage", False), bool):
        raise ApiError(f"stream_options must be {{\"include_usage\": true|false}}, got {_short(options)}",
                       "stream_options")
    stop = fields.get("stop", ())
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(text, str) and text for text in stop):
        raise ApiError(f"stop must be a non-empty string or a list of them, got {_short(stop)}", "stop")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and len(ids) + max_tokens > config.block_size:
        raise ApiError(f"the prompt ({len(ids)} tokens) and max_tokens ({max_tokens}) exceed the model's context "
                       f"of {config.block_size} tokens", prompt_param if len(ids) >= config.block_size else
                       ("max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"))
    settings = {ENGINE_FIELDS[name]: fields[name] for name in ENGINE_FIELDS if name in fields}
    settings["max_new_tokens"] = max_tokens
    settings.setdefault("temperature", 1.0)
    if settings.get("top_p") == 1:
        settings["top_p"] = None  # the whole distribution: the same draws as no top-p at all
    request = Request(prompt=tuple(ids), stop_token_ids=(stop_token,), **settings)
    try:
        request = request.checked(config)
    except ValueError as err:
        raise ApiError(*_api_terms(str(err), prompt_param, fields)) from None
    return Call(kind, request, tuple(stop), bool(fields.get("stream", False)), options.get("include_usage", False),
                fields.get("return_token_ids", False))


def _api_terms(message: str, prompt_param: str, fields: dict) -> tuple[str, str]:
    """The engine's message about a Request field, in the API's terms: (message, param)."""
    api_names = {engine: api for api, engine in ENGINE_FIELDS.items()}
    if "max_completion_tokens" in fields:
        api_names["max_new_tokens"] = "max_completion_tokens"
    api_names["prompt"] = prompt_param
    named = [(message.find(engine), engine) for engine in api_names if engine in message]
    if not named:
        return message, None
    engine = min(named)[1]
    return message.replace(engine, api_names[engine]), api_names[engine]


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- responses ---------------------------------------------------------------------------------------------

def response_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, core_iterations: int) -> dict:
    """OpenAI's usage, plus the core iterations the request's forwards ran (its prefill's included)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "core_iterations": core_iterations}


def choice(call: Call, text: str, finish_reason: str | None, token_ids: list[int], iterations: list[int],
           chunk: bool, first: bool = False) -> dict:
    """One choice of a response (chunk=False) or of a streamed chunk's delta (chunk=True)."""
    if call.kind == "chat":
        if chunk:
            entry = {"index": 0, "delta": ({"role": "assistant", "content": text} if first else {"content": text})}
        else:
            entry = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        entry = {"index": 0, "text": text, "logprobs": None}
    entry["finish_reason"] = finish_reason
    if call.return_token_ids:
        entry["token_ids"], entry["core_iterations"] = token_ids, iterations
    return entry


def envelope(call: Call, response: str, model: str, created: int, choices: list[dict], chunk: bool) -> dict:
    kind = ("chat.completion" if call.kind == "chat" else "text_completion") + (
        ".chunk" if chunk and call.kind == "chat" else "")
    return {"id": response, "object": kind, "created": created, "model": model, "choices": choices}


def now() -> int:
    return int(time.time())

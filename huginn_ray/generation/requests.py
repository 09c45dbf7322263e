"""What a sequence to generate asks for (`Request`, checked field by field) and how its tokens are drawn (`pick`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from huginn_ray.generation.caches import parse_cache
from huginn_ray.generation.exits import DEFAULT_THRESHOLDS
from huginn_ray.model.config import ModelConfig


@dataclass(frozen=True)
class Request:
    """One sequence to generate: its prompt and how it is decoded (a row of `generate`, a request of the engine).
    `checked(config)` refuses a bad field with a ValueError naming it."""

    prompt: tuple[int, ...]
    """Token ids of the prompt (at least one)."""
    max_new_tokens: int
    """Tokens to generate at most (fewer when a stop token comes first)."""
    num_steps: int | None = None
    """Most core iterations per forward (None: the model's mean_recurrence); every iteration with no criterion."""
    exit_criterion: str | None = None
    """One of DEFAULT_THRESHOLDS, or None / "none" for a fixed depth."""
    exit_threshold: float | None = None
    """The criterion's threshold (None: its default; 0 turns exits off)."""
    min_steps: int = 0
    """Iterations before the first check."""
    check_every: int = 1
    """Check after every this many iterations."""
    exit_in_prefill: bool = True
    """Whether the prompt's forward may exit early (else it runs num_steps iterations)."""
    cache: str = "full"
    """Key/value cache strategy: full, latest or ring:N."""
    warm_start: bool = False
    """Start each generated token's latent state from the previous token's final state instead of noise."""
    temperature: float = 0.0
    """0: greedy; else sample from softmax(logits / temperature)."""
    top_k: int | None = None
    """Sample among the k most probable tokens only."""
    top_p: float | None = None
    """Sample among the most probable tokens whose probability reaches top_p only (0 < top_p <= 1)."""
    seed: int = 0
    """Seeds the request's own generator (initial noise and sampling): its output does not depend on its batch."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends after emitting any of these."""

    def checked(self, config: ModelConfig) -> "Request":
        """This request with num_steps and exit_threshold resolved; ValueError naming the first bad field."""
        def integer(name: str, minimum: int, value=None) -> None:
            value = getattr(self, name) if value is None else value
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")

        def number(name: str, low: float, high: float = math.inf, low_open: bool = False) -> None:
            value = getattr(self, name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                    or value < low or (low_open and value == low) or value > high):
                bounds = f"{'>' if low_open else '>='} {low}" + ("" if high == math.inf else f" and <= {high}")
                raise ValueError(f"{name} must be a number {bounds}, got {value!r}")

        if not isinstance(self.prompt, (tuple, list)) or not self.prompt:
            raise ValueError(f"prompt must be a non-empty sequence of token ids, got {self.prompt!r}")
        for position, token in enumerate(self.prompt):
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < config.vocab_size:
                raise ValueError(f"prompt[{position}] = {token!r} is not a token id in [0, {config.vocab_size})")
        integer("max_new_tokens", 1)
        if len(self.prompt) + self.max_new_tokens > config.block_size:
            raise ValueError(f"prompt length {len(self.prompt)} + max_new_tokens {self.max_new_tokens} exceeds "
                             f"block_size={config.block_size}")
        num_steps = config.mean_recurrence if self.num_steps is None else self.num_steps
        integer("num_steps", 1, num_steps)
        criterion = None if self.exit_criterion in (None, "none") else self.exit_criterion
        if criterion is not None and criterion not in DEFAULT_THRESHOLDS:
            raise ValueError(f"unknown exit criterion {criterion!r} (exit_criterion); known: "
                             f"{', '.join(DEFAULT_THRESHOLDS)}, none")
        threshold = None
        if criterion is not None:
            if self.exit_threshold is not None:
                number("exit_threshold", 0)
            threshold = DEFAULT_THRESHOLDS[criterion] if self.exit_threshold is None else self.exit_threshold
        integer("min_steps", 0)
        integer("check_every", 1)
        for name in ("exit_in_prefill", "warm_start"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.cache, str):
            raise ValueError(f"cache must be 'full', 'latest' or 'ring:N' with N >= 1, got {self.cache!r}")
        parse_cache(self.cache)
        number("temperature", 0)
        if self.top_k is not None:
            integer("top_k", 1)
        if self.top_p is not None:
            number("top_p", 0, 1, low_open=True)
        integer("seed", 0)
        if self.seed >= 2**64:  # a torch generator takes 64 bits: the step that draws from it would raise
            raise ValueError(f"seed must be below 2**64, got {self.seed!r}")
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}")
        for token in self.stop_token_ids:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < config.vocab_size:
                raise ValueError(f"stop_token_ids holds {token!r}, not a token id in [0, {config.vocab_size})")
        return Request(**{**self.__dict__, "prompt": tuple(self.prompt), "num_steps": num_steps,
                          "exit_criterion": criterion, "exit_threshold": threshold,
                          "stop_token_ids": tuple(self.stop_token_ids)})


def pick(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None,
         top_p: float | None = None) -> Tensor:
    """The next token of each row of `logits` (rows, V): greedy when temperature == 0; else a draw from
    softmax(logits / temperature) restricted to the top_k tokens, then to the smallest set of most probable tokens
    whose probability reaches top_p."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        threshold = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probs = logits.softmax(dim=-1)
    if top_p is not None and top_p < 1:
        ordered, order = probs.sort(dim=-1, descending=True)
        outside = ordered.cumsum(dim=-1) - ordered >= top_p  # the tokens before it already reach top_p
        probs = probs.scatter(-1, order, ordered.masked_fill(outside, 0.0))
    return torch.multinomial(probs, 1, generator=generator)[:, 0]

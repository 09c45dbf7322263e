"""Admission into the engine's slots: a request's prompt prefill, its first token, and everything its decoding
will need from the host, so that the decode steps (huginn_ray.generation.decode_step) need nothing more.

`prefill` runs the admitted prompts' forwards eagerly through the generator's own batched step
(huginn_ray.generation.stepping: each prompt at its own length, each exiting on its own criterion) until each has
emitted its first token and begun its second forward (prelude, initial state). `draw_ahead` then takes every
random number the request's later tokens draw, from its own generator in the order batch-1 `generate` takes
them (per token: the exponential draw of its sample when it samples, then its next forward's initial noise when
that is noise), and `load` moves the request into a slot: its keys/values, depths, state, settings and
criterion comparands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from huginn_ray.generation.caches import NOT_YET, parse_cache
from huginn_ray.generation.exits import ENTROPY_START
from huginn_ray.generation.requests import Request
from huginn_ray.generation.slots import CRITERION_CODES, Slots
from huginn_ray.generation.stepping import Sequence, finish, iterate_pool, start
from huginn_ray.model.model import RecurrentGPT
from huginn_ray.model.noise import TRUNC_NORMAL_UNIFORM


@dataclass
class Draws:
    """The random numbers of a request's tokens 2..max_new_tokens, index t - 2 for token t."""

    exponential: Tensor | None
    """(max_new_tokens - 1, V) fp32: what `torch.multinomial` draws for each sampled token (None: greedy)."""
    uniform: Tensor | None
    """(max_new_tokens - 1, D): each next forward's initial noise, uniform on TRUNC_NORMAL_UNIFORM (None: warm
    start or zero initial state)."""


def prefill(model: RecurrentGPT, sequences: list[Sequence]) -> list[tuple[Sequence, int]]:
    """The prompts' forwards, batched, until each has emitted its first token (and, unless that ended it,
    begun its next forward). Returns (sequence, first token id) in the order they ended."""
    start(model, sequences)
    emitted, going = [], list(sequences)
    while going:
        ended = iterate_pool(model, going)
        emitted += finish(model, ended)
        going = [sequence for sequence in going if not sequence.steps]
    return emitted


def draw_ahead(model: RecurrentGPT, request: Request, generator: torch.Generator, dtype: torch.dtype) -> Draws:
    """Every draw of the request's tokens after its first, in batch-1 generation's order (module docstring)."""
    cfg, device, later = model.config, model.freqs_cis.device, request.max_new_tokens - 1
    noise = not request.warm_start and cfg.state_init != "zero"
    exponential = uniform = None
    if request.temperature > 0:
        exponential = torch.empty(max(later, 1), cfg.vocab_size, device=device)
    if noise:
        uniform = torch.zeros(max(later, 1), cfg.n_embd, device=device, dtype=dtype)
    for index in range(later):
        if exponential is not None:  # what torch.multinomial(probs, 1) draws: one exponential per token id
            exponential[index : index + 1].exponential_(1, generator=generator)
        if noise and index + 1 < later:  # the next forward's noise, unless this token is the last
            uniform[index : index + 1].uniform_(*TRUNC_NORMAL_UNIFORM, generator=generator)
    return Draws(exponential, uniform)


def load(slots: Slots, slot: int, sequence: Sequence, model: RecurrentGPT) -> None:
    """Move a prefilled sequence (its second forward begun) into `slot`: its keys/values and depths from the
    prefill's CachePool, its forward's state, its settings and its fresh criterion's comparands."""
    request, cache, cfg = sequence.request, slots.cache, model.config
    pool, source, length = sequence.cache.pool, sequence.cache.slot, sequence.cache.length
    ring = parse_cache(request.cache)
    kept = request.num_steps if ring is None else min(ring, request.num_steps)
    cache.fit(length + request.max_new_tokens - 1, kept)
    slots.fit_stop(len(request.stop_token_ids))
    table, D = pool.table[source], cfg.n_embd
    heads = (cache.heads, cache.head_dim)

    def copy(block: int, key: int, positions: int, plane: int | None = None) -> None:
        entries = pool.entries.index_select(0, table[key, :positions])
        where = (slot, slice(0, positions)) + (() if plane is None else (plane,))
        cache.keys[block][where] = entries[:, :D].view(positions, *heads)
        cache.values[block][where] = entries[:, D:].view(positions, *heads)

    P, C, L = cache.prelude, cache.coda, cache.core
    for block in range(P):  # the new forward's position has its prelude's keys/values too
        copy(block, block, length + 1)
    for block in range(C):
        copy(P + block, P + block, length)
    for j in range(L):
        for plane in range(kept):
            copy(P + C + j, P + C + L * plane + j, length, plane)
        if request.cache != "full":
            copy(P + C + j, P + C + L * kept + j, length, cache.planes)
    cache.depths[slot] = NOT_YET
    cache.depths[slot, :length] = pool.depths[source, :length]
    settings(slots, slot, request, kept, length, model)
    slots.state[slot] = pool.states[source]
    slots.injected[slot] = pool.injected[source]
    slots.previous_state[slot, 0] = pool.states[source].float()


def settings(slots: Slots, slot: int, request: Request, kept: int, position: int, model: RecurrentGPT) -> None:
    """The slot's per-request buffers for a request whose second forward begins at `position`."""
    V = model.config.vocab_size
    values = dict(position=position, iteration=0, emitted=1, active=True, exited=False,
                  num_steps=request.num_steps, kept=kept, max_new=request.max_new_tokens,
                  full=request.cache == "full", warm=request.warm_start,
                  criterion=CRITERION_CODES.get(request.exit_criterion, 0),
                  threshold=request.exit_threshold or 0.0, min_steps=request.min_steps,
                  check_every=request.check_every, temperature=request.temperature,
                  top_k=min(request.top_k or V, V), top_p=1.0 if request.top_p is None else request.top_p,
                  previous_entropy=ENTROPY_START, previous_argmax=-1, stable=0)
    for name, value in values.items():
        getattr(slots, name)[slot] = value
    slots.previous_logp[slot] = -math.log(V)
    slots.stop[slot] = -1
    slots.stop[slot, : len(request.stop_token_ids)] = torch.tensor(request.stop_token_ids, dtype=torch.long)


def refill(slots: Slots, slot: int, draws: Draws, token: int) -> None:
    """The slot's draws for its next finish, that of token `token` (2-based: the first decoded token is 2)."""
    if draws.exponential is not None:
        slots.next_exponential[slot] = draws.exponential[token - 2]
    if draws.uniform is not None:
        slots.next_uniform[slot] = draws.uniform[token - 2]

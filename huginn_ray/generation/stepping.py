"""How sequences advance, batched: the loop step of `generate` (the reference) and of the engine's prompt prefill
(huginn_ray.generation.admission; the engine decodes with huginn_ray.generation.decode_step).

Every sequence is a `Sequence` with its own slot of a `CachePool` (keys/values; a decoding forward's latent state),
random generator and forward in progress. `advance` runs one loop step: `iterate_pool`, a batched core iteration
over every sequence in the pool, each at its own position and iteration (`RowBatch`: one gather and one indexed
store per block, whatever the rows' positions; one call for the decoding sequences, one for those in their
prompt's prefill), then the exit criteria of the sequences that check after it, then `finish` of the sequences
whose forwards ended (their criterion, or their maximum depth): they run the coda and head, emit a token and
start their next token's forward (prelude, initial state), which joins the next loop step: one coda call and one
prelude call over one `Rows` (the index tensors built once for both). So no row waits
for another (the release iterates exited rows until the whole batch exits), and each row gets what it gets alone
at batch size 1 from the same initial noise and sampling draws, up to the rounding of batched matmuls.

The model is driven through its stages (RecurrentGPT.embed_and_prelude, inject, initial noise by
noise_from_uniform, core_step, coda_and_head).
"""

from __future__ import annotations

import torch
from torch import Tensor

from huginn_ray.generation.caches import CachePool, RowBatch, Rows
from huginn_ray.generation.exits import LOGIT_CRITERIA, ExitCriterion, is_check
from huginn_ray.generation.requests import Request, pick
from huginn_ray.model.config import ModelConfig
from huginn_ray.model.flops import inference_flops_per_token
from huginn_ray.model.model import RecurrentGPT
from huginn_ray.model.noise import TRUNC_NORMAL_UNIFORM


class Sequence:
    """One request in flight: its cache, its random generator, its tokens so far and the forward it iterates.

    The forward in progress: `ids` (its positions' tokens), `injected` (the adapter's half for e), `state`
    (1, positions, D), `iteration` (core iterations done) and `criterion`. `advance` moves it on."""

    def __init__(self, request: Request, generator: torch.Generator | None, caches: CachePool,
                 config: ModelConfig, input_states: Tensor | None = None, force_tokens: Tensor | None = None,
                 keep_states: bool = False):
        """`request` must be checked (Request.checked). `generator` draws the initial noise and the samples
        (None: torch's global one). Its cache is a slot of `caches` (release it with `cache.release()` when the
        pool outlives the sequence). `input_states` (1, prompt, D) replaces the prefill's noise; `force_tokens`
        (max_new_tokens,) are emitted instead of picked; `keep_states` records each forward's first and last
        latent state of the last position (huginn_ray.generation.generate.GenerationResult)."""
        self.request, self.generator, self.force_tokens = request, generator, force_tokens
        self.input_states, self.keep_states = input_states, keep_states
        self.cache = caches.allocate(config, len(request.prompt) + request.max_new_tokens - 1, request.cache,
                                     request.num_steps)
        self.ids = torch.tensor(request.prompt, device=caches.device)
        """The prompt's ids while its prefill runs; None after (a decoding forward's id is tokens[-1])."""
        self.length = len(request.prompt)
        """Positions of the forward in progress."""
        self.tokens: list[int] = list(request.prompt)
        self.steps: list[int] = []
        self.logprobs: list[float] = []
        self.flops: list[float] = []
        self.initial_states: list[Tensor] = []
        self.final_states: list[Tensor] = []
        self.finish_reason: str | None = None
        """None while generating; "stop" after a stop token, "length" after max_new_tokens."""
        self.exit_logits: Tensor | None = None
        """(1, V) logits of the forward's final state when it ended at a logit check (`iterate_pool`), until
        `finish` emits its token."""

    # A decoding forward's (one position) state and injected half live in its slot of the pool (CachePool.states,
    # .injected), so that a batched step reads and writes them with one gather and one store; a prefill's here.
    @property
    def state(self) -> Tensor:
        """(1, positions, D) latent state of the forward in progress."""
        return self.cache.pool.states[self.cache.slot].view(1, 1, -1) if self.length == 1 else self._state

    @state.setter
    def state(self, value: Tensor) -> None:
        if self.length == 1:
            self.cache.pool.states[self.cache.slot] = value[0, 0]
        else:
            self._state = value

    @property
    def injected(self) -> Tensor:
        """(1, positions, D) the adapter's half for e of the forward in progress."""
        return self.cache.pool.injected[self.cache.slot].view(1, 1, -1) if self.length == 1 else self._injected

    @injected.setter
    def injected(self, value: Tensor) -> None:
        if self.length == 1:
            self.cache.pool.injected[self.cache.slot] = value[0, 0]
        else:
            self._injected = value

    def given_initial_state(self) -> Tensor | None:
        """The next forward's initial state, (1, positions, D), when it is not noise: the prefill's
        `input_states`, or the previous token's final state (warm start); None when it is noise drawn from the
        sequence's generator (`start`)."""
        prefill = not self.steps
        if prefill and self.input_states is not None:
            return self.input_states
        if not prefill and self.request.warm_start:
            return self.last_final_state[:, None]
        return None

    def begin(self, model: RecurrentGPT, initial: Tensor, row: int) -> None:
        """Start a forward from row `row` of the batch's initial states (rows, width, D) (`start` places the state
        and the injected half): a fresh criterion."""
        request, prefill = self.request, not self.steps
        state = initial[row : row + 1, : self.length]
        if self.keep_states:
            self.initial_states.append(state[0, -1].clone())
        self.criterion = None
        if request.exit_criterion is not None and (not prefill or request.exit_in_prefill):
            self.criterion = ExitCriterion(request.exit_criterion, request.exit_threshold, model.config.vocab_size,
                                           state)
        self.iteration, self.coda_evals = 0, 0

    def checks_now(self) -> bool:
        """Whether the criterion is checked after the iteration just done (never after the last: nothing to save)."""
        request = self.request
        return (self.criterion is not None and self.iteration < request.num_steps
                and is_check(self.iteration, request.min_steps, request.check_every))

    def pick(self, logits: Tensor) -> Tensor:
        """The next token, (1,), from the last position's logits (1, V): forced, or drawn as the request says."""
        if self.force_tokens is not None:
            return self.force_tokens[len(self.steps) : len(self.steps) + 1]
        request = self.request
        return pick(logits, request.temperature, request.top_k, self.generator, request.top_p)

    def emit(self, model: RecurrentGPT, token_id: int, logprob: float) -> None:
        """End the forward, whose positions are committed, with its token and that token's log-probability:
        record it (`coda_evals` counts every coda + head run of the forward)."""
        request = self.request
        self.steps.append(self.iteration)
        if request.warm_start or self.keep_states:
            self.last_final_state = self.state[:, -1].clone()
            if self.keep_states:
                self.final_states.append(self.last_final_state[0])
        self.flops.append(inference_flops_per_token(model.config, self.iteration, self.cache.length, self.coda_evals))
        self.logprobs.append(logprob)
        self.tokens.append(token_id)
        self.ids, self.length = None, 1
        if token_id in request.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.steps) == request.max_new_tokens:
            self.finish_reason = "length"


def start(model: RecurrentGPT, sequences: list[Sequence], rows: Rows | None = None) -> None:
    """Run the prelude of each sequence's next forward (its prompt, or its last token) in one batched call and
    begin the forwards; `rows` are the sequences' Rows when the caller has them (`Rows.following`)."""
    rows = rows or Rows.of([s.cache for s in sequences], [s.length for s in sequences])
    device = rows.pool.device
    if rows.width == 1:
        ids = torch.tensor([s.tokens[-1:] for s in sequences], device=device)
    else:
        ids = pad([(torch.tensor(s.tokens[-1:], device=device) if s.ids is None else s.ids)[None, :, None]
                   for s in sequences], rows.width)[..., 0]
    x = model.embed_and_prelude(ids, rows.rope(model.freqs_cis), RowBatch(rows, "prelude"))
    injected = model.inject(x)
    given = [sequence.given_initial_state() for sequence in sequences]
    if model.config.state_init == "zero":
        initial = torch.zeros_like(x)
    else:  # each row's noise from its own generator, mapped to the truncated normal in one pass
        uniform = torch.zeros_like(x)
        for row, (sequence, state) in enumerate(zip(sequences, given)):
            if state is None:
                uniform[row, : sequence.length].uniform_(*TRUNC_NORMAL_UNIFORM, generator=sequence.generator)
        initial = model.noise_from_uniform(uniform)
    for row, state in enumerate(given):
        if state is not None:
            initial[row, : state.shape[1]] = state[0]
    for row, sequence in enumerate(sequences):
        sequence.begin(model, initial, row)
    if rows.width == 1:  # decoding forwards: into their slots at once
        rows.pool.states.index_copy_(0, rows.slots, initial[:, 0])
        rows.pool.injected.index_copy_(0, rows.slots, injected[:, 0])
    else:
        for row, sequence in enumerate(sequences):
            sequence.state = initial[row : row + 1, : sequence.length].clone()
            sequence.injected = injected[row : row + 1, : sequence.length]


def advance(model: RecurrentGPT, pool: list[Sequence]) -> list[tuple[Sequence, int]]:
    """One loop step of `generate`: `iterate_pool`, then `finish` of the forwards that ended. Returns (sequence,
    token id) for each token emitted."""
    return finish(model, iterate_pool(model, pool))


def iterate_pool(model: RecurrentGPT, pool: list[Sequence]) -> list[Sequence]:
    """One core iteration of every sequence of `pool`, each at its own position and iteration, batched: one call
    for the sequences decoding a token, one for those in their prompt's prefill (so that a prompt does not pad
    every decoding row to its length); then the criteria. Returns the sequences whose forward ended (criterion,
    or maximum depth), for `finish`; one that ended at a logit check keeps the logits it was checked with
    (`exit_logits`)."""
    decoding, prefilling = [], []
    for sequence in pool:
        (decoding if sequence.length == 1 else prefilling).append(sequence)
    for group in (decoding, prefilling):
        if group:
            iterate(model, group)
    ended, checks = [], {}
    for sequence in decoding + prefilling:
        if sequence.iteration == sequence.request.num_steps:
            ended.append(sequence)
        elif sequence.criterion is not None and sequence.checks_now():
            criterion = sequence.criterion
            checks.setdefault((criterion.name, 0 if criterion.uses_logits else sequence.length), []).append(sequence)
    logit_checks = [sequence for (name, _), group in checks.items() if name in LOGIT_CRITERIA for sequence in group]
    check_row = {id(sequence): row for row, sequence in enumerate(logit_checks)}
    check_logits = coda_head(model, logit_checks) if logit_checks else None
    for (name, _), group in checks.items():  # one computation per criterion (and length, for latent ones)
        criteria = [sequence.criterion for sequence in group]
        if name in LOGIT_CRITERIA:
            for sequence in group:
                sequence.coda_evals += 1
            logits = check_logits if len(group) == len(logit_checks) else check_logits[
                torch.tensor([check_row[id(s)] for s in group], device=check_logits.device)]
            values = ExitCriterion.quantities(criteria, None, logits)
        else:
            values = ExitCriterion.quantities(criteria, states(group), None)
        for sequence, exits in zip(group, ExitCriterion.exiting(criteria, values)):
            if exits:
                ended.append(sequence)
                if name in LOGIT_CRITERIA:  # its coda and head already ran on its final state
                    row = check_row[id(sequence)]
                    sequence.exit_logits = check_logits[row : row + 1]
    return ended


def finish(model: RecurrentGPT, ended: list[Sequence]) -> list[tuple[Sequence, int]]:
    """End the forwards of `ended` (from `iterate_pool`, possibly of several loop steps): their coda and head in
    one batched call (but for those holding `exit_logits`), their tokens, the commit of their positions, and
    their next forwards' prelude in one batched call. Returns (sequence, token id) for each token emitted."""
    if not ended:
        return []
    # one Rows for the ending forwards' coda and, after their commit, their next forwards' prelude
    rows = Rows.of([s.cache for s in ended], [s.length for s in ended], next_column=True)
    final = [sequence for sequence in ended if sequence.exit_logits is None]
    if len(final) == len(ended):
        logits = coda_head(model, final, rows)
    else:
        computed = iter(coda_head(model, final).split(1) if final else ())
        logits = torch.cat([s.exit_logits if s.exit_logits is not None else next(computed) for s in ended])
    if all(sequence.force_tokens is None and sequence.request.temperature == 0 for sequence in ended):
        tokens = logits.argmax(dim=-1)  # greedy: what each row's own pick gives, in one call
    else:
        tokens = torch.cat([sequence.pick(logits[row : row + 1]) for row, sequence in enumerate(ended)])
    logprobs = logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0]
    emitted = list(zip(ended, tokens.tolist()))  # the step's one read of the tokens (and one of their logprobs)
    ended[0].cache.pool.commit([s.cache for s in ended], [s.length for s in ended], [s.iteration for s in ended])
    for (sequence, token_id), logprob in zip(emitted, logprobs.tolist()):
        sequence.coda_evals += sequence.exit_logits is None
        sequence.exit_logits = None
        sequence.emit(model, token_id, logprob)
    going_on = [row for row, sequence in enumerate(ended) if sequence.finish_reason is None]
    if going_on:
        keep = None if len(going_on) == len(ended) else going_on
        start(model, [ended[row] for row in going_on], rows.following(keep))
    return emitted


def iterate(model: RecurrentGPT, sequences: list[Sequence]) -> None:
    """One core iteration of the sequences' forwards, in one batched call."""
    rows = Rows.of([s.cache for s in sequences], [s.length for s in sequences])
    batch = RowBatch(rows, "core", [s.iteration for s in sequences])
    rope = rows.rope(model.freqs_cis)
    if rows.width == 1:  # decoding: the states and injected halves in the pool's slots
        pool, slots = rows.pool, rows.slots
        new = model.core_step(pool.states.index_select(0, slots)[:, None], pool.injected.index_select(0, slots)[:, None],
                          rope, batch, 0)  # rows add their own iterations
        pool.states.index_copy_(0, slots, new[:, 0])
    else:
        new = model.core_step(pad([s.state for s in sequences], rows.width),
                          pad([s.injected for s in sequences], rows.width), rope, batch, 0)
        for row, sequence in enumerate(sequences):
            sequence.state = new[row : row + 1, : sequence.length]
    for sequence in sequences:
        sequence.iteration += 1


def coda_head(model: RecurrentGPT, sequences: list[Sequence], rows: Rows | None = None) -> Tensor:
    """The coda and head over the sequences' current states, in one batched call: their last positions' logits
    over the real vocabulary, (rows, V) fp32; `rows` are the sequences' Rows when the caller has them."""
    rows = rows or Rows.of([s.cache for s in sequences], [s.length for s in sequences])
    last = None if rows.width == 1 else torch.tensor([s.length - 1 for s in sequences])
    logits = model.coda_and_head(states(sequences, rows), rows.rope(model.freqs_cis), RowBatch(rows, "coda"), last)
    return logits[:, : model.config.vocab_size]


def states(sequences: list[Sequence], rows: Rows | None = None) -> Tensor:
    """The sequences' states side by side, (rows, width, D), padded after each one's length."""
    if all(sequence.length == 1 for sequence in sequences):
        pool = sequences[0].cache.pool
        slots = rows.slots if rows is not None else torch.tensor([s.cache.slot for s in sequences], device=pool.device)
        return pool.states.index_select(0, slots)[:, None]
    return pad([s.state for s in sequences], max(s.length for s in sequences))


def pad(tensors: list[Tensor], width: int) -> Tensor:
    """(1, length, ...) tensors side by side as (rows, width, ...), zero after each one's length."""
    if len(tensors) == 1 and tensors[0].shape[1] == width:
        return tensors[0]
    if all(t.shape[1] == width for t in tensors):
        return torch.cat(tensors)
    out = tensors[0].new_zeros(len(tensors), width, *tensors[0].shape[2:])
    for row, t in enumerate(tensors):
        out[row, : t.shape[1]] = t[0]
    return out

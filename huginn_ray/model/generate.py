"""Generation with adaptive compute, with the semantics of the released `generate_with_adaptive_compute`:
per-token exits from the recurrence, KV caches across iterations, and continuous chain-of-thought.

    result = generate(model, prompt_ids, max_new_tokens=32, num_steps=32, exit_criterion="kl",
                      exit_threshold=1e-3, cache="full", warm_start=True)
    result.tokens, result.steps            # (B, prompt + new) ids; (B, new) core iterations each token used

Every forward (the prompt's prefill, then one per generated token) iterates the core until its exit criterion
holds or `num_steps` is reached. The criterion is checked after iteration t when t > min_steps and
(t - 1 - min_steps) % check_every == 0 (the release's `min_steps` and `check_criterion_every_n_steps`:
by default after every iteration). The prefill exits too, all prompt positions at once, as in the release;
`exit_in_prefill=False` (the release's `do_not_exit_in_prefill`) runs it at the full depth. Exit when the
criterion's quantity falls below `exit_threshold` (`argmax-stability`: when the argmax has stayed the same for
that many consecutive checks); a threshold of 0 turns exits off (where the release's `argmax-stability` would
exit at the first check).

| criterion          | quantity per sequence, compared with the previous check                     | default |
|--------------------|------------------------------------------------------------------------------|---------|
| `entropy-diff`     | abs(H - H_prev), H = -sum p log(p + 1e-10) of the next-token distribution;   | 1e-3    |
|                    | H_prev starts at 100                                                         |         |
| `latent-diff`      | ||s - s_prev|| / ||s||, averaged over the forward's positions                | 0.03    |
| `kl`               | KL(p_prev || p), p_prev starts uniform                                       | 1e-3    |
| `minp-kl`          | the same after probabilities below 0.1 x max are set to 1/V (renormalised)  | 1e-5    |
| `argmax-stability` | consecutive checks with an unchanged argmax                                  | 5       |
| `cosine`           | 1 - cos(s, s_prev), the cosine averaged over the forward's positions         | 1e-3    |

s_prev is the latent state at the previous check, and at the first check the forward's initial state.
Logit-based criteria (entropy-diff, kl, minp-kl, argmax-stability) read the last position's logits over the
V = vocab_size real tokens (the released model has no padding rows: V = 65536 there) and run the coda and head at
every check; `flops_per_token` counts that. A forward that exits at such a check emits its token from that
check's logits (the coda and head of its final state: running them again would give the same).

KV caches (`cache=`): a token that exited after t iterations has no keys/values for later iterations, which a
later, deeper token attends to.
- `full` (default, the release's): a token at iteration i attends only to the past positions that reached
  iteration i (and to every position in the prelude and coda).
- `latest`: a missing entry is read from the latest iteration that position reached for the same core block
  (block index modulo the core's layer count; the release's `latest-m4`).
- `ring:N`: keep at most N iterations per position; iteration i of core block j lives in slot (i mod N, j), a
  missing one is read as in `latest`. Memory is bounded by N whatever the depth.
At a fixed depth (no exits) all three equal the model's full cache (`ring:N` with N >= depth).
`warm_start=True` starts each generated token's latent state from the previous token's final state instead of
noise (continuous chain-of-thought, the release's `continuous_compute`).

How rows advance (shared with the serving engine, huginn_ray.model.engine): every sequence is a `Sequence` with
its own slot of a `CachePool` (keys/values; a decoding forward's latent state), random generator and forward in
progress. `advance` runs one loop step: `iterate_pool`, a batched core iteration over every sequence in the
pool, each at its own position and iteration (`RowBatch`: one gather and one indexed store per block, whatever
the rows' positions; one call for the decoding sequences, one for those in their prompt's prefill), then
`finish` of the sequences whose forwards ended (their criterion, or their maximum depth): they run the coda and
head, emit a token and start their next token's forward (prelude, initial state), which joins the next loop
step: one coda call and one prelude call over one `Rows` (the index tensors built once for both). The engine
may hold ended forwards back from `finish` for a few steps to finish more of them per call
(EngineConfig.exit_wait_steps). So no row waits for
another (the release iterates exited rows until the whole batch exits), and each row gets what it gets alone
at batch size 1 from the same initial noise and sampling draws, up to the rounding of batched matmuls.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from huginn_ray.model.cache import CachePool, RowBatch, Rows, parse_cache
from huginn_ray.model.config import ModelConfig
from huginn_ray.model.flops import inference_flops_per_token
from huginn_ray.model.model import TRUNC_NORMAL_UNIFORM, RecurrentGPT

DEFAULT_THRESHOLDS = {
    "entropy-diff": 1e-3,
    "latent-diff": 0.03,
    "kl": 1e-3,
    "minp-kl": 1e-5,
    "argmax-stability": 5,
    "cosine": 1e-3,
}
LOGIT_CRITERIA = {"entropy-diff", "kl", "minp-kl", "argmax-stability"}
MINP_RATIO = 0.1
ENTROPY_START, ENTROPY_EPS = 100.0, 1e-10


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
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}")
        for token in self.stop_token_ids:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < config.vocab_size:
                raise ValueError(f"stop_token_ids holds {token!r}, not a token id in [0, {config.vocab_size})")
        return Request(**{**self.__dict__, "prompt": tuple(self.prompt), "num_steps": num_steps,
                          "exit_criterion": criterion, "exit_threshold": threshold,
                          "stop_token_ids": tuple(self.stop_token_ids)})


@dataclass
class GenerationResult:
    tokens: Tensor
    """(batch, prompt + generated) token ids; a row that stopped early is padded with its stop token."""
    steps: Tensor
    """(batch, generated) core iterations of the forward that produced each generated token (the first: the
    prefill); 0 after a row stopped."""
    flops_per_token: float
    """Mean forward FLOPs per token decoded after the prefill (the prefill's per-position FLOPs when there is
    none), the coda + head of logit-based criteria's checks included."""
    cache_bytes_per_token: float
    """Bytes of keys/values held per cached position at the end."""
    seconds: float
    initial_states: list[Tensor] = field(default_factory=list)
    """(batch, D) latent state each forward's recurrence started from at its last position (index 0: the prefill)."""
    final_states: list[Tensor] = field(default_factory=list)
    """(batch, D) final latent state of each forward's last position."""
    logprobs: Tensor | None = None
    """(batch, generated) log-probability of each emitted token under the distribution it was drawn from."""

    @property
    def mean_steps(self) -> float:
        return float(self.steps.float().mean())


class ExitCriterion:
    """One forward's running quantity of a criterion for one sequence; made anew for every forward (the prefill
    and each generated token), from that forward's initial state."""

    def __init__(self, name: str, threshold: float, vocab_size: int, initial_state: Tensor):
        if name not in DEFAULT_THRESHOLDS:
            raise ValueError(f"unknown exit criterion {name!r}; known: {', '.join(DEFAULT_THRESHOLDS)}, none")
        self.name, self.threshold, self.vocab_size = name, threshold, vocab_size
        self.uses_logits = name in LOGIT_CRITERIA
        device = initial_state.device
        if name in ("latent-diff", "cosine"):
            self.previous_state = initial_state.float().clone()
        elif name == "entropy-diff":
            self.previous_entropy = torch.full((1,), ENTROPY_START, device=device)
        elif name == "argmax-stability":
            self.previous_argmax = torch.full((1,), -1, dtype=torch.long, device=device)
            self.stable = torch.zeros(1, dtype=torch.long, device=device)
        else:  # kl, minp-kl: uniform
            self.previous_logp = torch.full((1, vocab_size), -math.log(vocab_size), device=device)

    def quantity(self, state: Tensor, logits: Tensor | None) -> Tensor:
        """The criterion's value, shape (1,), given the sequence's (1, positions, D) state and its last position's
        logits (1, V); remembers this check's state / distribution as the next check's comparand."""
        return ExitCriterion.quantities([self], state, logits)

    @staticmethod
    def quantities(criteria: list["ExitCriterion"], state: Tensor, logits: Tensor | None) -> Tensor:
        """`quantity` of several sequences' criteria of one name at once, shape (rows,): their states
        (rows, positions, D), all of one length, and last-position logits (rows, V). Row for row what
        `quantity` computes (every reduction runs within a row)."""
        name = criteria[0].name
        if name in ("latent-diff", "cosine"):
            state = state.float()
            previous = torch.cat([criterion.previous_state for criterion in criteria])
            for criterion, previous_state in zip(criteria, state.split(1)):  # one split: views of every row
                criterion.previous_state = previous_state
            if name == "latent-diff":
                return ((state - previous).norm(dim=-1) / state.norm(dim=-1)).mean(dim=-1)
            cosine = (state * previous).sum(-1) / (state.norm(dim=-1) * previous.norm(dim=-1)).clamp_min(1e-30)
            return 1 - cosine.mean(dim=-1)
        logits = logits.float()
        if name == "entropy-diff":
            probs = logits.softmax(dim=-1)
            value_now = -(probs * (probs + ENTROPY_EPS).log()).sum(dim=-1)
            value = (value_now - torch.cat([criterion.previous_entropy for criterion in criteria])).abs()
            for criterion, previous_entropy in zip(criteria, value_now.split(1)):
                criterion.previous_entropy = previous_entropy
            return value
        if name == "argmax-stability":
            argmax = logits.argmax(dim=-1)
            previous = torch.cat([criterion.previous_argmax for criterion in criteria])
            stable = torch.where(argmax == previous, torch.cat([criterion.stable for criterion in criteria]) + 1, 0)
            for criterion, previous_argmax, row_stable in zip(criteria, argmax.split(1), stable.split(1)):
                criterion.previous_argmax, criterion.stable = previous_argmax, row_stable
            return stable.float()
        logp = logits.log_softmax(dim=-1) if name == "kl" else minp(logits, criteria[0].vocab_size)
        value = kl(torch.cat([criterion.previous_logp for criterion in criteria]), logp)
        for criterion, previous_logp in zip(criteria, logp.split(1)):
            criterion.previous_logp = previous_logp
        return value

    @staticmethod
    def exiting(criteria: list["ExitCriterion"], values: Tensor) -> list[bool]:
        """Which of these criteria's checks (`quantities` of one name) end their forwards: value below the
        threshold (`argmax-stability`: at or above it); a threshold of 0 never does."""
        thresholds = torch.tensor([criterion.threshold for criterion in criteria], device=values.device)
        hit = values >= thresholds if criteria[0].name == "argmax-stability" else values < thresholds
        return (hit & (thresholds > 0)).tolist()


def kl(logp: Tensor, logq: Tensor) -> Tensor:
    """KL(p || q) from log-probabilities."""
    return (logp.exp() * (logp - logq)).sum(-1)


def minp(logits: Tensor, vocab_size: int) -> Tensor:
    """Probabilities below MINP_RATIO x max set to 1/vocab_size, renormalised; returned as log-probabilities."""
    p = logits.softmax(dim=-1)
    p = torch.where(p < MINP_RATIO * p.max(dim=-1, keepdim=True).values, torch.full_like(p, 1 / vocab_size), p)
    return (p / p.sum(-1, keepdim=True)).log()


def is_check(iteration: int, min_steps: int, check_every: int) -> bool:
    """Whether the criterion is checked after `iteration` (1-based) core iterations."""
    return iteration > min_steps and (iteration - 1 - min_steps) % check_every == 0


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
        latent state of the last position (GenerationResult)."""
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

    def pick(self, model: RecurrentGPT, logits: Tensor) -> Tensor:
        """The next token, (1,), from the last position's logits (1, V): forced, or drawn as the request says."""
        if self.force_tokens is not None:
            return self.force_tokens[len(self.steps) : len(self.steps) + 1]
        request = self.request
        return model._pick(logits, request.temperature, request.top_k, self.generator, request.top_p)

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
    rope = rows.rope(model.freqs_cis)
    x = model.transformer.wte(ids) * model.config.embedding_scale
    batch = RowBatch(rows, "prelude")
    for index, block in enumerate(model.transformer.prelude):
        x = block(x, rope, batch, index)
    injected = model._inject(x)
    given = [sequence.given_initial_state() for sequence in sequences]
    if model.config.state_init == "zero":
        initial = torch.zeros_like(x)
    else:  # each row's noise from its own generator, mapped to the truncated normal in one pass
        uniform = torch.zeros_like(x)
        for row, (sequence, state) in enumerate(zip(sequences, given)):
            if state is None:
                uniform[row, : sequence.length].uniform_(*TRUNC_NORMAL_UNIFORM, generator=sequence.generator)
        initial = model._noise_state(uniform)
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
        tokens = torch.cat([sequence.pick(model, logits[row : row + 1]) for row, sequence in enumerate(ended)])
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
        new = model._core(pool.states.index_select(0, slots)[:, None], pool.injected.index_select(0, slots)[:, None],
                          rope, batch, 0)  # rows add their own iterations
        pool.states.index_copy_(0, slots, new[:, 0])
    else:
        new = model._core(pad([s.state for s in sequences], rows.width),
                          pad([s.injected for s in sequences], rows.width), rope, batch, 0)
        for row, sequence in enumerate(sequences):
            sequence.state = new[row : row + 1, : sequence.length]
    for sequence in sequences:
        sequence.iteration += 1


def coda_head(model: RecurrentGPT, sequences: list[Sequence], rows: Rows | None = None) -> Tensor:
    """The coda and head over the sequences' current states, in one batched call: their last positions' logits
    over the real vocabulary, (rows, V) fp32; `rows` are the sequences' Rows when the caller has them."""
    rows = rows or Rows.of([s.cache for s in sequences], [s.length for s in sequences])
    rope = rows.rope(model.freqs_cis)
    x = model.transformer.ln_f(states(sequences, rows))
    batch = RowBatch(rows, "coda")
    for index, block in enumerate(model.transformer.coda):
        x = block(x, rope, batch, -1 - index)
    if rows.width == 1:
        last = x[:, 0]
    else:
        last = x[torch.arange(len(sequences)), torch.tensor([s.length - 1 for s in sequences])]
    return model.lm_head(model.transformer.ln_f(last)).float()[:, : model.config.vocab_size]


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


@torch.no_grad()
def generate(
    model: RecurrentGPT,
    input_ids: Tensor,
    max_new_tokens: int,
    num_steps: int | None = None,
    exit_criterion: str | None = None,
    exit_threshold: float | None = None,
    min_steps: int = 0,
    check_every: int = 1,
    exit_in_prefill: bool = True,
    cache: str = "full",
    warm_start: bool = False,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    input_states: Tensor | None = None,
    force_tokens: Tensor | None = None,
) -> GenerationResult:
    """See the module docstring. Every row of `input_ids` (batch, prompt) is generated as a `Request` with these
    settings; a row stops after `eos_token_id`. `generator` draws the initial noise and the samples (None:
    torch's global one; rows of a batch draw from it in turn). `input_states` (batch, prompt, D) replaces the
    prefill's initial noise. `force_tokens` (batch, max_new_tokens) are emitted instead of sampled (teacher
    forcing, for measuring the loss of adaptive compute); `logprobs` holds each emitted token's log-probability
    either way."""
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        pool, caches = [], CachePool(model.config, input_ids.device, next(model.parameters()).dtype)
        for row, prompt in enumerate(input_ids.tolist()):
            request = Request(tuple(prompt), max_new_tokens, num_steps, exit_criterion, exit_threshold, min_steps,
                              check_every, exit_in_prefill, cache, warm_start, temperature, top_k, top_p,
                              stop_token_ids=() if eos_token_id is None else (eos_token_id,)).checked(model.config)
            pool.append(Sequence(request, generator, caches, model.config,
                                 None if input_states is None else input_states[row : row + 1],
                                 None if force_tokens is None else force_tokens[row], keep_states=True))
        rows = list(pool)
        start(model, pool)
        while pool:
            advance(model, pool)
            pool = [sequence for sequence in pool if sequence.finish_reason is None]
        return result(rows, eos_token_id, time.perf_counter() - t0)
    finally:
        model.train(was_training)


def result(rows: list[Sequence], eos_token_id: int | None, seconds: float) -> GenerationResult:
    """The rows' outputs side by side, those that stopped early padded (tokens: eos; steps, states: 0)."""
    forwards = max(len(row.steps) for row in rows)

    def padded(values: list, fill) -> list:
        return values + [fill] * (forwards - len(values))

    tokens = torch.tensor([padded(row.tokens, eos_token_id) for row in rows])
    zeros = torch.zeros_like(rows[0].initial_states[0])
    decoded = [flops for row in rows for flops in row.flops[1:]] or [row.flops[0] for row in rows]
    held = sum(row.cache.bytes_held() for row in rows)
    return GenerationResult(
        tokens=tokens.to(rows[0].cache.pool.device), steps=torch.tensor([padded(row.steps, 0) for row in rows]),
        flops_per_token=sum(decoded) / len(decoded),
        cache_bytes_per_token=held / sum(row.cache.length for row in rows), seconds=seconds,
        initial_states=[torch.stack([row.initial_states[i] if i < len(row.initial_states) else zeros for row in rows])
                        for i in range(forwards)],
        final_states=[torch.stack([row.final_states[i] if i < len(row.final_states) else zeros for row in rows])
                      for i in range(forwards)],
        logprobs=torch.tensor([padded(row.logprobs, 0.0) for row in rows]),
    )

"""Generation with adaptive compute, with the semantics of the released `generate_with_adaptive_compute`:
per-token exits from the recurrence, KV caches across iterations, and continuous chain-of-thought.

    result = generate(model, prompt_ids, max_new_tokens=32, num_steps=32, exit_criterion="kl",
                      exit_threshold=1e-3, cache="full", warm_start=True)
    result.tokens, result.steps            # (B, prompt + new) ids; (B, new) core iterations each token used

Every forward (the prompt's prefill, then one per generated token) iterates the core until its exit criterion
holds or `num_steps` is reached. The criterion is checked after iteration t when t > min_steps and
(t - 1 - min_steps) % check_every == 0 (the release's `min_steps` and `check_criterion_every_n_steps`:
by default after every iteration). The prefill exits too, all prompt positions at once, as in the release;
`exit_in_prefill=False` (the release's `do_not_exit_in_prefill`) runs it at the full depth. The criteria, their
quantities and defaults: huginn_ray.generation.exits (a threshold of 0 turns exits off). A logit-based criterion
runs the coda and head at every check; `flops_per_token` counts that. A forward that exits at such a check emits
its token from that check's logits (the coda and head of its final state: running them again would give the same).

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

How rows advance, batched, each as it would alone: huginn_ray.generation.stepping.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from huginn_ray.generation.caches import CachePool
from huginn_ray.generation.requests import Request
from huginn_ray.generation.stepping import Sequence, advance, start
from huginn_ray.model.model import RecurrentGPT


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

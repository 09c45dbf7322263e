"""Generation with adaptive compute, with the semantics of the released `generate_with_adaptive_compute`:
per-token exits from the recurrence, KV caches across iterations, and continuous chain-of-thought.

    result = generate(model, prompt_ids, max_new_tokens=32, num_steps=32, exit_criterion="kl",
                      exit_threshold=1e-3, cache="full", warm_start=True)
    result.tokens, result.steps            # (B, prompt + new) ids; (B, new) core iterations each token used

Every forward (the prompt's prefill, then one per generated token) iterates the core until its exit criterion
holds or `num_steps` is reached. The criterion is checked after iteration t when t > min_steps and
(t - 1 - min_steps) % check_every == 0 (the release's `min_steps` and `check_criterion_every_n_steps`:
by default after every iteration). The prefill exits too, all prompt positions at once, as in the release;
`exit_in_prefill=False` (the release's `do_not_exit_in_prefill`) runs it at the full depth. Each sequence of
a batch exits on its own and is left out of further core iterations, so a batch gives every row what batch
size 1 gives it from the same initial states (the release keeps iterating exited rows until the whole batch
exits). Exit when the criterion's quantity falls below `exit_threshold` (`argmax-stability`: when the argmax
has stayed the same for that many consecutive checks); a threshold of 0 turns exits off (where the release's
`argmax-stability` would exit at the first check).

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
every check; `flops_per_token` counts that.

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
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from huginn_ray.model.cache import IterationKVCache, parse_cache
from huginn_ray.model.flops import inference_flops_per_token
from huginn_ray.model.model import RecurrentGPT

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


@dataclass
class GenerationResult:
    tokens: Tensor
    """(batch, prompt + generated) token ids."""
    steps: Tensor
    """(batch, generated) core iterations of the forward that produced each generated token (the first: the prefill)."""
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
    """One forward's running quantity of a criterion, per sequence; `check` returns which of the given rows exit.

    Made anew for every forward (the prefill and each generated token), from that forward's initial state."""

    def __init__(self, name: str, threshold: float, vocab_size: int, initial_state: Tensor):
        if name not in DEFAULT_THRESHOLDS:
            raise ValueError(f"unknown exit criterion {name!r}; known: {', '.join(DEFAULT_THRESHOLDS)}, none")
        self.name, self.threshold, self.vocab_size = name, threshold, vocab_size
        self.uses_logits = name in LOGIT_CRITERIA
        batch, device = initial_state.shape[0], initial_state.device
        if name in ("latent-diff", "cosine"):
            self.previous_state = initial_state.float().clone()
        elif name == "entropy-diff":
            self.previous_entropy = torch.full((batch,), ENTROPY_START, device=device)
        elif name == "argmax-stability":
            self.previous_argmax = torch.full((batch,), -1, dtype=torch.long, device=device)
            self.stable = torch.zeros(batch, dtype=torch.long, device=device)
        else:  # kl, minp-kl: uniform
            self.previous_logp = torch.full((batch, vocab_size), -math.log(vocab_size), device=device)

    def quantity(self, rows: Tensor, state: Tensor, logits: Tensor | None) -> Tensor:
        """The criterion's value for `rows`, given their (rows, positions, D) state and last-position logits
        (rows, V); remembers this check's state / distribution as the next check's comparand."""
        if self.name in ("latent-diff", "cosine"):
            state = state.float()
            previous = self.previous_state[rows]
            self.previous_state[rows] = state
            if self.name == "latent-diff":
                return ((state - previous).norm(dim=-1) / state.norm(dim=-1)).mean(dim=-1)
            cosine = (state * previous).sum(-1) / (state.norm(dim=-1) * previous.norm(dim=-1)).clamp_min(1e-30)
            return 1 - cosine.mean(dim=-1)
        logits = logits.float()
        if self.name == "entropy-diff":
            probs = logits.softmax(dim=-1)
            value_now = -(probs * (probs + ENTROPY_EPS).log()).sum(dim=-1)
            value = (value_now - self.previous_entropy[rows]).abs()
            self.previous_entropy[rows] = value_now
            return value
        if self.name == "argmax-stability":
            argmax = logits.argmax(dim=-1)
            self.stable[rows] = torch.where(argmax == self.previous_argmax[rows], self.stable[rows] + 1, 0)
            self.previous_argmax[rows] = argmax
            return self.stable[rows].float()
        logp = logits.log_softmax(dim=-1) if self.name == "kl" else minp(logits, self.vocab_size)
        value = kl(self.previous_logp[rows], logp)
        self.previous_logp[rows] = logp
        return value

    def exits(self, value: Tensor) -> Tensor:
        if self.threshold <= 0:
            return torch.zeros_like(value, dtype=torch.bool)
        if self.name == "argmax-stability":
            return value >= self.threshold
        return value < self.threshold


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
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    input_states: Tensor | None = None,
    force_tokens: Tensor | None = None,
) -> GenerationResult:
    """See the module docstring. `input_states` (batch, prompt, D) replaces the prefill's initial noise.
    `force_tokens` (batch, max_new_tokens) are emitted instead of sampled (teacher forcing, for measuring the
    loss of adaptive compute); `logprobs` holds each emitted token's log-probability either way."""
    cfg = model.config
    max_steps = cfg.mean_recurrence if num_steps is None else int(num_steps)
    if max_steps < 1 or min_steps < 0 or check_every < 1:
        raise ValueError(f"num_steps and check_every must be >= 1 and min_steps >= 0, got {max_steps}, "
                         f"{check_every}, {min_steps}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    batch, prompt_len = input_ids.shape
    total = prompt_len + max_new_tokens
    if total > cfg.block_size:
        raise ValueError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} exceeds block_size={cfg.block_size}")
    criterion_name = None if exit_criterion in (None, "none") else exit_criterion
    if criterion_name is not None and criterion_name not in DEFAULT_THRESHOLDS:
        raise ValueError(f"unknown exit criterion {criterion_name!r}; known: {', '.join(DEFAULT_THRESHOLDS)}, none")
    threshold = None
    if criterion_name is not None:
        threshold = DEFAULT_THRESHOLDS[criterion_name] if exit_threshold is None else exit_threshold
    parse_cache(cache)
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        kv = IterationKVCache(model.config, batch, total - 1, cache)  # the last token is emitted, never run
        device = input_ids.device
        tokens, forward_ids = input_ids, input_ids
        steps, flops, initial_states, final_states, logprobs = [], [], [], [], []
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        for index in range(max_new_tokens):
            embedded = _prelude(model, forward_ids, kv)
            if index == 0:
                state = model._initial_state(embedded) if input_states is None else input_states.clone()
            else:
                state = final_states[-1][:, None].clone() if warm_start else model._initial_state(embedded)
            initial_states.append(state[:, -1].clone())
            criterion = None
            if criterion_name is not None and (index > 0 or exit_in_prefill):
                criterion = ExitCriterion(criterion_name, threshold, cfg.vocab_size, state)
            state, used, coda_rows = _recur(model, kv, embedded, state, max_steps, criterion, min_steps, check_every)
            logits = _coda_head(model, state, kv)
            kv.length += forward_ids.shape[1]
            steps.append(used)
            final_states.append(state[:, -1].clone())
            flops.append(inference_flops_per_token(cfg, float(used.float().mean()), kv.length, 1 + coda_rows / batch))

            last = logits[:, -1, : cfg.vocab_size]
            if force_tokens is not None:
                next_token = force_tokens[:, index]
            else:
                next_token = model._pick(last, temperature, top_k, generator)
            logprobs.append(last.log_softmax(-1).gather(1, next_token[:, None])[:, 0])
            if eos_token_id is not None:
                next_token = torch.where(finished, torch.full_like(next_token, eos_token_id), next_token)
                finished |= next_token == eos_token_id
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            forward_ids = next_token[:, None]
            if eos_token_id is not None and bool(finished.all()):
                break
        decoded = flops[1:] or flops
        return GenerationResult(
            tokens=tokens, steps=torch.stack(steps, dim=1), flops_per_token=sum(decoded) / len(decoded),
            cache_bytes_per_token=kv.bytes_per_token(), seconds=time.perf_counter() - t0,
            initial_states=initial_states, final_states=final_states, logprobs=torch.stack(logprobs, dim=1),
        )
    finally:
        model.train(was_training)


def _recur(model: RecurrentGPT, kv: IterationKVCache, embedded: Tensor, state: Tensor, max_steps: int,
           criterion: ExitCriterion | None, min_steps: int, check_every: int) -> tuple[Tensor, Tensor, int]:
    """Iterate the core from `state` (batch, positions, D) until each row exits or max_steps. Returns the final
    states (an exited row keeps its state at the exit), the iterations each row used, and the number of
    (row, check) pairs that ran the coda + head for a logit-based criterion."""
    batch = state.shape[0]
    injected = model._inject(embedded)
    rope = _rope(model, kv, state.shape[1])
    used = torch.full((batch,), max_steps, dtype=torch.long, device=state.device)
    active = torch.arange(batch, device=state.device)
    coda_rows = 0
    for iteration in range(max_steps):
        kv.rows = active
        new = model._core(state[active], injected[active], rope, kv, iteration)
        state[active] = new
        done = iteration + 1
        if criterion is None or done == max_steps or not is_check(done, min_steps, check_every):
            continue  # an exit after the last iteration changes nothing
        logits = None
        if criterion.uses_logits:
            logits = _coda_head(model, new, kv)[:, -1, : model.config.vocab_size]
            coda_rows += len(active)
        exiting = criterion.exits(criterion.quantity(active, new, logits))
        used[active[exiting]] = done
        active = active[~exiting]
        if not len(active):
            break
    kv.rows = None
    return state, used, coda_rows


def _rope(model: RecurrentGPT, kv: IterationKVCache, length: int) -> Tensor:
    return model.freqs_cis[:, kv.length : kv.length + length]


def _prelude(model: RecurrentGPT, ids: Tensor, kv: IterationKVCache) -> Tensor:
    kv.rows = None
    rope = _rope(model, kv, ids.shape[1])
    x = model.transformer.wte(ids) * model.config.embedding_scale
    for index, block in enumerate(model.transformer.prelude):
        x = block(x, rope, kv, index)
    return x


def _coda_head(model: RecurrentGPT, state: Tensor, kv: IterationKVCache) -> Tensor:
    rope = _rope(model, kv, state.shape[1])
    x = model.transformer.ln_f(state)
    for index, block in enumerate(model.transformer.coda):
        x = block(x, rope, kv, -1 - index)
    return model.lm_head(model.transformer.ln_f(x)).float()

"""Generation with adaptive compute: per-token exits from the recurrence, KV caches across iterations, and
continuous chain-of-thought.

    result = generate(model, prompt_ids, max_new_tokens=32, num_steps=32, exit_criterion="kl",
                      exit_threshold=1e-3, cache="ring:16", warm_start=True)
    result.tokens, result.steps            # (B, prompt + new) ids; (B, new) core iterations each token used

The prompt is prefilled at the full depth `num_steps`; every generated token then iterates the core until its
exit criterion holds (checked after iteration t when t >= min_steps and t % check_every == 0) or `num_steps`
is reached. Each sequence of a batch exits on its own; exited sequences are left out of further core
iterations. Exit when the criterion's quantity falls below `exit_threshold` (for `argmax-stability`: when the
argmax has stayed the same for that many consecutive checks); a threshold of 0 never exits early.

| criterion          | quantity (per sequence)                                                      | default |
|--------------------|-------------------------------------------------------------------------------|---------|
| `entropy-diff`     | abs(H_t - H_prev) of the next-token distribution (H_prev starts at log V)    | 1e-3    |
| `latent-diff`      | ||s_t - s_{t-1}|| / ||s_t||                                                  | 0.03    |
| `kl`               | KL(p_prev || p_t) (p_prev starts uniform)                                    | 1e-3    |
| `minp-kl`          | the same after probabilities below 0.1 x max are set to 1e-6 (renormalised) | 1e-5    |
| `argmax-stability` | consecutive checks with an unchanged argmax                                  | 5       |
| `cosine`           | 1 - cos(s_t, s_{t-1})                                                        | 1e-3    |

The logit-based criteria (entropy-diff, kl, minp-kl, argmax-stability) run the coda and head at every check;
`flops_per_token` counts that.

KV caches (`cache=`): a token that exited after t iterations has no keys/values for later iterations, which a
later, deeper token attends to.
- `latest`: keep every iteration; a missing entry is read from the latest iteration that position reached
  for the same core block (block index modulo the core's layer count). With a fixed depth this is the full cache.
- `ring:N`: keep at most N iterations per position; iteration i of core block j lives in slot (i mod N, j).
  Memory is bounded by N whatever the depth; with N >= depth and a fixed depth it equals the full cache.
`warm_start=True` starts each generated token's latent state from the previous token's final state instead of
noise (continuous chain-of-thought).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

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
MINP_RATIO, MINP_FLOOR = 0.1, 1e-6


@dataclass
class GenerationResult:
    tokens: Tensor
    """(batch, prompt + generated) token ids."""
    steps: Tensor
    """(batch, generated) core iterations each generated token used (the first comes from the prefill)."""
    flops_per_token: float
    """Mean forward FLOPs per token decoded after the prefill (the prefill's per-position FLOPs when there is
    none), the coda + head of logit-based criteria's checks included."""
    cache_bytes_per_token: float
    """Bytes of keys/values held per cached position at the end."""
    seconds: float
    initial_states: list[Tensor] = field(default_factory=list)
    """(batch, D) latent state each generated token's recurrence started from (index 0: the prefill's last position)."""
    final_states: list[Tensor] = field(default_factory=list)
    """(batch, D) final latent state of each generated token."""
    logprobs: Tensor | None = None
    """(batch, generated) log-probability of each emitted token under the distribution it was drawn from."""

    @property
    def mean_steps(self) -> float:
        return float(self.steps.float().mean())


class IterationKVCache:
    """Keys/values per block and position for generation with per-token depth (strategies `latest`, `ring:N`).

    Duck-types the model's KVCache (`past_length`, `update`). Storage is preallocated per slot as
    (batch, max_len, heads, head_dim); `rows` selects the batch rows of the next updates (exited sequences
    are not computed) and `length` is the number of committed positions."""

    def __init__(self, model: RecurrentGPT, batch: int, max_len: int, strategy: str = "latest"):
        cfg = model.config
        self.prelude, self.core = cfg.n_layers_in_prelude, cfg.n_layers_in_recurrent_block
        self.batch, self.max_len = batch, max_len
        self.shape = (cfg.num_attention_heads, cfg.head_dim)
        self.ring = parse_cache(strategy)
        self.length = 0
        self.rows: Tensor | None = None
        self.slots: dict[tuple, list[Tensor]] = {}   # key -> [K, V, present (batch, max_len)]
        self.latest: dict[int, list[Tensor]] = {}    # core block j -> [K, V] of the deepest iteration written

    def _key(self, index: int) -> tuple:
        if index < 0:
            return ("coda", -1 - index)
        if index < self.prelude:
            return ("prelude", index)
        iteration, j = divmod(index - self.prelude, self.core)
        return ("core", iteration if self.ring is None else iteration % self.ring, j)

    def _alloc(self, like: Tensor, with_present: bool) -> list[Tensor]:
        kv = [like.new_zeros(self.batch, self.max_len, *self.shape) for _ in range(2)]
        if with_present:
            kv.append(torch.zeros(self.batch, self.max_len, dtype=torch.bool, device=like.device))
        return kv

    def past_length(self, index: int) -> int:
        return self.length

    def update(self, index: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        rows = self.rows if self.rows is not None else torch.arange(self.batch, device=k.device)
        start, end = self.length, self.length + k.shape[1]
        key = self._key(index)
        entry = self.slots.get(key) or self.slots.setdefault(key, self._alloc(k, with_present=True))
        entry[0][rows, start:end], entry[1][rows, start:end] = k, v
        entry[2][rows, start:end] = True
        keys, values = entry[0][rows, :end], entry[1][rows, :end]
        if key[0] == "core":
            latest = self.latest.get(key[2]) or self.latest.setdefault(key[2], self._alloc(k, with_present=False))
            latest[0][rows, start:end], latest[1][rows, start:end] = k, v
            present = entry[2][rows, :end, None, None]
            keys = torch.where(present, keys, latest[0][rows, :end])
            values = torch.where(present, values, latest[1][rows, :end])
        return keys, values

    def bytes_per_token(self) -> float:
        """Bytes of the key/value entries held (present ones, plus the latest-iteration copies) per position."""
        if not self.length:
            return 0.0
        per_entry = 2 * math.prod(self.shape) * next(iter(self.slots.values()))[0].element_size()
        held = sum(int(entry[2].sum()) for entry in self.slots.values())
        held += len(self.latest) * self.batch * self.length
        return held * per_entry / (self.batch * self.length)


def parse_cache(strategy: str) -> int | None:
    if strategy == "latest":
        return None
    if strategy.startswith("ring:") and strategy[5:].isdigit() and int(strategy[5:]) > 0:
        return int(strategy[5:])
    raise ValueError(f"cache must be 'latest' or 'ring:N' with N >= 1, got {strategy!r}")


class ExitCriterion:
    """The running quantity of one criterion, per sequence; `check` returns which active rows exit."""

    def __init__(self, name: str, threshold: float, vocab_size: int, batch: int, device):
        if name not in DEFAULT_THRESHOLDS:
            raise ValueError(f"unknown exit criterion {name!r}; known: {', '.join(DEFAULT_THRESHOLDS)}, none")
        self.name, self.threshold = name, threshold
        self.uses_logits = name in LOGIT_CRITERIA
        self.prev_logp = torch.full((batch, vocab_size), -math.log(vocab_size), device=device)  # uniform
        self.prev_argmax = torch.full((batch,), -1, dtype=torch.long, device=device)
        self.stable = torch.zeros(batch, dtype=torch.long, device=device)

    def quantity(self, rows: Tensor, state: Tensor, previous: Tensor, logits: Tensor | None) -> Tensor:
        if self.name == "latent-diff":
            return (state - previous).norm(dim=-1) / state.norm(dim=-1).clamp_min(1e-12)
        if self.name == "cosine":
            return 1 - F.cosine_similarity(state, previous, dim=-1)
        logp = logits.float().log_softmax(dim=-1)
        prev = self.prev_logp[rows]
        if self.name == "entropy-diff":
            value = (entropy(logp) - entropy(prev)).abs()
        elif self.name == "kl":
            value = kl(prev, logp)
        elif self.name == "minp-kl":
            value = kl(minp(prev), minp(logp))
        else:  # argmax-stability: consecutive checks with the same argmax
            argmax = logp.argmax(dim=-1)
            self.stable[rows] = torch.where(argmax == self.prev_argmax[rows], self.stable[rows] + 1, 0)
            self.prev_argmax[rows] = argmax
            value = self.stable[rows].float()
        self.prev_logp[rows] = logp
        return value

    def exits(self, value: Tensor) -> Tensor:
        if self.threshold <= 0:
            return torch.zeros_like(value, dtype=torch.bool)
        if self.name == "argmax-stability":
            return value >= self.threshold
        return value < self.threshold


def entropy(logp: Tensor) -> Tensor:
    return -(logp.exp() * logp).sum(-1)


def kl(logp: Tensor, logq: Tensor) -> Tensor:
    """KL(p || q) from log-probabilities."""
    return (logp.exp() * (logp - logq)).sum(-1)


def minp(logp: Tensor) -> Tensor:
    """Probabilities below MINP_RATIO x max set to MINP_FLOOR, renormalised; returned as log-probabilities."""
    p = logp.exp()
    p = torch.where(p < MINP_RATIO * p.max(dim=-1, keepdim=True).values, torch.full_like(p, MINP_FLOOR), p)
    return (p / p.sum(-1, keepdim=True)).log()


@torch.no_grad()
def generate(
    model: RecurrentGPT,
    input_ids: Tensor,
    max_new_tokens: int,
    num_steps: int | None = None,
    exit_criterion: str | None = None,
    exit_threshold: float | None = None,
    min_steps: int = 1,
    check_every: int = 1,
    cache: str = "latest",
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
    if max_steps < 1 or min_steps < 1 or check_every < 1:
        raise ValueError(f"num_steps, min_steps and check_every must be >= 1, got {max_steps}, {min_steps}, {check_every}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    batch, prompt_len = input_ids.shape
    total = prompt_len + max_new_tokens
    if total > cfg.block_size:
        raise ValueError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} exceeds block_size={cfg.block_size}")
    criterion_name = None if exit_criterion in (None, "none") else exit_criterion
    if criterion_name is not None and criterion_name not in DEFAULT_THRESHOLDS:
        raise ValueError(f"unknown exit criterion {criterion_name!r}; known: {', '.join(DEFAULT_THRESHOLDS)}, none")
    parse_cache(cache)
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        kv = IterationKVCache(model, batch, total, cache)
        device = input_ids.device
        criterion = None
        tokens, steps, flops, initial_states, final_states, logprobs = input_ids, [], [], [], [], []

        # prefill: the whole prompt at the full depth
        embedded = _prelude(model, input_ids, kv)
        state = model._initial_state(embedded) if input_states is None else input_states
        initial_states.append(state[:, -1].clone())
        injected = model._inject(embedded)
        for iteration in range(max_steps):
            state = model._core(state, injected, _rope(model, kv, prompt_len), kv, iteration)
        logits = _coda_head(model, state, kv)
        kv.length += prompt_len
        steps.append(torch.full((batch,), max_steps, dtype=torch.long, device=device))
        flops.append(inference_flops_per_token(cfg, max_steps, prompt_len))
        final_states.append(state[:, -1].clone())
        finished = torch.zeros(batch, dtype=torch.bool, device=device)

        for position in range(prompt_len, total):
            last = logits[:, -1, : cfg.vocab_size]
            if force_tokens is not None:
                next_token = force_tokens[:, position - prompt_len]
            else:
                next_token = model._pick(last, temperature, top_k, generator)
            logprobs.append(last.log_softmax(-1).gather(1, next_token[:, None])[:, 0])
            if eos_token_id is not None:
                next_token = torch.where(finished, torch.full_like(next_token, eos_token_id), next_token)
                finished |= next_token == eos_token_id
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            if position == total - 1 or (eos_token_id is not None and bool(finished.all())):
                break
            if criterion_name is not None:
                threshold = DEFAULT_THRESHOLDS[criterion_name] if exit_threshold is None else exit_threshold
                criterion = ExitCriterion(criterion_name, threshold, cfg.vocab_size, batch, device)

            embedded = _prelude(model, next_token[:, None], kv)
            state = final_states[-1][:, None].clone() if warm_start else model._initial_state(embedded)
            initial_states.append(state[:, 0].clone())
            injected = model._inject(embedded)
            used = torch.full((batch,), max_steps, dtype=torch.long, device=device)
            active = torch.arange(batch, device=device)
            rope = _rope(model, kv, 1)
            checks = 0
            for iteration in range(max_steps):
                kv.rows = active
                previous = state[active]
                new = model._core(previous, injected[active], rope, kv, iteration)
                state[active] = new
                done = iteration + 1
                if criterion is None or done < min_steps or done % check_every or done == max_steps:
                    continue
                check_logits = _coda_head(model, new, kv) if criterion.uses_logits else None
                checks += int(criterion.uses_logits) * len(active)
                value = criterion.quantity(active, new[:, 0].float(), previous[:, 0].float(),
                                           None if check_logits is None else check_logits[:, -1, : cfg.vocab_size])
                exiting = criterion.exits(value)
                used[active[exiting]] = done
                active = active[~exiting]
                if not len(active):
                    break
            kv.rows = None
            logits = _coda_head(model, state, kv)
            kv.length += 1
            steps.append(used)
            final_states.append(state[:, 0].clone())
            flops.append(inference_flops_per_token(cfg, float(used.float().mean()), position + 1,
                                                   1 + checks / batch))
        return GenerationResult(
            tokens=tokens, steps=torch.stack(steps[: tokens.shape[1] - prompt_len], dim=1),
            flops_per_token=sum(flops[1:]) / len(flops[1:]) if len(flops) > 1 else flops[0], cache_bytes_per_token=kv.bytes_per_token(),
            seconds=time.perf_counter() - t0, initial_states=initial_states, final_states=final_states,
            logprobs=torch.stack(logprobs, dim=1),
        )
    finally:
        model.train(was_training)


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

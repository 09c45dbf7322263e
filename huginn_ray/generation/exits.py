"""Exit criteria: when a forward of generation stops iterating the core.

The criterion is checked after iteration t when t > min_steps and (t - 1 - min_steps) % check_every == 0 (the
release's `min_steps` and `check_criterion_every_n_steps`: by default after every iteration; `is_check`). A
forward exits when the criterion's quantity falls below its threshold (`argmax-stability`: when the argmax has
stayed the same for that many consecutive checks); a threshold of 0 turns exits off (where the release's
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
Logit-based criteria (LOGIT_CRITERIA) read the last position's logits over the V = vocab_size real tokens (the
released model has no padding rows: V = 65536 there), for which generation runs the coda and head at every check.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

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

    @staticmethod
    def quantities(criteria: list["ExitCriterion"], state: Tensor, logits: Tensor | None) -> Tensor:
        """The criterion's value for several sequences' criteria of one name at once, shape (rows,), given their
        states (rows, positions, D), all of one length, and their last positions' logits (rows, V); each
        criterion remembers its row's state / distribution as its next check's comparand. Every reduction runs
        within a row, so a row's value does not depend on the others."""
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

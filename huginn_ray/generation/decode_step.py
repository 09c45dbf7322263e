"""The engine's decode step: one core iteration of every slot and, on the host's schedule, the finish of the
forwards that ended, over all B slots with fixed shapes and no read of the device.

    decode_step(model, slots, kind)     # slots: huginn_ray.generation.slots.Slots; kind: StepKind

The core runs over all B slots; the rows not iterating (empty slots, forwards that ended and wait for the
finish) are computed and discarded: their state is kept (`torch.where`) and their cache writes go to the trash
slot. Each row's criterion is checked on the device at its own iteration (`is_check`'s rule on tensors), and a
row whose forward ends sets `exited`. A finish step then runs the coda and head over all B slots, picks the
tokens of the `exited` rows (greedy, or temperature / top-k / top-p with the request's pre-drawn exponential
draw: `torch.multinomial(p, 1)` is argmax(p / q), q ~ Exp(1), so the token equals batch-1 generation's),
commits their positions, writes the outputs the host reads after the step, and starts their next forwards
(prelude of the new token, initial state from the pre-drawn noise or the last final state); a row that emitted
a stop token or its last token becomes inactive. What a step computes beyond that depends only on `StepKind`,
which the host knows without reading the device: the column bucket, whether it finishes, the criteria and
sampling modes its requests use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from huginn_ray.generation.exits import ENTROPY_EPS, ENTROPY_START, LOGIT_CRITERIA, kl, minp
from huginn_ray.generation.slots import CRITERION_CODES, SlotAttention, Slots, core_reads, past_mask
from huginn_ray.model.model import RecurrentGPT


@dataclass(frozen=True)
class StepKind:
    """What one decode step computes: with the slots' buffer shapes, the key of a captured graph."""

    columns: int
    """Positions of every slot the attention reads (a power of two, at least the furthest row's need)."""
    finish: bool
    """Whether the step finishes the ended forwards (every exit_wait_steps + 1 steps)."""
    criteria: tuple[str, ...] = ()
    """The exit criteria of the requests in the slots (sorted): only their quantities are computed."""
    sampling: bool = False
    """Whether the step finishes and some request samples (temperature > 0); else every token is an argmax."""
    top_k: bool = False
    """Whether the step finishes and some request restricts sampling to its top-k tokens."""
    top_p: bool = False
    """Whether the step finishes and some request restricts sampling to a top-p set."""
    latest: bool = True
    """Whether some request keeps latest copies (`latest`, `ring:N`); else the core writes none."""


def decode_step(model: RecurrentGPT, slots: Slots, kind: StepKind) -> None:
    """One step (the module docstring): every result lands in the slots' buffers."""
    core(model, slots, kind)
    if kind.finish:
        finish(model, slots, kind)


def core(model: RecurrentGPT, slots: Slots, kind: StepKind) -> None:
    """One core iteration of every iterating row, then their criteria: rows whose forward ends set `exited`."""
    iterating = slots.active & ~slots.exited
    plane = slots.iteration % slots.kept
    rope = model.freqs_cis[0, slots.position][:, None]
    read_plane, mask = core_reads(slots, kind.columns, plane)
    cache = SlotAttention(slots, kind.columns, slots.position, iterating, mask, plane, kind.latest, read_plane)
    new = model.core_step(slots.state[:, None], slots.injected[:, None], rope, cache, 0)[:, 0]
    slots.state.copy_(torch.where(iterating[:, None], new, slots.state))
    iteration = slots.iteration + iterating.long()
    slots.iteration.copy_(iteration)
    ends = iterating & (iteration >= slots.num_steps)
    if kind.criteria:
        check = (iterating & (slots.criterion > 0) & (iteration < slots.num_steps) & (iteration > slots.min_steps)
                 & ((iteration - 1 - slots.min_steps) % slots.check_every == 0))
        logits = None
        if LOGIT_CRITERIA.intersection(kind.criteria):
            logits = coda_head(model, slots, kind.columns, rope, iterating)
        ends = ends | exits(slots, kind.criteria, check, slots.state[:, None].float(), logits)
    slots.exited.copy_(slots.exited | ends)


def coda_head(model: RecurrentGPT, slots: Slots, columns: int, rope: Tensor, write: Tensor) -> Tensor:
    """(B, V) fp32 logits of every slot's current state; the coda's keys/values of the rows `write` marks go
    to their position (those of a forward that goes on are overwritten by its later coda)."""
    cache = SlotAttention(slots, columns, slots.position, write, past_mask(slots.position, columns))
    return model.coda_and_head(slots.state[:, None], rope, cache)[:, : model.config.vocab_size]


def exits(slots: Slots, criteria: tuple[str, ...], check: Tensor, state: Tensor, logits: Tensor | None) -> Tensor:
    """(B,) which rows' checks end their forwards, each by its own criterion and threshold (a threshold of 0
    never does); each checked row keeps its quantity's comparand for its next check. The quantities are those
    of huginn_ray.generation.exits.ExitCriterion.quantities, over all rows at once."""
    ends = torch.zeros_like(check)
    for name in criteria:
        rows = check & (slots.criterion == CRITERION_CODES[name])
        if name in ("latent-diff", "cosine"):
            previous = slots.previous_state
            if name == "latent-diff":
                value = ((state - previous).norm(dim=-1) / state.norm(dim=-1)).mean(dim=-1)
            else:
                cosine = (state * previous).sum(-1) / (state.norm(dim=-1) * previous.norm(dim=-1)).clamp_min(1e-30)
                value = 1 - cosine.mean(dim=-1)
            slots.previous_state.copy_(torch.where(rows[:, None, None], state, previous))
        elif name == "entropy-diff":
            probs = logits.softmax(dim=-1)
            entropy = -(probs * (probs + ENTROPY_EPS).log()).sum(dim=-1)
            value = (entropy - slots.previous_entropy).abs()
            slots.previous_entropy.copy_(torch.where(rows, entropy, slots.previous_entropy))
        elif name == "argmax-stability":
            argmax = logits.argmax(dim=-1)
            stable = torch.where(argmax == slots.previous_argmax, slots.stable + 1, 0)
            slots.previous_argmax.copy_(torch.where(rows, argmax, slots.previous_argmax))
            slots.stable.copy_(torch.where(rows, stable, slots.stable))
            value = stable.float()
        else:  # kl, minp-kl
            logp = logits.log_softmax(dim=-1) if name == "kl" else minp(logits, logits.shape[-1])
            value = kl(slots.previous_logp, logp)
            slots.previous_logp.copy_(torch.where(rows[:, None], logp, slots.previous_logp))
        hit = value >= slots.threshold if name == "argmax-stability" else value < slots.threshold
        ends = ends | (rows & hit & (slots.threshold > 0))
    return ends


def pick(logits: Tensor, slots: Slots, kind: StepKind) -> Tensor:
    """(B,) each row's token: huginn_ray.generation.requests.pick with the row's own settings, its multinomial
    draw replaced by the row's pre-drawn exponential one (the same token)."""
    greedy = logits.argmax(dim=-1)
    if not kind.sampling:
        return greedy
    sampled = slots.temperature > 0
    scaled = logits / torch.where(sampled, slots.temperature, 1.0)[:, None]
    if kind.top_k:  # the k-th largest (k = V: no restriction)
        kth = scaled.sort(dim=-1, descending=True).values.gather(1, (slots.top_k - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)
    if kind.top_p:
        ordered, order = probs.sort(dim=-1, descending=True)
        outside = ordered.cumsum(dim=-1) - ordered >= slots.top_p[:, None]
        kept = probs.scatter(-1, order, ordered.masked_fill(outside, 0.0))
        probs = torch.where((slots.top_p < 1)[:, None], kept, probs)
    return torch.where(sampled, (probs / slots.next_exponential).argmax(dim=-1), greedy)


def finish(model: RecurrentGPT, slots: Slots, kind: StepKind) -> None:
    """The finish of the `exited` rows (the module docstring)."""
    ending, position = slots.exited, slots.position
    rope = model.freqs_cis[0, position][:, None]
    token = pick(coda_head(model, slots, kind.columns, rope, ending), slots, kind)
    rows = torch.arange(slots.rows, device=slots.device)
    slots.cache.depths.index_put_((torch.where(ending, rows, slots.rows), position), slots.iteration)
    emitted = slots.emitted + ending.long()
    done = emitted >= slots.max_new
    if slots.stop.shape[1]:
        done = done | (slots.stop == token[:, None]).any(dim=-1)
    done = ending & done
    going_on = ending & ~done
    for out, value in zip(slots.outputs(), (token, ending, slots.iteration, done)):
        out.copy_(value)
    # the next forwards: prelude of the new token at the next position, initial state, fresh comparands
    position = position + going_on.long()
    cache = SlotAttention(slots, kind.columns, position, going_on, past_mask(position, kind.columns))
    embedded = model.embed_and_prelude(token[:, None], model.freqs_cis[0, position][:, None], cache)
    injected = model.inject(embedded)[:, 0]
    if model.config.state_init == "zero":
        noise = torch.zeros_like(slots.state)
    else:
        noise = model.noise_from_uniform(slots.next_uniform.clone())
    initial = torch.where(slots.warm[:, None], slots.state, noise)
    slots.state.copy_(torch.where(going_on[:, None], initial, slots.state))
    slots.injected.copy_(torch.where(going_on[:, None], injected, slots.injected))
    slots.position.copy_(position)
    slots.iteration.copy_(torch.where(going_on, 0, slots.iteration))
    slots.emitted.copy_(emitted)
    slots.exited.copy_(slots.exited & ~ending)
    slots.active.copy_(slots.active & ~done)
    begin_comparands(slots, going_on, initial, kind.criteria)


def begin_comparands(slots: Slots, rows: Tensor, initial: Tensor, criteria: tuple[str, ...]) -> None:
    """A fresh forward's criterion comparands for `rows`, from its initial states (B, D)
    (huginn_ray.generation.exits.ExitCriterion's starting values): those of `criteria` only, the criteria of
    every request in flight (a slot's others are set when a request is loaded into it)."""
    if "latent-diff" in criteria or "cosine" in criteria:
        slots.previous_state.copy_(torch.where(rows[:, None, None], initial[:, None].float(), slots.previous_state))
    if "entropy-diff" in criteria:
        slots.previous_entropy.copy_(torch.where(rows, ENTROPY_START, slots.previous_entropy))
    if "argmax-stability" in criteria:
        slots.previous_argmax.copy_(torch.where(rows, -1, slots.previous_argmax))
        slots.stable.copy_(torch.where(rows, 0, slots.stable))
    if "kl" in criteria or "minp-kl" in criteria:
        V = slots.previous_logp.shape[1]
        slots.previous_logp.copy_(torch.where(rows[:, None], -math.log(V), slots.previous_logp))

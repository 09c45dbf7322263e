"""Adaptive-compute generation: exits against hand computations, caches against the full cache, warm start."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from huginn_ray.model import KVCache, ModelConfig, RecurrentGPT
from huginn_ray.model.flops import inference_flops_per_token
from huginn_ray.model.generate import DEFAULT_THRESHOLDS, ExitCriterion, generate

CRITERIA = list(DEFAULT_THRESHOLDS)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one thread is fastest, and much faster than many on a shared, loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return RecurrentGPT(ModelConfig.from_name("raven-tiny", state_init="zero")).eval()


@pytest.fixture(scope="module")
def prompt():
    torch.manual_seed(1)
    return torch.randint(0, 4000, (2, 6))


@pytest.mark.parametrize("criterion", CRITERIA)
def test_threshold_zero_is_fixed_depth_greedy(model, prompt, criterion):
    result = generate(model, prompt, 6, num_steps=8, exit_criterion=criterion, exit_threshold=0)
    assert torch.equal(result.tokens, model.generate(prompt, 6, num_steps=8))
    assert (result.steps == 8).all()


@pytest.mark.parametrize("cache", ["latest", "ring:5", "ring:8"])
def test_caches_equal_the_full_cache_at_fixed_depth(model, prompt, cache):
    result = generate(model, prompt, 6, num_steps=5, cache=cache)
    assert torch.equal(result.tokens, model.generate(prompt, 6, num_steps=5))


def test_ring_cache_bounds_memory(model, prompt):
    full = generate(model, prompt, 4, num_steps=8, cache="latest").cache_bytes_per_token
    ring = generate(model, prompt, 4, num_steps=8, cache="ring:2").cache_bytes_per_token
    cfg = model.config
    entry = 2 * cfg.n_embd * 4  # K and V of one block at one position, fp32
    blocks = cfg.n_layers_in_prelude + cfg.n_layers_in_coda
    assert full == entry * (blocks + cfg.n_layers_in_recurrent_block * (8 + 1))  # + the latest-iteration copy
    assert ring == entry * (blocks + cfg.n_layers_in_recurrent_block * (2 + 1))


@torch.no_grad()
def hand_trajectory(model, prompt, depth):
    """For the second generated token: the latent state and next-token log-probs after each iteration 1..depth,
    computed with the model's own forward and full KVCache."""
    cache = KVCache()
    first = model(prompt, num_steps=(depth, 0), cache=cache).logits[:, -1, : model.config.vocab_size].argmax(-1)
    states = []
    hook = model.transformer.core_block[-1].register_forward_hook(lambda m, i, o: states.append(o[:, -1].clone()))
    try:
        logps = []
        for t in range(1, depth + 1):
            states.clear()
            logits = model(first[:, None], num_steps=(t, 0), cache=copy.deepcopy(cache)).logits
            logps.append(logits[:, -1, : model.config.vocab_size].log_softmax(-1))
    finally:
        hook.remove()
    return [torch.zeros_like(states[0])] + states, logps  # s_0 = 0 (state_init zero) ... s_depth


def hand_quantities(name, states, logps, checks):
    """The criterion's quantity at each checked iteration, written out from its definition."""
    vocab = logps[0].shape[-1]
    prev = torch.full_like(logps[0], -math.log(vocab))
    prev_argmax, stable, values = None, 0, {}
    for t in checks:
        s, s_prev, logp = states[t][0], states[t - 1][0], logps[t - 1][0]
        if name == "latent-diff":
            values[t] = float((s - s_prev).norm() / s.norm())
        elif name == "cosine":
            values[t] = float(1 - (s @ s_prev) / (s.norm() * s_prev.norm()))
        else:
            p, q = prev[0].exp(), logp.exp()
            if name == "entropy-diff":
                values[t] = float(abs((q * logp).sum() - (p * prev[0]).sum()))
            elif name == "kl":
                values[t] = float((p * (prev[0] - logp)).sum())
            elif name == "minp-kl":
                def floor(x):
                    x = torch.where(x < 0.1 * x.max(), torch.full_like(x, 1e-6), x)
                    return x / x.sum()
                a, b = floor(p), floor(q)
                values[t] = float((a * (a.log() - b.log())).sum())
            else:
                argmax = int(logp.argmax())
                stable = stable + 1 if argmax == prev_argmax else 0
                prev_argmax = argmax
                values[t] = float(stable)
            prev = logp[None]
    return values


@pytest.mark.parametrize("criterion", CRITERIA)
@pytest.mark.parametrize("check_every", [1, 2])
def test_each_criterion_exits_where_its_quantity_first_falls_below_threshold(model, prompt, criterion, check_every):
    depth, min_steps = 12, 2
    one = prompt[:1]
    states, logps = hand_trajectory(model, one, depth)
    checks = [t for t in range(min_steps, depth) if t % check_every == 0]
    values = hand_quantities(criterion, states, logps, checks)
    if criterion == "argmax-stability":
        threshold = max(max(values.values()), 1.0)
        expected = next((t for t in checks if values[t] >= threshold), depth)
    else:  # a threshold between checked values, so that the exit lands inside the recurrence
        ordered = sorted(values.values())
        threshold = (ordered[0] + ordered[1]) / 2
        expected = next((t for t in checks if values[t] < threshold), depth)
    assert expected < depth or criterion == "argmax-stability"
    result = generate(model, one, 2, num_steps=depth, exit_criterion=criterion, exit_threshold=threshold,
                      min_steps=min_steps, check_every=check_every)
    assert result.steps[0].tolist() == [depth, expected], values



def test_latent_quantities_are_the_specified_formulas():
    # the exit-position test above cannot tell ||s_t|| from ||s_{t-1}|| in the denominator on a converging
    # trajectory; this one holds the values themselves
    g = torch.Generator().manual_seed(0)
    state, previous = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    rows = torch.arange(2)
    latent = ExitCriterion("latent-diff", 0.03, 16, 2, "cpu").quantity(rows, state, previous, None)
    cosine = ExitCriterion("cosine", 1e-3, 16, 2, "cpu").quantity(rows, state, previous, None)
    for r in range(2):
        s, p = state[r], previous[r]
        assert latent[r].item() == pytest.approx(float((s - p).norm() / s.norm()), rel=1e-6)
        assert cosine[r].item() == pytest.approx(float(1 - (s @ p) / (s.norm() * p.norm())), rel=1e-5)

def test_batch_rows_exit_on_their_own(model, prompt):
    together = generate(model, prompt, 6, num_steps=10, exit_criterion="kl", exit_threshold=5e-3)
    assert together.steps[:, 1:].unique().numel() > 1
    for row in range(prompt.shape[0]):
        alone = generate(model, prompt[row : row + 1], 6, num_steps=10, exit_criterion="kl", exit_threshold=5e-3)
        assert torch.equal(alone.tokens[0], together.tokens[row])
        assert torch.equal(alone.steps[0], together.steps[row])


@torch.no_grad()
def test_warm_start_starts_from_the_previous_final_state(model, prompt):
    cold = generate(model, prompt, 4, num_steps=6)
    assert all((s == 0).all() for s in cold.initial_states)  # state_init zero
    warm = generate(model, prompt, 4, num_steps=6, warm_start=True)
    for k in range(1, len(warm.initial_states)):
        assert torch.equal(warm.initial_states[k], warm.final_states[k - 1])
    # the second token computed by hand from that initial state
    cache = KVCache()
    logits = model(prompt, num_steps=(6, 0), cache=cache).logits[:, -1, :4096]
    first = logits.argmax(-1)
    start = warm.final_states[0][:, None]
    second = model(first[:, None], num_steps=(6, 0), cache=cache, input_states=start).logits[:, -1, :4096].argmax(-1)
    assert torch.equal(warm.tokens[:, 6:8], torch.stack([first, second], dim=1))


def test_logit_criteria_count_their_coda_and_head(model, prompt):
    cfg = model.config
    latent = generate(model, prompt, 3, num_steps=6, exit_criterion="latent-diff", exit_threshold=0)
    logit = generate(model, prompt, 3, num_steps=6, exit_criterion="kl", exit_threshold=0)
    coda_head = inference_flops_per_token(cfg, 0, 8, 1) - inference_flops_per_token(cfg, 0, 8, 0)
    # 2 decoded tokens at context 7 and 8; the kl run checked after iterations 1..5 of each
    contexts = [7, 8]
    coda_heads = [inference_flops_per_token(cfg, 0, c, 1) - inference_flops_per_token(cfg, 0, c, 0) for c in contexts]
    assert logit.flops_per_token - latent.flops_per_token == pytest.approx(5 * sum(coda_heads) / 2)
    assert coda_head > 0


def test_bad_arguments_are_named(model, prompt):
    with pytest.raises(ValueError, match="unknown exit criterion"):
        generate(model, prompt, 2, exit_criterion="entropy")
    with pytest.raises(ValueError, match="ring:N"):
        generate(model, prompt, 2, cache="ring:0")

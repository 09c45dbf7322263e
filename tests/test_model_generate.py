"""Adaptive-compute generation: exits against hand computations, caches against the full cache, warm start."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from huginn_ray.model import KVCache, ModelConfig, RecurrentGPT
from huginn_ray.model.flops import inference_flops_per_token
from huginn_ray.generation.exits import DEFAULT_THRESHOLDS, ExitCriterion
from huginn_ray.generation.generate import generate
from huginn_ray.model.attention import rotate

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
    assert torch.equal(result.tokens, generate(model, prompt, 6, num_steps=8).tokens)  # no criterion: fixed depth
    assert (result.steps == 8).all()


@pytest.mark.parametrize("cache", ["full", "latest", "ring:5", "ring:8"])
def test_caches_equal_the_full_cache_at_fixed_depth(model, prompt, cache):
    result = generate(model, prompt, 6, num_steps=5, cache=cache)
    assert torch.equal(result.tokens, generate(model, prompt, 6, num_steps=5, cache="full").tokens)


def test_ring_cache_bounds_memory(model, prompt):
    full = generate(model, prompt, 4, num_steps=8, cache="full").cache_bytes_per_token
    latest = generate(model, prompt, 4, num_steps=8, cache="latest").cache_bytes_per_token
    ring = generate(model, prompt, 4, num_steps=8, cache="ring:2").cache_bytes_per_token
    cfg = model.config
    entry = 2 * cfg.n_embd * 4  # K and V of one block at one position, fp32
    blocks = cfg.n_layers_in_prelude + cfg.n_layers_in_coda
    assert full == entry * (blocks + cfg.n_layers_in_recurrent_block * 8)
    assert latest == entry * (blocks + cfg.n_layers_in_recurrent_block * (8 + 1))  # + the latest-iteration copy
    assert ring == entry * (blocks + cfg.n_layers_in_recurrent_block * (2 + 1))


@pytest.fixture(scope="module")
def noisy_model():
    """The released initial state (noise), so that the latent criteria's first comparand is not zero."""
    torch.manual_seed(0)
    return RecurrentGPT(ModelConfig.from_name("raven-tiny")).eval()


@torch.no_grad()
def prefill_trajectory(model, prompt, initial, depth):
    """The prefill's latent states s_0..s_depth (batch, positions, D) and its last position's next-token
    logits after each iteration 1..depth, from the model's own uncached forward."""
    states = [initial]
    hook = model.transformer.core_block[-1].register_forward_hook(lambda m, i, o: states.append(o.clone()))
    try:
        model(prompt, num_steps=(depth, 0), input_states=initial)
    finally:
        hook.remove()
    logits = [model(prompt, num_steps=(t, 0), input_states=initial).logits[:, -1, : model.config.vocab_size]
              for t in range(1, depth + 1)]
    return states, logits


def released_quantities(name, states, logits, checks, vocab):
    """The criterion's value at each checked iteration, written out from the released evaluators' definitions:
    comparand = the previous check (first: the initial state / uniform / entropy 100), minp floor 1/V."""
    previous_state, previous_entropy = states[0][0], 100.0
    previous_logp = torch.full((vocab,), math.log(1 / vocab))
    previous_argmax, stable, values = None, 0, {}
    for t in checks:
        s, z = states[t][0], logits[t - 1][0]
        p = z.softmax(-1)
        if name == "latent-diff":
            values[t] = float(((s - previous_state).norm(dim=-1) / s.norm(dim=-1)).mean())
            previous_state = s
        elif name == "cosine":
            cos = (s * previous_state).sum(-1) / s.norm(dim=-1) / previous_state.norm(dim=-1)
            values[t] = float(1 - cos.mean())
            previous_state = s
        elif name == "entropy-diff":
            entropy = float(-(p * torch.log(p + 1e-10)).sum())
            values[t] = abs(entropy - previous_entropy)
            previous_entropy = entropy
        elif name in ("kl", "minp-kl"):
            if name == "minp-kl":
                p = torch.where(p < 0.1 * p.max(), torch.full_like(p, 1 / vocab), p)
                p = p / p.sum()
            logp = p.log()
            values[t] = float((previous_logp.exp() * (previous_logp - logp)).sum())
            previous_logp = logp
        else:
            argmax = int(z.argmax())
            stable = stable + 1 if argmax == previous_argmax else 0
            previous_argmax = argmax
            values[t] = float(stable)
    return values


@pytest.mark.parametrize("criterion", CRITERIA)
@pytest.mark.parametrize("min_steps,check_every", [(0, 1), (1, 3)])
def test_each_criterion_exits_where_its_released_quantity_first_falls_below_threshold(
        noisy_model, criterion, min_steps, check_every):
    depth, model = 14, noisy_model
    torch.manual_seed(3)
    one = torch.randint(0, 4000, (1, 5))
    initial = model.initial_state(model.transformer.wte(one))
    states, logits = prefill_trajectory(model, one, initial, depth)
    checks = [t for t in range(1, depth) if t > min_steps and (t - 1 - min_steps) % check_every == 0]
    assert checks == ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13] if check_every == 1 else [2, 5, 8, 11])
    values = released_quantities(criterion, states, logits, checks, model.config.vocab_size)
    if criterion == "argmax-stability":
        threshold = max(max(values.values()), 1.0)
        expected = next((t for t in checks if values[t] >= threshold), depth)
    else:  # a threshold between checked values, so that the exit lands inside the recurrence
        ordered = sorted(values.values())
        threshold = (ordered[0] + ordered[1]) / 2
        expected = next((t for t in checks if values[t] < threshold), depth)
    assert expected < depth or criterion == "argmax-stability"
    result = generate(model, one, 1, num_steps=depth, exit_criterion=criterion, exit_threshold=threshold,
                      min_steps=min_steps, check_every=check_every, input_states=initial)
    assert result.steps[0].tolist() == [expected], values
    assert torch.equal(result.final_states[0], states[expected][:, -1])


def test_minp_floor_and_entropy_start_are_the_released_ones():
    vocab = 8
    logits = torch.tensor([[4.0, 3.0, 1.0, 0.0, -1.0, -2.0, -3.0, -5.0]])
    state = torch.zeros(1, 1, 4)
    p = logits[0].softmax(-1)  # entries below 0.1 x max: 1/8 each, then renormalised
    floored = torch.where(p < 0.1 * p.max(), torch.full_like(p, 1 / vocab), p)
    floored = floored / floored.sum()
    minp = ExitCriterion("minp-kl", 1e-5, vocab, state)
    assert ExitCriterion.quantities([minp], state, logits).item() == pytest.approx(
        float((torch.full((vocab,), 1 / vocab) * (math.log(1 / vocab) - floored.log())).sum()), rel=1e-6)
    entropy = ExitCriterion("entropy-diff", 1e-3, vocab, state)
    h = float(-(p * torch.log(p + 1e-10)).sum())
    assert ExitCriterion.quantities([entropy], state, logits).item() == pytest.approx(100.0 - h, rel=1e-6)


def test_entropy_diff_first_check_compares_with_100(noisy_model):
    # threshold 50: every later entropy change is below it, the first check's |H_1 - 100| is not (a start at
    # log V would exit there)
    depth, model = 6, noisy_model
    torch.manual_seed(4)
    one = torch.randint(0, 4000, (1, 5))
    initial = model.initial_state(model.transformer.wte(one))
    states, logits = prefill_trajectory(model, one, initial, depth)
    values = released_quantities("entropy-diff", states, logits, [1, 2], model.config.vocab_size)
    assert values[1] > 50 > values[2]
    result = generate(model, one, 1, num_steps=depth, exit_criterion="entropy-diff", exit_threshold=50,
                      input_states=initial)
    assert result.steps[0].tolist() == [2]


def masked_sandwich(block, x, rope, mask):
    """A sandwich block written out with an explicit (positions, positions) attention mask."""
    attn, (batch, length, width) = block.attn, x.shape
    h = block.norm_1(x)
    q, k, v = attn.Wqkv(h).view(batch, length, 3, attn.heads, attn.head_dim).unbind(dim=2)
    q, k = rotate(q + attn.qk_bias[0], rope), rotate(k + attn.qk_bias[1], rope)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    x = block.norm_2(attn.proj(y.transpose(1, 2).reshape(batch, length, width)) + x)
    return block.norm_4(block.mlp(block.norm_3(x)) + x)


@torch.no_grad()
def masked_forward(model, ids, depths):
    """All positions at once: position p runs depths[p] core iterations, and at iteration i a query attends to
    the past positions that ran iteration i (itself included); prelude and coda attend causally."""
    length = ids.shape[1]
    rope = model.freqs_cis[:, :length]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    x = model.transformer.wte(ids) * model.config.embedding_scale
    for block in model.transformer.prelude:
        x = masked_sandwich(block, x, rope, causal)
    embedded, state = x, torch.zeros_like(x)  # state_init zero
    for i in range(int(depths.max())):
        reached = depths > i
        mask = causal & (reached[None, :] | torch.eye(length, dtype=torch.bool))
        h = model.transformer.adapter(torch.cat([state, embedded], dim=-1))
        for block in model.transformer.core_block:
            h = masked_sandwich(block, h, rope, mask)
        state = torch.where(reached[None, :, None], h, state)
    x = model.transformer.ln_f(state)
    for block in model.transformer.coda:
        x = masked_sandwich(block, x, rope, causal)
    return model.lm_head(model.transformer.ln_f(x)).float()[..., : model.config.vocab_size]


@pytest.mark.parametrize("exit_in_prefill", [True, False])
def test_full_cache_attends_exactly_to_the_positions_that_reached_the_iteration(model, prompt, exit_in_prefill):
    one = prompt[:1]
    result = generate(model, one, 8, num_steps=10, exit_criterion="kl", exit_threshold=2e-2,
                      exit_in_prefill=exit_in_prefill)
    steps = result.steps[0]
    # depth of each position that was run: the prompt's from the prefill, then each generated token's forward
    depths = torch.cat([steps[:1].repeat(one.shape[1]), steps[1:]])
    assert any(depths[p] < depths[q] for p in range(len(depths)) for q in range(p + 1, len(depths)))
    assert (steps[0] == 10) != exit_in_prefill
    logits = masked_forward(model, result.tokens[:, :-1], depths)
    emitted = result.tokens[0, one.shape[1]:]
    positions = torch.arange(one.shape[1] - 1, result.tokens.shape[1] - 1)
    hand = logits[0, positions].log_softmax(-1).gather(1, emitted[:, None])[:, 0]
    assert torch.equal(logits[0, positions].argmax(-1), emitted)
    assert torch.allclose(result.logprobs[0], hand, atol=1e-5, rtol=0), (result.logprobs[0] - hand).abs().max()

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


def test_a_forward_that_exits_at_a_logit_check_emits_from_that_check(model, prompt):
    # kl is checked after every iteration: a forward that exits after t iterations ran the coda + head t times
    # (its last check gave the token), one that ran all 10 ran it 9 times at checks and once at the end
    result = generate(model, prompt[:1], 6, num_steps=10, exit_criterion="kl", exit_threshold=5e-3)
    steps = result.steps[0].tolist()
    assert min(steps[1:]) < 10
    context = prompt.shape[1]
    expected = [inference_flops_per_token(model.config, t, context + 1 + i, t) for i, t in enumerate(steps[1:])]
    assert result.flops_per_token == pytest.approx(sum(expected) / len(expected), rel=1e-12)


def test_bad_arguments_are_named(model, prompt):
    with pytest.raises(ValueError, match="unknown exit criterion"):
        generate(model, prompt, 2, exit_criterion="entropy")
    with pytest.raises(ValueError, match="ring:N"):
        generate(model, prompt, 2, cache="ring:0")

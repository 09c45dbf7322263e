"""Regional compilation (compile_blocks) and the chunked loss against the eager model, on CPU at tiny shapes."""

import pytest
import torch
from torch._dynamo.utils import counters

from huginn_ray.model import KVCache, ModelConfig, RecurrentGPT, chunked_cross_entropy
from huginn_ray.train.parallelize import compile_blocks

VOCAB = 512


def tiny(**overrides) -> ModelConfig:
    return ModelConfig.from_name("raven-tiny", vocab_size=VOCAB, n_embd=32, num_attention_heads=2,
                                 intermediate_size=64, block_size=64, **overrides)


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def run(model, x, num_steps, start, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x, labels=x, num_steps=num_steps, input_states=start).loss
    loss.backward()
    return loss.detach(), grads(model)


@pytest.fixture(scope="module")
def pair():
    """An eager model and a compiled copy with the same weights (compiled once for the whole module)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = RecurrentGPT(tiny())
    compiled = RecurrentGPT(tiny())
    compiled.load_state_dict(eager.state_dict())
    compile_blocks(compiled)
    return eager, compiled


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_blocks_match_eager_loss_and_gradients(pair, checkpointing):
    eager, compiled = pair
    x = torch.randint(0, VOCAB, (2, 16))
    start = torch.randn(2, 16, 32)
    for model in pair:
        model.config = tiny(activation_checkpointing=checkpointing)
    (loss_e, grads_e), (loss_c, grads_c) = (run(m, x, (2, 2), start) for m in (eager, compiled))
    assert state_dict_keys_unchanged(compiled)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert grads_e.keys() == grads_c.keys()
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-4, atol=1e-6, msg=name)


def state_dict_keys_unchanged(model) -> bool:
    return all("_orig_mod" not in key for key in model.state_dict())


def test_new_depths_do_not_recompile(pair):
    _, compiled = pair
    compiled.config = tiny()
    x = torch.randint(0, VOCAB, (2, 16))
    run(compiled, x, (1, 2), None)  # compiles the grad and the no-grad variants (if not yet)
    before = dict(counters["stats"])
    for depth in range(1, 13):
        run(compiled, x, depth if depth > 2 else (0, depth), None)
        compiled.train()
    assert counters["stats"]["unique_graphs"] == before.get("unique_graphs", 0)
    assert counters["stats"].get("calls_captured", 0) == before.get("calls_captured", 0)


def test_compiled_blocks_under_bf16_autocast_and_with_kv_cache(pair):
    eager, compiled = pair
    for model in pair:
        model.config = tiny()
    x = torch.randint(0, VOCAB, (2, 16))
    start = torch.randn(2, 16, 32)
    (loss_e, grads_e), (loss_c, grads_c) = (run(m, x, (1, 2), start, autocast=True) for m in (eager, compiled))
    torch.testing.assert_close(loss_c, loss_e, rtol=2e-2, atol=2e-2)
    # generation with a KV cache runs the eager block and gives the eager tokens
    eager.eval(), compiled.eval()
    try:
        prompt = torch.randint(0, VOCAB, (1, 5))
        with torch.no_grad():
            cache = KVCache()
            stepped = compiled(prompt, num_steps=2, cache=cache, input_states=torch.zeros(1, 5, 32)).logits
            full = eager(prompt, num_steps=2, input_states=torch.zeros(1, 5, 32)).logits
        torch.testing.assert_close(stepped, full, rtol=1e-4, atol=1e-5)
    finally:
        eager.train(), compiled.train()


@pytest.mark.parametrize("autocast", [False, True])
def test_chunked_loss_equals_full_logits_loss(autocast):
    torch.manual_seed(0)
    model = RecurrentGPT(tiny())
    x = torch.randint(0, VOCAB, (2, 24))
    labels = x.clone()
    labels[0, :5] = 7  # an ignored id inside the vocabulary, as validation ignores pad
    start = torch.randn(2, 24, 32)
    results = []
    for chunk in (0, 10):  # 48 tokens in chunks of 10: the last chunk is partial
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x, labels=labels, num_steps=(1, 2), input_states=start, ignore_index=7,
                        loss_chunk_tokens=chunk)
        (out.loss * 0.25).backward()  # a non-unit incoming gradient, as with gradient accumulation
        results.append((out, grads(model)))
    (full, grads_full), (chunked, grads_chunked) = results
    assert full.logits is not None and chunked.logits is None
    tol = dict(rtol=2e-2, atol=1e-3) if autocast else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(chunked.loss, full.loss, **tol)
    for name in grads_full:
        torch.testing.assert_close(grads_chunked[name], grads_full[name], **tol, msg=name)
    # logits stay available when asked for
    asked = model(x, labels=labels, num_steps=(1, 2), input_states=start, ignore_index=7, return_logits=True,
                  loss_chunk_tokens=10)
    assert asked.logits is not None and asked.logits.dtype == torch.float32


def test_chunked_cross_entropy_function_without_grad():
    h, w = torch.randn(3, 5, 8), torch.randn(16, 8)
    labels = torch.randint(0, 16, (3, 5))
    expected = torch.nn.functional.cross_entropy((h @ w.T).view(-1, 16), labels.view(-1))
    with torch.no_grad():
        torch.testing.assert_close(chunked_cross_entropy(h, w, labels, 4), expected)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_cross_entropy(h, w, labels, 0)


@pytest.mark.parametrize("chunk", [10, 48, 100])  # a partial last chunk, one exact chunk, one chunk past the end
def test_chunked_cross_entropy_gradients_equal_unchunked_with_tied_weight(chunk):
    # the head weight is also the embedding (tied, as lm_head and wte are): its gradient sums both uses
    torch.manual_seed(0)
    wte = torch.nn.Embedding(VOCAB, 32)
    mix = torch.randn(32, 32) / 32**0.5
    ids = torch.randint(0, VOCAB, (2, 24))
    labels = torch.randint(0, VOCAB, (2, 24))
    labels[0, :5] = labels[1, -3:] = -100  # ignored rows at the start and in the last chunk
    results = []
    for chunked in (False, True):
        wte.zero_grad(set_to_none=True)
        hidden = torch.tanh(wte(ids) @ mix)
        hidden.retain_grad()
        if chunked:
            loss = chunked_cross_entropy(hidden, wte.weight, labels, chunk)
        else:
            loss = torch.nn.functional.cross_entropy(
                torch.nn.functional.linear(hidden, wte.weight).float().view(-1, VOCAB), labels.view(-1))
        (loss * 3).backward()  # an incoming gradient of 3, not 1
        results.append((loss.detach(), hidden.grad, wte.weight.grad))
    for name, unchunked, chunked in zip(("loss", "hidden", "weight"), *results):
        torch.testing.assert_close(chunked, unchunked, rtol=1e-5, atol=1e-7, msg=name)
    ignored = labels == -100
    assert results[1][1][ignored].eq(0).all() and results[1][1][~ignored].ne(0).all()  # ignored rows: no gradient


def test_chunked_cross_entropy_saves_references_only():
    # what the chunked loss keeps from forward to backward: hidden, the weight and the labels themselves, no
    # gradient- or weight-sized tensor of its own (the gradients are recomputed in backward)
    torch.manual_seed(0)
    model = RecurrentGPT(tiny())
    hidden = torch.randn(2, 24, 32, requires_grad=True) * 1.0
    labels = torch.randint(0, VOCAB, (2, 24))
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        loss = chunked_cross_entropy(hidden, model.lm_head.weight, labels, 10)
    storages = [t.untyped_storage()._cdata for t in packed]
    expected = [x.untyped_storage()._cdata for x in (hidden, model.lm_head.weight, labels)]
    assert storages == expected
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: the one parameter
    loss.backward()
    assert model.lm_head.weight.grad.shape == (VOCAB, 32) and model.lm_head.weight.grad.dtype == torch.float32

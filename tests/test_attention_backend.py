"""Which scaled_dot_product_attention kernel a training run uses (huginn_ray.model.attention: probe, choice, restriction).

This machine has no GPU: the choice is tested with the kernels' availability as an input, written as a GPU would
report it (the `serves` dicts below stand in for `probe_attention_backends` on a CUDA or ROCm device, e.g. an
MI250X whose flash kernel does not take head_dim 96); the probe itself and the restriction run for real on the
CPU, where torch has a flash kernel and no memory-efficient one.
"""

from __future__ import annotations

import dataclasses


import pytest
import torch
from torch.nn.attention import SDPBackend

from huginn_ray.model import ModelConfig, RecurrentGPT
from huginn_ray.model.attention import (AttentionBackendError, AttentionShape, choose_attention_backend,
                                         probe_attention_backends, restrict_attention)
from huginn_ray.train import loop
from huginn_ray.train.stopping import Stop
from test_train_parallel import MemoryReader, plan_for, train_config

NEBEL = AttentionShape(batch=1, heads=55, seq_len=4096, head_dim=96, dtype=torch.bfloat16)
FLASH_REFUSES = "Flash attention kernel not used because: head_dim 96 is not supported on this device"
EFFICIENT_REFUSES = "Memory efficient kernel not used because: not compiled for this architecture"
CUDNN_REFUSES = "CuDNN attention kernel not used because: cuDNN is not available on this device"
FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def test_a_long_sequence_that_only_the_math_kernel_takes_is_refused_naming_the_shape():
    neither = {"flash": FLASH_REFUSES, "efficient": EFFICIENT_REFUSES, "cudnn": CUDNN_REFUSES}
    with pytest.raises(AttentionBackendError) as refused:
        choose_attention_backend(neither, NEBEL, "auto")
    assert str(refused.value) == (
        "only the math attention kernel takes the training shape (micro-batch 1 x 55 heads x seq_len 4096 x "
        "head_dim 96, bfloat16): it would materialise 1 x 55 x 4096^2 scores per call (1.72 GiB), out of memory or "
        "many times slower than a fused kernel. Not taken: flash: Flash attention kernel not used because: head_dim "
        "96 is not supported on this device; efficient: Memory efficient kernel not used because: not compiled for "
        "this architecture; cudnn: CuDNN attention kernel not used because: cuDNN is not available on this device. "
        "Set attention_backend: math to train with the math kernel on purpose, or use a shape a "
        "fused kernel takes")
    assert choose_attention_backend(neither, NEBEL, "math") == "math"  # on purpose
    short = AttentionShape(batch=8, heads=55, seq_len=1024, head_dim=96, dtype=torch.bfloat16)
    assert choose_attention_backend(neither, short, "auto") == "math"  # 1024 tokens: the math kernel may serve


def test_a_fused_kernel_is_chosen_where_one_takes_the_shape_flash_first_cudnn_last():
    every = {"flash": None, "efficient": None, "cudnn": None}
    assert choose_attention_backend(every, NEBEL, "auto") == "flash"
    assert choose_attention_backend({**every, "flash": FLASH_REFUSES}, NEBEL, "auto") == "efficient"
    assert choose_attention_backend({**every, "efficient": EFFICIENT_REFUSES}, NEBEL, "auto") == "flash"
    # a GPU whose flash and memory-efficient kernels do not take head_dim 96, and whose cuDNN does
    assert choose_attention_backend({"flash": FLASH_REFUSES, "efficient": EFFICIENT_REFUSES, "cudnn": None}, NEBEL,
                                    "auto") == "cudnn"
    with pytest.raises(ValueError, match="attention_backend must be 'auto' or 'math', got 'cudnn'"):
        choose_attention_backend(every, NEBEL, "cudnn")


def test_the_probe_on_this_cpu_finds_torch_s_cpu_flash_kernel_and_no_memory_efficient_one():
    serves = probe_attention_backends(AttentionShape(2, 4, 64, 16, torch.float32), torch.device("cpu"))
    assert serves["flash"] is None
    assert serves["efficient"].startswith("No viable backend for scaled_dot_product_attention was found")
    assert serves["cudnn"].startswith("No viable backend for scaled_dot_product_attention was found")
    rng_before = torch.get_rng_state()
    probe_attention_backends(AttentionShape(2, 4, 64, 16, torch.float32), torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), rng_before)  # a run's random streams do not see the probe


def test_a_restricted_model_fails_instead_of_falling_back_and_computes_what_the_unrestricted_one_does():
    torch.manual_seed(0)
    model = RecurrentGPT(ModelConfig.from_name("raven-tiny", vocab_size=64))
    ids = torch.randint(0, 64, (2, 16))
    state = torch.zeros(2, 16, model.config.n_embd)
    free = model(ids, labels=ids, num_steps=(1, 2), input_states=state).loss
    restrict_attention(model, "flash")
    assert model.transformer.core_block[0].attn.sdpa_backends == FUSED
    fused = model(ids, labels=ids, num_steps=(1, 2), input_states=state).loss
    fused.backward()
    assert torch.equal(fused, free)  # torch's own choice on this CPU is its flash kernel
    for block in model.blocks():  # what a GPU without a fused kernel for the shape would face
        block.attn.sdpa_backends = [SDPBackend.EFFICIENT_ATTENTION]
    with pytest.raises(RuntimeError, match="No viable backend"):
        model(ids, labels=ids, num_steps=(1, 2), input_states=state)
    restrict_attention(model, None)
    assert torch.equal(model(ids, labels=ids, num_steps=(1, 2), input_states=state).loss, free)


def test_a_worker_logs_the_kernel_it_trains_with_and_stops_on_a_long_math_only_shape(single_rank_group, monkeypatch, capsys):
    monkeypatch.setattr(loop, "ShardReader", MemoryReader)
    cfg = train_config([])
    c = loop.build_components(cfg, plan_for(cfg), 0, torch.device("cpu"))
    assert capsys.readouterr().out == ("[huginn] attention: flash kernel (micro-batch 2 x 4 heads x seq_len 16 x "
                                       "head_dim 16, float32, cpu)\n")
    assert c.model.transformer.prelude[0].attn.sdpa_backends == FUSED

    # stands in for a GPU whose fused kernels do not take the shape
    monkeypatch.setattr(loop, "probe_attention_backends",
                        lambda shape, device: {"flash": FLASH_REFUSES, "efficient": EFFICIENT_REFUSES,
                                               "cudnn": CUDNN_REFUSES})
    long = train_config(["block_size=2048"])
    plan = dataclasses.replace(plan_for(long), model_config=ModelConfig.from_name(
        "raven-tiny", vocab_size=64, block_size=2048))
    with pytest.raises(Stop, match=r"^attention: only the math attention kernel takes the training shape "
                                        r"\(micro-batch 2 x 4 heads x seq_len 2048 x head_dim 16, float32\)"):
        loop.build_components(long, plan, 0, torch.device("cpu"))
    on_purpose = train_config(["block_size=2048", "attention_backend=math"])
    c = loop.build_components(on_purpose, plan, 0, torch.device("cpu"))
    assert "[huginn] attention: math kernel (micro-batch 2 x 4 heads x seq_len 2048" in capsys.readouterr().out
    assert c.model.transformer.coda[0].attn.sdpa_backends == [SDPBackend.MATH]

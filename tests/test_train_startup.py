"""Startup at scale: meta-device build with on-device init."""

from __future__ import annotations

import torch

from huginn_ray.model import ModelConfig, RecurrentGPT


def test_meta_build_then_materialize_is_bitwise_the_cpu_init():
    cfg = ModelConfig.from_name("raven-tiny", vocab_size=64)
    torch.manual_seed(233)
    reference = RecurrentGPT(cfg)
    after_reference = torch.rand(4)
    torch.manual_seed(233)
    with torch.device("meta"):
        model = RecurrentGPT(cfg)
    assert model.transformer.wte.weight.is_meta
    model.materialize("cpu")
    assert torch.equal(torch.rand(4), after_reference)  # the same random draws, in the same order
    expected = reference.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert model.lm_head.weight is model.transformer.wte.weight

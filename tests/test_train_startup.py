"""Startup at scale: meta-device build with on-device init, and sharded optimizer checkpoints per node size."""

from __future__ import annotations

import pytest
import torch

from huginn_ray.model import ModelConfig, RecurrentGPT
from huginn_ray.train import checkpoint as ckpt
from huginn_ray.train.config import OptimConfig
from huginn_ray.train.sharding import NodeLayout, NodeSharding, NodeShardedOptimizer


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


def sharded(world_size, rank, node_size):
    torch.manual_seed(0)
    model = RecurrentGPT(ModelConfig.from_name("raven-tiny", vocab_size=64))
    optimizer = NodeShardedOptimizer(model, OptimConfig(), NodeSharding(model, NodeLayout(world_size, rank, node_size)))
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.01)
    optimizer.optimizer.step()  # state for the owned tensors (no broadcast: no process group here)
    return model, optimizer


def test_sharded_checkpoint_loads_with_another_node_count_and_refuses_another_node_size(tmp_path):
    model, optimizer = sharded(world_size=4, rank=1, node_size=2)  # 2 nodes x 2: local rank 1
    state = ckpt.TrainerState(step=3, world_size=4)
    ckpt.write(tmp_path, 1, model, optimizer, state, {}, torch.device("cpu"))
    assert [p.name for p in tmp_path.glob("optimizer*")] == ["optimizer_shard_00001_of_00002.pt"]
    # rank 5 of 4 nodes x 2 is local rank 1 too: it reads the same shard
    _, other = sharded(world_size=8, rank=5, node_size=2)
    ckpt.read_optimizer(tmp_path, other, torch.device("cpu"))
    loaded, written = other.state_dict()["shard"]["state"], optimizer.state_dict()["shard"]["state"]
    assert loaded.keys() == written.keys() and loaded
    for index in loaded:
        assert torch.equal(loaded[index]["exp_avg"], written[index]["exp_avg"])
    # another node size is refused by name
    _, four = sharded(world_size=8, rank=1, node_size=4)
    with pytest.raises(ValueError, match="written with node_size=2 .* this run has node_size=4"):
        ckpt.read_optimizer(tmp_path, four, torch.device("cpu"))
    # an unsharded run does not take sharded state silently
    from huginn_ray.train.optim import build_optimizer

    with pytest.raises(ValueError, match="optim.sharding=none"):
        ckpt.read_optimizer(tmp_path, build_optimizer(model, OptimConfig()), torch.device("cpu"))

"""A truncated or foreign optimizer.pt / rank file gives an error naming the file, not a raw torch error."""

from pathlib import Path

import pytest
import torch

from huginn_ray.model import ModelConfig, RecurrentGPT
from huginn_ray.train import checkpoint as ckpt
from huginn_ray.train.config import OptimConfig
from huginn_ray.train.optim import build_optimizer

CPU = torch.device("cpu")


def components(n_layers_in_recurrent_block: int = 1):
    torch.manual_seed(0)
    model = RecurrentGPT(ModelConfig.from_name("raven-tiny", vocab_size=64,
                                               n_layers_in_recurrent_block=n_layers_in_recurrent_block))
    return model, build_optimizer(model, OptimConfig())


@pytest.fixture
def saved(tmp_path) -> Path:
    model, optimizer = components()
    model(torch.randint(0, 64, (1, 8)), labels=torch.randint(0, 64, (1, 8)), num_steps=(1, 1)).loss.backward()
    optimizer.step()
    ckpt.write(tmp_path, 0, model, optimizer, ckpt.TrainerState(step=3, world_size=1), {"taken": 5}, CPU)
    return tmp_path


def read(directory, n_layers_in_recurrent_block=1):
    model, optimizer = components(n_layers_in_recurrent_block)
    return ckpt.read(directory, 0, 1, model, optimizer, CPU)


def test_intact_checkpoint_reads(saved):
    state, reader = read(saved)
    assert state.step == 3 and reader == {"taken": 5}


@pytest.mark.parametrize("name", ["optimizer.pt", "rank_00000.pt"])
def test_truncated_file_is_named(saved, name):
    path = saved / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ckpt.CheckpointError, match=rf"{path}: cannot be read, truncated"):
        read(saved)


@pytest.mark.parametrize("name", ["optimizer.pt", "rank_00000.pt"])
def test_foreign_file_is_named(saved, name):
    torch.save({"something": torch.zeros(2)}, saved / name)
    with pytest.raises(ckpt.CheckpointError, match=rf"{saved / name}: not a file this code wrote"):
        read(saved)


def test_missing_rank_file_is_named(saved):
    (saved / "rank_00000.pt").unlink()
    with pytest.raises(ckpt.CheckpointError, match=rf"{saved / 'rank_00000.pt'}: missing"):
        read(saved)


def test_optimizer_of_another_model_is_named(saved):
    model, optimizer = components(n_layers_in_recurrent_block=2)
    other = saved / "other"
    ckpt.write(other, 0, model, optimizer, ckpt.TrainerState(step=3, world_size=1), {}, CPU)
    (saved / "optimizer.pt").write_bytes((other / "optimizer.pt").read_bytes())
    with pytest.raises(ckpt.CheckpointError, match=rf"{saved / 'optimizer.pt'}: does not fit"):
        read(saved)

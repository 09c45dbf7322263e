"""The training side of the speed work: the token-id check in collate, the config switches reaching the model."""

import numpy as np
import pytest

from huginn_ray.config import ConfigError
from huginn_ray.train.config import compile_options_for, load_train_config
from huginn_ray.train.shard_reader import Rows, collate


def test_collate_checks_token_ids_once_per_batch_on_the_host():
    ids = np.array([[1, 2, 3, 9], [4, 5, 6, 7]], dtype=np.int32)
    rows = Rows(ids, None, np.zeros(2))
    batch = collate(rows, pad_id=9, eos_id=8, vocab_size=10)
    inputs, labels = batch.inputs, batch.labels
    assert inputs.tolist() == [[1, 2, 3], [4, 5, 6]] and labels.tolist() == [[2, 3, 9], [5, 6, 7]]
    ids[1, 2] = 10
    with pytest.raises(ValueError, match=r"token id 10 at \(row 1, position 2\).*vocabulary \[0, 10\)"):
        collate(rows, pad_id=9, eos_id=8, vocab_size=10)
    ids[1, 2] = -1
    with pytest.raises(ValueError, match="token id -1"):
        collate(rows, pad_id=9, eos_id=8, vocab_size=10)
    collate(rows, pad_id=9, eos_id=8)  # without a vocabulary size nothing is checked


def test_speed_switches_in_the_config(tmp_path):
    cfg = load_train_config(None, ["max_steps=1", "compile=true", "loss_chunk_tokens=256", "optim.compile_step=true"])
    assert cfg.compile and cfg.loss_chunk_tokens == 256 and cfg.optim.compile_step is True
    # the blocks' compile mode: without CUDA graphs on GPUs, torch's default on CPU, or the one the config names
    assert compile_options_for(cfg, "cuda") == {"mode": "max-autotune-no-cudagraphs"}
    assert compile_options_for(cfg, "cpu") == {}
    named = load_train_config(None, ["max_steps=1", "compile_options={mode: default, fullgraph: true}"])
    assert compile_options_for(named, "cuda") == compile_options_for(named, "cpu") == {"mode": "default",
                                                                                       "fullgraph": True}
    for mode in ("max-autotune", "reduce-overhead"):  # CUDA graphs: the recurrence breaks them
        with pytest.raises(ConfigError, match=f"^compile_options.mode={mode}: this mode records CUDA graphs"):
            load_train_config(None, ["max_steps=1", f"compile_options={{mode: {mode}}}"])
    assert load_train_config(None, ["max_steps=1"]).optim.compile_step is None
    with pytest.raises(ConfigError, match="loss_chunk_tokens"):
        load_train_config(None, ["max_steps=1", "loss_chunk_tokens=-1"])

"""Data shorter than the schedule: refused at preflight, or with schedule.fit_to_data the schedule laid over the
steps the data allows; the learning rates of the fitted run come from the training loop itself."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from huginn_ray.train import loop
from huginn_ray.train.config import load_train_config
from huginn_ray.train.launch import PreflightError, preflight
from test_train_data import make_dataset
from test_train_preflight import TINY


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"), num_shards=2, rows_per_shard=40, seq_len=32)


def config(dataset, tmp_path, *extra):
    """tiny_cpu (lr 3e-3, warmup 5, cooldown 10, min_lr 3e-4, micro-batch 2) asking for 50 steps; each shard holds
    40 rows: 20 steps."""
    data_dir, tokenizer = dataset
    return load_train_config(TINY, [f"out_dir={tmp_path}", f"data.data_dir={data_dir}",
                                    f"data.tokenizer_path={tokenizer}", "block_size=32",
                                    "model.overrides.vocab_size=64", "max_steps=50", *extra])


def test_data_shorter_than_the_schedule_is_refused_naming_both_and_the_switch(dataset, tmp_path):
    with pytest.raises(PreflightError) as refused:
        preflight(config(dataset, tmp_path))
    assert str(refused.value) == (
        f"{dataset[0]}: a shard holds 40 train rows, 20 steps of 2 rows from every shard, but the "
        "schedule is laid out for 50 steps (max_steps / max_tokens): the run would stop at the data's end at peak "
        "lr, without its cooldown. Set schedule.fit_to_data=true to lay the schedule over the 20 steps, or "
        "max_steps=20")


def test_fit_to_data_lays_the_schedule_over_the_data_and_the_loop_cools_down_to_its_end(dataset, tmp_path, capsys):
    cfg = config(dataset, tmp_path, "schedule.fit_to_data=true", "skip_first_optimizer_step=false")
    plan = preflight(cfg)
    assert f"{dataset[0]}: a shard holds 40 train rows, 20 steps of 2 rows from every shard, but the " \
           "schedule is laid out for 50 steps (max_steps / max_tokens); schedule.fit_to_data: the schedule (warmup " \
           "5, cooldown 10 steps) is laid over 20 steps" in capsys.readouterr().out
    assert plan.schedule_steps == 20

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:  # the 2-rank plan on 1 rank (the data order allows it): both shards, the real reader, all 20 steps
        c = loop.build_components(cfg, plan, 0, torch.device("cpu"))
        lrs = [loop.train_step(c, step, cfg, plan, torch.device("cpu")).lr for step in range(1, 21)]
        applied = [group["lr"] for group in c.optimizer.param_groups]
    finally:
        dist.destroy_process_group()
    # warmup 3e-3 x s / 5 to step 4, the peak for steps 5-10, then 3e-3 x (20 - s) / 10 down to min_lr 3e-4
    assert lrs == pytest.approx([6e-4, 1.2e-3, 1.8e-3, 2.4e-3, 3e-3, 3e-3, 3e-3, 3e-3, 3e-3, 3e-3,
                                 2.7e-3, 2.4e-3, 2.1e-3, 1.8e-3, 1.5e-3, 1.2e-3, 9e-4, 6e-4, 3e-4, 3e-4], rel=1e-12)
    assert applied == [3e-4] * len(applied)

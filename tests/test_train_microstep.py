"""With gradient accumulation the depth and the LR follow the micro-batch step (reference §2.1, §3.4, §3.6)."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from huginn_ray.model import sample_recurrence
from huginn_ray.train import loop
from huginn_ray.train.optim import trapezoid_lr
from test_train_parallel import MemoryReader, plan_for, train_config


def test_grad_accumulation_3_draws_depth_per_micro_batch_step_and_lr_per_optimizer_step(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        monkeypatch.setattr(loop, "ShardReader", MemoryReader)
        drawn = []

        def recording_sampler(step, mean, backprop):
            drawn.append(step)
            return sample_recurrence(step, mean, backprop)

        monkeypatch.setattr(loop, "sample_recurrence", recording_sampler)
        cfg = train_config(["max_steps=4", "schedule.warmup_steps=2", "schedule.cooldown_steps=1",
                            "skip_first_optimizer_step=false"])
        plan = plan_for(cfg, grad_accum=3)
        c = loop.build_components(cfg, plan, 0, torch.device("cpu"))
        results = [loop.train_step(c, step, cfg, plan, torch.device("cpu")) for step in range(1, 5)]
    finally:
        dist.destroy_process_group()
    assert drawn == list(range(1, 13))  # micro-batch steps 1..12, one depth each
    assert results[1].depths == [sample_recurrence(m, 4, 2) for m in (4, 5, 6)]
    assert len(set(d for r in results for d in r.depths)) > 1
    # the schedule counts optimizer steps, whatever the accumulation: warmup over 2 (step 1 half way, step 2 at the
    # peak), cooldown over the last 1 of 4 (step 4 at min_lr)
    assert [r.lr for r in results] == pytest.approx([1.5e-3, 3e-3, 3e-3, 3e-4], rel=1e-12)
    assert [r.lr for r in results] == [trapezoid_lr(s, 3e-3, 2, 1, 4, 3e-4) for s in range(1, 5)]

"""Every rank decides alike from the step's one all-reduce: stop requests, the time budget, and data errors.

Two real gloo processes run `huginn_ray.train.loop.train_step` on raven-tiny with an in-memory reader
(tests/test_train_parallel.py); one rank alone sees a stop request, the time budget running out, or a read error,
and both ranks must act on it at the same step. The driver's deadline arithmetic and the per-step host reads are
checked in one process.
"""

from __future__ import annotations

import collections
import socket
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from huginn_ray.config import load_config
from huginn_ray.train import loop
from huginn_ray.train.config import TrainConfig
from huginn_ray.train.launch import PreflightError, stop_at_unix
from test_train_grad_sync import spawn
from test_train_parallel import MemoryReader, plan_for, train_config


def flags_agreed(rank, world_size):
    """Step 1: rank 1 alone asks to stop; step 2: rank 1 alone runs out of time; step 4: rank 1's shard breaks."""
    loop.ShardReader = MemoryReader
    cfg = train_config([])
    plan = plan_for(cfg)
    c = loop.build_components(cfg, plan, rank, torch.device("cpu"))
    if rank == 1:  # rank 1's 4th read fails: step 4's rows, read ahead while step 3 runs
        read, reads = c.reader.reader.next_micro_batch, []

        def breaks_at_the_fourth_read():
            reads.append(1)
            if len(reads) == 4:
                raise OSError("Unexpected end of stream: page was 12 bytes, expected 4096")
            return read()
        c.reader.reader.next_micro_batch = breaks_at_the_fourth_read
        c.reader.reader.streams[1].path = "/data/train/00001.parquet"
    cpu = torch.device("cpu")
    report = {
        "request": loop.train_step(c, 1, cfg, plan, cpu, stop_here=rank == 1).stop_reason,
        "time": loop.train_step(c, 2, cfg, plan, cpu, time_up=rank == 1).stop_reason,
        "none": loop.train_step(c, 3, cfg, plan, cpu).stop_reason,
    }
    before = [p.detach().clone() for p in c.model.parameters()]
    try:
        loop.train_step(c, 4, cfg, plan, cpu)
        report["stop"] = None
    except loop.Stop as stop:
        report["stop"] = {"message": str(stop), "reporter": stop.reporter}
    report["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, c.model.parameters()))
    return report


def test_one_rank_s_stop_request_time_up_and_read_error_stop_every_rank_at_the_same_step(tmp_path):
    ranks = spawn(flags_agreed, 2, tmp_path, timeout_s=60)
    assert "error" not in ranks[0] and "error" not in ranks[1], ranks
    for report in ranks:
        assert (report["request"], report["time"], report["none"]) == ("request", "time limit", None)
        assert report["unchanged"]  # the broken step's optimizer step was not taken
    failing, other = ranks[1]["stop"], ranks[0]["stop"]
    assert failing == {
        "message": "step 4: rank 1 cannot read its data: /data/train/00001.parquet: OSError: Unexpected end of "
                   "stream: page was 12 bytes, expected 4096; every rank stops (1 rank(s) failed; a data error is "
                   "not retried: fix or regenerate the shard, then rerun to resume from the last checkpoint)",
        "reporter": True,
    }
    assert other["reporter"] is False
    assert other["message"].startswith("step 4: rank 1 cannot read its data (its message names the file)")


def test_stop_at_is_the_earlier_end_minus_the_margin():
    cfg = load_config(TrainConfig, None, ["max_steps=1", "time_limit_s=3600", "time_limit_margin_s=300"])
    assert stop_at_unix(cfg, 1000.0, {}) == 1000.0 + 3600 - 300
    assert stop_at_unix(cfg, 1000.0, {"HUGINN_JOB_END_TIME": "2000"}) == 2000.0 - 300
    assert stop_at_unix(cfg, 1000.0, {"HUGINN_JOB_END_TIME": "9000"}) == 4300.0
    cfg.time_limit_s = None
    assert stop_at_unix(cfg, 1000.0, {}) is None
    with pytest.raises(PreflightError, match=r"HUGINN_JOB_END_TIME='12:00' is not a Unix time"):
        stop_at_unix(cfg, 1000.0, {"HUGINN_JOB_END_TIME": "12:00"})
    with pytest.raises(PreflightError, match=r"no time left: the budget ends 200 s from now"):
        stop_at_unix(cfg, 1000.0, {"HUGINN_JOB_END_TIME": "1200"})


def test_time_is_up_when_this_step_and_one_more_would_end_past_the_deadline():
    assert not loop.time_is_up(None, 10**9, 5.0)
    assert not loop.time_is_up(100.0, 89.0, 5.0)  # 89 + 2 x 5 = 99: one more step fits after this one
    assert loop.time_is_up(100.0, 90.0, 5.0)
    assert loop.time_is_up(100.0, 100.0, 0.0)  # before the first step's time is known: only a passed deadline


def test_a_training_step_reads_the_device_once():
    """Reads of tensor values (item, bool, float, int, tolist) during a step, by call site: of the loop, model,
    optimizer and exchange, only the agreed vector's `tolist` is left besides reads of tensors that live on the
    CPU whatever the training device (not device syncs): the depth sampler's draws from its CPU generator, and
    ELLISAdam's per-tensor step counts (not counted here; asserted to be CPU tensors)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    original_reader = loop.ShardReader
    names = ("item", "__bool__", "__float__", "__int__", "tolist")
    originals = {name: getattr(torch.Tensor, name) for name in names}
    sites: collections.Counter = collections.Counter()
    try:
        loop.ShardReader = MemoryReader
        cfg = train_config(["grad_sync.kind=chunk_stream"])
        plan = plan_for(cfg, grad_accum=2)
        c = loop.build_components(cfg, plan, 0, torch.device("cpu"))
        for step in (1, 2):  # the first optimizer step is skipped (skip_first_optimizer_step): state after step 2
            loop.train_step(c, step, cfg, plan, torch.device("cpu"))
        step_counts = [state["step"] for state in c.optimizer.state.values()]
        assert step_counts and all(t.device.type == "cpu" and t.dtype == torch.int64 for t in step_counts)
        step_count_ids = {id(t) for t in step_counts}

        def counting(name):
            def read(self, *args, **kwargs):
                if id(self) in step_count_ids:
                    return originals[name](self, *args, **kwargs)
                frame = traceback.extract_stack(limit=2)[0]
                sites[f"{frame.filename.rsplit('/', 1)[-1]}:{frame.name}:{name}"] += 1
                return originals[name](self, *args, **kwargs)
            return read

        for name in names:
            setattr(torch.Tensor, name, counting(name))
        for step in (3, 4, 5):
            loop.train_step(c, step, cfg, plan, torch.device("cpu"))
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        loop.ShardReader = original_reader
        dist.destroy_process_group()
    project = {site: n for site, n in sites.items() if site.split(":")[0] in (
        "loop.py", "model.py", "optim.py", "grad_sync.py", "parallel.py")}
    # 3 steps of 2 micro-batches: one agreed-vector read per step; per micro-batch one CPU depth draw, one read
    # of the row keys (a host tensor from the reader) that seed the rows' noise generators and one count of its
    # supervised labels (host tensors too)
    assert project == {"loop.py:train_step:tolist": 3, "model.py:sample_recurrence:item": 6,
                       "model.py:keyed_initial_state:tolist": 6, "loop.py:host_count:__int__": 6}, sites

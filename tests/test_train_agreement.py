"""Every rank decides alike from the step's one all-reduce: stop requests, the time budget, and data errors.

Two real gloo processes run `huginn_ray.train.loop.train_step` on raven-tiny with an in-memory reader
(tests/test_train_parallel.py); one rank alone sees a stop request, the time budget running out, or a read error,
and both ranks must act on it at the same step. The driver's deadline arithmetic and the per-step host reads are
checked in one process.
"""

from __future__ import annotations

import collections
import io
import json
import re
import socket
import threading
import time
import traceback
from contextlib import contextmanager, redirect_stdout
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from huginn_ray.config import load_config
from huginn_ray.train import loop
from huginn_ray.train.stopping import Stop, time_is_up
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
    except Stop as stop:
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
    assert not time_is_up(None, 10**9, 5.0)
    assert not time_is_up(100.0, 89.0, 5.0)  # 89 + 2 x 5 = 99: one more step fits after this one
    assert time_is_up(100.0, 90.0, 5.0)
    assert time_is_up(100.0, 100.0, 0.0)  # before the first step's time is known: only a passed deadline


READS = ("item", "__bool__", "__float__", "__int__", "tolist")


@contextmanager
def counting_reads(sites: collections.Counter, exempt: set):
    """Count reads of tensor values (READS) by call site (file:function:read), except of tensors in `exempt`."""
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name):
        def read(self, *args, **kwargs):
            if id(self) not in exempt:
                frame = traceback.extract_stack(limit=2)[0]
                sites[f"{frame.filename.rsplit('/', 1)[-1]}:{frame.name}:{name}"] += 1
            return originals[name](self, *args, **kwargs)
        return read

    for name in READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory):
    """One process of gloo: steps 1-2 by train_step, then steps 3-8 by the loop's `run_steps` (log interval 2,
    validation every 3 steps and at the last, a profile of steps 5-6), with rank 0's real MetricsLogger whose
    MLflow calls (log_batch, log_artifact) and matplotlib's savefig are replaced by calls that wait until the loop
    has ended (at most 5 s each). Records the reads of tensor values by call site during steps 3-8 and, in order,
    every step's end and every waiting call's start and end with its thread."""
    import matplotlib.figure
    from mlflow.tracking import MlflowClient

    from huginn_ray.train import checkpoint as ckpt
    from huginn_ray.train.shard_reader import collate
    from huginn_ray.train.tracking import MetricsLogger

    run_dir = tmp_path_factory.mktemp("observed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    original_reader, original_step = loop.ShardReader, loop.train_step
    loop_ended, events, sites, console = threading.Event(), [], collections.Counter(), io.StringIO()
    patched = {(MlflowClient, "log_batch"), (MlflowClient, "log_artifact"), (matplotlib.figure.Figure, "savefig")}
    originals = {(owner, name): getattr(owner, name) for owner, name in patched}

    def waiting(owner, name):
        def call(self, *args, **kwargs):
            events.append(("start", name, threading.current_thread().name))
            loop_ended.wait(timeout=5)
            events.append(("end", name, threading.current_thread().name))
            if name == "log_batch":
                events.append(("logged", [m.key for m in kwargs.get("metrics", [])],
                               {t.key: t.value for t in kwargs.get("tags", [])}))
            if name == "savefig":
                return originals[(owner, name)](self, *args, **kwargs)
        return call

    def recorded_step(*args, **kwargs):
        result = original_step(*args, **kwargs)
        events.append(("step", args[1], threading.current_thread().name))
        return result

    try:
        loop.ShardReader = MemoryReader
        cfg = train_config(["grad_sync.kind=chunk_stream", "max_steps=8", "log_step_interval=2", "eval_step_interval=3",
                            "eval_depths=[1, 2]", "checkpoint.save_step_interval=100", "checkpoint.save_last_step=false",
                            f"out_dir={run_dir}", "run_name=observed", "profile.steps=[5, 6]",
                            "profile.memory_snapshot=true"])
        plan = plan_for(cfg, grad_accum=2)
        cpu = torch.device("cpu")
        c = loop.build_components(cfg, plan, 0, cpu)
        for step in (1, 2):  # the first optimizer step is skipped (skip_first_optimizer_step): state after step 2
            loop.train_step(c, step, cfg, plan, cpu)
        step_counts = [state["step"] for state in c.optimizer.state.values()]
        assert step_counts and all(t.device.type == "cpu" and t.dtype == torch.int64 for t in step_counts)
        val_batch = collate(MemoryReader("val", 0, cfg.seed, cfg.block_size + 1).next_rows(2), plan.pad_id,
                            plan.eos_id, plan.model_config.vocab_size)
        state = ckpt.TrainerState(step=2)
        for owner, name in patched:
            setattr(owner, name, waiting(owner, name))
        loop.train_step = recorded_step
        logger = MetricsLogger(f"http://127.0.0.1:{port}", "0" * 32)  # never reached: its calls are replaced
        with counting_reads(sites, {id(t) for t in step_counts}), redirect_stdout(console):
            loop.run_steps(c, cfg, plan, state, val_batch, logger, 0, 1, cpu)
        events.append(("loop ended", None, threading.current_thread().name))
        loop_ended.set()
        logger.close(timeout_s=30)
    finally:
        loop_ended.set()
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
        loop.ShardReader, loop.train_step = original_reader, original_step
        dist.destroy_process_group()
    return {"sites": sites, "events": events, "run_dir": run_dir, "main": threading.main_thread().name,
            "console": console.getvalue()}


def test_a_log_interval_reads_the_device_once(observed_run):
    """Reads of tensor values (item, bool, float, int, tolist) during steps 3-8, by call site: of the loop,
    model, optimizer, exchange and telemetry, only the agreed vector's `tolist` (every step) and the log
    interval's one read (module norms, every rank's step time, the model's telemetry and, on validation steps,
    the validation losses together) are left besides reads of tensors that live on the CPU whatever the training
    device (not device syncs): the depth sampler's draws from its CPU generator, the row keys and the supervised
    label counts of the host batches, and ELLISAdam's per-tensor step counts (not counted; asserted CPU)."""
    project = {site: n for site, n in observed_run["sites"].items() if site.split(":")[0] in (
        "loop.py", "model.py", "optim.py", "grad_sync.py", "parallel.py", "parallelize.py", "observe.py",
        "profiling.py", "checkpoint.py", "collectives.py", "validation.py", "stopping.py")}
    # 6 steps of 2 micro-batches: one agreed-vector read per step; log steps 4, 6, 8 and validation steps 3, 6,
    # 8 (a validation step is a log step): 4 interval reads; per micro-batch one CPU depth draw, one read of the
    # row keys (a host tensor from the reader) that seed the rows' noise and one count of its supervised labels
    # (host tensors too), and the same for each of the 3 validations' one micro-batch; once per run, after the
    # profiled steps, the gather of the trace files' names (collectives.all_ranks: W lengths, then the bytes)
    assert project == {"loop.py:train_step:tolist": 6, "observe.py:read_interval:tolist": 4,
                       "model.py:sample_recurrence:item": 12, "model.py:keyed_initial_state:tolist": 12 + 3,
                       "validation.py:host_count:__int__": 12 + 3, "collectives.py:<listcomp>:item": 1,
                       "collectives.py:<listcomp>:tolist": 1}, observed_run["sites"]


def test_no_mlflow_or_matplotlib_call_delays_a_step_of_rank_0(observed_run):
    """MLflow's calls and matplotlib's savefig wait until the loop has ended: every step of 3-8 ended before any
    of them returned, and none ran on the loop's thread (they run on the logger's sender and drawing threads)."""
    events, main = observed_run["events"], observed_run["main"]
    order = [e for e in events if e[0] in ("step", "end", "loop ended")]
    assert [e[1] for e in order if e[0] == "step"] == [3, 4, 5, 6, 7, 8]
    first_end = next(i for i, e in enumerate(order) if e[0] == "end")
    assert order[first_end - 1] == ("loop ended", None, main)  # nothing returned while the loop ran
    calls = [e for e in events if e[0] == "start"]
    assert {name for _, name, _ in calls} == {"log_batch", "log_artifact", "savefig"}
    assert {(name, thread) for _, name, thread in calls} == {
        ("log_batch", "huginn-mlflow-sender"), ("log_artifact", "huginn-mlflow-sender"),
        ("savefig", "huginn-mlflow-drawer")}, calls
    logged = {key for e in events if e[0] == "logged" for key in e[1]}
    for key in ("loss", "val_loss_2", "time/data", "time/forward", "time/backward", "time/comm", "time/optimizer",
                "time/validation", "time/checkpoint", "grad_norm/core", "update_norm/embeddings",
                "telemetry/recurrent_state_norm", "straggler/slowest_ratio"):
        assert key in logged, key


def test_a_profiled_step_range_leaves_a_trace_and_says_the_snapshot_needs_cuda(observed_run):
    directory = observed_run["run_dir"] / "observed" / "profile"
    trace = directory / "rank0.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)
    assert sorted(p.name for p in directory.iterdir()) == ["rank0.trace.json"]  # no memory snapshot on CPU
    assert ("[huginn] profile: memory_snapshot needs CUDA; this run trains on cpu, so steps 5-6 get a profiler "
            "trace only") in observed_run["console"]
    assert f"[huginn] profile of steps 5-6: {trace}" in observed_run["console"]


class RecordingLogger:
    """Stands in for rank 0's MetricsLogger (the MLflow side is tested with a real server in test_train_ray.py):
    keeps what the loop logs."""

    def __init__(self):
        self.metrics, self.tags = {}, {}

    def log(self, metrics, step):
        self.metrics.setdefault(step, {}).update(metrics)

    def set_tag(self, key, value):
        self.tags[key] = value

    def log_drawn_artifact(self, name, draw, artifact_path=None):
        pass


def straggling_rank(rank, world_size):
    """hsdp over 2 gloo ranks (one shard group), 4 steps by the loop's run_steps, logged every 2; rank 1 sleeps
    0.3 s in every step while it waits for its data (a test-only stand-in for a slow host)."""
    from huginn_ray.train import checkpoint as ckpt
    from huginn_ray.train.shard_reader import collate

    loop.ShardReader = MemoryReader
    if rank == 1:
        read = loop.read_batches

        def slow_read(c, cfg):
            time.sleep(0.3)
            return read(c, cfg)
        loop.read_batches = slow_read
    cfg = train_config(["parallelism.mode=hsdp", "max_steps=4", "log_step_interval=2", "eval_depths=[1]",
                        "checkpoint.save_step_interval=100", "checkpoint.save_last_step=false",
                        "out_dir=/nonexistent/runs"])
    plan = plan_for(cfg)
    cpu = torch.device("cpu")
    c = loop.build_components(cfg, plan, rank, cpu, local_world_size=2)
    c.hosts = ["10.0.0.1", "10.0.0.2"]  # every rank's node IP, as start_worker gathers them
    val_batch = collate(MemoryReader("val", rank, cfg.seed, cfg.block_size + 1).next_rows(2), plan.pad_id,
                        plan.eos_id, plan.model_config.vocab_size)
    logger = RecordingLogger() if rank == 0 else None
    console = io.StringIO()
    with redirect_stdout(console):
        loop.run_steps(c, cfg, plan, ckpt.TrainerState(), val_batch, logger, rank, world_size, cpu)
    return {"console": console.getvalue(),
            "metrics": logger.metrics if logger else None, "tags": logger.tags if logger else None}


def test_a_slow_rank_is_named_with_its_host_and_module_norms_are_global_under_hsdp(tmp_path):
    ranks = spawn(straggling_rank, 2, tmp_path, timeout_s=120)
    assert "error" not in ranks[0] and "error" not in ranks[1], ranks
    report = ranks[0]
    for step in ("2", "4"):
        assert re.search(rf"^\[huginn\] step {step} time per step \(s\): data [0-9.]+ forward [0-9.]+ backward "
                         r"[0-9.]+ comm [0-9.]+ optimizer [0-9.]+ validation [0-9.]+ checkpoint [0-9.]+$",
                         report["console"], re.M), report["console"]
        lines = [l for l in report["console"].splitlines() if l.startswith(f"[huginn] step {step} stragglers")]
        assert len(lines) == 1, report["console"]
        assert lines[0].startswith(f"[huginn] step {step} stragglers (own time above 1.5x the median): "
                                   "rank 1 on 10.0.0.2 "), lines
        metrics = report["metrics"][step]
        assert metrics["straggler/rank_1"] > 1.5 and "straggler/rank_0" not in metrics
        assert report["tags"][f"straggler.step_00000{step}"] == lines[0].split("median): ", 1)[1]
        # the module norms are global: their squares add up to the clip's global norm (sharded DTensors)
        squares = sum(metrics[f"grad_norm/{m}"] ** 2 for m in ("embeddings", "prelude", "core", "coda"))
        assert squares == pytest.approx(metrics["grad_norm"] ** 2, rel=1e-6)
        assert metrics["update_norm/core"] > 0
    assert ranks[1]["console"] == ""  # rank 1 prints nothing of its own

"""The console settings of jobs that start their own local Ray (huginn_ray.console, jobs/train.py)."""

import logging
import os

from huginn_ray.console import QUIET_ENV, failure_line, local_ray_init_kwargs, quiet_local_ray, summary_line
from huginn_ray.train.observe import eta, progress_line


def test_quiet_local_ray_sets_explicit_ray_settings(monkeypatch):
    for key in (*QUIET_ENV, "TORCH_CPP_LOG_LEVEL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # an explicit choice of the caller wins
    for name in ("ray", "ray.train", "ray.data", "ray.tune", "mlflow"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)
    quiet_local_ray(verbose=False)
    assert os.environ["RAY_AUTH_MODE"] == "disabled"
    assert os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    assert logging.getLogger("ray.train").level == logging.ERROR
    kwargs = local_ray_init_kwargs(verbose=False)
    assert kwargs["include_dashboard"] and kwargs["_node_ip_address"] == "127.0.0.1"
    assert kwargs["logging_level"] == logging.ERROR and kwargs["log_to_driver"]
    assert "logging_config" not in local_ray_init_kwargs(verbose=True)


def test_progress_line_has_an_eta_and_the_summary_names_the_figures():
    metrics = dict(loss=3.2, ppl=24.5, lr=1e-3, grad_norm=0.5, tokens_per_second=1234, mfu=0.05,
                   recurrence_n=2, recurrence_k=2, seconds_per_step=1.5)
    line = progress_line(10, 50, metrics)
    assert "step 10/50" in line and "tok/s 1234" in line and "MFU 5.00%" in line and "depth (2,2)" in line
    assert line.endswith("ETA 0:01:00")
    assert eta(3725) == "1:02:05"
    assert summary_line({"step": 50, "loss": 2.5, "tokens": 102400}) == "final: step 50, loss 2.5000, 102,400 tokens"
    assert summary_line({}) == ""


def test_failure_line_names_the_ranks_and_the_last_exception_of_ray_s_report():
    report = RuntimeError(  # the shape of Ray Train's WorkerGroupError text (a snippet cut in the middle)
        "Training failed due to worker errors:\n[Rank 0 Error Snippet]:\nTraceback (most recent call last):\n"
        '  File "/w/huginn_ray/train/loop.py", line 89, in train_loop_per_worker\n    _train(cfg)\n'
        "... (Output truncated. See individual worker logs for full details) ...\n"
        "    work.wait()\ntorch.distributed.DistBackendError: [../gloo/transport/tcp/pair.cc:534] Read error: "
        "timed out waiting 10000 ms\n\n")
    assert failure_line(report) == ("rank 0: torch.distributed.DistBackendError: [../gloo/transport/tcp/pair.cc:534] "
                                    "Read error: timed out waiting 10000 ms")
    assert failure_line(ValueError("bad shard\nsecond line")) == "ValueError: bad shard"

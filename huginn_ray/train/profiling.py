"""The profiled steps (`profile: {steps: [a, b], memory_snapshot: true}`): a torch profiler trace of steps a to b
on every rank, and a CUDA memory snapshot of them where there is CUDA.

Every rank writes `<run_dir>/profile/rank<k>.trace.json` (Chrome trace format: chrome://tracing or
https://ui.perfetto.dev) and, with memory_snapshot on CUDA, `<run_dir>/profile/rank<k>.memory.pickle`
(https://pytorch.org/memory_viz); with the run directory in a bucket, into a local directory named by the run,
then uploaded there (huginn_ray.train.run_files). Rank 0 queues the local files it can read (its own; every
rank's on a shared file system or on its node) for MLflow's artifact `profile/`, copied and uploaded by the
logger's threads.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import torch

from huginn_ray.train import run_files
from huginn_ray.train.collectives import all_ranks
from huginn_ray.train.config import ProfileSection


class StepProfiler:
    """Starts before step a, stops after step b (each rank). Outside those steps it costs nothing."""

    def __init__(self, cfg: ProfileSection, run_dir: str | Path, rank: int, device: torch.device):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.run_dir = str(run_dir)
        self.directory = run_files.local_dir(run_dir, "profile")
        self.profiler = None
        self.snapshot = cfg.memory_snapshot and device.type == "cuda"
        if cfg.steps and cfg.memory_snapshot and not self.snapshot and rank == 0:
            print(f"[huginn] profile: memory_snapshot needs CUDA; this run trains on {device.type}, so steps "
                  f"{cfg.steps[0]}-{cfg.steps[1]} get a profiler trace only", flush=True)

    def before_step(self, step: int) -> None:
        if not self.cfg.steps or step != self.cfg.steps[0]:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self.profiler.start()

    def after_step(self, step: int) -> list[Path]:
        """The local files this rank wrote (published to the run directory), after the profiled steps' last one
        (else nothing)."""
        if self.profiler is None or step != self.cfg.steps[1]:
            return []
        self.profiler.stop()
        self.directory.mkdir(parents=True, exist_ok=True)
        trace = self.directory / f"rank{self.rank}.trace.json"
        self.profiler.export_chrome_trace(str(trace))
        self.profiler = None
        written = [trace]
        if self.snapshot:
            snapshot = self.directory / f"rank{self.rank}.memory.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(snapshot)
        published = [run_files.publish(path, self.run_dir) for path in written]
        if self.rank == 0:
            print(f"[huginn] profile of steps {self.cfg.steps[0]}-{step}: {', '.join(published)}", flush=True)
        return written


def log_profile(written: list[Path], logger, device: torch.device) -> None:
    """After the profiled steps: every rank's files named to rank 0 (one gather, once per run), which queues
    those it can read (its own; every rank's on a shared file system) as MLflow artifacts under `profile/`, copied
    by the logger's drawing thread."""
    files = all_ranks([str(path) for path in written], device)
    if logger is None:
        return
    for path in (Path(p) for rank_files in files for p in rank_files):
        if path.is_file():
            logger.log_drawn_artifact(str(path), functools.partial(copy_into, path), "profile")


def copy_into(path: Path, directory: Path) -> Path:
    return Path(shutil.copy2(path, directory))

"""How a run stops on purpose, every rank at the same step: the `Stop` every rank raises, the files that ask the
workers to save and stop (the driver's SIGTERM, the cluster's signal) and the one that tells the driver why they
stopped (in the run directory, local or in a bucket: huginn_ray.storage), the time budget, and the stop after a
rank cannot read its data.

The decisions themselves travel in the step's one all-reduce (huginn_ray.train.loop.train_step); this module
holds what they are made of and what they say.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from huginn_ray import storage
from huginn_ray.train.config import TrainConfig


# pyarrow's read errors are OSError (ArrowIOError) or ValueError (ArrowInvalid); collate raises ValueError for ids
# outside the vocabulary; StopIteration is an exhausted shard
DATA_ERRORS = (OSError, ValueError, StopIteration)
"""What a rank that cannot read its data raises: every rank stops (`data_error_stop`), never a retry."""


class Stop(Exception):
    """The run stops on purpose, on every rank at the same step: a non-finite loss or gradient with
    on_nonfinite=stop, a rank that cannot read its data, or no checkpoint to resume from that loads. Not retried
    by Ray: it would only fail again."""

    def __init__(self, message: str, reporter: bool):
        super().__init__(message)
        self.reporter = reporter
        """This rank's message explains the stop; it writes it for the driver (the STOPPED file)."""


def stop_file(cfg: TrainConfig) -> str:
    """Created by the driver when it gets SIGTERM (jobs/train.py): the workers save and stop at the next step.

    The training function runs outside its process's main thread, where Python cannot install signal
    handlers, so the driver forwards the signal through this file (an object when the run is in a bucket)."""
    return storage.join(cfg.run_dir, "STOP")


STOP_FILE_ENV = "HUGINN_STOP_FILE"
"""A second stop file, named by the cluster (cluster_yamls/frontier.sbatch creates it on Slurm's signal)."""


def stop_files(cfg: TrainConfig) -> list[str]:
    return [stop_file(cfg)] + ([os.environ[STOP_FILE_ENV]] if os.environ.get(STOP_FILE_ENV) else [])


def request_stop(cfg: TrainConfig) -> str:
    """The driver asks the workers to save and stop after the current step; returns the stop file."""
    location = stop_file(cfg)
    storage.write_bytes(location, b"")
    return location


def stop_requested(cfg: TrainConfig) -> bool:
    """Rank 0, before every step: does a stop file exist?"""
    return any(storage.exists(location) for location in stop_files(cfg))


def clear_stop_requests(cfg: TrainConfig) -> None:
    for location in stop_files(cfg):
        storage.delete(location)


def stopped_file(cfg: TrainConfig) -> str:
    """Written by rank 0 when the run stops on purpose; holds the reason."""
    return storage.join(cfg.run_dir, "STOPPED")


def write_stop_reason(cfg: TrainConfig, stop: Stop) -> None:
    storage.write_text(stopped_file(cfg), str(stop) + "\n")


def clear_stop_reason(cfg: TrainConfig) -> None:
    storage.delete(stopped_file(cfg))


def stop_reason(cfg: TrainConfig) -> str | None:
    """Why the workers stopped on purpose (the STOPPED file), None when they did not."""
    try:
        return storage.read_text(stopped_file(cfg)).strip()
    except FileNotFoundError:
        return None


def time_is_up(stop_at_unix: float | None, now: float, step_seconds: float) -> bool:
    """True when the step about to run and one more would end past `stop_at_unix` (the driver's time budget
    minus the checkpoint margin): this step is the last, and its checkpoint is saved in time."""
    return stop_at_unix is not None and now + 2 * step_seconds >= stop_at_unix


def report_stop(cfg: TrainConfig, stop_reason: str, step: int) -> None:
    """Rank 0: why the run stops after this saved step; the stop files are removed (a rerun resumes)."""
    cause = f"stop requested ({', '.join(map(str, stop_files(cfg)))})" if stop_reason == "request" else \
        f"time budget ends in less than {cfg.time_limit_margin_s:g} s + two steps"
    print(f"[huginn] {cause}: saved step {step}, stopping", flush=True)
    clear_stop_requests(cfg)


def stop_if_a_rank_cannot_read(error: str | None, device: torch.device) -> None:
    """At startup (one all-reduce): every rank stops if any rank could not read its data."""
    failed = torch.tensor([float(error is not None)], device=device)
    dist.all_reduce(failed)
    if failed.item():
        raise data_error_stop("startup", error, int(failed.item()), device)


def data_error_stop(when: str, error: str | None, failed_ranks: int, device: torch.device) -> Stop:
    """The Stop every rank raises after `failed_ranks` ranks could not read their data; the lowest failing rank
    (one more small all-reduce, on this error path only) reports its error to the driver."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    first = torch.tensor([rank if error is not None else world_size], device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    first = int(first.item())
    advice = ("a data error is not retried: fix or regenerate the shard, then rerun to resume from the last "
              "checkpoint")
    if error is not None:
        return Stop(f"{when}: rank {rank} cannot read its data: {error}; every rank stops "
                    f"({failed_ranks} rank(s) failed; {advice})", reporter=rank == first)
    return Stop(f"{when}: rank {first} cannot read its data (its message names the file); every "
                f"rank stops ({failed_ranks} rank(s) failed; {advice})", reporter=False)

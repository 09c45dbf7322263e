"""Testing only: a rank that exits or hangs after a chosen step (`fault_injection` in the config), so the
end-to-end tests can watch Ray Train restart a run and a hung collective time out."""

from __future__ import annotations

import os
import time

from huginn_ray import storage
from huginn_ray.train.config import TrainConfig


def inject_fault(cfg: TrainConfig, rank: int, step: int, start_step: int) -> None:
    """After `step`, rank `kill_rank` exits or rank `hang_rank` stops answering, once per run directory (a marker
    file; an attempt Ray Train restarts runs on)."""
    fault = cfg.fault_injection
    if fault.kill_rank_at_step == step and rank == fault.kill_rank:
        action = "killed"
    elif fault.hang_rank_at_step == step and rank == fault.hang_rank:
        action = "hung"
    else:
        return
    marker = storage.join(cfg.run_dir, f"fault_injected_rank{rank}_step{step}")
    if storage.exists(marker):
        return
    storage.write_text(marker,
                       f"{action} after step {step} (attempt started at step {start_step}), pid {os.getpid()}\n")
    if action == "killed":
        print(f"[huginn] fault injection: rank {rank} exits after step {step}", flush=True)
        os._exit(1)
    print(f"[huginn] fault injection: rank {rank} hangs after step {step}", flush=True)
    while True:  # never joins the next collective; the other ranks' one raises after pg_timeout_s
        time.sleep(60)

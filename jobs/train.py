"""Train the Huginn recurrent-depth model on Ray Train.

    python jobs/train.py --config configs/train/tiny_cpu.yaml [key=value ...]
    ray job submit --working-dir . -- python jobs/train.py --config configs/train/tiny_cpu.yaml out_dir=/abs/dir

Connects to the Ray cluster in $RAY_ADDRESS (set by `ray job submit`), else starts a local one. Rerunning with
the same run_name and out_dir resumes from the newest checkpoint, in the same MLflow run.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback

from huginn_ray.console import failure_line, local_ray_environment, summary_line

if not os.environ.get("RAY_ADDRESS"):
    local_ray_environment()  # before Ray is imported (below), which reads RAY_AUTH_MODE

from huginn_ray.cluster.local_ray import connect_ray  # noqa: E402
from huginn_ray.config import ConfigError  # noqa: E402
from huginn_ray.train.config import load_train_config
from huginn_ray.train.launch import PreflightError, preflight, run_training
from huginn_ray.train.stopping import clear_stop_requests, request_stop
from huginn_ray.train.runlock import RunLock, RunLockError


def on_sigterm(cfg) -> None:
    """SIGTERM: ask the workers to save a checkpoint and stop after the current step."""
    print(f"[huginn] SIGTERM: asked the workers to save and stop ({request_stop(cfg)})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML file (configs/train/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optim.lr=1e-3")
    parser.add_argument("--verbose", action="store_true",
                        help="show Ray's own INFO/WARNING lines (otherwise they stay in Ray's log files)")
    args = parser.parse_args(argv)
    try:
        cfg = load_train_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    lock = RunLock(cfg.run_dir)  # one writer per run directory, checked before Ray starts
    try:
        taken_over = lock.acquire()
    except RunLockError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if taken_over:
        print(f"[huginn] {taken_over}", flush=True)
    try:
        return _run(cfg, args.verbose)
    finally:
        lock.release()


def startup_line(cfg, plan) -> str:
    return (f"[huginn] training {cfg.run_name}: {plan.schedule_steps} steps of {plan.global_batch_rows} rows, "
            f"{cfg.scaling.num_workers} workers, model {plan.model_config.name}"
            f"{' from ' + plan.init_from.path if plan.init_from else ''}, {plan.precision}"
            f"{', compiled blocks' if cfg.compile else ''}")


def _run(cfg, verbose: bool) -> int:
    try:
        plan = preflight(cfg)  # bad input is refused before Ray starts
    except PreflightError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    # a private Ray in a session of its own: a SIGTERM to the job's process group reaches only this driver, which
    # has the workers save before it stops Ray (LocalRayHead)
    connection = connect_ray(verbose=verbose, own_session=True)
    if connection.local and not verbose:
        print(f"[huginn] Ray's own INFO/WARNING lines go to {connection.temp_dir}/session_latest/logs, kept if the "
              f"run fails (--verbose shows them here)", flush=True)
    clear_stop_requests(cfg)  # left by an earlier attempt that this rerun resumes
    signal.signal(signal.SIGTERM, lambda signum, frame: on_sigterm(cfg))
    print(startup_line(cfg, plan), flush=True)
    outcome = None
    try:
        outcome = run_training(cfg, plan, ray_train_log_level="INFO" if verbose else "ERROR")
    except Exception as err:  # Ray's report in full, then one line of our own
        traceback.print_exc()
        print(f"[huginn] training failed, {failure_line(err)}", flush=True)
    finally:
        if connection.local:
            failed = outcome is None or not outcome.ok
            connection.stop(keep_logs=failed)
            if failed:
                print(f"[huginn] Ray's logs of this run are kept in {connection.temp_dir}/session_latest/logs",
                      flush=True)
    if outcome is None:
        print(f"[huginn] run directory: {cfg.run_dir}; rerun to resume from its newest checkpoint")
        return 1
    print(f"[huginn] {outcome.message}")
    summary = summary_line(outcome.metrics)
    if summary:
        print(f"[huginn] {summary}")
    print(f"[huginn] checkpoint: {outcome.checkpoint_path}")
    print(f"[huginn] run directory: {outcome.run_dir}")
    print(f"[huginn] MLflow: {outcome.mlflow_uri} (run {outcome.mlflow_run_id})")
    if outcome.mlflow_uri.startswith("sqlite:"):
        print(f"[huginn] open the UI with: mlflow ui --backend-store-uri {outcome.mlflow_uri} --port 5000")
    else:
        print(f"[huginn] open {outcome.mlflow_uri} in a browser")
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())

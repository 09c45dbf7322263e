"""How Ray Train's control plane grows with the worker count: start, checkpoint, restart, on this machine.

    tools/private_netns.sh python bench/ray_scale.py [--workers 2,4,8,16] [--out /tmp/hr_ray_scale]

For each worker count W, one run of the tiny model (raven-tiny, vocabulary 64, 32-token rows, micro-batch 1, one
torch thread per worker) through the training job's own path: `preflight`, then `run_training` (Ray Train's
TorchTrainer, the worker loop, MLflow in a SQLite store under --out), on W shards of test_train_data.py's
arithmetic rows, 4 steps, a checkpoint every 2 steps, and rank W-1 killed after step 3 (fault injection), so Ray
Train restarts the group from the step-2 checkpoint. One local Ray with W logical CPUs, Ray Train's defaults
(health check every 2 s). The figures come from rank 0's MLflow metrics, each stamped with the wall clock when
rank 0 logged it (one machine, one clock):

- fit -> step 1: from `run_training` to the loss of step 1 (MLflow run, Ray Train's controller, W actors, torch
  imports, the gloo process group, the model on every rank, the warm-up all-reduce, step 1);
- checkpoint: `checkpoint_seconds` of step 2 (every rank's DCP save, then Ray Train's report);
- restart: from the killed rank's exit (the mtime of its marker file) to the first step the restarted group
  finishes (Ray noticing the death, stopping the group, W new actors, the resume from the checkpoint, step 3);
- step: the median step time of steps 1-4 outside restarts (context: W workers share this machine's cores).

Needs a private namespace (tools/private_netns.sh): it starts a local Ray.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the synthetic shards of the training tests

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a Ray inside the private namespace, for this process only
from huginn_ray.console import local_ray_init_kwargs, quiet_local_ray  # noqa: E402

quiet_local_ray()

import ray  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from huginn_ray.train.config import load_train_config  # noqa: E402
from huginn_ray.train.launch import preflight, run_training  # noqa: E402
from test_train_data import make_dataset  # noqa: E402

STEPS, SAVE_EVERY, KILL_AFTER = 4, 2, 3


def run_once(workers: int, root: Path) -> dict:
    data_dir, tokenizer = make_dataset(root / f"data_{workers}", num_shards=workers, rows_per_shard=16, seq_len=32)
    cfg = load_train_config(str(REPO / "configs/train/tiny_cpu.yaml"), [
        f"run_name=scale_{workers}", f"out_dir={root / 'runs'}", f"data.data_dir={data_dir}",
        f"data.tokenizer_path={tokenizer}", "block_size=32", "model.overrides.vocab_size=64", "micro_batch_size=1",
        f"max_steps={STEPS}", "log_step_interval=1", "eval_step_interval=100", "eval_depths=[1]",
        f"checkpoint.save_step_interval={SAVE_EVERY}", "checkpoint.keep=2", "warmup_allreduce_mib=1",
        "schedule.warmup_steps=1", "schedule.cooldown_steps=0", "max_failures=1", f"scaling.num_workers={workers}",
        f"fault_injection.kill_rank_at_step={KILL_AFTER}", f"fault_injection.kill_rank={workers - 1}",
    ])
    plan = preflight(cfg)
    fit_start = time.time()
    outcome = run_training(cfg, plan, ray_train_log_level="ERROR")
    if not outcome.ok:
        raise RuntimeError(f"{workers} workers: {outcome.message}")
    client = MlflowClient(plan.mlflow_uri)
    history = lambda key: sorted(client.get_metric_history(outcome.mlflow_run_id, key),  # noqa: E731
                                 key=lambda m: m.timestamp)
    losses = history("loss")
    killed_at = (cfg.run_dir / f"fault_injected_rank{workers - 1}_step{KILL_AFTER}").stat().st_mtime
    first_step = next(m for m in losses if m.step == 1).timestamp / 1000
    # rank 0 logs num_workers as each group starts: the second entry is the restarted group's (rank 0 of the
    # first group may log step 3's loss just after the killed rank's exit)
    restarted = history("num_workers")[1].timestamp / 1000
    after_kill = next(m for m in losses if m.timestamp / 1000 >= restarted).timestamp / 1000
    step_times = [(b.timestamp - a.timestamp) / 1000 for a, b in zip(losses, losses[1:])
                  if b.step == a.step + 1 and not (a.timestamp / 1000 < killed_at < b.timestamp / 1000)]
    return {
        "workers": workers,
        "fit_to_first_step_s": first_step - fit_start,
        "checkpoint_s": next(m.value for m in history("checkpoint_seconds") if m.step == SAVE_EVERY),
        "restart_s": after_kill - killed_at,
        "step_s": statistics.median(step_times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="2,4,8,16")
    parser.add_argument("--out", default=None, help="work directory (default: a new temporary one, removed)")
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    root = Path(args.out or tempfile.mkdtemp(prefix="hr_ray_scale_"))
    temp_dir = tempfile.mkdtemp(prefix="hr_", dir="/tmp")  # short: Ray's socket paths are limited
    # the workers import the same huginn_ray as the driver (this checkout, not whichever copy is installed)
    # with its dashboard, as a job's local Ray: Ray Train's controller asks the state API whether it is alive
    ray.init(num_cpus=max(counts), _temp_dir=temp_dir, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
             **local_ray_init_kwargs())
    rows = []
    try:
        for workers in counts:
            rows.append(run_once(workers, root))
            print(f"{workers} workers done: {rows[-1]}", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\nRay Train control plane, raven-tiny on CPU, {os.cpu_count()} cores, {platform.machine()}, "
          f"ray {ray.__version__}; seconds")
    print("| workers | fit -> step 1 | checkpoint (save + report) | restart after a killed worker | step |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workers']} | {r['fit_to_first_step_s']:.1f} | {r['checkpoint_s']:.2f} | {r['restart_s']:.1f} "
              f"| {r['step_s']:.2f} |")


if __name__ == "__main__":
    main()

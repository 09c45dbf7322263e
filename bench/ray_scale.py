"""How Ray Train's control plane grows with the worker count, on this machine: start, checkpoint, restart.

    tools/private_netns.sh python bench/ray_scale.py --mode control [--backend none|gloo] [--workers 2,4,8,16,32]
    tools/private_netns.sh python bench/ray_scale.py --mode model [--workers 2,4,8,16] [--out /tmp/hr_ray_scale]

--mode control (the default): workers that do no model work, so that many workers on a few cores measure Ray
Train's control plane rather than cores shared by training steps. Each worker holds 4 KiB of state; per worker
count W, one `trainer.fit()` (Ray Train's DataParallelTrainer, no torch in the workers; with --backend gloo a
TorchTrainer that also opens the gloo process group) runs this in every worker: report the state as a checkpoint 3 times
(`ray.train.report`, SYNC upload: it returns when this rank's files are in storage and every rank has reported
the round), then rank W-1 exits after the second report (os._exit, once); Ray Train restarts the group from the
newest checkpoint, every rank reads its 4 KiB back and reports 3 more times. Every worker stamps the wall clock
(one machine, one clock) into a file; the terms:

- start: from `trainer.fit()` to the last worker entering the training function (Ray Train's controller, the
  placement group, W worker actors and their processes, with gloo the process group);
- report: per round, from the last rank calling `ray.train.report` to the last rank returning from it (the
  checkpoint's upload and Ray Train's agreement of every rank on the round), the median over the 5 complete
  rounds of both groups;
- restart: from the killed rank's exit to the last worker of the new group having read its checkpoint back
  (when Ray Train registered it before the exit)
  (Ray noticing the death at its health check, every 2 s by default; stopping the group; a new group started).

Then it prints, per term, the cost per added worker between successive counts and which terms grow faster than
linearly (the cost per added worker at the largest counts at least 1.5 x that at the smallest, and a log-log
slope above 1 between the two largest counts).

--mode model: one run of the tiny model (raven-tiny, vocabulary 64, 32-token rows, micro-batch 1, one torch
thread per worker) through the training job's own path: `preflight`, then `run_training` (Ray Train's
TorchTrainer, the worker loop, MLflow in a SQLite store under --out), on W shards of test_train_data.py's
arithmetic rows, 4 steps, a checkpoint every 2 steps, and rank W-1 killed after step 3 (fault injection), so Ray
Train restarts the group from the step-2 checkpoint. The figures come from rank 0's MLflow metrics: fit -> step 1,
checkpoint (`checkpoint_seconds` of step 2: every rank's DCP save, then Ray Train's report), restart (from the
killed rank's exit to the first step the restarted group finishes), step (the median step time; W workers share
this machine's cores, so on 2 cores every term also measures oversubscription).

Both modes start one local Ray with as many logical CPUs as the largest W, Ray Train's defaults otherwise. Needs a
private namespace (tools/private_netns.sh): it starts a local Ray.
"""

from __future__ import annotations

import argparse
import json
import math
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
STATE_BYTES, REPORTS, KILL_AFTER_REPORT = 4096, 3, 2
"""--mode control: bytes of state per worker; reports per group; rank W-1 exits after this many reports."""


def control_worker(config: dict) -> None:
    """--mode control's training function: no model, 4 KiB of state, timestamps into config["out"]."""
    import ray.train

    entered = time.time()
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    out = Path(config["out"])
    checkpoint = ray.train.get_checkpoint()
    # the marker, not the checkpoint, tells the restarted group: Ray Train registers a reported checkpoint after
    # the report returns, so a rank that exits right away may leave the restart without one
    attempt = 1 if (out / "killed").exists() else 0
    record = {"entered": entered, "reports": []}
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = (Path(directory) / f"state_{rank}.bin").read_bytes()
        assert len(state) == STATE_BYTES, len(state)
    record["restored"] = time.time()
    for report in range(REPORTS):
        directory = Path(tempfile.mkdtemp(prefix="hr_state_"))
        (directory / f"state_{rank}.bin").write_bytes(os.urandom(STATE_BYTES))
        called = time.time()
        ray.train.report({"attempt": attempt, "report": report},
                         checkpoint=ray.train.Checkpoint.from_directory(str(directory)))
        record["reports"].append([called, time.time()])
        (out / f"attempt{attempt}_rank{rank}.json").write_text(json.dumps(record))
        if attempt == 0 and report + 1 == KILL_AFTER_REPORT and rank == world_size - 1:
            (out / "killed").write_text(str(time.time()))
            os._exit(1)


def control_once(workers: int, root: Path, backend: str) -> dict:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    out = root / f"control_{workers}"
    out.mkdir(parents=True)
    common = dict(train_loop_config={"out": str(out)},
                  scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
                  run_config=RunConfig(name=f"control_{workers}", storage_path=str(root / "runs"),
                                       checkpoint_config=CheckpointConfig(num_to_keep=2),
                                       failure_config=FailureConfig(max_failures=1)))
    if backend == "gloo":
        from ray.train.torch import TorchConfig, TorchTrainer

        trainer = TorchTrainer(control_worker, torch_config=TorchConfig(backend="gloo"), **common)
    else:
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

        trainer = DataParallelTrainer(control_worker, **common)
    fit_start = time.time()
    trainer.fit()
    fit_end = time.time()
    groups = [[json.loads((out / f"attempt{a}_rank{r}.json").read_text()) for r in range(workers)] for a in (0, 1)]
    # complete rounds: the first group's before the kill, the second group's all
    rounds = [[rank["reports"][i] for rank in group] for group, count in zip(groups, (KILL_AFTER_REPORT, REPORTS))
              for i in range(count)]
    killed = float((out / "killed").read_text())
    return {
        "workers": workers,
        "start_s": max(rank["entered"] for rank in groups[0]) - fit_start,
        "report_s": statistics.median(max(end for _, end in ranks) - max(call for call, _ in ranks)
                                      for ranks in rounds),
        "restart_s": max(rank["restored"] for rank in groups[1]) - killed,
        "fit_s": fit_end - fit_start,
    }


CONTROL_TERMS = {"start_s": "start", "report_s": "report", "restart_s": "restart"}


def growth(rows: list[dict], key: str) -> tuple[list[float], float, bool]:
    """Seconds per added worker between successive counts, the log-log slope between the two largest counts, and
    whether the term grows faster than linearly (module docstring)."""
    per_worker = [(b[key] - a[key]) / (b["workers"] - a["workers"]) for a, b in zip(rows, rows[1:])]
    a, b = rows[-2], rows[-1]
    slope = math.log(b[key] / a[key]) / math.log(b["workers"] / a["workers"])
    return per_worker, slope, per_worker[-1] >= 1.5 * max(per_worker[0], 1e-3) and slope > 1.0


def print_control(rows: list[dict], backend: str) -> None:
    trainer = "TorchTrainer + gloo" if backend == "gloo" else "DataParallelTrainer (no torch)"
    print(f"\nRay Train control plane, workers without model work ({STATE_BYTES // 1024} KiB of state each), "
          f"{trainer}, {os.cpu_count()} cores, {platform.machine()}, ray {ray.__version__}; seconds")
    print("| workers | start | report (checkpoint, per round) | restart after a killed worker | whole fit |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workers']} | {r['start_s']:.2f} | {r['report_s']:.3f} | {r['restart_s']:.2f} | {r['fit_s']:.1f} |")
    if len(rows) < 3:
        return
    spans = " | ".join(f"{a['workers']}->{b['workers']}" for a, b in zip(rows, rows[1:]))
    print(f"\nseconds per added worker | {spans} | log-log slope {rows[-2]['workers']}->{rows[-1]['workers']} |")
    faster = []
    for key, name in CONTROL_TERMS.items():
        per_worker, slope, superlinear = growth(rows, key)
        print(f"{name} | " + " | ".join(f"{value:.4f}" for value in per_worker) + f" | {slope:.2f} |")
        if superlinear:
            faster.append(name)
    print(f"\nfaster than linear: {', '.join(faster) if faster else 'none'}")


def model_once(workers: int, root: Path) -> dict:
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
    killed_at = (Path(cfg.run_dir) / f"fault_injected_rank{workers - 1}_step{KILL_AFTER}").stat().st_mtime
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


def print_model(rows: list[dict]) -> None:
    print(f"\nRay Train control plane, raven-tiny on CPU, {os.cpu_count()} cores, {platform.machine()}, "
          f"ray {ray.__version__}; seconds")
    print("| workers | fit -> step 1 | checkpoint (save + report) | restart after a killed worker | step |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workers']} | {r['fit_to_first_step_s']:.1f} | {r['checkpoint_s']:.2f} | {r['restart_s']:.1f} "
              f"| {r['step_s']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["control", "model"], default="control")
    parser.add_argument("--backend", choices=["none", "gloo"], default="none",
                        help="--mode control: no torch in the workers, or a TorchTrainer with the gloo process group")
    parser.add_argument("--workers", default=None, help="worker counts (default 2,4,8,16,32; --mode model 2,4,8,16)")
    parser.add_argument("--out", default=None, help="work directory (default: a new temporary one, removed)")
    args = parser.parse_args()
    counts = [int(w) for w in (args.workers or ("2,4,8,16,32" if args.mode == "control" else "2,4,8,16")).split(",")]
    root = Path(args.out or tempfile.mkdtemp(prefix="hr_ray_scale_"))
    temp_dir = tempfile.mkdtemp(prefix="hr_", dir="/tmp")  # short: Ray's socket paths are limited
    # the workers import the same huginn_ray as the driver (this checkout, not whichever copy is installed)
    # with its dashboard, as a job's local Ray: Ray Train's controller asks the state API whether it is alive
    ray.init(num_cpus=max(counts), _temp_dir=temp_dir, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
             **local_ray_init_kwargs())
    rows = []
    try:
        for workers in counts:
            rows.append(control_once(workers, root, args.backend) if args.mode == "control"
                        else model_once(workers, root))
            print(f"{workers} workers done: {rows[-1]}", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.mode == "control":
        print_control(rows, args.backend)
    else:
        print_model(rows)


if __name__ == "__main__":
    main()

"""Driver side of a training run: check everything cheap first, then start Ray Train workers.

`preflight` refuses bad input (missing data, a worker count the data order cannot serve, tokenizer larger than the model's
vocabulary, sequence length mismatch, impossible batch arithmetic, a shard whose footer does not match the
manifest: huginn_ray/train/shard_check.py) before any Ray worker starts, and derives
the run plan the workers share. `run_training` opens the MLflow run and runs the TorchTrainer.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from huginn_ray import storage
from huginn_ray.cluster.devices import DeviceSelectionError, check_ray_train_gpu_environment, distributed_backend
from huginn_ray.config import ConfigError
from huginn_ray.data.shards import MANIFEST, is_version_of, read_manifest, shard_version
from huginn_ray.data.tokenizer import TOKENIZER_FILE, check_tokenizer_fits, file_sha256, special_token_ids
from huginn_ray.model import ModelConfig
from huginn_ray.train import hang_watch, init_from, tracking
from huginn_ray.train import checkpoint as ckpt
from huginn_ray.train.config import TrainConfig
from huginn_ray.train.data_order import DataOrder, DataOrderError, accumulates_gradients, largest_micro_batch
from huginn_ray.train.memory import GIB, plan_memory
from huginn_ray.train.shard_check import ShardCheckError, check_shards
from huginn_ray.train.loop import train_loop_per_worker
from huginn_ray.train.stopping import clear_stop_reason, stop_reason
from huginn_ray.train.run_plan import RunPlan, WorkerConfig


def train_worker(worker: WorkerConfig) -> None:
    """What every Ray Train worker runs (its process group is up): the training loop, under the hang watch that
    dumps the flight recorder and names the ranks that did not arrive when a collective hangs
    (huginn_ray.train.hang_watch)."""
    with hang_watch.watching(worker.cfg.run_dir, worker.cfg.pg_timeout_s):
        train_loop_per_worker(worker)


class PreflightError(ValueError):
    """Input that would make the run fail; raised before any worker starts."""


def newest_checkpoint_state(run_dir: str) -> ckpt.TrainerState | None:
    """The trainer state of the run's newest complete checkpoint (the one a rerun resumes from), or None; `run_dir`
    a local path or a bucket URI."""
    for directory in ckpt.resume_candidates(None, run_dir):
        if ckpt.incomplete(directory) is None:
            try:
                return ckpt.read_trainer_state(directory)
            except ckpt.CheckpointError:
                continue
    return None


def data_version(data_dir: str, resumed: ckpt.TrainerState | None) -> str:
    """The shard version the run reads, resolved once here and handed to every worker (RunPlan.data_dir): the
    version `data.data_dir` points to now (huginn_ray.data.shards.shard_version: a symlink, or a bucket's pointer
    object), or, when the run resumes, the version its checkpoint was trained on if that is a version of the same
    pointer (a publish since the run started does not change its data). A recorded version that is gone is
    refused by name."""
    current = shard_version(data_dir)
    recorded = resumed.data_dir if resumed is not None and resumed.data_dir else None
    if recorded is None or recorded == current or not is_version_of(recorded, data_dir):
        return current
    if not storage.exists(storage.join(recorded, MANIFEST)):  # a bucket keeps no empty "directories" to look for
        raise PreflightError(
            f"data.data_dir: the run's newest checkpoint (step {resumed.step}) was trained on {recorded}, which no "
            f"longer exists ({data_dir} now points to {current}); a run keeps the shard version it started with: "
            "restore it, or start a new run_name (init_from the checkpoint's model) on the new version")
    print(f"[huginn] {data_dir} now points to {current}; this run keeps reading {recorded}, the version it "
          "started with", flush=True)
    return recorded


def data_order(cfg: TrainConfig, num_streams: int, resumed: ckpt.TrainerState | None) -> DataOrder:
    """The run's data order on scaling.num_workers ranks (elastic [min, max]: on max, and min must be served
    too): the global batch is world_batch_size, else the checkpoint's, else micro_batch_size x (max) workers; a
    resumed run keeps its checkpoint's (the data position counts rows of that batch). With context parallelism
    the data order runs on the cp groups (a cp group's ranks read the same rows)."""
    world_size = cfg.scaling.max_workers // cfg.parallelism.context_parallel
    if resumed is not None and cfg.world_batch_size is not None and cfg.world_batch_size != resumed.global_batch_rows:
        raise PreflightError(
            f"world_batch_size={cfg.world_batch_size}, but the run's newest checkpoint (step {resumed.step}) was "
            f"trained with a global batch of {resumed.global_batch_rows} rows: a run keeps its global batch (set "
            f"world_batch_size={resumed.global_batch_rows}, or a new run_name to start over)")
    rows = cfg.world_batch_size or (resumed.global_batch_rows if resumed else cfg.micro_batch_size * world_size)
    try:
        DataOrder(num_streams, rows, cfg.micro_batch_size,
                  cfg.scaling.min_workers // cfg.parallelism.context_parallel).check()
        order = DataOrder(num_streams, rows, cfg.micro_batch_size, world_size).check()
    except DataOrderError as err:
        raise PreflightError(f"scaling.num_workers={cfg.scaling.num_workers}: {err}") from None
    return order


def worker_counts(cfg: TrainConfig) -> range:
    """Every count of data ranks the run may train on: scaling.num_workers, or its [min, max] (divided by
    parallelism.context_parallel: the cp groups)."""
    cp = cfg.parallelism.context_parallel
    return range(cfg.scaling.min_workers // cp, cfg.scaling.max_workers // cp + 1)


def largest_rank_micro_batch(cfg: TrainConfig, order: DataOrder) -> int:
    """The most rows a rank gets per micro-batch on any worker count of the run; says so when that exceeds
    micro_batch_size (too few workers for micro-batches of at most micro_batch_size rows)."""
    largest = largest_micro_batch(order.num_streams, order.global_batch_rows, cfg.micro_batch_size,
                                  worker_counts(cfg))
    if largest > cfg.micro_batch_size:
        print(f"[huginn] data order: on scaling.num_workers={cfg.scaling.num_workers} a rank gets up to {largest} "
              f"rows per micro-batch, more than micro_batch_size={cfg.micro_batch_size}: no gradient accumulation "
              f"splits the {order.global_batch_rows} rows of a step into global micro-batches of whole rows of "
              f"all {order.num_streams} shards with at most {cfg.micro_batch_size} rows per rank; the memory plan "
              f"counts {largest}", flush=True)
    return largest


def schedule_steps(cfg: TrainConfig, global_batch_rows: int) -> int:
    """Optimizer steps of the schedule: max_steps, or max_tokens // (global batch x block_size)."""
    if cfg.max_steps is not None:
        return cfg.max_steps
    return int(cfg.max_tokens) // (global_batch_rows * cfg.block_size)


def check_memory(cfg: TrainConfig, model_cfg: ModelConfig, micro_batch_rows: int, accumulates: bool = True) -> None:
    """Refuse a configuration whose per-rank memory plan, with micro-batches of `micro_batch_rows` (the largest a
    rank gets) and `accumulates` (whether a step may run several on a rank), exceeds device_memory_gib x
    memory_headroom."""
    plan = plan_memory(cfg, model_cfg, micro_batch_rows, accumulates)
    if not plan.fits:
        largest = ", ".join(f"{name} {size / GIB:.1f} GiB" for name, size in plan.largest())
        raise PreflightError(
            f"memory plan: {plan.total / GIB:.1f} GiB per rank exceeds device_memory_gib x memory_headroom = "
            f"{plan.device_bytes / GIB:.1f} x {plan.headroom:g} = {plan.limit / GIB:.1f} GiB; largest items: {largest}; "
            f"what would help: {plan.advice} (the whole plan: python -m huginn_ray.train.memory --config ...)"
        )


def preflight(cfg: TrainConfig) -> RunPlan:
    """The plan every worker gets: the data order's batch, the schedule, token ids, the resolved model config."""
    try:
        check_ray_train_gpu_environment(cfg.scaling.use_gpu)
    except DeviceSelectionError as err:
        raise PreflightError(str(err)) from None
    if not cfg.data.data_dir:
        raise PreflightError("data.data_dir is not set")
    try:  # a bucket that does not exist, or no credentials: named before anything is read
        storage.check_location(cfg.data.data_dir, "data.data_dir")
        storage.check_location(cfg.data.tokenizer_path, "data.tokenizer_path")
    except storage.StorageError as err:
        raise PreflightError(str(err)) from None
    if not (storage.exists(cfg.data.data_dir) if storage.is_uri(cfg.data.data_dir)
            else Path(cfg.data.data_dir).is_dir()):
        raise PreflightError(f"data.data_dir: directory not found: {cfg.data.data_dir}")
    resumed = newest_checkpoint_state(cfg.run_dir)
    try:
        data_dir = data_version(cfg.data.data_dir, resumed)
        manifest = read_manifest(data_dir)
    except ValueError as err:
        raise PreflightError(f"data.data_dir: {err}") from None
    order = data_order(cfg, manifest["num_shards"], resumed)
    if manifest["seq_len"] != cfg.block_size:
        raise PreflightError(f"block_size={cfg.block_size} but the shards in {data_dir} hold seq_len={manifest['seq_len']}")

    try:
        model_cfg = init_from.model_config(cfg)
    except ConfigError as err:
        raise PreflightError(str(err)) from None
    except (KeyError, TypeError, ValueError) as err:
        raise PreflightError(f"model: {err}") from None
    if cfg.block_size > model_cfg.block_size:
        raise PreflightError(f"block_size={cfg.block_size} exceeds the model's block_size={model_cfg.block_size}")
    check_memory(cfg, model_cfg, largest_rank_micro_batch(cfg, order),
                 accumulates_gradients(order.num_streams, order.global_batch_rows, cfg.micro_batch_size,
                                       worker_counts(cfg)))
    if not cfg.data.tokenizer_path:
        raise PreflightError("data.tokenizer_path is not set")
    try:
        check_tokenizer_fits(cfg.data.tokenizer_path, model_cfg.vocab_size)
        ids = special_token_ids(cfg.data.tokenizer_path)
    except ValueError as err:
        raise PreflightError(f"data.tokenizer_path: {err}") from None
    source = None
    if cfg.init_from:
        try:
            init_from.check_tokenizer(cfg.init_from, cfg.data.tokenizer_path, ids)
            source = init_from.describe_source(cfg.init_from, model_cfg)
        except ConfigError as err:
            raise PreflightError(str(err)) from None
    tokenizer_file = storage.join(cfg.data.tokenizer_path, TOKENIZER_FILE)
    if manifest["tokenizer_sha256"] != file_sha256(tokenizer_file):
        raise PreflightError(
            f"data.tokenizer_path: {tokenizer_file} is not the tokenizer the shards in {data_dir} were made with "
            f"(manifest tokenizer_sha256 {manifest['tokenizer_sha256'][:12]}..., file {file_sha256(tokenizer_file)[:12]}...)"
        )
    rows = manifest["rows_per_shard"]["train"]  # every shard holds the same number of rows
    per_step = order.rows_per_stream_per_step
    data_steps = rows // per_step
    if data_steps < 1:
        raise PreflightError(f"{data_dir}: a shard holds {rows} rows, one step needs {per_step} of every shard")
    val_rows = cfg.eval_iters * order.rows_per_stream_per_micro_batch
    if manifest["rows_per_shard"]["val"] < val_rows:
        raise PreflightError(
            f"{data_dir}: validation shards hold {manifest['rows_per_shard']['val']} rows, eval_iters x rows per "
            f"shard and micro-batch = {cfg.eval_iters} x {order.rows_per_stream_per_micro_batch} = {val_rows}"
        )
    steps = fit_schedule_to_data(cfg, data_dir, schedule_steps(cfg, order.global_batch_rows), data_steps, rows,
                                 per_step)

    # the one check that opens 2 x num_shards files: after every check that reads only the config and the manifest
    try:
        shards = check_shards(data_dir, manifest, model_cfg.vocab_size)
    except ShardCheckError as err:
        raise PreflightError(str(err)) from None
    print(f"[huginn] shards checked: {shards.files} footers in {shards.seconds:.1f} s ({shards.threads} threads)"
          + (f"; {shards.row_groups_without_statistics} row groups carry no id statistics (their ids are "
             "range-checked by collate during training only)" if shards.row_groups_without_statistics else ""), flush=True)
    precision = cfg.precision if cfg.precision != "auto" else ("bf16-mixed" if cfg.scaling.use_gpu else "fp32")
    return RunPlan(global_batch_rows=order.global_batch_rows, num_streams=order.num_streams, data_dir=str(data_dir),
                   schedule_steps=steps,
                   pad_id=ids["pad"], eos_id=ids["eos"], precision=precision, model_config=model_cfg,
                   stop_at_unix=stop_at_unix(cfg, time.time(), os.environ), init_from=source)


def fit_schedule_to_data(cfg: TrainConfig, data_dir: Path, schedule_steps: int, data_steps: int, rows: int,
                         rows_per_step: int) -> int:
    """The steps the run and its schedule span: `schedule_steps` when the shards hold that many; else the run is
    refused, or with schedule.fit_to_data the schedule is laid over the `data_steps` the shards hold."""
    if data_steps >= schedule_steps:
        return schedule_steps
    shortfall = (f"{data_dir}: a shard holds {rows} train rows, {data_steps} steps of {rows_per_step} rows from "
                 f"every shard, but the schedule is laid out for {schedule_steps} steps (max_steps / max_tokens)")
    if not cfg.schedule.fit_to_data:
        raise PreflightError(f"{shortfall}: the run would stop at the data's end at peak lr, without its cooldown. "
                             f"Set schedule.fit_to_data=true to lay the schedule over the {data_steps} steps, "
                             f"or max_steps={data_steps}")
    print(f"[huginn] {shortfall}; schedule.fit_to_data: the schedule (warmup {cfg.schedule.warmup_steps}, cooldown "
          f"{cfg.schedule.cooldown_steps} steps) is laid over {data_steps} steps", flush=True)
    return data_steps


JOB_END_TIME_ENV = "HUGINN_JOB_END_TIME"
"""Unix time at which the allocation ends (exported by cluster_yamls/frontier.sbatch from squeue)."""


def stop_at_unix(cfg: TrainConfig, start: float, environ: dict) -> float | None:
    """When the workers must have saved and stopped: the earlier of `start + time_limit_s` and the allocation's
    end, minus time_limit_margin_s; None without a budget."""
    ends = [start + cfg.time_limit_s] if cfg.time_limit_s else []
    if environ.get(JOB_END_TIME_ENV):
        try:
            ends.append(float(environ[JOB_END_TIME_ENV]))
        except ValueError:
            raise PreflightError(f"{JOB_END_TIME_ENV}={environ[JOB_END_TIME_ENV]!r} is not a Unix time") from None
    if not ends:
        return None
    stop_at = min(ends) - cfg.time_limit_margin_s
    if stop_at <= start:
        raise PreflightError(
            f"no time left: the budget ends {min(ends) - start:.0f} s from now (time_limit_s={cfg.time_limit_s}, "
            f"{JOB_END_TIME_ENV}={environ.get(JOB_END_TIME_ENV)}), less than time_limit_margin_s="
            f"{cfg.time_limit_margin_s:g}")
    return stop_at


@dataclass
class RunOutcome:
    ok: bool
    message: str
    checkpoint_path: str | None
    mlflow_uri: str
    mlflow_run_id: str
    run_dir: str
    metrics: dict


def run_training(cfg: TrainConfig, plan: RunPlan, ray_train_log_level: str = "INFO") -> RunOutcome:
    """MLflow run and TorchTrainer for a plan from `preflight`; Ray must be initialised (see jobs/train.py).

    `ray_train_log_level` is the console level of Ray Train's own controller and worker loggers (its log
    files under the Ray session keep everything)."""
    run_dir = cfg.run_dir
    uri = tracking.tracking_uri(cfg.mlflow.tracking_uri, cfg.out_dir)
    plan.mlflow_uri = uri
    plan.mlflow_run_id = tracking.open_run(cfg, uri, run_dir, plan.init_from)

    backend = distributed_backend(torch.device("cuda" if cfg.scaling.use_gpu else "cpu"))
    # a bucket through huginn_ray.storage's pyarrow file system: the endpoint of AWS_ENDPOINT_URL is the one used
    storage_filesystem, storage_path = storage.filesystem(cfg.out_dir) if storage.is_uri(cfg.out_dir) \
        else (None, cfg.out_dir)
    trainer = TorchTrainer(
        train_worker,
        train_loop_config=WorkerConfig(cfg, plan, ray_train_log_level),
        torch_config=TorchConfig(backend=backend, timeout_s=cfg.pg_timeout_s),
        scaling_config=ScalingConfig(
            # [min, max]: Ray Train's elastic worker group
            num_workers=tuple(cfg.scaling.num_workers) if isinstance(cfg.scaling.num_workers, list)
            else cfg.scaling.num_workers,
            use_gpu=cfg.scaling.use_gpu,
            resources_per_worker={"CPU": cfg.scaling.cpus_per_worker},
            placement_strategy=cfg.scaling.placement_strategy,
        ),
        run_config=RunConfig(
            name=cfg.run_name,
            storage_path=storage_path,
            storage_filesystem=storage_filesystem,
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            failure_config=FailureConfig(max_failures=cfg.max_failures),
            logging_config=LoggingConfig(log_level=ray_train_log_level),
            # set before each worker's process group exists: the flight recorder's size and dump path
            worker_runtime_env={"env_vars": hang_watch.flight_recorder_env(cfg.run_dir)},
        ),
    )
    ok = False
    status = "FAILED"  # an exception leaves the MLflow run FAILED
    clear_stop_reason(cfg)  # left by an earlier attempt that this rerun resumes
    try:
        result = trainer.fit()
        metrics = dict(result.metrics or {})
        checkpoint_path = ckpt.checkpoint_location(result.checkpoint) if result.checkpoint else None
        stopped = stop_reason(cfg)
        ok = stopped is None
        reason = metrics.get("stop_reason")
        step = metrics.get("step")
        message = stopped if not ok else (
            f"stopped on request at step {step}; rerun to resume" if reason == "request"
            else f"stopped at the time limit at step {step}; rerun to resume" if reason == "time limit"
            else f"finished at step {step}"
        )
        # stopped on request or at the time limit (SIGTERM, preemption): KILLED, and a rerun continues the same
        # MLflow run
        status = "FAILED" if not ok else "KILLED" if reason else "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        tracking.close_run(uri, plan.mlflow_run_id, status)
    return RunOutcome(ok, message, checkpoint_path, tracking.redact_uri(uri), plan.mlflow_run_id, run_dir, metrics)

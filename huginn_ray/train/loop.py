"""The per-worker training loop that Ray Train runs on every rank (reference §3.3-§3.4, §3.9-§3.11).

One step: read and check the step's micro-batches on the host, count their supervised labels over every rank (one
small all-reduce, used on the device), sample the depth (n, k) from the step (the same on every rank),
forward+backward every micro-batch, exchange gradients (fp32 mean), clip, set the scheduled lr in every group,
step (not the first one), then validate, log and checkpoint on their intervals. The loss is the sum of the token
losses of the whole global batch over its supervised tokens, divided by their count, on every layout, gradient
accumulation and split of a micro-batch's rows over the ranks (they may differ by a row: data_order.py). With
context parallelism each rank of a cp group trains its positions of its group's rows, forward and backward inside
the group's context (huginn_ray.train.context_parallel), and counts and sums only its own tokens.

All ranks decide alike with one small all-reduce per step, read once by the host (the step's only host sync):
the loss, whether the loss or gradient norm is non-finite, a stop request (SIGTERM, the Slurm signal), the time
budget running out, and a rank that could not read its data. A data error therefore stops every rank at the same
step, within seconds, instead of leaving 4095 ranks waiting for the process-group timeout. A log step adds one
all-reduce and one read for everything else the log shows (huginn_ray.train.observe: phase times, module norms,
every rank's step time, the model's telemetry, the validation losses).

The file reads top down in the order a worker runs: its phases (`train_on_rank`), the components it builds, where its
weights come from, the steps, then what a step logs, saves and validates. The model's parallelism is applied by
huginn_ray.train.parallelize, the saves made by checkpoint.Checkpointer, the stops decided from
huginn_ray.train.stopping.
"""

from __future__ import annotations

import logging
import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from huginn_ray.cluster.devices import training_device
from huginn_ray.data.shards import shard_path
from huginn_ray.model import ModelConfig, RecurrentGPT, sample_recurrence, training_flops_per_token
from huginn_ray.model.attention import (AttentionBackendError, AttentionShape, choose_attention_backend,
                                         probe_attention_backends, restrict_attention)
from huginn_ray.train import checkpoint as ckpt
from huginn_ray.train import parallel
from huginn_ray.train.collectives import all_ranks, count_ranks
from huginn_ray.train.config import TrainConfig
from huginn_ray.train.context_parallel import ContextParallel, ContextParallelError
from huginn_ray.train.data_order import DataOrder, DataOrderError
from huginn_ray.train.sharded_init import initialise_sharded
from huginn_ray.train.fault_injection import inject_fault
from huginn_ray.train.init_from import load_weights_into
from huginn_ray.train.observe import (MODULES, NO_CLOCK, OWN_PHASES, LogWindow, ModuleNorms, PhaseClock,
                                      find_stragglers, own_time_slot, progress_line, read_interval)
from huginn_ray.train.optim import apply_config_on_resume, build_optimizer, set_lr, trapezoid_lr
from huginn_ray.train.parallelize import gradient_sync, shard_and_allocate
from huginn_ray.train.profiling import StepProfiler, log_profile
from huginn_ray.train.run_plan import RunPlan, WorkerConfig
from huginn_ray.train.shard_reader import Batch, RankReader, ShardReader, StepPrefetcher, collate
from huginn_ray.train.stopping import (DATA_ERRORS, Stop, data_error_stop, report_stop, stop_requested, time_is_up,
                                       write_stop_reason)
from huginn_ray.train.validation import (host_count, log_validation, read_validation_batch, validation_metrics,
                                         validation_sums)
from huginn_ray.train.warmup import register_node, warmup_allreduce


def train_loop_per_worker(worker: WorkerConfig) -> None:
    # Ray Train sends the worker's root logger to the console at INFO; some of Ray's own loggers hang off the root
    # (one, named by its file path, logs "Reporting training result ..." at every checkpoint): the run's level
    logging.getLogger().setLevel(worker.log_level)
    cfg = worker.cfg
    try:
        train_on_rank(cfg, worker.plan)
    except Stop as stop:
        # Every rank raises Stop at the same step (the decision is all-reduced). Ending normally instead of
        # raising keeps Ray Train from restarting a run that would only fail again; the driver learns why
        # from the file (Ray's result carries the metrics of the last checkpoint only).
        print(f"[huginn] {stop}", flush=True)
        if stop.reporter:
            write_stop_reason(cfg, stop)
    finally:
        from huginn_ray.train import tracking

        # rank 0's metrics still buffered (a tracking outage) get their last chance, bounded by flush_timeout_s
        tracking.close_loggers()


def train_on_rank(cfg: TrainConfig, plan: RunPlan) -> None:
    """The run on this rank, phase by phase: start, validation rows, where the weights come from, the collective
    warmup, the metrics logger, the steps."""
    import ray.train  # here, not at the top: build_components and train_step run where Ray and MLflow are not installed

    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    device = training_device()
    c = start_worker(cfg, plan, ctx, device)
    val_batch = c.cp.local_batch(read_validation_batch(c.order, cfg, plan, c.shape.data_rank(rank), device))
    state, resized_from = restore_state(c, cfg, plan, rank, world_size, device)
    if cfg.warmup_allreduce_mib > 0:
        warmup_allreduce(device, cfg.warmup_allreduce_mib, timeout_s=cfg.warmup_timeout_s)
    logger = open_logger(cfg, state, rank, world_size, resized_from, plan) if rank == 0 else None
    run_steps(c, cfg, plan, state, val_batch, logger, rank, world_size, device)


def start_worker(cfg: TrainConfig, plan: RunPlan, ctx, device: torch.device) -> Components:
    """This rank's components (the weights not yet read), its node checked against the layout (shard groups are
    consecutive ranks, which must be one node's or part of one; always checked), the mesh's groups warmed."""
    import ray

    rank = ctx.get_world_rank()
    register_node()
    placement = {"node_rank": ctx.get_node_rank(), "local_rank": ctx.get_local_rank(),
                 "local_world_size": ctx.get_local_world_size(), "node_ip": ray.util.get_node_ip_address()}
    try:
        c = build_components(cfg, plan, rank, device, local_world_size=ctx.get_local_world_size(),
                             initialise=False)  # a checkpoint may hold the weights: initialised after the resume
    except DataOrderError as err:  # the same on every rank, before any collective
        raise Stop(f"data order: {err}", reporter=rank == 0) from None
    except (parallel.LayoutError, ContextParallelError) as err:
        raise Stop(f"layout: {err}", reporter=rank == 0) from None
    placements = all_ranks(placement, device)
    c.hosts = [p["node_ip"] for p in placements]
    parallel.check_node_layout(c.shape, placements)
    if rank == 0:
        print(f"[huginn] {parallel.describe_layout(c.shape, placements)}", flush=True)
    parallel.warm_mesh(c.mesh, device, c.cp.group)
    return c


@dataclass
class Components:
    """Everything a rank trains with; built the same way under Ray Train and under torchrun (bench)."""

    model_cfg: ModelConfig
    model: RecurrentGPT
    """The model (FSDP2-sharded under hsdp; DDP, if chosen, wraps it in `sync.module`)."""
    sync: object
    optimizer: torch.optim.Optimizer
    reader: StepPrefetcher
    order: DataOrder
    """Which rows this rank reads at every step (huginn_ray.train.data_order)."""
    autocast: object
    mesh: object
    """The ("replicate", "shard") DeviceMesh (huginn_ray.train.parallel)."""
    shape: parallel.MeshShape
    cp: ContextParallel
    """This rank's part of its cp group (huginn_ray.train.context_parallel; disabled at context_parallel 1)."""
    resumed: bool = False
    """Model, optimizer and reader were loaded from a checkpoint."""
    hosts: list[str] | None = None
    """Every rank's host, as the IP address of its Ray node, gathered at startup with the placements (straggler
    lines name them); None outside Ray Train."""


def build_components(cfg: TrainConfig, plan: RunPlan, rank: int, device: torch.device,
                     local_world_size: int | None = None, initialise: bool = True) -> Components:
    """`local_world_size`: ranks on this node (Ray Train's); it is the shard size of hsdp. None: every rank on
    one node. Raises DataOrderError when the data order does not allow this world size (every rank raises it,
    before any collective).

    The model is built on the meta device, then parallelised (huginn_ray.train.parallelize: compiled, sharded
    there under hsdp, and only this rank's part allocated: no rank ever holds the whole model under hsdp). Its
    weights (`load_initial_weights`): random (the seed's, identical on every rank, drawn shard by shard) or, with
    plan.init_from, the trained model's. `initialise=False` leaves them allocated, not initialised, for a caller
    that may resume from a checkpoint instead."""
    if device.type == "cpu":
        torch.set_num_threads(cfg.cpu_threads)
    world_size = dist.get_world_size()
    shape = parallel.mesh_shape(cfg.parallelism.sharded, world_size, local_world_size or world_size,
                                cfg.parallelism.context_parallel)
    order = plan.data_order(cfg.micro_batch_size, shape.data_ranks)  # a cp group's ranks read the same rows
    mesh = parallel.build_mesh(shape, device.type)
    cp = ContextParallel(parallel.context_group(shape), cfg.block_size, device)
    torch.manual_seed(cfg.seed)  # identical initial model on every rank
    random.seed(cfg.seed)
    model_cfg = plan.model_config
    with torch.device("meta"):  # no CPU copy of the model: allocate and initialise on the training device
        model = RecurrentGPT(model_cfg)
    model.split_sequence(cp if cp.enabled else None)
    use_attention_backend(model, cfg, plan, order.largest_micro_batch, rank, device)
    shard_and_allocate(model, cfg, plan.precision, shape, mesh, device)
    if initialise:
        load_initial_weights(model, plan, rank, cfg.seed, mesh.get_group("replicate"))
    sync = gradient_sync(model, cfg, shape, mesh)  # after the weights: DDP broadcasts rank 0's when built
    optimizer = build_optimizer(model, cfg.optim)
    reader = StepPrefetcher(
        RankReader(order, shape.data_rank(rank),
                   lambda stream: ShardReader(shard_path(plan.data_dir, "train", stream), stream, cfg.seed,
                                              cfg.block_size + 1)),
        order.grad_accum, lambda rows: cp.local_batch(collate(rows, plan.pad_id, plan.eos_id, model_cfg.vocab_size)),
        pin=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if plan.precision == "bf16-mixed" else nullcontext()
    return Components(model_cfg, model, sync, optimizer, reader, order, autocast, mesh, shape, cp)


def use_attention_backend(model: RecurrentGPT, cfg: TrainConfig, plan: RunPlan, rows: int, rank: int,
                          device: torch.device) -> None:
    """The attention kernel for micro-batches of up to `rows` rows on this device (the config's choice, or the
    first fused kernel that takes the shape), set on the model; every rank stops naming the shape when none does."""
    model_cfg = plan.model_config
    attention = AttentionShape(rows, model_cfg.num_attention_heads, cfg.block_size, model_cfg.head_dim,
                               torch.bfloat16 if plan.precision == "bf16-mixed" else torch.float32)
    try:
        backend = choose_attention_backend(probe_attention_backends(attention, device), attention, cfg.attention_backend)
    except AttentionBackendError as err:
        raise Stop(f"attention: {err}", reporter=rank == 0) from None
    restrict_attention(model, backend)
    if rank == 0:
        print(f"[huginn] attention: {backend} kernel ({attention.describe()}, {device.type})", flush=True)


def load_initial_weights(model: RecurrentGPT, plan: RunPlan, rank: int, seed: int, replicas) -> None:
    """The starting weights into this rank's (allocated) parameters; every rank calls it. With plan.init_from the
    trained model's, each rank reading 1/W of it and the `replicas` (the ranks holding the same part) completing
    each other; else the random init of `seed` (torch's RNG seeded here, so the draws are the same wherever the
    call comes), drawn shard by shard (`initialise_sharded`)."""
    source = plan.init_from
    if not source:
        torch.manual_seed(seed)
        initialise_sharded(model)
        return
    start = time.perf_counter()
    load_weights_into(model, source.path, replicas)
    if rank == 0:
        print(f"[huginn] weights from {source.path} (sha256 of the tensors {source.sha256[:12]}...) in "
              f"{time.perf_counter() - start:.1f} s", flush=True)


def restore_state(c: Components, cfg: TrainConfig, plan: RunPlan, rank: int, world_size: int,
                  device: torch.device) -> tuple[ckpt.TrainerState, int | None]:
    """Where the weights come from: the newest checkpoint that loads (Ray Train's registered one first), else
    plan.init_from's model, else the seed's random weights. Returns the trainer state and, for an elastic group
    restarted on another worker count (scaling.num_workers: [min, max]), the count it had (the next checkpoint
    records the new one). The replicas are checked to agree."""
    import ray.train

    state = ckpt.TrainerState(mlflow_run_id=plan.mlflow_run_id, world_size=world_size, layout=c.shape.name,
                              num_streams=plan.num_streams, global_batch_rows=plan.global_batch_rows,
                              data_dir=plan.data_dir)
    checkpoint = ray.train.get_checkpoint()  # read where it is (a shared file system or a bucket), not downloaded
    registered = ckpt.checkpoint_location(checkpoint) if checkpoint is not None else None
    resumed = resume_from_checkpoint(c, cfg, plan, registered, rank, device)
    if resumed is not None:
        state = resumed.state
        state.layout = c.shape.name
    else:  # a fresh run: the trained model's weights or the random init (a resumed one has its own)
        error = None
        try:
            load_initial_weights(c.model, plan, rank, cfg.seed, c.mesh.get_group("replicate"))
        except ValueError as err:
            error = str(err)
        failed, = count_ranks([error is not None], device)  # every rank stops alike
        if failed:  # the first failing rank's reason (every rank's reason gathered on this path only)
            errors = [e for e in all_ranks(error, device) if e is not None]
            raise Stop(f"init_from: {errors[0]}", reporter=rank == 0)
    resized_from = state.world_size if state.world_size != world_size else None
    state.world_size = world_size
    parallel.check_replicas_agree(c.model, c.optimizer, c.mesh, device, "at startup")
    return state, resized_from


def resume_from_checkpoint(c: Components, cfg: TrainConfig, plan: RunPlan, registered: str | None, rank: int,
                           device: torch.device) -> ckpt.Resumed | None:
    """Model, optimizer and reader from the newest checkpoint that loads (ckpt.resume), its data position checked,
    then the config's optimizer hyperparameters over the checkpoint's; None when there is none. Raises Stop on
    every rank when the run cannot resume (every rank read the same files and agreed)."""
    try:
        resumed = ckpt.resume(registered, cfg.run_dir, rank, c.model, c.optimizer, device,
                              replicas=c.mesh.get_group("replicate"))
        if resumed is not None:
            ckpt.check_data_position(resumed.state, resumed.directory, plan.num_streams, plan.global_batch_rows)
            c.reader.seek(resumed.state.rows_per_stream)
            apply_config_on_resume(c.optimizer, cfg.optim, verbose=rank == 0)
    except ValueError as err:  # CheckpointError included
        raise Stop(f"cannot resume: {err}", reporter=rank == 0) from None
    c.resumed = resumed is not None
    return resumed


def open_logger(cfg: TrainConfig, state: ckpt.TrainerState, rank: int, world_size: int, resized_from: int | None,
                plan: RunPlan):
    """Rank 0's metrics logger, which records every start of a worker group at the step it starts from (the
    history shows each resize and restart)."""
    from huginn_ray.train.tracking import MetricsLogger

    logger = MetricsLogger(plan.mlflow_uri, state.mlflow_run_id, max_pending=cfg.mlflow.max_pending_metrics,
                           flush_timeout_s=cfg.mlflow.flush_timeout_s)
    logger.log({"num_workers": world_size}, state.step)
    if resized_from is not None:
        print(f"[huginn] resize at step {state.step}: {resized_from} -> {world_size} workers", flush=True)
    return logger


def run_steps(c: Components, cfg: TrainConfig, plan: RunPlan, state: ckpt.TrainerState, val_batch: Batch, logger,
              rank: int, world_size: int, device: torch.device) -> None:
    """Steps until the schedule ends or a stop is requested: each trains, validates, logs and checkpoints on its
    interval (`logger`: rank 0's, None elsewhere). A validation step is also a log step: its losses travel in
    the log interval's one read."""
    max_steps = plan.schedule_steps
    tokens_per_step = plan.global_batch_rows * cfg.block_size
    window = LogWindow()
    start_step = state.step
    step_seconds = 0.0
    checkpointer = ckpt.Checkpointer(cfg.saves_asynchronously, rank, device)
    clock = PhaseClock(device)
    norms = ModuleNorms(c.model, world_size) if cfg.observe.module_norms else None
    profiler = StepProfiler(cfg.profile, cfg.run_dir, rank, device)

    while state.step < max_steps:
        state.step += 1
        step = state.step
        last_step = step == max_steps
        validation_step = step % cfg.eval_step_interval == 0 or last_step
        log_step = step % cfg.log_step_interval == 0 or validation_step
        profiler.before_step(step)
        step_start = time.time()
        result = train_step(c, step, cfg, plan, device, want_telemetry=cfg.telemetry and log_step,
                            stop_here=rank == 0 and stop_requested(cfg),
                            time_up=rank == 0 and time_is_up(plan.stop_at_unix, step_start, step_seconds),
                            clock=clock, norms=norms if log_step else None)
        step_seconds = time.time() - step_start
        state.tokens += tokens_per_step
        flops = sum(training_flops_per_token(c.model_cfg, depth, cfg.block_size) for depth in result.depths)
        window.add(result.loss, flops / len(result.depths) * tokens_per_step, tokens_per_step)
        validation = None
        if validation_step:
            clock.start()
            validation = validation_sums(c.model, val_batch, cfg, plan, device, c.autocast)
            clock.lap("validation")
        if cfg.profile.steps and step == cfg.profile.steps[1]:
            log_profile(profiler.after_step(step), logger, device)
        if log_step:
            log_interval(c, window, result, validation, clock, state, max_steps, cfg, logger, rank, world_size,
                         device)
            window = LogWindow()
        if (step % cfg.checkpoint.save_step_interval == 0 or (last_step and cfg.checkpoint.save_last_step)
                or result.stop_requested):
            clock.start()
            save_checkpoint(c, checkpointer, state, result, last_step, logger, rank, device)
            clock.lap("checkpoint")
        if result.stop_requested:
            if rank == 0:
                report_stop(cfg, result.stop_reason, step)
            return
        inject_fault(cfg, rank, step, start_step)
    checkpointer.finish()


@dataclass
class StepResult:
    loss: float
    """The step's loss: the token losses of the global batch (every micro-batch of every rank) summed over the
    supervised tokens, divided by their count."""
    lr: float
    grad_norm: float
    """Global L2 norm of the averaged gradients before clipping."""
    num_steps: tuple[int, int]
    """Depth (n, k) of the step's last micro-batch."""
    telemetry: dict[str, torch.Tensor] | None
    """The model's latent-state telemetry of the last micro-batch (device scalars), when asked for."""
    stop_reason: str | None
    """Save and stop after this step: "request" (a rank saw the STOP file: SIGTERM, the Slurm signal) or
    "time limit" (a rank found the time budget running out); None: go on."""
    depths: list = None
    """Depth (n, k) of every micro-batch of the step."""
    module_norms: torch.Tensor | None = None
    """With `norms`: this rank's shares of the squared gradient norms, then of the squared update norms, of
    observe.MODULES (device fp64; the log interval's all-reduce sums them)."""

    @property
    def stop_requested(self) -> bool:
        return self.stop_reason is not None


def micro_step(step: int, micro: int, grad_accum: int) -> int:
    """1-based micro-batch step of micro-batch `micro` (0-based) of optimizer step `step` (reference §3.4:
    `microbatch_step`): the depth sampler is seeded with it."""
    return (step - 1) * grad_accum + micro + 1


def train_step(c: Components, step: int, cfg: TrainConfig, plan: RunPlan, device: torch.device,
               want_telemetry: bool = False, stop_here: bool = False, time_up: bool = False,
               clock: PhaseClock = NO_CLOCK, norms: ModuleNorms | None = None) -> StepResult:
    """One optimizer step (reference §3.4): identical depth on all ranks, micro-batches, exchange, clip, step.

    `stop_here` / `time_up`: this rank asks every rank to save and stop after this step (the STOP file, the time
    budget). Losses and the gradient norm stay on the device until the step's one all-reduce is read. `clock`
    times the step's phases (observe.PHASES); with `norms` the step also leaves its module gradient and update
    norms on the device (log steps)."""
    grad_accum = c.order.grad_accum
    clock.start()
    batches, data_error = read_batches(c, cfg)
    clock.lap("data")
    counts, global_count = supervised_counts(batches, plan.pad_id, device)
    clock.lap("comm")
    telemetry = None
    # no supervised token in the whole step: a non-finite step (on_nonfinite decides)
    local_loss = torch.zeros((), dtype=torch.float64, device=device).masked_fill(global_count == 0, math.nan)
    depths = []
    for micro, batch in enumerate(batches):
        # every micro-batch draws its own depth from its micro-batch step (the same on every rank)
        n, k = sample_recurrence(micro_step(step, micro, grad_accum), c.model_cfg.mean_recurrence,
                                 c.model_cfg.mean_backprop_depth)
        depths.append((n, k))
        inputs = batch.inputs.to(device, non_blocking=True)  # pinned on GPUs
        labels = batch.labels.to(device, non_blocking=True)
        states = c.model.keyed_initial_state(batch.keys, cfg.block_size, cfg.seed, device)
        last = micro == grad_accum - 1
        with c.sync.micro_batch(last=last), c.cp.sequence():  # forward and backward inside the cp context
            with c.autocast:
                # collate checks every batch's token ids on the host: no device read for them here
                out = c.sync.module(inputs, labels=labels, num_steps=(n, k), input_states=states,
                                    ignore_index=plan.pad_id, return_telemetry=want_telemetry and last,
                                    loss_chunk_tokens=cfg.loss_chunk_tokens, check_token_ids=False)
            clock.lap("forward")
            if counts[micro]:
                # out.loss is this micro-batch's mean over its supervised tokens; the gradient exchange divides
                # by the world size: out.loss / (N / (W n)) makes the step's loss sum / N over the global batch
                divisor = global_count / (dist.get_world_size() * counts[micro])  # = grad_accum when all are full
                (out.loss / divisor.float()).backward()
                local_loss += out.loss.detach().double() / divisor
            else:  # nothing supervised: its mean is 0/0; a zero gradient keeps every collective of the step
                (out.loss * 0.0).backward()
        clock.lap("backward")
        telemetry = out.telemetry or telemetry
    c.sync.finish()
    telemetry = c.cp.mean(telemetry)
    clock.lap("comm")
    grad_squares = norms.grads() if norms is not None else None  # before clipping

    # a function of the optimizer step alone, so a resume on another worker count or accumulation keeps it
    lr = trapezoid_lr(step, cfg.optim.lr, cfg.schedule.warmup_steps, cfg.schedule.cooldown_steps,
                      plan.schedule_steps, cfg.schedule.min_lr)
    set_lr(c.optimizer, lr, cfg.schedule.reference_lr_quirk, c.resumed)
    grad_norm = clip_gradients(c, cfg.grad_clip)
    clock.lap("optimizer")

    # the step's agreement: [loss sum, non-finite ranks, stop requests, time-ups, data errors, grad norm (rank 0's)];
    # built on the device (no host round trip), reduced once, read once
    rank, world_size = dist.get_rank(), dist.get_world_size()
    agreed = torch.zeros(6, dtype=torch.float64, device=device)
    agreed[0] = local_loss
    agreed[1] = ~(torch.isfinite(local_loss) & torch.isfinite(grad_norm))
    for index, flag in ((2, stop_here), (3, time_up), (4, data_error is not None)):
        if flag:
            agreed[index] = 1.0
    if rank == 0:
        agreed[5] = grad_norm
    dist.all_reduce(agreed)
    loss_sum, nonfinite_ranks, stop_ranks, time_up_ranks, data_error_ranks, grad_norm = agreed.tolist()
    loss = loss_sum / world_size
    clock.lap("comm")

    if data_error_ranks:
        c.optimizer.zero_grad(set_to_none=True)
        raise data_error_stop(f"step {step}", data_error, int(data_error_ranks), device)
    if nonfinite_ranks:
        message = f"step {step}: non-finite loss ({loss}) or gradient norm ({grad_norm})"
        if cfg.on_nonfinite == "stop":
            raise Stop(f"{message}; stopping (on_nonfinite=stop)", reporter=rank == 0)
        if rank == 0:
            print(f"[huginn] {message}; optimizer step skipped (on_nonfinite=skip)", flush=True)
    elif not (step == 1 and cfg.skip_first_optimizer_step):
        if norms is not None:
            norms.snapshot()
        c.optimizer.step()
    module_norms = None
    if norms is not None:  # no snapshot: no step taken, a zero update
        updates = norms.updates() if norms.before is not None else torch.zeros_like(grad_squares)
        module_norms = torch.cat([grad_squares, updates])
    c.optimizer.zero_grad(set_to_none=True)
    clock.lap("optimizer")
    stop_reason = "request" if stop_ranks else "time limit" if time_up_ranks else None
    return StepResult(loss, lr, grad_norm, (n, k), telemetry, stop_reason, depths, module_norms)


def supervised_counts(batches: list[Batch], pad_id: int, device: torch.device) -> tuple[list[int], torch.Tensor]:
    """Supervised labels of each of this rank's micro-batches (collate gives the pad id to every label that is
    padding or, with a loss mask, not a target; the loss ignores it), counted on the host where the batches are,
    and of the whole step over every rank as an fp64 device scalar: one small all-reduce, which the forwards'
    loss scaling waits for on the device; the host never reads it."""
    counts = [host_count(batch.labels != pad_id) for batch in batches]
    total = torch.tensor([sum(counts)], dtype=torch.float64).to(device, non_blocking=True)
    dist.all_reduce(total)
    return counts, total[0]


def read_batches(c: Components, cfg: TrainConfig) -> tuple[list[Batch], str | None]:
    """The step's micro-batches, read and checked on the host (during the previous step: the
    StepPrefetcher) before any compute.

    A rank that cannot read its data trains this one step on zeros, so that every collective of the step still
    meets, and reports the error (rank and file) through the step's all-reduce."""
    try:
        return c.reader.next_step(), None
    except DATA_ERRORS as err:
        zeros = torch.zeros(cfg.micro_batch_size, cfg.block_size, dtype=torch.long)
        keys = torch.zeros(cfg.micro_batch_size, dtype=torch.long)
        batch = c.cp.local_batch(Batch(zeros, zeros, keys))
        return [batch] * c.order.grad_accum, f"{c.reader.path}: {type(err).__name__}: {err}"


def clip_gradients(c: Components, max_norm: float) -> torch.Tensor:
    """Global L2 norm of the averaged gradients before clipping, as a device scalar (under hsdp summed over the
    shard group in one all-reduce)."""
    return parallel.clip_grad_norm_([p for p in c.model.parameters() if p.requires_grad], max_norm)


def log_interval(c: Components, window: LogWindow, result: StepResult, validation: torch.Tensor | None,
                 clock: PhaseClock, state: ckpt.TrainerState, max_steps: int, cfg: TrainConfig, logger, rank: int,
                 world_size: int, device: torch.device) -> None:
    """The log interval's metrics, from one all-reduce and one device-to-host read (observe.read_interval) of
    everything the device holds for it: every rank's own step time, the module norms, the model's telemetry and
    the validation sums. Every rank takes part; rank 0 logs, prints the progress, phase, straggler and
    validation lines, and queues the validation plot for the logger's drawing thread."""
    step = state.step
    phases = {phase: seconds / window.steps for phase, seconds in clock.read().items()}
    summed = {"own_seconds": own_time_slot(sum(phases[p] for p in OWN_PHASES), rank, world_size)}
    if result.module_norms is not None:
        summed["module_norms"] = result.module_norms
    if validation is not None:
        summed["validation"] = validation
    telemetry = result.telemetry or {}
    from_rank0 = {"telemetry": torch.stack(list(telemetry.values()))} if telemetry else {}
    values = read_interval(summed, from_rank0, rank, device)
    metrics = window.metrics(result.loss, result.lr, result.grad_norm, result.num_steps, state.tokens, world_size,
                             cfg.peak_flops_per_device, device)
    if logger is None:
        return
    metrics.update({f"time/{phase}": seconds for phase, seconds in phases.items()})
    metrics.update({f"telemetry/{key}": value for key, value in zip(telemetry, values.get("telemetry", []))})
    if "module_norms" in values:
        squares = values["module_norms"]
        for i, module in enumerate(MODULES):
            metrics[f"grad_norm/{module}"] = math.sqrt(squares[i])
            metrics[f"update_norm/{module}"] = math.sqrt(squares[len(MODULES) + i])
    stragglers = find_stragglers(values["own_seconds"], cfg.observe.straggler_ratio)
    metrics["straggler/slowest_ratio"] = stragglers.slowest_ratio
    print(progress_line(step, max_steps, metrics), flush=True)
    print(f"[huginn] step {step} time per step (s): " + " ".join(f"{p} {s:.4f}" for p, s in phases.items()),
          flush=True)
    if stragglers.ranks:
        described = stragglers.describe(c.hosts or ["?"] * world_size)
        print(f"[huginn] step {step} stragglers (own time above {cfg.observe.straggler_ratio:g}x the median): "
              f"{described}", flush=True)
        metrics.update({f"straggler/rank_{r}": seconds / stragglers.median_s for r, seconds in stragglers.ranks})
        logger.set_tag(f"straggler.step_{step:06d}", described)
    logger.log(metrics, step)
    if validation is not None:
        log_validation(validation_metrics(cfg, values["validation"]), step, c.model_cfg.mean_recurrence, logger)


def save_checkpoint(c: Components, checkpointer: ckpt.Checkpointer, state: ckpt.TrainerState, result: StepResult,
                    last_step: bool, logger, rank: int, device: torch.device) -> None:
    """The replicas checked to agree, the data position recorded, the save started (the last one of a run
    finished before returning); rank 0 logs how long the save held the loop."""
    step = state.step
    parallel.check_replicas_agree(c.model, c.optimizer, c.mesh, device, f"step {step}")
    state.rows_per_stream = c.order.rows_per_stream_per_step * step
    if c.reader.position != state.rows_per_stream:  # the data order's invariant; a bug if it fails
        raise RuntimeError(f"rank {rank}: the reader stands at row {c.reader.position} of its streams, "
                           f"step {step} ends at row {state.rows_per_stream}")
    save_start = time.perf_counter()
    checkpointer.save(c.model, c.optimizer, state, result.loss, result.stop_reason,
                      final=last_step or result.stop_requested)
    if logger is not None:  # how long the save (and its report to Ray Train) held the loop
        logger.log({"checkpoint_seconds": time.perf_counter() - save_start}, step)

"""The training run's configuration: one YAML file (configs/train/*.yaml) plus dotted `key=value` overrides."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from huginn_ray import storage
from huginn_ray.config import AT_LEAST_1, NON_NEGATIVE, POSITIVE, ConfigError, Range, check_ranges, load_config


@dataclass
class ModelOverrides:
    """ModelConfig fields to change from the registry's (the reference's `model_overwrite`); each left null keeps
    the registry's value. The fields are huginn_ray.model.ModelConfig's, less `name` (model.name) and
    `activation_checkpointing` (a run setting: the top-level `activation_checkpointing`)."""

    block_size: int | None = None
    """Longest sequence the model accepts (the RoPE table's length)."""
    vocab_size: int | None = None
    """Tokenizer vocabulary size; token ids must be below it."""
    padding_multiple: int | None = None
    """The embedding and head have vocab_size rounded up to a multiple of this."""
    n_embd: int | None = None
    """Width of the residual stream and of the latent state."""
    num_attention_heads: int | None = None
    """Attention heads (head_dim = n_embd / heads)."""
    intermediate_size: int | None = None
    """Hidden width of the gated MLP."""
    n_layers_in_prelude: int | None = None
    """Sandwich blocks applied once to the embedded tokens."""
    n_layers_in_recurrent_block: int | None = None
    """Sandwich blocks of the core, applied once per recurrent iteration."""
    n_layers_in_coda: int | None = None
    """Sandwich blocks applied once after the recurrence."""
    mean_recurrence: int | None = None
    """Mean number of core iterations in training; the default depth at evaluation."""
    mean_backprop_depth: int | None = None
    """The last min(depth, this) iterations get gradients (truncated backprop)."""
    state_init: Literal["like-init", "zero"] | None = None
    """Initial latent state: trunc-normal noise ('like-init', as trained) or zeros."""
    rope_base: float | None = None
    """RoPE base frequency."""
    norm_eps: float | None = None
    """RMSNorm epsilon."""
    qk_bias: bool | None = None
    """Learned additive bias on queries and keys."""
    tie_embeddings: bool | None = None
    """lm_head shares the embedding matrix."""

    def given(self) -> dict[str, Any]:
        """The fields set, as ModelConfig keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass
class ModelSection:
    name: str = "raven-tiny"
    """Registry name of the architecture (huginn_ray.model.ModelConfig.from_name)."""
    overrides: ModelOverrides = field(default_factory=ModelOverrides)
    """ModelConfig fields to change, e.g. vocab_size, mean_recurrence."""


@dataclass
class OptimConfig:
    name: Literal["ELLISAdam", "AdamW"] = "ELLISAdam"
    """Optimizer class: the reference's ELLISAdam or torch AdamW."""
    lr: float = 4e-5
    """Peak learning rate (ELLISAdam also uses it as init_lr in the decoupled weight decay, so it must be
    positive there; AdamW takes 0: a run that changes no weight)."""
    weight_decay: float = 4e-5
    """Weight decay of the weight and embedding groups."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam betas."""
    eps: float = 1e-6
    """Adam epsilon (ELLISAdam: also the floor sqrt of the second moment under update clipping)."""
    update_clipping: bool = True
    """ELLISAdam: scale the step down when the update RMS of a tensor exceeds 1."""
    atan_adam: bool = True
    """ELLISAdam: atan2 update instead of m / (sqrt(v) + eps)."""
    running_init: bool = True
    """ELLISAdam: initialise the moments from the first gradient."""
    decouple_wd: bool = True
    """ELLISAdam: decay by (lr / init_lr) * weight_decay instead of lr * weight_decay."""
    no_weight_decay_for_bias_and_norm: bool = True
    """No decay on norm weights and biases (the third parameter group)."""
    compile_step: bool | None = None
    """ELLISAdam: torch.compile the step's two per-tensor functions (one fused kernel each: 9 passes over a tensor's
    memory instead of 26) when true, eager when false; null: compiled on GPUs, eager on CPU (compiling costs
    seconds at every worker's start there). Same result to rounding."""


@dataclass
class ScheduleConfig:
    warmup_steps: int = 4096
    """Linear warmup length in optimizer steps."""
    cooldown_steps: int = 4096
    """Linear cooldown to min_lr over the last optimizer steps before max_steps."""
    min_lr: float = 0.0
    """Floor of the cooldown."""
    fit_to_data: bool = False
    """When the shards hold fewer steps than max_steps / max_tokens asks for: false refuses the run at preflight
    (it would stop at the data's end at peak lr, with no cooldown); true lays the schedule over the steps the data
    allows (warmup and cooldown keep their lengths, the cooldown ends at the data's last step)."""
    reference_lr_quirk: bool = False
    """Forensic only: reproduce the reference's LR bug (weight matrices at the constant peak lr from step 1,
    every group frozen after a resume) instead of the intended schedule."""


@dataclass
class GradSyncConfig:
    kind: Literal["chunk_stream", "chunk_stream_overlap", "ddp"] = "chunk_stream"
    """Gradient exchange (huginn_ray.train.grad_sync); under parallelism.mode=hsdp the chunk stream between shard
    groups, after backward (chunk_stream) or launched during it (chunk_stream_overlap); not ddp."""
    chunk_mib: float = 64.0
    """Size of every all-reduce message of the chunk streams, in MiB of fp32 (DDP: bucket size)."""
    max_chunks_in_flight: int = 4
    """chunk_stream_overlap: chunk buffers (all-reduces) in flight at once; bounds its extra memory."""
    ddp_find_unused_parameters: bool = False
    """Only for ddp: needed when some parameter may get no gradient in a step."""


@dataclass
class ParallelismSection:
    mode: Literal["replicate", "hsdp"] = "replicate"
    """replicate: every rank holds the whole model, grad_sync.kind exchanges the gradients (the reference's way);
    hsdp: FSDP2 shards parameters, gradients and optimizer state over the ranks of a shard group, the chunk
    stream runs between shard groups (huginn_ray.train.parallel). A shard group is one Ray node (Ray Train's
    local world size)."""
    param_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """hsdp: the dtype FSDP2 gathers the prelude, core and coda blocks' matmul weights in (their gradients are
    reduced in fp32, the sharded master weights and the checkpoint stay fp32); norm weights, qk_bias and the root
    unit (embedding = head, recurrent-state adapter, final norm) are always fp32. bfloat16 halves those gathers
    and needs precision bf16-mixed (autocast feeds the matmuls bf16 activations); auto: bfloat16 when the run
    trains in bf16-mixed (GPUs by default), float32 otherwise (CPU)."""
    context_parallel: int = 1
    """Ranks one sequence is split over (the mesh's cp dimension): each holds block_size / context_parallel of
    its tokens and attends over the sequence's gathered keys and values. Divides the ranks of a node; 1: no split."""

    @property
    def sharded(self) -> bool:
        """Whether the layout shards the model (hsdp): the one reading of `mode`; the code branches on this, or on
        the layout built from it (huginn_ray.train.parallel.MeshShape)."""
        return self.mode == "hsdp"


@dataclass
class CompileOptions:
    """Keyword arguments of torch.compile for the sandwich blocks (with `compile: true`); null: torch's default."""

    mode: Literal["default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead"] | None = None
    """null: max-autotune-no-cudagraphs on GPUs (GPU_COMPILE_MODE), torch's default mode on CPU. Modes with CUDA
    graphs (max-autotune, reduce-overhead) are refused: a compiled core block runs k times per step, and a CUDA
    graph's replay overwrites the outputs of the previous one that backward still needs."""
    fullgraph: bool | None = None
    """Refuse graph breaks inside a block instead of splitting it."""
    dynamic: bool | None = None
    """Dynamic shapes: true compiles shape-generic kernels at once, false never does (a new shape recompiles);
    null: torch marks a dimension dynamic after it changes once."""
    backend: str | None = None
    """Compiler backend (inductor; aot_eager or eager to find a compiler bug)."""

    def given(self) -> dict[str, Any]:
        """The options set, as torch.compile keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass
class DataSection:
    data_dir: str = ""
    """Shard directory: train/{rank:05d}.parquet, val/{rank:05d}.parquet and manifest.json."""
    tokenizer_path: str = ""
    """Tokenizer directory (tokenizer.json) of the shards; gives the pad and eos ids."""


@dataclass
class ScalingSection:
    num_workers: int | list[int] = 2
    """Ray Train workers = data-parallel ranks; [min, max]: elastic (Ray Train starts as many as the cluster can
    place, at most max; after a node is lost it restarts on the workers it can get, at least min, and grows back
    when capacity returns; huginn_ray/train/README.md "Elastic runs")."""
    use_gpu: bool = False
    """One GPU per worker (NCCL/RCCL); otherwise CPU workers with gloo."""
    cpus_per_worker: float = 1.0
    """CPUs Ray reserves per worker."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How Ray places the workers on nodes."""

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, list) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, list) else self.num_workers


@dataclass
class CheckpointSection:
    save_step_interval: int = 128
    """Save every this many steps (also on SIGTERM and at the last step)."""
    keep: int = 3
    """Newest checkpoints kept (Ray CheckpointConfig.num_to_keep); resume can fall back to an older one only
    with at least 2."""
    save_last_step: bool = True
    """Save when the run reaches its last step."""
    async_save: bool | None = None
    """Write checkpoints in the background: the state is copied to host memory, training goes on while DCP writes
    it, and the next save waits for it; null: on with GPUs, off on CPU. The last save (last step, a stop) is
    synchronous."""


@dataclass
class MlflowSection:
    tracking_uri: str | None = None
    """MLflow tracking URI; else $MLFLOW_TRACKING_URI; else a SQLite store under out_dir/mlflow (a local one)."""
    experiment: str = "huginn_ray"
    """MLflow experiment name."""
    max_pending_metrics: int = 100_000
    """Metric values rank 0 buffers while the server is down or slow; beyond that the oldest are dropped."""
    flush_timeout_s: float = 60.0
    """At the end of a run, how long rank 0 waits for buffered metrics to reach the server."""


@dataclass
class ProfileSection:
    steps: list[int] | None = None
    """[a, b]: every rank records a torch profiler trace of steps a to b (1 <= a <= b <= max_steps), written to
    <run_dir>/profile/rank<k>.trace.json and logged to MLflow (huginn_ray.train.profiling). None: no profiling."""
    memory_snapshot: bool = False
    """Also a CUDA memory snapshot of those steps, <run_dir>/profile/rank<k>.memory.pickle (CUDA only; on other
    devices the console says none is written)."""


@dataclass
class ObserveSection:
    straggler_ratio: float = 1.5
    """At every log interval, a rank whose own time per step (its phases without the step's collectives)
    exceeds this many times the median rank's is named, with its host, in the console and MLflow."""
    module_norms: bool = True
    """Gradient and update norms of the embeddings, prelude, core and coda at the log interval (MLflow
    grad_norm/<module>, update_norm/<module>). The update norm keeps a copy of this rank's parameters (its
    shards under hsdp) during the optimizer step of log steps, which the memory plan counts."""


@dataclass
class FaultInjection:
    kill_rank_at_step: int | None = None
    """Testing only: worker `kill_rank` calls os._exit(1) once, after this step (a marker file in out_dir
    makes it happen only in the first attempt)."""
    kill_rank: int = 1
    """The rank that is killed."""
    hang_rank_at_step: int | None = None
    """Testing only: worker `hang_rank` stops answering once, after this step (it sleeps until Ray Train ends
    it; a marker file in out_dir holding its PID makes it happen only in the first attempt). The other ranks'
    next collective raises after `pg_timeout_s`."""
    hang_rank: int = 1
    """The rank that hangs."""


@dataclass
class TrainConfig:
    run_name: str = "huginn"
    """Name of the run: Ray Train run directory under out_dir, MLflow run name."""
    out_dir: str = "/tmp/huginn_runs"
    """Everything a run writes: Ray Train checkpoints, the embedded MLflow store, logs."""
    seed: int = 233
    """Model-init seed on every rank; train shard i is shuffled with seed + i, a row's latent noise is keyed by
    seed and the row."""
    max_tokens: float | None = None
    """Token budget; gives max_steps = max_tokens // (global batch rows * block_size) if set."""
    max_steps: int | None = None
    """Number of steps (wins over max_tokens); the run also ends when a rank's shard is exhausted."""
    block_size: int = 256
    """Training sequence length; shard rows hold block_size + 1 ids."""
    micro_batch_size: int = 1
    """Sequences per rank per forward."""
    world_batch_size: int | None = None
    """Sequences per optimizer step over all ranks (the global batch), fixed for the whole run; the gradient
    accumulation is world_batch_size / (micro_batch_size x workers). None: micro_batch_size x workers at the
    run's first start (a resumed run keeps its checkpoint's)."""
    model: ModelSection | None = None
    """Architecture; left out: raven-tiny, or with init_from the directory's (a model section given with
    init_from must agree with the directory, field by field)."""
    init_from: str | None = None
    """Start from a trained model instead of random weights: a Hugging Face model directory (the released
    Huginn-0125 layout, an export), a training checkpoint, or a training output directory (its newest
    checkpoint). Optimizer, schedule and data start fresh; a resumed run reads its own checkpoints instead
    (huginn_ray.train.init_from)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Trapezoid learning-rate schedule."""
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    """How the model is laid out over the ranks."""
    grad_sync: GradSyncConfig = field(default_factory=GradSyncConfig)
    """Gradient exchange between ranks (between shard groups under hsdp)."""
    data: DataSection = field(default_factory=DataSection)
    """Shards and tokenizer."""
    scaling: ScalingSection = field(default_factory=ScalingSection)
    """Ray Train workers."""
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """Checkpoint cadence and retention."""
    mlflow: MlflowSection = field(default_factory=MlflowSection)
    """Metrics tracking."""
    grad_clip: float = 1.0
    """Max global L2 norm of the averaged gradients."""
    skip_first_optimizer_step: bool = True
    """The reference never applies the first step's gradients."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite loss or gradient norm stops the run (with an error) or skips that optimizer step."""
    activation_checkpointing: bool = True
    """Activation checkpointing of every sandwich block: prelude and coda blocks, and the core's blocks in each
    gradient iteration (huginn_ray.model.ModelConfig.activation_checkpointing). Same numerics, one more
    forward of each block in backward, about a quarter of the activation memory."""
    compile: bool = False
    """torch.compile every sandwich block (huginn_ray.train.parallelize.compile_blocks, regional compilation): a
    new depth does not recompile. Costs compile time at the start of every worker (about a minute on CPU)."""
    compile_options: CompileOptions = field(default_factory=CompileOptions)
    """torch.compile's options for the blocks."""
    loss_chunk_tokens: int = 1024
    """Head + cross-entropy over chunks of this many tokens (huginn_ray.model.chunked_cross_entropy): at most
    loss_chunk_tokens x padded_vocab fp32 logits exist at a time instead of all tokens' logits and their
    gradient; backward recomputes each chunk's logits (one extra head matmul). 0 computes the full logits (the
    reference's way)."""
    precision: Literal["auto", "bf16-mixed", "fp32"] = "auto"
    """auto: bf16 autocast on GPU, fp32 on CPU (bitwise-reproducible)."""
    attention_backend: Literal["auto", "math"] = "auto"
    """auto: attention runs in a fused kernel (flash, else memory-efficient; probed at the training shape when
    the worker starts, and logged); when neither takes the shape the math kernel serves sequences of up to 1024
    tokens and a longer one is refused, naming the shape. math: the math kernel on purpose (it materialises
    micro-batch x heads x block_size^2 scores per call)."""
    log_step_interval: int = 4
    """Log metrics every this many steps."""
    eval_step_interval: int = 128
    """Validate every this many steps (and at the last step)."""
    eval_iters: int = 1
    """Validation micro-batches per rank per depth."""
    eval_depths: list[int] = field(default_factory=lambda: [1, 4, 8, 16, 64, 32])
    """Recurrence depths validated; the last one gives val_loss."""
    peak_flops_per_device: float = 191.5e12
    """Peak FLOP/s of one device for MFU (MI250X GCD: 383e12 / 2)."""
    telemetry: bool = True
    """Latent-state telemetry of the model on log steps."""
    pg_timeout_s: int = 900
    """Process-group timeout: a hung collective raises after this long."""
    warmup_allreduce_mib: float = 128.0
    """Size of the warm-up all-reduce buffer; 0 disables the warm-up."""
    warmup_timeout_s: float = 300.0
    """How long the warm-up waits for every rank to check in."""
    max_failures: int = 3
    """Worker failures Ray Train recovers from (restart from the newest checkpoint)."""
    time_limit_s: float | None = None
    """Wall-clock budget of this job from the driver's start: the run saves a checkpoint and stops when less than
    time_limit_margin_s remain. The Slurm allocation's end (HUGINN_JOB_END_TIME, exported by
    cluster_yamls/frontier.sbatch) also counts, whichever comes first. None: no budget of its own."""
    time_limit_margin_s: float = 300.0
    """Time left for the last checkpoint when the budget runs out (the reference saved with 5 minutes left)."""
    cpu_threads: int = 1
    """torch threads per CPU worker (1 keeps CPU runs bitwise reproducible)."""
    device_memory_gib: float | None = None
    """Memory of one device for the memory plan (huginn_ray.train.memory); None: the detected accelerator's
    (64 for an MI250X GCD) or, on CPU, the machine's RAM divided by the workers."""
    memory_headroom: float = 0.9
    """The preflight refuses a plan above device_memory_gib x memory_headroom."""
    profile: ProfileSection = field(default_factory=ProfileSection)
    """Profiler trace (and CUDA memory snapshot) of chosen steps."""
    observe: ObserveSection = field(default_factory=ObserveSection)
    """What the log interval shows besides loss and speed: module norms, stragglers."""
    fault_injection: FaultInjection = field(default_factory=FaultInjection)
    """Testing only."""

    @property
    def run_dir(self) -> str:
        """Where this run writes, a local path or a bucket URI: Ray Train's checkpoints, the run lock, the
        STOP/STOPPED files, profiler traces, flight-recorder dumps, fault-injection markers (huginn_ray.storage)."""
        return storage.join(self.out_dir, self.run_name)

    @property
    def saves_asynchronously(self) -> bool:
        """checkpoint.async_save, where null means: on with GPUs (the copy to host memory is fast), off on CPU."""
        return self.scaling.use_gpu if self.checkpoint.async_save is None else self.checkpoint.async_save


def load_train_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Load, validate, and make every path absolute (relative to the current directory): Ray workers run in
    their own directories."""
    cfg = load_config(TrainConfig, path, overrides, removed=REMOVED_KEYS)
    resolve_locations(cfg)
    check_ranges(cfg, TRAIN_RANGES)
    check_worker_range(cfg.scaling.num_workers)
    if cfg.optim.lr == 0 and cfg.optim.name == "ELLISAdam":
        raise ConfigError("optim.lr=0: ELLISAdam divides by its lr (init_lr); use optim.name=AdamW")
    if cfg.max_steps is None and cfg.max_tokens is None:
        raise ConfigError("set max_steps or max_tokens")
    if not cfg.eval_depths:
        raise ConfigError("eval_depths: needs at least one depth")
    for key in ("kill_rank", "hang_rank"):
        rank = getattr(cfg.fault_injection, key)
        # a rank every worker group has (an elastic group may run on min workers)
        if getattr(cfg.fault_injection, f"{key}_at_step") is not None and rank >= cfg.scaling.min_workers:
            raise ConfigError(f"fault_injection.{key}: must be in [0, {cfg.scaling.min_workers - 1}] "
                              f"(scaling.num_workers={cfg.scaling.num_workers}), got {rank}")
    check_sharding_config(cfg)
    check_profile_steps(cfg)
    check_compile_options(cfg)
    check_param_dtype(cfg)
    check_context_parallel(cfg)
    return cfg


def resolve_locations(cfg: TrainConfig) -> None:
    """Every location absolute against the current directory (Ray workers run in their own), URIs kept as URIs;
    refused by name: an unknown scheme, and an out_dir in a bucket with no MLflow server to log to."""
    cwd = os.getcwd()
    try:
        cfg.out_dir = storage.resolve_location(cfg.out_dir, cwd)
        if cfg.data.data_dir:  # a pointer kept as a pointer: the preflight resolves it (RunPlan.data_dir)
            cfg.data.data_dir = storage.resolve_location(cfg.data.data_dir, cwd, follow_links=False)
        if cfg.data.tokenizer_path:
            cfg.data.tokenizer_path = storage.resolve_location(cfg.data.tokenizer_path, cwd)
        cfg.init_from = storage.resolve_location(cfg.init_from, cwd) if cfg.init_from else None
    except storage.StorageError as err:
        raise ConfigError(str(err)) from None
    if storage.is_uri(cfg.out_dir) and not (cfg.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")):
        raise ConfigError(f"mlflow.tracking_uri: must be given with out_dir in object storage ({cfg.out_dir}): the "
                          f"default SQLite store under out_dir cannot live in a bucket; give an MLflow server "
                          f"(mlflow.tracking_uri=http://host:port, its artifact store in the bucket)")


REMOVED_KEYS = {
    "optim.sharding": "set parallelism.mode=hsdp to shard the optimizer state (and parameters and gradients)",
    "grad_sync.node_size": "set parallelism.mode=hsdp (its shard groups are Ray's nodes)",
    "parallelism.shard_size": "a shard group of parallelism.mode=hsdp is one Ray node (Ray Train's local world size)",
    "grad_sync.kind=hierarchical": "set parallelism.mode=hsdp (FSDP2 inside the node, the chunk stream between nodes)",
}


def check_worker_range(num_workers: int | list[int]) -> None:
    """scaling.num_workers as a list is [min, max] with min <= max (each >= 1: TRAIN_RANGES)."""
    if isinstance(num_workers, list) and (len(num_workers) != 2 or num_workers[0] > num_workers[1]):
        raise ConfigError(f"scaling.num_workers: a worker count or [min, max] with min <= max, got {num_workers}")


GPU_COMPILE_MODE = "max-autotune-no-cudagraphs"
"""torch.compile's mode for the blocks on GPUs unless compile_options names one: autotuned Triton kernels, no CUDA
graphs."""
CUDA_GRAPH_MODES = ("max-autotune", "reduce-overhead")


def compile_options_for(cfg: TrainConfig, device_type: str) -> dict[str, Any]:
    """torch.compile's keyword arguments for the blocks on a device of `device_type` (cuda, cpu)."""
    options = cfg.compile_options.given()
    if device_type == "cpu" or "mode" in options:
        return options
    return {"mode": GPU_COMPILE_MODE, **options}


def check_param_dtype(cfg: TrainConfig) -> None:
    if cfg.parallelism.param_dtype != "bfloat16":
        return
    if not cfg.parallelism.sharded:
        raise ConfigError("parallelism.param_dtype=bfloat16: only parallelism.mode=hsdp gathers weights")
    if cfg.precision == "fp32" or (cfg.precision == "auto" and not cfg.scaling.use_gpu):
        raise ConfigError(f"parallelism.param_dtype=bfloat16 needs precision=bf16-mixed (precision={cfg.precision}"
                          f"{', on CPU' if cfg.precision == 'auto' else ''} trains in fp32)")


def check_profile_steps(cfg: TrainConfig) -> None:
    """profile.steps is [a, b] with 1 <= a <= b, within max_steps when the config sets it (with max_tokens alone
    the run's length is known later; steps past its end are not profiled)."""
    steps = cfg.profile.steps
    if steps is None:
        return
    if len(steps) != 2 or steps[0] > steps[1]:
        raise ConfigError(f"profile.steps: [first, last] with first <= last, got {steps}")
    if cfg.max_steps is not None and steps[1] > cfg.max_steps:
        raise ConfigError(f"profile.steps: {steps} ends after the run's last step (max_steps={cfg.max_steps})")


def check_compile_options(cfg: TrainConfig) -> None:
    mode = cfg.compile_options.mode
    if mode in CUDA_GRAPH_MODES:
        raise ConfigError(f"compile_options.mode={mode}: this mode records CUDA graphs, which the recurrence breaks "
                          f"(a compiled core block runs k times per step); use {GPU_COMPILE_MODE} (the default on "
                          "GPUs)")


def check_context_parallel(cfg: TrainConfig) -> None:
    """parallelism.context_parallel = N > 1: a fixed worker count that N divides (it must also divide a node's
    workers: checked at startup, where Ray Train reports them), a block_size of 2N equal pieces (the head-tail
    layout), and none of the combinations context parallelism does not serve."""
    size = cfg.parallelism.context_parallel
    if size == 1:
        return
    name = f"parallelism.context_parallel={size}"
    if isinstance(cfg.scaling.num_workers, list):
        raise ConfigError(f"{name}: an elastic worker count (scaling.num_workers={cfg.scaling.num_workers}) is not "
                          "supported with context parallelism; give one worker count")
    if cfg.scaling.num_workers % size:
        raise ConfigError(f"{name} does not divide scaling.num_workers={cfg.scaling.num_workers}")
    if cfg.block_size % (2 * size):
        raise ConfigError(f"{name}: block_size={cfg.block_size} does not split into {2 * size} equal pieces (the "
                          f"head-tail layout: rank r holds pieces r and {2 * size - 1} - r); use a multiple of "
                          f"{2 * size}")
    if cfg.grad_sync.kind == "ddp":
        raise ConfigError(f"{name} with grad_sync.kind=ddp is not supported: use chunk_stream or "
                          "chunk_stream_overlap")
    if cfg.compile:
        raise ConfigError(f"{name} with compile=true is not supported: the compiled blocks would trace the cp "
                          "group's all-gather of keys and values")


def check_sharding_config(cfg: TrainConfig) -> None:
    if cfg.parallelism.sharded and cfg.grad_sync.kind == "ddp":
        raise ConfigError(f"grad_sync.kind={cfg.grad_sync.kind}: under parallelism.mode=hsdp the exchange between "
                          "shard groups is chunk_stream or chunk_stream_overlap")


# ---- allowed ranges of the numeric fields (checked by load_train_config; a new numeric field belongs here) -----
TRAIN_RANGES: dict[str, Range] = {
    "seed": Range(0, 2**64 - 1),  # torch.manual_seed's range (the initial model's seed)
    "max_tokens": POSITIVE,
    "max_steps": AT_LEAST_1,
    "block_size": AT_LEAST_1,
    "micro_batch_size": AT_LEAST_1,
    "world_batch_size": AT_LEAST_1,
    "optim.lr": NON_NEGATIVE,
    "optim.weight_decay": NON_NEGATIVE,
    "optim.betas": Range(0, 1, hi_open=True),
    "optim.eps": POSITIVE,
    "schedule.warmup_steps": NON_NEGATIVE,
    "schedule.cooldown_steps": NON_NEGATIVE,
    "schedule.min_lr": NON_NEGATIVE,
    "grad_sync.chunk_mib": Range(0, 16384, lo_open=True),  # 0 would hang every worker at startup
    "scaling.num_workers": AT_LEAST_1,
    "parallelism.context_parallel": AT_LEAST_1,
    "scaling.cpus_per_worker": POSITIVE,
    "checkpoint.save_step_interval": AT_LEAST_1,
    "checkpoint.keep": AT_LEAST_1,
    "mlflow.max_pending_metrics": AT_LEAST_1,
    "mlflow.flush_timeout_s": NON_NEGATIVE,
    "grad_clip": POSITIVE,  # a negative max norm flips the gradients, 0 zeroes them
    "log_step_interval": AT_LEAST_1,
    "eval_step_interval": AT_LEAST_1,
    "eval_iters": AT_LEAST_1,
    "eval_depths": AT_LEAST_1,
    "peak_flops_per_device": POSITIVE,
    "pg_timeout_s": AT_LEAST_1,
    "warmup_allreduce_mib": NON_NEGATIVE,
    "warmup_timeout_s": POSITIVE,
    "max_failures": Range(-1),  # -1: retry forever (Ray's convention)
    "time_limit_s": POSITIVE,
    "time_limit_margin_s": NON_NEGATIVE,
    "cpu_threads": AT_LEAST_1,
    "fault_injection.kill_rank_at_step": AT_LEAST_1,
    "fault_injection.kill_rank": NON_NEGATIVE,
    "fault_injection.hang_rank_at_step": AT_LEAST_1,
    "fault_injection.hang_rank": NON_NEGATIVE,
    "grad_sync.max_chunks_in_flight": AT_LEAST_1,
    "device_memory_gib": POSITIVE,
    "memory_headroom": Range(0, 1, lo_open=True),
    "loss_chunk_tokens": NON_NEGATIVE,  # 0: full logits
    **{f"model.overrides.{name}": AT_LEAST_1 for name in (
        "block_size", "vocab_size", "padding_multiple", "n_embd", "num_attention_heads", "intermediate_size",
        "n_layers_in_recurrent_block", "mean_recurrence", "mean_backprop_depth")},
    "model.overrides.n_layers_in_prelude": NON_NEGATIVE,
    "model.overrides.n_layers_in_coda": NON_NEGATIVE,
    "model.overrides.rope_base": POSITIVE,
    "model.overrides.norm_eps": POSITIVE,
    "profile.steps": AT_LEAST_1,
    "observe.straggler_ratio": Range(1, lo_open=True),
}

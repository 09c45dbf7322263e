"""What the driver's preflight derives once and every worker of every attempt receives."""

from __future__ import annotations

from dataclasses import dataclass

from huginn_ray.model.config import ModelConfig
from huginn_ray.train.config import TrainConfig
from huginn_ray.train.data_order import DataOrder


@dataclass(frozen=True)
class WeightsSource:
    """The trained model a fresh run starts from (`init_from`, huginn_ray.train.init_from.describe_source)."""

    path: str
    """The model directory (a training checkpoint's `model/`)."""
    hashed: str
    """What the sha256 covers: the model's tensors and the files they were read from
    (huginn_ray.model.pretrained.weights_digest)."""
    sha256: str
    """The sha256 of the weights themselves (name, dtype, shape and bytes of every tensor, in name order)."""


@dataclass
class RunPlan:
    global_batch_rows: int
    """Rows per optimizer step, all ranks and micro-batches together: `world_batch_size`, or a checkpoint's, or
    micro_batch_size x workers at the run's first start. Fixed for the whole run, whatever the worker count."""
    num_streams: int
    """Train shards in the data directory (huginn_ray.train.data_order)."""
    data_dir: str
    """The shard version every worker of every attempt reads (`<output_dir>/shards.vNNNN`): data.data_dir's pointer
    resolved once by the driver's preflight, or the version a resumed run's checkpoint records
    (huginn_ray.train.launch.data_version); a publish during the run does not change it."""
    schedule_steps: int
    """Optimizer steps the LR schedule spans; the run ends there."""
    pad_id: int
    eos_id: int
    precision: str
    """"fp32" or "bf16-mixed"."""
    model_config: ModelConfig
    """The model the run trains (the `model` section's, or init_from's config.json)."""
    init_from: WeightsSource | None = None
    """The trained model a fresh run starts from; None: random weights."""
    stop_at_unix: float | None = None
    """When the workers must have saved and stopped (the time budget); None: no budget."""
    mlflow_uri: str = ""
    mlflow_run_id: str = ""

    def data_order(self, micro_batch_size: int, world_size: int) -> DataOrder:
        """The data order on `world_size` ranks; DataOrderError when the rule does not allow it."""
        return DataOrder(self.num_streams, self.global_batch_rows, micro_batch_size, world_size).check()


@dataclass
class WorkerConfig:
    """What the driver hands every worker (Ray Train's `train_loop_config`, huginn_ray.train.loop.train_loop_per_worker)."""

    cfg: TrainConfig
    """The run's configuration, loaded and checked by the driver."""
    plan: RunPlan
    """What the preflight derived from it."""
    log_level: str = "INFO"
    """Console level of the worker's root logger (some of Ray Train's own loggers hang off it)."""

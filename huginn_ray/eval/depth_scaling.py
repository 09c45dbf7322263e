"""Loss and perplexity against recurrence depth, on the validation shards, as Ray Data batch inference.

The first `max_rows` rows of every validation shard go through an actor pool of model replicas
(huginn_ray.eval.batch_inference.depth_losses), each row at every depth, giving the summed next-token
cross-entropy and the label count (pad labels ignored, as in training's validation). A row's initial latent
state is keyed by the row, as in training's validation, so the numbers do not depend on the replica count or
the order rows are served in. The results become a table, `depth_scaling.csv`, `depth_scaling.png` (loss against
depth on a log-2 axis with the training depth marked, and loss against FLOPs per token), and MLflow metrics
and artifacts.
"""

from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from huginn_ray.eval.batch_inference import Replicas, depth_losses
from huginn_ray.eval.validation_rows import read_val_rows
from huginn_ray.model.flops import inference_flops_per_token

COLUMNS = ["depth", "loss", "ppl", "flops_per_token", "tokens"]


@dataclass
class DepthRow:
    depth: int
    loss: float
    ppl: float
    flops_per_token: float
    tokens: int


def depth_scaling(model_dir: str | Path, data_dir: str | Path, depths: list[int], replicas: Replicas, *,
                  max_rows: int | None = None, batch_size: int = 8, seed: int = 233, pad_id: int,
                  eos_id: int) -> list[DepthRow]:
    """One row per depth: the validation rows through Ray Data on `replicas` (huginn_ray.eval.batch_inference),
    on the connected Ray cluster. `model_dir`: a model directory or a bucket URI (huginn_ray.model_cache)."""
    from huginn_ray.model.config import ModelConfig
    from huginn_ray.model_cache import local_model_dir

    shards = sorted(str(p) for p in (Path(data_dir) / "val").glob("*.parquet"))
    if not shards:
        raise ValueError(f"no validation shards in {Path(data_dir) / 'val'}")
    losses = depth_losses(model_dir, shards, depths, replicas, max_rows=max_rows, batch_size=batch_size, seed=seed,
                          pad_id=pad_id, eos_id=eos_id)
    config = ModelConfig.from_json(local_model_dir(model_dir) / "config.json")
    seq_len = read_val_rows(shards[0], 1).shape[1] - 1
    rows = []
    for depth, (total, count) in zip(depths, losses):
        loss = total / max(count, 1)
        rows.append(DepthRow(depth, loss, math.exp(min(loss, 50.0)),
                             inference_flops_per_token(config, depth, seq_len), count))
    return rows


def format_table(rows: list[DepthRow]) -> str:
    lines = [f"{'depth':>6} {'loss':>8} {'ppl':>10} {'FLOPs/token':>12} {'tokens':>9}"]
    for r in rows:
        lines.append(f"{r.depth:>6} {r.loss:>8.4f} {r.ppl:>10.2f} {r.flops_per_token:>12.3g} {r.tokens:>9}")
    return "\n".join(lines)


def write_csv(rows: list, path: str | Path, columns: list[str] = COLUMNS) -> Path:
    """One row per dataclass in `rows` (DepthRow by default; the GSM8k sweep passes its own columns)."""
    path = Path(path)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for r in rows:
            writer.writerow(asdict(r))
    return path


def plot(depths: list[int], losses: list[float], path: str | Path, train_depth: int, title: str,
         flops: list[float] | None = None) -> Path:
    """Loss against depth (log-2 x axis, training depth marked); beside it loss against FLOPs per token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if flops else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot(depths, losses, "o-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.axvline(train_depth, color="gray", linestyle="--", label=f"training mean depth {train_depth}")
    ax.set_xlabel("core iterations at test time")
    ax.set_ylabel("validation loss")
    ax.legend()
    ax.grid(alpha=0.3)
    if flops:
        ax2 = axes[0][1]
        ax2.plot(flops, losses, "o-")
        ax2.set_xscale("log")
        ax2.set_xlabel("forward FLOPs per token")
        ax2.set_ylabel("validation loss")
        ax2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def validation_plot(metrics: dict, step: int, train_depth: int, directory: Path) -> Path | None:
    """The depth curve of one validation step of training, as `directory`/step_XXXXXX.png (None with fewer than two
    depths). Training logs it through MetricsLogger.log_drawn_artifact, which draws it off the step loop."""
    depths = sorted(int(k.removeprefix("val_loss_")) for k in metrics if k.removeprefix("val_loss_").isdigit())
    if len(depths) < 2:
        return None
    return plot(depths, [metrics[f"val_loss_{d}"] for d in depths], Path(directory) / f"step_{step:06d}.png",
                train_depth, f"validation loss by depth, step {step}")

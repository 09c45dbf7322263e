"""Validation at several depths: every rank's fixed validation rows (read once at startup), their loss sums at
every `eval_depths` depth on a validation step, the metrics from those sums once the log interval has summed them
over the ranks, and rank 0's lines and depth-scaling plot.

The loss at a depth is the token losses of every rank's rows summed over their supervised tokens, divided by their
count (as the training loss). The rows' initial latent noise is keyed by row (RecurrentGPT.keyed_initial_state),
so validation neither depends on nor changes any RNG stream, and does not depend on the worker count.
"""

from __future__ import annotations

import functools
import math

import torch

from huginn_ray.train.config import TrainConfig
from huginn_ray.train.data_order import DataOrder
from huginn_ray.train.run_plan import RunPlan
from huginn_ray.train.shard_reader import Batch, collate, validation_rows
from huginn_ray.train.stopping import DATA_ERRORS, stop_if_a_rank_cannot_read


def read_validation_batch(order: DataOrder, cfg: TrainConfig, plan: RunPlan, rank: int, device: torch.device) -> Batch:
    """This rank's fixed validation rows; every rank stops alike when one cannot read them."""
    read_error, val_batch = None, None
    try:
        val_batch = collate(validation_rows(plan.data_dir, order, rank, cfg.eval_iters, cfg.block_size + 1),
                            plan.pad_id, plan.eos_id, plan.model_config.vocab_size)
    except DATA_ERRORS as err:
        read_error = f"validation data: {type(err).__name__}: {err}"
    stop_if_a_rank_cannot_read(read_error, device)
    return val_batch


@torch.no_grad()
def validation_sums(model, batch: Batch, cfg: TrainConfig, plan: RunPlan, device, autocast) -> torch.Tensor:
    """This rank's [token loss sums at every eval depth..., supervised tokens] (device fp64): summed over the
    ranks, the loss at a depth is the token losses of every rank's fixed rows summed over their supervised tokens,
    divided by their count (as the training loss; masked rows weigh by what they supervise).

    The initial latent noise is keyed by row (RecurrentGPT.keyed_initial_state), so validation neither depends
    on nor changes any RNG stream, and a row's noise does not depend on the worker count."""
    model.eval()
    inputs, labels = batch.inputs.to(device), batch.labels.to(device)
    states = model.keyed_initial_state(batch.keys, cfg.block_size, cfg.seed, device)
    micro_batch = len(batch.keys) // cfg.eval_iters
    micro_batches = [slice(b * micro_batch, (b + 1) * micro_batch) for b in range(cfg.eval_iters)]
    counts = [host_count(batch.labels[rows] != plan.pad_id) for rows in micro_batches]
    sums = torch.zeros(len(cfg.eval_depths) + 1, dtype=torch.float64, device=device)
    sums[-1] = sum(counts)
    for i, depth in enumerate(cfg.eval_depths):
        for rows, count in zip(micro_batches, counts):
            if not count:  # its mean is 0/0
                continue
            with autocast:
                out = model(inputs[rows], labels=labels[rows], num_steps=(depth, 0), input_states=states[rows],
                            ignore_index=plan.pad_id, loss_chunk_tokens=cfg.loss_chunk_tokens,
                            check_token_ids=False)
            sums[i] += out.loss.double() * count
    model.train()
    return sums


def host_count(flags: torch.Tensor) -> int:
    """The true flags of a host tensor (a read of a CPU tensor: no device sync)."""
    return int(flags.sum())


def validation_metrics(cfg: TrainConfig, sums: list[float]) -> dict:
    """val_loss_D and val_ppl_D of every eval depth from the summed validation_sums; val_loss is the last
    depth's."""
    metrics = {}
    for depth, value in zip(cfg.eval_depths, [loss_sum / sums[-1] for loss_sum in sums[:-1]]):
        metrics[f"val_loss_{depth}"] = value
        metrics[f"val_ppl_{depth}"] = math.exp(min(value, 50.0))
    metrics["val_loss"] = metrics[f"val_loss_{cfg.eval_depths[-1]}"]
    metrics["val_ppl"] = math.exp(min(metrics["val_loss"], 50.0))
    return metrics


def log_validation(val: dict, step: int, train_depth: int, logger) -> None:
    """Rank 0: the validation losses logged and printed, the depth-scaling plot queued for the logger's sender
    thread (drawn and uploaded off the step loop)."""
    from huginn_ray.eval.depth_scaling import validation_plot

    logger.log(val, step)
    logger.log_drawn_artifact(f"depth-scaling plot of step {step}",
                              functools.partial(validation_plot, val, step, train_depth), "depth_scaling")
    print(f"[huginn] step {step} validation " + " ".join(f"{k}={v:.4f}" for k, v in val.items()), flush=True)

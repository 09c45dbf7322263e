"""Exact values of a training step and of validation, from the project's own per-rank code (real gloo groups).

`huginn_ray.train.loop.build_components`, `train_step` and `validation_sums` run in process groups of 1 rank (this
process) and 2 ranks (spawned by tests/test_train_grad_sync.py::spawn), on raven-tiny with a 64-token vocabulary
and rows from an in-memory reader (tests/test_train_parallel.py::MemoryReader, seeded per rank). Every value is
held to one computed another way: the 2-rank loss and validation loss to the mean of the 1-rank values of each
rank's data, the gradient the optimizer applies to the unclipped one scaled by hand, the weights to bitwise
equality where a step must leave them alone.
"""

from __future__ import annotations

import dataclasses
import math
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from huginn_ray.train import loop
from huginn_ray.train.stopping import Stop
from huginn_ray.train.shard_reader import Rows, collate
from test_train_grad_sync import free_port, spawn
from test_train_parallel import MemoryReader, plan_for, train_config, validate

CPU = torch.device("cpu")
POISONED_STEP = 3
"""The step whose loss is NaN on rank 1 only (on_nonfinite tests)."""


def config(*extra):
    return train_config(["eval_iters=2", "eval_depths=[1, 3]", *extra])


def validation_batch(rank, cfg, plan):
    """Rank `rank`'s fixed validation rows: eval_iters micro-batches, unlike its training rows."""
    rows = MemoryReader(None, 1000 + rank, 0, cfg.block_size + 1).next_rows(cfg.eval_iters * cfg.micro_batch_size)
    return collate(rows, plan.pad_id, plan.eos_id, 64)


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def global_norm(tensors) -> float:
    return torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in tensors])).item()


@pytest.fixture
def one_rank(monkeypatch):
    """A gloo group of this process alone; the loop reads its rows from MemoryReader."""
    monkeypatch.setattr(loop, "ShardReader", MemoryReader)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---- 2 ranks: every rank's report, computed once ---------------------------------------------------------------

def poisoned_run(rank: int, on_nonfinite: str) -> dict:
    """Up to 5 steps in which rank 1's loss at POISONED_STEP is NaN while its gradient stays finite: rank 0 sees
    a finite loss and a finite gradient norm, and learns of the NaN only from the step's agreement."""
    cfg = config(f"on_nonfinite={on_nonfinite}", "skip_first_optimizer_step=false")
    plan = plan_for(cfg)
    c = loop.build_components(cfg, plan, rank, CPU)
    forward = c.model.forward
    step = 0

    def poisoned_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        if rank == 1 and step == POISONED_STEP:
            out.loss = out.loss + float("nan")  # NaN value, the same finite gradient
        return out

    c.model.forward = poisoned_forward
    run = {"losses": [], "moved": []}
    for step in range(1, 6):
        before = weights(c.model)
        try:
            run["losses"].append(loop.train_step(c, step, cfg, plan, CPU).loss)
        except Stop as stop:
            run["stop"] = {"step": step, "message": str(stop)}
            break
        run["moved"].append(not same_weights(before, weights(c.model)))
    flat = torch.cat([p.detach().double().flatten() for p in c.model.parameters()])
    run["weights"] = [flat.sum().item(), flat.abs().sum().item()]
    return run


# ---- masked rows: the loss is sum over supervised tokens / their count over the global batch -----------------
SUPERVISED = {0: (32, 5), 1: (0, 19)}
"""Supervised labels of each rank's two micro-batches (of 2 x 16): rank 1's first one has none."""


class FixedStep:
    """Stands in for the StepPrefetcher: the same collated micro-batches at every step."""

    def __init__(self, batches):
        self.batches = batches

    def next_step(self):
        return self.batches


def masked_batches(rank: int, counts=None) -> list:
    """Rank `rank`'s micro-batches of rows with a loss mask whose first `count` target positions (row-major)
    are 1, collated as the loop collates them (the pad id, 0 here, on every label that is not a target)."""
    batches = []
    for micro, count in enumerate(counts or SUPERVISED[rank]):
        rows = MemoryReader(None, 10 * rank + micro, 500, 17).next_rows(2)
        targets = np.zeros(rows.ids[:, 1:].size, dtype=np.uint8)
        targets[:count] = 1
        mask = np.concatenate([np.zeros((len(rows.ids), 1), np.uint8), targets.reshape(len(rows.ids), -1)], axis=1)
        batches.append(collate(Rows(rows.ids, mask, rows.keys), 0, 1, 64))
    return batches


def masked_plan(cfg, grad_accum):
    """plan_for's, with a zero initial latent state: the forward is a function of the weights alone."""
    plan = plan_for(cfg, grad_accum=grad_accum)
    return dataclasses.replace(plan, model_config=plan.model_config.replace(state_init="zero"))


def masked_step(rank: int, batches_by_rank) -> dict:
    """Step 1 of this rank on its masked micro-batches: loss and gradient norm."""
    cfg = config()
    plan = masked_plan(cfg, grad_accum=len(batches_by_rank[rank]))
    c = loop.build_components(cfg, plan, rank, CPU)
    c.reader = FixedStep(batches_by_rank[rank])
    result = loop.train_step(c, 1, cfg, plan, CPU)
    return {"loss": result.loss, "grad_norm": result.grad_norm}


def hand_loss_and_grad_norm(batches_by_rank: dict) -> tuple[float, float, float]:
    """By hand, in fp64 from the model's fp32 logits: (sum of every supervised token's cross-entropy over every
    rank's micro-batches / their count, the global norm of its gradient, the mean of the micro-batches' own means)."""
    cfg = config()
    c = loop.build_components(cfg, masked_plan(cfg, 2), 0, CPU)
    total, count, means = 0.0, 0, []
    for micro in range(2):
        n, k = loop.sample_recurrence(loop.micro_step(1, micro, 2), 4, 2)
        for batches in batches_by_rank.values():
            labels = batches[micro].labels
            logits = c.model(batches[micro].inputs, num_steps=(n, k)).logits.double()
            token = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1),
                                                      ignore_index=0, reduction="sum")
            supervised = int((labels != 0).sum())
            total, count = total + token, count + supervised
            if supervised:
                means.append(token.item() / supervised)
    loss = total / count
    loss.backward()
    return loss.item(), global_norm([p.grad for p in c.model.parameters()]), sum(means) / len(means)


VALIDATION_SUPERVISED = {0: (29, 3), 1: (0, 11)}
"""Supervised labels of each rank's two validation micro-batches (of 2 x 16): rank 1's first one has none."""


def masked_validation(rank: int) -> dict:
    """This rank's validation of its masked rows (VALIDATION_SUPERVISED), the micro-batches of masked_batches as one
    batch of eval_iters = 2 micro-batches."""
    from huginn_ray.train.shard_reader import Batch

    cfg = config()
    plan = masked_plan(cfg, grad_accum=2)
    c = loop.build_components(cfg, plan, rank, CPU)
    parts = masked_batches(rank, VALIDATION_SUPERVISED[rank])
    batch = Batch(*(torch.cat([getattr(part, name) for part in parts]) for name in ("inputs", "labels", "keys")))
    return validate(c.model, batch, cfg, plan, CPU, c.autocast)


def rank_report(rank: int, world_size: int) -> dict:
    loop.ShardReader = MemoryReader  # this spawned process's own loop module
    cfg = config()
    plan = plan_for(cfg, grad_accum=2)
    c = loop.build_components(cfg, plan, rank, CPU)
    validation = validate(c.model, validation_batch(rank, cfg, plan), cfg, plan, CPU, c.autocast)
    return {
        "validation": validation,
        "loss": loop.train_step(c, 1, cfg, plan, CPU).loss,
        "skip": poisoned_run(rank, "skip"),
        "stop": poisoned_run(rank, "stop"),
        "masked": masked_step(rank, {r: masked_batches(r) for r in SUPERVISED}),
        "masked_validation": masked_validation(rank),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    reports = spawn(rank_report, 2, tmp_path_factory.mktemp("two_ranks"), timeout_s=60)
    for rank, report in enumerate(reports):
        assert "error" not in report, f"rank {rank}: {report.get('trace')}"
    return reports


def test_two_rank_loss_is_the_mean_of_the_rank_local_losses(one_rank, two_ranks, monkeypatch):
    cfg = config()
    plan = plan_for(cfg, grad_accum=2)
    local = []
    for r in (0, 1):  # each rank's data alone: same seed, same depth, 1 rank reading rank r's stream
        monkeypatch.setattr(loop, "ShardReader", lambda path, stream, seed, length: MemoryReader(path, r, seed, length))
        local.append(loop.train_step(loop.build_components(cfg, plan, 0, CPU), 1, cfg, plan, CPU).loss)
    mean = (local[0] + local[1]) / 2
    # the ranks' losses differ enough that a sum over ranks (2 x mean) or no averaging (each rank its own
    # loss, off by |l0 - l1| / 2 from the mean) is far outside the tolerance
    assert abs(local[0] - local[1]) > 1e-3 * mean, local
    for rank, report in enumerate(two_ranks):
        assert report["loss"] == pytest.approx(mean, rel=1e-6), (rank, report["loss"], local)


def test_two_rank_validation_is_the_mean_of_each_ranks_own_validation(one_rank, two_ranks):
    cfg = config()
    plan = plan_for(cfg, grad_accum=2)
    c = loop.build_components(cfg, plan, 0, CPU)
    local = [validate(c.model, validation_batch(r, cfg, plan), cfg, plan, CPU, c.autocast) for r in (0, 1)]
    for depth in (1, 3):
        key = f"val_loss_{depth}"
        mean = (local[0][key] + local[1][key]) / 2
        assert abs(local[0][key] - local[1][key]) > 1e-3 * mean, (key, local)  # not divided: off by 2x
        for rank, report in enumerate(two_ranks):
            assert report["validation"][key] == pytest.approx(mean, rel=1e-6), (rank, key, local)
            assert report["validation"][f"val_ppl_{depth}"] == pytest.approx(math.exp(mean), rel=1e-6)
    assert two_ranks[0]["validation"]["val_loss"] == two_ranks[0]["validation"]["val_loss_3"]


def test_validation_loss_weighs_every_supervised_token_of_every_rank_alike(one_rank, two_ranks):
    """Masked validation rows with 29, 3 (rank 0) and 0, 11 (rank 1) supervised tokens per micro-batch: the loss at
    each depth is every supervised token's cross-entropy summed over both ranks, over their count (43), computed
    here by hand from the model's logits; the mean of per-micro-batch (means is far from it."""
    cfg = config()
    c = loop.build_components(cfg, masked_plan(cfg, 2), 0, CPU)
    c.model.eval()
    for depth in (1, 3):
        total, count, micro_means = 0.0, 0, []
        for rank, counts in VALIDATION_SUPERVISED.items():
            for batch in masked_batches(rank, counts):
                logits = c.model(batch.inputs, num_steps=(depth, 0)).logits.double()
                token = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), batch.labels.view(-1),
                                                          ignore_index=0, reduction="sum").item()
                supervised = int((batch.labels != 0).sum())
                total, count = total + token, count + supervised
                if supervised:
                    micro_means.append(token / supervised)
        assert count == 43
        loss = total / count
        assert abs(loss - sum(micro_means) / len(micro_means)) > 1e-2 * loss
        for rank, report in enumerate(two_ranks):
            assert report["masked_validation"][f"val_loss_{depth}"] == pytest.approx(loss, rel=1e-6), (rank, depth)


def test_a_nan_loss_on_one_rank_skips_that_step_on_both_ranks_with_on_nonfinite_skip(two_ranks):
    for rank, report in enumerate(two_ranks):
        run = report["skip"]
        assert "stop" not in run, run
        # the poisoned step left the weights bitwise alone on both ranks; the steps before and after moved them
        assert run["moved"] == [True, True, False, True, True], (rank, run["moved"])
        losses = run["losses"]
        assert math.isnan(losses[POISONED_STEP - 1]), losses
        assert all(math.isfinite(loss) for i, loss in enumerate(losses) if i != POISONED_STEP - 1), losses
    assert two_ranks[0]["skip"]["weights"] == two_ranks[1]["skip"]["weights"]  # the ranks stayed in step


def test_a_nan_loss_on_one_rank_stops_both_ranks_at_that_step_with_on_nonfinite_stop(two_ranks):
    for rank, report in enumerate(two_ranks):
        run = report["stop"]
        assert run["stop"]["step"] == POISONED_STEP, (rank, run)
        assert run["stop"]["message"].startswith(f"step {POISONED_STEP}: non-finite loss"), run["stop"]
        assert "stopping (on_nonfinite=stop)" in run["stop"]["message"]
        assert run["moved"] == [True, True] and all(math.isfinite(loss) for loss in run["losses"]), run


# ---- 1 rank ------------------------------------------------------------------------------------------------------

def first_step_applied(cfg, plan):
    """Step 1 of a fresh model: the gradients its optimizer step gets (captured as the step starts), the result."""
    c = loop.build_components(cfg, plan, 0, CPU)
    applied = []
    optimizer_step = c.optimizer.step

    def recording_step(*args, **kwargs):
        applied.extend(p.grad.detach().clone() for p in c.model.parameters())
        return optimizer_step(*args, **kwargs)

    c.optimizer.step = recording_step
    return applied, loop.train_step(c, 1, cfg, plan, CPU)


def test_clipping_scales_the_applied_gradient_to_the_max_norm_and_reports_the_norm_before(one_rank):
    plan = plan_for(config())
    raw, unclipped = first_step_applied(config("grad_clip=1e6", "skip_first_optimizer_step=false"), plan)
    clipped, result = first_step_applied(config("grad_clip=1e-3", "skip_first_optimizer_step=false"), plan)
    raw_norm = global_norm(raw)
    assert raw_norm > 100 * 1e-3, raw_norm  # clipping at 1e-3 changes the gradient
    assert unclipped.grad_norm == pytest.approx(raw_norm, rel=1e-6)
    assert result.grad_norm == pytest.approx(raw_norm, rel=1e-6)  # StepResult: the norm before clipping
    assert global_norm(clipped) == pytest.approx(1e-3, rel=1e-5)
    scale = 1e-3 / raw_norm
    for got, before in zip(clipped, raw, strict=True):
        torch.testing.assert_close(got.double(), before.double() * scale, rtol=1e-5, atol=0)


@pytest.mark.parametrize("skip_first, moved", [(True, [False, True]), (False, [True, True])])
def test_skip_first_optimizer_step_leaves_the_weights_of_step_1_bitwise_alone(one_rank, skip_first, moved):
    cfg = config(f"skip_first_optimizer_step={str(skip_first).lower()}")
    plan = plan_for(cfg)
    c = loop.build_components(cfg, plan, 0, CPU)
    got = []
    for step in (1, 2):
        before = weights(c.model)
        loop.train_step(c, step, cfg, plan, CPU)
        got.append(not same_weights(before, weights(c.model)))
    assert got == moved


PAD, EOS = 40, 50


class RowsWithPads:
    """Rows of ids 2..31 with pad at input positions 3 (every row) and 7 (row 0), eos at position 5, and pad as
    the last id, which is only ever a label."""

    def __init__(self, path, stream, seed, row_length):
        self.row_length = row_length
        self.position = 0

    def next_rows(self, count):
        rows = 2 + (5 * np.arange(count)[:, None] + np.arange(self.row_length)) % 30
        rows[:, 3] = PAD
        rows[0, 7] = PAD
        rows[:, 5] = EOS
        rows[:, -1] = PAD
        return Rows(rows, None, np.arange(count))  # every call returns the same rows


def test_the_model_gets_pad_replaced_by_eos_in_the_inputs_and_pad_kept_in_the_labels(one_rank, monkeypatch):
    monkeypatch.setattr(loop, "ShardReader", RowsWithPads)
    cfg = config()
    plan = dataclasses.replace(plan_for(cfg), pad_id=PAD, eos_id=EOS)
    c = loop.build_components(cfg, plan, 0, CPU)
    seen = []
    forward = c.model.forward

    def recording_forward(input_ids, labels=None, **kwargs):
        seen.append((input_ids.clone(), labels.clone()))
        return forward(input_ids, labels=labels, **kwargs)

    c.model.forward = recording_forward
    loop.train_step(c, 1, cfg, plan, CPU)
    rows = RowsWithPads(None, 0, 0, cfg.block_size + 1).next_rows(cfg.micro_batch_size).ids
    inputs = rows[:, :-1].copy()
    inputs[:, 3] = EOS
    inputs[0, 7] = EOS
    assert len(seen) == 1
    assert torch.equal(seen[0][0], torch.from_numpy(inputs).long())
    assert torch.equal(seen[0][1], torch.from_numpy(rows[:, 1:]).long())
    assert (seen[0][1] == PAD).sum().item() == 2 + 1 + 2  # position 2 (x2), 6 (row 0), the last (x2)


def test_masked_loss_with_accumulation_is_the_sum_over_supervised_tokens_over_their_count(one_rank):
    batches = {0: masked_batches(0)}
    loss, grad_norm, mean_of_means = hand_loss_and_grad_norm(batches)
    assert abs(loss - mean_of_means) > 1e-2 * loss  # a per-micro-batch mean would be far off
    got = masked_step(0, batches)
    assert got["loss"] == pytest.approx(loss, rel=1e-6)
    assert got["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)


def test_two_ranks_with_different_supervised_counts_weigh_every_token_alike(one_rank, two_ranks):
    loss, grad_norm, mean_of_means = hand_loss_and_grad_norm({r: masked_batches(r) for r in SUPERVISED})
    assert abs(loss - mean_of_means) > 5e-3 * loss
    for rank, report in enumerate(two_ranks):
        assert report["masked"]["loss"] == pytest.approx(loss, rel=1e-6), rank
        assert report["masked"]["grad_norm"] == pytest.approx(grad_norm, rel=1e-5), rank


def test_a_step_without_any_supervised_token_is_non_finite(one_rank):
    with pytest.raises(Stop, match=r"step 1: non-finite loss \(nan\)"):
        masked_step(0, {0: masked_batches(0, counts=(0, 0))})


def test_a_fine_tune_on_masked_shards_resumes_bitwise(one_rank, monkeypatch, tmp_path):
    """The real shard reader on a shard with a loss_mask column (targets: a different stretch of every row, some
    rows without any), 6 steps straight, and 3 steps, a checkpoint, new components resumed from it, 3 more."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from huginn_ray.data.shards import shard_path
    from huginn_ray.train import checkpoint as ckpt
    from huginn_ray.train.shard_reader import ShardReader

    monkeypatch.setattr(loop, "ShardReader", ShardReader)
    rng = np.random.default_rng(3)
    ids = rng.integers(2, 64, size=(48, 17), dtype=np.int32)
    starts = rng.integers(0, 17, size=(48, 1))
    mask = ((np.arange(17) >= starts) & (np.arange(17) < starts + 6)).astype(np.uint8)
    mask[::7] = 0  # rows without a target
    path = shard_path(tmp_path, "train", 0)
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({"input_ids": pa.array(list(ids), type=pa.list_(pa.int32())),
                             "loss_mask": pa.array(list(mask), type=pa.list_(pa.uint8()))}), path, row_group_size=8)
    cfg = config(f"data.data_dir={tmp_path}", "skip_first_optimizer_step=false")
    plan = plan_for(cfg, grad_accum=2)
    straight = loop.build_components(cfg, plan, 0, CPU)
    expected = [loop.train_step(straight, step, cfg, plan, CPU).loss for step in range(1, 7)]
    first = loop.build_components(cfg, plan, 0, CPU)
    losses = [loop.train_step(first, step, cfg, plan, CPU).loss for step in range(1, 4)]
    state = ckpt.TrainerState(step=3, world_size=1, num_streams=1, global_batch_rows=plan.global_batch_rows,
                              rows_per_stream=3 * first.order.rows_per_stream_per_step)
    ckpt.write(tmp_path / "run" / "checkpoint_000003", 0, first.model, first.optimizer, state, CPU)
    second = loop.build_components(cfg, plan, 0, CPU)
    resumed = ckpt.resume(None, tmp_path / "run", 0, second.model, second.optimizer, CPU)
    second.reader.seek(resumed.state.rows_per_stream)
    second.resumed = True
    losses += [loop.train_step(second, step, cfg, plan, CPU).loss for step in range(4, 7)]
    assert losses == expected
    assert len(set(expected)) == 6


def test_a_resume_trains_with_the_config_s_optimizer_hyperparameters_and_names_each_change(one_rank, tmp_path,
                                                                                           capsys):
    """A checkpoint of 2 steps at weight_decay 1e-4, betas (0.9, 0.95), resumed by a config that changes
    weight_decay, betas[1] and eps (the schedule's lr aside): loop.resume_from_checkpoint leaves the config's values
    in every group and rank 0 names each change once; an unchanged resume says nothing."""
    from huginn_ray.train import checkpoint as ckpt

    run = [f"out_dir={tmp_path}", "optim.weight_decay=1e-4", "optim.betas=[0.9, 0.95]", "optim.eps=1e-6"]
    cfg = config(*run)
    plan = plan_for(cfg)
    first = loop.build_components(cfg, plan, 0, CPU)
    for step in (1, 2):
        loop.train_step(first, step, cfg, plan, CPU)
    state = ckpt.TrainerState(step=2, world_size=1, num_streams=1, global_batch_rows=plan.global_batch_rows,
                              rows_per_stream=2 * first.order.rows_per_stream_per_step)
    ckpt.write(Path(cfg.run_dir) / "checkpoint_000002", 0, first.model, first.optimizer, state, CPU)

    same = loop.build_components(cfg, plan, 0, CPU)
    capsys.readouterr()
    assert loop.resume_from_checkpoint(same, cfg, plan, None, 0, CPU).state.step == 2
    assert "[huginn] resume: " not in capsys.readouterr().out

    changed = config(*run, "optim.weight_decay=0.05", "optim.betas=[0.9, 0.99]", "optim.eps=1e-8")
    second = loop.build_components(changed, plan, 0, CPU)
    capsys.readouterr()
    loop.resume_from_checkpoint(second, changed, plan, None, 0, CPU)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[huginn] resume: ")]
    assert lines == ["[huginn] resume: optim.betas (0.9, 0.95) -> (0.9, 0.99) (config)",
                     "[huginn] resume: optim.eps 1e-06 -> 1e-08 (config)",
                     "[huginn] resume: optim.weight_decay 0.0001 -> 0.05 (config)"]
    assert second.resumed
    groups = {group["name"]: group for group in second.optimizer.param_groups}
    assert {name: group["weight_decay"] for name, group in groups.items()} == \
        {"weights": 0.05, "embedding": 0.05, "scale_norm": 0.0}
    assert all(group["betas"] == (0.9, 0.99) and group["eps"] == 1e-8 for group in groups.values())
    # the moments are the checkpoint's (the resume loaded them; only the hyperparameters changed)
    for p, q in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(first.optimizer.state[p]["exp_avg"], second.optimizer.state[q]["exp_avg"])


def test_seed_20000_trains_and_every_seed_the_config_accepts_gets_its_own_rows_noise(one_rank):
    """seed x 2^50 + key overflowed the generator's 64 bits from seed 2^14 on; row_seed keeps that value where it
    fits (seed 233's noise is what it was) and hashes (seed, key) beyond, so seed 20000 trains, and does not share
    its rows' noise with seed 20000 - 2^14 (as a reduction modulo 2^64 would)."""
    from huginn_ray.model.noise import TRUNC_NORMAL_UNIFORM, row_seed, trunc_normal_from_uniform_

    cfg = config("seed=20000")
    plan = plan_for(cfg)
    c = loop.build_components(cfg, plan, 0, CPU)
    assert math.isfinite(loop.train_step(c, 1, cfg, plan, CPU).loss)
    keys = torch.tensor([0, 7, 2**32 + 3])
    assert [row_seed(233, key) for key in keys.tolist()] == [233 * 2**50, 233 * 2**50 + 7, 233 * 2**50 + 2**32 + 3]
    noise = {seed: c.model.keyed_initial_state(keys, 4, seed, CPU) for seed in (233, 20000, 20000 - 2**14, 2**64 - 1)}
    generator = torch.Generator().manual_seed(233 * 2**50 + 7)  # the formula of every run before the fix
    uniform = torch.empty(4, c.model_cfg.n_embd).uniform_(*TRUNC_NORMAL_UNIFORM, generator=generator)
    expected = trunc_normal_from_uniform_(uniform, c.model_cfg.init_std)
    assert torch.equal(noise[233][1], expected * c.model_cfg.embedding_scale)
    assert not torch.equal(noise[20000], noise[20000 - 2**14])
    assert len({row_seed(seed, 7) for seed in noise}) == 4

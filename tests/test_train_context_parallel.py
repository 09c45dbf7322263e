"""Context parallelism (huginn_ray.train.context_parallel) gives the unsplit run's numbers (real gloo groups).

Training loop: raven-tiny at block_size 256 trained for 12 steps by `loop.train_step` on 4 ranks, with
context_parallel 4 (replicate) and with hsdp over shard 2 x cp 2, logs the losses and gradient norms of the same
run on one rank without context parallelism within 1e-5 relative (activation checkpointing, no-grad iterations,
the keyed initial state); step 1's reduced gradients agree within 1e-5. The shard 2 x cp 2 run saved after step 6 and resumed by new
components trains steps 7-12 with the uninterrupted run's losses, bit for bit. Validation (no gradients, the rows
split alike, the sums over every rank) gives one rank's losses at depths 1 and 3 within 1e-5.

Model level: 4 spawned ranks split a raven-tiny sequence of 256 tokens over a cp group of 4 (head-tail pieces of
32 tokens); every rank runs the forward and backward of its 64 positions inside the context, with no-grad and
checkpointed iterations and the keyed initial state. The loss (local sums over the global count, summed over the
group) and every gradient (summed over the group) must match one process's forward and backward of the whole
sequences. A backward outside the context is refused by name.
"""

from __future__ import annotations

import json
import os
import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from test_train_grad_sync import free_port, spawn

SEQ_LEN, ROWS, SEED = 256, 2, 7
DEPTH = (2, 2)
"""2 no-grad and 2 gradient iterations of the core."""


def tiny_model(checkpointing: bool):
    from huginn_ray.model import ModelConfig, RecurrentGPT

    torch.manual_seed(0)
    config = ModelConfig.from_name("raven-tiny", vocab_size=64, activation_checkpointing=checkpointing)
    return RecurrentGPT(config).train()


def rows():
    """Token ids, labels (a few ignored: -100) and row keys of the test's batch."""
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (ROWS, SEQ_LEN + 1), generator=generator)
    labels = tokens[:, 1:].clone()
    labels[:, ::7] = -100
    return tokens[:, :-1], labels, torch.tensor([11, 2**32 + 5])


def loss_sum(model, inputs, labels, keys, seq_len):
    """Sum of the token losses (the loop divides by the global count)."""
    states = model.keyed_initial_state(keys, seq_len, SEED, torch.device("cpu"))
    logits = model(inputs, num_steps=DEPTH, input_states=states).logits
    return F.cross_entropy(logits.flatten(0, 1), labels.reshape(-1), ignore_index=-100, reduction="sum")


def whole_run(checkpointing: bool) -> tuple[float, dict]:
    model = tiny_model(checkpointing)
    inputs, labels, keys = rows()
    count = (labels != -100).sum()
    loss = loss_sum(model, inputs, labels, keys, SEQ_LEN) / count
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def split_run(rank: int, world_size: int) -> dict:
    from huginn_ray.train.context_parallel import ContextParallel, ContextParallelError
    from huginn_ray.train.shard_reader import Batch

    report = {}
    for checkpointing in (False, True):
        model = tiny_model(checkpointing)
        cp = ContextParallel(dist.group.WORLD, SEQ_LEN, torch.device("cpu"))
        model.split_sequence(cp)
        inputs, labels, keys = rows()
        count = (labels != -100).sum()
        local = cp.local_batch(Batch(inputs, labels, keys))
        with cp.sequence():
            loss = loss_sum(model, local.inputs, local.labels, keys, SEQ_LEN) / count
            loss.backward()
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        grads = [p.grad for p in model.parameters()]
        for grad in grads:
            dist.all_reduce(grad)
        expected_loss, expected = whole_run(checkpointing)
        key = "checkpointed" if checkpointing else "plain"
        report[f"{key}/loss"] = (summed.item(), expected_loss)
        report[f"{key}/grad_error"] = max(((p.grad - expected[name]).abs().max() / expected[name].abs().max()).item()
                                          for name, p in model.named_parameters())
        model.zero_grad()
        if checkpointing:  # the forward inside, its backward outside: the recomputation is refused by name
            with cp.sequence():
                loss = loss_sum(model, local.inputs, local.labels, keys, SEQ_LEN)
            try:
                loss.backward()
                report["outside"] = "no error"
            except ContextParallelError as err:
                report["outside"] = str(err)
    return report


def four_rank_report(rank: int, world_size: int) -> dict:
    """Both halves of the test in one spawn of 4 processes (process start-up is most of their cost)."""
    return {"model": split_run(rank, world_size), "loop": loop_run(rank, world_size)}


@pytest.fixture(scope="module")
def four_rank_reports(tmp_path_factory):
    os.environ["CP_TEST_CHECKPOINT"] = str(tmp_path_factory.mktemp("cp_run") / "checkpoint")  # the spawned ranks'
    try:
        reports = spawn(four_rank_report, 4, tmp_path_factory.mktemp("cp4"), timeout_s=180)
    finally:
        del os.environ["CP_TEST_CHECKPOINT"]
    for report in reports:
        assert "error" not in report, report.get("trace")
    return reports


@pytest.fixture(scope="module")
def four_ranks(four_rank_reports):
    return [report["model"] for report in four_rank_reports]


@pytest.mark.parametrize("variant", ["plain", "checkpointed"])
def test_a_sequence_split_over_four_ranks_gives_the_whole_sequences_loss_and_gradients(four_ranks, variant):
    for report in four_ranks:
        got, expected = report[f"{variant}/loss"]
        assert got == pytest.approx(expected, rel=1e-5)
        assert report[f"{variant}/grad_error"] < 1e-5


def test_a_backward_outside_the_context_is_refused_by_name(four_ranks):
    for report in four_ranks:
        assert "recomputation in a backward) with gradients outside ContextParallel.sequence()" in report["outside"]


def test_the_head_tail_layout_gives_every_rank_a_head_and_a_tail_piece():
    from huginn_ray.train.context_parallel import ContextParallelError, head_tail_positions

    assert head_tail_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert head_tail_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    everyone = torch.cat([head_tail_positions(256, 4, r) for r in range(4)])
    assert sorted(everyone.tolist()) == list(range(256))
    with pytest.raises(ContextParallelError, match="block_size=20 does not split into 2 x context_parallel = 8"):
        head_tail_positions(20, 4, 0)


# ---- the training loop: 12 steps on 4 ranks against 1 rank --------------------------------------------------
LOOP_STEPS = 12
LAYOUTS = {
    "cp4": ["parallelism.context_parallel=4"],
    "shard2xcp2": ["parallelism.mode=hsdp", "parallelism.context_parallel=2"],
}
"""4 ranks on one node: a cp group of 4 (replicated model); FSDP over shard 2 x cp 2 (two cp groups read
different rows)."""


def loop_run(rank: int, world_size: int) -> dict:
    """Train raven-tiny for LOOP_STEPS steps of 4 rows of 256 tokens from 2 streams (one micro-batch per step on
    every layout, so every layout samples the same depths): every layout of `world_size` ranks (one rank: no
    split). Reports the losses, the gradient norms, step 1's reduced gradients and the final weights."""
    from test_train_parallel import MemoryReader, train_config

    from huginn_ray.model import ModelConfig
    from huginn_ray.train import loop
    from huginn_ray.train.run_plan import RunPlan

    loop.ShardReader = MemoryReader
    cpu = torch.device("cpu")
    report = {}
    for name, extra in ({"whole": []} if world_size == 1 else LAYOUTS).items():
        cfg = train_config(["block_size=256", "micro_batch_size=4", f"max_steps={LOOP_STEPS}",
                            f"scaling.num_workers={world_size}", *extra])
        model_cfg = ModelConfig.from_name("raven-tiny", vocab_size=64, activation_checkpointing=True)
        plan = RunPlan(global_batch_rows=4, num_streams=2, data_dir=cfg.data.data_dir, schedule_steps=LOOP_STEPS,
                       pad_id=0, eos_id=1, precision="fp32", model_config=model_cfg)
        c = loop.build_components(cfg, plan, rank, cpu, local_world_size=world_size)
        grads, step = {}, c.optimizer.step

        def recording_step():
            if not grads:
                grads.update({n: whole(p.grad).tolist() for n, p in c.model.named_parameters()})
            step()

        c.optimizer.step = recording_step
        validation = validation_loss(c, cfg, plan, rank)
        results = [loop.train_step(c, s, cfg, plan, cpu) for s in range(1, SAVED_AT + 1)]
        if name == RESUMED_LAYOUT:
            save(c, plan, rank, world_size)
        results += [loop.train_step(c, s, cfg, plan, cpu) for s in range(SAVED_AT + 1, LOOP_STEPS + 1)]
        report[name] = {"losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results],
                        "depths": [r.depths for r in results], "grads": grads, "validation": validation,
                        "weights": {n: whole(p).tolist() for n, p in c.model.named_parameters()}}
        if name == RESUMED_LAYOUT:  # a new run from the checkpoint of step 6
            c = loop.build_components(cfg, plan, rank, cpu, local_world_size=world_size)
            resume(c, plan, rank)
            report[name]["resumed_losses"] = [loop.train_step(c, s, cfg, plan, cpu).loss
                                              for s in range(SAVED_AT + 1, LOOP_STEPS + 1)]
    return report


def validation_loss(c, cfg, plan, rank: int) -> dict:
    """The validation metrics at depths 1 and 3 of the initial model on 4 fixed rows, each cp group validating its
    data rank's rows of them, split as in training."""
    from dataclasses import replace

    from test_train_parallel import validate, MemoryReader

    from huginn_ray.train.shard_reader import collate

    rows = MemoryReader(None, 99, 0, cfg.block_size + 1).next_rows(c.order.rows_per_micro_batch)
    batch = collate(rows[list(c.order.rows(c.shape.data_rank(rank)))], plan.pad_id, plan.eos_id)
    return validate(c.model, c.cp.local_batch(batch), replace(cfg, eval_depths=[1, 3], eval_iters=1), plan,
                    torch.device("cpu"), c.autocast)


SAVED_AT = 6
RESUMED_LAYOUT = "shard2xcp2"
"""The layout whose run is saved after step 6 and resumed by new components for steps 7-12."""


def checkpoint_dir() -> Path:
    return Path(os.environ["CP_TEST_CHECKPOINT"])


def save(c, plan, rank: int, world_size: int) -> None:
    from huginn_ray.train import checkpoint as ckpt

    ckpt.write(checkpoint_dir(), rank, c.model, c.optimizer,
               ckpt.TrainerState(step=SAVED_AT, world_size=world_size, num_streams=plan.num_streams,
                                 global_batch_rows=plan.global_batch_rows, rows_per_stream=c.reader.position),
               torch.device("cpu"))


def resume(c, plan, rank: int) -> None:
    """What the loop does with a checkpoint: model and optimizer loaded, the data position checked, the reader
    seeked."""
    from huginn_ray.train import checkpoint as ckpt

    directory = checkpoint_dir()
    resumed = ckpt.resume(directory, directory.parent, rank, c.model, c.optimizer, torch.device("cpu"),
                          log=lambda message: None)
    ckpt.check_data_position(resumed.state, directory, plan.num_streams, plan.global_batch_rows)
    c.reader.seek(resumed.state.rows_per_stream)
    c.resumed = True


def whole(tensor):
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


@pytest.fixture(scope="module")
def loop_runs(four_rank_reports):
    """The one-rank run in this process (a gloo group of it alone), and the 4 ranks' reports."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    threads = torch.get_num_threads()
    try:
        reference = json.loads(json.dumps(loop_run(0, 1)["whole"]))  # as the spawned ranks report it
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    return reference, [report["loop"] for report in four_rank_reports]


def relative_error(got, expected) -> float:
    got, expected = torch.tensor(got), torch.tensor(expected)
    return ((got - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_context_parallel_run_trains_as_one_rank_without_it(loop_runs, layout):
    reference, reports = loop_runs
    assert any(n > 0 for (n, k), in reference["depths"])  # no-grad iterations ran
    for report in reports:
        run = report[layout]
        assert run["depths"] == reference["depths"]
        assert run["validation"] == pytest.approx(reference["validation"], rel=1e-5)
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert run["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5)
        for name, grad in reference["grads"].items():
            assert relative_error(run["grads"][name], grad) < 1e-5, name
        for name, weight in reference["weights"].items():
            # after 12 Adam steps: its normalisation amplifies fp32 summation-order differences of tiny gradients
            assert relative_error(run["weights"][name], weight) < 1e-4, name


@pytest.mark.parametrize("overrides, message", [
    (["parallelism.context_parallel=0"], "parallelism.context_parallel"),
    (["parallelism.context_parallel=3", "scaling.num_workers=4"], "context_parallel=3 does not divide "
                                                                    "scaling.num_workers=4"),
    (["parallelism.context_parallel=2", "scaling.num_workers=[2, 4]"], "an elastic worker count"),
    (["parallelism.context_parallel=4", "scaling.num_workers=4", "block_size=20"],
     "block_size=20 does not split into 8 equal pieces"),
    (["parallelism.context_parallel=2", "grad_sync.kind=ddp"], "with grad_sync.kind=ddp is not supported"),
    (["parallelism.context_parallel=2", "compile=true"], "with compile=true is not supported"),
])
def test_a_context_parallel_layout_the_run_cannot_serve_is_refused_by_name(overrides, message):
    from huginn_ray.config import ConfigError
    from huginn_ray.train.config import load_train_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_train_config(None, ["max_steps=2", "block_size=16", *overrides])


def test_a_cp_group_lies_inside_a_node_and_reads_as_one_data_rank():
    from huginn_ray.train import parallel

    shape = parallel.mesh_shape(True, 8, 4, context_parallel=2)
    assert (shape.shard_size, shape.replicas, shape.data_ranks) == (4, 2, 4)
    assert [shape.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert shape.name == "hsdp, shard_size 4, context_parallel 2"
    with pytest.raises(parallel.LayoutError, match="context_parallel=4 does not divide the 2 ranks of a node"):
        parallel.mesh_shape(False, 8, 2, context_parallel=4)


def test_a_context_parallel_run_resumes_exactly(loop_runs):
    _, reports = loop_runs
    for report in reports:
        run = report[RESUMED_LAYOUT]
        assert run["resumed_losses"] == run["losses"][SAVED_AT:]

"""Context parallelism (huginn_ray.train.context_parallel) gives the unsplit run's numbers (real gloo groups).

Model level: 4 spawned ranks split a raven-tiny sequence of 256 tokens over a cp group of 4 (head-tail pieces of
32 tokens); every rank runs the forward and backward of its 64 positions inside the context, with no-grad and
checkpointed iterations and the keyed initial state. The loss (local sums over the global count, summed over the
group) and every gradient (summed over the group) must match one process's forward and backward of the whole
sequences. A backward outside the context is refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from test_train_grad_sync import spawn

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


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    reports = spawn(split_run, 4, tmp_path_factory.mktemp("cp4"), timeout_s=60)
    for report in reports:
        assert "error" not in report, report.get("trace")
    return reports


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

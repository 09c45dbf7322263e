"""A truncated or foreign DCP state file or trainer state gives an error naming the file or the state directory, not
a raw torch error; a checkpoint continues only its own data order; resume passes over incomplete or unloadable checkpoints to the newest one that loads on every
rank; replicated tensors are written once, spread over the ranks."""

import json
import re
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from huginn_ray.model import ModelConfig, RecurrentGPT
from huginn_ray.train import checkpoint as ckpt
from huginn_ray.train.config import OptimConfig
from huginn_ray.train.optim import build_optimizer

CPU = torch.device("cpu")


def components(n_layers_in_recurrent_block: int = 1):
    torch.manual_seed(0)
    model = RecurrentGPT(ModelConfig.from_name("raven-tiny", vocab_size=64,
                                               n_layers_in_recurrent_block=n_layers_in_recurrent_block))
    return model, build_optimizer(model, OptimConfig())


@pytest.fixture
def saved(tmp_path) -> Path:
    model, optimizer = components()
    torch.manual_seed(0)
    model(torch.randint(0, 64, (1, 8)), labels=torch.randint(0, 64, (1, 8)), num_steps=(1, 1)).loss.backward()
    optimizer.step()
    ckpt.write(tmp_path, 0, model, optimizer, ckpt.TrainerState(step=3, world_size=1, num_streams=2,
                                                                global_batch_rows=8, rows_per_stream=12), CPU)
    return tmp_path


def read(directory, n_layers_in_recurrent_block=1):
    model, optimizer = components(n_layers_in_recurrent_block)
    state = ckpt.read_trainer_state(directory)
    ckpt.read_tensors(directory, model, optimizer)
    return state, model, optimizer


def test_intact_checkpoint_reads_back_every_tensor_exactly(saved):
    model, _ = components()
    state, loaded, loaded_optimizer = read(saved)
    assert (state.step, state.num_streams, state.global_batch_rows, state.rows_per_stream) == (3, 2, 8, 12)
    stepped, stepped_optimizer = components()  # what the fixture saved: the same seed, batch and step
    torch.manual_seed(0)
    stepped(torch.randint(0, 64, (1, 8)), labels=torch.randint(0, 64, (1, 8)), num_steps=(1, 1)).loss.backward()
    stepped_optimizer.step()
    assert not torch.equal(loaded.transformer.wte.weight, model.transformer.wte.weight)  # not the fresh init
    for (name, value), expected in zip(loaded.state_dict().items(), stepped.state_dict().values()):
        assert torch.equal(value, expected), name
    for got, expected in zip(loaded_optimizer.state.values(), stepped_optimizer.state.values()):
        assert torch.equal(got["exp_avg"], expected["exp_avg"]) and torch.equal(got["exp_avg_sq"], expected["exp_avg_sq"])
    steps = [s["step"] for s in loaded_optimizer.state.values()]
    assert steps and all(step.device.type == "cpu" and int(step) == 1 for step in steps)  # on the host


@pytest.mark.parametrize("name, error", [
    ("state/__0_0.distcp", "state: cannot be loaded into this model and optimizer"),
    ("trainer_state.json", "trainer_state.json: cannot be read")])
def test_truncated_file_is_named(saved, name, error):
    path = saved / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ckpt.CheckpointError, match=rf"{saved}/{error}"):
        read(saved)


def test_a_checkpoint_continues_only_its_own_data_order(saved):
    state = ckpt.read_trainer_state(saved)
    ckpt.check_data_position(state, saved, 2, 8)
    with pytest.raises(ValueError, match=rf"^checkpoint {saved} was written with 2 train shards and a global batch "
                                         r"of 8 rows, this run has 2 shards and 16 rows \(world_batch_size\)"):
        ckpt.check_data_position(state, saved, 2, 16)


def test_a_checkpoint_of_another_model_is_refused_naming_the_missing_tensor(saved):
    with pytest.raises(ckpt.CheckpointError, match=rf"{saved / 'state'}: cannot be loaded into this model and "
                       r"optimizer \(rank 0: RuntimeError: Missing key in checkpoint state_dict: "
                       r"model.transformer.core_block.1.norm_1.weight"):
        read(saved, n_layers_in_recurrent_block=2)


# --- resume: the newest complete checkpoint that loads, falling back past broken ones ---

WORLD = 2


def save_run_checkpoint(run_dir: Path, step: int) -> Path:
    """A two-rank checkpoint as Ray Train leaves it (both ranks' files merged into one directory), with its
    marker; the model's first parameter, data position and trainer state say which step it is."""
    directory = run_dir / f"checkpoint_2026-11-23_11-00-{step:02d}.000000"
    model, optimizer = components()
    with torch.no_grad():
        next(model.parameters()).fill_(step)
    state = ckpt.TrainerState(step=step, world_size=WORLD, rows_per_stream=step)
    for rank in range(WORLD):
        ckpt.start_save(directory, rank, model, optimizer, state, CPU).future.result()
    ckpt.write_marker(directory, step, ckpt.marker_files(directory))
    return directory


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """Checkpoints of steps 4 and 8 and 12 (the newest, the one Ray Train registered last)."""
    for step in (4, 8, 12):
        save_run_checkpoint(tmp_path, step)
    return tmp_path


def checkpoint_of(run_dir: Path, step: int) -> Path:
    return run_dir / f"checkpoint_2026-11-23_11-00-{step:02d}.000000"


def resume(run_dir: Path, registered_step: int | None = 12):
    model, optimizer = components()
    messages = []
    registered = checkpoint_of(run_dir, registered_step) if registered_step is not None else None
    resumed = ckpt.resume(registered, run_dir, 0, model, optimizer, CPU, log=messages.append)
    return resumed, model, messages


def assert_resumed_at(resumed, model, step: int):
    assert resumed.state.step == resumed.state.rows_per_stream == step and resumed.state.world_size == WORLD
    assert resumed.directory == str(checkpoint_of(Path(resumed.directory).parent, step))
    assert torch.equal(next(model.parameters()), torch.full_like(next(model.parameters()), step))


def test_resume_takes_the_registered_checkpoint_when_it_is_complete(run_dir):
    resumed, model, messages = resume(run_dir)
    assert_resumed_at(resumed, model, 12)
    assert messages == [f"[huginn] resumed from {checkpoint_of(run_dir, 12)} at step 12"]


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


BROKEN = {
    "truncated state/__0_0.distcp": (
        lambda d: truncate(d / "state/__0_0.distcp"),
        r"state/__0_0.distcp has \d+ bytes, checkpoint_complete.json lists \d+: truncated"),
    "missing state/.metadata": (
        lambda d: (d / "state/.metadata").unlink(),
        r"state/.metadata is missing \(checkpoint_complete.json lists it with \d+ bytes\)"),
    "no marker (half-written)": (
        lambda d: (d / "checkpoint_complete.json").unlink(),
        r"no checkpoint_complete.json: the save did not finish"),
    "marker lists a file of another size": (
        lambda d: (d / "checkpoint_complete.json").write_text(
            (d / "checkpoint_complete.json").read_text().replace('"state/.metadata": ', '"state/.metadata": 1')),
        r"state/.metadata has \d+ bytes, checkpoint_complete.json lists 1\d+: truncated or rewritten"),
    "complete but unreadable state/__0_0.distcp (same size)": (
        lambda d: (d / "state/__0_0.distcp").write_bytes(bytes((d / "state/__0_0.distcp").stat().st_size)),
        r"state: cannot be loaded into this model and optimizer \(rank 0: UnpicklingError"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_newest_checkpoint_is_skipped_for_the_previous_one(run_dir, case):
    breaks, why = BROKEN[case]
    breaks(checkpoint_of(run_dir, 12))
    resumed, model, messages = resume(run_dir)
    assert_resumed_at(resumed, model, 8)
    assert len(messages) == 2, messages
    assert messages[0].startswith(f"[huginn] skipping checkpoint {checkpoint_of(run_dir, 12)} (")
    assert re.search(why, messages[0]), messages[0]
    assert messages[1] == f"[huginn] resumed from {checkpoint_of(run_dir, 8)} at step 8"


def test_two_broken_checkpoints_fall_back_two_steps_and_newer_unregistered_saves_are_ignored(run_dir):
    (checkpoint_of(run_dir, 12) / "state/.metadata").unlink()
    truncate(checkpoint_of(run_dir, 8) / "state/__0_0.distcp")
    save_run_checkpoint(run_dir, 16)  # complete, but Ray never registered it: not a candidate
    resumed, model, messages = resume(run_dir)
    assert_resumed_at(resumed, model, 4)
    assert [m.split(" (")[0] for m in messages] == [
        f"[huginn] skipping checkpoint {checkpoint_of(run_dir, 12)}",
        f"[huginn] skipping checkpoint {checkpoint_of(run_dir, 8)}",
        f"[huginn] resumed from {checkpoint_of(run_dir, 4)} at step 4"]


def test_no_loadable_checkpoint_fails_naming_every_one_tried(run_dir):
    for step in (4, 8, 12):
        (checkpoint_of(run_dir, step) / "checkpoint_complete.json").unlink()
    with pytest.raises(ckpt.CheckpointError) as failed:
        resume(run_dir)
    message = str(failed.value)
    assert message.startswith(f"no checkpoint of {run_dir} can be resumed from; tried, newest first: ")
    tried = [checkpoint_of(run_dir, step) for step in (12, 8, 4)]
    assert [message.index(str(d)) for d in tried] == sorted(message.index(str(d)) for d in tried)
    assert message.count("no checkpoint_complete.json: the save did not finish") == 3


def test_without_a_registered_checkpoint_a_complete_one_in_storage_is_used(run_dir):
    resumed, model, _ = resume(run_dir, registered_step=None)
    assert_resumed_at(resumed, model, 12)


def test_only_unfinished_saves_start_the_run_at_step_0_and_say_so(tmp_path):
    save_run_checkpoint(tmp_path, 4)
    (checkpoint_of(tmp_path, 4) / "checkpoint_complete.json").unlink()
    resumed, _, messages = resume(tmp_path, registered_step=None)
    assert resumed is None
    assert messages == [
        f"[huginn] skipping checkpoint {checkpoint_of(tmp_path, 4)} "
        "(no checkpoint_complete.json: the save did not finish)",
        f"[huginn] no finished checkpoint in {tmp_path} (only unfinished saves): starting at step 0"]
    assert resume(tmp_path / "empty", registered_step=None)[0] is None  # a new run


def test_the_marker_lists_every_file_of_every_rank_with_its_size(run_dir):
    directory = checkpoint_of(run_dir, 12)
    listed = json.loads((directory / "checkpoint_complete.json").read_text())
    on_disk = {str(p.relative_to(directory)): p.stat().st_size for p in directory.rglob("*")
               if p.is_file() and p.name != "checkpoint_complete.json"}
    assert listed == {"step": 12, "files": on_disk}
    assert sorted(on_disk) == ["model/config.json", "state/.metadata", "state/__0_0.distcp", "trainer_state.json"]


def two_gloo_ranks(rank: int, port: int, run_dir: str) -> None:
    """Both ranks save steps 8 and 12 with the real collectives (the marker lists rank 1's file too), then
    rank 1 does not see rank 1's tensor file of step 12 (a stand-in for a shared file system that shows one node
    a file later than another): only rank 1 finds that checkpoint incomplete."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=30))
    torch.set_num_threads(1)
    run_dir = Path(run_dir)
    for step in (8, 12):
        model, optimizer = components()
        with torch.no_grad():
            next(model.parameters()).fill_(step)
        ckpt.write(checkpoint_of(run_dir, step), rank, model, optimizer,
                   ckpt.TrainerState(step=step, world_size=WORLD, rows_per_stream=step), CPU)
    dist.barrier()
    if rank == 1:
        sees_everything = ckpt.incomplete
        ckpt.incomplete = lambda d, *share: ("state/__1_0.distcp is missing (checkpoint_complete.json lists it)"
                                             if d == str(checkpoint_of(run_dir, 12)) else sees_everything(d, *share))
    model, optimizer = components()
    messages = []
    resumed = ckpt.resume(checkpoint_of(run_dir, 12), run_dir, rank, model, optimizer, CPU, log=messages.append)
    (run_dir / f"result_{rank}.json").write_text(json.dumps(
        {"step": resumed.state.step, "rows": resumed.state.rows_per_stream, "directory": str(resumed.directory),
         "first_param": next(model.parameters()).flatten()[0].item(), "messages": messages}))
    dist.destroy_process_group()


def test_ranks_agree_to_skip_a_checkpoint_that_only_one_rank_cannot_load(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(two_gloo_ranks, args=(port, str(tmp_path)), nprocs=WORLD, start_method="spawn", join=True)
    results = [json.loads((tmp_path / f"result_{rank}.json").read_text()) for rank in range(WORLD)]
    files = json.loads((checkpoint_of(tmp_path, 12) / "checkpoint_complete.json").read_text())["files"]
    assert files.keys() == {"state/__0_0.distcp", "state/__1_0.distcp", "state/.metadata", "model/config.json",
                            "trainer_state.json"}
    # the model is replicated on both ranks: each tensor is written once, and both ranks write a share of them
    model, optimizer = components()  # the same state saved by one process alone, for the byte count
    with torch.no_grad():
        next(model.parameters()).fill_(12)
    ckpt.write(tmp_path / "one_rank", 0, model, optimizer, ckpt.TrainerState(step=12, world_size=1), CPU)
    one_rank = (tmp_path / "one_rank" / "state" / "__0_0.distcp").stat().st_size
    shares = [files["state/__0_0.distcp"], files["state/__1_0.distcp"]]
    assert min(shares) > 0.2 * one_rank and abs(sum(shares) - one_rank) < 0.05 * one_rank, (shares, one_rank)
    for rank, result in enumerate(results):
        assert result["step"] == 8 and result["first_param"] == 8.0
        assert result["rows"] == 8 and result["directory"] == str(checkpoint_of(tmp_path, 8))
    skipped, used = results[0]["messages"]
    assert skipped == (f"[huginn] skipping checkpoint {checkpoint_of(tmp_path, 12)} (rank 1: state/__1_0.distcp is "
                       "missing (checkpoint_complete.json lists it))")
    assert used == f"[huginn] resumed from {checkpoint_of(tmp_path, 8)} at step 8"
    assert results[1]["messages"] == []  # rank 0 speaks for all


def async_two_ranks(rank: int, port: int, run_dir: str) -> None:
    """An asynchronous save while "training" goes on, then one whose write fails on rank 0 only."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=30))
    torch.set_num_threads(1)
    run_dir = Path(run_dir)
    background = dist.new_group(backend="gloo")
    model, optimizer = components()
    saved = {key: value.clone() for key, value in model.state_dict().items()}
    state = ckpt.TrainerState(step=3, world_size=WORLD)
    pending = ckpt.start_save(run_dir / "good", rank, model, optimizer, state, CPU, background)
    with torch.no_grad():  # the next steps change the weights while the save is written
        for p in model.parameters():
            p.add_(1.0)
    complete = ckpt.finish_save(pending, CPU)
    loaded, loaded_optimizer = components()
    ckpt.read_tensors(run_dir / "good", loaded, loaded_optimizer)
    equal = all(torch.equal(value, saved[key]) for key, value in loaded.state_dict().items())
    if rank == 0:  # a directory where rank 0's tensor file must go: its write fails inside DCP
        (run_dir / "bad" / "state" / "__0_0.distcp").mkdir(parents=True)
    dist.barrier()
    failed = ckpt.finish_save(ckpt.start_save(run_dir / "bad", rank, model, optimizer, state, CPU, background), CPU)
    (run_dir / f"async_{rank}.json").write_text(json.dumps({"complete": complete, "equal": equal, "failed": failed}))
    dist.destroy_process_group()


def test_an_asynchronous_save_holds_the_state_of_its_start_and_a_failed_one_leaves_no_marker(tmp_path, capfd):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(async_two_ranks, args=(port, str(tmp_path)), nprocs=WORLD, start_method="spawn", join=True)
    results = [json.loads((tmp_path / f"async_{rank}.json").read_text()) for rank in range(WORLD)]
    assert results == [{"complete": True, "equal": True, "failed": False}] * WORLD
    assert ckpt.incomplete(tmp_path / "good") is None
    assert ckpt.incomplete(tmp_path / "bad") == "no checkpoint_complete.json: the save did not finish"
    out = capfd.readouterr().out
    assert "[huginn] the checkpoint of step 3 failed (rank 0: " in out and "IsADirectoryError" in out, out[-2000:]
    assert "the previous complete checkpoint stays the newest" in out


@pytest.mark.parametrize("name", ["ELLISAdam", "AdamW"])
def test_a_save_before_the_first_step_leaves_the_optimizer_as_it_was(tmp_path, name):
    """DCP creates a missing optimizer state with a fake step; the state must already exist, unchanged by saving
    (ELLISAdam's running init must still take the first real gradient; no step may be counted)."""
    torch.manual_seed(0)
    model = RecurrentGPT(ModelConfig.from_name("raven-tiny", vocab_size=64))
    optimizer = build_optimizer(model, OptimConfig(name=name))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    ckpt.write(tmp_path, 0, model, optimizer, ckpt.TrainerState(step=1, world_size=1), CPU)
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    for state in optimizer.state.values():
        assert int(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    loaded = build_optimizer(model, OptimConfig(name=name))
    ckpt.read_tensors(tmp_path, model, loaded)
    assert all(int(state["step"]) == 0 for state in loaded.state.values())


def test_io_errors_are_retried_and_other_errors_are_not(monkeypatch):
    from torch.distributed.checkpoint.api import CheckpointException

    monkeypatch.setattr(ckpt.time, "sleep", lambda seconds: None)
    calls = []

    def flaky():  # DCP's report of an I/O error on rank 1, twice, then success
        calls.append(1)
        if len(calls) < 3:
            raise CheckpointException("read", {1: (OSError("Input/output error"), None)})
        return "loaded"

    assert ckpt.with_retries("reading", flaky) == "loaded" and len(calls) == 3
    calls.clear()

    def wrong_model():
        calls.append(1)
        raise CheckpointException("plan", {0: (RuntimeError("Missing key in checkpoint state_dict: x"), None)})

    with pytest.raises(CheckpointException):
        ckpt.with_retries("reading", wrong_model)
    assert len(calls) == 1
    calls.clear()

    def always_failing():
        calls.append(1)
        raise OSError("Stale file handle")

    with pytest.raises(OSError, match="Stale file handle"):
        ckpt.with_retries("reading", always_failing)
    assert len(calls) == ckpt.IO_ATTEMPTS

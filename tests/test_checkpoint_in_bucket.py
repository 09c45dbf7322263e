"""Training checkpoints with the run directory in a bucket (moto's S3 server, tests/s3_server.py): checkpoints the
project's own save wrote, uploaded as Ray Train's storage leaves them, are found, checked and loaded on the bucket
with the same answers as on the local disk; a deleted or truncated object makes its checkpoint skipped, named as
locally; Ray's checkpoint maps to its location; profiler traces and flight-recorder dumps are published there."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from huginn_ray import storage
from huginn_ray.checkpoint_layout import MARKER, incomplete
from huginn_ray.model import ModelConfig, RecurrentGPT
from huginn_ray.train import checkpoint as ckpt
from huginn_ray.train import replica_read
from huginn_ray.train.config import OptimConfig
from huginn_ray.train.optim import build_optimizer
from s3_server import s3_fixture

CPU = torch.device("cpu")
STEPS = (4, 8)


s3 = s3_fixture("runs")


def components():
    torch.manual_seed(0)
    model = RecurrentGPT(ModelConfig.from_name("raven-tiny", vocab_size=64))
    return model, build_optimizer(model, OptimConfig())


def name_of(step: int) -> str:
    return f"checkpoint_2026-11-28_18-00-{step:02d}.000000"


@pytest.fixture
def runs(s3, single_rank_group, tmp_path, request) -> tuple[str, str]:
    """(local run directory, the same run in the bucket): checkpoints of steps 4 and 8, each of a model trained one
    step on a batch of its own (so the optimizer's moments are not zero), saved by the project's save on a
    single-rank gloo group and uploaded as Ray Train's storage does, the marker last."""
    local = str(tmp_path / "run")
    bucket = f"s3://runs/{request.node.name}/run"
    for step in STEPS:
        model, optimizer = components()
        torch.manual_seed(step)
        model(torch.randint(0, 64, (1, 8)), labels=torch.randint(0, 64, (1, 8)), num_steps=(1, 1)).loss.backward()
        optimizer.step()
        state = ckpt.TrainerState(step=step, world_size=1, num_streams=2, global_batch_rows=8, rows_per_stream=4 * step)
        assert ckpt.write(Path(local, name_of(step)), 0, model, optimizer, state, CPU)
        storage.upload_dir(Path(local, name_of(step)), storage.join(bucket, name_of(step)), last=MARKER)
    return local, bucket


def resume(run_dir: str, registered_step: int | None = 8, replicas=None):
    model, optimizer = components()
    messages = []
    registered = storage.join(run_dir, name_of(registered_step)) if registered_step is not None else None
    resumed = ckpt.resume(registered, run_dir, 0, model, optimizer, CPU, log=messages.append, replicas=replicas)
    return resumed, model, optimizer, messages


def test_candidates_and_the_completeness_check_give_the_local_answers(runs):
    from huginn_ray.train.launch import newest_checkpoint_state

    local, bucket = runs
    for registered in (None, name_of(4), name_of(8)):
        found = {run: ckpt.resume_candidates(registered and storage.join(run, registered), run) for run in runs}
        assert found[bucket] == [c.replace(local, bucket) for c in found[local]]
    assert ckpt.resume_candidates(storage.join(bucket, name_of(4)), bucket) == [storage.join(bucket, name_of(4))]
    assert ckpt.resume_candidates(None, bucket) == [storage.join(bucket, name_of(s)) for s in (8, 4)]
    assert ckpt.resume_candidates(None, storage.join(bucket, "nothing_here")) == []
    for step in STEPS:
        assert incomplete(storage.join(bucket, name_of(step))) is None
    assert newest_checkpoint_state(bucket) == newest_checkpoint_state(local) == ckpt.TrainerState(
        step=8, world_size=1, num_streams=2, global_batch_rows=8, rows_per_stream=32)


@pytest.mark.parametrize("spread", [False, True], ids=["dcp_reader", "replica_spread_read"])
def test_loading_from_the_bucket_gives_bitwise_the_local_state(runs, spread):
    """Through DCP's reader (one process) and through the replica-spread reader (`read_dcp`, here its group of
    one rank), every tensor of model and optimizer equals the local load's, from as many bytes read."""
    local, bucket = runs
    replicas = dist.group.WORLD if spread else None
    loaded = {}
    for run in runs:
        with replica_read.counting_reads() as count:
            resumed, model, optimizer, messages = resume(run, replicas=replicas)
        assert messages == [f"[huginn] resumed from {storage.join(run, name_of(8))} at step 8"]
        assert resumed.directory == storage.join(run, name_of(8)) and resumed.state.rows_per_stream == 32
        loaded[run] = (model.state_dict(), optimizer.state_dict(), count.bytes)
    (model_l, optim_l, read_l), (model_b, optim_b, read_b) = loaded[local], loaded[bucket]
    assert read_b == read_l > 0
    assert model_l.keys() == model_b.keys()
    for name in model_l:
        assert torch.equal(model_l[name], model_b[name]), name
    fresh, _ = components()
    assert not torch.equal(model_b["transformer.wte.weight"], fresh.state_dict()["transformer.wte.weight"])
    assert optim_l["param_groups"] == optim_b["param_groups"]
    assert optim_l["state"].keys() == optim_b["state"].keys() and len(optim_b["state"]) > 0
    for index, moments in optim_l["state"].items():
        for key, value in moments.items():
            assert torch.equal(value, optim_b["state"][index][key]), (index, key)
        assert moments["exp_avg"].abs().sum() > 0


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_damaged_object_makes_the_checkpoint_skipped_by_name_as_locally(runs, damage):
    local, bucket = runs
    name = "state/__0_0.distcp"
    listed = json.loads(storage.read_text(storage.join(bucket, name_of(8), MARKER)))["files"][name]
    messages = {}
    for run in runs:
        damaged = storage.join(run, name_of(8), name)
        if damage == "deleted":
            storage.delete(damaged, missing_ok=False)
        else:
            storage.write_bytes(damaged, storage.read_bytes(damaged)[: listed // 2])
        resumed, model, _, messages[run] = resume(run)
        assert resumed.state.step == 4 and resumed.directory == storage.join(run, name_of(4))
    why = (f"{name} is missing ({MARKER} lists it with {listed} bytes)" if damage == "deleted" else
           f"{name} has {listed // 2} bytes, {MARKER} lists {listed}: truncated or rewritten")
    assert messages[bucket] == [f"[huginn] skipping checkpoint {storage.join(bucket, name_of(8))} ({why})",
                                f"[huginn] resumed from {storage.join(bucket, name_of(4))} at step 4"]
    assert messages[local] == [m.replace(bucket, local) for m in messages[bucket]]
    assert incomplete(storage.join(bucket, name_of(8))) == why


def test_without_a_loadable_checkpoint_the_run_cannot_resume_and_says_which_were_tried(runs):
    _, bucket = runs
    for step in STEPS:
        storage.delete(storage.join(bucket, name_of(step), MARKER), missing_ok=False)
    with pytest.raises(ckpt.CheckpointError) as raised:
        resume(bucket)
    tried = "; ".join(f"{storage.join(bucket, name_of(s))} (no {MARKER}: the save did not finish)" for s in (8, 4))
    assert str(raised.value) == (f"no checkpoint of {bucket} can be resumed from; tried, newest first: {tried}. "
                                 "Move them away (or pick another run_name) to start over")


def test_a_ray_checkpoint_maps_to_its_location(s3, tmp_path):
    from ray.train import Checkpoint

    filesystem, path = storage.filesystem("s3://runs/prefix/run/checkpoint_1")
    assert path == "runs/prefix/run/checkpoint_1"
    assert ckpt.checkpoint_location(Checkpoint(path, filesystem)) == "s3://runs/prefix/run/checkpoint_1"
    assert ckpt.checkpoint_location(Checkpoint(str(tmp_path))) == str(tmp_path)


def test_profiler_traces_and_flight_recorder_dumps_are_published_to_a_bucket_run_directory(s3, request):
    from huginn_ray.train import hang_watch, run_files
    from huginn_ray.train.config import ProfileSection
    from huginn_ray.train.profiling import StepProfiler

    run_dir = f"s3://runs/{request.node.name}/run"
    profiler = StepProfiler(ProfileSection(steps=[1, 1]), run_dir, 0, CPU)
    profiler.before_step(1)
    torch.ones(4).sum()
    written, = profiler.after_step(1)
    assert written == run_files.local_dir(run_dir, "profile") / "rank0.trace.json"
    assert written.parent == Path(__import__("tempfile").gettempdir(), "huginn_run_files", "s3", "runs",
                                  request.node.name, "run", "profile")
    assert storage.read_bytes(f"{run_dir}/profile/rank0.trace.json") == written.read_bytes()

    watch = hang_watch.HangWatch(run_dir, 10.0, 3, store=None, backend="gloo")
    assert watch.dump_file == hang_watch.dump_dir(run_dir) / "rank_3" and watch.dump_file.parent.is_dir()
    assert hang_watch.flight_recorder_env(run_dir)["TORCH_FR_DUMP_TEMP_FILE"] == \
        str(hang_watch.dump_dir(run_dir) / "rank_")
    watch.dump_file.write_bytes(b"a dump")
    watch.publish()
    assert storage.read_bytes(f"{run_dir}/flight_recorder/rank_3") == b"a dump"
    os.unlink(watch.dump_file)

"""hsdp (FSDP2 inside a shard group, the chunk stream between shard groups) trains like replicate (real gloo groups).

Four processes run `huginn_ray.train.loop.train_step` (the training loop's step) on raven-tiny for 20 steps, as 2
nodes x 2 ranks (the local world size Ray Train would report is given to `build_components`; the node ranks Ray
itself assigns are tested in test_train_multinode.py), with rank-dependent data from an in-memory reader. Every hsdp
variant must log the same losses as replicate + chunk_stream (fp32 on CPU: equal up to summation order), with
activation checkpointing on, with ELLISAdam and AdamW (streamed during backward), and compiled; a rank must hold about half the parameter and
optimizer bytes; the replicas of a shard must hold identical shards.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from huginn_ray.train.shard_reader import Rows

STEPS = 20
HSDP = ["parallelism.mode=hsdp"]
NODE_SIZE = 2
"""Ranks per node (Ray Train's local world size): hsdp's shard size."""
VARIANTS = {
    "replicate": ["grad_sync.kind=chunk_stream"],
    "hsdp": HSDP,
    "replicate+adamw": ["optim.name=AdamW"],
    "hsdp+adamw+overlap": [*HSDP, "optim.name=AdamW", "grad_sync.kind=chunk_stream_overlap"],
    "hsdp+compile": [*HSDP, "compile=true"],
    # bf16 autocast on CPU; gathers in fp32, then the blocks' matmul weights gathered in bf16
    "hsdp+autocast": [*HSDP, "precision=bf16-mixed", "parallelism.param_dtype=float32"],
    "hsdp+bf16": [*HSDP, "precision=bf16-mixed", "parallelism.param_dtype=bfloat16"],
    "replicate+quirk": ["schedule.reference_lr_quirk=true"],
    "hsdp+quirk": [*HSDP, "schedule.reference_lr_quirk=true"],
}


class MemoryReader:
    """Stands in for a shard's reader (huginn_ray.train.shard_reader.ShardReader): stream-dependent random rows,
    the same on every run, keyed like a shard's rows."""

    def __init__(self, path, stream, seed, row_length):
        self.path, self.stream, self.seed, self.row_length = path, stream, seed, row_length
        self.seek(0)

    def seek(self, position):
        self.rng = np.random.default_rng(self.seed + self.stream)
        self.position = 0
        if position:
            self.next_rows(position)

    def next_rows(self, count):
        # counting sequences mod 62 from a random start: learnable, so the loss falls
        start = self.rng.integers(0, 62, size=(count, 1))
        keys = self.stream * 2**32 + self.position + np.arange(count, dtype=np.int64)
        self.position += count
        return Rows(2 + (start + np.arange(self.row_length)) % 62, None, keys)


def train_config(extra):
    from huginn_ray.config import load_config
    from huginn_ray.train.config import TrainConfig

    return load_config(TrainConfig, None, [
        "max_steps=20", "block_size=16", "micro_batch_size=2", "model.name=raven-tiny", "optim.lr=3e-3",
        "schedule.warmup_steps=5", "schedule.cooldown_steps=5", "schedule.min_lr=3e-4", "grad_sync.chunk_mib=0.05",
        "data.data_dir=/nonexistent", *extra,
    ])


def plan_for(cfg, grad_accum=1, world_size=None):
    """The run plan of `world_size` ranks (default: the process group's) reading one stream each."""
    from huginn_ray.model import ModelConfig
    from huginn_ray.train.run_plan import RunPlan

    world_size = world_size or (dist.get_world_size() if dist.is_initialized() else 1)
    model_cfg = ModelConfig.from_name("raven-tiny", vocab_size=64, activation_checkpointing=True)
    return RunPlan(global_batch_rows=cfg.micro_batch_size * world_size * grad_accum, num_streams=world_size, data_dir=cfg.data.data_dir,
                   schedule_steps=cfg.max_steps, pad_id=0, eos_id=1,
                   precision="fp32" if cfg.precision == "auto" else cfg.precision,
                   model_config=model_cfg)


def local_bytes(tensors) -> int:
    from huginn_ray.train.parallel import local

    return sum(local(t).numel() * local(t).element_size() for t in tensors if torch.is_tensor(t) and t.ndim > 0)


@contextmanager
def counting_gathers(gathered: dict, model, seen: dict):
    """Bytes FSDP2 all-gathers (its `dist.all_gather_single` calls), by dtype, into `gathered`; the dtype of every
    parameter of the first core block and of the adapter as the core block's first forward sees them (gathered),
    into `seen`."""
    all_gather = dist.all_gather_single

    def counted(output, *args, **kwargs):
        key = str(output.dtype).removeprefix("torch.")
        gathered[key] = gathered.get(key, 0) + output.numel() * output.element_size()
        return all_gather(output, *args, **kwargs)

    def record(module, args):
        if not seen:
            seen.update({name: str(p.dtype).removeprefix("torch.") for name, p in module.named_parameters()})
            seen["adapter.weight"] = str(model.transformer.adapter.weight.dtype).removeprefix("torch.")

    dist.all_gather_single = counted
    handle = model.transformer.core_block[0].register_forward_pre_hook(record)
    try:
        yield
    finally:
        dist.all_gather_single = all_gather
        handle.remove()


def run_variants(rank, world_size, variants):
    from huginn_ray.train import loop
    from huginn_ray.train.parallel import local

    loop.ShardReader = MemoryReader
    report = {}
    for name in variants:
        cfg = train_config(VARIANTS[name])
        plan = plan_for(cfg)
        c = loop.build_components(cfg, plan, rank, torch.device("cpu"), local_world_size=NODE_SIZE)
        losses = []
        t0 = time.perf_counter()
        gathered, seen = {}, {}
        for step in range(1, STEPS + 1):
            if step == 18 and name.endswith("quirk"):  # a resume: state_dict round trip, then the quirk freezes
                c.optimizer.load_state_dict(c.optimizer.state_dict())
                c.resumed = True
            with counting_gathers(gathered, c.model, seen) if step == 1 else nullcontext():
                losses.append(loop.train_step(c, step, cfg, plan, torch.device("cpu")).loss)
        whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in c.model.parameters()]
        flat = torch.cat([p.detach().reshape(-1) for p in whole])
        report[name] = {
            "losses": losses,
            "param_sum": flat.double().sum().item(),
            "param_abs": flat.double().abs().sum().item(),
            "param_bytes": local_bytes(c.model.parameters()),
            "state_bytes": local_bytes(t for s in c.optimizer.state.values() for t in s.values()),
            "local_param_sum": sum(local(p.detach()).double().sum().item() for p in c.model.parameters()),
            "lrs": [g["lr"] for g in c.optimizer.param_groups],
            "gathered": gathered,
            "gathered_dtypes": seen,
            "seconds": time.perf_counter() - t0,
        }
        if name == "hsdp":
            report[name]["replica_check"] = break_a_replica(c, rank)
        if hasattr(c.sync, "remove_hooks"):
            c.sync.remove_hooks()
    return report


def break_a_replica(c, rank) -> str:
    """check_replicas_agree passes after training, then fails on every rank once rank 3 changes its shard of the
    embedding (shard 1, whose replicas are ranks 1 and 3): this rank's message."""
    from huginn_ray.train import parallel

    parallel.check_replicas_agree(c.model, c.optimizer, c.mesh, torch.device("cpu"), "step 20")
    if rank == 3:
        with torch.no_grad():
            parallel.local(c.model.transformer.wte.weight).add_(1.0)
    try:
        parallel.check_replicas_agree(c.model, c.optimizer, c.mesh, torch.device("cpu"), "step 20")
    except RuntimeError as err:
        return str(err)
    return "no error"


def whole_state(c) -> dict:
    """Every parameter and optimizer tensor of a rank's components, gathered whole (DTensors), by name."""
    names = {p: name for name, p in c.model.named_parameters()}
    whole = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()  # noqa: E731
    state = {name: whole(p) for name, p in c.model.named_parameters()}
    for p, values in c.optimizer.state.items():
        for key, value in values.items():
            state[f"{key} of {names[p]}"] = whole(value)
    return state


SAVED_AT, RESUMED_TO = 6, 12
"""The resharding runs: 4 ranks save after step 6; every resume trains steps 7-12."""
RESHARD = [*HSDP, "micro_batch_size=1"]
"""The resharding run: 4 shards, 8 rows a step, micro-batches of 1 row per rank, 2 per step (GA 2)."""


def recording_keys(c) -> list:
    """The row keys of every micro-batch the loop trains on, step by step (wraps the components' reader)."""
    steps, next_step = [], c.reader.next_step

    def next_step_recorded():
        batches = next_step()
        steps.append([batch.keys.tolist() for batch in batches])
        return batches

    c.reader.next_step = next_step_recorded
    return steps


def validate(model, batch, cfg, plan, device, autocast) -> dict:
    """What a validation step logs: every rank's validation_sums all-reduced (the loop carries them in the log
    interval's all-reduce), then validation_metrics."""
    from huginn_ray.train import validation

    sums = validation.validation_sums(model, batch, cfg, plan, device, autocast)
    dist.all_reduce(sums)
    return validation.validation_metrics(cfg, sums.tolist())


def validation_loss(c, cfg, plan, rank) -> float:
    """Validation at depth 1 of one fixed global micro-batch of R rows, each rank validating its rows of it
    (huginn_ray.train.data_order: the ranks' shares differ by a row at most)."""
    from dataclasses import replace

    from huginn_ray.train.shard_reader import collate

    rows = MemoryReader(None, 99, 0, cfg.block_size + 1).next_rows(c.order.rows_per_micro_batch)
    batch = collate(rows[np.array(c.order.rows(rank))], plan.pad_id, plan.eos_id)
    return validate(c.model, batch, replace(cfg, eval_depths=[1], eval_iters=1), plan, torch.device("cpu"),
                    c.autocast)["val_loss"]


def reshard(rank, world_size, directory):
    """Train 2 x 2 hsdp for 6 steps, save, go on to 12; then load that checkpoint as 2 x 2 again, as hsdp with
    one shard group of 4 and as replicate, compare every tensor with the saved one, and train steps 7-12 again."""
    from huginn_ray.train import checkpoint as ckpt
    from huginn_ray.train import loop

    loop.ShardReader = MemoryReader
    cpu = torch.device("cpu")
    cfg = train_config(RESHARD)
    plan = plan_for(cfg, grad_accum=2)
    c = loop.build_components(cfg, plan, rank, cpu, local_world_size=NODE_SIZE)
    keys = recording_keys(c)
    uninterrupted = [loop.train_step(c, step, cfg, plan, cpu).loss for step in range(1, SAVED_AT + 1)]
    saved = whole_state(c)
    validation = validation_loss(c, cfg, plan, rank)
    ckpt.write(directory, rank, c.model, c.optimizer,
               ckpt.TrainerState(step=SAVED_AT, world_size=world_size, num_streams=plan.num_streams,
                                 global_batch_rows=plan.global_batch_rows, rows_per_stream=c.reader.position), cpu)
    # the trained (sharded) model's logits, for the export test: a forward is collective under hsdp
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (2, 12), generator=generator)
    states = torch.randn(2, 12, c.model_cfg.n_embd, generator=generator)
    c.model.eval()
    with torch.no_grad():
        logits = {d: c.model(ids, num_steps=(d, 0), input_states=states).logits for d in (1, 4)}
    c.model.train()
    if rank == 0:
        torch.save({"ids": ids, "states": states, "logits": logits}, directory.parent / "trained_logits.pt")
    uninterrupted += [loop.train_step(c, step, cfg, plan, cpu).loss for step in range(SAVED_AT + 1, RESUMED_TO + 1)]
    report = {"uninterrupted": uninterrupted, "keys": keys, "validation": validation}
    for name, overrides, node_size in (("2 x 2", RESHARD, NODE_SIZE), ("shard 4", RESHARD, 4),
                                       ("replicate", ["parallelism.mode=replicate", "micro_batch_size=1"], NODE_SIZE)):
        cfg = train_config(overrides)
        c = loop.build_components(cfg, plan, rank, cpu, local_world_size=node_size)
        c.resumed = resume(c, directory, plan, rank)
        loaded = whole_state(c)
        report[name] = {
            "layout": c.shape.shard_size,
            "keys_equal": sorted(loaded) == sorted(saved),
            "differing": [key for key in saved if not torch.equal(saved[key], loaded.get(key))],
            "losses": [loop.train_step(c, step, cfg, plan, cpu).loss for step in range(SAVED_AT + 1, RESUMED_TO + 1)],
        }
    return report


def resume(c, directory, plan, rank) -> bool:
    """What the loop does with a checkpoint: load model and optimizer, check the data order, seek the reader."""
    from huginn_ray.train import checkpoint as ckpt

    resumed = ckpt.resume(directory, directory.parent, rank, c.model, c.optimizer, torch.device("cpu"),
                          log=lambda message: None)
    ckpt.check_data_position(resumed.state, directory, plan.num_streams, plan.global_batch_rows)
    c.reader.seek(resumed.state.rows_per_stream)
    return True


RESUMES = {
    2: (("micro-batch x 2", [*HSDP, "micro_batch_size=2"]), ("one micro-batch a step", [*HSDP, "micro_batch_size=4"])),
    3: (("hsdp, rows 1, 1, 2", [*HSDP, "micro_batch_size=1"]),
        ("replicate, rows 1, 1, 2", ["parallelism.mode=replicate", "grad_sync.kind=chunk_stream", "micro_batch_size=2"])),
}
"""The resumes of the 4-rank checkpoint of `reshard`, by worker count: (name, overrides). 2 ranks of 2 rows (the
same accumulation), and of 4 rows (one micro-batch a step); 3 ranks of 1, 1 and 2 rows (the same accumulation):
with micro_batch_size 1 a rank's micro-batch exceeds it (no accumulation gives at most 1 row to each of 3 ranks),
with 2 it does not."""


def resume_elsewhere(rank, world_size, directory):
    """The 4-rank checkpoint of `reshard` resumed by `world_size` ranks (one node: hsdp has one shard group of
    them), in each data order of RESUMES[world_size]: steps 7-12, their losses and row keys."""
    from huginn_ray.train import loop

    loop.ShardReader = MemoryReader
    cpu = torch.device("cpu")
    plan = plan_for(train_config(RESHARD), grad_accum=2, world_size=4)  # the run's data order: 4 shards, 8 rows a step
    report = {}
    for name, overrides in RESUMES[world_size]:
        cfg = train_config(overrides)
        c = loop.build_components(cfg, plan, rank, cpu)
        resume(c, directory, plan, rank)
        keys = recording_keys(c)
        report[name] = {"grad_accum": c.order.grad_accum, "layout": c.shape.shard_size, "keys": keys,
                        "validation": validation_loss(c, cfg, plan, rank),
                        "losses": [loop.train_step(c, step, cfg, plan, cpu).loss
                                   for step in range(SAVED_AT + 1, RESUMED_TO + 1)]}
    return report


def _run(rank, world_size, port, out_dir, variants):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    try:
        if variants in ("reshard", "resume"):
            task = reshard if variants == "reshard" else resume_elsewhere
            result = task(rank, world_size, Path(out_dir) / "checkpoint")
        else:
            result = run_variants(rank, world_size, variants)
    except Exception as err:
        result = {"error": type(err).__name__, "trace": traceback.format_exc()}
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


def spawn(tmp_path, variants, world_size=4):
    """Run `variants` (a list of VARIANTS names, "reshard" or "resume") on `world_size` gloo ranks; every rank's
    report."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_run, args=(world_size, port, str(tmp_path), variants), nprocs=world_size,
                       start_method="spawn", join=True)
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world_size)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    reports = spawn(tmp_path_factory.mktemp("sharding"), list(VARIANTS))
    for rank, report in enumerate(reports):
        assert "error" not in report, f"rank {rank}: {report.get('trace')}"
    return reports


def assert_close_losses(got, expected, label):
    assert len(got) == len(expected) == STEPS
    for step, (a, b) in enumerate(zip(got, expected), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"{label}: step {step} loss {a} vs unsharded {b}"


@pytest.mark.parametrize("variant", ["hsdp", "hsdp+adamw+overlap", "hsdp+compile"])
def test_hsdp_logs_the_losses_of_replicate(results, variant):
    reference = results[0]["replicate+adamw" if "adamw" in variant else "replicate"]
    assert reference["losses"][-1] < reference["losses"][0] - 0.5  # it trains
    for rank, report in enumerate(results):
        assert_close_losses(report[variant]["losses"], reference["losses"], f"rank {rank} {variant}")
        # the whole model, gathered from the shards, is the replicated run's
        assert report[variant]["param_abs"] == pytest.approx(reference["param_abs"], rel=1e-5)
        assert report[variant]["param_sum"] == results[0][variant]["param_sum"]


def test_bf16_gathers_train_like_fp32_gathers_with_norms_qk_bias_and_adapter_in_fp32(results):
    """param_dtype bfloat16 against float32 gathers, both under bf16 autocast on CPU: the losses of 20 steps within
    5e-3 relative (autocast casts fp32-gathered weights to the very bf16 values, and their gradients come back
    through the cast in bf16 as well, so only the order of the fp32 sums may differ); the bytes FSDP2 gathered in step 1 are the memory plan's, at most 0.6 x those of fp32 gathers;
    inside the gathered core block the matmul weights are bf16, the norm weights, qk_bias and the adapter fp32."""
    from huginn_ray.train.memory import plan_memory

    reference = results[0]["hsdp+autocast"]["losses"]
    assert reference[-1] < reference[0] - 0.5  # it trains
    for rank, report in enumerate(results):
        bf16, fp32 = report["hsdp+bf16"], report["hsdp+autocast"]
        for step, (a, b) in enumerate(zip(bf16["losses"], fp32["losses"]), start=1):
            assert abs(a - b) <= 5e-3 * abs(b), f"rank {rank} step {step}: loss {a} with bf16 gathers, {b} fp32"
        assert bf16["gathered_dtypes"] == {
            "norm_1.weight": "float32", "attn.qk_bias": "float32", "attn.Wqkv.weight": "bfloat16",
            "attn.proj.weight": "bfloat16", "norm_2.weight": "float32", "norm_3.weight": "float32",
            "mlp.fc.weight": "bfloat16", "mlp.proj.weight": "bfloat16", "norm_4.weight": "float32",
            "adapter.weight": "float32"}
        assert set(fp32["gathered_dtypes"].values()) == {"float32"}
        for variant in ("hsdp+bf16", "hsdp+autocast"):  # one micro-batch a step: the plan's bytes per micro-batch
            plan = plan_memory(train_config([*VARIANTS[variant], "scaling.num_workers=2",
                                             "model.overrides.vocab_size=64"]))
            assert report[variant]["gathered"] == plan.gathered, variant
        assert sum(bf16["gathered"].values()) <= 0.6 * sum(fp32["gathered"].values())


def test_each_rank_of_a_shard_group_holds_about_half_the_parameters_and_optimizer_state(results):
    for key in ("param_bytes", "state_bytes"):
        whole = results[0]["replicate"][key]
        shards = [report["hsdp"][key] for report in results]
        assert shards[0] == shards[2] and shards[1] == shards[3], (key, shards)  # replicas hold equal shards
        assert shards[0] + shards[1] >= whole  # FSDP pads dim 0 of uneven tensors: at least the whole
        for shard in shards:
            assert abs(shard - whole / 2) <= 0.1 * whole / 2, (key, shards, whole)


def test_the_replicas_of_a_shard_hold_the_same_values_after_training(results):
    sums = [report["hsdp"]["local_param_sum"] for report in results]
    assert sums[0] == sums[2] and sums[1] == sums[3] and sums[0] != sums[1]


def test_a_replica_that_differs_stops_every_rank_and_its_replicas_name_it(results):
    messages = [report["hsdp"]["replica_check"] for report in results]
    other = "step 20: the replicas of another shard disagree (their ranks name them)"
    named = ("step 20: the replicas disagree: rank(s) [3] differ from rank 1 (first differing tensor: "
             "transformer.wte.weight); replicas of a shard must be identical")
    assert messages == [other, named, other, named]


@pytest.mark.parametrize("variant", ["replicate+quirk", "hsdp+quirk"])
def test_reference_lr_quirk_in_both_modes(results, variant):
    lrs = results[1][variant]["lrs"]
    # weights group at the constructor lr; the others frozen at the lr loaded at the "resume" (step 17's, in the cooldown)
    assert lrs[0] == 3e-3
    assert all(lr < 3e-3 for lr in lrs[1:])
    assert_close_losses(results[0]["hsdp+quirk"]["losses"], results[0]["replicate+quirk"]["losses"], variant)
    assert results[0]["replicate+quirk"]["losses"] != results[0]["replicate"]["losses"]


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """The resharding run: every rank's report, and the directory with its checkpoint and the trained logits."""
    directory = tmp_path_factory.mktemp("reshard")
    return spawn(directory, "reshard"), directory


def global_keys(reports, step_reports_key, name=None) -> list:
    """Per step, per micro-batch: every rank's row keys in rank order (the global micro-batch)."""
    per_rank = [report[name]["keys"] if name else report[step_reports_key] for report in reports]
    return [[sum((rank[step][micro] for rank in per_rank), []) for micro in range(len(per_rank[0][step]))]
            for step in range(len(per_rank[0]))]


def test_a_4_rank_run_resumes_on_2_and_3_ranks_with_the_same_rows_and_losses(resharded):
    """Issues 18 and 27: stopped at step 6 by 4 ranks (1 row each per micro-batch, 2 micro-batches a step), resumed
    by 2 ranks with micro-batches twice as large and by 3 ranks taking 1, 1 and 2 rows of each micro-batch, under
    hsdp and replicate: steps 7-12 train on the same rows, micro-batch by micro-batch, and log the uninterrupted
    run's losses (fp32: up to summation order); with one micro-batch a step instead, every step consumes the same
    rows."""
    reports, directory = resharded
    uninterrupted = global_keys(reports, "keys")
    assert len(uninterrupted) == RESUMED_TO and all([len(micro) for micro in step] == [4, 4] for step in uninterrupted)
    resumes = {world_size: spawn(directory, "resume", world_size=world_size) for world_size in (2, 3)}
    for world_size, resumed in resumes.items():
        for rank, report in enumerate(resumed):
            assert "error" not in report, f"{world_size} ranks, rank {rank}: {report.get('trace')}"
        same_grouping = ["micro-batch x 2"] if world_size == 2 else [name for name, _ in RESUMES[3]]
        for name in same_grouping:
            assert resumed[0][name]["grad_accum"] == 2, name
            assert global_keys(resumed, None, name) == uninterrupted[SAVED_AT:], name
            rows = [[len(report[name]["keys"][0][micro]) for report in resumed] for micro in range(2)]
            assert rows == ([[2, 2]] * 2 if world_size == 2 else [[1, 1, 2]] * 2), (name, rows)
            # the same 4 validation rows, split 1, 1, 1, 1 at the save and 2, 2 or 1, 1, 2 here: their mean
            for rank, report in enumerate(resumed):
                assert report[name]["validation"] == pytest.approx(reports[0]["validation"], rel=1e-6), (name, rank)
            for rank, report in enumerate(resumed):
                got, expected = report[name]["losses"], reports[0]["uninterrupted"][SAVED_AT:]
                for step, (a, b) in enumerate(zip(got, expected), start=SAVED_AT + 1):
                    assert abs(a - b) <= 1e-5 * abs(b), f"{name}, rank {rank}: step {step} loss {a} vs 4 ranks {b}"
    one_micro_batch = global_keys(resumes[2], None, "one micro-batch a step")
    assert resumes[2][0]["one micro-batch a step"]["grad_accum"] == 1
    assert [sorted(step[0]) for step in one_micro_batch] == [sorted(sum(step, [])) for step in uninterrupted[SAVED_AT:]]
    assert len(resumes[2][0]["one micro-batch a step"]["losses"]) == RESUMED_TO - SAVED_AT


def test_an_hsdp_checkpoint_resumes_bitwise_in_its_layout_and_exactly_under_another_shard_size_and_replicate(resharded):
    reports, tmp_path = resharded
    for rank, report in enumerate(reports):
        assert "error" not in report, f"rank {rank}: {report.get('trace')}"
        # the same layout resumes exactly: bitwise the losses of the run that went on
        assert report["2 x 2"]["differing"] == [] and report["2 x 2"]["losses"] == report["uninterrupted"][SAVED_AT:]
        for name, layout in (("shard 4", 4), ("replicate", 1)):
            assert report[name]["layout"] == layout
            assert report[name]["keys_equal"] and report[name]["differing"] == [], (name, report[name]["differing"])
            got, expected = report[name]["losses"], report["uninterrupted"][SAVED_AT:]
            for step, (a, b) in enumerate(zip(got, expected), start=SAVED_AT + 1):
                assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} {name}: step {step} loss {a} vs {b}"
    # every rank wrote its own shards of the 2 x 2 checkpoint
    written = sorted(p.name for p in (tmp_path / "checkpoint" / "state").glob("*.distcp"))
    assert written == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"], written


def test_memory_plan_gives_each_rank_s_shard_of_parameters_and_optimizer_state(results):
    from huginn_ray.train.memory import plan_memory

    # CPU workers: the plan takes every worker as one node, so 2 workers plan the 2-rank shard groups measured
    plan = plan_memory(train_config([*HSDP, "scaling.num_workers=2", "model.overrides.vocab_size=64"]))
    measured = max(report["hsdp"]["state_bytes"] for report in results)
    planned = {name: b for name, b, _ in plan.rows}["optimizer state (ELLISAdam: 2 fp32 moments)"]
    assert abs(planned - measured) <= 0.10 * measured, (planned, measured)  # padding of dim 0 and step counters
    replicate = plan_memory(train_config(["scaling.num_workers=2", "model.overrides.vocab_size=64"]))
    assert {name: b for name, b, _ in replicate.rows}["optimizer state (ELLISAdam: 2 fp32 moments)"] > 1.8 * planned


def test_export_straight_from_an_hsdp_checkpoint_gives_the_trained_model_s_logits(resharded, tmp_path):
    """The 2 x 2 checkpoint of the resharding run, exported by one process, against the sharded model's logits."""
    from transformers import AutoModelForCausalLM

    from huginn_ray.model import export

    run = resharded[1]
    out = tmp_path / "hf"
    assert export.main(["--checkpoint", str(run / "checkpoint"), "--out", str(out)]) == 0
    assert not list(out.glob("*.distcp")) and (out / "model.safetensors").is_file()  # weights only, one file set
    trained = torch.load(run / "trained_logits.pt")
    model = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    with torch.no_grad():
        for depth, expected in trained["logits"].items():
            got = model(trained["ids"], num_steps=depth, input_states=trained["states"]).logits
            error = float((got - expected).norm() / expected.norm())
            assert error < 1e-6, (depth, error)

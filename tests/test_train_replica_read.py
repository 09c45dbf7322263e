"""Startup without the whole model on any rank, and reads the file system serves once (issue 27, items 2 and 3).

Four gloo processes, as 2 nodes x 2 ranks (hsdp: 2 shard groups of 2, so R = 2 replicas of each shard), build
a model (raven-tiny, 256 wide, so that tensor bytes outweigh the per-piece archive headers) the way the training
loop does, train one step, save, and then read the checkpoint back, and the same model as an `init_from`
directory (safetensors, and the training checkpoint), both ways: every rank reading its whole part (the path
without replicas) and through the replica-spread path (1/R of the rows each, then an all-gather over the
replicate dimension). Also under `replicate` (R = 4). Counted per rank: the largest amount of model memory live
at once during startup (a TorchDispatchMode following every storage the ops create), and the bytes each read
path takes from the file system (huginn_ray.train.replica_read.counting_reads).
"""

from __future__ import annotations

import json
import os
import socket
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from test_train_parallel import MemoryReader

NODE_SIZE = 2
WIDTH = ["model.overrides.n_embd=256", "model.overrides.intermediate_size=1024"]


def train_config(extra):
    from huginn_ray.config import load_config
    from huginn_ray.train.config import TrainConfig

    return load_config(TrainConfig, None, [
        "max_steps=4", "block_size=16", "micro_batch_size=2", "model.name=raven-tiny", "optim.lr=3e-3",
        "schedule.warmup_steps=1", "schedule.cooldown_steps=1", "data.data_dir=/nonexistent", *extra])


def plan_for(cfg, world_size):
    from huginn_ray.model import ModelConfig
    from huginn_ray.train.run_plan import RunPlan

    model_cfg = ModelConfig.from_name("raven-tiny", vocab_size=64, n_embd=256, intermediate_size=1024)
    return RunPlan(global_batch_rows=cfg.micro_batch_size * world_size, num_streams=world_size, data_dir=cfg.data.data_dir,
                   schedule_steps=cfg.max_steps, pad_id=0, eos_id=1, precision="fp32",
                   model_config=model_cfg)


class LiveModelBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The bytes of every storage the dispatched ops create and that is still referenced, and their peak: it
    holds each storage it saw and counts it as freed once only its own reference is left."""

    def __init__(self):
        super().__init__()
        self.storages, self.peak, self.counting = {}, 0, True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counting:
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    local = t.to_local() if hasattr(t, "to_local") else t
                    if not local.is_meta:
                        storage = local.untyped_storage()
                        self.storages.setdefault(storage.data_ptr(), storage)
            self.peak = max(self.peak, self.live())
        return out

    def live(self) -> int:
        self.storages = {ptr: s for ptr, s in self.storages.items() if torch._C._storage_Use_Count(s._cdata) > 1}
        return sum(s.nbytes() for s in self.storages.values())


def build(cfg, plan, rank, initialise=True):
    """build_components, with the most memory its ops hold at once until the model is built (the gradient
    exchange's buffers and the optimizer state come next)."""
    from huginn_ray.train import loop, parallelize

    tracker = LiveModelBytes()
    builders = {name: getattr(parallelize, name) for name in ("build_grad_sync", "build_hsdp_grad_sync")}

    def stop_counting(builder):
        def build_exchange(*args, **kwargs):
            tracker.counting = False
            return builder(*args, **kwargs)
        return build_exchange

    for name, builder in builders.items():  # replicate's exchange, hsdp's
        setattr(parallelize, name, stop_counting(builder))
    try:
        with tracker:
            c = loop.build_components(cfg, plan, rank, torch.device("cpu"), local_world_size=NODE_SIZE,
                                      initialise=initialise)
    finally:
        for name, builder in builders.items():
            setattr(parallelize, name, builder)
    return c, tracker.peak


def local_state(c) -> dict:
    """This rank's part of every model and optimizer tensor, by name (clones)."""
    from huginn_ray.train.parallel import local

    names = {p: name for name, p in c.model.named_parameters()}
    state = {name: local(p.detach()).clone() for name, p in c.model.named_parameters()}
    for p, values in c.optimizer.state.items():
        state.update({f"{key} of {names[p]}": local(v).clone() for key, v in values.items() if torch.is_tensor(v)})
    return state


def differing(a: dict, b: dict) -> list[str]:
    return sorted(set(a) ^ set(b)) + [key for key in a if key in b and not torch.equal(a[key], b[key])]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def hf_rows(directory, key, model):
    """This rank's rows of `key` read straight from a safetensors directory (the whole file)."""
    from safetensors.torch import load_file

    from huginn_ray.train.replica_read import local_rows

    rows = local_rows(dict(model.named_parameters())[key])[1]
    return load_file(directory / "model.safetensors")[key][rows or slice(None)]


def run(rank, world_size, directory):
    from huginn_ray.model import RecurrentGPT
    from huginn_ray.model.pretrained import save_pretrained
    from huginn_ray.train.init_from import load_weights_into
    from huginn_ray.train.replica_read import counting_reads
    from huginn_ray.train import checkpoint as ckpt
    from huginn_ray.train import loop

    loop.ShardReader = MemoryReader
    cpu = torch.device("cpu")
    report = {}
    for mode in ("hsdp", "replicate"):
        cfg = train_config([f"parallelism.mode={mode}", *WIDTH])
        plan = plan_for(cfg, world_size)
        c, peak = build(cfg, plan, rank)
        # the whole-model init, drawn by a CPU construction from the same seed: this rank's rows of it
        torch.manual_seed(cfg.seed)
        whole = RecurrentGPT(c.model_cfg).state_dict()
        from huginn_ray.train.replica_read import local_rows

        init_differs = [name for name, p in c.model.named_parameters()
                        if not torch.equal(local_rows(p)[0], whole[name][local_rows(p)[1] or slice(None)])]
        shards = nbytes(local_rows(p)[0] for p in c.model.parameters())
        t = c.model.transformer
        units = [*t.prelude, *t.coda, t.core_block]
        unit_bytes = [nbytes(p for p in u.parameters()) for u in units]
        unit_bytes.append(nbytes(whole[name] for name, _ in c.model.named_parameters()) - sum(unit_bytes))  # the root
        loop.train_step(c, 1, cfg, plan, cpu)
        saved = local_state(c)
        run_dir = directory / mode
        ckpt.write(run_dir / "checkpoint", rank, c.model, c.optimizer, ckpt.TrainerState(step=1), cpu)
        if rank == 0 and mode == "hsdp":
            save_pretrained(RecurrentGPT(c.model_cfg), run_dir / "hf")  # another draw: the init_from weights
        dist.barrier()
        reads, loaded = {}, {}
        for name, replicas in (("whole part", None), ("spread", c.mesh.get_group("replicate"))):
            resumed, _ = build(cfg, plan, rank, initialise=False)
            with counting_reads() as count:
                ckpt.read_tensors(run_dir / "checkpoint", resumed.model, resumed.optimizer, replicas)
            reads[f"resume, {name}"] = count.bytes
            loaded[f"resume, {name}"] = local_state(resumed)
            for source in ("hf", "checkpoint/model") if mode == "hsdp" else ():
                fresh, _ = build(cfg, plan, rank, initialise=False)
                with counting_reads() as count:
                    load_weights_into(fresh.model, run_dir / source, replicas)
                reads[f"init_from {source}, {name}"] = count.bytes
                loaded[f"init_from {source}, {name}"] = local_state(fresh)
        model_keys = [name for name, _ in c.model.named_parameters()]
        report[mode] = {
            "peak": peak, "shards": shards, "units": unit_bytes, "init_differs": init_differs, "reads": reads,
            # today's path (every rank reading its whole part) loads what was saved; the spread path, bitwise it
            "resume differs from saved": differing(loaded["resume, whole part"], saved),
            "spread differs": {what: differing(loaded[f"{what}, spread"], loaded[f"{what}, whole part"])
                               for what in ("resume", "init_from hf", "init_from checkpoint/model")
                               if f"{what}, spread" in loaded},
        }
        if mode == "hsdp":
            report[mode]["init_from differs"] = {
                "checkpoint": [k for k in model_keys if not torch.equal(
                    loaded["init_from checkpoint/model, whole part"][k], saved[k])],
                "hf": [k for k in model_keys if not torch.equal(
                    loaded["init_from hf, whole part"][k], hf_rows(run_dir / "hf", k, c.model))]}
    return report


def _run(rank, world_size, port, directory):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    try:
        result = run(rank, world_size, Path(directory))
    except Exception as err:
        result = {"error": type(err).__name__, "trace": traceback.format_exc()}
    with open(os.path.join(directory, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("replica_read")


@pytest.fixture(scope="module")
def reports(checkpoints):
    directory = checkpoints
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_run, args=(4, port, str(directory)), nprocs=4, start_method="spawn", join=True)
    results = [json.loads((directory / f"{r}.json").read_text()) for r in range(4)]
    for rank, report in enumerate(results):
        assert "error" not in report, f"rank {rank}: {report.get('trace')}"
    return results


def state_bytes(checkpoint: Path) -> int:
    """The bytes of every tensor a checkpoint holds (model and optimizer), from its DCP metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(checkpoint / "state").read_metadata().state_dict_metadata
    return sum(md.size.numel() * md.properties.dtype.itemsize for md in metadata.values()
               if isinstance(md, TensorStorageMetadata))


def test_under_hsdp_no_rank_holds_more_than_its_shard_plus_one_unit_at_startup_and_the_init_is_the_whole_model_s(
        reports):
    for rank, report in enumerate(reports):
        hsdp = report["hsdp"]
        whole = sum(hsdp["units"])
        assert hsdp["shards"] < 0.51 * whole  # FSDP pads dim 0: a little over half
        assert hsdp["peak"] <= hsdp["shards"] + max(hsdp["units"]) < whole, (rank, hsdp["peak"], hsdp["shards"])
        # bitwise this rank's rows of the whole-model init, on both layouts (the losses of hsdp = replicate:
        # test_train_parallel.py)
        assert hsdp["init_differs"] == [] and report["replicate"]["init_differs"] == [], rank


def test_resume_and_init_from_read_a_quarter_of_the_state_per_rank_and_load_the_same_bits(reports, checkpoints):
    state = state_bytes(checkpoints / "hsdp" / "checkpoint")
    assert state == state_bytes(checkpoints / "replicate" / "checkpoint")
    model = sum(reports[0]["hsdp"]["units"])
    for mode, shard_size in (("hsdp", NODE_SIZE), ("replicate", 1)):
        spread = [report[mode]["reads"]["resume, spread"] for report in reports]
        for rank, report in enumerate(reports):
            got, reads = report[mode], report[mode]["reads"]
            assert got["resume differs from saved"] == [], (rank, mode)
            assert all(keys == [] for keys in got["spread differs"].values()), (rank, mode, got["spread differs"])
            assert len(got["spread differs"]) == (3 if mode == "hsdp" else 1)
            # the path without replicas: every rank reads its whole part (1/S of the state)
            assert reads["resume, whole part"] >= state / shard_size, (rank, mode, reads)
            # spread over the replicas: 1/W each (the rows, plus each stored piece's archive header)
            assert 0.95 * state / 4 <= reads["resume, spread"] <= 1.1 * state / 4, (rank, mode, reads, state)
            if mode == "replicate":
                continue
            assert got["init_from differs"] == {"checkpoint": [], "hf": []}, rank
            for source in ("hf", "checkpoint/model"):
                assert reads[f"init_from {source}, whole part"] >= model / shard_size, (rank, mode, reads)
                assert 0.95 * model / 4 <= reads[f"init_from {source}, spread"] <= 1.1 * model / 4, (rank, reads)
        assert sum(spread) <= 1.1 * state  # the file system serves the state once


def test_the_replicas_of_the_frontier_layout_each_read_a_512th_of_its_shard_groups_part():
    """How huginn_ray.train.replica_read.deal divides the reading among R = 512 replicas (4,096 ranks in shard
    groups of 8, configs/train/frontier_nebel_512_nodes.yaml), on the shapes of the nebel's parts: every byte of a
    part is read by exactly one replica, and no replica reads more than 1.05 x its 1/R, for the parameters
    (init_from) and for the state (resume: the parameters, Adam's moments and steps, the RoPE buffer of shape
    (1, 4096, 1, 48, 2), which is cut along its second dim). Arithmetic only: no process group."""
    import math

    from huginn_ray.config import load_config
    from huginn_ray.model import RecurrentGPT
    from huginn_ray.train.replica_read import deal, portion, split_dim
    from huginn_ray.train.config import TrainConfig
    from huginn_ray.train.init_from import model_config

    class Replica:  # the group's rank and size: all that portion() asks of a process group
        def __init__(self, rank, size):
            self._rank, self._size = rank, size

        def rank(self):
            return self._rank

        def size(self):
            return self._size

    cfg = load_config(TrainConfig, Path(__file__).resolve().parents[1] / "configs/train/frontier_nebel_512_nodes.yaml",
                      ["compile=false"])
    with torch.device("meta"):
        model = RecurrentGPT(model_config(cfg))
        params = [torch.empty((math.ceil(p.shape[0] / 8), *p.shape[1:])) for p in model.parameters()]  # FSDP2's
        state = [*params, model.freqs_cis] + [t for p in params for t in (torch.empty(()), p, p)]
    replicas = 512
    for name, parts in (("parameters", params), ("state", state)):
        reads = [0] * replicas
        for part, share in zip(parts, deal(parts, replicas)):
            dim, pieces = split_dim(part), []
            for rank in range(replicas):
                index = portion(part, share, Replica(rank, replicas))
                if index is not None:
                    pieces.append(index[dim] if index else slice(0, 1))  # a 0-dim part: its one element
                    reads[rank] += part[index].numel() * part.element_size()
                    assert all(s == slice(0, n) for d, (s, n) in enumerate(zip(index, part.shape)) if d != dim)
            # the pieces tile the part's rows: each row read once
            pieces.sort(key=lambda s: s.start)
            assert [s.start for s in pieces] == [0] + [s.stop for s in pieces[:-1]], (name, part.shape, share)
            assert pieces[-1].stop == (part.shape[dim] if part.dim() else 1), (name, part.shape, share)
        total = sum(part.numel() * part.element_size() for part in parts)
        assert sum(reads) == total and max(reads) <= 1.05 * total / replicas, (name, max(reads) * replicas / total)

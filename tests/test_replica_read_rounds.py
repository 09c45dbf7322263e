"""The replica-spread read of a DCP checkpoint (huginn_ray.train.replica_read.read_dcp) on 4 gloo ranks, with
rounds of a few dozen bytes so that the spans of the replicas, the rounds and the stored pieces all cut each other:
it loads bitwise what DCP's own load loads, in the save's layout and across layouts (saved as 2 shard groups of 2,
read with every rank holding whole tensors, R = 4; and back), non-tensor values included; a piece missing from the
`.metadata` or a damaged file fails every rank with the same error, the ranks that met it naming the key or the
file, the others how many failed (an OSError for a file that cannot be read, so that all retry together; a
ValueError for a missing piece or one that is not a torch.save archive)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROUND_BYTES = 48
"""A round gathers about this many bytes: the state below takes dozens of rounds."""


def state(layout: str, mesh, seed: int) -> dict:
    """A model-and-optimizer-like state: a fp32 matrix whose 37 rows do not split evenly, a bf16 vector, a 0-dim
    step, a buffer of shape (1, 6, 2), and non-tensor values. `hsdp`: the tensors of dim >= 1 sharded on dim 0
    over the mesh's shard dimension and replicated over its replicate dimension; `replicate`: whole on every rank."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    generator = torch.Generator().manual_seed(seed)
    tensors = {"weight": torch.randn(37, 5, generator=generator),
               "bias": torch.randn(3, generator=generator).to(torch.bfloat16),
               "step": torch.tensor(float(seed)),
               "rope": torch.randn(1, 6, 2, generator=generator)}
    if layout == "hsdp":
        tensors = {key: distribute_tensor(value, mesh, [Replicate(), Shard(0)]) if value.dim() else value
                   for key, value in tensors.items()}
    return {"model": tensors, "optim": {"lr": 0.1 * seed, "betas": (0.9, 0.95 + seed), "name": f"adam {seed}"}}


def local(state_dict: dict) -> dict:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state_dict)
    return {key: (value.to_local() if hasattr(value, "to_local") else value) for key, value in flat.items()}


def same(a: dict, b: dict) -> list[str]:
    """The keys whose values differ (tensors: torch.equal, including dtype)."""
    differ = sorted(set(a) ^ set(b))
    for key in a.keys() & b.keys():
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                differ.append(key)
        elif x != y:
            differ.append(key)
    return differ


def run(rank: int, directory: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from huginn_ray.train.replica_read import read_dcp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    groups = {"hsdp": mesh.get_group("replicate"), "replicate": dist.group.WORLD}
    report = {}
    for saved_as, seed in (("hsdp", 1), ("replicate", 2)):
        path = directory / saved_as
        dcp.save(state(saved_as, mesh, seed), checkpoint_id=path)
        for read_as in ("hsdp", "replicate"):
            expected = state(read_as, mesh, 0)  # other values: every one is overwritten
            dcp.load(expected, checkpoint_id=path)
            got = state(read_as, mesh, 0)
            read_dcp(path, got, groups[read_as], round_bytes=ROUND_BYTES)
            report[f"{saved_as} read as {read_as}"] = same(local(got), local(expected))
            report[f"{saved_as} read as {read_as}, loaded the saved values"] = \
                local(expected)["optim.lr"] == 0.1 * seed
    # the piece of the matrix's first rows (shard 0: ranks 0 and 2) missing from the .metadata; its file cut inside
    # the piece; its file deleted
    dcp.save(state("hsdp", mesh, 3), checkpoint_id=directory / "saved")
    dist.barrier()
    metadata = dcp.FileSystemReader(directory / "saved").read_metadata()
    piece = next(index for index in metadata.storage_data if index.fqn == "model.weight" and index.offset[0] == 0)
    info = metadata.storage_data[piece]
    if rank == 0:
        for name in ("lacking", "truncated", "deleted"):
            shutil.copytree(directory / "saved", directory / name)
        metadata.storage_data = {index: value for index, value in metadata.storage_data.items() if index != piece}
        with open(directory / "lacking" / ".metadata", "wb") as f:
            pickle.dump(metadata, f)
        with open(directory / "truncated" / info.relative_path, "r+b") as f:
            f.truncate(info.offset + 10)
        (directory / "deleted" / info.relative_path).unlink()
    dist.barrier()
    for name in ("lacking", "truncated", "deleted"):
        try:
            read_dcp(directory / name, state("hsdp", mesh, 0), groups["hsdp"], round_bytes=ROUND_BYTES)
            report[name] = None
        except (OSError, ValueError) as err:
            report[name] = ["OSError" if isinstance(err, OSError) else type(err).__name__, str(err)]
    report["file"] = info.relative_path
    return report


def _run(rank: int, port: int, directory: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        result = run(rank, Path(directory))
    except Exception as err:
        result = {"error": type(err).__name__, "trace": traceback.format_exc()}
    with open(os.path.join(directory, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


def test_the_replica_spread_read_loads_what_dcp_loads_in_any_layout_and_fails_every_rank_alike(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_run, args=(port, str(tmp_path)), nprocs=4, start_method="spawn", join=True)
    reports = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(4)]
    for rank, report in enumerate(reports):
        assert "error" not in report, f"rank {rank}: {report.get('trace')}"
    for rank, report in enumerate(reports):
        for saved_as in ("hsdp", "replicate"):
            for read_as in ("hsdp", "replicate"):
                assert report[f"{saved_as} read as {read_as}"] == [], (rank, saved_as, read_as, report)
                assert report[f"{saved_as} read as {read_as}, loaded the saved values"], (rank, saved_as, read_as)
    # any failure fails every rank with one kind of error: the ranks that met it name the file (the missing piece
    # holds shard 0's rows: ranks 0 and 2), the others say how many ranks failed
    file = reports[0]["file"]
    for name, kind, naming in (("lacking", "ValueError", "model.weight at [0, 0] is missing"),
                               ("truncated", "ValueError", f"truncated/{file}"),
                               ("deleted", "OSError", f"deleted/{file}")):
        errors = [report[name] for report in reports]
        assert all(error is not None and error[0] == kind for error in errors), (name, errors)
        named = [rank for rank, (_, message) in enumerate(errors) if naming in message]
        assert named == [0, 2] if name == "lacking" else named, (name, errors)
        assert all(naming in message or "other rank(s) could not read their bytes" in message
                   for _, message in errors), (name, errors)

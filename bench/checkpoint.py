"""Checkpoint save and load per rank: seconds and bytes, replicate vs hsdp, synchronous vs asynchronous.

    python bench/checkpoint.py --world 4 --shard-size 2 --model raven-small --width 512

Spawns `--world` gloo processes, builds the same model on each (whole under replicate; FSDP2-sharded over shard
groups of `--shard-size` under hsdp) with the training loop's optimizer, takes one optimizer step so that the
state exists, then every rank saves its part with `huginn_ray.train.checkpoint.start_save` / `finish_save` into
its own directory (what it hands to Ray Train) and loads it back with `checkpoint.read_tensors` from the merged
directory (what Ray Train gives back on resume). Reported per rank, median over `--repeats`:
- held s: how long the training loop waits for the save (synchronous: the whole save; asynchronous: DCP's copy
  of the state to host memory, after which training goes on);
- save s: from the start of the save until it is complete on every rank (the marker written);
- written MiB: bytes of the files this rank wrote (replicated tensors are written once, spread over the ranks);
- load s, loaded MiB: the load, and the bytes of the tensors this rank holds, which is what DCP reads for it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from huginn_ray.model import ModelConfig, RecurrentGPT
from huginn_ray.train import checkpoint as ckpt
from huginn_ray.train import parallel
from huginn_ray.train.config import OptimConfig, ParallelismSection
from huginn_ray.train.optim import build_optimizer

CPU = torch.device("cpu")
MODES = (("replicate", False), ("replicate", True), ("hsdp", False), ("hsdp", True))


def held_bytes(model, optimizer) -> int:
    """Bytes of the tensors this rank holds (its shards under hsdp): what a load reads for it."""
    tensors = [*model.parameters(), *(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))]
    return sum(parallel.local(t).numel() * parallel.local(t).element_size() for t in tensors)


def worker(rank: int, args, port: int, root: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world,
                            timeout=timedelta(minutes=10))
    background = dist.new_group(backend="gloo")
    cfg = ModelConfig.from_name(args.model, n_embd=args.width, intermediate_size=args.width * 8 // 3 // 64 * 64,
                                num_attention_heads=max(1, args.width // 64))
    results = {}
    for mode, asynchronous in MODES:
        shape = parallel.mesh_shape(ParallelismSection(mode=mode).sharded, args.world, args.shard_size)
        mesh = parallel.build_mesh(shape, "cpu")
        torch.manual_seed(0)
        model = RecurrentGPT(cfg)
        if shape.sharded:
            parallel.apply_hsdp(model, mesh)
        optimizer = build_optimizer(model, OptimConfig())
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        optimizer.step()
        state = ckpt.TrainerState(step=1, world_size=args.world)
        held, saves, loads, written = [], [], [], 0
        for repeat in range(args.repeats):
            base = Path(root) / f"{mode}_{asynchronous}_{repeat}"
            mine, merged = base / f"rank_{rank}", base / "merged"
            dist.barrier()
            t0 = time.perf_counter()
            pending = ckpt.start_save(mine, rank, model, optimizer, state, CPU,
                                      background if asynchronous else None)
            held.append(time.perf_counter() - t0)
            ckpt.finish_save(pending, CPU)
            saves.append(time.perf_counter() - t0)
            written = sum(p.stat().st_size for p in mine.rglob("*") if p.is_file())
            dist.barrier()
            if rank == 0:  # Ray Train merges the ranks' directories into one checkpoint
                for r in range(args.world):
                    for path in (base / f"rank_{r}").rglob("*"):
                        if path.is_file():
                            target = merged / path.relative_to(base / f"rank_{r}")
                            target.parent.mkdir(parents=True, exist_ok=True)
                            os.symlink(path, target)
            dist.barrier()
            t0 = time.perf_counter()
            ckpt.read_tensors(merged, model, optimizer)
            loads.append(time.perf_counter() - t0)
        results[f"{mode} {'async' if asynchronous else 'sync'}"] = {
            "held_s": statistics.median(held), "save_s": statistics.median(saves), "written_bytes": written,
            "load_s": statistics.median(loads), "loaded_bytes": held_bytes(model, optimizer)}
    gathered = [None] * args.world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out).write_text(json.dumps({"ranks": gathered, "params": sum(p.numel() for p in model.parameters())}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--shard-size", type=int, default=2, help="hsdp: ranks per shard group")
    parser.add_argument("--model", default="raven-small")
    parser.add_argument("--width", type=int, default=512, help="n_embd of the reduced-width model")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = tempfile.mkdtemp(prefix="huginn_ckpt_bench_")
    out = os.path.join(root, "result.json")
    try:
        mp.start_processes(worker, args=(args, port, root, out), nprocs=args.world, start_method="spawn")
        result = json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.model} at width {args.width}: {result['params']:,} parameters, {args.world} ranks (hsdp: shard "
          f"groups of {args.shard_size}), gloo, local disk, median of {args.repeats}")
    print(f"{'layout':<16}{'rank':>5}{'held s':>9}{'save s':>9}{'written MiB':>13}{'load s':>9}{'loaded MiB':>12}")
    for mode in result["ranks"][0]:
        for rank, r in enumerate(result["ranks"]):
            row = r[mode]
            print(f"{mode:<16}{rank:>5}{row['held_s']:>9.3f}{row['save_s']:>9.3f}{row['written_bytes'] / 2**20:>13.2f}"
                  f"{row['load_s']:>9.3f}{row['loaded_bytes'] / 2**20:>12.2f}")


if __name__ == "__main__":
    sys.exit(main())

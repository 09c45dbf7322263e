"""Checkpoint save and load per rank: seconds and bytes, unsharded vs node-sharded optimizer state.

    python bench/checkpoint.py --world 4 --node-size 2 --model raven-small --width 512

Spawns `--world` gloo processes (virtual nodes of `--node-size` ranks), builds the same model on each with the
training loop's optimizer (ELLISAdam, or NodeShardedOptimizer with optim.sharding=node), takes one optimizer
step so that the state exists, then every rank writes its part of a checkpoint with
`huginn_ray.train.checkpoint.write` into its own directory (what it hands to Ray Train), and reads it back with
`checkpoint.read` from the merged directory (what Ray Train gives back on resume). Reported per rank: bytes
written, seconds to write, bytes the rank reads, seconds to read; the median over `--repeats`.
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
from huginn_ray.train.config import OptimConfig
from huginn_ray.train.optim import build_optimizer
from huginn_ray.train.sharding import NodeSharding, NodeShardedOptimizer, build_node_layout


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def worker(rank: int, args, port: int, root: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world,
                            timeout=timedelta(minutes=10))
    cfg = ModelConfig.from_name(args.model, n_embd=args.width, intermediate_size=args.width * 8 // 3 // 64 * 64,
                                num_attention_heads=max(1, args.width // 64))
    layout = build_node_layout(args.node_size)
    results = {}
    for mode in ("none", "node"):
        torch.manual_seed(0)
        model = RecurrentGPT(cfg)
        optimizer = (build_optimizer(model, OptimConfig()) if mode == "none"
                     else NodeShardedOptimizer(model, OptimConfig(), NodeSharding(model, layout)))
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        optimizer.step()
        state = ckpt.TrainerState(step=1, world_size=args.world)
        writes, reads, written, read = [], [], 0, 0
        for repeat in range(args.repeats):
            base = Path(root) / f"{mode}_{repeat}"
            mine, merged = base / f"rank_{rank}", base / "merged"
            dist.barrier()
            t0 = time.perf_counter()
            ckpt.write(mine, rank, model, optimizer, state, {"row_group": 0}, torch.device("cpu"))
            writes.append(time.perf_counter() - t0)
            written = dir_bytes(mine)
            dist.barrier()
            if rank == 0:  # Ray Train merges the ranks' directories into one checkpoint
                merged.mkdir()
                for r in range(args.world):
                    for path in (base / f"rank_{r}").iterdir():
                        os.symlink(path, merged / path.name)
            dist.barrier()
            before = {p.name for p in merged.iterdir()}
            t0 = time.perf_counter()
            ckpt.read(merged, rank, args.world, model, optimizer, torch.device("cpu"))
            reads.append(time.perf_counter() - t0)
            sharding = getattr(optimizer, "sharding", None)
            opt_file = ("optimizer.pt" if sharding is None
                        else ckpt.shard_file(sharding.layout.local_rank, sharding.layout.node_size))
            read = sum((merged / name).resolve().stat().st_size
                       for name in (opt_file, ckpt.rank_file(rank), "trainer_state.json") if name in before)
            read += dir_bytes((merged / "model").resolve())
        results[mode] = {"write_s": statistics.median(writes), "write_bytes": written,
                         "read_s": statistics.median(reads), "read_bytes": read}
    gathered = [None] * args.world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out).write_text(json.dumps({"ranks": gathered, "params": sum(p.numel() for p in model.parameters())}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--node-size", type=int, default=2)
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
    print(f"{args.model} at width {args.width}: {result['params']:,} parameters, {args.world} ranks as "
          f"{args.world // args.node_size} virtual nodes x {args.node_size}, gloo, median of {args.repeats}")
    print(f"{'sharding':<9}{'rank':>5}{'write MiB':>11}{'write s':>9}{'read MiB':>10}{'read s':>8}")
    for mode in ("none", "node"):
        for rank, r in enumerate(result["ranks"]):
            row = r[mode]
            print(f"{mode:<9}{rank:>5}{row['write_bytes'] / 2**20:>11.2f}{row['write_s']:>9.3f}"
                  f"{row['read_bytes'] / 2**20:>10.2f}{row['read_s']:>8.3f}")


if __name__ == "__main__":
    sys.exit(main())

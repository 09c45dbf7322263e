"""Compare the three gradient exchanges: time per training step and all-reduce bus bandwidth.

    python bench/allreduce.py --world 2 --model raven-small --steps 6 --chunk-mib 16

Spawns `--world` processes (gloo on CPU; NCCL with one GPU per process when enough GPUs are present), builds
the same model on each, and times forward+backward+exchange for: no exchange (the compute baseline),
chunk_stream, chunk_stream_overlap and ddp. For the synchronous chunk stream the exchange alone is also timed,
giving the bus bandwidth 2 (W - 1) / W x bytes / time (bytes including the zero padding of the last chunk).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from huginn_ray.cluster.devices import distributed_backend
from huginn_ray.model import ModelConfig, RecurrentGPT
from huginn_ray.train.grad_sync import ChunkStream, build_grad_sync

KINDS = ("none", "chunk_stream", "chunk_stream_overlap", "ddp")


def sync_device(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(rank: int, args, port: int, out: str) -> None:
    use_cuda = torch.cuda.device_count() >= args.world
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    dist.init_process_group(distributed_backend(device), init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=args.world, timeout=timedelta(minutes=10))
    cfg = ModelConfig.from_name(args.model, activation_checkpointing=True)
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=generator).to(device)
    results = {"backend": dist.get_backend(), "device": str(device), "world": args.world}
    for kind in KINDS:
        torch.manual_seed(0)
        model = RecurrentGPT(cfg).to(device)
        results["grad_mib"] = sum(p.numel() for p in model.parameters()) * 4 / 2**20
        sync = None if kind == "none" else build_grad_sync(kind, model, args.chunk_mib)
        module = model if sync is None else sync.module
        step_times, exchange_times = [], []
        for step in range(args.warmup + args.steps):
            dist.barrier()
            sync_device(device)
            t0 = time.perf_counter()
            if sync is None:
                module(inputs[:, :-1], labels=inputs[:, 1:], num_steps=(args.n, args.k)).loss.backward()
            else:
                with sync.micro_batch(last=True):
                    module(inputs[:, :-1], labels=inputs[:, 1:], num_steps=(args.n, args.k)).loss.backward()
                sync_device(device)
                t1 = time.perf_counter()
                sync.finish()
            sync_device(device)
            t2 = time.perf_counter()
            if step >= args.warmup:
                step_times.append(t2 - t0)
                if isinstance(sync, ChunkStream):
                    exchange_times.append(t2 - t1)
            model.zero_grad(set_to_none=True)
        results[kind] = {"step_s": statistics.median(step_times)}
        if exchange_times:
            exchange = statistics.median(exchange_times)
            wire_bytes = len(sync.chunks) * sync.buffer.numel() * 4
            results[kind]["exchange_s"] = exchange
            results[kind]["chunks"] = len(sync.chunks)
            results[kind]["bus_gb_s"] = 2 * (args.world - 1) / args.world * wire_bytes / exchange / 1e9
        if hasattr(sync, "remove_hooks"):
            sync.remove_hooks()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--model", default="raven-small")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--n", type=int, default=2, help="no-grad recurrence iterations")
    parser.add_argument("--k", type=int, default=4, help="recurrence iterations with gradients")
    parser.add_argument("--chunk-mib", type=float, default=16.0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    mp.start_processes(worker, args=(args, port, out), nprocs=args.world, start_method="spawn")
    r = json.load(open(out))
    os.unlink(out)
    base = r["none"]["step_s"]
    print(f"{args.model}: {r['grad_mib']:.1f} MiB fp32 gradients, {r['world']} ranks, {r['backend']} on {r['device'].split(':')[0]}, "
          f"seq {args.seq_len} x batch {args.batch}, depth (n={args.n}, k={args.k}), chunks of {args.chunk_mib:g} MiB")
    print(f"{'exchange':<22}{'step (s)':>10}{'vs none':>10}{'exchange (s)':>14}{'bus GB/s':>10}")
    for kind in KINDS:
        row = r[kind]
        extra = f"{row['exchange_s']:>14.3f}{row['bus_gb_s']:>10.2f}" if "bus_gb_s" in row else f"{'':>14}{'':>10}"
        print(f"{kind:<22}{row['step_s']:>10.3f}{row['step_s'] / base:>10.2f}x{extra}")


if __name__ == "__main__":
    sys.exit(main())

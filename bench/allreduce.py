"""Compare the gradient exchanges: bytes sent between nodes per rank per step (counted), exchange and step time.

    python bench/allreduce.py --world 4 --node-size 2 --model raven-small --steps 6 --chunk-mib 4

Spawns `--world` processes (gloo on CPU; NCCL with one GPU per process when enough GPUs are present) split into
virtual nodes of `--node-size` ranks (rank = node * node_size + local_rank), builds the same model on each, and
times forward+backward+exchange for: no exchange (the compute baseline), the replicated exchanges chunk_stream,
chunk_stream_overlap and ddp, and hsdp (FSDP2 over the virtual node, the chunk stream between nodes over each
rank's gradient shard). Under hsdp the exchange time is the stream between nodes; FSDP2's gathers and
reduce-scatters inside the node run during forward and backward and are in the step time.

Bytes between nodes are counted, not estimated: every collective the exchange issues (torch.distributed
all_reduce / reduce / broadcast, and FSDP2's all_gather_into_tensor / reduce_scatter_tensor; DDP's bucket
all-reduces go through a comm hook that issues them from Python) is wrapped, and the payload bytes of each call
whose process group spans more than one virtual node are summed. These are message
payloads; how many times a collective algorithm moves each byte over the node boundary (a ring all-reduce sends
about 2 (G-1)/G x payload per rank for G ranks) depends on the library and topology and is the same factor for
every exchange here, since all inter-node messages are all-reduces.
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
from huginn_ray.train import parallel
from huginn_ray.train.grad_sync import ChunkStream, build_grad_sync

KINDS = ("none", "chunk_stream", "chunk_stream_overlap", "ddp", "hsdp")


def sync_device(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class InterNodeCounter:
    """Wraps the torch.distributed collectives; sums payload bytes of calls over groups spanning nodes."""

    def __init__(self, node_size: int):
        self.node_size = node_size
        self.bytes = 0
        self.calls = 0
        self._originals = {}

    def spans_nodes(self, group) -> bool:
        ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        return len({r // self.node_size for r in ranks}) > 1

    def count(self, tensor, group) -> None:
        if self.spans_nodes(group):
            self.bytes += tensor.numel() * tensor.element_size()
            self.calls += 1

    def install(self) -> None:
        for name in ("all_reduce", "reduce", "broadcast"):
            original = getattr(dist, name)
            self._originals[name] = original

            def wrapped(tensor, *args, _original=original, **kwargs):
                self.count(tensor, kwargs.get("group"))
                return _original(tensor, *args, **kwargs)

            setattr(dist, name, wrapped)
        for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):  # FSDP2's, called as dist.<name>
            original = getattr(dist, name)

            def wrapped(output, input, *args, _original=original, **kwargs):
                self.count(input, kwargs.get("group"))  # what this rank sends
                return _original(output, input, *args, **kwargs)

            setattr(dist, name, wrapped)

    @staticmethod
    def ddp_hook(process_group, bucket):
        """DDP's default all-reduce, issued from Python (torch.distributed.all_reduce, counted by the wrapper)
        instead of from DDP's C++ reducer, which the wrapper cannot see."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(process_group, bucket)


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
    shape = parallel.MeshShape(sharded=True, world_size=args.world, shard_size=args.node_size)
    mesh = parallel.build_mesh(shape, device.type)
    counter = InterNodeCounter(args.node_size)
    counter.install()
    results = {"backend": dist.get_backend(), "device": str(device), "world": args.world, "rank": rank}
    for kind in KINDS:
        torch.manual_seed(0)
        model = RecurrentGPT(cfg).to(device)
        results["grad_mib"] = sum(p.numel() for p in model.parameters()) * 4 / 2**20
        if kind == "hsdp":
            parallel.apply_hsdp(model, mesh)
            sync = ChunkStream(model, int(args.chunk_mib * 2**20) // 4, group=mesh.get_group("replicate"),
                               divide_by=args.world)
        else:
            sync = None if kind == "none" else build_grad_sync(kind, model, args.chunk_mib,
                                                               max_chunks_in_flight=args.max_in_flight)
        if kind == "ddp":
            sync.module.register_comm_hook(None, counter.ddp_hook)
        module = model if sync is None else sync.module
        step_times, exchange_times, sent = [], [], []
        for step in range(args.warmup + args.steps):
            dist.barrier()
            sync_device(device)
            counter.bytes = 0
            t0 = time.perf_counter()
            t1 = None
            with (sync.micro_batch(last=True) if sync is not None else torch.enable_grad()):
                module(inputs[:, :-1], labels=inputs[:, 1:], num_steps=(args.n, args.k)).loss.backward()
            sync_device(device)
            t1 = time.perf_counter()
            if sync is not None:
                sync.finish()
            sync_device(device)
            t2 = time.perf_counter()
            if step >= args.warmup:
                step_times.append(t2 - t0)
                exchange_times.append(t2 - t1)
                sent.append(counter.bytes)
            model.zero_grad(set_to_none=True)
        results[kind] = {"step_s": statistics.median(step_times), "exchange_s": statistics.median(exchange_times),
                         "inter_node_bytes": max(sent)}
        if hasattr(sync, "remove_hooks"):
            sync.remove_hooks()
    gathered = [None] * args.world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--node-size", type=int, default=2, help="ranks per virtual node")
    parser.add_argument("--model", default="raven-small")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--n", type=int, default=2, help="no-grad recurrence iterations")
    parser.add_argument("--k", type=int, default=4, help="recurrence iterations with gradients")
    parser.add_argument("--chunk-mib", type=float, default=4.0)
    parser.add_argument("--max-in-flight", type=int, default=4, help="chunk_stream_overlap buffers in flight")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    mp.start_processes(worker, args=(args, port, out), nprocs=args.world, start_method="spawn")
    ranks = json.load(open(out))
    os.unlink(out)
    r = ranks[0]
    base = r["none"]["step_s"]
    print(f"{args.model}: {r['grad_mib']:.1f} MiB fp32 gradients, {r['world']} ranks as {args.world // args.node_size} "
          f"virtual nodes x {args.node_size}, {r['backend']} on {r['device'].split(':')[0]}, seq {args.seq_len} x batch "
          f"{args.batch}, depth (n={args.n}, k={args.k}), chunks of {args.chunk_mib:g} MiB")
    print(f"{'exchange':<22}{'inter-node MiB/rank/step':>26}{'exchange (s)':>14}{'step (s)':>10}{'vs none':>9}")
    for kind in KINDS:
        row = r[kind]
        mib = max(rank[kind]["inter_node_bytes"] for rank in ranks) / 2**20  # the busiest rank
        exchange = statistics.median(rank[kind]["exchange_s"] for rank in ranks)
        print(f"{kind:<22}{mib:>26.2f}{exchange if kind != 'none' else 0:>14.3f}{row['step_s']:>10.3f}"
              f"{row['step_s'] / base:>8.2f}x")


if __name__ == "__main__":
    sys.exit(main())

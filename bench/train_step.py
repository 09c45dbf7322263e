"""A training step under Ray Train versus the same step under plain torchrun.

    python bench/train_step.py --workers 2 --steps 20 --model raven-tiny --seq-len 128 --rounds 2

Both sides run `huginn_ray.train.loop.train_step` on components from `build_components` (model, gradient
exchange, optimizer, shard reader) over the same synthetic shards, with gloo on CPU (NCCL with GPUs). Rank 0
times `--steps` steps after `--warmup` steps; the two launchers alternate for `--rounds` rounds and the median
step times are compared. Needs a private namespace (tools/private_netns.sh) since it starts a local Ray.

    python bench/train_step.py --count-syncs --model raven-tiny --steps 4

counts instead, in one process (world size 1, gloo), the reads of a tensor's value by the host per training
step (Tensor.item / __bool__ / __float__ / __int__ / tolist: each one a device sync on a GPU), by call site.
Reads of the optimizer's step counters, which live on the CPU by design, are listed but are no sync.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from huginn_ray.cluster.devices import distributed_backend
from huginn_ray.config import from_dict, to_dict
from huginn_ray.model import ModelConfig
from huginn_ray.train.config import TrainConfig
from huginn_ray.data.shards import shard_path
from huginn_ray.train.loop import build_components, train_step
from huginn_ray.train.run_plan import RunPlan


def make_shards(root: Path, workers: int, rows: int, seq_len: int, vocab: int) -> None:
    rng = np.random.default_rng(0)
    for rank in range(workers):
        path = shard_path(root, "train", rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = rng.integers(0, vocab - 32, size=(rows, seq_len + 1), dtype=np.int32)
        pq.write_table(pa.table({"input_ids": pa.array(list(data), type=pa.list_(pa.int32()))}), path,
                       row_group_size=64)


def plan_of(spec: dict) -> RunPlan:
    """The RunPlan a spec carries as JSON (its model config in the Hugging Face form)."""
    return RunPlan(**{**spec["plan"], "model_config": ModelConfig.from_hf_dict(spec["plan"]["model_config"])})


def timed_steps(spec: dict) -> None:
    """Run on every rank once the process group is up; rank 0 writes the step times."""
    cfg = from_dict(TrainConfig, spec["cfg"])
    rank = dist.get_rank()
    # the same device on both launchers: the worker's GPU (Ray Train and torchrun both set it) or the CPU
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.scaling.use_gpu else torch.device("cpu")
    plan = plan_of(spec)
    components = build_components(cfg, plan, rank, device)
    times = []
    for step in range(1, spec["warmup"] + spec["steps"] + 1):
        dist.barrier()
        t0 = time.perf_counter()
        train_step(components, step, cfg, plan, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step > spec["warmup"]:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps(times))


def ray_train_loop(spec: dict) -> None:
    timed_steps(spec)


def run_ray(spec: dict, workers: int) -> list[float]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    cfg = from_dict(TrainConfig, spec["cfg"])
    TorchTrainer(
        ray_train_loop, train_loop_config=spec,
        torch_config=TorchConfig(backend=distributed_backend(torch.device("cuda" if cfg.scaling.use_gpu else "cpu"))),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=cfg.scaling.use_gpu),
        run_config=RunConfig(storage_path=spec["storage"], name=f"bench_{time.time_ns()}"),
    ).fit()
    return json.loads(Path(spec["result"]).read_text())


def run_torchrun(spec_path: Path, workers: int) -> list[float]:
    spec = json.loads(spec_path.read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={workers}", "--master_addr=127.0.0.1",
         f"--master_port={port}", __file__, "--torchrun-worker", str(spec_path)],
        check=True, capture_output=True, timeout=600,
    )
    return json.loads(Path(spec["result"]).read_text())


def torchrun_worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    use_gpu = spec["cfg"]["scaling"]["use_gpu"]
    if use_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(distributed_backend(torch.device("cuda" if use_gpu else "cpu")))
    timed_steps(spec)
    dist.destroy_process_group()


def count_host_syncs(spec: dict) -> None:
    import collections
    import traceback

    cfg = from_dict(TrainConfig, spec["cfg"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    device = torch.device("cpu")
    plan = plan_of(spec)
    components = build_components(cfg, plan, 0, device)
    sites: collections.Counter = collections.Counter()
    counting = False
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "__bool__", "__float__", "__int__", "tolist")}

    def patched(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            if counting:
                frame = traceback.extract_stack(limit=2)[0]
                sites[f"{Path(frame.filename).name}:{frame.lineno} {frame.name} ({name})"] += 1
            return original(self, *args, **kwargs)
        return read

    for name in originals:
        setattr(torch.Tensor, name, patched(name))
    try:
        train_step(components, 1, cfg, plan, device)  # the first step (state init) is not counted
        counting = True
        for step in range(2, spec["steps"] + 2):
            train_step(components, step, cfg, plan, device, want_telemetry=False)
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        dist.destroy_process_group()
    steps = spec["steps"]
    print(f"host reads of tensor values per training step (mean of {steps} steps, grad_accum "
          f"{components.order.grad_accum}): {sum(sites.values()) / steps:.1f}")
    for site, count in sites.most_common():
        print(f"  {count / steps:6.1f}  {site}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", default="raven-tiny")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--grad-sync", default="chunk_stream")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--count-syncs", action="store_true", help="count host reads of tensors per step instead")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (--count-syncs)")
    parser.add_argument("--torchrun-worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torchrun_worker:
        return torchrun_worker(args.torchrun_worker)

    import ray

    use_gpu = torch.cuda.device_count() >= args.workers and not args.count_syncs
    root = Path(tempfile.mkdtemp(prefix="hr_bench_"))
    model_cfg = ModelConfig.from_name(args.model, activation_checkpointing=True)
    rows = args.micro_batch * (args.warmup + args.steps)
    make_shards(root / "data", args.workers, rows, args.seq_len, model_cfg.vocab_size)
    cfg = TrainConfig(out_dir=str(root), block_size=args.seq_len, micro_batch_size=args.micro_batch)
    cfg.grad_sync.kind = args.grad_sync
    cfg.grad_sync.chunk_mib = 16
    cfg.scaling.use_gpu = use_gpu
    cfg.data.data_dir = str(root / "data")
    cfg.cpu_threads = 1
    # --count-syncs: one rank, one shard, grad_accum micro-batches; else one shard per worker, no accumulation
    streams = 1 if args.count_syncs else args.workers
    plan = RunPlan(global_batch_rows=args.micro_batch * (args.grad_accum if args.count_syncs else args.workers),
                   num_streams=streams, schedule_steps=10**6, data_dir=cfg.data.data_dir, pad_id=model_cfg.vocab_size - 1,
                   eos_id=model_cfg.vocab_size - 2, precision="bf16-mixed" if use_gpu else "fp32",
                   model_config=model_cfg)
    spec = {"cfg": to_dict(cfg), "plan": {**asdict(plan), "model_config": model_cfg.to_hf_dict()}, "steps": args.steps,
            "warmup": args.warmup,
            "result": str(root / "times.json"), "storage": str(root / "ray")}
    if args.count_syncs:
        make_shards(root / "data", 1, rows * args.grad_accum + args.micro_batch, args.seq_len, model_cfg.vocab_size)
        return count_host_syncs(spec)
    spec_path = root / "spec.json"
    spec_path.write_text(json.dumps(spec))

    # the workers import this script (bench/) and the same huginn_ray as the driver (this checkout, not
    # whichever copy is installed), as the torchrun column does
    here = Path(__file__).resolve().parent
    ray.init(_temp_dir=tempfile.mkdtemp(prefix="hr_", dir="/tmp"), include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])}})
    medians = {"ray_train": [], "torchrun": []}
    for _ in range(args.rounds):
        medians["ray_train"].append(statistics.median(run_ray(spec, args.workers)))
        medians["torchrun"].append(statistics.median(run_torchrun(spec_path, args.workers)))
    ray.shutdown()
    ray_s, torchrun_s = statistics.median(medians["ray_train"]), statistics.median(medians["torchrun"])
    # the fastest round of each launcher is the least disturbed by other load on a shared machine
    ray_best, torchrun_best = min(medians["ray_train"]), min(medians["torchrun"])
    print(f"{args.model}, seq {args.seq_len} x micro-batch {args.micro_batch}, {args.workers} workers "
          f"({'nccl' if use_gpu else 'gloo'}), {args.grad_sync}, median of {args.steps} steps x {args.rounds} rounds")
    print(f"  torchrun   {torchrun_s * 1000:8.1f} ms/step   rounds: {[round(m * 1000, 1) for m in medians['torchrun']]}")
    print(f"  Ray Train  {ray_s * 1000:8.1f} ms/step   rounds: {[round(m * 1000, 1) for m in medians['ray_train']]}")
    print(f"  Ray Train / torchrun = {ray_s / torchrun_s:.3f} ({(ray_s / torchrun_s - 1) * 100:+.1f}%) median round, "
          f"{ray_best / torchrun_best:.3f} ({(ray_best / torchrun_best - 1) * 100:+.1f}%) fastest round")


if __name__ == "__main__":
    main()

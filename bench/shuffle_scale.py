"""Shuffle scaling: the same packed rows (>= 1 GiB) shuffled into 16, 256, 1024 and 4096 train + val shards.

    python bench/shuffle_scale.py [--gib 1.0] [--shards 16,256,1024,4096] [--cpus 2] [--out /tmp/hr_shuffle]

Writes synthetic packed files (rows of seq_len + 1 uint16 ids, 5 % validation rows, the pack stage's file
layout), then in one run:
  baseline - a plain pyarrow read + write of the same packed files (one process), the disk's reference speed;
  shuffle N - huginn_ray.data.shard_build.run_shuffle on a fresh local Ray for each N.
Per N it prints wall time, records (rows) per second, bytes read and written (input, intermediate map files,
shards), the driver's peak RSS (sampled every 50 ms) and its growth during the shuffle, the peak number of objects
in the object store and of object references the driver holds, the number of map / reduce tasks, and the largest
task peak RSS.
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from huginn_ray.data import shard_build
from huginn_ray.data.tokenize_pack import packed_schema
from huginn_ray.data.tokens import parquet_options, rows_to_arrow


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def write_packed(root: Path, gib: float, row_len: int, rows_per_file: int) -> list[dict]:
    root.mkdir(parents=True)
    total_rows = int(gib * 2**30 / (row_len * 2))
    rng = np.random.default_rng(0)
    files, done, index = [], 0, 0
    while done < total_rows:
        n = min(rows_per_file, total_rows - done)
        rows = rng.integers(0, 65536, size=(n, row_len), dtype=np.uint16)
        split = ((done + np.arange(n)) % 20 == 0).astype(np.uint8)
        path = root / f"0000-{index:016x}.parquet"
        table = pa.table({"input_ids": rows_to_arrow(rows, "uint16"), "split": pa.array(split)},
                         schema=packed_schema("uint16"))
        pq.write_table(table, path, **parquet_options(table))  # as the pack stage writes them
        files.append({"path": str(path), "train_rows": int((split == 0).sum()), "val_rows": int(split.sum())})
        done += n
        index += 1
    return files


def baseline(files: list[dict], out: Path) -> tuple[float, int, int]:
    out.mkdir()
    start = time.perf_counter()
    read = written = 0
    for f in files:
        table = pq.read_table(f["path"])
        read += os.path.getsize(f["path"])
        target = out / Path(f["path"]).name
        pq.write_table(table, target, **parquet_options(table))
        written += target.stat().st_size
    os.sync()
    return time.perf_counter() - start, read, written


class Sampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.peak_rss = rss_mib()
        self.peak_objects = self.peak_refs = 0

    def run(self) -> None:
        import ray
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        state = get_state_from_address(ray.get_runtime_context().gcs_address)
        core = ray._private.worker.global_worker.core_worker
        last_store = 0.0
        while not self.stop.is_set():
            self.peak_rss = max(self.peak_rss, rss_mib())
            self.peak_refs = max(self.peak_refs, len(core.get_all_reference_counts()))
            if time.time() - last_store > 0.5:
                last_store = time.time()
                try:
                    reply = get_memory_info_reply(state, timeout_seconds=5)
                    self.peak_objects = max(self.peak_objects, reply.store_stats.num_local_objects)
                except Exception:
                    pass
            time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--shards", default="16,256,1024,4096")
    parser.add_argument("--cpus", type=int, default=os.cpu_count())
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--rows-per-file", type=int, default=4096)
    parser.add_argument("--map-mib", type=int, default=256)
    parser.add_argument("--reducer-mib", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import ray

    root = Path(args.out or tempfile.mkdtemp(prefix="hr_shuffle_", dir="/tmp"))
    row_len = args.seq_len + 1
    files = write_packed(root / "packed", args.gib, row_len, args.rows_per_file)
    input_bytes = sum(os.path.getsize(f["path"]) for f in files)
    rows = sum(f["train_rows"] + f["val_rows"] for f in files)
    print(f"input: {len(files)} packed files, {rows} rows of {row_len} uint16 ids, "
          f"{input_bytes / 2**30:.2f} GiB on disk", flush=True)
    base_s, base_read, base_written = baseline(files, root / "baseline")
    shutil.rmtree(root / "baseline")
    print(f"baseline pyarrow read+write: {base_s:.1f}s = {input_bytes / 2**20 / base_s:.0f} MiB/s", flush=True)

    results = []
    for n in [int(x) for x in args.shards.split(",")]:
        temp_dir = tempfile.mkdtemp(prefix="hrs_", dir="/tmp")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=args.cpus, object_store_memory=256 << 20, _temp_dir=temp_dir,
                 include_dashboard=False, log_to_driver=False)
        out = root / f"shards_{n}"
        sampler = Sampler()
        before = rss_mib()
        sampler.start()
        start = time.perf_counter()
        shard_build.run_shuffle(files, row_len, out, num_shards=n, seed=1, row_group_size=64,
                           reducer_mib=args.reducer_mib, map_mib=args.map_mib, token_dtype="uint16",
                           vocab_size=65536, fingerprint=f"bench-{n}", manifest_extra={})
        os.sync()
        wall = time.perf_counter() - start
        sampler.stop.set()
        sampler.join()
        st = dict(shard_build.last_run_stats)
        read = input_bytes + st["intermediate_bytes_read"]
        written = st["intermediate_bytes_written"] + st["shard_bytes_written"]
        results.append((n, wall, read, written, sampler.peak_rss, sampler.peak_rss - before, sampler.peak_objects,
                        sampler.peak_refs, st["map_tasks"], st["reducers"], st["max_task_peak_rss_mib"]))
        print(f"N={n}: {wall:.1f}s, {rows / wall:.0f} records/s", flush=True)
        ray.shutdown()
        shutil.rmtree(os.path.realpath(out))  # the published version; `out` is the pointer to it
        out.unlink()
        shutil.rmtree(temp_dir, ignore_errors=True)

    print(f"\n=== shuffle scaling: {input_bytes / 2**30:.2f} GiB packed input ({rows} rows), {args.cpus} Ray CPUs, "
          f"map_mib {args.map_mib}, reducer_mib {args.reducer_mib}, load average {os.getloadavg()[0]:.1f} ===")
    print(f"baseline pyarrow read+write (1 process): {base_s:.1f}s, read {base_read / 2**30:.2f} GiB, "
          f"written {base_written / 2**30:.2f} GiB, {input_bytes / 2**20 / base_s:.0f} MiB/s")
    print("| N shards | wall s | records/s | vs baseline | read GiB | written GiB | driver peak RSS MiB (growth) | "
          "peak store objects | peak driver refs | map / reduce tasks | largest task peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, wall, read, written, peak, growth, objs, refs, maps, reds, task_rss in results:
        print(f"| {n} | {wall:.1f} | {rows / wall:.0f} | {base_s / wall:.2f}x | {read / 2**30:.2f} | {written / 2**30:.2f} | "
              f"{peak:.0f} (+{growth:.0f}) | {objs} | {refs} | {maps} / {reds} | {task_rss:.0f} |")
    if not args.out:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

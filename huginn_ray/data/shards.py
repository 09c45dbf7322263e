"""The global shuffle: packed rows -> exactly N train + N validation shards, one per training rank.

Contract. Packed rows have a deterministic global order per split (input files in the given order, rows in file
order). For a split with T rows, rows_per_shard = T // N and the first N * rows_per_shard positions of a seeded
pseudo-random permutation of [0, T) are kept (the surplus T mod N rows are dropped and reported). The row at
global index g goes to position p = perm(g): shard p // rows_per_shard, slot p % rows_per_shard. The permutation
is a keyed Feistel network with cycle walking, so every row is placed exactly once, with no table of T entries.
Train and validation rows are shuffled separately and never mixed.

Execution: a two-pass external shuffle through files, so that no intermediate data lives in Ray's object store
and nothing the driver or a task holds grows with N (huginn_ray/data/README.md has the cost model):

1. map: one Ray task per group of ~`shuffle.map_mib` of input files computes every row's position, drops the
   surplus, sorts its rows by position (hence by destination shard) and writes one Arrow IPC file per split,
   `map/<split>/MMMMMM.arrow` (columns `position`, `input_ids`), plus `MMMMMM.idx.npy`: N + 1 row offsets, row
   range [idx[s], idx[s+1]) of the file holds the rows bound for shard s.
2. reduce: one Ray task per range of consecutive shards holding ~`shuffle.reducer_mib` of rows memory-maps
   every map file of its split, reads only its row range (two index entries + those rows' bytes), merges by
   position and writes its shards `<split>/RRRRR.parquet` (column `input_ids`, list<uint16|int32>, row groups of
   `shuffle.row_group_size`).

Tasks return only a few integers; map tasks and reducers declare `memory=` to Ray from their data size, so Ray
does not start more of them on a node than its memory holds. Every file is written under a temporary name and
renamed when complete, in `<shard_dir>.partial/` with the plan's fingerprint: a rerun after a crash keeps the
committed map files and shards and redoes only the rest.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.tokens import (DTYPES, MAX_LIST_IDS, check_ids, fixed_rows, numpy_dtype, parquet_options,
                                    row_schema, rows_to_arrow)

TRAIN, VAL = 0, 1
SPLITS = {"train": TRAIN, "val": VAL}
MANIFEST = "manifest.json"
PLAN = "_PLAN.json"
_MASK64 = np.uint64(2**64 - 1)
_TASK_OVERHEAD = 256 << 20  # a worker's own footprint (interpreter, pyarrow, numpy), added to memory= requests
MAX_IN_FLIGHT_PER_CPU = 2


def shard_path(shard_dir: str | Path, split: str, rank: int) -> Path:
    return Path(shard_dir) / split / f"{rank:05d}.parquet"


class FeistelPermutation:
    """A seeded bijection of [0, n), evaluated on numpy arrays."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int, salt: int):
        self.n = n
        bits = max(2, math.ceil(math.log2(max(n, 2))))
        self.half = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        keys = np.random.default_rng([seed, salt]).integers(0, 2**63, size=self.ROUNDS, dtype=np.int64)
        self.keys = keys.astype(np.uint64)

    def _round(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(self.half), x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix64(right ^ key) & self.mask)
        return (left << np.uint64(self.half)) | right

    def __call__(self, index: np.ndarray) -> np.ndarray:
        out = self._round(index.astype(np.uint64))
        outside = out >= np.uint64(self.n)
        while outside.any():  # cycle walking: stays a bijection of [0, n)
            out[outside] = self._round(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a good 64-bit mixing function."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))



def plan_split(total_rows: int, num_shards: int, row_bytes: int, reducer_bytes: int, split: str) -> dict:
    """Rows per shard, surplus and reducer layout of one split: about `reducer_bytes` of rows per reducer."""
    rows_per_shard = total_rows // num_shards
    if rows_per_shard == 0:
        raise ValueError(f"the {split} split has {total_rows} packed rows, fewer than num_shards={num_shards}: "
                         "add data, lower num_shards or (for val) raise val_fraction")
    reducers = max(1, min(num_shards, math.ceil(total_rows * row_bytes / reducer_bytes)))
    shards_per_reducer = math.ceil(num_shards / reducers)
    reducers = math.ceil(num_shards / shards_per_reducer)
    return {"rows": total_rows, "num_shards": num_shards, "rows_per_shard": rows_per_shard,
            "kept": rows_per_shard * num_shards,
            "dropped": total_rows - rows_per_shard * num_shards, "reducers": reducers,
            "shards_per_reducer": shards_per_reducer}


def _group_files(files: list[dict], row_bytes: int, group_bytes: int) -> list[list[dict]]:
    """Consecutive input files in groups of about `group_bytes` of rows: one map task each."""
    groups: list[list[dict]] = [[]]
    size = 0
    for f in files:
        if groups[-1] and size + (f["train_rows"] + f["val_rows"]) * row_bytes > group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(f)
        size += (f["train_rows"] + f["val_rows"]) * row_bytes
    return [g for g in groups if g]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _map_paths(work: Path, split: str, index: int) -> tuple[Path, Path]:
    return work / "map" / split / f"{index:06d}.arrow", work / "map" / split / f"{index:06d}.idx.npy"


def _read_input(entry: dict, row_len: int, dtype: str, vocab_size: int, hashes: dict) -> dict[str, np.ndarray]:
    """One input file's rows per split, as (rows, row_len) arrays of the storage type, checked.

    With `hashes` not None, the file's sha256 is recorded in it (read once: the bytes are hashed and parsed)."""
    path = entry["path"]
    if hashes is not None:
        data = pa.py_buffer(Path(path).read_bytes())
        hashes[path] = hashlib.sha256(data).hexdigest()
        source = pa.BufferReader(data)
    else:
        source = path
    pf = pq.ParquetFile(source)
    names = pf.schema_arrow.names
    if "input_ids" not in names:
        raise ValueError(f"{path}: no column 'input_ids' (columns: {', '.join(names)})")
    has_split = "split" in names
    table = pf.read(columns=["input_ids", "split"] if has_split else ["input_ids"])
    out = {}
    for name, code in SPLITS.items():
        if has_split:
            part = table.filter(pc.equal(table.column("split"), code)).column("input_ids")
        else:
            part = table.column("input_ids") if entry[f"{name}_rows"] else table.column("input_ids").slice(0, 0)
        rows = fixed_rows(part, row_len, str(path))
        if len(rows) != entry[f"{name}_rows"]:
            raise ValueError(f"{path}: {len(rows)} {name} rows, the plan expected {entry[f'{name}_rows']} "
                             "(the file changed since it was listed)")
        check_ids(rows, vocab_size, dtype, str(path))
        out[name] = rows.astype(numpy_dtype(dtype), copy=False)
    return out


def _map_group(index: int, files: list[dict], offsets: dict, plans: dict, seed: int, row_len: int, dtype: str,
               vocab_size: int, work: str, hash_inputs: bool = False) -> dict:
    """Ray task: sort one group's rows by destination position and write one map file (+ index) per split."""
    work_dir = Path(work)
    todo = [name for name in SPLITS if not _map_paths(work_dir, name, index)[1].exists()]
    written = 0
    hashes: dict | None = {} if hash_inputs else None
    if todo:
        parts: dict[str, list[np.ndarray]] = {name: [] for name in SPLITS}
        for entry in files:
            for name, rows in _read_input(entry, row_len, dtype, vocab_size, hashes).items():
                parts[name].append(rows)
        if hash_inputs:  # before any map file is committed, so a resumed task finds them
            layout.write_json(work_dir / "map" / f"{index:06d}.sha256.json", hashes)
        for name in todo:
            plan, code = plans[name], SPLITS[name]
            rows = np.concatenate(parts[name]) if parts[name] else np.zeros((0, row_len), np.uint16)
            parts[name] = []
            position = FeistelPermutation(plan["rows"], seed, code)(offsets[name] + np.arange(len(rows)))
            kept = np.flatnonzero(position < plan["kept"])
            order = kept[np.argsort(position[kept], kind="stable")]
            position = position[order]
            rows = rows[order]
            bounds = np.searchsorted(position // plan["rows_per_shard"], np.arange(plan["num_shards"] + 1))
            data_path, index_path = _map_paths(work_dir, name, index)
            # large_list: a map file holds ~map_mib of rows, more ids than 32-bit list offsets address at >= 4 GiB
            table = pa.table({"position": pa.array(position, pa.int64()),
                              "input_ids": rows_to_arrow(rows, dtype, large=True)})
            del rows
            tmp = layout.temp_path(data_path)
            with ipc.new_file(tmp, table.schema) as writer:
                writer.write_table(table)
            layout.commit_file(tmp, data_path)
            written += data_path.stat().st_size
            tmp = layout.temp_path(index_path)
            with open(tmp, "wb") as f:
                np.save(f, bounds.astype(np.int64))
            layout.commit_file(tmp, index_path)  # the index is the commit mark of this map file
    if hash_inputs and not todo:  # resumed: the hashes were recorded next to the committed map files
        hashes = json.loads((work_dir / "map" / f"{index:06d}.sha256.json").read_text())
    return {"bytes_written": written, "skipped": not todo, "peak_rss_mib": _peak_rss_mib(), "sha256": hashes}


def _split_index_path(work: Path, split: str) -> Path:
    return work / "map" / split / "index.npy"


def write_split_index(work: Path, split: str, num_maps: int, num_shards: int) -> None:
    """Gather the split's per-map indexes into one (num_shards + 1, num_maps) int64 array, `map/<split>/index.npy`.

    Row s holds where shard s's rows start in every map file, so a reducer reads two rows of it (once) and then
    opens only the map files whose range for it is not empty. Written through a memory map: the driver's heap
    does not grow with num_shards x num_maps."""
    final = _split_index_path(work, split)
    tmp = layout.temp_path(final)
    index = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int64, shape=(num_shards + 1, num_maps))
    for m in range(num_maps):
        index[:, m] = np.load(_map_paths(work, split, m)[1])
    index.flush()
    del index
    layout.commit_file(tmp, final)


def _reduce(split: str, reducer: int, plan: dict, work: str, row_len: int, dtype: str, row_group_size: int) -> dict:
    """Ray task: read this reducer's row range from the map files that hold rows for it, order by position, write."""
    work_dir = Path(work)
    first = reducer * plan["shards_per_reducer"]
    shards = [s for s in range(first, min(plan["num_shards"], first + plan["shards_per_reducer"]))
              if not shard_path(work_dir / "out", split, s).exists()]
    read = written = opened = 0
    if shards:
        lo_shard, hi_shard = shards[0], shards[-1] + 1
        index = np.load(_split_index_path(work_dir, split), mmap_mode="r")
        starts, ends = np.array(index[lo_shard]), np.array(index[hi_shard])
        del index
        positions, blocks = [], []
        for m in np.flatnonzero(ends > starts):
            lo, hi = int(starts[m]), int(ends[m])
            data_path = _map_paths(work_dir, split, int(m))[0]
            opened += 1
            with pa.memory_map(str(data_path)) as source:
                part = ipc.open_file(source).read_all().slice(lo, hi - lo)
                positions.append(np.array(part.column("position").to_numpy()))
                blocks.append(np.array(fixed_rows(part.column("input_ids"), row_len, str(data_path))))
                del part
            read += (hi - lo) * (row_len * blocks[-1].itemsize + 8)
        position = np.concatenate(positions) if positions else np.zeros(0, np.int64)
        order = np.argsort(position, kind="stable")
        position = position[order]
        rows = np.concatenate(blocks)[order] if blocks else np.zeros((0, row_len), np.uint16)
        del blocks
        rps = plan["rows_per_shard"]
        for shard in shards:
            lo, hi = np.searchsorted(position, [shard * rps, (shard + 1) * rps])
            if hi - lo != rps or (hi > lo and (position[lo] != shard * rps or position[hi - 1] != (shard + 1) * rps - 1)):
                raise RuntimeError(f"{split} shard {shard}: {hi - lo} rows, expected {rps}")
            path = shard_path(work_dir / "out", split, shard)
            tmp = layout.temp_path(path)
            table = pa.table({"input_ids": rows_to_arrow(rows[lo:hi], dtype)}, schema=row_schema(dtype))
            pq.write_table(table, tmp, row_group_size=row_group_size, **parquet_options(table))
            layout.commit_file(tmp, path)
            written += path.stat().st_size
    return {"bytes_read": read, "bytes_written": written, "shards": len(shards), "map_files_opened": opened,
            "peak_rss_mib": _peak_rss_mib()}


def _node_memory_cap() -> int:
    import ray

    sizes = [n["Resources"].get("memory", 0) for n in ray.nodes() if n.get("Alive")]
    return int(max(sizes)) if sizes else 0


def _memory_request(estimate: int, cap: int) -> int:
    """memory= for a task: its estimate, but never more than the largest node offers (the task would never run)."""
    return int(min(estimate, cap)) if cap else int(estimate)


def run_bounded(calls: list, limit: int, label: str, stage: str = "shuffle") -> list:
    """Submit `calls` (functions returning an ObjectRef) with at most `limit` in flight; results in call order.

    Only small results come back, and the driver holds at most `limit` pending references at a time."""
    import ray

    results: list = [None] * len(calls)
    pending: dict = {}
    next_call = done = 0
    last_print = 0.0
    while next_call < len(calls) or pending:
        while next_call < len(calls) and len(pending) < limit:
            pending[calls[next_call]()] = next_call
            next_call += 1
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            results[pending.pop(ref)] = ray.get(ref)
            done += 1
        if time.time() - last_print > 5 or done == len(calls):
            last_print = time.time()
            print(f"[{stage}] {label}: {done}/{len(calls)}", flush=True)
    return results


last_run_stats: dict = {}
"""Figures of the latest run_shuffle in this process (tasks, bytes, task peak RSS), for bench/shuffle_scale.py."""


def run_shuffle(files: list[dict], row_len: int, shard_root: Path, *, num_shards: int, seed: int,
                row_group_size: int, reducer_mib: int, map_mib: int, token_dtype: str, vocab_size: int,
                fingerprint: str, manifest_extra: dict, hash_inputs: bool = False) -> dict:
    """Shuffle rows of `files` ({path, train_rows, val_rows}, in global order) into shards; returns the manifest.

    Skipped when `shard_root` holds a manifest of the same fingerprint; resumes from `<shard_root>.partial`."""
    import ray

    shard_root = Path(shard_root)
    existing = layout.read_marker(shard_root, MANIFEST)
    work = shard_root.with_name(shard_root.name + ".partial")
    if existing is not None and existing.get("fingerprint") == fingerprint:
        shutil.rmtree(work, ignore_errors=True)
        print(f"[shuffle] complete ({num_shards} + {num_shards} shards), skipped", flush=True)
        return existing

    itemsize = np.dtype(np.uint16 if token_dtype == "uint16" else np.int32).itemsize
    row_bytes = row_len * itemsize + 8
    plans = {name: plan_split(sum(f[f"{name}_rows"] for f in files), num_shards, row_bytes,
                              reducer_mib << 20, name) for name in SPLITS}
    for name, plan in plans.items():
        if plan["rows_per_shard"] * row_len > MAX_LIST_IDS:  # a shard's input_ids column is one list<> array
            raise ValueError(f"num_shards={num_shards}: a {name} shard would hold {plan['rows_per_shard']} rows of "
                             f"{row_len} ids, more than the {MAX_LIST_IDS} ids a parquet list column addresses; "
                             f"raise num_shards")
    groups = _group_files(files, row_bytes, map_mib << 20)
    work_plan = {"fingerprint": fingerprint, "map_mib": map_mib, "reducer_mib": reducer_mib,
                 "groups": [[str(f["path"]) for f in g] for g in groups], "token_dtype": token_dtype}
    work_id = layout.fingerprint(work_plan)
    previous = layout.read_marker(work, PLAN)
    if previous is not None and previous.get("id") == work_id:
        done_maps = sum(1 for _ in (work / "map").glob("*/*.idx.npy"))
        done_shards = sum(1 for _ in (work / "out").glob("*/*.parquet"))
        print(f"[shuffle] resuming {work}: {done_maps}/{2 * len(groups)} map files and "
              f"{done_shards}/{2 * num_shards} shards already written are kept", flush=True)
        for stale in work.glob("*/*/*.tmp"):  # half-written by a crashed attempt: never read, removed
            stale.unlink()
    else:
        if work.exists():
            print(f"[shuffle] removing {work}: left by a run with other inputs or settings", flush=True)
            shutil.rmtree(work)
        for name in SPLITS:
            (work / "map" / name).mkdir(parents=True)
            (work / "out" / name).mkdir(parents=True)
        layout.write_json(work / PLAN, {"id": work_id, "fingerprint": fingerprint,
                                        "map_tasks": len(groups), "num_shards": num_shards})

    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    limit = MAX_IN_FLIGHT_PER_CPU * cpus
    cap = _node_memory_cap()
    started = time.time()

    biggest = max(sum((f["train_rows"] + f["val_rows"]) for f in g) for g in groups) * row_bytes
    map_task = ray.remote(_map_group).options(memory=_memory_request(3 * biggest + _TASK_OVERHEAD, cap))
    calls, running = [], {name: 0 for name in SPLITS}
    for index, group in enumerate(groups):
        offsets = dict(running)
        entries = [{"path": str(f["path"]), "train_rows": f["train_rows"], "val_rows": f["val_rows"]} for f in group]
        calls.append(lambda i=index, e=entries, o=offsets: map_task.remote(
            i, e, o, plans, seed, row_len, token_dtype, vocab_size, str(work), hash_inputs))
        for f in group:
            for name in SPLITS:
                running[name] += f[f"{name}_rows"]
    map_results = run_bounded(calls, limit, "map tasks")
    map_s = time.time() - started
    for name in SPLITS:
        write_split_index(work, name, len(groups), num_shards)

    calls = []
    for name, plan in plans.items():
        reducer_bytes = plan["shards_per_reducer"] * plan["rows_per_shard"] * row_bytes
        reduce_task = ray.remote(_reduce).options(memory=_memory_request(3 * reducer_bytes + _TASK_OVERHEAD, cap))
        for r in range(plan["reducers"]):
            calls.append(lambda n=name, r=r, p=plan, t=reduce_task: t.remote(
                n, r, p, str(work), row_len, token_dtype, row_group_size))
    reduce_results = run_bounded(calls, limit, "reducers")

    for name in SPLITS:
        written = sorted(p.name for p in (work / "out" / name).glob("*.parquet"))
        if written != [f"{r:05d}.parquet" for r in range(num_shards)]:
            raise RuntimeError(f"shuffle wrote {len(written)} {name} shards, expected {num_shards}")
    last_run_stats.clear()
    last_run_stats.update(
        map_tasks=len(groups), reducers=len(calls), map_s=map_s, total_s=time.time() - started,
        intermediate_bytes_written=sum(r["bytes_written"] for r in map_results),
        intermediate_bytes_read=sum(r["bytes_read"] for r in reduce_results),
        shard_bytes_written=sum(r["bytes_written"] for r in reduce_results),
        map_files_opened=sum(r["map_files_opened"] for r in reduce_results),
        max_task_peak_rss_mib=max(r["peak_rss_mib"] for r in map_results + reduce_results))

    if hash_inputs:  # local packed inputs: record the sha256 of every file read (Hub files carry theirs)
        digests = {path: digest for r in map_results for path, digest in (r["sha256"] or {}).items()}
        for info in manifest_extra.get("sources", {}).values():
            for f in info.get("files", []):
                root = info.get("local_dir")
                if root and f.get("hash") is None:
                    f["hash"] = digests.get(str(Path(root) / f["path"]))
    manifest = {
        "format": "huginn_ray.shards/2",
        "fingerprint": fingerprint,
        "num_shards": num_shards,
        "seq_len": row_len - 1,
        "row_len": row_len,
        "token_dtype": token_dtype,
        "seed": seed,
        "row_group_size": row_group_size,
        "rows_per_shard": {name: plans[name]["rows_per_shard"] for name in SPLITS},
        "tokens_per_shard": {name: plans[name]["rows_per_shard"] * row_len for name in SPLITS},
        "total_rows": {name: plans[name]["kept"] for name in SPLITS},
        "dropped_surplus_rows": {name: plans[name]["dropped"] for name in SPLITS},
        **manifest_extra,
    }
    layout.write_json(work / "out" / MANIFEST, manifest)
    layout.replace_dir(work / "out", shard_root)
    shutil.rmtree(work)
    for name in SPLITS:
        print(f"[shuffle] {name}: {num_shards} shards x {plans[name]['rows_per_shard']} rows "
              f"({plans[name]['dropped']} surplus rows dropped)", flush=True)
    return manifest


_REQUIRED = {
    "num_shards": int, "seq_len": int, "seed": int, "rows_per_shard": dict, "tokens_per_shard": dict,
    "tokenizer_sha256": str, "vocab_size": int, "input_fingerprint": str, "dropped_surplus_rows": dict,
}


def read_manifest(shard_dir: str | Path) -> dict:
    """Load and validate `<shard_dir>/manifest.json`; errors name the file and the offending key."""
    path = Path(shard_dir) / MANIFEST
    if not path.is_file():
        raise ValueError(f"shard manifest not found: {path} (run jobs/prepare_data.py first)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path}: expected a JSON object")
    for key, kind in _REQUIRED.items():
        if key not in manifest:
            raise ValueError(f"{path}: missing key {key!r}")
        if not isinstance(manifest[key], kind) or isinstance(manifest[key], bool):
            raise ValueError(f"{path}: key {key!r} should be {kind.__name__}, got {manifest[key]!r}")
    for key in ("rows_per_shard", "tokens_per_shard", "dropped_surplus_rows"):
        for split in SPLITS:
            value = manifest[key].get(split)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{path}: {key}.{split} should be a non-negative integer, got {value!r}")
    dtype = manifest.setdefault("token_dtype", "int32")  # manifests before 16-bit storage held int32 rows
    if dtype not in DTYPES:
        raise ValueError(f"{path}: token_dtype should be one of {', '.join(DTYPES)}, got {dtype!r}")
    if manifest["num_shards"] <= 0 or manifest["seq_len"] <= 0:
        raise ValueError(f"{path}: num_shards and seq_len must be positive")
    for split in SPLITS:
        if manifest["tokens_per_shard"][split] != manifest["rows_per_shard"][split] * (manifest["seq_len"] + 1):
            raise ValueError(f"{path}: tokens_per_shard.{split} != rows_per_shard.{split} * (seq_len + 1)")
    return manifest

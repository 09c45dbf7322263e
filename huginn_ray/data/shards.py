"""Global shuffle of all packed rows into exactly N train and N validation shards, plus the shard manifest.

Packed rows have a deterministic global order: packed files sorted by name, rows in file order. For each split
with T rows, rows_per_shard = T // N and the first N * rows_per_shard positions of a seeded pseudo-random
permutation of [0, T) are kept (the surplus T mod N rows are dropped and reported). A row at global index g goes
to position p = perm(g): shard p // rows_per_shard, slot p % rows_per_shard. The permutation is a keyed Feistel
network with cycle walking, so every row is placed exactly once, with no table of T entries anywhere.

Ray tasks do a map/reduce: a map task per ~`shuffle.reducer_mib` of packed files sends each row to the reducer
that owns its shard; each reducer holds about `shuffle.reducer_mib` of rows, orders them by slot and writes its
shards (`train/RRRRR.parquet`, `val/RRRRR.parquet`, column `input_ids` list<int32>, row groups of the configured
size).
Validation rows were held out before packing (huginn_ray/data/tokenize_pack.py) and are shuffled only among
themselves.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from huginn_ray.data import layout
from huginn_ray.data.tokenize_pack import TRAIN, VAL

SPLITS = {"train": TRAIN, "val": VAL}
MANIFEST = "manifest.json"
SHARD_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32()))])
_MASK64 = np.uint64(2**64 - 1)


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


def _map_files(paths: list[str], offsets: dict, plans: dict, seed: int) -> list:
    """Ray task: route the rows of consecutive packed files to the reducers of their shards.

    `offsets` gives each split's global index of the first row of paths[0]; rows are numbered in file order.
    """
    per_reducer: list[list[pa.Table]] = [[] for name in SPLITS for _ in range(plans[name]["reducers"])]
    running = dict(offsets)
    for path in paths:
        table = pq.read_table(path, columns=["input_ids", "split"])
        column = 0
        for name, code in SPLITS.items():
            plan = plans[name]
            rows = table.filter(pc.equal(table.column("split"), code)).select(["input_ids"])
            count = rows.num_rows
            position = FeistelPermutation(plan["rows"], seed, code)(running[name] + np.arange(count, dtype=np.int64))
            running[name] += count
            kept = position < plan["kept"]
            reducer = (position // plan["rows_per_shard"]) // plan["shards_per_reducer"]
            # kept rows grouped by reducer, each group still in row order (stable sort of ascending indices)
            kept_rows = np.nonzero(kept)[0]
            by_reducer = kept_rows[np.argsort(reducer[kept_rows], kind="stable")]
            bounds = np.searchsorted(reducer[by_reducer], np.arange(plan["reducers"] + 1))
            for r in range(plan["reducers"]):
                take = by_reducer[bounds[r] : bounds[r + 1]]
                per_reducer[column].append(
                    rows.take(pa.array(take)).append_column("position", pa.array(position[take])))
                column += 1
    return [pa.concat_tables(pieces) for pieces in per_reducer]


def _group_files(files: list[dict], row_bytes: int, group_bytes: int) -> list[list[dict]]:
    """Consecutive packed files in groups of about `group_bytes` of rows: one map task each, so the number of
    intermediate objects (map tasks x reducers) stays (data size / group size) x reducers."""
    groups: list[list[dict]] = [[]]
    size = 0
    for f in files:
        if groups[-1] and size + (f["train_rows"] + f["val_rows"]) * row_bytes > group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(f)
        size += (f["train_rows"] + f["val_rows"]) * row_bytes
    return [g for g in groups if g]


def _reduce(split: str, reducer: int, plan: dict, out_dir: str, row_group_size: int, *pieces: pa.Table) -> list:
    """Ray task: order one reducer's rows by position and write its shards."""
    table = pa.concat_tables(pieces)
    table = table.take(pc.sort_indices(table.column("position")))
    positions = table.column("position").to_numpy()
    first = reducer * plan["shards_per_reducer"]
    written = []
    for shard in range(first, min(plan["num_shards"], first + plan["shards_per_reducer"])):
        lo, hi = np.searchsorted(positions, [shard * plan["rows_per_shard"], (shard + 1) * plan["rows_per_shard"]])
        rows = table.slice(lo, hi - lo).select(["input_ids"])
        if rows.num_rows != plan["rows_per_shard"]:
            raise RuntimeError(f"{split} shard {shard}: {rows.num_rows} rows, expected {plan['rows_per_shard']}")
        path = shard_path(out_dir, split, shard)
        tmp = path.with_name(path.name + ".tmp")
        pq.write_table(rows.cast(SHARD_SCHEMA), tmp, row_group_size=row_group_size)
        tmp.rename(path)
        written.append(shard)
    return written


def run_shuffle(pack_marker: dict, packed_root: Path, shard_root: Path, *, num_shards: int, seed: int,
                row_group_size: int, reducer_mib: int, fingerprint: str, manifest_extra: dict) -> dict:
    """Shuffle packed rows into shards (skipped when complete); returns the manifest."""
    import ray

    existing = layout.read_marker(shard_root, MANIFEST)
    if existing is not None and existing.get("fingerprint") == fingerprint:
        print(f"[shuffle] complete ({num_shards} + {num_shards} shards), skipped", flush=True)
        return existing

    row_len = pack_marker["seq_len"] + 1
    files = pack_marker["files"]
    plans = {name: plan_split(sum(f[f"{name}_rows"] for f in files), num_shards, row_len * 4 + 8,
                              reducer_mib << 20, name) for name in SPLITS}
    tmp = layout.tmp_dir_for(shard_root)
    for name in SPLITS:
        (tmp / name).mkdir()

    num_pieces = sum(plan["reducers"] for plan in plans.values())
    map_task = ray.remote(_map_files).options(num_returns=num_pieces)
    running = {name: 0 for name in SPLITS}
    piece_refs = []
    for group in _group_files(files, row_len * 4, reducer_mib << 20):
        refs = map_task.remote([str(packed_root / f["file"]) for f in group], dict(running), plans, seed)
        piece_refs.append([refs] if num_pieces == 1 else refs)
        for f in group:
            for name in SPLITS:
                running[name] += f[f"{name}_rows"]

    reduce_task = ray.remote(_reduce)
    pending = []
    column = 0
    for name, plan in plans.items():
        for r in range(plan["reducers"]):
            inputs = [refs[column] for refs in piece_refs]
            pending.append(reduce_task.remote(name, r, plan, str(tmp), row_group_size, *inputs))
            column += 1
    done = 0
    total = len(pending)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)
        done += 1
        print(f"[shuffle] reducers done: {done}/{total}", flush=True)

    for name in SPLITS:
        written = sorted(p.name for p in (tmp / name).glob("*.parquet"))
        if written != [f"{r:05d}.parquet" for r in range(num_shards)]:
            raise RuntimeError(f"shuffle wrote {len(written)} {name} shards, expected {num_shards}")

    manifest = {
        "format": "huginn_ray.shards/1",
        "fingerprint": fingerprint,
        "num_shards": num_shards,
        "seq_len": pack_marker["seq_len"],
        "row_len": row_len,
        "seed": seed,
        "row_group_size": row_group_size,
        "rows_per_shard": {name: plans[name]["rows_per_shard"] for name in SPLITS},
        "tokens_per_shard": {name: plans[name]["rows_per_shard"] * row_len for name in SPLITS},
        "total_rows": {name: plans[name]["kept"] for name in SPLITS},
        "dropped_surplus_rows": {name: plans[name]["dropped"] for name in SPLITS},
        **manifest_extra,
    }
    layout.write_json(tmp / MANIFEST, manifest)
    layout.replace_dir(tmp, shard_root)
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
    if manifest["num_shards"] <= 0 or manifest["seq_len"] <= 0:
        raise ValueError(f"{path}: num_shards and seq_len must be positive")
    for split in SPLITS:
        if manifest["tokens_per_shard"][split] != manifest["rows_per_shard"][split] * (manifest["seq_len"] + 1):
            raise ValueError(f"{path}: tokens_per_shard.{split} != rows_per_shard.{split} * (seq_len + 1)")
    return manifest

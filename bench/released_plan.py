"""`--plan` of the released configuration (configs/data/huginn_released.yaml) on a mimic of the downloaded release.

    PYTHONPATH=. python bench/released_plan.py [--dir /tmp/hr_released_plan] [--tokens 800e9]

The release cannot be fetched here (no network, 6.4 TB), so the bench writes what the plan reads of a downloaded
one: the download stage's provenance (`download/huginn-dataset/_provenance.json`: 4096 train + 4096 val files
with their sizes) and, for every file, a parquet file whose footer holds the file's row count and column type
(list<int64>, rows of no ids: the plan reads footers, never rows). Row counts: `--tokens` packed tokens in rows of
4,097 ids, 95 % train and 5 % validation (the reference's split), spread evenly over each split's 4096 files;
sizes: 8 bytes per id (int64, the README's 4 x 1.6 TB = 6.4 TB). Then it runs the plan twice (the second reads
the first's cache when the package caches plans) and prints the figures as JSON. The disk check is replaced
(this machine has no 13 TB free); nothing else is.

Run it with another checkout's package on PYTHONPATH to compare (the script itself only uses
`huginn_ray.data.plan.build_plan`, `load_data_config` and `load_sources`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
ROW_LEN, FILES = 4097, 4096


def write_mimic(out: Path, tokens: float) -> None:
    rows = tokens / ROW_LEN
    per_file = {"train": round(rows * 0.95 / FILES), "val": round(rows * 0.05 / FILES)}
    folder = out / "download" / "huginn-dataset"
    listed = []
    for split, n in per_file.items():
        (folder / split).mkdir(parents=True, exist_ok=True)
        table = pa.table({"input_ids": pa.array([[]] * n, pa.list_(pa.int64()))})
        for i in range(FILES):
            rel = f"{split}/{i:04d}_00000.parquet"
            pq.write_table(table, folder / rel)
            listed.append({"path": rel, "size": n * ROW_LEN * 8, "sha256": None, "git_sha1": None})
    (folder / "_provenance.json").write_text(json.dumps({
        "source": "huginn-dataset", "commit": "0" * 40, "files": listed,
        "request": {"address": "tomg-group-umd/huginn-dataset", "revision": "main",
                    "patterns": ["train/*.parquet", "val/*.parquet"]}}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/hr_released_plan")
    parser.add_argument("--tokens", type=float, default=800e9)
    args = parser.parse_args()
    from huginn_ray.data import plan as plan_mod
    from huginn_ray.data.config import load_data_config
    from huginn_ray.data.sources import load_sources

    out = Path(args.dir)
    if not (out / "download" / "huginn-dataset" / "_provenance.json").is_file():
        write_mimic(out, args.tokens)
    plan_mod.check_disk = lambda cfg, peak: {"output_dir_bytes": 0, "free_bytes": 0}
    cfg = load_data_config(ROOT / "configs" / "data" / "huginn_released.yaml",
                           [f"output_dir={out}", f"tokenizer.path={out / 'no_tokenizer'}"])
    sources = load_sources(cfg.sources)
    for attempt in ("first", "second"):
        started = time.perf_counter()
        plan = plan_mod.build_plan(cfg, sources)
        seconds = time.perf_counter() - started
        print(json.dumps({"plan": attempt, "seconds": round(seconds, 2), "cached": plan.get("cached"),
                          **{key: plan.get(key) for key in ("estimated_tokens", "input_bytes", "peak_disk_bytes",
                                                            "disk_after_stage_bytes", "io_bytes", "reshard_method",
                                                            "estimated_seconds", "counts")}}))


if __name__ == "__main__":
    main()

"""Prepare training data: download -> staging -> filter -> tokenize/pack -> global shuffle into per-rank shards.

    python jobs/prepare_data.py --config configs/data/demo.yaml [--stage pack ...] [--quiet] [key=value ...]
    python jobs/prepare_data.py --config configs/data/huginn.yaml --plan [--json]   # nothing is written
    python jobs/prepare_data.py --config configs/data/demo.yaml --gc-shards        # delete old shard versions
    ray job submit --working-dir . -- python jobs/prepare_data.py --config configs/data/huginn.yaml

Started directly it runs on a private local Ray; under `ray job submit` it uses that cluster (output_dir must
then be on storage every node sees). `<output_dir>/LOCK` (huginn_ray/train/runlock.py, as for a training run)
refuses a second driver on the same output_dir while the first is alive. Outputs are described in huginn_ray/data/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from huginn_ray.config import ConfigError
from huginn_ray import storage
from huginn_ray.data import layout
from huginn_ray.data.bucket_publish import remove_old_versions as remove_bucket_versions
from huginn_ray.data.bucket_sources import mirror_bucket_inputs
from huginn_ray.data.config import load_data_config
from huginn_ray.data.pipeline import (STAGES, check_chat_not_mixed, check_sources, eval_ngrams, init_ray,
                                      packed_only, print_last_error, root_error, run)
from huginn_ray.data.plan import build_plan, format_plan
from huginn_ray.data.sources import load_sources
from huginn_ray.train.runlock import RunLock, RunLockError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="data config YAML (see configs/data/)")
    parser.add_argument("--stage", choices=STAGES, action="append",
                        help="run only this stage (repeatable); default: all stages in order")
    parser.add_argument("--plan", action="store_true",
                        help="print what the run means (files, bytes, tokens, disk, memory, time) and exit; "
                             "nothing is downloaded or written")
    parser.add_argument("--json", action="store_true", help="with --plan: one JSON object instead of the table")
    parser.add_argument("--gc-shards", action="store_true",
                        help="delete every published shard version but the current one (<output_dir>/shards.vNNNN; "
                             "a training run reads the version it started with to its end: only when none reads an "
                             "old one) and exit")
    parser.add_argument("--quiet", action="store_true", help="no Ray Data progress bars (the stages' own lines stay)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. num_shards=8")
    args = parser.parse_args(argv)
    try:
        cfg = load_data_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"prepare_data: config error: {err}", file=sys.stderr)
        return 2
    if args.plan:
        try:
            # the plan samples the files of bucket sources from their local copies
            sources = mirror_bucket_inputs(cfg, load_sources(cfg.sources), quiet=args.json)
            # lists mixing packed or chat sources with others are refused; sources a run cannot fetch are
            # planned without and named (a run refuses them: check_sources)
            packed_only(sources)
            check_chat_not_mixed(sources)
            # the evaluation n-gram set, unless a Hub evaluation set would have to be fetched for it
            plan = build_plan(cfg, sources, eval_ngrams(cfg, fetch=False))
        except Exception as err:
            print(f"prepare_data: error: {root_error(err)}", file=sys.stderr)
            return 1
        print(json.dumps(plan, sort_keys=True) if args.json else format_plan(plan), flush=True)
        return 0
    start = time.time()
    lock = RunLock(cfg.root)  # one driver per output_dir, checked before Ray starts
    try:
        message = lock.acquire()
    except RunLockError as err:
        print(f"prepare_data: error: {err}", file=sys.stderr)
        return 1
    if message:
        print(f"prepare_data: {message}", flush=True)
    if args.gc_shards:
        try:
            for path in (remove_bucket_versions(cfg.output_dir) if cfg.in_bucket
                         else layout.remove_old_versions(cfg.root / "shards")):
                print(f"prepare_data: removed {path}", flush=True)
        finally:
            lock.release()
        return 0
    stop_ray, error = None, None
    try:
        check_sources(load_sources(cfg.sources))  # a list the pipeline refuses is refused before Ray starts
        stop_ray = init_ray(cfg, quiet=args.quiet)
        manifest = run(cfg, tuple(args.stage) if args.stage else STAGES)
    except Exception as err:
        error = str(root_error(err))
    finally:
        if stop_ray is not None:
            stop_ray()
        lock.release()
    if error is not None:
        print_last_error("prepare_data", error)
        return 1
    if not args.stage or "shuffle" in args.stage:
        print(f"prepare_data: {manifest['num_shards']} train + {manifest['num_shards']} val shards in "
              f"{storage.join(cfg.output_dir, 'shards')} ({manifest['rows_per_shard']['train']} / "
              f"{manifest['rows_per_shard']['val']} "
              f"rows each) in {time.time() - start:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

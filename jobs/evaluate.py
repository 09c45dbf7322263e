"""Evaluate a checkpoint: loss against recurrence depth on the validation shards, or lm-eval tasks.

    python jobs/evaluate.py --checkpoint DIR --data-dir SHARD_DIR [--out DIR] [--depths 1,2,4,8,16,32,64]
        [--max-rows N] [key=value ...]
    python jobs/evaluate.py --checkpoint DIR --lm-eval TASKS [--include-path YAML_DIR] [--num-steps 32]
        [--limit N] [--out DIR]

Depth scaling runs one Ray task per (validation shard, depth) on the cluster in $RAY_ADDRESS, else on a private
local Ray, and writes a table to the console and depth_scaling.csv + depth_scaling.png into --out (default:
an eval/ directory beside the checkpoint). lm-eval exports the checkpoint to <out>/hf and runs EleutherAI's
harness on it through HFLM (pip install -e .[eval]). Both log metrics and files to the checkpoint's MLflow run
(or a new run when the checkpoint has none). key=value: batch_size, seed, mlflow_uri, experiment, tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from huginn_ray.model.pretrained import resolve_model_dir

OPTIONS = {"batch_size": int, "seed": int, "mlflow_uri": str, "experiment": str, "tokenizer": str}


def find_tracking(model_dir: Path) -> tuple[str | None, str | None]:
    """The MLflow store and run of the training run that wrote this checkpoint, when there is one."""
    run_id, uri = None, None
    for parent in [model_dir, *model_dir.parents]:
        state = parent / "trainer_state.json"
        if run_id is None and state.is_file():
            run_id = json.loads(state.read_text()).get("mlflow_run_id")
        if uri is None and (parent / "mlflow" / "mlflow.db").is_file():
            uri = f"sqlite:///{(parent / 'mlflow' / 'mlflow.db').resolve()}"
    return uri, run_id


def mlflow_run(model_dir: Path, out: Path, options: dict) -> tuple[str, str]:
    from mlflow.tracking import MlflowClient

    uri, run_id = find_tracking(model_dir)
    uri = options.get("mlflow_uri") or uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri is None:
        (out / "mlflow").mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{(out / 'mlflow' / 'mlflow.db').resolve()}"
    client = MlflowClient(uri)
    if run_id is not None and options.get("mlflow_uri") is None:
        try:
            client.get_run(run_id)
            return uri, run_id
        except Exception:
            pass
    name = options.get("experiment", "huginn-eval")
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(
        name, artifact_location=(out / "mlflow" / "artifacts").resolve().as_uri() if uri.startswith("sqlite") else None)
    run = client.create_run(experiment_id, run_name=f"eval {model_dir}", tags={"huginn.checkpoint": str(model_dir)})
    return uri, run.info.run_id


def tokenizer_for(model_dir: Path, data_dir: Path | None, options: dict) -> Path | None:
    from huginn_ray.model.export import find_tokenizer

    if options.get("tokenizer"):
        return Path(options["tokenizer"])
    found = find_tokenizer(model_dir)
    if found is None and data_dir is not None and (data_dir.parent / "tokenizer" / "tokenizer.json").is_file():
        found = data_dir.parent / "tokenizer"
    return found


def run_depth_scaling(args, model_dir: Path, out: Path, options: dict) -> int:
    import ray
    from mlflow.tracking import MlflowClient

    from huginn_ray.cluster.local_ray import init_local_ray

    from huginn_ray.data.tokenizer import special_token_ids
    from huginn_ray.eval.depth_scaling import depth_scaling, format_table, plot, write_csv
    from huginn_ray.model.config import ModelConfig

    data_dir = Path(args.data_dir)
    tokenizer = tokenizer_for(model_dir, data_dir, options)
    if tokenizer is None:
        raise ValueError("no tokenizer found beside the model or the shards: pass tokenizer=DIR (for pad/eos ids)")
    ids = special_token_ids(tokenizer)
    depths = [int(d) for d in args.depths.split(",")]
    config = ModelConfig.from_json(model_dir / "config.json")
    local = None
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
    else:
        local = tempfile.mkdtemp(prefix="hr_", dir="/tmp")
        init_local_ray(_temp_dir=local, num_cpus=os.cpu_count())  # token auth: Ray listens on every interface
    try:
        rows = depth_scaling(model_dir, data_dir, depths, max_rows=args.max_rows,
                             batch_size=options.get("batch_size", 8), seed=options.get("seed", 233),
                             pad_id=ids["pad"], eos_id=ids["eos"])
    finally:
        ray.shutdown()
        if local:
            shutil.rmtree(local, ignore_errors=True)
    print(format_table(rows))
    out.mkdir(parents=True, exist_ok=True)
    csv_path = write_csv(rows, out / "depth_scaling.csv")
    png_path = plot([r.depth for r in rows], [r.loss for r in rows], out / "depth_scaling.png",
                    config.mean_recurrence, f"{config.name}: validation loss by test-time depth",
                    flops=[r.flops_per_token for r in rows])
    uri, run_id = mlflow_run(model_dir, out, options)
    client = MlflowClient(uri)
    for r in rows:
        for key in ("loss", "ppl", "flops_per_token"):
            client.log_metric(run_id, f"eval/{key}_depth_{r.depth}", getattr(r, key))
    client.log_artifact(run_id, str(csv_path), artifact_path="depth_scaling")
    client.log_artifact(run_id, str(png_path), artifact_path="depth_scaling")
    print(f"[huginn] table: {csv_path}")
    print(f"[huginn] plot: {png_path}")
    print(f"[huginn] MLflow: {uri} (run {run_id})")
    return 0


def run_lm_eval(args, model_dir: Path, out: Path, options: dict) -> int:
    from mlflow.tracking import MlflowClient

    from huginn_ray.eval.lm_eval import evaluate_tasks
    from huginn_ray.model.export import export
    from huginn_ray.model.pretrained import load_pretrained

    tokenizer = tokenizer_for(model_dir, Path(args.data_dir) if args.data_dir else None, options)
    if tokenizer is None:
        raise ValueError("lm-eval needs a tokenizer: pass tokenizer=DIR")
    hf_dir = export(load_pretrained(model_dir), out / "hf", tokenizer)
    results = evaluate_tasks(hf_dir, args.lm_eval.split(","), num_steps=args.num_steps,
                             include_path=args.include_path, limit=args.limit, batch_size=options.get("batch_size", 1))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "lm_eval_results.json"
    path.write_text(json.dumps(results, indent=2, default=str))
    uri, run_id = mlflow_run(model_dir, out, options)
    client = MlflowClient(uri)
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                name = f"lm_eval/{task}/{key.replace(',', '_')}_steps_{args.num_steps}"
                client.log_metric(run_id, name, float(value))
                print(f"{task:>24} {key:>28} {value:.4f}")
    client.log_artifact(run_id, str(path), artifact_path="lm_eval")
    print(f"[huginn] results: {path}")
    print(f"[huginn] MLflow: {uri} (run {run_id})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="model dir, training checkpoint, or training out_dir")
    parser.add_argument("--data-dir", help="shard directory with val/*.parquet (depth scaling)")
    parser.add_argument("--out", help="output directory (default: eval/ beside the checkpoint)")
    parser.add_argument("--depths", default="1,2,4,8,16,32,64")
    parser.add_argument("--max-rows", type=int, default=None, help="rows per validation shard")
    parser.add_argument("--lm-eval", help="comma-separated lm-eval task names")
    parser.add_argument("--include-path", help="directory of local lm-eval task YAMLs")
    parser.add_argument("--num-steps", type=int, default=32, help="core iterations for lm-eval")
    parser.add_argument("--limit", type=int, default=None, help="lm-eval: examples per task")
    parser.add_argument("overrides", nargs="*", help="key=value: " + ", ".join(OPTIONS))
    args = parser.parse_args(argv)
    try:
        options = {}
        for item in args.overrides:
            key, sep, value = item.partition("=")
            if not sep or key not in OPTIONS:
                raise ValueError(f"unknown option {item!r}; known keys: {', '.join(OPTIONS)}")
            options[key] = OPTIONS[key](value)
        model_dir = resolve_model_dir(args.checkpoint)
        out = Path(args.out) if args.out else model_dir.parent / "eval"
        if args.lm_eval:
            return run_lm_eval(args, model_dir, out, options)
        if not args.data_dir:
            raise ValueError("--data-dir is required for depth scaling (or pass --lm-eval TASKS)")
        return run_depth_scaling(args, model_dir, out, options)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Evaluate a checkpoint: loss against recurrence depth on the validation shards, or lm-eval tasks.

    python jobs/evaluate.py --checkpoint DIR --data-dir SHARD_DIR [--out DIR] [--depths 1,2,4,8,16,32,64]
        [--max-rows N] [--device cpu|cuda] [--replicas N] [key=value ...]
    python jobs/evaluate.py --checkpoint DIR --lm-eval TASKS [--include-path YAML_DIR] [--num-steps 32]
        [--limit N] [--out DIR]
    python jobs/evaluate.py --checkpoint DIR --gsm8k TEST_JSONL [--num-steps 32 | --sweep [4,8,16,32,64]]
        [--limit N] [--out DIR] [--device cpu|cuda] [--replicas N] [dtype=bfloat16] [max_gen_toks=N] [seed=N]
    python jobs/evaluate.py --checkpoint DIR --gsm8k TEST_JSONL [--num-steps 32 | --sweep ...] --server URL
        [num_concurrent=8] [exit_criterion=kl] [exit_threshold=X] [max_gen_toks=N] [seed=N]

Depth scaling and GSM8k run as Ray Data batch inference over an actor pool of model replicas (--replicas N, one
per GPU or CPU actors; huginn_ray/eval/batch_inference.py) on the cluster in $RAY_ADDRESS, else on a private
local Ray; the results do not depend on the replica count. Depth scaling writes a table to the console and
depth_scaling.csv + depth_scaling.png into --out (default: an eval/ directory beside the checkpoint; required
for a checkpoint in a bucket, `s3://...`, which is read through this node's cache and handed to the replicas as
its URI: huginn_ray/model_cache.py). lm-eval exports the checkpoint to <out>/hf and runs EleutherAI's
harness on it through HFLM (pip install -e .[eval]). --gsm8k runs the paper's GSM8k recipe (huginn_ray/eval/gsm8k.py:
lm-eval's gsm8k_cot pinned in configs/eval/, chat template, the authors' system prompt, 32 iterations) on a local
JSONL copy of the test split, offline; with --sweep at each listed depth, writing gsm8k_depth_sweep.csv + .png.
With --server URL the GSM8k generations go through a running jobs/serve.py instead (lm-eval's local-completions,
num_concurrent requests at once, batched by the server's engine; huginn_ray/eval/server_lm.py), which must serve
this checkpoint; its API key from $HUGINN_API_KEY. The prompts and per-request seeds are the Ray Data path's;
with exit_criterion= (and exit_threshold=) every token exits the recurrence on that criterion.
All log metrics and files to the checkpoint's MLflow run (or a new run when the checkpoint has none).
--device: cpu or cuda (default: cuda when a GPU is present: for depth scaling and GSM8k, when the Ray cluster has
GPUs, one per replica). key=value: batch_size, seed (depth scaling: the latent noise's; GSM8k: request i is
generated after seeding torch with seed + i), mlflow_uri, experiment, tokenizer, dtype (float32 | bfloat16, the weights';
default bfloat16 on a GPU, else float32), max_gen_toks (GSM8k: overrides the pinned 256 for a model whose
block_size cannot hold it; recorded with the results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from huginn_ray.cluster.local_ray import connect_ray
from huginn_ray.eval.gsm8k import GSM8K_RECIPE
from huginn_ray.model.inference import inference_placement
from huginn_ray.model_cache import in_bucket, local_model_dir

OPTIONS = {"batch_size": int, "seed": int, "mlflow_uri": str, "experiment": str, "tokenizer": str, "dtype": str,
           "max_gen_toks": int, "num_concurrent": int, "exit_criterion": str, "exit_threshold": float}
SERVER_OPTIONS = ("num_concurrent", "exit_criterion", "exit_threshold")
"""Options of the evaluation through a server (--server) only."""


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


def mlflow_run(model_dir: Path, out: Path, options: dict, checkpoint: str) -> tuple[str, str]:
    """The checkpoint's own MLflow run, else a new one; `checkpoint` (--checkpoint) names a model in a bucket, whose
    `model_dir` is this node's copy."""
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
    named = checkpoint.rstrip("/") if in_bucket(checkpoint) else str(model_dir)
    run = client.create_run(experiment_id, run_name=f"eval {named}", tags={"huginn.checkpoint": named})
    return uri, run.info.run_id


def tokenizer_for(model_dir: Path, data_dir: Path | None, options: dict) -> Path | None:
    from huginn_ray.model.export import find_tokenizer

    if options.get("tokenizer"):
        return Path(options["tokenizer"])
    found = find_tokenizer(model_dir)
    if found is None and data_dir is not None and (data_dir.parent / "tokenizer" / "tokenizer.json").is_file():
        found = data_dir.parent / "tokenizer"
    return found


def replicas_for(args, options: dict):
    """The evaluation's model replicas on the connected cluster: --device (default cuda when the cluster has GPUs),
    dtype=, --replicas (default one per GPU, else 1)."""
    import ray

    from huginn_ray.eval.batch_inference import Replicas

    gpus = int(ray.cluster_resources().get("GPU", 0))
    device = args.device or ("cuda" if gpus else "cpu")
    placement = inference_placement(device, options.get("dtype"), check_present=False)  # the replicas' GPUs
    count = args.replicas or (gpus if placement.device.type == "cuda" else 1)
    replicas = Replicas(count, placement.device.type, placement.dtype_name)
    print(f"[huginn] {replicas.count} model replica(s) on {placement.describe()}", flush=True)
    return replicas


def server_for(args, options: dict):
    """The running server the GSM8k generations go through (--server), its key from $HUGINN_API_KEY."""
    from huginn_ray.eval.server_lm import Server
    from huginn_ray.serve.access import API_KEY_ENV

    for option, given in (("--replicas", args.replicas), ("--device", args.device), ("dtype=", options.get("dtype"))):
        if given is not None:
            raise ValueError(f"{option} places the Ray Data path's replicas; with --server the server's own "
                             f"replicas generate (jobs/serve.py's options)")
    server = Server(args.server, options.get("num_concurrent", 8), os.environ.get(API_KEY_ENV),
                    options.get("exit_criterion"), options.get("exit_threshold"))
    print(f"[huginn] generating through the server at {server.url} ({server.num_concurrent} requests at once)",
          flush=True)
    return server


def run_depth_scaling(args, model_dir: Path, out: Path, options: dict) -> int:
    from mlflow.tracking import MlflowClient

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
    with connect_ray(num_cpus=os.cpu_count()):  # on a private local Ray: every CPU of the machine
        # a model in a bucket reaches the replicas as its URI: each loads its own node's copy
        model = args.checkpoint.rstrip("/") if in_bucket(args.checkpoint) else model_dir
        rows = depth_scaling(model, data_dir, depths, replicas_for(args, options), max_rows=args.max_rows,
                             batch_size=options.get("batch_size", 8), seed=options.get("seed", 233),
                             pad_id=ids["pad"], eos_id=ids["eos"])
    print(format_table(rows))
    out.mkdir(parents=True, exist_ok=True)
    csv_path = write_csv(rows, out / "depth_scaling.csv")
    png_path = plot([r.depth for r in rows], [r.loss for r in rows], out / "depth_scaling.png",
                    config.mean_recurrence, f"{config.name}: validation loss by test-time depth",
                    flops=[r.flops_per_token for r in rows])
    uri, run_id = mlflow_run(model_dir, out, options, args.checkpoint)
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
    placement = inference_placement(args.device, options.get("dtype"))
    hf_dir = export(load_pretrained(model_dir), out / "hf", tokenizer)
    results = evaluate_tasks(hf_dir, args.lm_eval.split(","), num_steps=args.num_steps,
                             include_path=args.include_path, limit=args.limit, batch_size=options.get("batch_size", 1),
                             device=str(placement.device), dtype=placement.dtype_name)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "lm_eval_results.json"
    path.write_text(json.dumps(results, indent=2, default=str))
    uri, run_id = mlflow_run(model_dir, out, options, args.checkpoint)
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


def run_gsm8k(args, model_dir: Path, out: Path, options: dict) -> int:
    from mlflow.tracking import MlflowClient

    from huginn_ray.eval.gsm8k import evaluate_gsm8k, plot_sweep, sweep_rows, write_sweep_csv
    from huginn_ray.model.config import ModelConfig
    from huginn_ray.model.export import export
    from huginn_ray.model.pretrained import load_pretrained

    depths = [int(d) for d in args.sweep.split(",")] if args.sweep else [args.num_steps]
    if any(d < 1 for d in depths):
        raise ValueError(f"depths must be >= 1, got {depths}")
    tokenizer = tokenizer_for(model_dir, None, options)
    if tokenizer is None:
        raise ValueError("the GSM8k recipe needs a tokenizer (its chat template): pass tokenizer=DIR")
    hf_dir = export(load_pretrained(model_dir), out / "hf", tokenizer)
    settings = dict(limit=args.limit, max_gen_toks=options.get("max_gen_toks"), seed=options.get("seed", 0))
    started = time.monotonic()
    if args.server:
        server = server_for(args, options)
        report = evaluate_gsm8k(hf_dir, args.gsm8k, out / "tasks", depths, server, **settings)
    else:
        with connect_ray(num_cpus=os.cpu_count()):  # on a private local Ray: every CPU of the machine
            report = evaluate_gsm8k(hf_dir, args.gsm8k, out / "tasks", depths, replicas_for(args, options), **settings)
    report["settings"]["wall_s"] = round(time.monotonic() - started, 1)
    rows = sweep_rows(report)
    name = "gsm8k_depth_sweep" if args.sweep else "gsm8k"
    path = out / f"{name}.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    uri, run_id = mlflow_run(model_dir, out, options, args.checkpoint)
    client = MlflowClient(uri)
    print(f"{'depth':>6} {'strict-match':>13} {'flexible-extract':>17} {'problems':>9}")
    for r in rows:
        print(f"{r.depth:>6} {r.strict_match:>13.4f} {r.flexible_extract:>17.4f} {r.samples:>9}")
        client.log_metric(run_id, f"gsm8k/strict_match_depth_{r.depth}", r.strict_match)
        client.log_metric(run_id, f"gsm8k/flexible_extract_depth_{r.depth}", r.flexible_extract)
    client.log_artifact(run_id, str(path), artifact_path="gsm8k")
    if args.sweep:
        config = ModelConfig.from_json(model_dir / "config.json")
        csv_path = write_sweep_csv(rows, out / f"{name}.csv")
        png_path = plot_sweep(rows, out / f"{name}.png", config.mean_recurrence, f"{config.name}: GSM8k by depth")
        client.log_artifact(run_id, str(csv_path), artifact_path="gsm8k")
        client.log_artifact(run_id, str(png_path), artifact_path="gsm8k")
        print(f"[huginn] table: {csv_path}")
        print(f"[huginn] plot: {png_path}")
    print(f"[huginn] results and settings: {path} ({GSM8K_RECIPE.task}, system prompt, chat template, "
          f"{report['settings']['samples']} problems, generated in {report['settings']['wall_s']} s)")
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
    parser.add_argument("--num-steps", type=int, default=32, help="core iterations for lm-eval and GSM8k")
    parser.add_argument("--gsm8k", help="JSONL copy of GSM8k's test split: run the paper's GSM8k recipe")
    parser.add_argument("--sweep", nargs="?", const=",".join(str(d) for d in GSM8K_RECIPE.sweep_depths),
                        help="GSM8k at each of these depths (default %(const)s)")
    parser.add_argument("--limit", type=int, default=None, help="lm-eval: examples per task")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when a GPU is present)")
    parser.add_argument("--replicas", type=int, default=None,
                        help="depth scaling and GSM8k: model replicas (default: one per GPU of the cluster, else 1)")
    parser.add_argument("--server", help="GSM8k: generate through this running jobs/serve.py (its base URL, e.g. "
                                         "http://127.0.0.1:8000) instead of Ray Data replicas")
    parser.add_argument("overrides", nargs="*", help="key=value: " + ", ".join(OPTIONS))
    args = parser.parse_args(argv)
    try:
        options = {}
        for item in args.overrides:
            key, sep, value = item.partition("=")
            if not sep or key not in OPTIONS:
                raise ValueError(f"unknown option {item!r}; known keys: {', '.join(OPTIONS)}")
            options[key] = OPTIONS[key](value)
        if in_bucket(args.checkpoint) and not args.out:
            raise ValueError(f"--out is required with --checkpoint {args.checkpoint} (the results are local files)")
        model_dir = local_model_dir(args.checkpoint, log=print)
        out = Path(args.out) if args.out else model_dir.parent / "eval"
        if args.sweep and not args.gsm8k:
            raise ValueError("--sweep needs --gsm8k TEST_JSONL")
        if args.server and not args.gsm8k:
            raise ValueError("--server needs --gsm8k TEST_JSONL (the evaluation through a server runs the GSM8k "
                             "recipe)")
        for key in SERVER_OPTIONS:
            if key in options and not args.server:
                raise ValueError(f"{key}= applies to the evaluation through a server: pass --server URL")
        if args.gsm8k:
            return run_gsm8k(args, model_dir, out, options)
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

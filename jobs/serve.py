"""Serve a trained model over an OpenAI-compatible HTTP API on Ray Serve (huginn_ray/serve/README.md).

    python jobs/serve.py --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--replicas N] [--tokenizer DIR]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--max-rows 32] [--max-cache-gib 4] [--exit-wait-steps 2]
        [--admit-rows 1] [--[no-]cuda-graphs] [--compile] [--model-name NAME] [--api-key KEY]

DIR is a model directory, a training checkpoint, or a training out_dir (newest checkpoint); the tokenizer defaults
to one stored beside the model. DIR and --tokenizer may be in a bucket (`s3://...`: a model directory or a training
checkpoint): the driver checks its copy, and every replica is handed the URI and loads its own node's copy
(huginn_ray/model_cache.py, downloaded once per node). Each replica loads the model once (on one GPU with --device cuda, the default when
a GPU is present, else on one CPU) and runs one continuous-depth-batching engine. Listens on 127.0.0.1 unless
--host says otherwise. With --api-key KEY (or $HUGINN_API_KEY) every request must carry `Authorization: Bearer
KEY` (401 otherwise); an address other than loopback is refused without a key. Connects to the Ray cluster in
$RAY_ADDRESS, else starts a private local Ray with token authentication. Ctrl-C (SIGINT) or SIGTERM shuts the application down, stops the local Ray, and exits 0.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
from pathlib import PurePosixPath

from huginn_ray.console import local_ray_environment

if not os.environ.get("RAY_ADDRESS"):
    local_ray_environment()  # before `import ray`, which reads RAY_AUTH_MODE

import ray  # noqa: E402

from huginn_ray.cluster.local_ray import connect_ray  # noqa: E402
from huginn_ray.console import ray_connect_kwargs  # noqa: E402
from huginn_ray.generation.engine import EngineConfig  # noqa: E402
from huginn_ray.model.export import find_tokenizer  # noqa: E402
from huginn_ray.model.inference import DTYPES, inference_placement  # noqa: E402
from huginn_ray.model_cache import in_bucket, local_dir, local_model_dir  # noqa: E402
from huginn_ray.serve.access import API_KEY_ENV, check_access  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the one stored with the model)")
    parser.add_argument("--host", default="127.0.0.1", help="address the HTTP proxy listens on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--replicas", type=int, default=1, help="engine replicas (one GPU or one CPU each)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when a GPU is present)")
    parser.add_argument("--dtype", choices=list(DTYPES), help="weights' dtype (default: bfloat16 on a GPU, else float32)")
    parser.add_argument("--max-rows", type=int, default=32, help="sequences each engine advances at once")
    parser.add_argument("--max-cache-gib", type=float, default=4.0, help="key/value cache each engine may reserve")
    parser.add_argument("--exit-wait-steps", type=int, default=2,
                        help="decode steps between two finishes (coda, head, sampling, next prelude) over the slots "
                             "whose forwards ended (EngineConfig.exit_wait_steps: throughput for latency; 2: a "
                             "finish every third step, which served the most tokens/s under 8 clients on the CPU)")
    parser.add_argument("--admit-rows", type=int, default=1,
                        help="free rows an engine waits for before admitting queued requests together "
                             "(EngineConfig.admit_rows: throughput for time to first token)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction,
                        help="replay each kind of decode step as a captured CUDA graph (EngineConfig.cuda_graphs; "
                             "default: on with --device cuda, off on the CPU)")
    parser.add_argument("--compile", action="store_true",
                        help="compile each kind of decode step with torch.compile the first time it runs "
                             "(EngineConfig.compile: the same outputs, faster steps; that first step waits seconds)")
    parser.add_argument("--model-name", help="the model's name in the API (default: the directory's name)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"every request must send `Authorization: Bearer KEY` (default: ${API_KEY_ENV}; the "
                             f"variable keeps the key out of the process list); required off loopback")
    parser.add_argument("--verbose", action="store_true", help="Ray's own INFO lines on the console")
    args = parser.parse_args(argv)
    try:
        settings = plan(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    # explicitly: a process started in the background by a shell inherits SIGINT ignored
    signal.signal(signal.SIGINT, stop_on_signal)
    signal.signal(signal.SIGTERM, stop_on_signal)
    connection = None
    try:
        # a private Ray in a session of its own (LocalRayHead), so that a terminal's Ctrl-C reaches this driver
        # only, which then shuts Serve and Ray down in order
        connection = connect_ray(verbose=args.verbose, own_session=True,
                                 cluster_kwargs=ray_connect_kwargs(args.verbose))
        from ray import serve

        from huginn_ray.serve.app import build_app

        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(settings, args.replicas), name="huginn", route_prefix="/")
        print(f"[huginn] serving {settings.model_name} ({args.replicas} replica(s), {settings.device}, "
              f"{settings.dtype}) on http://{args.host}:{args.port}/v1"
              f"{' (API key required)' if settings.api_key else ''}; Ctrl-C stops it", flush=True)
        threading.Event().wait()
    except KeyboardInterrupt:
        print("[huginn] shutting down", flush=True)
    finally:
        if ray.is_initialized():
            from ray import serve

            serve.shutdown()
        if connection is not None:
            connection.stop()
    return 0


def stop_on_signal(signum, frame):
    raise KeyboardInterrupt


def plan(args) -> "ServeSettings":  # noqa: F821
    """The replicas' settings, every name and path checked before Ray starts; ValueError naming the option."""
    from huginn_ray.serve.app import ServeSettings

    check_access(args.host, args.api_key)
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    engine = engine_config(args)
    # the driver of a remote cluster may have no GPU itself: its replicas do
    placement = inference_placement(args.device, args.dtype, check_present=not os.environ.get("RAY_ADDRESS"))
    if args.cuda_graphs and placement.device.type != "cuda":
        raise ValueError(f"--cuda-graphs needs --device cuda, not {placement.device.type}")
    model_dir = local_model_dir(args.checkpoint, log=lambda line: print(line, flush=True)).resolve()
    tokenizer_dir = local_dir(args.tokenizer, "--tokenizer") if args.tokenizer else find_tokenizer(model_dir)
    if tokenizer_dir is None:
        raise ValueError(f"no tokenizer stored with {args.checkpoint}: pass --tokenizer")
    if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        raise ValueError(f"--tokenizer {args.tokenizer or tokenizer_dir}: no tokenizer.json there")
    named = PurePosixPath(args.checkpoint.rstrip("/")) if in_bucket(args.checkpoint) else model_dir
    name = args.model_name or (named.parent.name if named.name == "model" else named.name)
    # a model in a bucket reaches the replicas as its URI: each loads its own node's copy
    model = args.checkpoint.rstrip("/") if in_bucket(args.checkpoint) else str(model_dir)
    if args.tokenizer:
        tokenizer = args.tokenizer if in_bucket(args.tokenizer) else os.path.abspath(args.tokenizer)
    else:
        tokenizer = None if in_bucket(args.checkpoint) else os.path.abspath(tokenizer_dir)
    return ServeSettings(model_dir=model, tokenizer_dir=tokenizer, model_name=name, device=placement.device.type,
                         dtype=placement.dtype_name, engine=engine, api_key=args.api_key)


ENGINE_OPTIONS = {"max_rows": "--max-rows", "max_cache_bytes": "--max-cache-gib",
                  "exit_wait_steps": "--exit-wait-steps", "admit_rows": "--admit-rows"}
"""EngineConfig field -> the option that gives it."""


def engine_config(args) -> EngineConfig:
    """Each replica's engine capacities from the options. EngineConfig checks them (one place for serve and the
    engine); its refusal is raised here, before Ray starts, as a ValueError naming the option and the field."""
    gib = args.max_cache_gib
    try:  # a GiB count that is not finite reaches EngineConfig as it is, which refuses it as not an integer
        return EngineConfig(args.max_rows, int(gib * 2**30) if math.isfinite(gib) else gib, args.exit_wait_steps,
                            args.admit_rows, args.cuda_graphs, args.compile)
    except ValueError as err:
        message = str(err)
        field = min((message.find(name), name) for name in ENGINE_OPTIONS if name in message)[1]
        option = ENGINE_OPTIONS[field]
        raise ValueError(f"{option} {getattr(args, option[2:].replace('-', '_'))}: {message}") from None


if __name__ == "__main__":
    sys.exit(main())

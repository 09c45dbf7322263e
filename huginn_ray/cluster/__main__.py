"""Command line.

  python -m huginn_ray.cluster render [--slurm | --nodelist EXPR] TEMPLATE > cluster.yaml
  python -m huginn_ray.cluster rayjob --config CONFIG --out-dir s3://BUCKET/runs --image IMAGE \
      --mlflow-tracking-uri URI [--variant cpu|cuda|rocm] [--workers N] [--gpus-per-worker G] [key=value ...] \
      > rayjob.yaml
  python -m huginn_ray.cluster wait-for-nodes COUNT [--address HOST:PORT] [--timeout SECONDS]
"""

import argparse
import contextlib
import os
import sys
from pathlib import Path

from huginn_ray.cluster.kuberay import (
    DEFAULT_TEMPLATE,
    KubeRayError,
    RayJobRequest,
    SharedVolume,
    load_rayjob_template,
    render_rayjob,
)
from huginn_ray.cluster.render import RenderError, load_template, render, slurm_hosts, to_yaml
from huginn_ray.cluster.slurm import NodeListError, expand_nodelist
from huginn_ray.cluster.wait import ClusterWaitTimeout, wait_for_nodes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m huginn_ray.cluster")
    commands = parser.add_subparsers(dest="command", required=True)

    render_parser = commands.add_parser(
        "render", help="fill a cluster_yamls/ template with the hosts of an allocation; writes YAML to stdout"
    )
    hosts = render_parser.add_mutually_exclusive_group()
    hosts.add_argument("--slurm", action="store_true", help="hosts from SLURM_JOB_NODELIST, the first one is the head")
    hosts.add_argument("--nodelist", help="hosts from this Slurm node-list expression, e.g. 'frontier[00001-00004]'")
    render_parser.add_argument("template", help="a cluster YAML template, e.g. cluster_yamls/frontier.yaml")
    render_parser.set_defaults(run=_render)

    _add_rayjob_parser(commands)

    wait_parser = commands.add_parser("wait-for-nodes", help="block until COUNT Ray nodes are alive")
    wait_parser.add_argument("count", type=int, help="number of nodes, head included")
    wait_parser.add_argument("--address", default="127.0.0.1:6379", help="the head's GCS, host:port")
    wait_parser.add_argument("--timeout", type=float, default=1800, help="seconds before giving up")
    wait_parser.set_defaults(run=_wait)

    args = parser.parse_args(argv)
    return args.run(args)


def _render(args: argparse.Namespace) -> int:
    try:
        template = load_template(args.template)
        if args.slurm:
            host_list, suffix = slurm_hosts(), os.environ.get("SLURM_JOB_ID")
        elif args.nodelist:
            host_list, suffix = expand_nodelist(args.nodelist), None
        else:
            host_list, suffix = None, None
        # Ray's validation logs to stdout; stdout carries the YAML.
        with contextlib.redirect_stdout(sys.stderr):
            config = render(template, Path(args.template).parent, host_list, suffix)
    except (RenderError, NodeListError) as error:
        print(f"huginn_ray.cluster render: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(to_yaml(config))
    return 0


def _add_rayjob_parser(commands: argparse._SubParsersAction) -> None:
    rayjob = commands.add_parser(
        "rayjob", help="a KubeRay RayJob manifest for jobs/train.py (CPU head, GPU workers); writes YAML to stdout"
    )
    rayjob.add_argument("--config", required=True, help="training config, relative to the repository root")
    rayjob.add_argument("--out-dir", required=True, help="the run's out_dir: a bucket URI, s3://... or gs://...")
    rayjob.add_argument("--image", required=True, help="the image built from docker/Dockerfile for --variant")
    rayjob.add_argument("--variant", default="cuda", help="cpu, cuda or rocm (default cuda)")
    rayjob.add_argument("--workers", type=int, default=1, help="worker pods, one per GPU node (default 1)")
    rayjob.add_argument("--gpus-per-worker", type=int, help="GPUs per worker pod (default 1; none for cpu)")
    rayjob.add_argument("--mlflow-tracking-uri", help="the MLflow server (else the config's mlflow.tracking_uri)")
    rayjob.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                        help="environment of every pod, e.g. AWS_ENDPOINT_URL=...; NAME alone takes this shell's "
                             "value; credentials are refused (the service account provides them)")
    rayjob.add_argument("--service-account", help="the pods' service account (default: the template's)")
    rayjob.add_argument("--shared-volume", metavar="CLAIM:MOUNT_PATH",
                        help="a ReadWriteMany PersistentVolumeClaim every pod mounts; allows local paths under it")
    rayjob.add_argument("--name", help="the RayJob's name (default: the template's)")
    rayjob.add_argument("--namespace", help="the RayJob's namespace (default: kubectl's current one)")
    for flag, what in (("--worker-cpus", "CPU of a worker pod"), ("--worker-memory", "memory of a worker pod"),
                       ("--shm-size", "a worker pod's /dev/shm"), ("--head-cpus", "CPU of the head pod"),
                       ("--head-memory", "memory of the head pod")):
        rayjob.add_argument(flag, help=f"{what}, a Kubernetes quantity (default: the template's)")
    rayjob.add_argument("--backoff-limit", type=int, help="retries of a failed job (default: the template's)")
    rayjob.add_argument("--template", default=str(DEFAULT_TEMPLATE), help="the RayJob template")
    rayjob.add_argument("overrides", nargs="*", help="dotted key=value overrides of the config, e.g. max_steps=100")
    rayjob.set_defaults(run=_rayjob)


def _rayjob(args: argparse.Namespace) -> int:
    try:
        request = RayJobRequest(
            config=args.config, out_dir=args.out_dir, image=args.image, variant=args.variant, workers=args.workers,
            gpus_per_worker=args.gpus_per_worker, mlflow_tracking_uri=args.mlflow_tracking_uri,
            overrides=list(args.overrides), env=_env_arguments(args.env), name=args.name, namespace=args.namespace,
            service_account=args.service_account, shared_volume=_shared_volume_argument(args.shared_volume),
            worker_cpus=args.worker_cpus, worker_memory=args.worker_memory, shm_size=args.shm_size,
            head_cpus=args.head_cpus, head_memory=args.head_memory, backoff_limit=args.backoff_limit,
        )
        manifest = render_rayjob(load_rayjob_template(args.template), request)
    except KubeRayError as error:
        print(f"huginn_ray.cluster rayjob: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(to_yaml(manifest))
    return 0


def _env_arguments(items: list[str]) -> dict[str, str]:
    """`--env NAME=VALUE` as given; `--env NAME` with this shell's value of NAME."""
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            if name not in os.environ:
                raise KubeRayError(f"--env {name}: not set in this shell (give NAME=VALUE)")
            value = os.environ[name]
        env[name] = value
    return env


def _shared_volume_argument(text: str | None) -> SharedVolume | None:
    if text is None:
        return None
    claim, sep, mount_path = text.partition(":")
    if not sep or not claim or not mount_path:
        raise KubeRayError(f"--shared-volume {text!r} is not CLAIM:MOUNT_PATH")
    return SharedVolume(claim=claim, mount_path=mount_path)


def _wait(args: argparse.Namespace) -> int:
    try:
        alive = wait_for_nodes(args.address, args.count, args.timeout)
    except ClusterWaitTimeout as error:
        print(f"huginn_ray.cluster wait-for-nodes: {error}", file=sys.stderr)
        return 1
    print(f"{alive} Ray nodes alive at {args.address}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Command line.

  python -m huginn_ray.cluster render [--slurm | --nodelist EXPR] TEMPLATE > cluster.yaml
  python -m huginn_ray.cluster wait-for-nodes COUNT [--address HOST:PORT] [--timeout SECONDS]
"""

import argparse
import contextlib
import os
import sys
from pathlib import Path

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

"""Turn a cluster-YAML template plus a host list into a config that `ray up` can use as it is.

The templates in cluster_yamls/ describe what every node runs; only the hosts (and the ssh user) differ from one
Slurm allocation to the next. Rendering fills them in, makes the file-mount sources absolute (so the rendered YAML
works from any directory), checks that those sources exist, and runs Ray's own config validation, so a mistake
shows up here rather than halfway through `ray up`.
"""

import copy
import getpass
import os
from pathlib import Path
from typing import Any

import yaml

from huginn_ray.cluster.slurm import expand_nodelist


class RenderError(ValueError):
    """A template or host list that cannot become a valid cluster config; the message names the field or file."""


def load_template(path: str | os.PathLike) -> dict[str, Any]:
    """Read a cluster YAML template, refusing anything but Ray's on-premise (`local`) provider."""
    path = Path(path)
    if not path.is_file():
        raise RenderError(f"cluster template {path} does not exist")
    config = yaml.safe_load(path.read_text())
    if not isinstance(config, dict):
        raise RenderError(f"{path}: a cluster YAML must be a mapping, got {type(config).__name__}")
    provider_type = (config.get("provider") or {}).get("type")
    if provider_type != "local":
        raise RenderError(f"{path}: provider.type must be 'local' (on-premise), got {provider_type!r}")
    return config


def slurm_hosts(environ: dict[str, str] | None = None) -> list[str]:
    """The hosts of the current Slurm allocation, from SLURM_JOB_NODELIST."""
    environ = os.environ if environ is None else environ
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise RenderError("--slurm: SLURM_JOB_NODELIST is not set (run this inside an allocation: salloc/sbatch)")
    return expand_nodelist(nodelist)


def render(
    template: dict[str, Any],
    template_dir: str | os.PathLike,
    hosts: list[str] | None = None,
    cluster_suffix: str | None = None,
) -> dict[str, Any]:
    """A copy of `template` with hosts[0] as head and the rest as workers, ready for `ray up`.

    `hosts=None` keeps the template's own head_ip/worker_ips (cluster_yamls/local.yaml). `cluster_suffix` (the
    Slurm job id) keeps the launcher's per-cluster state of two allocations apart.
    """
    config = copy.deepcopy(template)
    provider = config["provider"]
    if hosts is not None:
        if not hosts:
            raise RenderError("the host list is empty: a cluster needs at least a head node")
        provider["head_ip"] = hosts[0]
        provider["worker_ips"] = list(hosts[1:])
    if not provider.get("head_ip"):
        raise RenderError("provider.head_ip is empty: pass --slurm or --nodelist")
    provider.setdefault("worker_ips", [])
    # Every node of the allocation joins: the launcher caps the worker count at max_workers.
    config["max_workers"] = len(provider["worker_ips"])
    if cluster_suffix:
        config["cluster_name"] = f"{config['cluster_name']}-{cluster_suffix}"
    auth = config.setdefault("auth", {})
    if not auth.get("ssh_user"):
        auth["ssh_user"] = getpass.getuser()
    config["file_mounts"] = _absolute_file_mounts(config.get("file_mounts") or {}, Path(template_dir))
    validate(config)
    return config


def _absolute_file_mounts(file_mounts: dict[str, str], template_dir: Path) -> dict[str, str]:
    """Resolve relative mount sources against the template's directory and check that they exist."""
    resolved = {}
    for remote, local in file_mounts.items():
        source = Path(os.path.expanduser(local))
        if not source.is_absolute():
            source = (template_dir / source).resolve()
        if not source.exists():
            example = source.parent / f"{source.name}.example"
            hint = f" (copy {example.name} to it and fill it in)" if example.exists() else ""
            raise RenderError(f"file_mounts[{remote!r}]: {source} does not exist{hint}")
        resolved[remote] = str(source)
    return resolved


def validate(config: dict[str, Any]) -> dict[str, Any]:
    """Run Ray's own cluster-config checks (the ones `ray up` runs) and return the prepared config."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(config)
    validate_config(prepared)
    return prepared


def to_yaml(config: dict[str, Any]) -> str:
    """The config as YAML text, keys in the template's order."""
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=120)

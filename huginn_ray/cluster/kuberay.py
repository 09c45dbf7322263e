"""A KubeRay `RayJob` manifest for jobs/train.py: a template from cluster_yamls/kuberay/ plus one run's settings.

The template holds what a site sets once (resources, /dev/shm, the service account, retries); a `RayJobRequest`
holds what changes per run (the config and its overrides, `out_dir` in a bucket, the image and its variant, the
worker count, GPUs per worker, the object store's endpoint). `render_rayjob` checks the request before anything is
written and refuses bad input naming the command-line argument; the manifest it returns holds no credentials:
pods reach the bucket through their service account.

Nodes of a Kubernetes cluster share no file system unless a volume is mounted on every pod, so every path the
job reads or writes (`out_dir`, `data.data_dir`, `data.tokenizer_path`, `init_from`) must be a bucket URI, or an
absolute path on the shared volume (`SharedVolume`) when there is one.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from huginn_ray.config import ConfigError, apply_overrides, read_yaml
from huginn_ray.redact import redact_uri

IMAGE_PROJECT_DIR = "/home/ray/huginn_ray"
"""Where docker/Dockerfile copies the repository in the image (its WORKDIR): the entrypoint's paths start here."""
GPU_RESOURCE = {"cpu": None, "cuda": "nvidia.com/gpu", "rocm": "amd.com/gpu"}
"""Image variant -> the Kubernetes extended resource of its GPUs (the device plugins' names)."""
VARIANT_ENV = {"rocm": {"RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1"}}
"""Environment a variant's pods need: on AMD nodes every worker sees the node's GPUs (huginn_ray.cluster.devices)."""
PATH_KEYS = ("out_dir", "data.data_dir", "data.tokenizer_path", "init_from")
"""Config keys the job reads or writes as paths: each must be reachable from every pod."""
RENDERED_KEYS = {"out_dir": "--out-dir", "scaling.num_workers": "--workers and --gpus-per-worker",
                 "scaling.use_gpu": "--variant", "mlflow.tracking_uri": "--mlflow-tracking-uri"}
"""Config keys the manifest sets from its arguments (an override of them is refused, naming the argument)."""
BUCKET_URI = re.compile(r"^(s3|gs)://[^/\s]+(/\S*)?$")
SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|ACCESS_KEY|SESSION|CREDENTIAL|PRIVATE|API_KEY", re.I)
"""Environment names that hold credentials: never in a manifest (the service account provides them)."""
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|m|k|M|G|T)?$")
QUANTITY_FACTOR = {None: 1, "m": 10**-3, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                   "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
MLFLOW_SCHEMES = ("http", "https", "databricks")
"""Tracking URIs a pod can reach without a shared file system: a server (its artifact store in the bucket)."""
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TEMPLATE = REPO_ROOT / "cluster_yamls" / "kuberay" / "rayjob.yaml"


class KubeRayError(ValueError):
    """A RayJob request or template that cannot become a manifest; the message names the argument or field."""


@dataclass
class SharedVolume:
    """A ReadWriteMany PersistentVolumeClaim mounted on every pod: the one case where local paths are allowed."""

    claim: str
    """The PersistentVolumeClaim's name."""
    mount_path: str
    """Where it is mounted in every pod (absolute); config paths under it are reachable from every pod."""


@dataclass
class RayJobRequest:
    """One training run on KubeRay. Fields left None take the template's value."""

    config: str
    """Training config, relative to the repository root (the image holds the same tree at IMAGE_PROJECT_DIR)."""
    out_dir: str
    """Where the run writes (checkpoints, run control): a bucket URI, s3://... or gs://..."""
    image: str
    """The container image of every pod, built from docker/Dockerfile for `variant`."""
    variant: str = "cuda"
    """cpu, cuda or rocm: the image's build and the GPUs the workers ask for (GPU_RESOURCE)."""
    workers: int = 1
    """Worker pods (one per GPU node)."""
    gpus_per_worker: int | None = None
    """GPUs per worker pod, one Ray Train worker each; None: 1 (cuda, rocm). The cpu variant takes none (one Ray
    Train worker per pod)."""
    mlflow_tracking_uri: str | None = None
    """The MLflow server (http(s)://, its artifact store in the bucket); None: the config's mlflow.tracking_uri."""
    overrides: list[str] = field(default_factory=list)
    """Dotted key=value overrides of the config, passed to jobs/train.py as they are."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment of every pod: the object store's endpoint and region (AWS_ENDPOINT_URL, AWS_DEFAULT_REGION);
    names that look like credentials are refused."""
    name: str | None = None
    """The RayJob's name (a DNS label)."""
    namespace: str | None = None
    """The RayJob's namespace; None: kubectl's current one."""
    service_account: str | None = None
    """The Kubernetes service account of every pod: it grants the bucket (IRSA, Workload Identity)."""
    shared_volume: SharedVolume | None = None
    """A volume every pod mounts, which allows local paths under it; None: buckets only."""
    worker_cpus: str | None = None
    """CPU of a worker pod (a Kubernetes quantity, limit = request)."""
    worker_memory: str | None = None
    """Memory of a worker pod (a Kubernetes quantity, limit = request); /dev/shm counts against it."""
    shm_size: str | None = None
    """A worker pod's /dev/shm (a memory-backed emptyDir)."""
    head_cpus: str | None = None
    """CPU of the head pod."""
    head_memory: str | None = None
    """Memory of the head pod."""
    backoff_limit: int | None = None
    """Retries of a failed job, each on a new RayCluster that resumes from the newest complete checkpoint."""


def load_rayjob_template(path: str | os.PathLike = DEFAULT_TEMPLATE) -> dict[str, Any]:
    """Read a RayJob template and check that it has the head and the one worker group that rendering fills."""
    path = Path(path)
    if not path.is_file():
        raise KubeRayError(f"--template: {path} does not exist")
    template = yaml.safe_load(path.read_text())
    if not isinstance(template, dict) or template.get("kind") != "RayJob" or template.get("apiVersion") != "ray.io/v1":
        raise KubeRayError(f"--template: {path} is not a RayJob of apiVersion ray.io/v1")
    cluster = (template.get("spec") or {}).get("rayClusterSpec") or {}
    groups = cluster.get("workerGroupSpecs") or []
    if len(groups) != 1:
        raise KubeRayError(f"--template: {path}: spec.rayClusterSpec.workerGroupSpecs must hold exactly one group "
                           f"(the GPU workers), it holds {len(groups)}")
    for where, group in (("headGroupSpec", cluster.get("headGroupSpec") or {}), ("workerGroupSpecs[0]", groups[0])):
        containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or []
        if len(containers) != 1:
            raise KubeRayError(f"--template: {path}: spec.rayClusterSpec.{where}.template.spec.containers must "
                               f"hold exactly one container (Ray's), it holds {len(containers)}")
    return template


def render_rayjob(template: dict[str, Any], request: RayJobRequest, repo_root: Path = REPO_ROOT) -> dict[str, Any]:
    """The manifest for `request`: a copy of `template` with the entrypoint, image, workers, GPUs, environment and
    resources filled in. Refuses bad input, naming the argument, before returning anything."""
    gpu_resource, gpus = _check_variant(request)
    workers = _positive_int(request.workers, "--workers")
    if not request.image or any(c.isspace() for c in request.image):
        raise KubeRayError(f"--image must name a container image, got {request.image!r}")
    _check_env(request.env)
    if request.shared_volume is not None:
        _check_dns_label(request.shared_volume.claim, "--shared-volume")
        if not os.path.isabs(request.shared_volume.mount_path):
            raise KubeRayError(f"--shared-volume: mount path {request.shared_volume.mount_path!r} is not absolute")
    entrypoint = _entrypoint(request, workers * (gpus or 1), repo_root)
    manifest = copy.deepcopy(template)
    if request.name is not None:
        _check_dns_label(request.name, "--name")
        manifest["metadata"]["name"] = request.name
    if request.namespace is not None:
        _check_dns_label(request.namespace, "--namespace")
        manifest["metadata"]["namespace"] = request.namespace
    spec = manifest["spec"]
    spec["entrypoint"] = entrypoint
    if request.backoff_limit is not None:
        if isinstance(request.backoff_limit, bool) or not isinstance(request.backoff_limit, int) \
                or request.backoff_limit < 0:
            raise KubeRayError(f"--backoff-limit must be an integer >= 0, got {request.backoff_limit!r}")
        spec["backoffLimit"] = request.backoff_limit
    head = spec["rayClusterSpec"]["headGroupSpec"]
    group = spec["rayClusterSpec"]["workerGroupSpecs"][0]
    group["replicas"] = group["minReplicas"] = group["maxReplicas"] = workers
    if gpu_resource:
        group.setdefault("rayStartParams", {})["num-gpus"] = str(gpus)
    env = {**VARIANT_ENV.get(request.variant, {}), **request.env}
    _fill_pod(head, request, env, cpus=request.head_cpus, memory=request.head_memory, shm=None,
              where="head", cpus_arg="--head-cpus", memory_arg="--head-memory")
    _fill_pod(group, request, env, cpus=request.worker_cpus, memory=request.worker_memory, shm=request.shm_size,
              where="worker", cpus_arg="--worker-cpus", memory_arg="--worker-memory")
    if gpu_resource:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        limits[gpu_resource] = gpus
    return manifest


def _check_variant(request: RayJobRequest) -> tuple[str | None, int | None]:
    """The GPU resource name and count per worker pod (None, None for the cpu variant)."""
    if request.variant not in GPU_RESOURCE:
        raise KubeRayError(f"--variant must be one of {', '.join(GPU_RESOURCE)}, got {request.variant!r}")
    gpu_resource = GPU_RESOURCE[request.variant]
    if gpu_resource is None:
        if request.gpus_per_worker is not None:
            raise KubeRayError(f"--gpus-per-worker={request.gpus_per_worker!r}: the cpu variant has no GPUs "
                               f"(use --variant cuda or rocm)")
        return None, None
    gpus = 1 if request.gpus_per_worker is None else request.gpus_per_worker
    return gpu_resource, _positive_int(gpus, "--gpus-per-worker")


def _positive_int(value: Any, argument: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KubeRayError(f"{argument} must be a positive integer, got {value!r}")
    return value


def _check_dns_label(value: str, argument: str) -> None:
    if not DNS_LABEL.match(value):
        raise KubeRayError(f"{argument}={value!r} is not a Kubernetes name (lower-case letters, digits and '-', "
                           f"at most 63 characters, starting and ending with a letter or digit)")


def _check_env(env: dict[str, str]) -> None:
    """Names are environment names that hold no credentials; values hold no credentials either."""
    for name, value in env.items():
        if not ENV_NAME.match(name):
            raise KubeRayError(f"--env {name!r}: not an environment variable name")
        if SECRET_NAME.search(name):
            raise KubeRayError(f"--env {name}: credentials never go into a manifest; the pods get them from their "
                               f"service account (--service-account)")
        if redact_uri(value) != value:
            raise KubeRayError(f"--env {name}: its value carries credentials ({redact_uri(value)}); the pods get "
                               f"them from their service account (--service-account)")


def _entrypoint(request: RayJobRequest, train_workers: int, repo_root: Path) -> str:
    """`python <image>/jobs/train.py --config <image>/<config> <overrides> out_dir=... scaling...`, checked."""
    config = _config_in_repo(request.config, repo_root)
    for item in request.overrides:
        key = item.partition("=")[0]
        if key in RENDERED_KEYS:
            raise KubeRayError(f"override {item!r}: the manifest sets {key} from {RENDERED_KEYS[key]}")
    rendered = [f"out_dir={request.out_dir}", f"scaling.num_workers={train_workers}",
                f"scaling.use_gpu={'false' if request.variant == 'cpu' else 'true'}"]
    if request.mlflow_tracking_uri is not None:
        rendered.append(f"mlflow.tracking_uri={request.mlflow_tracking_uri}")
    overrides = [*request.overrides, *rendered]
    try:
        settings = apply_overrides(read_yaml(repo_root / config), overrides)
    except ConfigError as error:
        raise KubeRayError(f"--config {config} with its overrides: {error}") from None
    _check_paths(settings, request)
    _check_tracking_uri(settings, request)
    argv = ["python", f"{IMAGE_PROJECT_DIR}/jobs/train.py", "--config", f"{IMAGE_PROJECT_DIR}/{config}", *overrides]
    return shlex.join(argv)


def _config_in_repo(config: str, repo_root: Path) -> str:
    """The config's path relative to the repository root, which the image holds at IMAGE_PROJECT_DIR."""
    path = Path(config)
    if path.is_absolute():
        try:
            path = path.resolve().relative_to(repo_root.resolve())
        except ValueError:
            raise KubeRayError(f"--config {config} is outside the repository ({repo_root}): the image holds only "
                               f"the repository's files") from None
    if not (repo_root / path).is_file():
        raise KubeRayError(f"--config {config}: no such file in the repository ({repo_root})")
    return path.as_posix()


def _setting(settings: dict, key: str) -> Any:
    node: Any = settings
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _check_paths(settings: dict, request: RayJobRequest) -> None:
    """Every path the job touches is a bucket URI, or an absolute path on the shared volume."""
    mount = request.shared_volume.mount_path.rstrip("/") if request.shared_volume else None
    for key in PATH_KEYS:
        value = _setting(settings, key)
        if not value:
            continue
        value = str(value)
        argument = "--out-dir" if key == "out_dir" else f"{key} (--config {request.config} or its override)"
        if BUCKET_URI.match(value):
            if redact_uri(value) != value:
                raise KubeRayError(f"{argument}: {redact_uri(value)} carries credentials")
            continue
        if mount and os.path.isabs(value) and (value + "/").startswith(mount + "/"):
            continue
        where = f"on the shared volume ({mount})" if mount else "shared by the pods (--shared-volume)"
        raise KubeRayError(f"{argument}={value!r} is not a bucket URI (s3://, gs://) nor a path {where}")


def _check_tracking_uri(settings: dict, request: RayJobRequest) -> None:
    """An MLflow server: SQLite in out_dir (the default) would be lost with the pods or written into a bucket."""
    uri = _setting(settings, "mlflow.tracking_uri")
    if not uri:
        raise KubeRayError("--mlflow-tracking-uri is required: the pods share no directory for MLflow's default "
                           "SQLite store (give a server, its artifact store in the bucket)")
    uri = str(uri)
    if uri.partition("://")[0] not in MLFLOW_SCHEMES:
        raise KubeRayError(f"--mlflow-tracking-uri={uri!r} must be a server ({', '.join(MLFLOW_SCHEMES)})")
    if redact_uri(uri) != uri:
        raise KubeRayError(f"--mlflow-tracking-uri={redact_uri(uri)} carries credentials; give the server's "
                           f"credentials to the pods through their service account, not the manifest")


def _fill_pod(group: dict, request: RayJobRequest, env: dict[str, str], *, cpus: str | None, memory: str | None,
              shm: str | None, where: str, cpus_arg: str, memory_arg: str) -> None:
    """Image, service account, environment, resources, /dev/shm and the shared volume of one group's pods."""
    pod = group["template"]["spec"]
    container = pod["containers"][0]
    container["image"] = request.image
    if request.service_account is not None:
        _check_dns_label(request.service_account, "--service-account")
        pod["serviceAccountName"] = request.service_account
    if not pod.get("serviceAccountName"):
        raise KubeRayError(f"--service-account: the template's {where} pods name no serviceAccountName; the pods "
                           f"reach the bucket through it")
    if env:
        container["env"] = [*(container.get("env") or []), *({"name": k, "value": v} for k, v in env.items())]
    resources = container.setdefault("resources", {})
    for key, value, argument in (("cpu", cpus, cpus_arg), ("memory", memory, memory_arg)):
        if value is not None:
            _quantity_bytes(value, argument)
            resources.setdefault("limits", {})[key] = resources.setdefault("requests", {})[key] = value
    shm_volume = _shm_volume(pod, where)
    if shm is not None:
        _quantity_bytes(shm, "--shm-size")
        shm_volume["emptyDir"]["sizeLimit"] = shm
    limit = (resources.get("limits") or {}).get("memory")
    shm_size = shm_volume["emptyDir"].get("sizeLimit")
    if limit and shm_size and _quantity_bytes(shm_size, "--shm-size") >= _quantity_bytes(str(limit), memory_arg):
        raise KubeRayError(f"--shm-size: the {where} pod's /dev/shm ({shm_size}) counts against its memory and must "
                           f"be below it ({memory_arg} {limit})")
    if request.shared_volume is not None:
        pod.setdefault("volumes", []).append(
            {"name": "shared", "persistentVolumeClaim": {"claimName": request.shared_volume.claim}})
        container.setdefault("volumeMounts", []).append(
            {"name": "shared", "mountPath": request.shared_volume.mount_path})


def _shm_volume(pod: dict, where: str) -> dict:
    """The memory-backed emptyDir mounted at /dev/shm (the template must have one)."""
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0].get("volumeMounts") or []}
    for volume in pod.get("volumes") or []:
        if mounts.get(volume["name"]) == "/dev/shm" and (volume.get("emptyDir") or {}).get("medium") == "Memory":
            return volume
    raise KubeRayError(f"--template: the {where} pod has no emptyDir with medium: Memory mounted at /dev/shm "
                       f"(Ray's object store and NCCL/RCCL need it)")


def _quantity_bytes(value: str, argument: str) -> float:
    """A Kubernetes quantity (`64Gi`, `8`, `500m`) as a number: bytes, or cores for a CPU count."""
    match = QUANTITY.match(str(value))
    if not match:
        raise KubeRayError(f"{argument}={value!r} is not a Kubernetes quantity (e.g. 8, 64Gi, 500M)")
    return float(match.group(1)) * QUANTITY_FACTOR[match.group(2)]


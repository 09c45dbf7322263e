"""The KubeRay RayJob manifest (`python -m huginn_ray.cluster rayjob`) and docker/Dockerfile, read as text.

No Kubernetes and no Docker engine here: the manifest's structure, the absence of credentials, and that its
entrypoint passes jobs/train.py's own argument and config parsing are checked; the Dockerfile's stages, versions
and build context are checked against pyproject.toml, the Makefile and the RayJob template.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import ray
import yaml
from packaging.requirements import Requirement

from huginn_ray.cluster.__main__ import main
from huginn_ray.cluster.kuberay import IMAGE_PROJECT_DIR, SECRET_NAME, load_rayjob_template

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / "docker" / "Dockerfile.dockerignore"
BUCKET = "s3://huginn-runs"
OPTIONS = {"--config": "configs/train/tiny_cpu.yaml", "--out-dir": f"{BUCKET}/runs",
           "--image": "registry.example.com/huginn_ray:cuda", "--workers": "2", "--gpus-per-worker": "8",
           "--mlflow-tracking-uri": "http://mlflow.mlflow.svc:5000"}
OVERRIDES = [f"data.data_dir={BUCKET}/data/shards", f"data.tokenizer_path={BUCKET}/data/tokenizer", "max_steps=100"]


def cli(extra: tuple[str, ...] = (), overrides: list[str] = OVERRIDES, **changes: str | None) -> list[str]:
    """The rayjob command line: OPTIONS with `changes` (out_dir="..." sets --out-dir, None drops it), the object
    store's environment, `extra` options, then the overrides."""
    options = {**OPTIONS, **{"--" + key.replace("_", "-"): value for key, value in changes.items()}}
    flat = [item for flag, value in options.items() if value is not None for item in (flag, value)]
    return ["rayjob", *flat, "--env", "AWS_ENDPOINT_URL=http://minio.minio.svc:9000",
            "--env", "AWS_DEFAULT_REGION=us-east-1", *extra, *overrides]


ARGS = cli()
ENV = [{"name": "AWS_ENDPOINT_URL", "value": "http://minio.minio.svc:9000"},
       {"name": "AWS_DEFAULT_REGION", "value": "us-east-1"}]
SHM_MOUNT = {"name": "dshm", "mountPath": "/dev/shm"}


def rendered(capsys, args: list[str]) -> tuple[dict, str]:
    assert main(args) == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    return yaml.safe_load(text), text


def refusal(capsys, args: list[str]) -> str:
    assert main(args) == 2
    return capsys.readouterr().err


def test_rayjob_manifest(capsys):
    manifest, _ = rendered(capsys, ARGS)
    assert (manifest["apiVersion"], manifest["kind"], manifest["metadata"]) == \
        ("ray.io/v1", "RayJob", {"name": "huginn-train"})
    spec = manifest["spec"]
    assert spec["entrypoint"] == (
        f"python {IMAGE_PROJECT_DIR}/jobs/train.py --config {IMAGE_PROJECT_DIR}/configs/train/tiny_cpu.yaml "
        f"data.data_dir={BUCKET}/data/shards data.tokenizer_path={BUCKET}/data/tokenizer max_steps=100 "
        f"out_dir={BUCKET}/runs scaling.num_workers=16 scaling.use_gpu=true "
        f"mlflow.tracking_uri=http://mlflow.mlflow.svc:5000")
    assert {k: spec[k] for k in ("submissionMode", "backoffLimit", "shutdownAfterJobFinishes")} == \
        {"submissionMode": "K8sJobMode", "backoffLimit": 2, "shutdownAfterJobFinishes": True}
    cluster = spec["rayClusterSpec"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"] == {"num-gpus": "0"}
    assert head["template"]["spec"]["serviceAccountName"] == "huginn-train"
    head_container = head["template"]["spec"]["containers"][0]
    assert head_container["image"] == "registry.example.com/huginn_ray:cuda"
    assert head_container["resources"] == {"limits": {"cpu": "8", "memory": "32Gi"},
                                           "requests": {"cpu": "8", "memory": "32Gi"}}
    assert (head_container["env"], head_container["volumeMounts"]) == (ENV, [SHM_MOUNT])
    assert head["template"]["spec"]["volumes"] == [{"name": "dshm",
                                                    "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}]

    [group] = cluster["workerGroupSpecs"]
    assert (group["groupName"], group["replicas"], group["minReplicas"], group["maxReplicas"]) == \
        ("gpu-workers", 2, 2, 2)
    assert group["rayStartParams"] == {"num-gpus": "8"}
    pod = group["template"]["spec"]
    assert pod["serviceAccountName"] == "huginn-train"
    [worker] = pod["containers"]
    assert worker["image"] == "registry.example.com/huginn_ray:cuda"
    assert worker["resources"] == {"limits": {"cpu": "56", "memory": "400Gi", "nvidia.com/gpu": 8},
                                   "requests": {"cpu": "56", "memory": "400Gi"}}
    assert (worker["env"], worker["volumeMounts"]) == (ENV, [SHM_MOUNT])
    assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}]


def test_rayjob_manifest_holds_no_credentials(capsys):
    manifest, text = rendered(capsys, ARGS)
    lowered = text.lower()
    for secret in ("aws_secret", "secret_access_key", "aws_access_key_id", "session_token", "secretkeyref",
                   "password", "@"):
        assert secret not in lowered, secret
    assert not re.search(r"token(?!izer)", lowered)  # data.tokenizer_path is the one "token" allowed
    cluster = manifest["spec"]["rayClusterSpec"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        for variable in group["template"]["spec"]["containers"][0]["env"]:
            assert not SECRET_NAME.search(variable["name"])


def test_rocm_variant_and_a_shared_volume(capsys):
    args = cli(extra=("--variant", "rocm", "--shared-volume", "huginn-shared:/shared", "--worker-memory", "512Gi",
                      "--shm-size", "128Gi"),
               overrides=["data.data_dir=/shared/data/shards", f"data.tokenizer_path={BUCKET}/tokenizer"])
    manifest, _ = rendered(capsys, args)
    [group] = manifest["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    worker = group["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"] == {"cpu": "56", "memory": "512Gi", "amd.com/gpu": 8}
    assert worker["env"][0] == {"name": "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES", "value": "1"}
    assert worker["volumeMounts"] == [SHM_MOUNT, {"name": "shared", "mountPath": "/shared"}]
    assert group["template"]["spec"]["volumes"][1] == {"name": "shared",
                                                       "persistentVolumeClaim": {"claimName": "huginn-shared"}}
    assert group["template"]["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] == "128Gi"


@pytest.mark.parametrize("args,message", [
    (cli(out_dir="/data/runs"), "--out-dir='/data/runs' is not a bucket URI"),
    (cli(workers="0"), "--workers must be a positive integer, got 0"),
    (cli(workers="-2"), "--workers must be a positive integer, got -2"),
    (cli(gpus_per_worker="0"), "--gpus-per-worker must be a positive integer, got 0"),
    (cli(variant="tpu"), "--variant must be one of cpu, cuda, rocm, got 'tpu'"),
    (cli(variant="cpu"), "--gpus-per-worker=8: the cpu variant has no GPUs"),
    (cli(overrides=OVERRIDES[1:]),
     "data.data_dir (--config configs/train/tiny_cpu.yaml or its override)='out/data_demo/shards' is not a bucket"),
    (cli(overrides=[*OVERRIDES, "out_dir=s3://other/runs"]),
     "override 'out_dir=s3://other/runs': the manifest sets out_dir from --out-dir"),
    (cli(mlflow_tracking_uri=None), "--mlflow-tracking-uri is required"),
    (cli(mlflow_tracking_uri="sqlite:///mlflow.db"), "--mlflow-tracking-uri='sqlite:///mlflow.db' must be a server"),
    (cli(extra=("--env", "AWS_SECRET_ACCESS_KEY=abc")), "--env AWS_SECRET_ACCESS_KEY: credentials never go"),
    (cli(extra=("--env", "HF_TOKEN=abc")), "--env HF_TOKEN: credentials never go"),
    (cli(extra=("--env", "AWS_ENDPOINT_URL=https://user:pw@s3.example.com")),
     "--env AWS_ENDPOINT_URL: its value carries credentials (https://user:***@s3.example.com)"),
    (cli(shm_size="400Gi"), "--shm-size: the worker pod's /dev/shm (400Gi) counts against its memory"),
    (cli(config="configs/train/missing.yaml"), "--config configs/train/missing.yaml: no such file"),
])
def test_bad_input_is_refused_naming_the_argument(capsys, args, message):
    assert message in refusal(capsys, args)


def test_a_worker_count_that_is_not_an_integer_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit):
        main(cli(workers="two"))
    assert "argument --workers: invalid int value: 'two'" in capsys.readouterr().err


def train_job_main(capsys, monkeypatch, args: list[str]) -> tuple[int, list, str]:
    """jobs/train.py's main() on the rendered entrypoint's argv (the image's paths mapped to this checkout), with
    the run lock and training stubbed out: (its return code, the configs it would train, its stderr)."""
    manifest, _ = rendered(capsys, args)
    argv = shlex.split(manifest["spec"]["entrypoint"])
    assert argv[:2] == ["python", f"{IMAGE_PROJECT_DIR}/jobs/train.py"]
    in_repo = [arg.replace(IMAGE_PROJECT_DIR, str(REPO)) if arg.startswith(IMAGE_PROJECT_DIR) else arg
               for arg in argv[2:]]
    monkeypatch.setenv("RAY_ADDRESS", "auto")  # as in the pod under `ray job submit`: no local-Ray settings
    spec = importlib.util.spec_from_file_location("train_job", REPO / "jobs" / "train.py")
    train_job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_job)
    accepted = []

    class NoLock:
        def __init__(self, run_dir):
            pass

        def acquire(self):
            return None

        def release(self):
            pass

    monkeypatch.setattr(train_job, "RunLock", NoLock)
    monkeypatch.setattr(train_job, "_run", lambda cfg, verbose: accepted.append(cfg) or 0)
    code = train_job.main(in_repo)
    return code, accepted, capsys.readouterr().err


def test_the_shared_volume_entrypoint_passes_train_py_s_own_parsing(capsys, monkeypatch):
    args = cli(extra=("--shared-volume", "huginn-shared:/shared"), out_dir="/shared/runs",
               overrides=["data.data_dir=/shared/data/shards", "data.tokenizer_path=/shared/data/tokenizer",
                          "max_steps=100"])
    code, accepted, err = train_job_main(capsys, monkeypatch, args)
    assert code == 0, err
    [cfg] = accepted
    assert (cfg.scaling.num_workers, cfg.scaling.use_gpu, cfg.max_steps) == (16, True, 100)
    assert cfg.mlflow.tracking_uri == "http://mlflow.mlflow.svc:5000"
    assert (cfg.out_dir, cfg.data.data_dir, cfg.data.tokenizer_path) == \
        ("/shared/runs", "/shared/data/shards", "/shared/data/tokenizer")


def test_the_bucket_entrypoint_passes_train_py_s_own_parsing(capsys, monkeypatch):
    """The manifest's entrypoint with out_dir, shards and tokenizer in a bucket: jobs/train.py's own parsing
    keeps every URI as it is and would train that configuration."""
    code, accepted, err = train_job_main(capsys, monkeypatch, ARGS)
    assert code == 0, err
    [cfg] = accepted
    assert (cfg.out_dir, cfg.data.data_dir, cfg.data.tokenizer_path, cfg.run_dir) == \
        (f"{BUCKET}/runs", f"{BUCKET}/data/shards", f"{BUCKET}/data/tokenizer", f"{BUCKET}/runs/{cfg.run_name}")
    assert (cfg.scaling.num_workers, cfg.max_steps, cfg.mlflow.tracking_uri) == \
        (16, 100, "http://mlflow.mlflow.svc:5000")


def dockerfile_stages() -> tuple[dict[str, str], dict[str, str], list[tuple[str, list[str]]]]:
    """(ARG defaults, stage -> base image, [(stage, its instructions)]) of docker/Dockerfile."""
    lines = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text()).splitlines()
    instructions = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    args, bases, stages = {}, {}, []
    for instruction in instructions:
        keyword, _, rest = instruction.partition(" ")
        if keyword == "FROM":
            base, _, name = rest.partition(" AS ")
            stages.append((name or "final", []))
            bases[name or "final"] = base
        elif stages:
            stages[-1][1].append(instruction)
        elif keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
    return args, bases, stages


def test_dockerfile_variants_and_versions():
    args, bases, stages = dockerfile_stages()
    assert bases == {"cpu-base": "rayproject/ray:${RAY_VERSION}-py311",
                     "cuda-base": "rayproject/ray:${RAY_VERSION}-py311-gpu",
                     "rocm-base": "${ROCM_BASE}", "final": "${VARIANT}-base"}
    assert args["VARIANT"] in ("cpu", "cuda", "rocm") and args["ROCM_BASE"].startswith("rocm/pytorch:")
    # the image's Ray is the one the suite runs, within pyproject.toml's range, and the RayJob template's rayVersion
    pyproject = (REPO / "pyproject.toml").read_text()
    listed = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.MULTILINE | re.DOTALL).group(1)
    dependencies = [Requirement(r) for r in re.findall(r'^\s+"([^"]+)",', listed, re.MULTILINE)]
    assert {"ray", "torch", "pyarrow", "mlflow"} <= {r.name for r in dependencies}
    [ray_requirement] = [r for r in dependencies if r.name == "ray"]
    assert args["RAY_VERSION"] == ray.__version__ and ray_requirement.specifier.contains(args["RAY_VERSION"])
    assert load_rayjob_template()["spec"]["rayClusterSpec"]["rayVersion"] == args["RAY_VERSION"]
    # torch: the version `make` installs
    assert f"torch=={args['TORCH_VERSION']}" in (REPO / "Makefile").read_text()
    runs = {name: " ".join(i for i in body if i.startswith("RUN ")) for name, body in stages}
    for variant in ("cpu", "cuda"):
        assert '"torch==${TORCH_VERSION}"' in runs[f"{variant}-base"]
    # ROCm: the base's torch, Ray with pyproject.toml's extras
    extras = re.search(r'"ray\[([a-z,]+)\]', pyproject).group(1)
    assert f'"ray[{extras}]==${{RAY_VERSION}}"' in runs["rocm-base"] and "torch.version.hip" in runs["rocm-base"]
    # the project: copied to the entrypoint's directory, installed from its own pyproject.toml (no second list)
    final = dict(stages)["final"]
    assert f"WORKDIR {IMAGE_PROJECT_DIR}" in final and "COPY . ." in final
    assert "pip install --no-cache-dir --constraint /tmp/base_constraints.txt /tmp/huginn_ray_src" in runs["final"]
    named = {r.name for r in dependencies} - {"ray", "torch"}
    for name, run in runs.items():
        assert not [d for d in named if re.search(rf"\b{re.escape(d)}\b", run)], name


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, closely enough for these patterns: a pattern matches the path or one of its parents."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        tails = [pattern[3:]] if pattern.startswith("**/") else []
        for prefix in prefixes:
            if fnmatch.fnmatch(prefix, pattern) or any(fnmatch.fnmatch(prefix.rsplit("/", 1)[-1], t) or
                                                       fnmatch.fnmatch(prefix, t) for t in tails):
                return True
    return False


def test_dockerfile_holds_no_credentials_and_the_context_keeps_the_project():
    text = DOCKERFILE.read_text()
    for keyword in ("ENV", "ARG"):
        for name in re.findall(rf"^{keyword}\s+([A-Za-z_0-9]+)", text, re.MULTILINE):
            assert not SECRET_NAME.search(name), name
    assert not re.search(r"aws_secret|access_key|token|password|\.aws|secret", text.lower())
    patterns = [p for p in DOCKERIGNORE.read_text().splitlines() if p and not p.startswith("#")]
    for local_state in ("out/train_tiny_cpu/LOCK", ".venv/bin/python", "cluster_yamls/site.env", ".git/config",
                        "home/.aws/credentials", "configs/.env"):
        assert dockerignored(local_state, patterns), local_state
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    needed = [p for p in tracked.splitlines() if p.split("/")[0] in ("huginn_ray", "jobs", "configs", "cluster_yamls")
              or p in ("pyproject.toml", "README.md")]
    assert {"huginn_ray/data/tokenizer.py", "jobs/train.py", "configs/train/tiny_cpu.yaml"} <= set(needed)
    assert [p for p in needed if dockerignored(p, patterns)] == []

"""The Frontier environment (reference launch §5) reaches the processes of a Ray Train run.

The test starts Ray exactly as cluster_yamls/frontier.yaml's head does (its own head start commands, after
frontier_env.sh is mounted next to a site.env), then runs a TorchTrainer with two CPU workers that report their
environment, device and process-group backend. Stand-ins: Lmod's `module` command (a shell function that records
what frontier_env.sh loads), the aws-ofi-rccl plugin directory (an empty temp dir), and the --autoscaling-config
flag is dropped (the launcher writes that file on a real head). Ray runs in a network+PID namespace of its own, so
the YAML's fixed ports are free and the `ray stop` among its head commands touches no other Ray.
"""

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from isolation import nested_namespace

REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent.parent

pytestmark = pytest.mark.slow

# §5 of the reference: what every training process on Frontier must see.
FRONTIER_VARIABLES = {
    "HSA_FORCE_FINE_GRAIN_PCIE": "1",
    "FI_CXI_ATS": "0",
    "NCCL_NET_GDR_LEVEL": "3",
    "NCCL_SOCKET_IFNAME": "hsn",
    "NCCL_CROSS_NIC": "1",
    "MPICH_GPU_SUPPORT_ENABLED": "0",
    "OMP_NUM_THREADS": "7",
    "RAY_AUTH_MODE": "token",
    "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1",
}

DRIVER = """
import json, os, sys
import ray, ray.train
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

out_dir = sys.argv[1]
names = sys.argv[2].split(",")

def report_environment():
    import torch.distributed as dist
    from huginn_ray.cluster.devices import distributed_backend, training_device
    context = ray.train.get_context()
    device = training_device()
    record = {
        "env": {name: os.environ.get(name) for name in names},
        "device": str(device),
        "backend": distributed_backend(device),
        "process_group_backend": dist.get_backend() if dist.is_initialized() else None,
        "world_size": context.get_world_size(),
    }
    with open(os.path.join(out_dir, f"rank{context.get_world_rank()}.json"), "w") as f:
        json.dump(record, f)

ray.init(address="auto")
TorchTrainer(
    report_environment,
    scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
    run_config=RunConfig(storage_path=os.path.join(out_dir, "results"), name="env_check"),
).fit()
"""


def _head_start_commands(env_file: Path) -> list[str]:
    """frontier.yaml's head start commands for Ray, with the env file where this test mounted it."""
    template = yaml.safe_load((REPO / "cluster_yamls" / "frontier.yaml").read_text())
    ray_commands = [c for c in template["head_start_ray_commands"] if "ray st" in c]
    assert [c.split("&&")[-1].split()[:2] for c in ray_commands] == [["ray", "stop"], ["ray", "start"]]
    return [
        c.replace("~/.huginn_ray/frontier_env.sh", str(env_file)).replace(
            "--autoscaling-config=~/ray_bootstrap_config.yaml", ""
        )
        for c in ray_commands
    ]


def test_frontier_environment_reaches_ray_train_workers():
    unshare, problem = nested_namespace()
    if problem:
        pytest.skip(f"the cluster needs a network+PID namespace of its own: {problem}")
    work = Path(f"/tmp/hre_{secrets.token_hex(4)}")  # short: Ray's socket paths live below it
    work.mkdir()
    try:
        mounts, plugin = work / "mounts", work / "aws-ofi-rccl"
        mounts.mkdir()
        (plugin / "lib").mkdir(parents=True)
        shutil.copy(REPO / "cluster_yamls" / "frontier_env.sh", mounts / "frontier_env.sh")
        token = work / "auth_token"
        token.write_text(secrets.token_hex(32))
        (mounts / "site.env").write_text(
            f"export HUGINN_SHARED_DIR={work}/shared\nexport HUGINN_VENV={VENV}\n"
            f"export HUGINN_NODE_LOCAL_DIR={work}/node\nexport HUGINN_RCCL_PLUGIN_DIR={plugin}\n"
            f"export RAY_AUTH_TOKEN_PATH={token}\n"
        )
        (work / "node").mkdir()
        (work / "driver.py").write_text(DRIVER)
        names = [*FRONTIER_VARIABLES, "LD_LIBRARY_PATH", "MLFLOW_TRACKING_URI", "TORCHINDUCTOR_CACHE_DIR"]
        script = "\n".join([
            "set -e",
            "ip link set lo up",
            # Stand-in for Lmod: records the modules frontier_env.sh asks for.
            f'module() {{ echo "$@" >> {work}/modules; }}',
            "export -f module",
            "unset RAY_ADDRESS RAY_AUTH_TOKEN",
            *_head_start_commands(mounts / "frontier_env.sh"),
            f"source {mounts}/frontier_env.sh",
            f"python {work}/driver.py {work} {','.join(names)}",
        ])  # no `ray stop` at the end: --kill-child ends every process of the namespace with this script
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "OMP_", "NCCL_"))}
        env["PATH"] = f"{VENV / 'bin'}:{env['PATH']}"
        run = subprocess.run(
            [*unshare, "bash", "-c", script],
            capture_output=True, text=True, env=env, cwd=REPO, timeout=240,
        )
        assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]

        # Sourced three times (ray stop, ray start, the driver), loading the same modules each time.
        modules = "load PrgEnv-gnu/8.5.0 rocm/6.2.0 craype-accel-amd-gfx90a"
        assert (work / "modules").read_text().splitlines() == 3 * [modules]
        records = [json.loads((work / f"rank{rank}.json").read_text()) for rank in (0, 1)]
        for record in records:
            seen = record["env"]
            for name, value in FRONTIER_VARIABLES.items():
                assert seen[name] == value, f"{name} in a Ray Train worker: {seen[name]!r}, expected {value!r}"
            assert seen["LD_LIBRARY_PATH"].split(":")[0] == f"{plugin}/lib"
            assert seen["MLFLOW_TRACKING_URI"] == f"sqlite:///{work}/shared/mlflow/mlflow.db"
            assert seen["TORCHINDUCTOR_CACHE_DIR"] == f"{work}/shared/inductor_cache"
            assert record["device"] == "cpu" and record["backend"] == "gloo"
            assert record["process_group_backend"] == "gloo" and record["world_size"] == 2
    finally:
        shutil.rmtree(work, ignore_errors=True)

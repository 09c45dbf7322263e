"""A Ray that a job starts itself requires a token: its ports listen on every interface, not only loopback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import os, secrets, shutil, subprocess, sys, tempfile
os.environ["RAY_AUTH_MODE"] = "disabled"  # what a careless environment says; the job's own Ray ignores it
import ray
from huginn_ray.cluster.local_ray import init_local_ray
temp_dir = tempfile.mkdtemp(prefix="hra_", dir="/tmp")
info = init_local_ray(num_cpus=1, include_dashboard=False, _temp_dir=temp_dir)
print("WORKER_MODE", ray.get(ray.remote(lambda: os.environ["RAY_AUTH_MODE"]).remote()))
connect = f"import ray; ray.init(address={info.address_info['gcs_address']!r}); print('CONNECTED')"
# a refused client retries once a second for 20 s by default; 3 tries are plenty on loopback (the right token
# connecting under the same budget shows that a refusal is not a timeout)
base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {"RAY_gcs_server_port_wait_time_s": "3"}
for name, extra in (("right", {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.environ["RAY_AUTH_TOKEN"]}),
                    ("none", {"RAY_AUTH_MODE": "disabled"}),
                    ("wrong", {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})):
    client = subprocess.run([sys.executable, "-c", connect], env={**base, **extra}, capture_output=True, text=True,
                            timeout=120)
    print("CLIENT", name, "CONNECTED" in client.stdout)
ray.shutdown()
shutil.rmtree(temp_dir, ignore_errors=True)
"""


@pytest.mark.slow
def test_a_jobs_own_local_ray_refuses_clients_without_its_token():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "RAY_DISABLE_USAGE_STATS": "1"})
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "WORKER_MODE token" in run.stdout
    assert "CLIENT right True" in run.stdout, run.stdout + run.stderr[-3000:]
    assert "CLIENT none False" in run.stdout and "CLIENT wrong False" in run.stdout, run.stdout


def test_head_command_offers_the_gpus_asked_for_else_leaves_them_to_ray():
    from huginn_ray.cluster.local_ray import head_command

    common = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--port=6379",
              "--node-ip-address=127.0.0.1", "--temp-dir=/tmp/hr_x", "--disable-usage-stats",
              "--include-dashboard=true", "--dashboard-host=127.0.0.1"]
    command = head_command("/tmp/hr_x", 6379)
    assert command[:len(common)] == common
    # the other ports are free ones, never Ray's fixed defaults
    ports = dict(arg[2:].split("=") for arg in command[len(common):])
    assert sorted(ports) == ["dashboard-agent-listen-port", "dashboard-port", "ray-client-server-port"]
    assert not {"8265", "52365", "10001"} & set(ports.values())
    assert head_command("/tmp/hr_x", 6379, num_gpus=1)[-1] == "--num-gpus=1"
    assert head_command("/tmp/hr_x", 6379, num_gpus=0)[-1] == "--num-gpus=0"
    assert not any(arg.startswith("--num-gpus") for arg in command)

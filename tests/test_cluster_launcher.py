"""`ray up` / `ray exec` / `ray job submit` / `ray down` on this machine through Ray's on-premise provider.

The cluster is cluster_yamls/local.yaml, rendered like any other template, and reached over real ssh: the test
starts an sshd with throw-away keys inside a network and PID namespace of its own (nested in the one `make test`
runs in), so the cluster's fixed ports (ssh 22, GCS 6379, dashboard 8265, MLflow 5000) are free and the
`ray stop` that the launcher runs cannot touch any other test's Ray. The test's own client commands join only that
namespace's network (nsenter -n). Only the node-local and shared paths differ from a real workstation: they point
into a temp dir, as does the file-mount target (~/.huginn_ray becomes <tmp>/mounts).
"""

import getpass
import hashlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from huginn_ray.cluster.render import load_template, render, to_yaml

from isolation import nested_namespace

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"

pytestmark = pytest.mark.slow

# Run on the head through `ray exec`: the cluster's size, the env file's MLflow store, the MLflow server.
PROBE = """
import os, time, urllib.request
import ray
ray.init(address="auto")
print("NODES", sum(node["Alive"] for node in ray.nodes()))
print("MLFLOW", os.environ["MLFLOW_TRACKING_URI"])
for _ in range(90):
    try:
        print("HEALTH", urllib.request.urlopen("http://127.0.0.1:5000/health", timeout=2).read().decode())
        break
    except OSError:
        time.sleep(1)
"""

# The teardown command of docs/frontier.md, with the env file of local.yaml.
TEARDOWN = 'source {env_file} && kill "$(cat "$HUGINN_NODE_LOCAL_DIR/mlflow.pid")" && ray stop'


def _missing_prerequisite() -> str | None:
    for tool in ("nsenter", "ssh", "ssh-keygen", "rsync"):
        if not shutil.which(tool):
            return f"{tool} is not installed (ray up needs it)"
    if not os.access(SSHD, os.X_OK):
        return "sshd is not installed (tools/ensure_sshd.sh installs openssh-server where it may)"
    if os.geteuid() != 0 or Path("/proc/self/uid_map").read_text().split() != ["0", "0", "4294967295"]:
        # sshd needs /run/sshd and its unprivileged `sshd` user for privilege separation: neither exists for the
        # uid 0 of a user namespace (tools/private_netns.sh as a non-root user maps that user alone)
        return "sshd needs real root (privilege separation): not available to a non-root user, even in a user namespace"
    return nested_namespace()[1]


@pytest.fixture
def sshd_namespace(tmp_path_factory):
    """An sshd on 127.0.0.1:22 inside a fresh namespace; yields (pid of a process in it, workdir, client key)."""
    reason = _missing_prerequisite()
    if reason:
        pytest.skip(reason)
    # Short path: Ray's unix sockets live under the node-local dir and must stay < 107 characters.
    work = Path(f"/tmp/hrl_{secrets.token_hex(4)}")
    work.mkdir(mode=0o700)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", work / "host_key"], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", work / "client_key"], check=True)
    shutil.copy(work / "client_key.pub", work / "authorized_keys")
    (work / "sshd_config").write_text(
        f"ListenAddress 127.0.0.1\nPort 22\nHostKey {work}/host_key\nAuthorizedKeysFile {work}/authorized_keys\n"
        f"PidFile {work}/sshd.pid\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nAllowTcpForwarding yes\nMaxSessions 50\n"
        "MaxStartups 50\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    namespace = subprocess.Popen(
        [*nested_namespace()[0], "bash", "-c",
         f'ip link set lo up && exec {SSHD} -D -e -f "$0"', str(work / "sshd_config")],
        stdout=open(work / "sshd.log", "w"), stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while _in_namespace(namespace.pid, ["bash", "-c", "echo > /dev/tcp/127.0.0.1/22"]).returncode:
            assert namespace.poll() is None, f"sshd exited: {(work / 'sshd.log').read_text()}"
            assert time.monotonic() < deadline, "sshd did not listen within 30 s"
            time.sleep(0.2)
        yield namespace.pid, work, work / "client_key"
    finally:
        namespace.kill()  # --kill-child: the namespace's init dies, and with it every process of the cluster
        namespace.wait()
        shutil.rmtree(work, ignore_errors=True)


def _in_namespace(pid: int, command: list[str], env: dict | None = None, timeout: float = 60):
    return subprocess.run(
        ["nsenter", "-t", str(pid), "-n", *map(str, command)],
        capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO,
    )


def _local_cluster_yaml(work: Path, key: Path) -> tuple[Path, Path]:
    """Render cluster_yamls/local.yaml for this test; returns (cluster yaml, token file)."""
    token = work / "auth_token"
    token.write_text(secrets.token_hex(32))
    site_env = work / "site.env"
    site_env.write_text(
        f"export HUGINN_SHARED_DIR={work}/shared\nexport HUGINN_VENV={VENV_BIN.parent}\n"
        f"export HUGINN_NODE_LOCAL_DIR={work}/node\nexport HUGINN_RCCL_PLUGIN_DIR=\n"
        f"export RAY_AUTH_TOKEN_PATH={token}\n"
    )
    text = (REPO / "cluster_yamls" / "local.yaml").read_text().replace("~/.huginn_ray", f"{work}/mounts")
    (work / "local.yaml").write_text(text)
    template = load_template(work / "local.yaml")
    template["cluster_name"] = f"hr-test-{work.name}"
    template["auth"] = {"ssh_user": "root", "ssh_private_key": str(key)}
    template["file_mounts"][f"{work}/mounts/local_env.sh"] = str(REPO / "cluster_yamls" / "local_env.sh")
    template["file_mounts"][f"{work}/mounts/site.env"] = str(site_env)
    cluster_yaml = work / "cluster.yaml"
    cluster_yaml.write_text(to_yaml(render(template, REPO / "cluster_yamls")))
    return cluster_yaml, token


def _remove_launcher_leftovers(cluster_name: str) -> None:
    """What `ray up` leaves outside the temp dir for this cluster: state, config cache, ssh control dir, and the
    bootstrap files it copies into the head's home (this machine's, here)."""
    for suffix in ("state", "lock"):
        Path(f"/tmp/ray/cluster-{cluster_name}.{suffix}").unlink(missing_ok=True)
    for cached in Path(tempfile.gettempdir()).glob("ray-config-*"):
        if cluster_name in cached.read_text(errors="replace"):
            cached.unlink(missing_ok=True)
    user_hash = hashlib.sha256(getpass.getuser().encode()).hexdigest()[:10]
    cluster_hash = hashlib.sha256(cluster_name.encode()).hexdigest()[:10]
    shutil.rmtree(f"/tmp/ray_ssh_{user_hash}/{cluster_hash}", ignore_errors=True)
    bootstrap = Path.home() / "ray_bootstrap_config.yaml"
    if bootstrap.exists() and cluster_name in bootstrap.read_text(errors="replace"):
        bootstrap.unlink()
        (Path.home() / "ray_bootstrap_key.pem").unlink(missing_ok=True)


def _ray_cli_env(token: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{VENV_BIN}:{env['PATH']}"
    if token is not None:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    return env


def test_ray_up_exec_job_submit_down(sshd_namespace):
    pid, work, key = sshd_namespace
    cluster_yaml, token = _local_cluster_yaml(work, key)
    env = _ray_cli_env(token)
    ray = str(VENV_BIN / "ray")
    try:
        up = _in_namespace(pid, [ray, "up", "-y", "--no-config-cache", cluster_yaml], env=env, timeout=240)
        assert up.returncode == 0, f"ray up failed:\n{up.stdout[-4000:]}\n{up.stderr[-4000:]}"

        # A command on the head through ray exec: the cluster has one node, the env file's settings, and the
        # MLflow server that the head start commands launched answers on the head's loopback.
        (work / "probe.py").write_text(PROBE)
        probe = f"source {work}/mounts/local_env.sh && python {work}/probe.py"
        exec_result = _in_namespace(pid, [ray, "exec", cluster_yaml, probe], env=env, timeout=120)
        out = exec_result.stdout + exec_result.stderr
        assert exec_result.returncode == 0, out[-4000:]
        assert "NODES 1" in out
        assert f"MLFLOW sqlite:///{work}/shared/mlflow/mlflow.db" in out
        assert "HEALTH OK" in out, "the MLflow server on the head did not answer /health"
        assert (work / "shared" / "mlflow" / "mlflow.db").is_file()

        # A job through the dashboard's job API, with the repo as working dir like the real jobs; it reads a
        # variable from the cluster's env file inside a Ray task on the cluster.
        job = (
            "import os, ray; from huginn_ray.cluster.slurm import expand_nodelist; ray.init(); "
            "print('JOB', ray.get(ray.remote(lambda: os.environ['MLFLOW_TRACKING_URI']).remote()), "
            "expand_nodelist('n[1-2]'))"
        )
        submit = [ray, "job", "submit", "--address", "http://127.0.0.1:8265", "--working-dir", ".", "--",
                  "python", "-c", job]
        result = _in_namespace(pid, submit, env=env, timeout=180)
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        assert f"JOB sqlite:///{work}/shared/mlflow/mlflow.db ['n1', 'n2']" in result.stdout

        # Token authentication is on: the same submission with a wrong token is refused.
        wrong = _ray_cli_env(None) | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        refused = _in_namespace(pid, submit, env=wrong, timeout=120)
        assert refused.returncode != 0
        assert "JOB" not in refused.stdout
    finally:
        # `ray down` runs a bare `ray stop` on the head, which a login shell without the venv cannot find:
        # stop Ray and MLflow through the env file first (docs/frontier.md tears down the same way).
        stop = _in_namespace(pid, [ray, "exec", cluster_yaml, TEARDOWN.format(env_file=f"{work}/mounts/local_env.sh")],
                             env=env, timeout=120)
        down = _in_namespace(pid, [ray, "down", "-y", cluster_yaml], env=env, timeout=120)
        _remove_launcher_leftovers(f"hr-test-{work.name}")
    assert stop.returncode == 0, (stop.stdout + stop.stderr)[-4000:]
    assert down.returncode == 0, (down.stdout + down.stderr)[-4000:]
    for port, what in ((6379, "the head's GCS"), (8265, "the dashboard"), (5000, "the MLflow server")):
        listening = _in_namespace(pid, ["bash", "-c", f"echo > /dev/tcp/127.0.0.1/{port}"])
        assert listening.returncode != 0, f"{what} still listens after the teardown"

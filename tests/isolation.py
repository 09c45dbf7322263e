"""Where the tests may start servers, and how they stop what they started.

- `private_namespace_problem()`: None inside the network+PID namespace of tools/private_netns.sh (recognised by
  the namespace ids that script exports, not by guessing from PIDs), else why not.
- `nested_namespace()`: the `unshare` command that gives a test a network+PID namespace of its own (through a
  user namespace when not root), or why there is none here, naming the missing tool.
- `LocalRayHead`: a `ray start --head --block` that the test owns; stopping it ends exactly the processes it
  started (its process group, then any process still carrying its marker in the environment), never a machine-wide
  `ray stop`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

VENV_BIN = Path(sys.executable).parent


def private_namespace_problem() -> str | None:
    unavailable = os.environ.get("HUGINN_PRIVATE_NS_UNAVAILABLE")
    if unavailable:
        return f"tools/private_netns.sh could not make a private namespace: {unavailable}"
    marker = os.environ.get("HUGINN_PRIVATE_NS")
    if not marker:
        return "not run through tools/private_netns.sh (make test), so a Ray head here would not be private"
    here = f"{os.readlink('/proc/self/ns/net')} {os.readlink('/proc/self/ns/pid')}"
    if marker != here:
        return f"HUGINN_PRIVATE_NS={marker!r} is not this process's namespaces ({here})"
    interfaces = [name for _, name in socket.if_nameindex()]
    if interfaces != ["lo"]:
        return f"the private namespace has interfaces besides loopback: {interfaces}"
    return None


_NESTED: tuple[list[str], str | None] | None = None


def nested_namespace() -> tuple[list[str], str | None]:
    """(unshare command prefix, None) or ([], reason). The prefix ends with --kill-child: when its first process
    exits, every process in the namespace dies with it."""
    global _NESTED
    if _NESTED is None:
        missing = [tool for tool in ("unshare", "ip") if not shutil.which(tool)]
        if missing:
            _NESTED = [], f"missing tool(s): {', '.join(missing)} (unshare: util-linux; ip: iproute2)"
        else:
            prefix = ["unshare", "-n", "-p", "-f", "--mount-proc", "--kill-child"]
            if os.geteuid() != 0:
                prefix[1:1] = ["--user", "--map-root-user"]
            probe = subprocess.run([*prefix, "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
            reason = None if probe.returncode == 0 else (
                f"`{' '.join(prefix)}` is not allowed here: {(probe.stderr or probe.stdout).strip()}")
            _NESTED = (prefix if reason is None else []), reason
    return _NESTED


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_session(process: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM to the session a server was started in (start_new_session=True), SIGKILL after `timeout_s`."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=timeout_s)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def wait_for(url: str, seconds: float, alive=lambda: True) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if not alive():
            raise RuntimeError(f"the server behind {url} exited before answering")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not come up in {seconds} s")
        time.sleep(0.3)


HEAD_MARKER = "HUGINN_TEST_RAY_HEAD"


def pids_of_head(temp_dir: str) -> list[int]:
    """PIDs started from one LocalRayHead: its marker is in their environment (inherited by the GCS, raylet,
    workers and submitted jobs), or its temp dir is on their command line. Workers rename themselves (ray::IDLE),
    so the environment is the reliable mark."""
    marker = f"{HEAD_MARKER}={temp_dir}\0".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes() or temp_dir.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


class LocalRayHead:
    """A Ray head node owned by one test (or module): started with --block in a session of its own."""

    def __init__(self, num_cpus: int, env: dict, dashboard: bool = True):
        self.temp_dir = tempfile.mkdtemp(prefix="hr_", dir="/tmp")  # short: Ray's socket paths are limited
        self.port, self.dashboard_port = free_port(), free_port()
        command = [str(VENV_BIN / "ray"), "start", "--head", "--block", f"--port={self.port}",
                   f"--temp-dir={self.temp_dir}", f"--num-cpus={num_cpus}", "--disable-usage-stats",
                   # Ray's fixed defaults (agent 52365, client server 10001) would collide with another Ray on
                   # this loopback, even one still shutting down: its job agent then never registers
                   f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}"]
        if dashboard:
            command += ["--include-dashboard=true", "--dashboard-host=127.0.0.1",
                        f"--dashboard-port={self.dashboard_port}"]
        self.log = open(Path(self.temp_dir) / "ray_start.log", "w")
        self.process = subprocess.Popen(command, env={**env, HEAD_MARKER: self.temp_dir}, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        try:
            if dashboard:
                wait_for(f"{self.dashboard}/api/version", 90, alive=lambda: self.process.poll() is None)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM to `ray start --block` (it stops the head it started), then SIGKILL to its process group and to
        any process still carrying this head's marker (workers Ray put in sessions of their own)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=3)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        deadline = time.monotonic() + 10
        while (pids := pids_of_head(self.temp_dir)) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


class MlflowServer:
    """An `mlflow server` on a free loopback port, in a session of its own: stop() ends exactly its processes."""

    def __init__(self, root: Path, env: dict | None = None):
        self.root, self.port, self.env = Path(root), free_port(), env
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process = None

    def start(self) -> "MlflowServer":
        self.process = subprocess.Popen(
            [str(VENV_BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--default-artifact-root", str(self.root / "artifacts"), "--host", "127.0.0.1", "--port",
             str(self.port), "--workers", "1"],
            stdout=open(self.root / "server.log", "a"), stderr=subprocess.STDOUT, env=self.env,
            start_new_session=True)
        try:
            wait_for(f"{self.uri}/health", 180, alive=lambda: self.process.poll() is None)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.process is None:
            return
        stop_session(self.process, timeout_s=60)  # the server and its uvicorn worker
        try:  # a worker that outlived the server process
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process = None

"""How every job reaches Ray (`connect_ray`): the cluster in RAY_ADDRESS (set by `ray job submit`), else a private
local Ray the job starts for itself (`python jobs/train.py ...`, `jobs/prepare_data.py`).

Ray's GCS and raylet listen on every interface of the machine, whatever --node-ip-address says, and anyone who
reaches an unauthenticated Ray can run code in it. So a Ray that a job starts itself always runs with token
authentication: a fresh random token per job, handed to Ray's processes through the environment only (nothing
written to ~/.ray). An explicit RAY_AUTH_TOKEN in the environment is used instead of a fresh one.

The training and serving jobs' Ray (`LocalRayHead`) runs in a session of its own. `ray.init()` would start the GCS
and raylet in the driver's process group, where a SIGTERM to the job's group (a scheduler ending the job step,
`kill -- -PGID`) kills them together with the driver before the workers could save; in their own session, the
signal reaches only the driver, which asks the workers to save and stop, and then stops Ray itself.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


def require_token_auth() -> None:
    """Turn on Ray token authentication for the Ray this process is about to start (and its workers)."""
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    # Ray caches its config (the auth mode among it) when it is imported; re-read it, as Ray's own
    # enable-token-auth helper does (ray._private.authentication.authentication_token_setup).
    from ray._raylet import Config

    Config.initialize("")


def init_local_ray(*, verbose: bool = False, dashboard: bool = False, **ray_init_kwargs):
    """ray.init of a new local instance with token authentication on and the console settings of
    huginn_ray.console (Ray's own lines to its log files unless `verbose`); `dashboard` for jobs whose Ray Train
    controller queries the state API. Other keyword arguments go to ray.init. Returns ray.init's result."""
    import ray

    from huginn_ray.console import local_ray_init_kwargs, quiet_local_ray

    quiet_local_ray(verbose)  # the workers of this local Ray inherit the settings
    require_token_auth()
    return ray.init(address="local", **{**local_ray_init_kwargs(verbose, dashboard), **ray_init_kwargs})


@dataclass
class RayConnection:
    """The Ray this job's driver is connected to: the cluster in RAY_ADDRESS, or the private local Ray that
    `connect_ray` started (in `temp_dir`; in a session of its own when `head` is set)."""

    temp_dir: str | None = None
    """The private Ray's temp dir, its logs under session_latest/logs; None on a cluster."""
    remove_temp_dir: bool = False
    """Whether `stop` removes temp_dir (connect_ray made it)."""
    head: LocalRayHead | None = None
    """The private Ray's `ray start` in a session of its own (`own_session`), else None."""

    @property
    def local(self) -> bool:
        """Whether the job started this Ray itself (and stops it)."""
        return self.temp_dir is not None

    def stop(self, keep_logs: bool = False) -> None:
        """Disconnect the driver (ray.shutdown); a private Ray is stopped too, and the temp dir connect_ray made for
        it removed unless `keep_logs`."""
        import ray

        ray.shutdown()
        if self.head is not None:
            self.head.stop()
        if self.remove_temp_dir and not keep_logs:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "RayConnection":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def connect_ray(*, verbose: bool = False, own_session: bool = False, cluster_kwargs: dict | None = None,
                temp_dir: str | None = None, temp_prefix: str = "hr_", **local_kwargs) -> RayConnection:
    """Connect this driver to the Ray cluster in RAY_ADDRESS, else start a private local Ray with token
    authentication (Ray listens on every interface) and connect to it.

    `cluster_kwargs` go to ray.init on a cluster. The private Ray runs in `temp_dir` (kept), else in a fresh short
    one under /tmp (other Ray instances may share /tmp/ray, and socket paths are limited; `stop` removes it). With
    `own_session` it is a LocalRayHead in a session of its own (a signal to the job's process group reaches the
    driver alone, which then stops Ray in order), the driver connecting with the console settings of `verbose`;
    else ray.init starts it in this process (`init_local_ray`, without dashboard; `local_kwargs` go to its
    ray.init). When the driver cannot connect to the head it started, the head is stopped and its temp dir kept
    (its logs say why)."""
    import ray

    from huginn_ray.console import ray_connect_kwargs

    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], **(cluster_kwargs or {}))
        return RayConnection()
    connection = RayConnection(temp_dir or tempfile.mkdtemp(prefix=temp_prefix, dir="/tmp"),
                               remove_temp_dir=temp_dir is None)
    if not own_session:
        init_local_ray(verbose=verbose, _temp_dir=connection.temp_dir, **local_kwargs)
        return connection
    connection.head = LocalRayHead(connection.temp_dir, verbose=verbose)
    try:
        ray.init(address=connection.head.address, **ray_connect_kwargs(verbose))
    except BaseException:
        connection.head.stop()
        raise
    return connection


class LocalRayHead:
    """`ray start --head --block` on loopback with token authentication, in a session of its own; `stop()` ends
    its processes (its process group; the workers die with their raylet). `num_gpus`: the GPUs the head offers
    (None: what Ray detects)."""

    def __init__(self, temp_dir: str, verbose: bool = False, startup_timeout_s: float = 120.0,
                 num_gpus: int | None = None):
        from huginn_ray.console import quiet_local_ray

        quiet_local_ray(verbose)  # the head's processes inherit the settings through the environment
        require_token_auth()
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        self.log_path = Path(temp_dir) / "ray_start.log"
        command = head_command(temp_dir, port, num_gpus)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=_terminate_with_parent)
        try:
            self._wait_until_up(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_until_up(self, timeout_s: float) -> None:
        """Until `ray start` says its processes run (its dashboard wants the token, so it is not polled)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if "Ray runtime started." in self.log_path.read_text():
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the job's local Ray head did not start (see {self.log_path}): "
                                   + self.log_path.read_text()[-2000:])
            time.sleep(0.3)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the head's process group (`ray start --block` stops what it started), SIGKILL after
        `timeout_s`."""
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, None)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue


def head_command(temp_dir: str, port: int, num_gpus: int | None = None) -> list[str]:
    """The `ray start` of a LocalRayHead: on loopback, blocking, with its dashboard (Ray Train's controller asks
    the state API, which the dashboard serves, whether it is alive); `--num-gpus` only when num_gpus is given.
    Every other port is a free one, not Ray's fixed default (dashboard 8265, job agent 52365, client server
    10001): another Ray on this machine, even one still shutting down, would hold those, and this head's job
    agent would then never register."""
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
               "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}", "--disable-usage-stats",
               "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={free_port()}",
               f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}"]
    return command + ([f"--num-gpus={num_gpus}"] if num_gpus is not None else [])


def _terminate_with_parent() -> None:
    """In the child before exec: SIGTERM when the driver dies, however it dies (Linux; a no-op elsewhere), so a
    head in its own session is never left behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""One writer per run: a second job on a live run directory is refused by name before Ray starts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from huginn_ray.train.runlock import RunLock, RunLockError, _process_start

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "jobs"))
import train as train_job  # noqa: E402


def write_lock(run_dir: Path, pid: int, host: str | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "LOCK"
    path.write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid, "start": _process_start(pid),
                                "since": "2026-01-01T00:00:00Z"}))
    return path


@pytest.fixture
def live_process():
    process = subprocess.Popen(["sleep", "60"])
    yield process.pid
    process.kill()
    process.wait()


def test_second_writer_is_refused_and_names_the_holder(tmp_path, live_process):
    write_lock(tmp_path / "run", live_process)
    with pytest.raises(RunLockError, match=rf"another job is writing run directory .*run .*PID {live_process}"):
        RunLock(tmp_path / "run").acquire()


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    write_lock(tmp_path / "run", dead.pid)
    lock = RunLock(tmp_path / "run")
    message = lock.acquire()
    assert f"took over the stale lock {tmp_path / 'run' / 'LOCK'}" in message and f"PID {dead.pid}" in message
    assert json.loads((tmp_path / "run" / "LOCK").read_text())["pid"] == lock._record()["pid"]
    lock.release()
    assert not (tmp_path / "run" / "LOCK").exists()


def test_reused_pid_does_not_keep_a_lock(tmp_path, live_process):
    path = write_lock(tmp_path / "run", live_process)
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "start": "1"}))  # same PID, another process's start time
    assert "took over the stale lock" in RunLock(tmp_path / "run").acquire()


def test_lock_of_another_host_is_refused_while_its_heartbeat_is_fresh_then_taken_over(tmp_path):
    path = write_lock(tmp_path / "run", 1, host="other-node-17")
    with pytest.raises(RunLockError, match=rf"other-node-17.*delete {path}"):
        RunLock(tmp_path / "run").acquire()
    old = time.time() - 301  # the holder's allocation ended: no heartbeat for longer than STALE_S
    os.utime(path, (old, old))
    assert "took over the stale lock" in RunLock(tmp_path / "run").acquire()


def test_the_holder_keeps_its_heartbeat(tmp_path):
    lock = RunLock(tmp_path / "run", heartbeat_s=0.1)
    lock.acquire()
    old = time.time() - 1000
    os.utime(lock.path, (old, old))
    time.sleep(0.5)
    assert time.time() - lock.path.stat().st_mtime < 5
    lock.release()


def test_train_job_refuses_a_locked_run_before_ray_starts(tmp_path, live_process, capsys):
    config = REPO / "configs" / "train" / "tiny_cpu.yaml"
    write_lock(tmp_path / "locked", live_process)
    code = train_job.main(["--config", str(config), f"out_dir={tmp_path}", "run_name=locked", "max_steps=2"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"PID {live_process}" in err and "refusing to start a second writer" in err
    assert not ray.is_initialized()
    # the job's own lock goes when it ends, also when it ends early (here: preflight finds no data)
    code = train_job.main(["--config", str(config), f"out_dir={tmp_path}", "run_name=free", "max_steps=2",
                           f"data.data_dir={tmp_path / 'no_data'}"])
    assert code == 2 and "data.data_dir" in capsys.readouterr().err
    assert not (tmp_path / "free" / "LOCK").exists()
